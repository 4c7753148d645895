// The index maps of the wgmma expert GEMM (moe_prefill_wgmma.cu): which physical k of a 128-wide k block each logical
// k position of the MMA holds, and where a (row, logical k) element of the activations lives in a 128-byte-swizzled
// shared-memory stage. Plain C++ that the kernel and the host emulation (tests/unit/backend/cuda/
// moe_wgmma_layout_test.cpp) both compile, so the emulation checks the kernel's own maps.
//
// Why a permutation: the weights are the MMA's A operand, decoded from NVFP4 in registers. Lane t of a quad loads the
// 32 codes [32 t, 32 t + 32) of its two weight rows as one 16-byte load per 128-k block (like moe_experts.cu) and
// decodes code pairs (c, c + 4) of a 32-bit word with one shift (device.cuh, e2m1_pair_bits). The A fragment of
// k-step s (16 logical k) wants, in register 0, logical k 2t and 2t + 1, in register 2 logical k 2t + 8 and 2t + 9.
// So logical k L = 16 s + 8 half + 2 t + e (s = 2 j + h) holds physical k 32 t + 8 j + 2 h + half + 4 e: word j,
// pair (2 h + half, 2 h + half + 4), element e of the pair. The activations (the MMA's B operand, from shared memory)
// are stored in logical order, so both operands agree; gathering x and writing silu(gate) * up apply the map once.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define KILN_WG_HD __host__ __device__
#else
#define KILN_WG_HD
#endif

namespace kiln::cuda::ops::wgmma_layout {

constexpr int kKBlock = 128;  // k per pipeline stage and per lane load (4 lanes x 32 codes)

// The physical k (within a 128-k block) that logical position L holds.
KILN_WG_HD constexpr int phys_k(int L) {
  const int s = L >> 4, kk = L & 15;
  const int j = s >> 1, h = s & 1, half = kk >> 3, t = (kk & 7) >> 1, e = kk & 1;
  return 32 * t + 8 * j + 2 * h + half + 4 * e;
}
// Its inverse: the logical position of physical k p.
KILN_WG_HD constexpr int logical_k(int p) {
  const int t = p >> 5, j = (p & 31) >> 3, c = p & 7;  // c = 2 h + half + 4 e
  const int e = c >> 2, h = (c >> 1) & 1, half = c & 1;
  return 16 * (2 * j + h) + 8 * half + 2 * t + e;
}

// Code index (0..31) within lane t's 32 codes, of k-step s's fragment register half `half` (0: a0/a1, 1: a4/a5),
// element e: word j = s / 2, pair (2 (s % 2) + half, + 4).
KILN_WG_HD constexpr int lane_code(int s, int half, int e) { return 8 * (s >> 1) + 2 * (s & 1) + half + 4 * e; }

// Byte offset of (row n, logical k L in [0, 128)) in a stage of `rows` rows: two 64-k halves of rows x 128 bytes
// (each 1024-byte aligned), 16-byte chunk c of a row stored at chunk c ^ (n % 8): the 128-byte swizzle a wgmma
// shared-memory descriptor of layout type 1 reads (8-row groups 1024 bytes apart).
KILN_WG_HD constexpr uint32_t stage_offset(int n, int L, int rows) {
  const int half = L >> 6, c = (L & 63) >> 3;
  return static_cast<uint32_t>(half * rows * 128 + n * 128 + ((c ^ (n & 7)) << 4) + (L & 7) * 2);
}
// The byte offset (from the stage base) a k-step's descriptor starts at: its half, then 32 bytes per k-step inside.
KILN_WG_HD constexpr uint32_t kstep_offset(int s, int rows) {
  return static_cast<uint32_t>((s >> 2) * rows * 128 + (s & 3) * 32);
}

// Gate/up blocks cover 64 consecutive logical positions of the intermediate dimension (a half of a 128 block): weight
// row m (0..63) of block fb is intermediate feature feature_of(fb, m), and its output lands at logical position
// 64 fb + m, contiguous for the down GEMM's activation rows.
KILN_WG_HD constexpr int gate_up_feature(int fb, int m) {
  const int L = 64 * fb + m;
  return (L / kKBlock) * kKBlock + phys_k(L % kKBlock);
}

// The accumulators of a wgmma m64nNk16 (fp32 D) in a lane (g = lane / 4, q = lane % 4) of warp w of its warpgroup:
// register i holds weight row 16 w + g + 8 ((i % 4) / 2) (of the warpgroup's 64) and column 8 (i / 4) + 2 q + i % 2.
KILN_WG_HD constexpr int acc_row(int warp, int g, int i) { return 16 * warp + g + 8 * ((i & 3) >> 1); }
KILN_WG_HD constexpr int acc_col(int q, int i) { return 8 * (i >> 2) + 2 * q + (i & 1); }

// The walking down GEMM's stores (moe_prefill_wgmma.cu, store_down_block): register pair (i, i + 1), i even, holds
// columns n, n + 1 of one row m; the lane of g ^ 1 (lane ^ 4) holds row m ^ 1 of the same columns. Each lane stores
// two adjacent rows of one column: the even-g lane (n; m, m + 1) with its register i low and the other lane's register
// i high, the odd-g lane (n + 1; m - 1, m) with the other lane's register i + 1 low and its register i + 1 high. So a
// lane hands over register i + 1 (even g) or i (odd g).
struct PairStore {
  int col, row;  // the column, the lower of the two rows
  int own_reg;   // this lane's register in the pair; the other lane's same-numbered register is the other half
  bool own_low;  // whether this lane's value is the lower row (the low bf16)
  int sent_reg;  // the register this lane hands to lane ^ 4
};
KILN_WG_HD constexpr PairStore down_pair_store(int warp, int g, int q, int i) {
  const bool odd = g & 1;
  const int m = acc_row(warp, g, i), n = acc_col(q, i);
  return odd ? PairStore{n + 1, m - 1, i + 1, false, i} : PairStore{n, m, i, true, i + 1};
}

}  // namespace kiln::cuda::ops::wgmma_layout
