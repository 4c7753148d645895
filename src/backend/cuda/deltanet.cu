// Gated DeltaNet (linear attention): the causal depthwise conv1d with its rolling state, and the
// gated delta rule in recurrent form with the gated RMSNorm fused into its output.
//
// Recurrent kernel: one block per (value head, sequence), 512 threads. Thread (v, ks) owns state
// column v, keys [32 ks, 32 ks + 32) in registers for the whole token loop (the state is read and
// written once per launch); k^T S and q^T S are 32-term partial sums joined by two shuffles.
// Prefill runs the same loop over the chunk's tokens (a chunked UT-transform form would be faster).
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

using namespace dev;

constexpr int kConvThreads = 128;

// grid: (ceil(C / 128), S).
__global__ void __launch_bounds__(kConvThreads) gdn_conv1d_kernel(const uint16_t* __restrict__ x, int64_t ldx,
                                                                   const uint16_t* __restrict__ w,
                                                                   uint16_t* __restrict__ state, GdnSeqs seqs, int C,
                                                                   uint16_t* __restrict__ out) {
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int s = blockIdx.y;
  if (c >= C) return;
  const int t0 = seqs.seq_start[s], t1 = seqs.seq_start[s + 1];
  uint16_t* st = state + int64_t(seqs.slot[s]) * 3 * C + c;
  const bool reset = seqs.reset[s] != 0;
  float h0 = reset ? 0.0f : bf16_bits_to_f32(st[0]);
  float h1 = reset ? 0.0f : bf16_bits_to_f32(st[C]);
  float h2 = reset ? 0.0f : bf16_bits_to_f32(st[2 * C]);
  const uint2 wv = *reinterpret_cast<const uint2*>(w + int64_t(c) * 4);
  const float w0 = bf16_lo(wv.x), w1 = bf16_hi(wv.x), w2 = bf16_lo(wv.y), w3 = bf16_hi(wv.y);
  for (int t = t0; t < t1; ++t) {
    const float xt = bf16_bits_to_f32(x[int64_t(t) * ldx + c]);
    const float y = w0 * h0 + w1 * h1 + w2 * h2 + w3 * xt;
    h0 = h1;
    h1 = h2;
    h2 = xt;
    out[int64_t(t) * C + c] = __bfloat16_as_ushort(__float2bfloat16_rn(silu(y)));
  }
  if (t1 > t0 || reset) {
    // The window holds bf16 inputs (or zeros), so storing them back is exact.
    st[0] = __bfloat16_as_ushort(__float2bfloat16_rn(h0));
    st[C] = __bfloat16_as_ushort(__float2bfloat16_rn(h1));
    st[2 * C] = __bfloat16_as_ushort(__float2bfloat16_rn(h2));
  }
}

struct RecurrentParams {
  const uint16_t* qkv;
  int64_t ld_qkv;
  const uint16_t* z;
  int64_t ld_z;
  const uint16_t* a;
  int64_t ld_a;
  const uint16_t* b;
  int64_t ld_b;
  const float* A_log;
  const float* dt_bias;
  const float* norm_w;
  float eps;
  float* state;
  GdnSeqs seqs;
  int nk, nv;
  uint16_t* out;
};

constexpr int kDim = 128;           // key and value head dims this kernel supports
constexpr int kSplitK = 4;          // threads per state column
constexpr int kKPer = kDim / kSplitK;
constexpr int kRecThreads = kDim * kSplitK;

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// grid: (nv, S).
__global__ void __launch_bounds__(kRecThreads) gdn_recurrent_kernel(const RecurrentParams p) {
  const int h = blockIdx.x, s = blockIdx.y;
  const int kh = h / (p.nv / p.nk);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int v = tid / kSplitK, ks = tid % kSplitK;
  const int t0 = p.seqs.seq_start[s], t1 = p.seqs.seq_start[s + 1];
  const bool reset = p.seqs.reset[s] != 0;
  if (t1 <= t0 && !reset) return;

  float* sp = p.state + ((int64_t(p.seqs.slot[s]) * p.nv + h) * kDim + v) * kDim + ks * kKPer;
  float S[kKPer];
#pragma unroll
  for (int i = 0; i < kKPer; i += 4) {
    const float4 f = reset ? make_float4(0.f, 0.f, 0.f, 0.f) : *reinterpret_cast<const float4*>(sp + i);
    S[i] = f.x;
    S[i + 1] = f.y;
    S[i + 2] = f.z;
    S[i + 3] = f.w;
  }
  const float A = -expf(p.A_log[h]);
  const float dtb = p.dt_bias[h];
  const float nw = p.norm_w[v];
  const float q_scale = rsqrtf(float(kDim));

  __shared__ float q_s[kDim], k_s[kDim];
  __shared__ float red[kRecThreads / 32];

  for (int t = t0; t < t1; ++t) {
    const uint16_t* row = p.qkv + int64_t(t) * p.ld_qkv;
    if (tid < kDim) q_s[tid] = bf16_bits_to_f32(row[kh * kDim + tid]);
    else if (tid < 2 * kDim) k_s[tid - kDim] = bf16_bits_to_f32(row[(p.nk + kh) * kDim + tid - kDim]);
    const float vt = bf16_bits_to_f32(row[(2 * p.nk + h) * kDim + v]);
    const float zt = bf16_bits_to_f32(p.z[int64_t(t) * p.ld_z + h * kDim + v]);
    const float at = bf16_bits_to_f32(p.a[int64_t(t) * p.ld_a + h]);
    const float bt = bf16_bits_to_f32(p.b[int64_t(t) * p.ld_b + h]);
    __syncthreads();

    // l2 norms of q and k (every warp computes them; cheaper than another barrier).
    float sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int i = 0; i < kDim / 32; ++i) {
      const float qv = q_s[lane + 32 * i], kv = k_s[lane + 32 * i];
      sq += qv * qv;
      sk += kv * kv;
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    const float inv_q = rsqrtf(sq + 1e-6f) * q_scale, inv_k = rsqrtf(sk + 1e-6f);
    const float decay = expf(A * softplus(at + dtb));
    const float beta = sigmoid(bt);

    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < kKPer; ++i) {
      S[i] *= decay;
      kv += S[i] * k_s[ks * kKPer + i];
    }
    kv *= inv_k;
    kv += __shfl_xor_sync(0xffffffffu, kv, 1);
    kv += __shfl_xor_sync(0xffffffffu, kv, 2);
    const float delta = (vt - kv) * beta;
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < kKPer; ++i) {
      S[i] += k_s[ks * kKPer + i] * inv_k * delta;
      o += S[i] * q_s[ks * kKPer + i];
    }
    o *= inv_q;
    o += __shfl_xor_sync(0xffffffffu, o, 1);
    o += __shfl_xor_sync(0xffffffffu, o, 2);

    // Gated RMSNorm over the head's 128 values (each held by 4 threads: count it once).
    const float ss = warp_sum(ks == 0 ? o * o : 0.0f);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kRecThreads / 32; ++i) total += red[i];
    if (ks == 0) {
      const float y = nw * o * rsqrtf(total / kDim + p.eps) * silu(zt);
      p.out[int64_t(t) * p.nv * kDim + h * kDim + v] = __bfloat16_as_ushort(__float2bfloat16_rn(y));
    }
    __syncthreads();  // q_s, k_s and red are rewritten by the next token
  }
#pragma unroll
  for (int i = 0; i < kKPer; i += 4) *reinterpret_cast<float4*>(sp + i) = make_float4(S[i], S[i + 1], S[i + 2], S[i + 3]);
}

}  // namespace

void gdn_conv1d(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* conv_state, const GdnSeqs& seqs, int C,
                uint16_t* out, Stream stream) {
  if (seqs.num_seqs <= 0) return;
  const dim3 grid((C + kConvThreads - 1) / kConvThreads, seqs.num_seqs);
  gdn_conv1d_kernel<<<grid, kConvThreads, 0, stream>>>(x, ldx, w, conv_state, seqs, C, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void gdn_recurrent(const uint16_t* qkv, int64_t ld_qkv, const uint16_t* z, int64_t ld_z, const uint16_t* a,
                   int64_t ld_a, const uint16_t* b, int64_t ld_b, const float* A_log, const float* dt_bias,
                   const float* norm_w, float eps, float* state, const GdnSeqs& seqs, const GdnShape& shape,
                   uint16_t* out, Stream stream) {
  if (seqs.num_seqs <= 0) return;
  if (shape.k_dim != kDim || shape.v_dim != kDim)
    cuda_fail("gated DeltaNet: head dims {}x{} not supported (only 128x128)", {shape.k_dim, shape.v_dim});
  if (shape.n_k_heads <= 0 || shape.n_v_heads % shape.n_k_heads != 0)
    cuda_fail("gated DeltaNet: {} value heads do not group over {} key heads", {shape.n_v_heads, shape.n_k_heads});
  RecurrentParams p{qkv, ld_qkv, z, ld_z, a, ld_a, b, ld_b, A_log, dt_bias, norm_w, eps, state, seqs,
                    shape.n_k_heads, shape.n_v_heads, out};
  gdn_recurrent_kernel<<<dim3(shape.n_v_heads, seqs.num_seqs), kRecThreads, 0, stream>>>(p);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
