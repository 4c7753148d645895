// Row-wise and element-wise kernels: RMSNorm (plain and zero-centred, with an optional fused residual
// add), embedding gather, silu(gate) * up. All memory-bound: 16-byte accesses. (The greedy argmax over a vocabulary
// is ops::argmax_rows in cuda_ops_elementwise.cu.)
#include <cuda_bf16.h>

#include <cfloat>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

using namespace dev;

constexpr int kNormThreads = 256;

__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < int(blockDim.x / 32); ++i) total += scratch[i];
  __syncthreads();
  return total;
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = bf16_lo(u[i]);
    f[2 * i + 1] = bf16_hi(u[i]);
  }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                    pack_bf16x2(f[6], f[7]));
}

// Normalises row values already read; x is re-read from `src` (L1/L2) for the output pass.
__device__ void norm_write(const uint16_t* src, const uint16_t* w, int H, float inv_rms, bool zero_centred,
                           uint16_t* dst) {
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
    float x[8], wf[8];
    unpack8(*reinterpret_cast<const uint4*>(src + c * 8), x);
    unpack8(*reinterpret_cast<const uint4*>(w + c * 8), wf);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = x[i] * inv_rms * (zero_centred ? 1.0f + wf[i] : wf[i]);
    *reinterpret_cast<uint4*>(dst + c * 8) = pack8(x);
  }
}

__global__ void __launch_bounds__(kNormThreads) rmsnorm_kernel(const uint16_t* __restrict__ x, int64_t ldx,
                                                                const uint16_t* __restrict__ w, int H, float eps,
                                                                bool zero_centred, uint16_t* __restrict__ out,
                                                                int64_t ldo) {
  __shared__ float scratch[32];
  const uint16_t* row = x + int64_t(blockIdx.x) * ldx;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(row + c * 8), f);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += f[i] * f[i];
  }
  ss = block_sum(ss, scratch);
  norm_write(row, w, H, rsqrtf(ss / H + eps), zero_centred, out + int64_t(blockIdx.x) * ldo);
}

__global__ void __launch_bounds__(kNormThreads) add_rmsnorm_kernel(uint16_t* __restrict__ residual,
                                                                    const uint16_t* __restrict__ delta,
                                                                    const uint16_t* __restrict__ w, int H,
                                                                    float eps, bool zero_centred,
                                                                    uint16_t* __restrict__ out) {
  __shared__ float scratch[32];
  uint16_t* row = residual + int64_t(blockIdx.x) * H;
  const uint16_t* drow = delta + int64_t(blockIdx.x) * H;
  float ss = 0.0f;
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
    float a[8], b[8];
    unpack8(*reinterpret_cast<const uint4*>(row + c * 8), a);
    unpack8(*reinterpret_cast<const uint4*>(drow + c * 8), b);
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] += b[i];
    const uint4 r = pack8(a);
    *reinterpret_cast<uint4*>(row + c * 8) = r;
    unpack8(r, a);  // the norm sees the rounded bf16 sum, as the model does
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += a[i] * a[i];
  }
  ss = block_sum(ss, scratch);  // its barrier also orders the row writes above before the re-read
  norm_write(row, w, H, rsqrtf(ss / H + eps), zero_centred, out + int64_t(blockIdx.x) * H);
}

__global__ void embedding_kernel(const uint16_t* __restrict__ table, const int32_t* __restrict__ ids, int H,
                                 int64_t V, uint16_t* __restrict__ out) {
  const int t = blockIdx.x;
  const int64_t id = ids[t];
  const bool ok = id >= 0 && id < V;
  for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
    const uint4 v = ok ? *reinterpret_cast<const uint4*>(table + id * H + c * 8) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(out + int64_t(t) * H + c * 8) = v;
  }
}

__global__ void silu_mul_kernel(const uint16_t* __restrict__ gu, int64_t ld_gu, int I, uint16_t* __restrict__ out,
                                int64_t ldo) {
  const int t = blockIdx.y;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= I / 8) return;
  float g[8], u[8];
  unpack8(*reinterpret_cast<const uint4*>(gu + int64_t(t) * ld_gu + c * 8), g);
  unpack8(*reinterpret_cast<const uint4*>(gu + int64_t(t) * ld_gu + I + c * 8), u);
#pragma unroll
  for (int i = 0; i < 8; ++i) g[i] = silu(g[i]) * u[i];
  *reinterpret_cast<uint4*>(out + int64_t(t) * ldo + c * 8) = pack8(g);
}

__device__ __forceinline__ uint32_t hash32(uint64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) ^ (static_cast<uint32_t>(i >> 32) * 0x9e3779b9u) ^ (seed * 0x85ebca6bu);
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
__device__ __forceinline__ float unit_float(uint32_t h) { return float(h >> 8) * (1.0f / 16777216.0f); }

__global__ void fill_u8_kernel(uint8_t* p, size_t n, uint32_t seed, uint32_t lo, uint32_t span) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint8_t>(lo + hash32(i, seed) % span);
}
__global__ void fill_bf16_kernel(uint16_t* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __bfloat16_as_ushort(__float2bfloat16_rn((2.0f * unit_float(hash32(i, seed)) - 1.0f) * scale));
}
__global__ void fill_f32_kernel(float* p, size_t n, uint32_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = lo + (hi - lo) * unit_float(hash32(i, seed));
}
constexpr int kFillBlocks = 4096;

void check_rows(int H, const char* what) {
  if (H % 8 != 0) cuda_fail(std::string(what) + ": row length must be a multiple of 8 (got {})", {H});
}

}  // namespace

void rmsnorm(const uint16_t* x, int64_t ldx, const uint16_t* w, int T, int H, float eps, bool zero_centred,
             uint16_t* out, int64_t ldo, Stream stream) {
  if (T <= 0) return;
  check_rows(H, "rmsnorm");
  rmsnorm_kernel<<<T, kNormThreads, 0, stream>>>(x, ldx, w, H, eps, zero_centred, out, ldo);
  KILN_CUDA_CHECK_LAUNCH();
}

void add_rmsnorm(uint16_t* residual, const uint16_t* delta, const uint16_t* w, int T, int H, float eps,
                 bool zero_centred, uint16_t* out, Stream stream) {
  if (T <= 0) return;
  check_rows(H, "add_rmsnorm");
  add_rmsnorm_kernel<<<T, kNormThreads, 0, stream>>>(residual, delta, w, H, eps, zero_centred, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void embedding(const uint16_t* table, const int32_t* ids, int T, int H, int64_t V, uint16_t* out, Stream stream) {
  if (T <= 0) return;
  check_rows(H, "embedding");
  embedding_kernel<<<T, 256, 0, stream>>>(table, ids, H, V, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void silu_mul(const uint16_t* gu, int64_t ld_gu, int T, int I, uint16_t* out, int64_t ldo, Stream stream) {
  if (T <= 0) return;
  check_rows(I, "silu_mul");
  const dim3 grid((I / 8 + 127) / 128, T);
  silu_mul_kernel<<<grid, 128, 0, stream>>>(gu, ld_gu, I, out, ldo);
  KILN_CUDA_CHECK_LAUNCH();
}


void fill_random_u8(uint8_t* p, size_t n, uint32_t seed, uint8_t lo, uint8_t hi, Stream stream) {
  if (n == 0) return;
  fill_u8_kernel<<<kFillBlocks, 256, 0, stream>>>(p, n, seed, lo, uint32_t(hi) - lo + 1);
  KILN_CUDA_CHECK_LAUNCH();
}
void fill_random_bf16(uint16_t* p, size_t n, uint32_t seed, float scale, Stream stream) {
  if (n == 0) return;
  fill_bf16_kernel<<<kFillBlocks, 256, 0, stream>>>(p, n, seed, scale);
  KILN_CUDA_CHECK_LAUNCH();
}
void fill_random_f32(float* p, size_t n, uint32_t seed, float lo, float hi, Stream stream) {
  if (n == 0) return;
  fill_f32_kernel<<<kFillBlocks, 256, 0, stream>>>(p, n, seed, lo, hi);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda
