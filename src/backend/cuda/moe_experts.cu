// CudaOps routed experts with NVFP4 weights on tensor cores over fp32 activations (mma.sync m16n8k16, bf16 in, fp32
// accumulate), any number of rows.
//
// Hopper has no FP4 MMA, so NVFP4 codes are decoded to bf16 in registers: e2m1 * e4m3 block scale is exact in bf16
// (at most 6 significant bits; the 2^118 / 2^-8 bookkeeping of device.cuh keeps it in range). The fp32
// activations are split into kParts bf16 parts once per launch (split_rows_kernel), and every part goes through the
// same weight fragment. kParts 3 (--dtype float32): x = hi + mid + lo, the products carry ~24 bits of x, so the
// result matches the fp32 CUDA-core path up to summation order (the op checks hold at 1e-5 rel-L2). kParts 1
// (--dtype bfloat16): x rounded once to bf16 (relative error <= 2^-8 per value), one MMA per weight fragment instead
// of three; accumulation stays fp32. Only these two are instantiated.
//
// Layout: the weight tile is the MMA's A operand (16 weight rows per warp), the rows of x (tokens) its B operand,
// 8 per MMA tile. Warps split K in 128-wide steps (lane q of a quad streams k [32q, 32q + 32) of two weight rows:
// 16 bytes of NVFP4 codes) and reduce through shared memory. The order in which a lane's codes enter the MMA's k
// dimension is a permutation of the physical k, the same for A and B (dev::e2m1_pair_bits): decoding is a few shifts per
// pair of codes.
//
// Experts: a block = one row tile of the grouping (one expert, up to tile_m sorted rows, walked 8 kSub at a time)
// x 16 kMT output features. The gate/up launch (kMats 2) writes silu(gate) * up already split into parts, in the
// layout the down launch (kMats 1) reads as its B operand; the down launch writes fp32 rows that moe_combine sums
// per token.
//
// Prefill row tiles (>= 16 rows) stage x in shared memory (moe_mma_xsmem_kernel, 2 token sub-tiles per pass over
// the weights): the same 4 x 2 warps and weight path, but the block copies the x fragments of its two
// k-steps (a stage: 8 kSub rows x 256 k x parts) global -> shared with cp.async once, double buffered (the next stage
// in flight while this one is multiplied, one __syncthreads per stage), and the 4 row-tile warps read their B
// fragments from there with 128-bit shared loads (padded, swizzled: no bank conflicts) instead of 4 copies of the
// same global loads. The k-split reduction reuses the stage buffers. Shared memory: 56 KB (2 blocks per SM).
#include <atomic>
#include <cuda_bf16.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ptx.cuh"

namespace kiln::cuda::ops {
namespace {


constexpr int kStepK = 128;  // k per warp step: 4 lanes x 32 codes of each weight row

struct MmaArgs {
  const WeightDesc* table = nullptr;  // [E][3] {gate, up, down}
  int which0 = 0, which1 = 1;         // table entries of matrix 0 (and 1 when kMats == 2)
  const int4* tile_info = nullptr;      // [tiles] {expert (-1: none), first sorted row, end row, 0}
  const uint16_t* xs = nullptr;         // split input rows [rows][K/32][parts][32] (bf16 bits)
  const int32_t* row_index = nullptr;   // input row of each sorted row (null: the sorted row itself)
  int K = 0, N = 0;
  uint16_t* act_s = nullptr;  // kMats 2: split output [sorted rows][N/32][parts][32]
  float* y = nullptr;         // kMats 1: [sorted rows][N]
};

template <int kParts>
__device__ __forceinline__ void split_value(float v, uint16_t (&o)[kParts]) {
  float r = v;
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
    const __nv_bfloat16 h = __float2bfloat16_rn(r);
    o[p] = __bfloat16_as_ushort(h);
    r -= __bfloat162float(h);
  }
}

// xs[t][c][p][i] = part p of x[t][32c + i].
template <int kParts>
__global__ void split_rows_kernel(const float* __restrict__ x, int64_t ldx, int64_t T, int64_t K,
                                  uint16_t* __restrict__ xs) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t n = T * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / K, k = i % K;
    uint16_t o[kParts];
    split_value<kParts>(x[t * ldx + k], o);
    uint16_t* dst = xs + t * K * kParts + (k / 32) * kParts * 32 + (k % 32);
#pragma unroll
    for (int p = 0; p < kParts; ++p) dst[p * 32] = o[p];
  }
}

template <int kMats>
struct MmaStep {
  uint4 w[kMats][2];      // 32 codes of rows g and g + 8
  uint32_t sc[kMats][2];  // their 2 block-scale bytes each
};

// A lane's weight streams for one 16-row weight tile (rows row0 + g and row0 + g + 8 of each matrix; codes
// [32 q, 32 q + 32) of every k-step) and the matrices' global scales: shared by both expert kernels.
template <int kMats>
struct WeightRows {
  const uint8_t* wrow[kMats][2];
  const uint8_t* srow[kMats][2];
  float gscale[kMats];
  __device__ __forceinline__ WeightRows(const MmaArgs& a, int e, int row0, int g, int q) {
    const int64_t row_bytes = a.K / 2, row_scales = a.K / 16;
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi) {
      const WeightDesc& w = a.table[e * 3 + (mi == 0 ? a.which0 : a.which1)];
      gscale[mi] = w.scale * dev::kNvfp4AccumScale;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = row0 + g + 8 * r;
        wrow[mi][r] = static_cast<const uint8_t*>(w.data) + row * row_bytes + 16 * q;
        srow[mi][r] = w.block_scale + row * row_scales + 2 * q;
      }
    }
  }
  // k-step s's codes and block scales into st.
  __device__ __forceinline__ void load(MmaStep<kMats>& st, int s) const {
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        st.w[mi][r] = ptx::ld_stream_16(wrow[mi][r] + s * (kStepK / 2));
        st.sc[mi][r] = __ldg(reinterpret_cast<const uint16_t*>(srow[mi][r] + s * (kStepK / 16)));
      }
  }
};

using dev::decode_fragment;
using dev::word_of;

// One output value of token t (sorted row), output feature n: gate/up (kMats 2) stores silu(gate) * up split into
// parts for the down launch, down (kMats 1) the fp32 value.
template <int kMats, int kParts>
__device__ __forceinline__ void store_output(const MmaArgs& a, int t, int n, const float (&v)[kMats]) {
  if constexpr (kMats == 2) {
    uint16_t o[kParts];
    split_value<kParts>(dev::silu(v[0]) * v[1], o);
    uint16_t* dst = a.act_s + int64_t(t) * a.N * kParts + (n / 32) * kParts * 32 + (n % 32);
#pragma unroll
    for (int p = 0; p < kParts; ++p) dst[p * 32] = o[p];
  } else {
    a.y[int64_t(t) * a.N + n] = v[0];
  }
}

// Block: kMT x kKS warps. Warp (mt, ks) owns weight rows [16 mt, 16 mt + 16) of the block's 16 kMT and the k-steps
// ks, ks + kKS, ...; the kKS partial sums of each row tile meet in shared memory.
// kSub: 8-token MMA tiles per pass over the weights; each decoded weight fragment feeds all of them (prefill).
// kMinBlocks (decode-sized launches): blocks per SM asked of the register allocator; 0 leaves it free
// (gate/up 122-136 registers, down 80-110: 2 blocks per SM).
template <int kMats, int kParts, int kMT, int kKS, int kSub, int kMinBlocks = 0>
__global__ void __launch_bounds__(kMT * kKS * 32, kMinBlocks > 0 ? kMinBlocks : kSub == 2 ? 2 : 1)
    moe_mma_kernel(const MmaArgs a) {
  dev::pdl_enter();  // first statement: see launch.cuh
  constexpr int kWarps = kMT * kKS;
  const int4 info = a.tile_info[blockIdx.x];  // one load: expert and rows of this tile
  const int e = info.x, rb = info.y, re = info.z;
  if (e < 0 || rb >= re) return;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int mt = warp % kMT, ks = warp / kMT;
  const int row0 = (blockIdx.y * kMT + mt) * 16;
  const int steps = a.K / kStepK;
  const WeightRows<kMats> wr(a, e, row0, g, q);
  const int64_t xs_row = int64_t(a.K) * kParts;  // bf16 elements per split row
  constexpr int kStepX = 4 * kParts * 32;        // bf16 elements of one step (4 lanes x parts x 32)

  __shared__ float red[kKS][kMT][kMats][kSub][4][32];

  for (int tb = rb; tb < re; tb += 8 * kSub) {
    // Tokens past the tile's last row read the last row again: their loads stay unconditional, their MMA columns
    // are never stored.
    const uint16_t* xrow[kSub];
#pragma unroll
    for (int u = 0; u < kSub; ++u) {
      const int tok = min(tb + 8 * u + g, re - 1);
      xrow[u] = a.xs + int64_t(a.row_index ? a.row_index[tok] : tok) * xs_row + q * kParts * 32;
    }

    float acc[kMats][kSub][4];
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
      for (int u = 0; u < kSub; ++u) acc[mi][u][0] = acc[mi][u][1] = acc[mi][u][2] = acc[mi][u][3] = 0.0f;

    auto compute = [&](const MmaStep<kMats>& st, int s) {
      // x of every sub-tile: all 4 words up front with one sub-tile, word by word with several (registers).
      constexpr int kPre = kSub == 1 ? 4 : 1;
      uint4 xv[kSub][kPre][kParts];
      auto load_x = [&](int j0) {
#pragma unroll
        for (int u = 0; u < kSub; ++u) {
          const uint4* xp = reinterpret_cast<const uint4*>(xrow[u] + int64_t(s) * kStepX);
#pragma unroll
          for (int p = 0; p < kParts; ++p)
#pragma unroll
            for (int jj = 0; jj < kPre; ++jj) xv[u][jj][p] = __ldg(xp + p * 4 + j0 + jj);
        }
      };
      if constexpr (kPre == 4) load_x(0);
      uint32_t sc[kMats][2][2];  // [mat][row][scale block]
#pragma unroll
      for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          sc[mi][r][0] = dev::nvfp4_scale_bf16x2(st.sc[mi][r] & 0xff);
          sc[mi][r][1] = dev::nvfp4_scale_bf16x2(st.sc[mi][r] >> 8);
        }
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // word j: codes 8j..8j+7 of this lane's 32
        if constexpr (kPre == 1) load_x(j);
        const int jx = kPre == 1 ? 0 : j;
#pragma unroll
        for (int mi = 0; mi < kMats; ++mi) {
          const uint32_t w0 = word_of(st.w[mi][0], j), w1 = word_of(st.w[mi][1], j);
          const uint32_t s0 = sc[mi][0][j / 2], s1 = sc[mi][1][j / 2];
          uint32_t f[4];
          decode_fragment<0>(w0, w1, s0, s1, f);
#pragma unroll
          for (int u = 0; u < kSub; ++u)
#pragma unroll
            for (int p = 0; p < kParts; ++p)
              ptx::mma_bf16_16816(acc[mi][u], f, __byte_perm(xv[u][jx][p].x, xv[u][jx][p].z, 0x5410),
                                 __byte_perm(xv[u][jx][p].x, xv[u][jx][p].z, 0x7632));
          decode_fragment<1>(w0, w1, s0, s1, f);
#pragma unroll
          for (int u = 0; u < kSub; ++u)
#pragma unroll
            for (int p = 0; p < kParts; ++p)
              ptx::mma_bf16_16816(acc[mi][u], f, __byte_perm(xv[u][jx][p].y, xv[u][jx][p].w, 0x5410),
                                 __byte_perm(xv[u][jx][p].y, xv[u][jx][p].w, 0x7632));
        }
      }
    };

    // The next step's weight loads are in flight while this step decodes and multiplies.
    int s = ks;
    if (s < steps) {
      MmaStep<kMats> cur;
      wr.load(cur, s);
      for (; s + kKS < steps; s += kKS) {
        MmaStep<kMats> nxt;
        wr.load(nxt, s + kKS);
        compute(cur, s);
        cur = nxt;
      }
      compute(cur, s);
    }

#pragma unroll
    for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
      for (int u = 0; u < kSub; ++u)
#pragma unroll
        for (int c = 0; c < 4; ++c) red[ks][mt][mi][u][c][lane] = acc[mi][u][c];
    __syncthreads();
    // Fragment c of row tile m, sub-tile u: weight row 16 m + g + 8 (c >= 2), token 8u + 2q + (c & 1); a warp each.
    for (int f = warp; f < kMT * kSub * 4; f += kWarps) {
      const int m = f / (4 * kSub), u = (f / 4) % kSub, c = f % 4;
      float v[kMats];
#pragma unroll
      for (int mi = 0; mi < kMats; ++mi) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kKS; ++w) sum += red[w][m][mi][u][c][lane];
        v[mi] = sum * wr.gscale[mi];
      }
      const int n = (blockIdx.y * kMT + m) * 16 + g + (c >= 2 ? 8 : 0);
      const int t = tb + 8 * u + 2 * q + (c & 1);
      if (t < re) store_output<kMats, kParts>(a, t, n, v);
    }
    __syncthreads();  // red is written again by the next token tile
  }
}

// ---- prefill kernel with x staged in shared memory
// The same block (4 row tiles x 2 k-splits, weights in registers one step ahead) over 8 kSub tokens, but the x
// fragments of a stage (the block's two k-steps: 256 k) travel global -> shared by cp.async once per block, double
// buffered (stage st + 1 in flight while stage st is multiplied), and the 4 row-tile warps read their B fragments
// from there (128-bit shared loads) instead of each loading them from global memory.
// Stage layout, in 16-byte units: row r (token 8u + g of the pass), chunk c (32 k: k-split c / 4, lane q = c % 4),
// unit pj = 4 p + j (part p, word j) at r * kRow + c * kChunk + (pj ^ (r & 1)). The chunk stride 4 parts + 2 puts
// the 4 q of a quarter warp on distinct even / odd bank groups, the xor moves the odd row g to the other parity:
// the 8 lanes of a quarter warp read 8 distinct bank groups.
template <int kParts, int kSub>
struct XStage {
  static constexpr int kRows = 8 * kSub;          // tokens per pass
  static constexpr int kRowUnits = 32 * kParts;   // units of one row's stage: 8 chunks x parts x 4 words
  static constexpr int kChunk = 4 * kParts + 2;   // padded chunk stride
  static constexpr int kRow = 8 * kChunk;         // row stride
  static constexpr int kUnits = kRows * kRow;     // one stage
  static constexpr int kCopies = kRows * kRowUnits / 256;  // cp.async per thread per stage
  static_assert(kRows * kRowUnits % 256 == 0);
  // Both stages, the k-split reduction aliased onto them, then the row table.
  template <int kMats>
  static constexpr int red_units() {
    return 2 * 4 * kMats * kSub * 4 * 32 / 4;  // [kKS 2][kMT 4][kMats][kSub][4][32] floats
  }
  template <int kMats>
  static constexpr int table_units() {
    return 2 * kUnits > red_units<kMats>() ? 2 * kUnits : red_units<kMats>();
  }
  template <int kMats>
  static constexpr size_t bytes() {
    return size_t(table_units<kMats>()) * 16 + kRows * sizeof(const uint4*);
  }
};

template <int kMats, int kParts, int kSub>
__global__ void __launch_bounds__(256, kMats == 2 && kSub == 4 ? 1 : 2) moe_mma_xsmem_kernel(const MmaArgs a) {
  dev::pdl_enter();  // first statement: see launch.cuh
  constexpr int kMT = 4, kKS = 2;
  using L = XStage<kParts, kSub>;
  extern __shared__ uint4 smem[];
  const int4 info = a.tile_info[blockIdx.x];
  const int e = info.x, rb = info.y, re = info.z;
  if (e < 0 || rb >= re) return;

  float* red = reinterpret_cast<float*>(smem);  // [kKS][kMT][kMats][kSub][4][32], after the last stage is used
  const uint4** xsrc = reinterpret_cast<const uint4**>(smem + L::template table_units<kMats>());  // [kRows]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  const int mt = warp % kMT, ks = warp / kMT;
  const int row0 = (blockIdx.y * kMT + mt) * 16;
  const int steps = a.K / kStepK, stages = (steps + 1) / 2;
  const WeightRows<kMats> wr(a, e, row0, g, q);
  const int64_t xs_row = int64_t(a.K) * kParts;  // bf16 elements per split row
  // This lane's B fragments in a stage: row g, chunk 4 ks + q; word j at + 4 p + (j ^ (g & 1)).
  const int g1 = g & 1;
  const int xlane = g * L::kRow + (4 * ks + q) * L::kChunk;

  // Stage st (k-steps 2 st, 2 st + 1; a step past the last one copies the last one again, unused) into buffer buf.
  auto copy = [&](int st, int buf) {
    const uint32_t base = ptx::smem_addr(smem + buf * L::kUnits);
    int t = tid;
    asm volatile("" : "+r"(t));  // recompute the indices per stage rather than hold them in registers
#pragma unroll
    for (int n = 0; n < L::kCopies; ++n) {
      const int i = t + 256 * n;
      const int r = i / L::kRowUnits, rem = i % L::kRowUnits;
      const int c = rem / (4 * kParts), pj = rem % (4 * kParts);
      const int step = min(2 * st + (c >> 2), steps - 1);
      const uint4* src = xsrc[r] + step * (16 * kParts) + (c & 3) * (4 * kParts) + pj;
      ptx::cp_async_16(base + 16 * (r * L::kRow + c * L::kChunk + (pj ^ (r & 1))), src);
    }
  };

  for (int tb = rb; tb < re; tb += L::kRows) {
    // Rows past the tile's last row copy the last row again: their MMA columns are never stored.
    if (tid < L::kRows) {
      const int tok = min(tb + tid, re - 1);
      xsrc[tid] = reinterpret_cast<const uint4*>(a.xs + int64_t(a.row_index ? a.row_index[tok] : tok) * xs_row);
    }
    __syncthreads();
    copy(0, 0);
    ptx::cp_async_commit();

    float acc[kMats][kSub][4];
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
      for (int u = 0; u < kSub; ++u) acc[mi][u][0] = acc[mi][u][1] = acc[mi][u][2] = acc[mi][u][3] = 0.0f;

    auto compute = [&](const MmaStep<kMats>& st, int buf) {
      const uint4* xb = smem + buf * L::kUnits + xlane;
      uint32_t sc[kMats][2];  // [mat][row]: the scale of words j, j + 1
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // word j: codes 8j..8j+7 of this lane's 32
        if (j % 2 == 0) {
#pragma unroll
          for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) sc[mi][r] = dev::nvfp4_scale_bf16x2((st.sc[mi][r] >> (4 * j)) & 0xff);
        }
        // k-step 0 of the word: code pairs (0,4), (1,5); k-step 1: (2,6), (3,7).
        uint32_t f0[kMats][4], f1[kMats][4];
#pragma unroll
        for (int mi = 0; mi < kMats; ++mi) {
          const uint32_t w0 = word_of(st.w[mi][0], j), w1 = word_of(st.w[mi][1], j);
          decode_fragment<0>(w0, w1, sc[mi][0], sc[mi][1], f0[mi]);
          decode_fragment<1>(w0, w1, sc[mi][0], sc[mi][1], f1[mi]);
        }
        // (j ^ g1) = j + (j even ? g1 : -g1): the row parity swizzle.
        const uint4* xj = xb + j + ((j & 1) ? -g1 : g1);
#pragma unroll
        for (int u = 0; u < kSub; ++u)
#pragma unroll
          for (int p = 0; p < kParts; ++p) {
            const uint4 xv = xj[u * 8 * L::kRow + 4 * p];
#pragma unroll
            for (int mi = 0; mi < kMats; ++mi) {
              ptx::mma_bf16_16816(acc[mi][u], f0[mi], __byte_perm(xv.x, xv.z, 0x5410), __byte_perm(xv.x, xv.z, 0x7632));
              ptx::mma_bf16_16816(acc[mi][u], f1[mi], __byte_perm(xv.y, xv.w, 0x5410), __byte_perm(xv.y, xv.w, 0x7632));
            }
          }
      }
    };

    // Weights one step ahead in registers (clamped past the last step: unconditional loads), x one stage ahead in
    // shared memory.
    MmaStep<kMats> cur;
    wr.load(cur, min(ks, steps - 1));
    for (int st = 0; st < stages; ++st) {
      ptx::cp_async_wait<0>();
      __syncthreads();  // stage st landed for every thread; every warp is done with stage st - 1 (the next buffer)
      if (st + 1 < stages) copy(st + 1, (st + 1) & 1);
      ptx::cp_async_commit();
      MmaStep<kMats> nxt;
      wr.load(nxt, min(2 * st + 2 + ks, steps - 1));
      if (2 * st + ks < steps) compute(cur, st & 1);
      cur = nxt;
    }
    __syncthreads();  // red overwrites the stages

#pragma unroll
    for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
      for (int u = 0; u < kSub; ++u)
#pragma unroll
        for (int c = 0; c < 4; ++c)
          red[((((ks * kMT + mt) * kMats + mi) * kSub + u) * 4 + c) * 32 + lane] = acc[mi][u][c];
    __syncthreads();
    // Fragment c of row tile m, sub-tile u: weight row 16 m + g + 8 (c >= 2), token 8u + 2q + (c & 1); a warp each.
    for (int f = warp; f < kMT * kSub * 4; f += kMT * kKS) {
      const int m = f / (4 * kSub), u = (f / 4) % kSub, c = f % 4;
      float v[kMats];
#pragma unroll
      for (int mi = 0; mi < kMats; ++mi) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kKS; ++w) sum += red[((((w * kMT + m) * kMats + mi) * kSub + u) * 4 + c) * 32 + lane];
        v[mi] = sum * wr.gscale[mi];
      }
      const int n = (blockIdx.y * kMT + m) * 16 + g + (c >= 2 ? 8 : 0);
      const int t = tb + 8 * u + 2 * q + (c & 1);
      if (t < re) store_output<kMats, kParts>(a, t, n, v);
    }
    __syncthreads();  // the next pass rewrites the row table and the stages (red)
  }
}

template <int kMats, int kParts, int kSub>
void launch_mma_xsmem(const MmaArgs& a, int64_t max_tiles, Stream stream) {
  constexpr size_t bytes = XStage<kParts, kSub>::template bytes<kMats>();
  auto kernel = moe_mma_xsmem_kernel<kMats, kParts, kSub>;
  static std::atomic<uint64_t> configured{0};
  set_dynamic_smem_once(kernel, bytes, configured);
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(a.N / 64));
  launch_kernel(kernel, grid, 256, bytes, stream, a);
  KILN_CUDA_CHECK_LAUNCH();
}

// Warp layout per launch: kMT row tiles of 16 x kKS k-splits (8 warps). More row tiles per block mean fewer blocks
// (each pays the tile / descriptor lookups once) and longer per-warp k chains.
template <int kMats, int kParts, int kMT, int kSub, int kMinBlocks = 0>
void launch_mma_mt(const MmaArgs& a, int64_t max_tiles, Stream stream) {
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(a.N / (16 * kMT)));
  launch_kernel(moe_mma_kernel<kMats, kParts, kMT, 8 / kMT, kSub, kMinBlocks>, grid, 256, 0, stream, a);
  KILN_CUDA_CHECK_LAUNCH();
}

// A decode-sized launch (one token sub-tile) with kMT row tiles, at `occ` blocks per SM (3 or 4; others: the
// allocator's choice). The hints were measured with 3 parts. 1 part takes them too, and 3 where 3 parts leave the
// allocator free: left free it gives the 1-part kernels more registers than the 3-part ones (gate/up 142-152
// against 122: one block of 8 warps per SM where 3 parts get two), while at 3 blocks per SM they need 80 and spill
// at most 4 bytes (ptxas, sm_90a; down at 4 blocks: 64, no spills). Not yet timed on the GPU.
template <int kMats, int kParts, int kMT>
void launch_mma_decode(const MmaArgs& a, int64_t max_tiles, int occ, Stream stream) {
  if (occ == 4) return launch_mma_mt<kMats, kParts, kMT, 1, 4>(a, max_tiles, stream);
  if (occ == 3 || kParts == kMmaPartsBf16) return launch_mma_mt<kMats, kParts, kMT, 1, 3>(a, max_tiles, stream);
  if constexpr (kParts != kMmaPartsBf16) launch_mma_mt<kMats, kParts, kMT, 1>(a, max_tiles, stream);
}

// Row tiles of >= 16 rows (prefill): moe_mma_xsmem_kernel with 2 token sub-tiles per pass over the weights (each
// decoded weight fragment feeds both; 2 blocks per SM). Decode-sized tiles take one sub-tile with the row-tile count
// asked for (the widest that divides N; 8 means 8 row tiles x 1 k-split).
template <int kMats, int kParts>
void launch_mma(const MmaArgs& a, int64_t max_tiles, int mt, int tile_m, int occ, Stream stream) {
  if (tile_m >= 16 && a.N % 64 == 0) return launch_mma_xsmem<kMats, kParts, 2>(a, max_tiles, stream);
  while (mt > 1 && a.N % (16 * mt) != 0) mt /= 2;
  if (mt >= 8) launch_mma_decode<kMats, kParts, 8>(a, max_tiles, occ, stream);
  else if (mt >= 4) launch_mma_decode<kMats, kParts, 4>(a, max_tiles, occ, stream);
  else if (mt == 2) launch_mma_decode<kMats, kParts, 2>(a, max_tiles, occ, stream);
  else launch_mma_decode<kMats, kParts, 1>(a, max_tiles, occ, stream);
}

template <int kParts>
void run_experts_mma(const float* x, int64_t T, int64_t H, int64_t I, const WeightDesc* experts, int64_t E,
                     const MoeMmaPlan& plan, Stream stream) {
  (void)E;
  const int64_t n = T * H;
  const int64_t blocks = (n + 255) / 256;
  launch_kernel(split_rows_kernel<kParts>, static_cast<unsigned>(blocks < 8192 ? blocks : 8192), 256, 0, stream, x, H, T, H, plan.xs);
  KILN_CUDA_CHECK_LAUNCH();
  MmaArgs up;
  up.table = experts;
  up.which0 = 0;
  up.which1 = 1;
  up.tile_info = plan.tile_info;
  up.xs = plan.xs;
  up.row_index = plan.row_token;
  up.K = static_cast<int>(H);
  up.N = static_cast<int>(I);
  up.act_s = plan.act_s;
  profile_mark("split x");
  launch_mma<2, kParts>(up, plan.max_tiles, plan.mt_up, plan.tile_m, plan.occ_up, stream);
  profile_mark("gate/up (tensor cores)");
  MmaArgs down = up;
  down.which0 = down.which1 = 2;
  down.xs = plan.act_s;
  down.row_index = nullptr;
  down.K = static_cast<int>(I);
  down.N = static_cast<int>(H);
  down.act_s = nullptr;
  down.y = plan.y;
  launch_mma<1, kParts>(down, plan.max_tiles, plan.mt_down, plan.tile_m, plan.occ_down, stream);
  profile_mark("down (tensor cores)");
}

}  // namespace

bool moe_mma_supported(int64_t H, int64_t I, int experts_gemv2_kind) {
  return experts_gemv2_kind == 1 && H % kStepK == 0 && I % kStepK == 0 && H > 0 && I > 0;
}

void moe_experts_mma(const float* x, int64_t T, int64_t H, int64_t I, const WeightDesc* experts, int64_t E,
                     const MoeMmaPlan& plan, Stream stream) {
  if (T == 0) return;
  if (plan.parts == kMmaPartsFp32) return run_experts_mma<kMmaPartsFp32>(x, T, H, I, experts, E, plan, stream);
  if (plan.parts == kMmaPartsBf16) return run_experts_mma<kMmaPartsBf16>(x, T, H, I, experts, E, plan, stream);
  cuda_fail("moe_experts_mma: {} bf16 parts (1 or 3)", {plan.parts});
}

bool linear_nvfp4_mma_supported(const WeightDesc& w) {
  return w.kind == WeightKind::nvfp4 && !w.bias && w.k % kStepK == 0 && w.n % 64 == 0 && w.k > 0 && w.n > 0 &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && reinterpret_cast<uintptr_t>(w.block_scale) % 2 == 0;
}

// The routed-expert kernel with one "expert" (the weight) and row tiles of kLinearTileRows rows: the prefill tiles
// (4 x 16 weight rows x 2 k-splits per block, x staged in shared memory, 2 token sub-tiles per pass over the weights).
namespace {
template <int kParts>
void run_linear_nvfp4_mma(const WeightDesc* w_dev, const int4* tiles, int64_t n_tiles, int64_t K, int64_t N,
                          const float* x, int64_t ldx, int64_t T, uint16_t* xs, float* out, Stream stream) {
  const int64_t n = T * K;
  const int64_t blocks = (n + 255) / 256;
  launch_kernel(split_rows_kernel<kParts>, static_cast<unsigned>(blocks < 8192 ? blocks : 8192), 256, 0, stream, x,
                ldx, T, K, xs);
  KILN_CUDA_CHECK_LAUNCH();
  MmaArgs a;
  a.table = w_dev;
  a.which0 = a.which1 = 0;
  a.tile_info = tiles;
  a.xs = xs;
  a.K = static_cast<int>(K);
  a.N = static_cast<int>(N);
  a.y = out;
  launch_mma<1, kParts>(a, n_tiles, 4, kLinearTileRows, 0, stream);
}
}  // namespace

void linear_nvfp4_mma(const WeightDesc* w_dev, const int4* tiles, int64_t n_tiles, int64_t K, int64_t N,
                      const float* x, int64_t ldx, int64_t T, uint16_t* xs, float* out, Stream stream,
                      int mma_parts) {
  if (T == 0) return;
  if (mma_parts == kMmaPartsFp32)
    return run_linear_nvfp4_mma<kMmaPartsFp32>(w_dev, tiles, n_tiles, K, N, x, ldx, T, xs, out, stream);
  if (mma_parts == kMmaPartsBf16)
    return run_linear_nvfp4_mma<kMmaPartsBf16>(w_dev, tiles, n_tiles, K, N, x, ldx, T, xs, out, stream);
  cuda_fail("linear_nvfp4_mma: {} bf16 parts (1 or 3)", {mma_parts});
}

}  // namespace kiln::cuda::ops
