// CudaOps kernels with per-sequence state: the paged KV store, causal GQA attention over the pool (a block
// per (token, query head), keys in tiles of 128 with an online softmax), and the gated delta rule (the
// recurrence, a block per (sequence, value head, 32 value columns) holding its slice of the state in registers).
#include <cuda_fp8.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops_device.cuh"
#include "backend/cuda/cuda_ops_kernels.h"

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

constexpr int kAttnThreads = 128;  // keys per tile, and threads per block
constexpr int kMaxHeadDim = 512;
constexpr int kDimsPerThread = kMaxHeadDim / kAttnThreads;

__device__ __forceinline__ float pool_at(const void* pool, ElemType elem, int64_t i, float scale) {
  return elem == ElemType::e4m3 ? e4m3_to_f32(static_cast<const uint8_t*>(pool)[i]) * scale : load_elem(pool, elem, i);
}

// grid (T, q_heads). Each thread scores one key of the tile, then accumulates dims tid, tid + 128, ... of the
// output over the tile's keys. Softmax with a running max and sum; out = acc / sum at the end.
__global__ void attention_kernel(const float* __restrict__ q, int q_heads, KvPoolArgs pool, StepArgs step, float scale,
                                 float* __restrict__ out) {
  __shared__ float qs[kMaxHeadDim];
  __shared__ float probs[kAttnThreads];
  __shared__ int64_t rows[kAttnThreads];
  __shared__ float red[32];
  const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int D = pool.head_dim, kvh = h / (q_heads / pool.kv_heads);
  const int s = seq_of_token(step, t);
  const int n_keys = step.token_pos[t] + 1;
  const int64_t row_elems = int64_t(pool.kv_heads) * D;
  for (int d = tid; d < D; d += kAttnThreads) qs[d] = q[(int64_t(t) * q_heads + h) * D + d];
  __syncthreads();

  float acc[kDimsPerThread];
#pragma unroll
  for (int i = 0; i < kDimsPerThread; ++i) acc[i] = 0.0f;
  float run_max = -INFINITY, run_sum = 0.0f;
  for (int j0 = 0; j0 < n_keys; j0 += kAttnThreads) {
    const int j = j0 + tid;
    float score = -INFINITY;
    int64_t row = -1;
    if (j < n_keys) {
      row = kv_pool_row(step, s, j);
      if (row >= 0) {
        const int64_t base = row * row_elems + int64_t(kvh) * D;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += qs[d] * pool_at(pool.k, pool.elem, base + d, pool.k_scale);
        score = dot * scale;
      }
    }
    const float tile_max = block_max(score, red);
    const float new_max = fmaxf(run_max, tile_max);
    // A tile whose keys all lack a page contributes nothing (new_max stays -inf only if nothing was seen yet).
    const float p = (score == -INFINITY) ? 0.0f : expf(score - new_max);
    const float correction = (run_max == -INFINITY) ? 0.0f : expf(run_max - new_max);
    probs[tid] = p;
    rows[tid] = row;
    const float tile_sum = block_sum(p, red);  // also orders the probs / rows writes before the reads below
    run_sum = run_sum * correction + tile_sum;
    run_max = new_max;
    const int n_tile = min(kAttnThreads, n_keys - j0);
#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) {
      const int d = tid + i * kAttnThreads;
      if (d >= D) break;
      float a = acc[i] * correction;
      for (int jj = 0; jj < n_tile; ++jj) {
        if (rows[jj] < 0) continue;
        a += probs[jj] * pool_at(pool.v, pool.elem, rows[jj] * row_elems + int64_t(kvh) * D + d, pool.v_scale);
      }
      acc[i] = a;
    }
    __syncthreads();  // probs / rows are rewritten by the next tile
  }
  const float inv = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
#pragma unroll
  for (int i = 0; i < kDimsPerThread; ++i) {
    const int d = tid + i * kAttnThreads;
    if (d < D) out[(int64_t(t) * q_heads + h) * D + d] = acc[i] * inv;
  }
}

// ---- gated delta rule

// q, k [T, Hk, Dk] -> L2-normalised (x * rsqrt(sum x^2 + 1e-6)), q also / sqrt(Dk). A warp per vector.
__global__ void l2norm_qk_kernel(const float* __restrict__ q, const float* __restrict__ k, int64_t vectors, int64_t Dk,
                                 float* __restrict__ qn, float* __restrict__ kn) {
  const int64_t vec = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (vec >= 2 * vectors) return;
  const bool is_q = vec < vectors;
  const float* src = (is_q ? q : k) + (is_q ? vec : vec - vectors) * Dk;
  float* dst = (is_q ? qn : kn) + (is_q ? vec : vec - vectors) * Dk;
  float ss = 0.0f;
  for (int64_t i = lane; i < Dk; i += 32) ss += src[i] * src[i];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss + 1e-6f);
  const float q_scale = sqrtf(static_cast<float>(Dk));
  for (int64_t i = lane; i < Dk; i += 32) dst[i] = is_q ? (src[i] * inv) / q_scale : src[i] * inv;
}

constexpr int kDeltaWarps = 8;        // key rows are spread over the warps: row i lives in warp i % 8
constexpr int kDeltaRowsPerThread = 32;  // Dk <= 8 * 32 = 256

// grid (S, Hv, ceil(Dv / 32)), block 8 warps. Lane l of every warp owns value column j = 32 * blockIdx.z + l; warp
// w holds S[i][j] for i = w, w + 8, ... in registers. Per token: S *= exp(g); kv = sum_i S[i][j] k[i] (partial sums
// per warp, added in warp order); delta = (v[j] - kv) * beta; S[i][j] += k[i] delta; out[j] = sum_i S[i][j] q[i].
__global__ void __launch_bounds__(kDeltaWarps * 32)
    delta_rule_kernel(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ v,
                      const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state, int Hk,
                      int Hv, int Dk, int Dv, StepArgs step, float* __restrict__ out) {
  __shared__ float q_s[kDeltaWarps * kDeltaRowsPerThread];
  __shared__ float k_s[kDeltaWarps * kDeltaRowsPerThread];
  __shared__ float red_kv[kDeltaWarps][32];
  __shared__ float red_o[kDeltaWarps][32];
  const int s = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = blockIdx.z * 32 + lane;
  const bool col_ok = j < Dv;
  const int kh = h / (Hv / Hk);
  float* S = state + (int64_t(step.seq_state_slot[s]) * Hv + h) * Dk * Dv;

  float sv[kDeltaRowsPerThread];
#pragma unroll
  for (int r = 0; r < kDeltaRowsPerThread; ++r) {
    const int i = warp + kDeltaWarps * r;
    sv[r] = (col_ok && i < Dk) ? S[int64_t(i) * Dv + j] : 0.0f;
  }
  const int b = step.seq_token_begin[s], e = step.seq_token_begin[s + 1];
  for (int t = b; t < e; ++t) {
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
      q_s[i] = qn[(int64_t(t) * Hk + kh) * Dk + i];
      k_s[i] = kn[(int64_t(t) * Hk + kh) * Dk + i];
    }
    __syncthreads();
    const float decay = expf(g[int64_t(t) * Hv + h]);
    const float bt = beta[int64_t(t) * Hv + h];
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < kDeltaRowsPerThread; ++r) {
      const int i = warp + kDeltaWarps * r;
      if (i < Dk) {
        sv[r] *= decay;
        part += sv[r] * k_s[i];
      }
    }
    red_kv[warp][lane] = part;
    __syncthreads();
    float kv = 0.0f;
#pragma unroll
    for (int w = 0; w < kDeltaWarps; ++w) kv += red_kv[w][lane];
    const float vj = col_ok ? v[(int64_t(t) * Hv + h) * Dv + j] : 0.0f;
    const float delta = (vj - kv) * bt;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < kDeltaRowsPerThread; ++r) {
      const int i = warp + kDeltaWarps * r;
      if (i < Dk) {
        sv[r] += k_s[i] * delta;
        o += sv[r] * q_s[i];
      }
    }
    red_o[warp][lane] = o;
    __syncthreads();
    if (warp == 0 && col_ok) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kDeltaWarps; ++w) sum += red_o[w][lane];
      out[(int64_t(t) * Hv + h) * Dv + j] = sum;
    }
    // The next token's q_s / k_s / red_kv writes come after this token's reads: every thread has passed the
    // red_o barrier (all q_s / k_s reads done); red_kv is next written after the next barrier.
  }
#pragma unroll
  for (int r = 0; r < kDeltaRowsPerThread; ++r) {
    const int i = warp + kDeltaWarps * r;
    if (col_ok && i < Dk) S[int64_t(i) * Dv + j] = sv[r];
  }
}

}  // namespace

void kv_store(const float* k, const float* v, const KvPoolArgs& pool, const StepArgs& step, Stream stream) {
  const int64_t total = int64_t(step.num_tokens) * pool.kv_heads * pool.head_dim;
  if (total == 0) return;
  const int64_t blocks = (total + 255) / 256;
  kv_store_kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(k, v, pool, step);
  KILN_CUDA_CHECK_LAUNCH();
}

void attention(const float* q, int64_t q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale, float* out,
               Stream stream) {
  if (step.num_tokens == 0) return;
  if (pool.head_dim > kMaxHeadDim) cuda_fail("attention: head_dim {} is not supported (at most {})", {pool.head_dim, kMaxHeadDim});
  const dim3 grid(static_cast<unsigned>(step.num_tokens), static_cast<unsigned>(q_heads));
  attention_kernel<<<grid, kAttnThreads, 0, stream>>>(q, static_cast<int>(q_heads), pool, step, scale, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta, float* state,
                      int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, const StepArgs& step, float* out,
                      float* qk_work, Stream stream) {
  if (step.num_tokens == 0 || step.num_seqs == 0) return;
  if (Dk > kDeltaWarps * kDeltaRowsPerThread)
    cuda_fail("gated delta rule: key head dim {} is not supported (at most {})", {Dk, kDeltaWarps * kDeltaRowsPerThread});
  const int64_t vectors = int64_t(step.num_tokens) * Hk;
  float* qn = qk_work;
  float* kn = qk_work + vectors * Dk;
  l2norm_qk_kernel<<<grid_for(2 * vectors, 8), 256, 0, stream>>>(q, k, vectors, Dk, qn, kn);
  KILN_CUDA_CHECK_LAUNCH();
  const dim3 grid(static_cast<unsigned>(step.num_seqs), static_cast<unsigned>(Hv), grid_for(Dv, 32));
  delta_rule_kernel<<<grid, kDeltaWarps * 32, 0, stream>>>(qn, kn, v, g, beta, state, static_cast<int>(Hk),
                                                           static_cast<int>(Hv), static_cast<int>(Dk),
                                                           static_cast<int>(Dv), step, out);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
