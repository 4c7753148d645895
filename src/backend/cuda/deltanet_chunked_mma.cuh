// Device helpers shared by the chunked gated delta rule's kernels: the single-kernel form (deltanet_chunked.cu) and
// the split form (deltanet_chunked_split.cu): cp.async copies into shared memory, the chunk's gates, the 16-row
// diagonal-block inverses of the triangular solve, and the tf32 tensor-core step (the fragment layout and every
// warp's tiles are deltanet_chunked_tiles.h's).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/deltanet_chunked_tiles.h"
#include "backend/cuda/ptx.cuh"

namespace kiln::cuda::ops::delta_chunked {

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// dst (shared) = ok ? *src : 0 without going through registers: cp.async, zero-filled when !ok (src must be a
// valid address either way); complete after wait_copies(). A plain copy where cp.async is missing (the host pass).
__device__ __forceinline__ void copy_async(float* dst, const float* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ptx::cp_async_4(ptx::smem_addr(dst), src, ok ? 4 : 0);
#else
  *dst = ok ? *src : 0.0f;
#endif
}

// The same for 4 floats (dst and src 16-byte aligned).
__device__ __forceinline__ void copy_async4(float* dst, const float* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ptx::cp_async_16(ptx::smem_addr(dst), src, ok ? 16 : 0);
#else
  for (int e = 0; e < 4; ++e) dst[e] = ok ? src[e] : 0.0f;
#endif
}

__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ptx::cp_async_wait_all();
#endif
}

// Groups of copies (the split form's scan keeps two in flight): commit closes this thread's group of copies issued
// since the last commit; wait_copies_but_newest waits for all but the most recently committed group.
__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ptx::cp_async_commit();
#endif
}
__device__ __forceinline__ void wait_copies_but_newest() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  ptx::cp_async_wait<1>();
#endif
}

// g and beta of token i (< 64) of a chunk, zero past its m tokens. Loaded into registers a phase before they are
// stored, so that the store does not wait for global memory.
struct Gates {
  float g, beta;
};
__device__ __forceinline__ Gates load_gates(const float* __restrict__ g, const float* __restrict__ beta, int tok,
                                            int m, int h, int Hv, int i) {
  const int64_t off = int64_t(tok + imin(i, m - 1)) * Hv + h;
  const float gv = g[off], bv = beta[off];
  return {i < m ? gv : 0.0f, i < m ? bv : 0.0f};
}

// T_bb = (I + A_bb)^-1 for diagonal block b = tid / 16, column c = tid % 16 (threads 0..63), A at L::a (row stride
// L::lda), T_bb to L::tbb: forward substitution on e_c, written right-looking (x_j known, then subtracted from every
// later row) so that the rows' updates overlap; each x_r still sums its terms in the order j = 0, 1, ..., r - 1.
// Rows above c come out exactly zero.
template <class L>
__device__ __forceinline__ void diagonal_inverse(float* sm, int tid) {
  const int b = tid >> 4, c = tid & 15;
  const float* ab = sm + L::a + kSub * b * L::lda + kSub * b;
  float x[kSub];
#pragma unroll
  for (int r = 0; r < kSub; ++r) x[r] = r == c ? 1.0f : 0.0f;
#pragma unroll
  for (int j = 0; j < kSub; ++j)
#pragma unroll
    for (int r = j + 1; r < kSub; ++r) x[r] = fmaf(-ab[r * L::lda + j], x[j], x[r]);
  float* t = sm + L::tbb + b * kSub * kSub;
#pragma unroll
  for (int r = 0; r < kSub; ++r) t[r * kSub + c] = x[r];
}

// col[r * ld] = sum_{r' <= r} t[r][r'] col[r' * ld] for the 16 rows of one column, in place (the column is read into
// registers first and no other thread touches it). t is lower triangular with zeros above the diagonal, so whole
// float4 groups up to the diagonal can be read.
__device__ __forceinline__ void apply_block_inverse(float* col, int ld, const float* t) {
  float x[kSub];
#pragma unroll
  for (int r = 0; r < kSub; ++r) x[r] = col[r * ld];
#pragma unroll
  for (int r = 0; r < kSub; ++r) {
    float acc = 0.0f;
#pragma unroll
    for (int q = 0; q <= r / 4; ++q) {
      const float4 tt = *reinterpret_cast<const float4*>(t + r * kSub + 4 * q);
      acc = fmaf(tt.x, x[4 * q], acc);
      acc = fmaf(tt.y, x[4 * q + 1], acc);
      acc = fmaf(tt.z, x[4 * q + 2], acc);
      acc = fmaf(tt.w, x[4 * q + 3], acc);
    }
    col[r * ld] = acc;
  }
}

// A value at a tensor-core input: hi = tf32(x) and, with 3 parts, lo = tf32(x - hi) (hi + lo carry 22 of x's 24
// significant bits).
template <int PARTS>
struct Tf32 {
  uint32_t hi, lo;
};
template <int PARTS>
__device__ __forceinline__ Tf32<PARTS> split_tf32(float x) {
  Tf32<PARTS> r;
  r.hi = ptx::to_tf32(x);
  r.lo = PARTS == 3 ? ptx::to_tf32(x - __uint_as_float(r.hi)) : 0u;
  return r;
}

// d += a b over one 16 x 8 x 8 step: hi hi with 1 part; lo hi + hi lo + hi hi with 3 (the small terms first; lo lo,
// ~2^-22 of the product, is dropped), all into the same fp32 accumulator.
template <int PARTS>
__device__ __forceinline__ void mma_step(float (&d)[4], const Tf32<PARTS> (&a)[4], const Tf32<PARTS> (&b)[2]) {
  const uint32_t ah[4] = {a[0].hi, a[1].hi, a[2].hi, a[3].hi};
  if constexpr (PARTS == 3) {
    const uint32_t al[4] = {a[0].lo, a[1].lo, a[2].lo, a[3].lo};
    ptx::mma_tf32_1688(d, al, b[0].hi, b[1].hi);
    ptx::mma_tf32_1688(d, ah, b[0].lo, b[1].lo);
  }
  ptx::mma_tf32_1688(d, ah, b[0].hi, b[1].hi);
}

}  // namespace kiln::cuda::ops::delta_chunked
