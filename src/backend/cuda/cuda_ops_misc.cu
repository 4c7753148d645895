// CudaOps helpers that are not model maths: the deterministic random fill of `--load-format dummy` (the device
// twin of model::fill_random_host: same hash, same rounding, so CPU and GPU dummy weights are identical bytes),
// and a busy-wait kernel the op profiler queues first so that the ops after it run back to back.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops_kernels.h"
#include "backend/cuda/cuda_ops_launch.cuh"

namespace kiln::cuda::ops {
namespace {

__device__ __forceinline__ uint64_t fill_hash(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void fill_bytes_kernel(uint8_t* out, int64_t n, uint64_t seed, uint32_t lo, uint32_t span, bool sign) {
  dev::pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = fill_hash(seed, static_cast<uint64_t>(i));
    uint32_t b = lo + static_cast<uint32_t>((h >> 32) % span);
    if (sign && (h & 1)) b |= 0x80u;
    out[i] = static_cast<uint8_t>(b);
  }
}

template <int kElem>  // 0 f32, 1 bf16, 2 f16
__global__ void fill_uniform_kernel(void* out, int64_t n, uint64_t seed, float lo, float d) {
  dev::pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = fill_hash(seed, static_cast<uint64_t>(i));
    const float u = static_cast<float>(h >> 40) * 0x1p-24f;
    const float v = __fadd_rn(lo, __fmul_rn(d, u));  // no contraction: the host computes the same two roundings
    if constexpr (kElem == 0) static_cast<float*>(out)[i] = v;
    else if constexpr (kElem == 1) static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
    else static_cast<__half*>(out)[i] = __float2half_rn(v);
  }
}

__global__ void busy_wait_kernel(uint64_t ns) {
  dev::pdl_enter();
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// x = hi + mid + lo, each bf16 (round to nearest even): the three rows blocks of out [3T, K].
__global__ void split_bf16x3_kernel(const float* __restrict__ x, int64_t ldx, int64_t T, int64_t K,
                                    __nv_bfloat16* __restrict__ out) {
  dev::pdl_enter();
  const int64_t n = T * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / K, k = i % K;
    const float v = x[t * ldx + k];
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    const float r1 = v - __bfloat162float(h);
    const __nv_bfloat16 m = __float2bfloat16_rn(r1);
    const float r2 = r1 - __bfloat162float(m);
    out[i] = h;
    out[n + i] = m;
    out[2 * n + i] = __float2bfloat16_rn(r2);
  }
}

// out[t, :] = (lo + mid) + hi of the three row blocks of part [3T, N].
// out = (lo + mid) + hi of the three partial GEMM outputs, column c of part into the segment whose column range
// holds it (one segment: a plain linear; several: one GEMM over adjacent weights).
__global__ void sum3_segments_kernel(const float* __restrict__ part, int64_t T, int64_t N, Sum3Segments segs) {
  dev::pdl_enter();
  const int64_t n = T * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / N, c = i % N;
    int s = 0;
#pragma unroll
    for (int j = 1; j < Sum3Segments::kMax; ++j)
      if (j < segs.count && c >= segs.col0[j]) s = j;
    segs.out[s][t * segs.ldo[s] + (c - segs.col0[s])] = (part[2 * n + i] + part[n + i]) + part[i];
  }
}

unsigned fill_grid(int64_t n) {
  const int64_t g = (n + 255) / 256;
  return static_cast<unsigned>(g < 8192 ? (g > 0 ? g : 1) : 8192);
}

}  // namespace

namespace {
bool g_pdl = false;
}  // namespace
namespace {
bool g_prev_kernel = false;
}  // namespace
bool pdl_enabled() { return g_pdl; }
void set_pdl_enabled(bool on) { g_pdl = on; }
void pdl_note_other_op() { g_prev_kernel = false; }
bool pdl_previous_was_kernel_and_mark() {
  const bool prev = g_prev_kernel;
  g_prev_kernel = true;
  return prev;
}

namespace {
ProfileMarkFn g_mark_fn = nullptr;
void* g_mark_ctx = nullptr;
}  // namespace
void set_profile_mark(ProfileMarkFn fn, void* ctx) {
  g_mark_fn = fn;
  g_mark_ctx = ctx;
}
void profile_mark(const char* label) {
  if (g_mark_fn) g_mark_fn(g_mark_ctx, label);
}

void fill_random_bytes(uint8_t* out, int64_t n, uint64_t seed, uint32_t byte_lo, uint32_t byte_hi, bool random_sign,
                       Stream stream) {
  if (n == 0) return;
  launch_kernel(fill_bytes_kernel, fill_grid(n), 256, 0, stream, out, n, seed, byte_lo, byte_hi - byte_lo, random_sign);
  KILN_CUDA_CHECK_LAUNCH();
}

void fill_random_uniform(void* out, ElemType elem, int64_t n, uint64_t seed, float lo, float hi, Stream stream) {
  if (n == 0) return;
  const float d = hi - lo;
  switch (elem) {
    case ElemType::f32: launch_kernel(fill_uniform_kernel<0>, fill_grid(n), 256, 0, stream, out, n, seed, lo, d); break;
    case ElemType::bf16: launch_kernel(fill_uniform_kernel<1>, fill_grid(n), 256, 0, stream, out, n, seed, lo, d); break;
    case ElemType::f16: launch_kernel(fill_uniform_kernel<2>, fill_grid(n), 256, 0, stream, out, n, seed, lo, d); break;
    default: cuda_fail("random uniform fill: element type {} is not a float type", {static_cast<int>(elem)});
  }
  KILN_CUDA_CHECK_LAUNCH();
}

void split_bf16x3(const float* x, int64_t ldx, int64_t T, int64_t K, uint16_t* out, Stream stream) {
  if (T * K == 0) return;
  launch_kernel(split_bf16x3_kernel, fill_grid(T * K), 256, 0, stream, x, ldx, T, K, reinterpret_cast<__nv_bfloat16*>(out));
  KILN_CUDA_CHECK_LAUNCH();
}

void sum3_rows_segments(const float* part, int64_t T, int64_t N, const Sum3Segments& segs, Stream stream) {
  if (T * N == 0) return;
  launch_kernel(sum3_segments_kernel, fill_grid(T * N), 256, 0, stream, part, T, N, segs);
  KILN_CUDA_CHECK_LAUNCH();
}

void sum3_rows(const float* part, int64_t T, int64_t N, float* out, int64_t ldo, Stream stream) {
  Sum3Segments one;
  one.out[0] = out;
  one.ldo[0] = ldo;
  one.count = 1;
  sum3_rows_segments(part, T, N, one, stream);
}

void busy_wait(double microseconds, Stream stream) {
  launch_kernel(busy_wait_kernel, 1, 1, 0, stream, static_cast<uint64_t>(microseconds * 1000.0));
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
