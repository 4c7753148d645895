// Decode-shaped attention and the KV store: the paged KV store (a thread per stored element) and causal GQA attention
// over the pool (keys split over blocks, a warp per key with lanes over the head dims, online softmax, partial
// results merged). Any step shape; CudaOps sends prefill-shaped steps to attention_prefill.cu where it serves them.
#include <cuda_fp8.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;

// ---- KV store: a thread per stored element

// inv_scale: 1 / scale, multiplied as the CPU backend does (stored = e4m3(value * (1 / scale))).
__device__ __forceinline__ void store_pool(void* pool, ElemType elem, int64_t i, float v, float inv_scale) {
  switch (elem) {
    case ElemType::f32: static_cast<float*>(pool)[i] = v; break;
    case ElemType::bf16: {
      // round to nearest even, NaN kept (as the CPU's f32_to_bf16)
      static_cast<uint16_t*>(pool)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
      break;
    }
    case ElemType::e4m3:
      static_cast<uint8_t*>(pool)[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v * inv_scale, __NV_SATFINITE, __NV_E4M3));
      break;
    case ElemType::f16: static_cast<uint16_t*>(pool)[i] = __half_as_ushort(__float2half_rn(v)); break;
  }
}

__global__ void kv_store_kernel(const float* __restrict__ k, const float* __restrict__ v, KvPoolArgs pool,
                                StepArgs step) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t row_elems = int64_t(pool.kv_heads) * pool.head_dim;
  const int64_t total = int64_t(step.num_tokens) * row_elems;
  const float k_inv = 1.0f / pool.k_scale, v_inv = 1.0f / pool.v_scale;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(i / row_elems);
    const int64_t e = i % row_elems;
    const int64_t row = kv_pool_row(step, seq_of_token(step, t), step.token_pos[t]);
    if (row < 0) continue;
    store_pool(pool.k, pool.elem, row * row_elems + e, k[i], k_inv);
    store_pool(pool.v, pool.elem, row * row_elems + e, v[i], v_inv);
  }
}

// ---- attention

constexpr int kMaxHeadDim = 512;

__device__ __forceinline__ float pool_at(const void* pool, ElemType elem, int64_t i, float scale) {
  return elem == ElemType::e4m3 ? e4m3_to_f32(static_cast<const uint8_t*>(pool)[i]) * scale : load_elem(pool, elem, i);
}

// ---- attention, split over keys (flash-decoding style; every T): grid (T, q_heads, splits), 4 warps per block.
// A warp takes every 4th key of the block's range: lanes hold dims lane, lane + 32, ... of q, the dot product is a
// warp sum, and the warp keeps its own running max / sum / output; the block merges its warps, then either writes
// the output (one split) or a partial (max, sum, acc) that attention_merge_kernel combines.

constexpr int kSplitWarps = 4;
constexpr int kMaxDimsPerLane = kMaxHeadDim / 32;

// One step of a warp's online softmax over kKeys scores (a key that is not `valid` has score -inf and weight 0), with
// at least one valid key: the running max m moves to the new max, the running sum l is rescaled and takes the keys'
// weights p; returns the factor the running output must be rescaled by.
template <int kKeys>
__device__ __forceinline__ float online_softmax_step(const float (&score)[kKeys], const bool (&valid)[kKeys], float mt,
                                                     float& m, float& l, float (&p)[kKeys]) {
  const float new_m = fmaxf(m, mt);
  const float corr = m == -INFINITY ? 0.0f : expf(m - new_m);
  l *= corr;
#pragma unroll
  for (int u = 0; u < kKeys; ++u) {
    p[u] = valid[u] ? expf(score[u] - new_m) : 0.0f;
    l += p[u];
  }
  m = new_m;
  return corr;
}

// The block's epilogue, once every warp has written its running max / sum (sm_m, sm_l) and output (sm_acc rows of
// kAccStride): the warps merged in warp order, then the output (one split) or this split's partial (max, sum, acc)
// for attention_merge_kernel. th: the (token, head) row.
template <int kAccStride>
__device__ __forceinline__ void merge_warps_and_store(const float (&sm_m)[kSplitWarps], const float (&sm_l)[kSplitWarps],
                                                      const float (&sm_acc)[kSplitWarps][kAccStride], int D,
                                                      int64_t th, int sp, int splits, float* __restrict__ part_ml,
                                                      float* __restrict__ part_acc, float* __restrict__ out) {
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < kSplitWarps; ++w) M = fmaxf(M, sm_m[w]);
  float L = 0.0f, f[kSplitWarps];
#pragma unroll
  for (int w = 0; w < kSplitWarps; ++w) {
    f[w] = sm_m[w] == -INFINITY ? 0.0f : expf(sm_m[w] - M);
    L += sm_l[w] * f[w];
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < kSplitWarps; ++w) a += sm_acc[w][d] * f[w];
    if (splits == 1) out[th * D + d] = L > 0.0f ? a / L : 0.0f;
    else part_acc[(th * splits + sp) * D + d] = a;
  }
  if (splits > 1 && threadIdx.x == 0) {
    part_ml[(th * splits + sp) * 2] = M;
    part_ml[(th * splits + sp) * 2 + 1] = L;
  }
}

__global__ void __launch_bounds__(kSplitWarps * 32) attention_split_kernel(
    const float* __restrict__ q, int q_heads, KvPoolArgs pool, StepArgs step, float scale, int keys_per_split,
    float* __restrict__ part_ml, float* __restrict__ part_acc, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  __shared__ float sm_m[kSplitWarps], sm_l[kSplitWarps];
  __shared__ float sm_acc[kSplitWarps][kMaxHeadDim];
  const int t = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int D = pool.head_dim, kvh = h / (q_heads / pool.kv_heads);
  const int s = seq_of_token(step, t);
  const int n_keys = step.token_pos[t] + 1;
  const int j_begin = sp * keys_per_split, j_end = min(n_keys, j_begin + keys_per_split);
  const int64_t row_elems = int64_t(pool.kv_heads) * D;
  float qv[kMaxDimsPerLane], acc[kMaxDimsPerLane];
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < D ? q[(int64_t(t) * q_heads + h) * D + d] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  constexpr int kKeys = 4;  // keys in flight per warp
  for (int j0 = j_begin + warp * kKeys; j0 < j_end; j0 += kSplitWarps * kKeys) {
    int64_t base[kKeys];
    bool ok[kKeys];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      const int j = j0 + u;
      const int64_t row = j < j_end ? kv_pool_row(step, s, j) : -1;
      base[u] = row < 0 ? -1 : row * row_elems + int64_t(kvh) * D;
      ok[u] = base[u] >= 0;
    }
    float score[kKeys];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      float dot = 0.0f;
      if (base[u] >= 0) {
#pragma unroll
        for (int i = 0; i < kMaxDimsPerLane; ++i) {
          const int d = lane + 32 * i;
          if (d < D) dot += qv[i] * pool_at(pool.k, pool.elem, base[u] + d, pool.k_scale);
        }
      }
      score[u] = dot;
    }
    float mt = -INFINITY;
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      score[u] = base[u] >= 0 ? warp_sum(score[u]) * scale : -INFINITY;  // base is uniform over the warp
      mt = fmaxf(mt, score[u]);
    }
    if (mt == -INFINITY) continue;
    float p[kKeys];
    const float corr = online_softmax_step(score, ok, mt, m, l, p);
#pragma unroll
    for (int i = 0; i < kMaxDimsPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < D) {
        float a = acc[i] * corr;
#pragma unroll
        for (int u = 0; u < kKeys; ++u)
          if (ok[u]) a += p[u] * pool_at(pool.v, pool.elem, base[u] + d, pool.v_scale);
        acc[i] = a;
      }
    }
  }
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kMaxDimsPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < D) sm_acc[warp][d] = acc[i];
  }
  merge_warps_and_store(sm_m, sm_l, sm_acc, D, int64_t(t) * q_heads + h, sp, splits, part_ml, part_acc, out);
}

// The same kernel for the common pools (f32 / bf16 / e4m3, head_dim 32 x kDPL with kDPL 4, 8 or 16): lane l owns
// the contiguous dims [l * kDPL, (l + 1) * kDPL), every load is unconditional (a key without a page reads row 0 and
// is masked), so the K rows of a warp's 4 keys are all in flight at once.
template <int kElem, int kDPL>  // kElem: 0 f32, 1 bf16, 3 e4m3 (ElemType)
__device__ __forceinline__ void load_dims(const void* pool, int64_t e0, float scale, float (&v)[kDPL]) {
#pragma unroll
  for (int c = 0; c < kDPL; c += 4) {
    if constexpr (kElem == 0) {
      const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(pool) + e0 + c);
      v[c] = f.x; v[c + 1] = f.y; v[c + 2] = f.z; v[c + 3] = f.w;
    } else if constexpr (kElem == 1) {
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(pool) + e0 + c);
      v[c] = __uint_as_float(u.x << 16); v[c + 1] = __uint_as_float(u.x & 0xffff0000u);
      v[c + 2] = __uint_as_float(u.y << 16); v[c + 3] = __uint_as_float(u.y & 0xffff0000u);
    } else {
      const uint32_t u = *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(pool) + e0 + c);
#pragma unroll
      for (int b = 0; b < 4; ++b) v[c + b] = e4m3_to_f32((u >> (8 * b)) & 0xffu) * scale;
    }
  }
}

template <int kElem, int kDPL>
__global__ void __launch_bounds__(kSplitWarps * 32) attention_split_vec_kernel(
    const float* __restrict__ q, int q_heads, KvPoolArgs pool, StepArgs step, float scale, int keys_per_split,
    float* __restrict__ part_ml, float* __restrict__ part_acc, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  constexpr int D = 32 * kDPL;
  constexpr int kKeys = 4;
  __shared__ float sm_m[kSplitWarps], sm_l[kSplitWarps];
  __shared__ float sm_acc[kSplitWarps][D];
  const int t = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kvh = h / (q_heads / pool.kv_heads);
  const int s = seq_of_token(step, t);
  const int n_keys = step.token_pos[t] + 1;
  const int j_begin = sp * keys_per_split, j_end = min(n_keys, j_begin + keys_per_split);
  const int64_t row_elems = int64_t(pool.kv_heads) * D;
  const int64_t head_off = int64_t(kvh) * D + lane * kDPL;
  float qv[kDPL], acc[kDPL];
  {
    const float* qp = q + (int64_t(t) * q_heads + h) * D + lane * kDPL;
#pragma unroll
    for (int i = 0; i < kDPL; ++i) {
      qv[i] = qp[i];
      acc[i] = 0.0f;
    }
  }
  float m = -INFINITY, l = 0.0f;
  for (int j0 = j_begin + warp * kKeys; j0 < j_end; j0 += kSplitWarps * kKeys) {
    int64_t rows[kKeys];
    bool ok[kKeys];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      const int j = j0 + u;
      const int64_t row = j < j_end ? kv_pool_row(step, s, j) : -1;
      ok[u] = row >= 0;
      rows[u] = ok[u] ? row : 0;
    }
    float kv[kKeys][kDPL];
#pragma unroll
    for (int u = 0; u < kKeys; ++u) load_dims<kElem, kDPL>(pool.k, rows[u] * row_elems + head_off, pool.k_scale, kv[u]);
    float score[kKeys];
    float mt = -INFINITY;
#pragma unroll
    for (int u = 0; u < kKeys; ++u) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < kDPL; ++i) dot += qv[i] * kv[u][i];
      dot = warp_sum(dot) * scale;
      score[u] = ok[u] ? dot : -INFINITY;
      mt = fmaxf(mt, score[u]);
    }
#pragma unroll
    for (int u = 0; u < kKeys; ++u) load_dims<kElem, kDPL>(pool.v, rows[u] * row_elems + head_off, pool.v_scale, kv[u]);
    if (mt == -INFINITY) continue;  // uniform over the warp
    float p[kKeys];
    const float corr = online_softmax_step(score, ok, mt, m, l, p);
#pragma unroll
    for (int i = 0; i < kDPL; ++i) {
      float a = acc[i] * corr;
#pragma unroll
      for (int u = 0; u < kKeys; ++u) a += p[u] * kv[u][i];
      acc[i] = a;
    }
  }
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kDPL; ++i) sm_acc[warp][lane * kDPL + i] = acc[i];
  merge_warps_and_store(sm_m, sm_l, sm_acc, D, int64_t(t) * q_heads + h, sp, splits, part_ml, part_acc, out);
}

template <int kDPL>
bool launch_attention_split_vec(dim3 grid, Stream stream, const float* q, int q_heads, const KvPoolArgs& pool,
                           const StepArgs& step, float scale, int kps, float* ml, float* acc, float* out) {
  switch (pool.elem) {
    case ElemType::f32: launch_kernel(attention_split_vec_kernel<0, kDPL>, grid, kSplitWarps * 32, 0, stream, q, q_heads, pool, step, scale, kps, ml, acc, out); return true;
    case ElemType::bf16: launch_kernel(attention_split_vec_kernel<1, kDPL>, grid, kSplitWarps * 32, 0, stream, q, q_heads, pool, step, scale, kps, ml, acc, out); return true;
    case ElemType::e4m3: launch_kernel(attention_split_vec_kernel<3, kDPL>, grid, kSplitWarps * 32, 0, stream, q, q_heads, pool, step, scale, kps, ml, acc, out); return true;
    default: return false;
  }
}

__global__ void attention_merge_kernel(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                                       int q_heads, int D, int splits, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t th = int64_t(blockIdx.x) * q_heads + blockIdx.y;
  const float* ml = part_ml + th * splits * 2;
  float M = -INFINITY;
  for (int sp = 0; sp < splits; ++sp) M = fmaxf(M, ml[2 * sp]);
  float L = 0.0f;
  for (int sp = 0; sp < splits; ++sp)
    if (ml[2 * sp] != -INFINITY) L += ml[2 * sp + 1] * expf(ml[2 * sp] - M);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.0f;
    for (int sp = 0; sp < splits; ++sp)
      if (ml[2 * sp] != -INFINITY) a += part_acc[(th * splits + sp) * D + d] * expf(ml[2 * sp] - M);
    out[th * D + d] = L > 0.0f ? a / L : 0.0f;
  }
}

}  // namespace

void kv_store(const float* k, const float* v, const KvPoolArgs& pool, const StepArgs& step, Stream stream) {
  const int64_t total = int64_t(step.num_tokens) * pool.kv_heads * pool.head_dim;
  if (total == 0) return;
  const int64_t blocks = (total + 255) / 256;
  launch_kernel(kv_store_kernel, static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream, k, v, pool, step);
  KILN_CUDA_CHECK_LAUNCH();
}

int attention_splits(int64_t T, int64_t q_heads, const StepArgs& step) {
  // Enough blocks to fill the GPU (~2 per SM) with at least 64 keys a split; the key range is bounded by the page
  // table's width (host-known), so a captured graph's grid serves every shorter context.
  const int64_t max_keys = int64_t(step.max_pages) * step.page_size;
  const int64_t blocks = T * q_heads;
  int64_t splits = blocks >= 264 ? 1 : (264 + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, (max_keys + 63) / 64));
  return static_cast<int>(std::min<int64_t>(splits, 64));
}

size_t attention_workspace_bytes(int64_t T, int64_t q_heads, int64_t head_dim, const StepArgs& step) {
  const int splits = attention_splits(T, q_heads, step);
  if (splits == 1) return 0;
  return static_cast<size_t>(T * q_heads * splits) * (2 + head_dim) * sizeof(float);
}

void attention(const float* q, int64_t q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale, float* out,
               void* workspace, Stream stream) {
  if (step.num_tokens == 0) return;
  if (pool.head_dim > kMaxHeadDim) cuda_fail("attention: head_dim {} is not supported (at most {})", {pool.head_dim, kMaxHeadDim});
  const int64_t T = step.num_tokens;
  const int splits = attention_splits(T, q_heads, step);
  const int64_t max_keys = int64_t(step.max_pages) * step.page_size;
  const int keys_per_split = static_cast<int>((max_keys + splits - 1) / splits);
  float* part_ml = static_cast<float*>(workspace);
  float* part_acc = part_ml ? part_ml + T * q_heads * splits * 2 : nullptr;
  if (splits > 1 && !workspace) cuda_fail("attention: no workspace for {} splits", {splits});
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(q_heads), static_cast<unsigned>(splits));
  const int qh = static_cast<int>(q_heads);
  bool launched = false;
  switch (pool.head_dim) {
    case 128: launched = launch_attention_split_vec<4>(grid, stream, q, qh, pool, step, scale, keys_per_split, part_ml, part_acc, out); break;
    case 256: launched = launch_attention_split_vec<8>(grid, stream, q, qh, pool, step, scale, keys_per_split, part_ml, part_acc, out); break;
    case 512: launched = launch_attention_split_vec<16>(grid, stream, q, qh, pool, step, scale, keys_per_split, part_ml, part_acc, out); break;
    default: break;
  }
  if (!launched)
    launch_kernel(attention_split_kernel, grid, kSplitWarps * 32, 0, stream, q, qh, pool, step, scale, keys_per_split, part_ml,
                                                                   part_acc, out);
  KILN_CUDA_CHECK_LAUNCH();
  if (splits > 1) {
    launch_kernel(attention_merge_kernel, dim3(static_cast<unsigned>(T), static_cast<unsigned>(q_heads)), 128, 0, stream, part_ml, part_acc, static_cast<int>(q_heads), pool.head_dim, splits, out);
    KILN_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace kiln::cuda::ops
