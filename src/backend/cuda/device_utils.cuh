// Device-side helpers shared by the kernel families: bf16 packing, warp reductions, FP8/FP4 decoding,
// and thin wrappers over the PTX instructions the kernels use (mma.sync m16n8k16 bf16, ldmatrix,
// cp.async). Everything here exists on sm_80 and later, so it compiles for sm_90a and sm_120a alike.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kiln::cuda::dev {

using bf16 = __nv_bfloat16;
using bf16x2 = __nv_bfloat162;

// ---- bf16 packing ----
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  bf16x2 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

// ---- reductions ----
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// ---- FP8 E4M3 (OCP e4m3fn) ----
// Exact decode without tables: normal values rebias the exponent, subnormals are m * 2^-9.
__device__ __forceinline__ float e4m3_to_f32(uint32_t b) {
  const uint32_t exp = (b >> 3) & 0xf, man = b & 0x7;
  float mag = exp ? __uint_as_float(((exp + 120u) << 23) | (man << 20)) : float(man) * 0.001953125f;
  if (exp == 0xf && man == 0x7) mag = __int_as_float(0x7fc00000);  // S.1111.111 is NaN
  return (b & 0x80) ? -mag : mag;
}

// ---- FP4 E2M1 -> bf16 ----
// Two E2M1 codes, nibbles i and i+4 of `w` (bits 4i.. and 4i+16..), become a bf16x2 pair whose
// values are e2m1 * 2^-126: the 3 magnitude bits land on the lowest exponent bits and the top
// mantissa bit (exponent field 0 gives the bf16 subnormal 0.5 * 2^-126, matching E2M1's own
// subnormal). Multiplying by a bf16 scale that carries 2^118 (see nvfp4_scale_bf16x2) gives
// e2m1 * scale * 2^-8 exactly; the 2^8 goes into the fp32 epilogue. Pairing nibble i with i+4
// lets one shift serve both halves.
template <int kI>
__device__ __forceinline__ uint32_t e2m1_pair_bits(uint32_t w) {
  constexpr int kMagShift = 6 - 4 * kI;   // bit 4i -> bit 6
  constexpr int kSignShift = 12 - 4 * kI;  // bit 4i+3 -> bit 15
  const uint32_t mag = kMagShift >= 0 ? (w << kMagShift) : (w >> -kMagShift);
  const uint32_t sgn = w << kSignShift;
  return (mag & 0x01c001c0u) | (sgn & 0x80008000u);
}

// bf16x2 (both halves) of e4m3 scale * 2^118. Exact: e4m3 has 4 significant bits and
// 448 * 2^118 < 2^127 fits bf16's range.
__device__ __forceinline__ uint32_t nvfp4_scale_bf16x2(uint32_t scale_byte) {
  const float s = e4m3_to_f32(scale_byte) * 3.3230699894622794e+35f;  // 2^118
  const uint32_t h = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(s)));
  return h | (h << 16);
}
// The factor an accumulator of (e2m1 * scale * 2^-8) products needs.
constexpr float kNvfp4AccumScale = 256.0f;

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  bf16x2 r = __hmul2(*reinterpret_cast<bf16x2*>(&a), *reinterpret_cast<bf16x2*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// ---- tensor-core MMA: D[16x8] += A[16x16] (row) * B[16x8] (col), bf16 in, fp32 accumulate ----
// Fragment layout (lane = 4*g + q): a0=(g, 2q..2q+1) a1=(g+8, 2q..) a2=(g, 2q+8..) a3=(g+8, 2q+8..);
// b0=(k 2q..2q+1, n g) b1=(k 2q+8.., n g); c0,c1=(g, 2q..2q+1) c2,c3=(g+8, 2q..2q+1).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- shared memory ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// cp.async of 16 bytes; src_bytes < 16 zero-fills the rest (0 = all zeros, src not read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Streaming 16-byte global load that skips L1 allocation (weights are read once per launch).
__device__ __forceinline__ uint4 ld_stream_16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

}  // namespace kiln::cuda::dev
