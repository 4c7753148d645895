// CudaOps routed experts with NVFP4 weights on tensor cores over fp32 activations (mma.sync m16n8k16, bf16 in, fp32
// accumulate), any number of rows.
//
// Hopper has no FP4 MMA, so NVFP4 codes are decoded to bf16 in registers: e2m1 * e4m3 block scale is exact in bf16
// (at most 6 significant bits; the 2^118 / 2^-8 bookkeeping of device_utils.cuh keeps it in range). The fp32
// activations are split into bf16 parts x = hi + mid (+ lo) once per launch (split_rows_kernel), and every part goes
// through the same weight fragment: with three parts the products carry ~24 bits of x, so the result matches the
// fp32 CUDA-core path up to summation order (the op checks hold at 1e-5 rel-L2; two parts ~2^-17).
//
// Layout: the weight tile is the MMA's A operand (16 weight rows per warp), the rows of x (tokens) its B operand,
// 8 per MMA tile. Warps split K in 128-wide steps (lane q of a quad streams k [32q, 32q + 32) of two weight rows:
// 16 bytes of NVFP4 codes) and reduce through shared memory. The order in which a lane's codes enter the MMA's k
// dimension is a permutation of the physical k, the same for A and B (see nvfp4.cu): decoding is a few shifts per
// pair of codes.
//
// Experts: a block = one row tile of the grouping (one expert, up to tile_m sorted rows, walked 8 kSub at a time)
// x 16 kMT output features. The gate/up launch (kMats 2) writes silu(gate) * up already split into parts, in the
// layout the down launch (kMats 1) reads as its B operand; the down launch writes fp32 rows that moe_combine sums
// per token.
#include <cuda_bf16.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops_device.cuh"
#include "backend/cuda/cuda_ops_kernels.h"
#include "backend/cuda/device_utils.cuh"

namespace kiln::cuda::ops {
namespace {

namespace tc = ::kiln::cuda::dev;

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

// Block: kMT x kKS warps. Warp (mt, ks) owns weight rows [16 mt, 16 mt + 16) of the block's 16 kMT and the k-steps
// ks, ks + kKS, ...; the kKS partial sums of each row tile meet in shared memory.
// kSub: 8-token MMA tiles per pass over the weights; each decoded weight fragment feeds all of them (prefill).
template <int kMats, int kParts, int kMT, int kKS, int kSub>
__global__ void __launch_bounds__(kMT * kKS * 32, kSub == 2 ? 2 : 1) moe_mma_kernel(const MmaArgs a) {
  constexpr int kWarps = kMT * kKS;
  const int4 info = a.tile_info[blockIdx.x];  // one load: expert and rows of this tile
  const int e = info.x, rb = info.y, re = info.z;
  if (e < 0 || rb >= re) return;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int mt = warp % kMT, ks = warp / kMT;
  const int row0 = (blockIdx.y * kMT + mt) * 16;
  const int64_t row_bytes = a.K / 2, row_scales = a.K / 16;
  const int steps = a.K / kStepK;

  const uint8_t* wrow[kMats][2];
  const uint8_t* srow[kMats][2];
  float gscale[kMats];
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi) {
    const WeightDesc& w = a.table[e * 3 + (mi == 0 ? a.which0 : a.which1)];
    gscale[mi] = w.scale * tc::kNvfp4AccumScale;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row0 + g + 8 * r;
      wrow[mi][r] = static_cast<const uint8_t*>(w.data) + row * row_bytes + 16 * q;
      srow[mi][r] = w.block_scale + row * row_scales + 2 * q;
    }
  }
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

    auto load = [&](MmaStep<kMats>& st, int s) {
#pragma unroll
      for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          st.w[mi][r] = tc::ld_stream_16(wrow[mi][r] + s * (kStepK / 2));
          st.sc[mi][r] = __ldg(reinterpret_cast<const uint16_t*>(srow[mi][r] + s * (kStepK / 16)));
        }
    };
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
          sc[mi][r][0] = tc::nvfp4_scale_bf16x2(st.sc[mi][r] & 0xff);
          sc[mi][r][1] = tc::nvfp4_scale_bf16x2(st.sc[mi][r] >> 8);
        }
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // word j: codes 8j..8j+7 of this lane's 32
        if constexpr (kPre == 1) load_x(j);
        const int jx = kPre == 1 ? 0 : j;
#pragma unroll
        for (int mi = 0; mi < kMats; ++mi) {
          const uint32_t w0 = j == 0 ? st.w[mi][0].x : j == 1 ? st.w[mi][0].y : j == 2 ? st.w[mi][0].z : st.w[mi][0].w;
          const uint32_t w1 = j == 0 ? st.w[mi][1].x : j == 1 ? st.w[mi][1].y : j == 2 ? st.w[mi][1].z : st.w[mi][1].w;
          const uint32_t s0 = sc[mi][0][j / 2], s1 = sc[mi][1][j / 2];
          uint32_t f[4];
          // k-step 0: code pairs (0,4), (1,5); k-step 1: (2,6), (3,7).
          f[0] = tc::bf16x2_mul(tc::e2m1_pair_bits<0>(w0), s0);
          f[1] = tc::bf16x2_mul(tc::e2m1_pair_bits<0>(w1), s1);
          f[2] = tc::bf16x2_mul(tc::e2m1_pair_bits<1>(w0), s0);
          f[3] = tc::bf16x2_mul(tc::e2m1_pair_bits<1>(w1), s1);
#pragma unroll
          for (int u = 0; u < kSub; ++u)
#pragma unroll
            for (int p = 0; p < kParts; ++p)
              tc::mma_bf16_16816(acc[mi][u], f, __byte_perm(xv[u][jx][p].x, xv[u][jx][p].z, 0x5410),
                                 __byte_perm(xv[u][jx][p].x, xv[u][jx][p].z, 0x7632));
          f[0] = tc::bf16x2_mul(tc::e2m1_pair_bits<2>(w0), s0);
          f[1] = tc::bf16x2_mul(tc::e2m1_pair_bits<2>(w1), s1);
          f[2] = tc::bf16x2_mul(tc::e2m1_pair_bits<3>(w0), s0);
          f[3] = tc::bf16x2_mul(tc::e2m1_pair_bits<3>(w1), s1);
#pragma unroll
          for (int u = 0; u < kSub; ++u)
#pragma unroll
            for (int p = 0; p < kParts; ++p)
              tc::mma_bf16_16816(acc[mi][u], f, __byte_perm(xv[u][jx][p].y, xv[u][jx][p].w, 0x5410),
                                 __byte_perm(xv[u][jx][p].y, xv[u][jx][p].w, 0x7632));
        }
      }
    };

    // The next step's weight loads are in flight while this step decodes and multiplies.
    int s = ks;
    if (s < steps) {
      MmaStep<kMats> cur;
      load(cur, s);
      for (; s + kKS < steps; s += kKS) {
        MmaStep<kMats> nxt;
        load(nxt, s + kKS);
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
        v[mi] = sum * gscale[mi];
      }
      const int n = (blockIdx.y * kMT + m) * 16 + g + (c >= 2 ? 8 : 0);
      const int t = tb + 8 * u + 2 * q + (c & 1);
      if (t < re) {
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
    }
    __syncthreads();  // red is written again by the next token tile
  }
}

// Warp layout per launch: kMT row tiles of 16 x kKS k-splits (8 warps). More row tiles per block mean fewer blocks
// (each pays the tile / descriptor lookups once) and longer per-warp k chains.
template <int kMats, int kParts, int kMT, int kSub>
void launch_mma_mt(const MmaArgs& a, int64_t max_tiles, Stream stream) {
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(a.N / (16 * kMT)));
  moe_mma_kernel<kMats, kParts, kMT, 8 / kMT, kSub><<<grid, 256, 0, stream>>>(a);
  KILN_CUDA_CHECK_LAUNCH();
}

// Row tiles of 16 rows take 2 token sub-tiles per pass over the weights, larger ones `sub` (2 or 4), with 4 x 2
// warps (prefill: each decoded weight fragment feeds every sub-tile). With 2 sub-tiles the kernel fits 2 blocks per
// SM (128 registers), which measured faster than 4 sub-tiles at 1 block per SM (4k prefill 7,225 vs 7,031 tok/s). Decode-sized tiles take one sub-tile, with the
// row-tile count asked for (the widest that divides N; 8 means 8 row tiles x 1 k-split).
template <int kMats, int kParts>
void launch_mma(const MmaArgs& a, int64_t max_tiles, int mt, int tile_m, int sub, Stream stream) {
  if (tile_m >= 16 && a.N % 64 == 0) {
    if (tile_m == 16 || sub == 2) return launch_mma_mt<kMats, kParts, 4, 2>(a, max_tiles, stream);
    return launch_mma_mt<kMats, kParts, 4, 4>(a, max_tiles, stream);
  }
  while (mt > 1 && a.N % (16 * mt) != 0) mt /= 2;
  if (mt >= 8) launch_mma_mt<kMats, kParts, 8, 1>(a, max_tiles, stream);
  else if (mt >= 4) launch_mma_mt<kMats, kParts, 4, 1>(a, max_tiles, stream);
  else if (mt == 2) launch_mma_mt<kMats, kParts, 2, 1>(a, max_tiles, stream);
  else launch_mma_mt<kMats, kParts, 1, 1>(a, max_tiles, stream);
}

template <int kParts>
void run_experts_mma(const float* x, int64_t T, int64_t H, int64_t I, const WeightDesc* experts, int64_t E,
                     const MoeMmaPlan& plan, Stream stream) {
  (void)E;
  const int64_t n = T * H;
  const int64_t blocks = (n + 255) / 256;
  split_rows_kernel<kParts><<<static_cast<unsigned>(blocks < 8192 ? blocks : 8192), 256, 0, stream>>>(
      x, H, T, H, plan.xs);
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
  launch_mma<2, kParts>(up, plan.max_tiles, plan.mt_up, plan.tile_m, plan.sub, stream);
  MmaArgs down = up;
  down.which0 = down.which1 = 2;
  down.xs = plan.act_s;
  down.row_index = nullptr;
  down.K = static_cast<int>(I);
  down.N = static_cast<int>(H);
  down.act_s = nullptr;
  down.y = plan.y;
  launch_mma<1, kParts>(down, plan.max_tiles, plan.mt_down, plan.tile_m, plan.sub, stream);
}

}  // namespace

bool moe_mma_supported(int64_t H, int64_t I, int experts_gemv2_kind) {
  return experts_gemv2_kind == 1 && H % kStepK == 0 && I % kStepK == 0 && H > 0 && I > 0;
}

void moe_experts_mma(const float* x, int64_t T, int64_t H, int64_t I, const WeightDesc* experts, int64_t E,
                     const MoeMmaPlan& plan, Stream stream) {
  if (T == 0) return;
  if (plan.parts == 2) run_experts_mma<2>(x, T, H, I, experts, E, plan, stream);
  else run_experts_mma<3>(x, T, H, I, experts, E, plan, stream);
}

}  // namespace kiln::cuda::ops
