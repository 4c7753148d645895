// The MoE block of a step of 1-4 tokens (decode at batch <= 4, a draft step, a verify pass of K <= 3) as ONE
// persistent kernel: the router and the shared expert's input projections, the routing, the routed NVFP4 experts'
// gate/up and SiLU * up, their down projections, the shared expert's down projection and the weighted combine with the
// gated shared expert.
//
// Why: at batch 1 the unfused block is ~9 dependent kernels per layer (linear_multi of router + shared gate/up,
// shared down, moe_route, group, split, gate/up, down, combine), each a few microseconds of its own latency for
// 1-10 MB of weights (docs/perf/decode-latency.md). Here the phases are separated by grid-wide barriers (~1 us each)
// instead of kernel boundaries, and every phase spreads its rows over all of the GPU's warps.
//
// Phases (grid: one block of 512 threads per multiprocessor, all resident: moe_block_decode_grid):
//  0. every block copies the step's x rows into shared memory, or (the post-attention residual add + RMSNorm folded in)
//     computes them itself: residual + y, its RMS norm times the norm weight (block 0 writes residual + y back to the
//     residual stream after the first grid barrier, when no block reads it any more);
//  A. rows of [router; shared gate; shared up; shared expert gate] (dense BF16, fp32 x) spread over all warps, a
//     warp per row read once for every token: logits, gate, up and the gate's logit into the workspace;
//                                                                                      -- grid barrier
//  B. every block routes the tokens itself (a warp per token: moe_route_warp_kernel's maths, bitwise its ids and
//     weights), computes the shared expert's silu(gate) * up and sigmoid(gate logit) into shared memory, and lists
//     the step's distinct held experts in ascending id;
//  C. items (distinct expert u, row i of I) over all warps: the NVFP4 gate and up rows of u, read once, against x of
//     every token that picked u (rounded to bf16 under --dtype bfloat16, as the tensor-core path rounds it),
//     silu(g) * u into the workspace row of that (token, slot) pair (rounded likewise);  -- grid barrier
//  D. every block copies the experts' activations into shared memory; rows h of H over all warps, a warp per row,
//     each distinct expert's down row read once: per token sum over its slots (w_j * scale_2_j) * down_j[h] . act_j,
//     plus sigmoid(gate) * shared_down[h] . act_shared.
//
// Maths: the unfused ops' (fp32 accumulation, the same decode of NVFP4 codes as the other kernels); only the order of
// the fp32 sums differs. The routing's ids and weights are bitwise moe_route's given the same logits; the logits
// come from a different summation order than linear_multi's, so a near-tie between two experts may route
// differently (as any other GEMV would).
//
// The grid barrier (two words that persist across launches, zeroed once by the caller; a 10 s wait traps) and the
// swizzled shared-memory rows: persistent_grid.cuh, shared with deltanet_block_decode.cu.
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe_block_decode.h"
#include "backend/cuda/moe_decode_common.cuh"
#include "backend/cuda/persistent_grid.cuh"
#include "backend/cuda/ptx.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;
using namespace moe_decode;
using namespace persistent;

constexpr int kMaxTopK = 16;
constexpr int kMaxH = 4096;
constexpr int kMaxI = 1024;
constexpr int kMaxIs = 1024;
constexpr int kMaxE = 1024;  // 32 logits per lane in the routing warp
constexpr int kDownLoads = 4;  // 16-byte down chunks per lane in flight (a pass covers 128 chunks of a row)
constexpr int kMaxT = 4;       // tokens per step (decode at batch <= 4, a verify pass of K <= 3 at batch 1)
constexpr int kMaxSmem = 200 * 1024;  // dynamic shared memory: x, the experts' activations, the shared expert's

struct ExpertDesc {
  const uint8_t* data[3];
  const uint8_t* scales[3];
  float gscale[3];  // scale_2 * kNvfp4AccumScale
};

// kKC: ceil(H / 1024) (16-byte chunks of 32 codes per lane per row of H; lanes past the row idle). kT: the most tokens
// (1 or 4); a.T <= kT of them are live.
template <int kKC, bool kBf16, int kT>
__global__ void __launch_bounds__(kThreads, 1) moe_block_decode_kernel(const MoeBlockArgs a) {
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ float4 smem4[];
  constexpr int kMaxPairs = kT * kMaxTopK;
  __shared__ int32_t s_ids[kMaxPairs];     // pair p = t * K + j: global expert id
  __shared__ float s_w[kMaxPairs];         // its routing weight
  __shared__ int32_t s_first[kMaxPairs];   // 1: no earlier pair picked the same held expert
  __shared__ int32_t s_rank[kMaxPairs];    // the pair's expert among the step's distinct held experts (-1: not held)
  __shared__ float s_coef[kMaxPairs];      // w_p * scale_2 * 256 of its expert's down projection
  __shared__ int32_t s_upair[kMaxPairs][kT];  // [distinct expert u][token t]: the pair, or -1
  __shared__ ExpertDesc s_desc[kMaxPairs];    // [u]
  __shared__ int32_t s_nu;
  __shared__ float s_sig[kT];

  const int H = a.H, T = a.T;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
  const int E = a.E, Is = a.Is, I = a.I, K = a.top_k, P = T * K;
  const int R = E + 2 * Is + 1, R4 = (R + 3) & ~3;  // phase A rows; a token's stride in the workspace
  float4* xs4 = smem4;                                      // [T][H / 4] swizzled per token
  float4* act4 = smem4 + T * H / 4;                         // [P][I / 4] swizzled (phase D)
  float* acts = reinterpret_cast<float*>(act4 + P * I / 4);  // [T][Is] plain
  float* ws = static_cast<float*>(a.workspace);             // [T][R4] then [P][I]
  float* ws_act = ws + T * R4;

  // ---- 0: x into shared memory (or the residual step computed here)
  if (!a.residual) {
    const float4* x4 = reinterpret_cast<const float4*>(a.x);
    for (int k4 = tid; k4 < T * H / 4; k4 += kThreads) {
      const int t = k4 / (H / 4), r4 = k4 % (H / 4);
      xs4[t * (H / 4) + swz(r4)] = __ldcg(x4 + k4);
    }
  } else {
    residual_norm_rows(a.residual, a.residual_y, T, H, a.norm_w, a.norm_w_elem, a.norm_eps, a.norm_zero_centred, xs4);
  }
  __syncthreads();

  // ---- A: dense BF16 rows [router E; shared gate Is; shared up Is; shared expert gate 1], a warp per row, every
  // token against the row's one read
  dense_rows<kKC, kT>(
      [&](int r) {
        if (r < E) return static_cast<const uint16_t*>(a.router) + int64_t(r) * H;
        if (r < E + Is) return static_cast<const uint16_t*>(a.shared_gate_proj) + int64_t(r - E) * H;
        if (r < E + 2 * Is) return static_cast<const uint16_t*>(a.shared_up_proj) + int64_t(r - E - Is) * H;
        return static_cast<const uint16_t*>(a.shared_expert_gate);
      },
      R, H, T, xs4, ws, R4, a.prefetch);
  grid_barrier(a.barrier);
  // Every block has read the residual stream: block 0 writes residual + y back (bitwise phase 0's sum).
  if (a.residual && blockIdx.x == 0) residual_write_back(a.residual, a.residual_y, T, H);

  // ---- B: routing (warp t routes token t, in every block), the shared expert's activation and gate (warps >= kT)
  if (warp < T) {
    const float* l = ws + warp * R4;
    float p[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int e = lane + 32 * i;
      p[i] = e < E ? __ldcg(l + e) : -INFINITY;
    }
    int idx;
    float val;
    route_logits(p, E, K, a.renormalise, lane, idx, val);
    if (lane < K) {
      s_ids[warp * K + lane] = idx;
      s_w[warp * K + lane] = val;
      if (blockIdx.x == 0 && a.ids) {
        a.ids[warp * K + lane] = idx;
        a.weights[warp * K + lane] = val;
      }
    }
  } else if (warp >= kT) {
    for (int q = tid - 32 * kT; q < T * Is; q += kThreads - 32 * kT) {
      const int t = q / Is, i = q % Is;
      const float g = __ldcg(ws + t * R4 + E + i), u = __ldcg(ws + t * R4 + E + Is + i);
      acts[q] = silu(g) * u;
    }
    if (tid - 32 * kT < T) {
      const int t = tid - 32 * kT;
      s_sig[t] = sigmoid(__ldcg(ws + t * R4 + E + 2 * Is));
    }
  }
  if constexpr (kBf16) {  // x as the experts' tensor-core path takes it (phase A used it in fp32)
    float* xs = reinterpret_cast<float*>(xs4);
    for (int k = tid; k < T * H; k += kThreads) xs[k] = __bfloat162float(__float2bfloat16_rn(xs[k]));
  }
  __syncthreads();
  // The step's distinct held experts in ascending id: u = the number of distinct held experts below the pair's.
  if (tid < P) {
    const int e = s_ids[tid];
    const bool held = e - a.held_begin >= 0 && e - a.held_begin < a.E_held;
    int first = held;
    for (int q = 0; q < tid && first; ++q) first = s_ids[q] != e;
    s_first[tid] = first;
  }
  __syncthreads();
  if (tid < P) {
    const int e = s_ids[tid];
    const bool held = e - a.held_begin >= 0 && e - a.held_begin < a.E_held;
    int rank = -1;
    if (held) {
      rank = 0;
      for (int q = 0; q < P; ++q) rank += s_first[q] && s_ids[q] < e;
    }
    s_rank[tid] = rank;
    if (tid == 0) {
      int n = 0;
      for (int q = 0; q < P; ++q) n += s_first[q];
      s_nu = n;
    }
  }
  for (int q = tid; q < kMaxPairs * kT; q += kThreads) (&s_upair[0][0])[q] = -1;
  __syncthreads();
  if (tid < P) {
    const int u = s_rank[tid];
    float coef = 0.0f;
    if (u >= 0) {
      const int64_t e = s_ids[tid] - a.held_begin;
      s_upair[u][tid / K] = tid;  // a token picks an expert at most once
      const WeightDesc* w = a.experts + e * 3;
      coef = s_w[tid] * (w[2].scale * kNvfp4AccumScale);
      if (s_first[tid]) {
        ExpertDesc d;
#pragma unroll
        for (int m = 0; m < 3; ++m) {
          d.data[m] = static_cast<const uint8_t*>(w[m].data);
          d.scales[m] = w[m].block_scale;
          d.gscale[m] = w[m].scale * kNvfp4AccumScale;
        }
        s_desc[u] = d;
      }
    }
    s_coef[tid] = coef;
  }
  __syncthreads();
  const int NU = s_nu;
  if (a.prefetch && lane == 0) {  // this warp's phase-D rows (shared down, each distinct expert's down row) into L2
    for (int h = gwarp; h < H; h += nwarps) {
      ptx::prefetch_l2_bulk(static_cast<const uint16_t*>(a.shared_down_proj) + int64_t(h) * Is, 2u * Is);
      for (int u = 0; u < NU; ++u) {
        ptx::prefetch_l2_bulk(s_desc[u].data[2] + int64_t(h) * (I / 2), static_cast<uint32_t>(I / 2));
        const uint8_t* sc = s_desc[u].scales[2] + int64_t(h) * (I / 16);  // bulk: 16-byte aligned, a multiple of 16
        if ((reinterpret_cast<uintptr_t>(sc) & 15u) == 0 && (I / 16) % 16 == 0)
          ptx::prefetch_l2_bulk(sc, static_cast<uint32_t>(I / 16));
      }
    }
  }

  // ---- C: (distinct expert u, row i) items: for each token t that picked u, silu(gate_u[i] . x_t) * (up_u[i] . x_t)
  // into the workspace row of its pair
  {
    constexpr int kItems = kKC <= 2 ? 2 : 1;  // items whose loads a warp has in flight together
    const int n_items = NU * I;
    const int64_t row_bytes = H / 2, row_scales = H / 16;
    const int C = H / 32;  // chunks per row
    for (int base = gwarp * kItems; base < n_items; base += nwarps * kItems) {
      uint4 w[kItems][2][kKC];
      uint32_t sc[kItems][2][kKC];
#pragma unroll
      for (int it = 0; it < kItems; ++it) {
        const int item = base + it;
        const int u = item < n_items ? item / I : 0, i = item < n_items ? item % I : 0;
        const ExpertDesc& d = s_desc[u];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int q = 0; q < kKC; ++q) {
            const int c = lane + 32 * q;
            if (item < n_items && c < C) {
              w[it][m][q] = ptx::ld_stream_16(d.data[m] + i * row_bytes + 16 * c);
              sc[it][m][q] = __ldg(reinterpret_cast<const uint16_t*>(d.scales[m] + i * row_scales + 2 * c));
            } else {
              w[it][m][q] = make_uint4(0, 0, 0, 0);
              sc[it][m][q] = 0;
            }
          }
      }
#pragma unroll
      for (int t = 0; t < kT; ++t) {
        if (t >= T) break;
        bool needed = false;  // some item's expert was picked by token t (uniform over the warp)
#pragma unroll
        for (int it = 0; it < kItems; ++it)
          needed |= base + it < n_items && s_upair[(base + it) / I][t] >= 0;
        if (!needed) continue;
        float acc[kItems][2];
#pragma unroll
        for (int it = 0; it < kItems; ++it) acc[it][0] = acc[it][1] = 0.0f;
#pragma unroll
        for (int q = 0; q < kKC; ++q) {
          const int c = lane + 32 * q;
          if (c >= C) break;
          float xv[32];
          load_chunk(xs4 + t * (H / 4), c, xv);
#pragma unroll
          for (int it = 0; it < kItems; ++it)
#pragma unroll
            for (int m = 0; m < 2; ++m)
              acc[it][m] = dot_chunk(w[it][m][q], chunk_scales(sc[it][m][q]), xv, acc[it][m]);
        }
#pragma unroll
        for (int it = 0; it < kItems; ++it) {
          const int item = base + it;
          const float g = warp_sum(acc[it][0]), up = warp_sum(acc[it][1]);
          if (lane == 0 && item < n_items) {
            const int u = item / I, i = item % I;
            const int p = s_upair[u][t];
            if (p >= 0) {
              const ExpertDesc& d = s_desc[u];
              float v = silu(g * d.gscale[0]) * (up * d.gscale[1]);
              if constexpr (kBf16) v = __bfloat162float(__float2bfloat16_rn(v));
              ws_act[p * I + i] = v;
            }
          }
        }
      }
    }
  }
  grid_barrier(a.barrier);

  // ---- D: rows h of the output, every token against the row's one read
  {
    const float4* src = reinterpret_cast<const float4*>(ws_act);
    for (int k4 = tid; k4 < P * I / 4; k4 += kThreads) act4[swz(k4)] = __ldcg(src + k4);
  }
  __syncthreads();
  {
    const int CI = I / 32;    // down chunks per expert row
    const int nC = NU * CI;   // a row's chunks over the step's distinct experts
    const int SV = Is / 8;    // shared down: 16-byte loads of 8 bf16 per row
    const int64_t row_bytes = I / 2, row_scales = I / 16;
    const uint16_t* sdown = static_cast<const uint16_t*>(a.shared_down_proj);
    for (int h = gwarp; h < H; h += nwarps) {
      uint4 sraw[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int v = lane + 32 * q;
        sraw[q] = v < SV ? ptx::ld_stream_16(sdown + int64_t(h) * Is + 8 * v) : make_uint4(0, 0, 0, 0);
      }
      float acc[kT];
#pragma unroll
      for (int t = 0; t < kT; ++t) acc[t] = 0.0f;
      for (int g0 = 0; g0 < nC; g0 += 32 * kDownLoads) {
        uint4 w[kDownLoads];
        uint32_t sc[kDownLoads];
#pragma unroll
        for (int q = 0; q < kDownLoads; ++q) {
          const int g = g0 + lane + 32 * q;
          const int u = g < nC ? g / CI : 0, c = g < nC ? g % CI : 0;
          const ExpertDesc& d = s_desc[u];
          if (g < nC) {
            w[q] = ptx::ld_stream_16(d.data[2] + h * row_bytes + 16 * c);
            sc[q] = __ldg(reinterpret_cast<const uint16_t*>(d.scales[2] + h * row_scales + 2 * c));
          } else {
            w[q] = make_uint4(0, 0, 0, 0);
            sc[q] = 0;
          }
        }
#pragma unroll
        for (int q = 0; q < kDownLoads; ++q) {
          const int g = g0 + lane + 32 * q;
          if (g >= nC) break;
          const int u = g / CI, c = g % CI;
          const uint2 scb = chunk_scales(sc[q]);
#pragma unroll
          for (int t = 0; t < kT; ++t) {
            if (t >= T) break;
            const int p = s_upair[u][t];
            if (p < 0) continue;
            float xv[32];
            load_chunk(act4, p * CI + c, xv);
            acc[t] = fmaf(dot_chunk(w[q], scb, xv, 0.0f), s_coef[p], acc[t]);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < kT; ++t) {
        if (t >= T) break;
        float sacc = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int v = lane + 32 * q;
          if (v >= SV) break;
          // Two float4 per lane (acts rows start 32-byte aligned: Is % 8 == 0), 2-way bank conflicts at most.
          const float4* av = reinterpret_cast<const float4*>(acts + t * Is) + 2 * v;
          const float4 a0 = av[0], a1 = av[1];
          const uint32_t p[4] = {sraw[q].x, sraw[q].y, sraw[q].z, sraw[q].w};
          sacc += a0.x * __uint_as_float(p[0] << 16) + a0.y * __uint_as_float(p[0] & 0xffff0000u) +
                  a0.z * __uint_as_float(p[1] << 16) + a0.w * __uint_as_float(p[1] & 0xffff0000u);
          sacc += a1.x * __uint_as_float(p[2] << 16) + a1.y * __uint_as_float(p[2] & 0xffff0000u) +
                  a1.z * __uint_as_float(p[3] << 16) + a1.w * __uint_as_float(p[3] & 0xffff0000u);
        }
        const float routed = warp_sum(acc[t]);
        sacc = warp_sum(sacc);
        if (lane == 0) a.out[int64_t(t) * H + h] = routed + sacc * s_sig[t];
      }
    }
  }
}

size_t smem_bytes(int64_t T, int64_t H, int top_k, int64_t I, int64_t Is) {
  return sizeof(float) * static_cast<size_t>(T * H + T * top_k * I + T * Is);
}

template <int kKC, bool kBf16>
void launch_one(const MoeBlockArgs& a, int grid, Stream stream) {
  const size_t smem = smem_bytes(a.T, a.H, a.top_k, a.I, a.Is);
  if (a.T == 1) launch_kernel(moe_block_decode_kernel<kKC, kBf16, 1>, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                              smem, stream, a);
  else launch_kernel(moe_block_decode_kernel<kKC, kBf16, kMaxT>, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                     smem, stream, a);
  KILN_CUDA_CHECK_LAUNCH();
}

template <int kKC, bool kBf16, int kT>
void set_smem_limit(int& per_sm) {
  const int n = allow_smem(moe_block_decode_kernel<kKC, kBf16, kT>, kMaxSmem);
  per_sm = per_sm < 0 ? n : std::min(per_sm, n);
}
template <int kKC>
void set_smem_limits(int& per_sm) {
  set_smem_limit<kKC, false, 1>(per_sm);
  set_smem_limit<kKC, true, 1>(per_sm);
  set_smem_limit<kKC, false, kMaxT>(per_sm);
  set_smem_limit<kKC, true, kMaxT>(per_sm);
}

}  // namespace

bool moe_block_decode_supported(int64_t T, int64_t H, int64_t E, int64_t Is, int64_t I, int top_k) {
  return T >= 1 && T <= kMaxT && H >= 32 && H % 32 == 0 && H <= kMaxH && E >= 1 && E <= kMaxE && top_k >= 1 &&
         top_k <= kMaxTopK && top_k <= E && I >= 32 && I <= kMaxI && I % 32 == 0 && Is >= 8 && Is <= kMaxIs &&
         Is % 8 == 0 && smem_bytes(T, H, top_k, I, Is) <= static_cast<size_t>(kMaxSmem);
}

size_t moe_block_decode_workspace_bytes(int64_t T, int64_t E, int64_t Is, int top_k, int64_t I) {
  return sizeof(float) * static_cast<size_t>(T * ((E + 2 * Is + 1 + 3) & ~int64_t(3)) + T * top_k * I);
}

int moe_block_decode_grid(int device) {
  int sms = 0, per_sm = -1;
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Every instance may take kMaxSmem of shared memory (set here, on the caller's current device, once per CudaOps:
  // never while a stream is being captured); one block per multiprocessor must fit.
  set_smem_limits<1>(per_sm);
  set_smem_limits<2>(per_sm);
  set_smem_limits<3>(per_sm);
  set_smem_limits<4>(per_sm);
  return per_sm >= 1 ? sms : 0;
}

void moe_block_decode(const MoeBlockArgs& a, int grid, Stream stream) {
  if (!moe_block_decode_supported(a.T, a.H, a.E, a.Is, a.I, a.top_k) || grid < 1)
    cuda_fail("moe_block_decode: T {} H {} E {} Is {} I {} top_k {} grid {} outside the kernel's shapes",
              {a.T, a.H, a.E, a.Is, a.I, a.top_k, grid});
  const bool bf16 = a.bf16_expert_inputs;
  switch ((a.H + 1023) / 1024) {
    case 1: bf16 ? launch_one<1, true>(a, grid, stream) : launch_one<1, false>(a, grid, stream); break;
    case 2: bf16 ? launch_one<2, true>(a, grid, stream) : launch_one<2, false>(a, grid, stream); break;
    case 3: bf16 ? launch_one<3, true>(a, grid, stream) : launch_one<3, false>(a, grid, stream); break;
    default: bf16 ? launch_one<4, true>(a, grid, stream) : launch_one<4, false>(a, grid, stream); break;
  }
}

}  // namespace kiln::cuda::ops
