// Device helpers of the decode-sized routed-expert kernels (moe_decode_fused.cu, moe_block_decode.cu): one warp's
// routing of one token (moe_route_warp_kernel's maths, bitwise its ids and weights) and the NVFP4 dot product of one
// 16-byte chunk of codes on the CUDA cores (the tensor-core kernels' decode: e2m1 * e4m3 block scale, exact in bf16).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/device.cuh"

namespace kiln::cuda::ops::moe_decode {

using namespace ::kiln::cuda::ops::dev;

// ---- routing: one warp, one token (moe_route_warp_kernel's maths: softmax in fp32 with the same per-lane and
// butterfly sums, top-k as repeated argmax, ties to the lower id; the picks use __reduce_max_sync over the
// probabilities' bits, which order like the non-negative floats they are, then __reduce_min_sync over the ids)

// The lane's best unpicked probability: key = bits + 1 (0: none; p >= 0 orders like its bits), lowest expert on ties.
__device__ __forceinline__ void lane_best(const float (&p)[32], uint32_t picked, int lane, int E, uint32_t& key,
                                          int& expert) {
  key = 0;
  expert = 0x7fffffff;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int e = lane + 32 * i;
    // p >= 0 is false for NaN: it never wins (as in the shuffle kernel).
    const uint32_t k = e < E && !((picked >> i) & 1u) && p[i] >= 0.0f ? __float_as_uint(p[i]) + 1u : 0u;
    if (k > key) {
      key = k;
      expert = e;
    }
  }
}

// p: the token's logits, p[i] = logit of expert lane + 32 i (-inf past E); overwritten. Lanes j < top_k return pick
// j's expert and weight.
__device__ __forceinline__ void route_logits(float (&p)[32], int E, int top_k, bool renormalise, int lane, int& my_idx,
                                             float& my_val) {
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < 32; ++i) m = fmaxf(m, p[i]);
  m = warp_max(m);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? expf(p[i] - m) : 0.0f;  // lanes past E add zeros at the end of the lane's sum: no change
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < 32; ++i) p[i] = lane + 32 * i < E ? p[i] / sum : -INFINITY;
  uint32_t picked = 0, key;
  int best;
  lane_best(p, picked, lane, E, key, best);
  float chosen_sum = 0.0f;
  my_idx = 0;
  my_val = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const uint32_t top = __reduce_max_sync(0xffffffffu, key);
    int idx = static_cast<int>(__reduce_min_sync(0xffffffffu, key == top ? static_cast<uint32_t>(best) : 0xffffffffu));
    // Nothing left with a number (NaN logits): the shuffle kernel's pick, expert 0 at -inf.
    const float v = top ? __uint_as_float(top - 1u) : -INFINITY;
    if (!top) idx = 0;
    if (top && (idx & 31) == lane) {
      picked |= 1u << (idx >> 5);
      lane_best(p, picked, lane, E, key, best);
    }
    chosen_sum += v;
    if (lane == j) {
      my_val = v;
      my_idx = idx;
    }
  }
  if (renormalise) my_val = my_val / chosen_sum;
}

// route_logits over the logits row l (read through the non-coherent path: written by an earlier kernel).
__device__ __forceinline__ void route_token(const float* __restrict__ l, int E, int top_k, bool renormalise, int lane,
                                            int& my_idx, float& my_val) {
  float p[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? l[e] : -INFINITY;
  }
  route_logits(p, E, top_k, renormalise, lane, my_idx, my_val);
}

// ---- NVFP4 dot products of one 16-byte chunk (32 codes, two 16-code scale blocks) against 32 fp32 values

// The chunk's two block scales as bf16x2 (nvfp4_scale_bf16x2: scale * 2^118).
__device__ __forceinline__ uint2 chunk_scales(uint32_t sc16) {
  return make_uint2(nvfp4_scale_bf16x2(sc16 & 0xffu), nvfp4_scale_bf16x2((sc16 >> 8) & 0xffu));
}

// Word j (codes 8j .. 8j + 7): pair q holds codes q (low half) and q + 4 (high half) as e2m1 * scale * 2^-8 in bf16.
template <int kQ>
__device__ __forceinline__ float fma_pair(uint32_t word, uint32_t scale, const float* xv, float acc) {
  const uint32_t pr = bf16x2_mul(e2m1_pair_bits<kQ>(word), scale);
  acc = fmaf(__uint_as_float(pr << 16), xv[kQ], acc);
  return fmaf(__uint_as_float(pr & 0xffff0000u), xv[kQ + 4], acc);
}
__device__ __forceinline__ float dot_chunk(const uint4& w, const uint2& sc, const float (&xv)[32], float acc) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t s = j < 2 ? sc.x : sc.y;
    acc = fma_pair<0>(words[j], s, xv + 8 * j, acc);
    acc = fma_pair<1>(words[j], s, xv + 8 * j, acc);
    acc = fma_pair<2>(words[j], s, xv + 8 * j, acc);
    acc = fma_pair<3>(words[j], s, xv + 8 * j, acc);
  }
  return acc;
}

}  // namespace kiln::cuda::ops::moe_decode
