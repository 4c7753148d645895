// MoE routing and combine: softmax + top-k per token (one warp per token), grouping of the (token, slot)
// pairs by expert (one block: shared-memory histogram, scans, scatter), and the weighted combine of
// the experts' outputs with the shared expert. The expert FFN itself is in nvfp4.cu.
#include <cuda_bf16.h>

#include <algorithm>
#include <cfloat>
#include <climits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

using namespace dev;

constexpr int kMaxExperts = 1024;  // the plan kernel gives one thread per expert
constexpr int kMaxTopK = 32;
constexpr int kRoutePerLane = kMaxExperts / 32;
constexpr int kGemmTileM = 128;  // must match the GEMM's pair tile (nvfp4.cu kBM)

// One warp per token.
__global__ void route_topk_kernel(const float* __restrict__ logits, int64_t ld, int T, int E, int k,
                                  bool renormalize, int* __restrict__ ids, float* __restrict__ weights) {
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= T) return;
  const float* row = logits + int64_t(t) * ld;
  float v[kRoutePerLane];
  float mx = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? row[e] : -FLT_MAX;
    if (v[i] != v[i]) v[i] = -FLT_MAX;  // NaN logits never win
    mx = fmaxf(mx, v[i]);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kRoutePerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? expf(v[i] - mx) : -1.0f;  // probabilities are >= 0; -1 marks "no expert"
    if (e < E) sum += v[i];
  }
  sum = warp_sum(sum);
  const float inv = 1.0f / sum;

  float picked_sum = 0.0f, my_w = 0.0f;
  int my_id = 0;
  for (int j = 0; j < k; ++j) {
    float best = -2.0f;
    int best_e = INT_MAX;
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i) {
      const int e = lane + 32 * i;
      if (v[i] > best) {  // strict: lowest index wins ties within a lane (indices ascend)
        best = v[i];
        best_e = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
    const float w = best * inv;
    picked_sum += w;
    if (lane == j) {
      my_w = w;
      my_id = best_e;
    }
#pragma unroll
    for (int i = 0; i < kRoutePerLane; ++i)
      if (lane + 32 * i == best_e) v[i] = -2.0f;
  }
  if (lane < k) {
    ids[int64_t(t) * k + lane] = my_id;
    weights[int64_t(t) * k + lane] = renormalize ? my_w / picked_sum : my_w;
  }
}

// Exclusive block scan of one int per thread (blockDim.x <= 1024); returns the total via *total.
__device__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    if (lane < nwarps) warp_sums[lane] = s;  // inclusive prefix of warp totals
    if (lane == 31) *total = s;
  }
  __syncthreads();
  const int before = warp == 0 ? 0 : warp_sums[warp - 1];
  const int result = before + x - v;
  __syncthreads();  // warp_sums reused by the next scan
  return result;
}

// One block of max(E, 32) rounded to a warp multiple threads.
__global__ void plan_kernel(const int* __restrict__ ids, int pairs, int E, int k, int* __restrict__ group_expert,
                            int* __restrict__ group_offset, int* __restrict__ group_tile_offset,
                            int* __restrict__ num_groups, int* __restrict__ sorted_token,
                            int* __restrict__ pair_pos) {
  __shared__ int count[kMaxExperts];
  __shared__ int cursor[kMaxExperts];
  __shared__ int warp_sums[32];
  __shared__ int totals[3];
  const int e = threadIdx.x;
  if (e < E) count[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) atomicAdd(&count[ids[i]], 1);
  __syncthreads();
  const int c = e < E ? count[e] : 0;
  const int offset = block_exclusive_scan(c, warp_sums, &totals[0]);
  const int gidx = block_exclusive_scan(c > 0 ? 1 : 0, warp_sums, &totals[1]);
  const int tile = block_exclusive_scan((c + kGemmTileM - 1) / kGemmTileM, warp_sums, &totals[2]);
  if (c > 0) {
    group_expert[gidx] = e;
    group_offset[gidx] = offset;
    group_tile_offset[gidx] = tile;
  }
  if (e < E) cursor[e] = offset;
  if (threadIdx.x == 0) {
    *num_groups = totals[1];
    group_offset[totals[1]] = pairs;
    group_tile_offset[totals[1]] = totals[2];
  }
  __syncthreads();
  // Order inside a group depends on atomics; every pair's result is computed independently of its
  // position, so outputs do not.
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int pos = atomicAdd(&cursor[ids[i]], 1);
    sorted_token[pos] = i / k;
    pair_pos[i] = pos;
  }
}

// grid: T; each thread 8 hidden elements per iteration.
__global__ void combine_kernel(const uint16_t* __restrict__ y, const int* __restrict__ pair_pos,
                               const float* __restrict__ topk_w, int k, int H, const uint16_t* __restrict__ shared,
                               int64_t ld_shared, const float* __restrict__ shared_gate, int64_t ld_gate,
                               uint16_t* __restrict__ out, int64_t ldo) {
  const int t = blockIdx.x;
  __shared__ int rows[kMaxTopK];
  __shared__ float ws[kMaxTopK];
  if (threadIdx.x < k) {
    rows[threadIdx.x] = pair_pos[int64_t(t) * k + threadIdx.x];
    ws[threadIdx.x] = topk_w[int64_t(t) * k + threadIdx.x];
  }
  __syncthreads();
  const float sg = shared_gate ? sigmoid(shared_gate[int64_t(t) * ld_gate]) : 0.0f;
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
    float acc[8] = {};
    for (int j = 0; j < k; ++j) {
      const uint4 v = *reinterpret_cast<const uint4*>(y + int64_t(rows[j]) * H + c * 8);
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] += ws[j] * bf16_lo(u[i]);
        acc[2 * i + 1] += ws[j] * bf16_hi(u[i]);
      }
    }
    if (shared) {
      const uint4 v = *reinterpret_cast<const uint4*>(shared + int64_t(t) * ld_shared + c * 8);
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] += sg * bf16_lo(u[i]);
        acc[2 * i + 1] += sg * bf16_hi(u[i]);
      }
    }
    uint4 o;
    o.x = pack_bf16x2(acc[0], acc[1]);
    o.y = pack_bf16x2(acc[2], acc[3]);
    o.z = pack_bf16x2(acc[4], acc[5]);
    o.w = pack_bf16x2(acc[6], acc[7]);
    *reinterpret_cast<uint4*>(out + int64_t(t) * ldo + c * 8) = o;
  }
}

size_t align256(size_t v) { return (v + 255) & ~size_t(255); }

}  // namespace

size_t moe_routing_bytes(int max_tokens, int E, int k) {
  const size_t P = size_t(max_tokens) * k;
  return align256(P * 4) * 2 + align256(size_t(E) * 4) + align256(size_t(E + 1) * 4) * 2 + align256(4) +
         align256(P * 4) * 2;
}

MoeRouting moe_routing_carve(void* mem, int max_tokens, int E, int k) {
  if (E > kMaxExperts || k > kMaxTopK || k > E || k <= 0)
    cuda_fail("MoE routing supports up to {} experts and top-k up to {} (got {} experts, top-k {})", {kMaxExperts,
         kMaxTopK, E, k});
  const size_t P = size_t(max_tokens) * k;
  char* p = static_cast<char*>(mem);
  auto take = [&](size_t bytes) {
    char* r = p;
    p += align256(bytes);
    return r;
  };
  MoeRouting r;
  r.topk_ids = reinterpret_cast<int*>(take(P * 4));
  r.topk_weights = reinterpret_cast<float*>(take(P * 4));
  r.group_expert = reinterpret_cast<int*>(take(size_t(E) * 4));
  r.group_offset = reinterpret_cast<int*>(take(size_t(E + 1) * 4));
  r.group_tile_offset = reinterpret_cast<int*>(take(size_t(E + 1) * 4));
  r.num_groups = reinterpret_cast<int*>(take(4));
  r.sorted_token = reinterpret_cast<int*>(take(P * 4));
  r.pair_pos = reinterpret_cast<int*>(take(P * 4));
  r.max_tokens = max_tokens;
  r.num_experts = E;
  r.top_k = k;
  return r;
}

void moe_route(const float* logits, int64_t ld_logits, int T, bool renormalize, const MoeRouting& r,
               Stream stream) {
  if (T <= 0) return;
  if (T > r.max_tokens) cuda_fail("moe_route: {} tokens but the routing was sized for {}", {T, r.max_tokens});
  const int E = r.num_experts, k = r.top_k;
  constexpr int kWarps = 8;
  route_topk_kernel<<<(T + kWarps - 1) / kWarps, kWarps * 32, 0, stream>>>(logits, ld_logits, T, E, k, renormalize,
                                                                           r.topk_ids, r.topk_weights);
  KILN_CUDA_CHECK_LAUNCH();
  const int threads = std::max(32, (E + 31) / 32 * 32);
  plan_kernel<<<1, threads, 0, stream>>>(r.topk_ids, T * k, E, k, r.group_expert, r.group_offset,
                                         r.group_tile_offset, r.num_groups, r.sorted_token, r.pair_pos);
  KILN_CUDA_CHECK_LAUNCH();
}

void moe_combine(const uint16_t* y, const MoeRouting& r, int T, int H, const uint16_t* shared, int64_t ld_shared,
                 const float* shared_gate, int64_t ld_gate, uint16_t* out, int64_t ldo, Stream stream) {
  if (T <= 0) return;
  if (H % 8 != 0) cuda_fail("moe_combine: hidden size must be a multiple of 8 (got {})", {H});
  combine_kernel<<<T, 256, 0, stream>>>(y, r.pair_pos, r.topk_weights, r.top_k, H, shared, ld_shared, shared_gate,
                                        ld_gate, out, ldo);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
