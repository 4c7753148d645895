// The gated delta rule in chunks of 64 tokens (the UT-transform form of transformers' torch_chunk_gated_delta_rule,
// as cpu_delta_rule.cpp's chunked_head), for prefill. A block per (sequence, value head, DVT value columns) walks
// its sequence's chunks in order, holding its [Dk, DVT] slice of the state S in shared memory. Accurate expf, no
// fast-math. Two forms of the same kernel (template PARTS = tf32_parts):
//  - PARTS 0: everything in fp32 FMA on the CUDA cores.
//  - PARTS 1 / 3: phases 1, 4 and 5 (the matrix products, ~90% of the FMA form's arithmetic at Dk 128) as
//    mma.sync m16n8k8 with tf32 inputs and fp32 accumulation, issued by all 8 warps with fragments read from the
//    same fp32 shared buffers and converted in registers: 3 parts split each input into tf32 hi + lo (3 mmas per
//    product, fp32-class accuracy), 1 part rounds it once (--dtype bfloat16). The tiles are deltanet_chunked_tiles.h's
//    (every warp the same number of mmas per phase; checked by a host emulation). The solve, gates and decays stay
//    fp32 FMA, as the PARTS 0 form. Shared memory: kqs and vx / o rows 4 floats wider (bank-conflict-free fragment
//    loads; Layout), 5 KB more at Dk 128, within the same per-block limits.
//    Expected (not yet measured): the products stop being the bound: at Dk 128 the FMA form spends ~2.5 ms per
//    layer of an 8192-token pass (~16 TFLOP/s); at 3 parts the mma work is ~3x the FMA count at tensor-core rate,
//    so the kernel should become bound by the solve's barrier-separated steps and global memory, about 2-3x faster.
//
// Per chunk of m <= 64 tokens (rows m..63 are zero-padded: k = q = v = beta = g = 0, so they add nothing), with
// cs_i = g_0 + ... + g_i summed in token order as the CPU does:
//   phase 1   G = [k; q] [k^T | S]        one product over the key dim: k.k, q.k, k S, q S
//             A_ij = beta_i (k_i.k_j) e^(cs_i - cs_j)  (j < i)     P_ij = (q_i.k_j) e^(cs_i - cs_j)  (j <= i)
//             X_i  = beta_i (v_i - e^cs_i k_i S)                   O_i  = e^cs_i q_i S
//   solve     V = (I + A)^-1 X in blocks of 16 rows. This is the CPU's v_new = U - W S: (I + A)^-1 is linear, so
//             (I + A)^-1 (beta v) - (I + A)^-1 (beta k e^cs) S = (I + A)^-1 X.
//   phase 4   out_i = O_i + sum_j P_ij V_j
//   phase 5   S = e^cs_last S + sum_i (k_i e^(cs_last - cs_i)) (outer) V_i
// A, P and the solve depend on k, q and the gates only; every DVT tile of a head recomputes them (the price of
// spreading a head over Dv / DVT blocks, which the short-sequence cases need to fill the GPU).
//
// 256 threads, one block per SM (97 .. 225 KB of shared memory), 8 barriers per chunk. The next chunk's k, q, v
// travel global -> shared by cp.async while this chunk is solved (k and v double-buffered), so only the first
// chunk waits for memory. Every shared buffer is written and read in barrier-separated steps; the host emulation
// that checked this ran each interval's threads in forward, reverse and random order with identical results.
// A bf16 state (DeltaStateRef) is widened to fp32 as it enters shared memory and rounded once, to nearest even, when
// the final state is written back; the chunks in between update the fp32 copy in shared memory.
//
// ---- The split form (deltanet_chunked_split.cu; the default where it serves the call, CudaOptions::delta_rule_split,
// `--disable-delta-rule-split` keeps the kernel above). Measured on an H100 at the 35B-A3B's heads (Hk 16, Hv 32,
// Dk = Dv = 128), one 8192-token pass: the kernel above takes 2.45-2.50 ms per layer, and moving its products to
// tensor cores changed that by 2%: it is bound by the serial per-chunk path (~19 us per chunk x 128 chunks in one wave
// of 128 blocks: 8 barriers, the 16-row block solve, the loads), not by arithmetic. Everything that depends on k, q,
// v and the gates alone moves out of the sequential walk:
//   kernel 1 (preparation), a block per (chunk, value head, sequence), fully parallel (4096 blocks of 256 threads at
//   8192 tokens, two per SM): A and P as phase 1's key tiles; T = (I + A)^-1 explicitly (the diagonal inverses and
//   M_b as above, then T's three sub-diagonals of 16 x 16 blocks, T_bc = -sum_j M_bj T_jc, fp32 FMA); then on tensor
//   cores W = T (beta e^cs k) [64 x Dk] and U = T (beta v) [64 x Dv] (phase 4's tiling, T zero right of the diagonal
//   blocks). W, U, P and cs go to a global workspace (fp32 in every form: the scan's products read them through the
//   same tf32 split as everything else, so a bf16 copy would add a second rounding that tf32_parts 3 does not have,
//   and for 1 part would double the rounding of W and U; kernels.h gated_delta_rule_chunked_workspace_bytes: 41 KiB
//   per token at the 35B-A3B, 323.5 MiB for an 8192-token pass, from the scratch arena, counted by the memory plan).
//   kernel 2 (scan), a block per (sequence, value head, 32 value columns): per chunk X = U - W S (= the V above),
//   out = e^cs q S + P X, S = e^cs_last S + (e^(cs_last - cs) k)^T X, all three products on tensor cores, with two
//   barriers per chunk and no solve; the next chunk's W and q double-buffered, k, P, U each copied while the phase
//   before their readers runs (cp.async groups).
// Expected (not yet measured), per layer at the 35B-A3B, 8192 tokens, tf32_parts 3: kernel 1 moves ~540 MB through
// HBM (reads q, k, v, writes 340 MB of workspace: ~0.17 ms at 3.3 TB/s) and its arithmetic is small, so ~0.25 ms;
// kernel 2 runs 128 blocks x 128 chunks, each chunk 106 mma steps per warp (318 mmas at 3 parts; ~1.5 us at the
// H100's mma.sync rate) and ~120 KB of loads per block from L2 (2 GB in all: ~0.35 ms at ~5.5 TB/s, overlapped by the
// copies), so ~3-4 us per chunk, ~0.45 ms. Together ~0.7-0.8 ms per layer against 2.45 ms: ~3x. tf32_parts 1 does a
// third of the mmas; then the loads bound kernel 2.
#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/deltanet_chunked_mma.cuh"
#include "backend/cuda/deltanet_chunked_split.h"
#include "backend/cuda/deltanet_chunked_tiles.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ptx.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace delta_chunked;  // kChunk, kThreads, kSub, Layout and the tensor-core tiling (deltanet_chunked_tiles.h)

// Starts the copies of one chunk's k (into k set `set`), q and v tile (into vx buffer `set`), zero outside the
// chunk's m tokens, Dk and Dv. Element n of a thread: key dim d = 8 * (tile % (DK / 8)) + lane % 8, token
// i = 4 * (tile / (DK / 8)) + lane / 8 with tile = warp + 8 n: a warp reads 4 tokens x 32 contiguous bytes and
// writes kqs[d][i] to 32 distinct banks.
template <int DK, int DVT, bool TC>
__device__ __forceinline__ void copy_chunk(float* sm, int set, const float* __restrict__ qn,
                                           const float* __restrict__ kn, const float* __restrict__ vp, int tok, int m,
                                           int kh, int Hk, int Dk, int h, int Dv, int64_t ldv, int col0, int tid) {
  using L = Layout<DK, DVT, TC>;
  const int warp = tid >> 5, lane = tid & 31, kc = L::k_col(set);
#pragma unroll 4
  for (int n = 0; n < DK / 4; ++n) {
    const int tile = warp + 8 * n;
    const int d = 8 * (tile % (DK / 8)) + (lane & 7), i = 4 * (tile / (DK / 8)) + (lane >> 3);
    const bool ok = i < m && d < Dk;
    const int64_t off = (int64_t(tok + imin(i, m - 1)) * Hk + kh) * Dk + imin(d, Dk - 1);
    copy_async(sm + L::kqs + d * L::ldk + kc + i, kn + off, ok);
    copy_async(sm + L::kqs + d * L::ldk + L::q_col + i, qn + off, ok);
  }
  float* vx = sm + L::vx + set * kChunk * L::ldv;
#pragma unroll 4
  for (int n = 0; n < DVT / 4; ++n) {
    const int e = tid + kThreads * n, c = e % DVT, i = e / DVT, col = col0 + c;
    const bool ok = i < m && col < Dv;
    copy_async(vx + i * L::ldv + c, vp + int64_t(tok + imin(i, m - 1)) * ldv + int64_t(h) * Dv + imin(col, Dv - 1),
               ok);
  }
}

template <int DK, int DVT, bool TC>
__device__ __forceinline__ void store_gates(float* sm, Gates x, int i) {
  using L = Layout<DK, DVT, TC>;
  sm[L::graw + i] = x.g;
  sm[L::beta + i] = x.beta;
}

// Cumulative log-decay of a chunk, one thread, in token order: the exact sums of the CPU's chunked_head. Padded
// tokens have g = 0, so cs[63] = cs[m - 1].
template <int DK, int DVT, bool TC>
__device__ __forceinline__ void cumulative_decay(float* sm, int half) {
  using L = Layout<DK, DVT, TC>;
  float cum = 0.0f;
  for (int i = 0; i < kChunk; ++i) {
    cum += sm[L::graw + i];
    sm[L::cs + half * kChunk + i] = cum;
  }
}

// Phase 1's product-column block t (32 columns each) as a column of [k^T | S]: key columns 0..63, then state
// columns from 64. Light warps own rows 0..31 of k or q, whose key columns 32..63 lie above the diagonal: they
// skip that block.
template <bool LIGHT>
__device__ __forceinline__ int product_column(int t) {
  if (LIGHT) return t == 0 ? 0 : kChunk + 32 * (t - 1);
  return 32 * t;
}

// Phase 1 for one warp: 16 rows of [k; q] (kqs columns row0 .. row0 + 15 of the warp, 8 per thread) times the
// needed columns of [k^T | S] (2 adjacent columns per 32-column block per thread), then the gating into A / P / X /
// O. Warps 0..3 are light (rows 0..31 of k and of q), warps 4..7 heavy (rows 32..63); warps w and w + 4 share a
// scheduler, so every scheduler gets one of each.
template <int DK, int DVT, bool LIGHT>
__device__ __forceinline__ void chunk_products(float* sm, int set, const float* cs, int warp, int lane) {
  using L = Layout<DK, DVT>;
  constexpr int NT = (LIGHT ? 1 : 2) + DVT / 32;
  const float* kqs = sm + L::kqs;
  const bool is_q = (warp >> 1) & 1;  // warps 2, 3, 6, 7: rows of q
  const int kc = L::k_col(set), i0 = 16 * (warp & 1) + 32 * (warp >> 2) + 8 * (lane >> 4);
  const int row0 = (is_q ? L::q_col : kc) + i0;
  const int g2 = 2 * (lane & 15);
  // kqs column of product column c of [k^T | S]
  auto kqs_col = [&](int c) { return c < kChunk ? kc + c : L::s_col + c - kChunk; };
  float acc[8][2 * NT];
#pragma unroll
  for (int a = 0; a < 8; ++a)
#pragma unroll
    for (int t = 0; t < 2 * NT; ++t) acc[a][t] = 0.0f;

#pragma unroll 4
  for (int d = 0; d < DK; ++d) {
    const float* row = kqs + d * L::ldk;
    const float4 x0 = *reinterpret_cast<const float4*>(row + row0);
    const float4 x1 = *reinterpret_cast<const float4*>(row + row0 + 4);
    const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float2 y = *reinterpret_cast<const float2*>(row + kqs_col(product_column<LIGHT>(t)) + g2);
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        acc[a][2 * t] = fmaf(x[a], y.x, acc[a][2 * t]);
        acc[a][2 * t + 1] = fmaf(x[a], y.y, acc[a][2 * t + 1]);
      }
    }
  }

  // Gating. The masks are selects, never multiplications: above the diagonal e^(cs_i - cs_j) may overflow.
  float* ap = sm + (is_q ? L::p : L::a);
  float* vx = sm + L::vx + set * kChunk * L::ldv;
  float* o = sm + L::o;
  const float* beta = sm + L::beta;
#pragma unroll
  for (int a = 0; a < 8; ++a) {
    const int i = i0 + a;
    const float ci = cs[i], ei = expf(ci), bi = beta[i];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int col = product_column<LIGHT>(t) + g2;
      if (col < kChunk) {  // key columns j: P (q rows) or A (k rows)
        float r[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int j = col + u;
          const float decayed = acc[a][2 * t + u] * expf(ci - cs[j]);
          r[u] = is_q ? (j <= i ? decayed : 0.0f) : (j < i ? bi * decayed : 0.0f);
        }
        *reinterpret_cast<float2*>(ap + i * L::lda + col) = make_float2(r[0], r[1]);
      } else if (is_q) {  // state columns, q rows: O
        *reinterpret_cast<float2*>(o + i * L::ldv + col - kChunk) =
            make_float2(ei * acc[a][2 * t], ei * acc[a][2 * t + 1]);
      } else {  // state columns, k rows: X, in place of v
        float2* x = reinterpret_cast<float2*>(vx + i * L::ldv + col - kChunk);
        const float2 vv = *x;
        *x = make_float2(bi * (vv.x - ei * acc[a][2 * t]), bi * (vv.y - ei * acc[a][2 * t + 1]));
      }
    }
    // The skipped block is zero. No reader looks there (the solve reads A at and left of the diagonal blocks,
    // phase 4 stops at the diagonal block), but A and P stay what their names say.
    if (LIGHT) *reinterpret_cast<float2*>(ap + i * L::lda + 32 + g2) = make_float2(0.0f, 0.0f);
  }
}

// ---- the tensor-core products (tf32_parts 1 or 3): phases 1, 4 and 5 as mma.m16n8k8 with tf32 inputs and fp32
// accumulation, every fragment read from the fp32 shared buffers and converted in registers (split_tf32 / mma_step:
// deltanet_chunked_mma.cuh). The tiles of each warp and the fragment layout are deltanet_chunked_tiles.h's (checked
// there by a host emulation).

// Phase 1 on tensor cores for one warp: its 5 key tiles and DVT / 8 state tiles of G (p1_tile), then the same gating
// into A / P / X / O as chunk_products, element by element at the accumulator fragment's coordinates.
template <int DK, int DVT, int PARTS>
__device__ __forceinline__ void chunk_products_tc(float* sm, int set, const float* cs, int warp, int lane) {
  using L = Layout<DK, DVT, true>;
  constexpr int NJ = p1_tiles(DVT);
  const int row_x = p1_row_x(warp), row_y = p1_row_y(warp);
  float acc[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

#pragma unroll 2
  for (int k0 = 0; k0 < DK; k0 += 8) {
    Tf32<PARTS> ax[4], ay[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Coord f = a_frag(lane, e);
      ax[e] = split_tf32<PARTS>(sm[p1_a_offset<L>(set, row_x + f.row, k0 + f.col)]);
    }
    if (row_y != row_x) {  // warp-uniform
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const Coord f = a_frag(lane, e);
        ay[e] = split_tf32<PARTS>(sm[p1_a_offset<L>(set, row_y + f.row, k0 + f.col)]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) ay[e] = ax[e];
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const Tile t = p1_tile(warp, j);
      const bool y = p1_uses_y(warp, j);
      Tf32<PARTS> a[4], b[2];
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = y ? ay[e] : ax[e];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const Coord f = b_frag(lane, e);
        b[e] = split_tf32<PARTS>(sm[p1_b_offset<L>(set, k0 + f.row, t.col + f.col)]);
      }
      mma_step<PARTS>(acc[j], a, b);
    }
  }

  // Gating, as chunk_products: selects, never multiplications, for the masks.
  float* vx = sm + L::vx + set * kChunk * L::ldv;
  float* o = sm + L::o;
  const float* beta = sm + L::beta;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const Tile t = p1_tile(warp, j);
    const bool is_q = t.row >= kChunk;  // tile-uniform, as is key vs state column
    float* ap = sm + (is_q ? L::p : L::a);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // accumulators 2 h, 2 h + 1: one row, two adjacent columns
      const Coord f = c_frag(lane, 2 * h);
      const int i = (t.row + f.row) & (kChunk - 1), col = t.col + f.col;
      const float ci = cs[i], bi = beta[i], g0 = acc[j][2 * h], g1 = acc[j][2 * h + 1];
      if (col < kChunk) {  // key columns j: P (q rows) or A (k rows)
        float r[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int jj = col + u;
          const float decayed = (u ? g1 : g0) * expf(ci - cs[jj]);
          r[u] = is_q ? (jj <= i ? decayed : 0.0f) : (jj < i ? bi * decayed : 0.0f);
        }
        *reinterpret_cast<float2*>(ap + i * L::lda + col) = make_float2(r[0], r[1]);
      } else if (is_q) {  // state columns, q rows: O
        const float ei = expf(ci);
        *reinterpret_cast<float2*>(o + i * L::ldv + col - kChunk) = make_float2(ei * g0, ei * g1);
      } else {  // state columns, k rows: X, in place of v
        const float ei = expf(ci);
        float2* x = reinterpret_cast<float2*>(vx + i * L::ldv + col - kChunk);
        const float2 vv = *x;
        *x = make_float2(bi * (vv.x - ei * g0), bi * (vv.y - ei * g1));
      }
    }
  }
  // Key columns right of row tile x's last needed tile are zero (no reader looks there; A and P stay what their
  // names say). Every row tile is one warp's x.
  {
    const int first = p1_first_unneeded_col(row_x), width = kChunk - first;
    float* z = sm + (row_x >= kChunk ? L::p : L::a) + (row_x & (kChunk - 1)) * L::lda + first;
    for (int e = lane; e < 16 * width; e += 32) z[(e / width) * L::lda + e % width] = 0.0f;
  }
}

// Phase 4 on tensor cores: out = O + P V for the warp's 2 row tiles x DVT / 32 column tiles (p4_tile), rows < m and
// columns < `cols` stored to out0 (the chunk's row 0 at this block's first column; rows ld elements apart).
template <int DK, int DVT, int PARTS>
__device__ __forceinline__ void chunk_output_tc(const float* sm, int set, int warp, int lane, float* out0, int64_t ld,
                                                int m, int cols) {
  using L = Layout<DK, DVT, true>;
  constexpr int NU = p4_col_tiles(DVT);
  float acc[2][NU][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const Tile t = p4_tile(warp, mi, u);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const Coord f = c_frag(lane, e);
        acc[mi][u][e] = sm[p4_o_offset<L>(t.row + f.row, t.col + f.col)];
      }
    }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    const int row = p4_tile(warp, mi, 0).row, kend = p4_k_end(row);  // P is zero right of the row tile's end
#pragma unroll 2
    for (int k0 = 0; k0 < kend; k0 += 8) {
      Tf32<PARTS> a[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const Coord f = a_frag(lane, e);
        a[e] = split_tf32<PARTS>(sm[p4_a_offset<L>(row + f.row, k0 + f.col)]);
      }
#pragma unroll
      for (int u = 0; u < NU; ++u) {
        const Tile t = p4_tile(warp, mi, u);
        Tf32<PARTS> b[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const Coord f = b_frag(lane, e);
          b[e] = split_tf32<PARTS>(sm[v_offset<L>(set, k0 + f.row, t.col + f.col)]);
        }
        mma_step<PARTS>(acc[mi][u], a, b);
      }
    }
  }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const Tile t = p4_tile(warp, mi, u);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const Coord f = c_frag(lane, e);
        const int i = t.row + f.row, c = t.col + f.col;
        if (i < m && c < cols) out0[int64_t(i) * ld + c] = acc[mi][u][e];
      }
    }
}

// Phase 5 on tensor cores: S = e^cs_last S + K' V for the warp's row tile x p5_col_tiles column tiles (p5_tile);
// K' is the k set scaled by e^(cs_last - cs_i). Each S element is read and written by the one lane that owns it.
template <int DK, int DVT, int PARTS>
__device__ __forceinline__ void state_update_tc(float* sm, int set, float decay, int warp, int lane) {
  using L = Layout<DK, DVT, true>;
  constexpr int NT = p5_col_tiles(DK, DVT);
  const int row = p5_tile(warp, 0, DK, DVT).row;
  float acc[NT][4];
#pragma unroll
  for (int u = 0; u < NT; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[u][e] = 0.0f;
#pragma unroll 2
  for (int k0 = 0; k0 < kChunk; k0 += 8) {
    Tf32<PARTS> a[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Coord f = a_frag(lane, e);
      a[e] = split_tf32<PARTS>(sm[p5_a_offset<L>(set, row + f.row, k0 + f.col)]);
    }
#pragma unroll
    for (int u = 0; u < NT; ++u) {
      const Tile t = p5_tile(warp, u, DK, DVT);
      Tf32<PARTS> b[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const Coord f = b_frag(lane, e);
        b[e] = split_tf32<PARTS>(sm[v_offset<L>(set, k0 + f.row, t.col + f.col)]);
      }
      mma_step<PARTS>(acc[u], a, b);
    }
  }
#pragma unroll
  for (int u = 0; u < NT; ++u) {
    const Tile t = p5_tile(warp, u, DK, DVT);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Coord f = c_frag(lane, e);
      float* sp = sm + p5_s_offset<L>(t.row + f.row, t.col + f.col);
      *sp = fmaf(*sp, decay, acc[u][e]);
    }
  }
}

template <int DK, int DVT, int PARTS>
__global__ void __launch_bounds__(kThreads, 1)
    delta_rule_chunked_kernel(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ v,
                              const float* __restrict__ g, const float* __restrict__ beta, DeltaStateRef state,
                              int Hk, int Hv, int Dk, int Dv, int64_t ldv, StepArgs step, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  constexpr bool TC = PARTS > 0;  // the tensor-core layout (Layout's strides)
  using L = Layout<DK, DVT, TC>;
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  float* kqs = sm + L::kqs;
  float* am = sm + L::a;
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * DVT;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kh = h / (Hv / Hk);
  const int tok0 = step.seq_token_begin[s], n = step.seq_token_begin[s + 1] - tok0;
  if (n <= 0) return;  // whole block
  const int64_t S0 = (int64_t(step.seq_state_slot[s]) * Hv + h) * Dk * Dv;  // this head's state, in elements

  // Chunk 0's inputs and the state slice (zero outside Dk x Dv), then chunk 0's cumulative decay. An fp32 state
  // travels by cp.async; a bf16 one through registers, widened to fp32 (visible after the barrier below).
  copy_chunk<DK, DVT, TC>(sm, 0, qn, kn, v, tok0, imin(kChunk, n), kh, Hk, Dk, h, Dv, ldv, col0, tid);
#pragma unroll 4
  for (int n2 = 0; n2 < DK * DVT / kThreads; ++n2) {
    const int e = tid + kThreads * n2, d = e / DVT, c = e % DVT, col = col0 + c;
    const bool ok = d < Dk && col < Dv;
    const int64_t at = S0 + int64_t(imin(d, Dk - 1)) * Dv + imin(col, Dv - 1);
    if (state.bf16)
      kqs[d * L::ldk + L::s_col + c] = ok ? dev::load_state(state, at) : 0.0f;
    else
      copy_async(kqs + d * L::ldk + L::s_col + c, static_cast<const float*>(state.data) + at, ok);
  }
  if (tid < kChunk) store_gates<DK, DVT, TC>(sm, load_gates(g, beta, tok0, imin(kChunk, n), h, Hv, tid), tid);
  wait_copies();
  __syncthreads();
  if (tid == kThreads - 1) cumulative_decay<DK, DVT, TC>(sm, 0);

  int ci = 0;
  for (int c0 = 0; c0 < n; c0 += kChunk, ++ci) {
    const int m = imin(kChunk, n - c0), set = ci & 1;
    const bool has_next = c0 + kChunk < n;  // block-uniform, as every branch around a barrier below
    const int next_tok = tok0 + c0 + kChunk, next_m = has_next ? imin(kChunk, n - c0 - kChunk) : 0;
    const float* cs = sm + L::cs + set * kChunk;
    float* vx = sm + L::vx + set * kChunk * L::ldv;
    float* kcur = kqs + L::k_col(set);
    Gates next_gates{0.0f, 0.0f};  // warps 2 and 3: the next chunk's, stored after phase 1
    if (has_next && (warp >> 1) == 1) next_gates = load_gates(g, beta, next_tok, next_m, h, Hv, tid - 64);
    __syncthreads();  // k set `set`, q, S, vx `set`, beta and cs hold this chunk

    // ---- phase 1: A, P, X, O; and e^(cs_last - cs_i) for phase 5
    if constexpr (PARTS > 0)
      chunk_products_tc<DK, DVT, PARTS>(sm, set, cs, warp, lane);
    else if (warp < 4)
      chunk_products<DK, DVT, true>(sm, set, cs, warp, lane);
    else
      chunk_products<DK, DVT, false>(sm, set, cs, warp, lane);
    if (tid < kChunk) sm[L::dec + tid] = expf(cs[kChunk - 1] - cs[tid]);
    __syncthreads();

    // ---- the next chunk's copies start (q is free now; k and v go to the other set), waited for at the end of
    // this chunk. Diagonal inverses; the next chunk's gates; this chunk's k scaled by e^(cs_last - cs_i), which
    // phase 5 alone reads from here on.
    if (has_next) copy_chunk<DK, DVT, TC>(sm, set ^ 1, qn, kn, v, next_tok, next_m, kh, Hk, Dk, h, Dv, ldv, col0, tid);
    if (warp < 2) {
      diagonal_inverse<L>(sm, tid);
    } else if (warp < 4) {
      if (has_next) store_gates<DK, DVT, TC>(sm, next_gates, tid - 64);
    } else {
#pragma unroll 4
      for (int n2 = 0; n2 < DK / 2; ++n2) {
        const int e = tid - 128 + 128 * n2, d = e / kChunk, i = e % kChunk;
        kcur[d * L::ldk + i] *= sm[L::dec + i];
      }
    }
    __syncthreads();

    // ---- Z_b = T_bb X_b (all four blocks) and M_b = T_bb A_b,<b (blocks 1..3, in place in A), one 16-row column
    // per thread; the next chunk's cumulative decay by the last thread.
    {
      constexpr int kZ = 4 * DVT, kSegs = kZ + 16 + 32 + 48;
      for (int seg = tid; seg < kSegs; seg += kThreads) {
        if (seg < kZ) {
          const int b = seg / DVT, c = seg % DVT;
          apply_block_inverse(vx + kSub * b * L::ldv + c, L::ldv, sm + L::tbb + b * kSub * kSub);
        } else {
          const int mseg = seg - kZ, b = mseg < 16 ? 1 : (mseg < 48 ? 2 : 3), j = mseg - 8 * b * (b - 1);
          apply_block_inverse(am + kSub * b * L::lda + j, L::lda, sm + L::tbb + b * kSub * kSub);
        }
      }
      if (has_next && tid == kThreads - 1) cumulative_decay<DK, DVT, TC>(sm, set ^ 1);
    }
    __syncthreads();

    // ---- V_b = Z_b - M_b V_<b, block by block (V_0 = Z_0). Each thread owns DVT / 16 elements of the block.
#pragma unroll
    for (int b = 1; b < 4; ++b) {
      const int c = tid % DVT;
#pragma unroll 1
      for (int qq = 0; qq < DVT / 16; ++qq) {
        const int r = kSub * b + tid / DVT + qq * (kThreads / DVT);
        const float* mrow = am + r * L::lda;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kSub * b; j += 4) {
          const float4 mm = *reinterpret_cast<const float4*>(mrow + j);
          acc = fmaf(mm.x, vx[(j + 0) * L::ldv + c], acc);
          acc = fmaf(mm.y, vx[(j + 1) * L::ldv + c], acc);
          acc = fmaf(mm.z, vx[(j + 2) * L::ldv + c], acc);
          acc = fmaf(mm.w, vx[(j + 3) * L::ldv + c], acc);
        }
        vx[r * L::ldv + c] -= acc;
      }
      __syncthreads();
    }

    // ---- phase 4: out = O + P V. On tensor cores: chunk_output_tc. On the CUDA cores: warp w owns rows 8w .. 8w + 7
    // (P is zero right of the diagonal, so j stops at 8w + 8); a thread 8 / (32 / (DVT / 4)) rows x 4 columns.
    if constexpr (PARTS > 0) {
      chunk_output_tc<DK, DVT, PARTS>(sm, set, warp, lane, out + (int64_t(tok0 + c0) * Hv + h) * Dv + col0,
                                      int64_t(Hv) * Dv, m, Dv - col0);
    } else {
      constexpr int NCG = DVT / 4, RGW = 32 / NCG, TR = 8 / RGW;
      const int cg = lane % NCG, rl = lane / NCG;
      const float* pm = sm + L::p;
      float acc[TR][4];
#pragma unroll
      for (int q = 0; q < TR; ++q) {
        const float4 oo = *reinterpret_cast<const float4*>(sm + L::o + (8 * warp + rl + RGW * q) * L::ldv + 4 * cg);
        acc[q][0] = oo.x;
        acc[q][1] = oo.y;
        acc[q][2] = oo.z;
        acc[q][3] = oo.w;
      }
      const int jend = 8 * warp + 8;
#pragma unroll 2
      for (int j = 0; j < jend; j += 4) {
        float4 vv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) vv[u] = *reinterpret_cast<const float4*>(vx + (j + u) * L::ldv + 4 * cg);
#pragma unroll
        for (int q = 0; q < TR; ++q) {
          const float4 pp = *reinterpret_cast<const float4*>(pm + (8 * warp + rl + RGW * q) * L::lda + j);
          const float pu[4] = {pp.x, pp.y, pp.z, pp.w};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            acc[q][0] = fmaf(pu[u], vv[u].x, acc[q][0]);
            acc[q][1] = fmaf(pu[u], vv[u].y, acc[q][1]);
            acc[q][2] = fmaf(pu[u], vv[u].z, acc[q][2]);
            acc[q][3] = fmaf(pu[u], vv[u].w, acc[q][3]);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < TR; ++q) {
        const int r = 8 * warp + rl + RGW * q;
        if (r < m) {
          float* op = out + (int64_t(tok0 + c0 + r) * Hv + h) * Dv + col0 + 4 * cg;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (col0 + 4 * cg + e < Dv) op[e] = acc[q][e];
        }
      }
    }

    // ---- phase 5: S = e^cs_last S + (k e^(cs_last - cs))^T V, no barrier after phase 4: it reads neither S nor k.
    // On tensor cores: state_update_tc. On the CUDA cores: warps tile (8 TD key dims) x (16 value columns); a thread
    // owns key dims 8 TD wd + 8 r + lane % 8 (r < TD), so each float4 read of k covers 8 consecutive kqs rows, and 4
    // columns.
    if constexpr (PARTS > 0) {
      state_update_tc<DK, DVT, PARTS>(sm, set, expf(cs[kChunk - 1]), warp, lane);
    } else {
      constexpr int WC = DVT / 16, WD = 8 / WC, TD = DK / (8 * WD);
      static_assert(TD >= 1 && TD * 8 * WD == DK, "phase 5 tiling");
      const int dl = lane & 7, c = 16 * (warp / WD) + 4 * (lane >> 3), dbase = 8 * TD * (warp % WD) + dl;
      float acc[TD][4];
#pragma unroll
      for (int r = 0; r < TD; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][e] = 0.0f;
#pragma unroll 2
      for (int i = 0; i < kChunk; i += 4) {
        float4 vv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) vv[u] = *reinterpret_cast<const float4*>(vx + (i + u) * L::ldv + c);
#pragma unroll
        for (int r = 0; r < TD; ++r) {
          const float4 kk = *reinterpret_cast<const float4*>(kcur + (dbase + 8 * r) * L::ldk + i);
          const float ku[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            acc[r][0] = fmaf(ku[u], vv[u].x, acc[r][0]);
            acc[r][1] = fmaf(ku[u], vv[u].y, acc[r][1]);
            acc[r][2] = fmaf(ku[u], vv[u].z, acc[r][2]);
            acc[r][3] = fmaf(ku[u], vv[u].w, acc[r][3]);
          }
        }
      }
      const float decay = expf(cs[kChunk - 1]);
#pragma unroll
      for (int r = 0; r < TD; ++r) {
        float4* sp = reinterpret_cast<float4*>(kqs + (dbase + 8 * r) * L::ldk + L::s_col + c);
        const float4 s0 = *sp;
        *sp = make_float4(fmaf(s0.x, decay, acc[r][0]), fmaf(s0.y, decay, acc[r][1]), fmaf(s0.z, decay, acc[r][2]),
                          fmaf(s0.w, decay, acc[r][3]));
      }
    }
    wait_copies();    // the next chunk's k, q, v have landed (this thread's copies) ...
    __syncthreads();  // ... everyone's, and every read of this chunk's buffers is done
  }

  // The loop's last barrier published the final state.
#pragma unroll 4
  for (int n2 = 0; n2 < DK * DVT / kThreads; ++n2) {
    const int e = tid + kThreads * n2, d = e / DVT, c = e % DVT, col = col0 + c;
    if (d < Dk && col < Dv) dev::store_state(state, S0 + int64_t(d) * Dv + col, kqs[d * L::ldk + L::s_col + c]);
  }
}

}  // namespace

namespace {

int key_tile(int64_t Dk) { return chunk_key_tile(Dk); }

template <bool TC>
size_t layout_bytes(int dk, int dvt) {
  switch (dk * 1000 + dvt) {
    case 32032: return Layout<32, 32, TC>::bytes;
    case 32064: return Layout<32, 64, TC>::bytes;
    case 64032: return Layout<64, 32, TC>::bytes;
    case 64064: return Layout<64, 64, TC>::bytes;
    case 128032: return Layout<128, 32, TC>::bytes;
    case 128064: return Layout<128, 64, TC>::bytes;
    default: return ~size_t{0};
  }
}
// The block's shared memory for either kernel (the tensor-core layout's wider pads: Layout); the support check and
// the tile choice use the larger, so that both kernels serve the same shapes.
size_t shared_bytes(int dk, int dvt) { return std::max(layout_bytes<false>(dk, dvt), layout_bytes<true>(dk, dvt)); }

// An attribute of the current device, or `fallback` when it cannot be read (the failed call's error is cleared so
// that a later KILN_CUDA_CHECK_LAUNCH does not report it).
int device_attribute(cudaDeviceAttr attr, int fallback) {
  int dev = 0, value = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&value, attr, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return fallback;
  }
  return value;
}

// Value columns per block. 32 spreads a head over more blocks (the short-step case: 1 sequence x 32 heads x 4
// tiles fills an H200's 132 SMs once); 64 costs about 1.5x the time per block for 2x the columns (phase 1's shared
// k.k / q.k columns are amortised over more value columns), which wins once the 32-column grid needs more waves.
int value_tile(int64_t Dv, int64_t Hv, int num_seqs, int dk) {
  if (Dv <= 32 || shared_bytes(dk, 64) > size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 0)))
    return 32;
  const int64_t sms = device_attribute(cudaDevAttrMultiProcessorCount, 132);
  const int64_t blocks32 = int64_t(num_seqs) * Hv * ((Dv + 31) / 32);
  const int64_t blocks64 = int64_t(num_seqs) * Hv * ((Dv + 63) / 64);
  const int64_t waves32 = (blocks32 + sms - 1) / sms, waves64 = (blocks64 + sms - 1) / sms;  // one block per SM
  return 3 * waves64 < 2 * waves32 ? 64 : 32;
}

template <int DK, int DVT, int PARTS>
void launch(const float* qn, const float* kn, const float* v, const float* g, const float* beta, DeltaStateRef state,
            int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t ldv, const StepArgs& step, float* out,
            cudaStream_t stream) {
  constexpr size_t bytes = Layout<DK, DVT, (PARTS > 0)>::bytes;
  auto kernel = delta_rule_chunked_kernel<DK, DVT, PARTS>;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  const dim3 grid(static_cast<unsigned>(step.num_seqs), static_cast<unsigned>(Hv),
                  static_cast<unsigned>((Dv + DVT - 1) / DVT));
  launch_kernel(kernel, grid, kThreads, bytes, stream, qn, kn, v, g, beta, state, static_cast<int>(Hk), static_cast<int>(Hv),
                                            static_cast<int>(Dk), static_cast<int>(Dv), ldv, step, out);
  KILN_CUDA_CHECK_LAUNCH();
}

// The kernel of one tile shape for tf32_parts 0 (FMA), 1 or 3 (tensor cores).
template <int DK, int DVT>
void launch_parts(int tf32_parts, const float* qn, const float* kn, const float* v, const float* g, const float* beta,
                  DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t ldv,
                  const StepArgs& step, float* out, cudaStream_t stream) {
  switch (tf32_parts) {
    case 0: launch<DK, DVT, 0>(qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
    case 1: launch<DK, DVT, 1>(qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
    default: launch<DK, DVT, 3>(qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
  }
}

}  // namespace

// The split form's workspace (SplitWorkspace: W, U, P, cs per chunk row; rows = T + 64 S). For the 35B-A3B (Hv 32,
// Dk = Dv = 128) and one 8192-token sequence: 339,222,528 bytes (323.5 MiB, 41 KiB per token).
size_t gated_delta_rule_chunked_workspace_bytes(int64_t T, int64_t Hv, int64_t Dk, int64_t Dv, const StepArgs& step) {
  if (T <= 0 || step.num_seqs <= 0) return 0;
  return static_cast<size_t>(split_workspace(T, step.num_seqs, Hv, Dk, Dv).floats) * sizeof(float);
}

bool gated_delta_rule_chunked_split_supported(int64_t Hv, int64_t Dk, int64_t Dv, const StepArgs& step,
                                              int tf32_parts) {
  if (tf32_parts != 1 && tf32_parts != 3) return false;
  if (step.num_seqs > 65535 || Hv > 65535 || !gated_delta_rule_chunked_supported(Dk, Dv)) return false;
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, 0) < 8) return false;
  return delta_rule_split_shared_bytes(Dk) <= size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
}

bool gated_delta_rule_chunked_supported(int64_t Dk, int64_t Dv) {
  if (Dk < 1 || Dk > 128 || Dv < 1 || Dv > 65535 * 32) return false;
  return shared_bytes(key_tile(Dk), 32) <= size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
}

void gated_delta_rule_chunked(const float* qn, const float* kn, const float* v, const float* g, const float* beta,
                              DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t ldv,
                              const StepArgs& step, float* out, void* workspace, cudaStream_t stream,
                              int tf32_parts) {
  if (step.num_tokens == 0 || step.num_seqs == 0) return;
  if (!gated_delta_rule_chunked_supported(Dk, Dv))
    cuda_fail("chunked gated delta rule: head dims Dk {} Dv {} are not supported here", {Dk, Dv});
  if (tf32_parts != 0 && tf32_parts != 1 && tf32_parts != 3)
    cuda_fail("chunked gated delta rule: tf32_parts {} (0: fp32 FMA, 1 or 3: tensor cores)", {int64_t(tf32_parts)});
  if (tf32_parts != 0 && device_attribute(cudaDevAttrComputeCapabilityMajor, 0) < 8)
    cuda_fail("chunked gated delta rule: the tensor-core kernel needs sm_80 or newer (tf32 mma); pass tf32_parts 0");
  if (workspace && gated_delta_rule_chunked_split_supported(Hv, Dk, Dv, step, tf32_parts)) {
    gated_delta_rule_chunked_split(qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, workspace, stream,
                                   tf32_parts);
    return;
  }
  const int dk = key_tile(Dk), dvt = value_tile(Dv, Hv, step.num_seqs, dk);
  switch (dk * 1000 + dvt) {
    case 32032: launch_parts<32, 32>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
    case 32064: launch_parts<32, 64>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
    case 64032: launch_parts<64, 32>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
    case 64064: launch_parts<64, 64>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
    case 128032: launch_parts<128, 32>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
    default: launch_parts<128, 64>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, stream); break;
  }
}

}  // namespace kiln::cuda::ops
