// Device helpers of the persistent decode kernels (moe_block_decode.cu, deltanet_block_decode.cu): one block of 512
// threads per multiprocessor, all resident at once, whose phases are separated by grid-wide barriers instead of kernel
// boundaries.
//  - grid_barrier: a count and a generation word that persist across launches (the caller owns them, zeroed once).
//    Each block's thread 0 reads the generation, arrives on the count; the last to arrive resets the count and bumps
//    the generation, the others spin until it changes (cooperative groups' grid sync, written out). Every block must
//    be resident at once, which one block per multiprocessor guarantees when no other kernel holds the
//    multiprocessors (CudaOps takes these kernels only where a rank has its GPU to itself). A barrier waiting more
//    than 10 s traps (a launch error) instead of hanging.
//  - vectors in shared memory as chunks of 32 floats (8 float4) rotated per chunk (swz): lanes reading float4 q of
//    consecutive chunks hit different banks.
//  - residual_norm_rows: add_rms_norm's maths (the residual step between blocks) into shared memory, per block.
//  - dense_rows: rows of dense BF16 weights, a warp per row, every token of the step against the row's one read.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/ptx.cuh"

namespace kiln::cuda::ops::persistent {

using namespace ::kiln::cuda::ops::dev;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ int swz(int k4) { return (k4 & ~7) | ((k4 + (k4 >> 3)) & 7); }

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every block of the grid reaches it before any leaves it; the block's global writes before it are visible to every
// block after it.
__device__ __forceinline__ void grid_barrier(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* count = bar;
    unsigned* gen = bar + 1;
    const unsigned g = ld_acquire(gen);  // before arriving: it cannot change until this block has arrived
    __threadfence();
    const unsigned arrived = atomicAdd(count, 1u);
    if (arrived == gridDim.x - 1) {
      atomicExch(count, 0u);
      __threadfence();
      atomicAdd(gen, 1u);
    } else {
      const unsigned long long t0 = global_ns();
      while (ld_acquire(gen) == g) {
        __nanosleep(32);
        if (global_ns() - t0 > 10000000000ull) __trap();  // a block that never came: fail the launch, don't hang
      }
    }
    __threadfence();
  }
  __syncthreads();
}

// 32 floats of chunk c (swizzled float4 array base) into registers.
__device__ __forceinline__ void load_chunk(const float4* base, int c, float (&v)[32]) {
#pragma unroll
  for (int f = 0; f < 8; ++f) {
    const float4 q = base[swz(8 * c + f)];
    v[4 * f] = q.x;
    v[4 * f + 1] = q.y;
    v[4 * f + 2] = q.z;
    v[4 * f + 3] = q.w;
  }
}

// The block's copy of T rows of H (swizzled per row, H % 4 == 0) = rms_norm(residual (+ y)) * (w (+ 1)), with
// add_rms_norm's maths: v = residual + y in fp32, inv = 1 / sqrt(sum(v^2) / H + eps), x = (v * inv) * (w + one); only
// the order of the sum of squares differs. y may be null (a plain rms_norm). Ends with __syncthreads.
__device__ __forceinline__ void residual_norm_rows(const float* residual, const float* y, int T, int H,
                                                   const void* w, ElemType w_elem, float eps, bool zero_centred,
                                                   float4* xs4) {
  __shared__ float s_red[kWarps];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float4* r4p = reinterpret_cast<const float4*>(residual);
  const float4* y4p = reinterpret_cast<const float4*>(y);
  const float one = zero_centred ? 1.0f : 0.0f;
  for (int t = 0; t < T; ++t) {
    float ss = 0.0f;
    for (int k4 = tid; k4 < H / 4; k4 += kThreads) {
      float4 v = __ldcg(r4p + t * (H / 4) + k4);
      if (y) {
        const float4 d = __ldcg(y4p + t * (H / 4) + k4);
        v = make_float4(v.x + d.x, v.y + d.y, v.z + d.z, v.w + d.w);
      }
      xs4[t * (H / 4) + swz(k4)] = v;
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = warp_sum(ss);
    if (lane == 0) s_red[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) tot += s_red[q];
    const float inv = 1.0f / sqrtf(tot / float(H) + eps);
    for (int k4 = tid; k4 < H / 4; k4 += kThreads) {
      float4& v = xs4[t * (H / 4) + swz(k4)];
      v.x = (v.x * inv) * (load_elem(w, w_elem, 4 * k4) + one);
      v.y = (v.y * inv) * (load_elem(w, w_elem, 4 * k4 + 1) + one);
      v.z = (v.z * inv) * (load_elem(w, w_elem, 4 * k4 + 2) + one);
      v.w = (v.w * inv) * (load_elem(w, w_elem, 4 * k4 + 3) + one);
    }
    __syncthreads();  // s_red is reused by the next token
  }
}

// residual += y for T rows of H (the residual stream written back after every block has read it; bitwise
// residual_norm_rows's sum). Threads of one block.
__device__ __forceinline__ void residual_write_back(float* residual, const float* y, int T, int H) {
  float4* r4p = reinterpret_cast<float4*>(residual);
  const float4* y4p = reinterpret_cast<const float4*>(y);
  for (int k4 = threadIdx.x; k4 < T * H / 4; k4 += kThreads) {
    const float4 r = __ldcg(r4p + k4), d = __ldcg(y4p + k4);
    r4p[k4] = make_float4(r.x + d.x, r.y + d.y, r.z + d.z, r.w + d.w);
  }
}

// Rows [0, R) of dense BF16 weights [*, K] (row_ptr(r): the row's first element, 16-byte aligned; K % 8 == 0), a warp
// per row over all the grid's warps: out[t * ld_out + r] = row . x_t for the T <= kT tokens of xs4 (swizzled rows of K
// floats). 16-byte streaming loads, a pass of 1024 kKC weights of the row in flight at once (one pass where
// K <= 1024 kKC); fp32 products and sums. kRI: rows a warp has in flight together (r, r + warps, ...: more bytes in
// flight per warp where a warp has several rows; 4 kKC kRI 16-byte registers per lane). prefetch: lane 0 first asks L2
// for the warp's next rows (cp.async.bulk.prefetch), so that their bytes stream while these rows' loads are waited on.
template <int kKC, int kT, int kRI = 1, typename RowPtr>
__device__ __forceinline__ void dense_rows(RowPtr row_ptr, int R, int K, int T, const float4* xs4, float* out,
                                           int ld_out, bool prefetch = false) {
  constexpr int kLoads = 4 * kKC;  // 16-byte loads (8 weights) per lane, row and pass, those past K idle
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
  for (int r0 = gwarp; r0 < R; r0 += kRI * nwarps) {
    const uint16_t* w[kRI];
#pragma unroll
    for (int j = 0; j < kRI; ++j) w[j] = r0 + j * nwarps < R ? row_ptr(r0 + j * nwarps) : nullptr;
    if (prefetch && lane == 0)
#pragma unroll
      for (int j = 0; j < kRI; ++j)
        if (r0 + (kRI + j) * nwarps < R) ptx::prefetch_l2_bulk(row_ptr(r0 + (kRI + j) * nwarps), 2u * K);
    float acc[kRI][kT];
#pragma unroll
    for (int j = 0; j < kRI; ++j)
#pragma unroll
      for (int t = 0; t < kT; ++t) acc[j][t] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += 1024 * kKC) {
      uint4 raw[kRI][kLoads];
#pragma unroll
      for (int j = 0; j < kRI; ++j)
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int k = k0 + 8 * (lane + 32 * u);
          raw[j][u] = w[j] && k < K ? ptx::ld_stream_16(w[j] + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int j = 0; j < kRI; ++j) {
        if (!w[j]) break;
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int k = k0 + 8 * (lane + 32 * u);
          if (k >= K) break;
          const int k4 = k / 4;
          const uint32_t p[4] = {raw[j][u].x, raw[j][u].y, raw[j][u].z, raw[j][u].w};
#pragma unroll
          for (int t = 0; t < kT; ++t) {
            if (t >= T) break;
            const float4 x0 = xs4[t * (K / 4) + swz(k4)], x1 = xs4[t * (K / 4) + swz(k4 + 1)];
            acc[j][t] += x0.x * __uint_as_float(p[0] << 16) + x0.y * __uint_as_float(p[0] & 0xffff0000u) +
                         x0.z * __uint_as_float(p[1] << 16) + x0.w * __uint_as_float(p[1] & 0xffff0000u);
            acc[j][t] += x1.x * __uint_as_float(p[2] << 16) + x1.y * __uint_as_float(p[2] & 0xffff0000u) +
                         x1.z * __uint_as_float(p[3] << 16) + x1.w * __uint_as_float(p[3] & 0xffff0000u);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kRI; ++j) {
      if (!w[j]) break;
#pragma unroll
      for (int t = 0; t < kT; ++t) {
        if (t >= T) break;
        const float v = warp_sum(acc[j][t]);
        if (lane == 0) out[t * ld_out + r0 + j * nwarps] = v;
      }
    }
  }
}

// Host side: lets `kernel` take up to `smem` bytes of dynamic shared memory (on the current device; never during stream
// capture) and returns how many of its blocks of kThreads then fit one multiprocessor (the grid needs >= 1).
template <typename Kernel>
int allow_smem(Kernel* kernel, int smem) {
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int n = 0;
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem));
  return n;
}

}  // namespace kiln::cuda::ops::persistent
