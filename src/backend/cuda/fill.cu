// Device fills that are not model maths: the deterministic random fill of `--load-format dummy` (the device twin of
// model::fill_random_host: same hash, same rounding, so CPU and GPU dummy weights are identical bytes), and the
// busy-wait kernel the op profiler queues first so that the ops after it run back to back.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda::ops {
namespace {

__device__ __forceinline__ uint64_t fill_hash(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Index in the full tensor of slice element i (format::slice_source_index).
__device__ __forceinline__ int64_t slice_source(const FillSlice& s, int64_t i) {
  const int64_t c = i % s.last_local;
  int64_t rest = i / s.last_local;
  const int64_t m = rest % s.mid;
  rest /= s.mid;
  int64_t j = rest % s.split_local;
  const int64_t o = rest / s.split_local;
  int64_t src = j;
  if (s.num_rows > 0) {
    for (int r = 0; r < s.num_rows; ++r) {
      if (j < s.row_count[r]) {
        src = s.row_begin[r] + j;
        break;
      }
      j -= s.row_count[r];
    }
  }
  return (((s.outer_begin + o) * s.split_full + src) * s.mid + m) * s.last_full + s.last_begin + c;
}

template <bool kSliced>
__global__ void fill_bytes_kernel(uint8_t* out, int64_t n, uint64_t seed, uint32_t lo, uint32_t span, bool sign,
                                  const FillSlice slice) {
  dev::pdl_enter();  // first statement: see launch.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t src = kSliced ? slice_source(slice, i) : i;
    const uint64_t h = fill_hash(seed, static_cast<uint64_t>(src));
    uint32_t b = lo + static_cast<uint32_t>((h >> 32) % span);
    if (sign && (h & 1)) b |= 0x80u;
    out[i] = static_cast<uint8_t>(b);
  }
}

template <int kElem, bool kSliced>  // kElem 0 f32, 1 bf16, 2 f16
__global__ void fill_uniform_kernel(void* out, int64_t n, uint64_t seed, float lo, float d, const FillSlice slice) {
  dev::pdl_enter();  // first statement: see launch.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t src = kSliced ? slice_source(slice, i) : i;
    const uint64_t h = fill_hash(seed, static_cast<uint64_t>(src));
    const float u = static_cast<float>(h >> 40) * 0x1p-24f;
    const float v = __fadd_rn(lo, __fmul_rn(d, u));  // no contraction: the host computes the same two roundings
    if constexpr (kElem == 0) static_cast<float*>(out)[i] = v;
    else if constexpr (kElem == 1) static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
    else static_cast<__half*>(out)[i] = __float2half_rn(v);
  }
}

__global__ void busy_wait_kernel(uint64_t ns) {
  dev::pdl_enter();  // first statement: see launch.cuh
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

unsigned fill_grid(int64_t n) {
  const int64_t g = (n + 255) / 256;
  return static_cast<unsigned>(g < 8192 ? (g > 0 ? g : 1) : 8192);
}

}  // namespace

void fill_random_bytes(uint8_t* out, int64_t n, uint64_t seed, uint32_t byte_lo, uint32_t byte_hi, bool random_sign,
                       Stream stream, const FillSlice* slice) {
  if (n == 0) return;
  const FillSlice s = slice ? *slice : FillSlice{};
  if (slice)
    launch_kernel(fill_bytes_kernel<true>, fill_grid(n), 256, 0, stream, out, n, seed, byte_lo, byte_hi - byte_lo,
                  random_sign, s);
  else
    launch_kernel(fill_bytes_kernel<false>, fill_grid(n), 256, 0, stream, out, n, seed, byte_lo, byte_hi - byte_lo,
                  random_sign, s);
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {
template <bool kSliced>
void launch_uniform(void* out, ElemType elem, int64_t n, uint64_t seed, float lo, float d, Stream stream,
                    const FillSlice& s) {
  switch (elem) {
    case ElemType::f32: launch_kernel(fill_uniform_kernel<0, kSliced>, fill_grid(n), 256, 0, stream, out, n, seed, lo, d, s); break;
    case ElemType::bf16: launch_kernel(fill_uniform_kernel<1, kSliced>, fill_grid(n), 256, 0, stream, out, n, seed, lo, d, s); break;
    case ElemType::f16: launch_kernel(fill_uniform_kernel<2, kSliced>, fill_grid(n), 256, 0, stream, out, n, seed, lo, d, s); break;
    default: cuda_fail("random uniform fill: element type {} is not a float type", {static_cast<int>(elem)});
  }
}
}  // namespace

void fill_random_uniform(void* out, ElemType elem, int64_t n, uint64_t seed, float lo, float hi, Stream stream,
                         const FillSlice* slice) {
  if (n == 0) return;
  const float d = hi - lo;
  if (slice) launch_uniform<true>(out, elem, n, seed, lo, d, stream, *slice);
  else launch_uniform<false>(out, elem, n, seed, lo, d, stream, FillSlice{});
  KILN_CUDA_CHECK_LAUNCH();
}

void busy_wait(double microseconds, Stream stream) {
  launch_kernel(busy_wait_kernel, 1, 1, 0, stream, static_cast<uint64_t>(microseconds * 1000.0));
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
