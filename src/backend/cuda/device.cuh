// Device helpers of the kernels (the .cu files of this folder): element loads as fp32, FP8 / FP4 decoding, one weight
// element or eight of them as the CPU backend decodes them, NVFP4 -> bf16 decoding for the tensor-core kernels,
// reductions, step-layout lookups. fp32 maths with the accurate expf / cosf (no fast-math intrinsics): the kernels
// are checked against the CPU backend at ~1e-5. The PTX wrappers are in ptx.cuh.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops::dev {

__device__ __forceinline__ float bf16_to_f32(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
// fp32 -> bf16 bits, round to nearest even.
__device__ __forceinline__ uint16_t f32_to_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
// bf16x2 of (lo, hi), round to nearest even; lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float f16_to_f32(uint16_t v) { return __half2float(__ushort_as_half(v)); }

// OCP E4M3 (e4m3fn): bias 7, S.1111.111 is NaN, subnormals m * 2^-9. Exact.
__device__ __forceinline__ float e4m3_to_f32(uint32_t b) {
  const uint32_t e = (b >> 3) & 0xf, m = b & 0x7;
  float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : float(m) * 0.001953125f;
  if (e == 0xf && m == 0x7) mag = __int_as_float(0x7fc00000);
  return (b & 0x80) ? -mag : mag;
}

// E2M1 code (bit 3 sign, bits 0-2 magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6}). Exact.
__device__ __forceinline__ float e2m1_to_f32(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const float mag = e ? __uint_as_float(((e + 126u) << 23) | (m << 22)) : 0.5f * float(m);
  return (c & 8u) ? -mag : mag;
}

// The same value as e2m1_to_f32 without a select (the streaming gemv decodes 32 codes a load): sign -> bit 31, the 3
// magnitude bits -> bits 24..22 give the value times 2^-126 (code 1: the subnormal 2^-127), scaled back exactly by
// 2^126. Exact.
__device__ __forceinline__ float e2m1_to_f32_branchless(uint32_t c) {
  return __uint_as_float(((c & 7u) << 22) | ((c & 8u) << 28)) * 8.507059173023462e+37f;
}

// Element i of a float tensor of type `t`.
__device__ __forceinline__ float load_elem(const void* p, ElemType t, int64_t i) {
  switch (t) {
    case ElemType::f32: return static_cast<const float*>(p)[i];
    case ElemType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case ElemType::f16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case ElemType::e4m3: return e4m3_to_f32(static_cast<const uint8_t*>(p)[i]);
  }
  return 0.0f;
}

// Element i of a DeltaNet recurrent state as fp32, and its store (a bf16 state: rounded to nearest even).
__device__ __forceinline__ float load_state(const DeltaStateRef& s, int64_t i) {
  return s.bf16 ? bf16_to_f32(static_cast<const uint16_t*>(s.data)[i]) : static_cast<const float*>(s.data)[i];
}
__device__ __forceinline__ void store_state(const DeltaStateRef& s, int64_t i, float x) {
  if (s.bf16)
    static_cast<__nv_bfloat16*>(s.data)[i] = __float2bfloat16_rn(x);
  else
    static_cast<float*>(s.data)[i] = x;
}

// W[n, k] as the CPU backend decodes it: dense as stored; fp8 e4m3 * scale; nvfp4 (e2m1 * block) * scale_2.
__device__ __forceinline__ float weight_at(const WeightDesc& w, int64_t n, int64_t k) {
  switch (w.kind) {
    case WeightKind::dense: return load_elem(w.data, w.elem, n * w.k + k);
    case WeightKind::fp8_tensor: return e4m3_to_f32(static_cast<const uint8_t*>(w.data)[n * w.k + k]) * w.scale;
    case WeightKind::nvfp4: {
      const uint8_t byte = static_cast<const uint8_t*>(w.data)[n * (w.k / 2) + k / 2];
      const float bs = e4m3_to_f32(w.block_scale[n * (w.k / 16) + k / 16]);
      return (e2m1_to_f32((k & 1) ? (byte >> 4) : (byte & 0xf)) * bs) * w.scale;
    }
  }
  return 0.0f;
}

// W[n, k0 .. k0 + 8) with one vector load. Needs k % 8 == 0, k0 % 8 == 0 and a 16-byte aligned base (dense f32
// loads two 16-byte vectors; fp8 8 bytes; nvfp4 4 bytes of codes: 8 elements inside one 16-element block).
__device__ __forceinline__ void weight_at8(const WeightDesc& w, int64_t n, int64_t k0, float (&out)[8]) {
  switch (w.kind) {
    case WeightKind::dense:
      if (w.elem == ElemType::f32) {
        const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(w.data) + n * w.k + k0);
        const float4 a = p[0], b = p[1];
        out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
        out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
      } else {
        const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w.data) + n * w.k + k0);
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint16_t lo = uint16_t(words[i] & 0xffffu), hi = uint16_t(words[i] >> 16);
          out[2 * i] = w.elem == ElemType::bf16 ? bf16_to_f32(lo) : f16_to_f32(lo);
          out[2 * i + 1] = w.elem == ElemType::bf16 ? bf16_to_f32(hi) : f16_to_f32(hi);
        }
      }
      return;
    case WeightKind::fp8_tensor: {
      const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(w.data) + n * w.k + k0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        out[i] = e4m3_to_f32((v.x >> (8 * i)) & 0xffu) * w.scale;
        out[4 + i] = e4m3_to_f32((v.y >> (8 * i)) & 0xffu) * w.scale;
      }
      return;
    }
    case WeightKind::nvfp4: {
      const uint32_t codes = *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(w.data) + n * (w.k / 2) + k0 / 2);
      const float bs = e4m3_to_f32(w.block_scale[n * (w.k / 16) + k0 / 16]);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = (e2m1_to_f32((codes >> (4 * i)) & 0xfu) * bs) * w.scale;
      return;
    }
  }
}

// ---- FP4 E2M1 -> bf16 for the tensor-core kernels
// Two E2M1 codes, nibbles i and i+4 of `w` (bits 4i.. and 4i+16..), become a bf16x2 pair whose values are
// e2m1 * 2^-126: the 3 magnitude bits land on the lowest exponent bits and the top mantissa bit (exponent field 0
// gives the bf16 subnormal 0.5 * 2^-126, matching E2M1's own subnormal). Multiplying by a bf16 scale that carries
// 2^118 (nvfp4_scale_bf16x2) gives e2m1 * scale * 2^-8 exactly; the 2^8 goes into the fp32 epilogue. Pairing nibble i
// with i+4 lets one shift serve both halves.
template <int kI>
__device__ __forceinline__ uint32_t e2m1_pair_bits(uint32_t w) {
  constexpr int kMagShift = 6 - 4 * kI;   // bit 4i -> bit 6
  constexpr int kSignShift = 12 - 4 * kI;  // bit 4i+3 -> bit 15
  const uint32_t mag = kMagShift >= 0 ? (w << kMagShift) : (w >> -kMagShift);
  const uint32_t sgn = w << kSignShift;
  return (mag & 0x01c001c0u) | (sgn & 0x80008000u);
}
// bf16x2 (both halves) of e4m3 scale * 2^118. Exact: e4m3 has 4 significant bits and 448 * 2^118 < 2^127 fits
// bf16's range.
__device__ __forceinline__ uint32_t nvfp4_scale_bf16x2(uint32_t scale_byte) {
  const float s = e4m3_to_f32(scale_byte) * 3.3230699894622794e+35f;  // 2^118
  const uint32_t h = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(s)));
  return h | (h << 16);
}
// The factor an accumulator of (e2m1 * scale * 2^-8) products needs.
constexpr float kNvfp4AccumScale = 256.0f;
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Word j (codes 8j .. 8j + 7) of a lane's 16 bytes of NVFP4 codes.
__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}
// The tensor-core A fragment (mma.m16n8k16 / wgmma: registers 0 and 2 row g, 1 and 3 row g + 8) of one k-step half
// of a word pair (w0: row g, w1: row g + 8) with their block scales (nvfp4_scale_bf16x2): half 0 takes code pairs
// (0,4), (1,5), half 1 (2,6), (3,7). The expert kernels of moe_experts.cu and moe_prefill_wgmma.cu.
template <int kHalf>
__device__ __forceinline__ void decode_fragment(uint32_t w0, uint32_t w1, uint32_t s0, uint32_t s1,
                                                uint32_t (&f)[4]) {
  f[0] = bf16x2_mul(e2m1_pair_bits<2 * kHalf>(w0), s0);
  f[1] = bf16x2_mul(e2m1_pair_bits<2 * kHalf>(w1), s1);
  f[2] = bf16x2_mul(e2m1_pair_bits<2 * kHalf + 1>(w0), s0);
  f[3] = bf16x2_mul(e2m1_pair_bits<2 * kHalf + 1>(w1), s1);
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The gated delta rule's gates of one (token, value head) from their raw inputs, delta_rule_gates_kernel's arithmetic:
// decay = exp(g) = exp(-exp(A_log) softplus(a + dt_bias)) (torch softplus, threshold 20), beta = sigmoid(b).
__device__ __forceinline__ void delta_gates(float a_in, float b_in, float A_log, float dt_bias, float& decay,
                                            float& beta) {
  const float xv = a_in + dt_bias;
  const float softplus = xv > 20.0f ? xv : log1pf(expf(xv));
  decay = expf(-expf(A_log) * softplus);
  beta = 1.0f / (1.0f + expf(-b_in));
}

// ---- reductions over a warp and over a block: the one set every kernel of this folder uses. Every lane (thread)
// gets the same result, in a fixed order: an xor butterfly pairs the same lanes in every lane, and a block combines
// its warps' results in warp order, the same loop in every thread; so a result never depends on scheduling. Max is
// order-free (fmaxf for floats: NaN loses to any number; the larger key for integers).

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
  template <typename T>
  __device__ __forceinline__ static T identity() { return T(0); }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ double operator()(double a, double b) const { return fmax(a, b); }
  __device__ __forceinline__ unsigned long long operator()(unsigned long long a, unsigned long long b) const {
    return b > a ? b : a;
  }
  template <typename T>
  __device__ __forceinline__ static T identity() {  // what a lane without a value contributes
    if constexpr (std::is_floating_point_v<T>) {
      return T(-INFINITY);
    } else {
      static_assert(std::is_unsigned_v<T>, "max reductions take floats or unsigned keys");
      return T(0);
    }
  }
};

// op over the warp (an xor butterfly).
template <typename T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <typename T>
__device__ __forceinline__ T warp_sum(T v) { return warp_reduce(v, SumOp{}); }
template <typename T>
__device__ __forceinline__ T warp_max(T v) { return warp_reduce(v, MaxOp{}); }

// 1 / sqrt(mean(x^2) + eps) of the row xr [D] (global or shared memory), by the calling warp (lane l sums elements l,
// l + 32, ...): the RMSNorm kernels' and the delta rule's fused output norm's (deltanet.cu) one arithmetic.
// 1 / sqrt(sum v^2 + 1e-6) of n floats, over a warp (lane-strided sums, then a warp sum): the delta rule's L2 norm of
// q and k (every lane gets it).
__device__ __forceinline__ float warp_inv_l2(const float* __restrict__ v, int64_t n) {
  float ss = 0.0f;
  for (int64_t i = threadIdx.x & 31; i < n; i += 32) ss += v[i] * v[i];
  ss = warp_sum(ss);
  return 1.0f / sqrtf(ss + 1e-6f);
}

__device__ __forceinline__ float warp_row_inv_rms(const float* __restrict__ xr, int64_t D, float eps) {
  float ss = 0.0f;
  for (int64_t i = threadIdx.x & 31; i < D; i += 32) ss += xr[i] * xr[i];
  ss = warp_sum(ss);
  return 1.0f / sqrtf(ss / float(D) + eps);
}

// Argmax over the warp of (value, index) pairs: the larger value wins, the lower index on ties (an xor butterfly).
__device__ __forceinline__ void warp_argmax(float& value, int& index) {
  float v = value;
  int i = index;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
  value = v;
  index = i;
}

// Inclusive prefix sum over the warp: lane i gets the sum of lanes 0..i (Hillis-Steele, 5 shuffles).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// op over the block (blockDim.x a multiple of 32, <= 1024): each warp's result, then those in warp order from the
// identity. `red` holds 32 values of shared memory; the call synchronises the block twice (the first barrier also
// publishes the caller's earlier shared-memory writes; the second lets the next reduction reuse `red`).
template <typename T, class Op>
__device__ __forceinline__ T block_reduce(T v, T* red, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T total = Op::template identity<T>();
  for (int i = 0; i < warps; ++i) total = op(total, red[i]);
  __syncthreads();
  return total;
}
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* red) { return block_reduce(v, red, SumOp{}); }
template <typename T>
__device__ __forceinline__ T block_max(T v, T* red) { return block_reduce(v, red, MaxOp{}); }

// Argmax as a max over 64-bit keys: the value's order-preserving bits above, ~index below (the larger value wins,
// ties go to the lower index); NaN gives 0 ("none": loses to everything), -0 ties +0. Reduce with block_max.
__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t i) {
  if (v != v) return 0;
  uint32_t b = v == 0.0f ? 0u : __float_as_uint(v);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<unsigned long long>(b) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}

// The sequence of token t: the s with seq_token_begin[s] <= t < seq_token_begin[s + 1].
__device__ __forceinline__ int seq_of_token(const StepArgs& step, int t) {
  int lo = 0, hi = step.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (step.seq_token_begin[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Pool row of position pos of sequence s (page * page_size + pos % page_size), or -1 without a page.
__device__ __forceinline__ int64_t kv_pool_row(const StepArgs& step, int s, int pos) {
  const int page_index = pos / step.page_size;
  if (page_index >= step.max_pages) return -1;
  const int32_t page = step.page_table[int64_t(s) * step.max_pages + page_index];
  if (page < 0) return -1;
  return int64_t(page) * step.page_size + pos % step.page_size;
}

inline unsigned grid_for(int64_t n, int block) { return static_cast<unsigned>((n + block - 1) / block); }

}  // namespace kiln::cuda::ops::dev
