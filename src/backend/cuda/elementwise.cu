// CudaOps kernels over rows and elements: strided copy, max |x|, embedding, RMSNorm (plain / zero-centred /
// gated), RoPE, add, SiLU-mul, sigmoid-mul, row gather.
// One thread per element or a warp per row; fp32 maths in the CPU backend's order where it matters.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;

constexpr int kBlock = 256;

// ---- copy

struct CopyShape {
  int64_t shape[4], ss[4], ds[4];
};

template <typename T>
__global__ void copy_kernel(const T* __restrict__ src, T* __restrict__ dst, CopyShape c, int64_t total) {
  dev::pdl_enter();  // first statement: see launch.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rem = i, so = 0, dof = 0;
#pragma unroll
    for (int d = 3; d >= 0; --d) {
      const int64_t idx = rem % c.shape[d];
      rem /= c.shape[d];
      so += idx * c.ss[d];
      dof += idx * c.ds[d];
    }
    dst[dof] = src[so];
  }
}


// ---- max |x|

__global__ void max_abs_kernel(const float* __restrict__ x, int64_t n, unsigned* result) {
  dev::pdl_enter();  // first statement: see launch.cuh
  float m = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(x[i]));
  m = warp_max(m);
  // Non-negative floats order like their bit patterns.
  if ((threadIdx.x & 31) == 0) atomicMax(result, __float_as_uint(m));
}

// ---- embedding / gather

__global__ void embedding_kernel(const void* __restrict__ table, ElemType elem, int64_t V, int64_t H,
                                 const int32_t* __restrict__ ids, int64_t id_begin, int64_t T, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t total = T * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, h = i % H;
    const int64_t row = int64_t(ids[t]) - id_begin;
    out[i] = (row >= 0 && row < V) ? load_elem(table, elem, row * H + h) : 0.0f;
  }
}

__global__ void gather_rows_kernel(const float* __restrict__ x, int64_t x_rows, int64_t H,
                                   const int32_t* __restrict__ rows, int64_t R, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t total = R * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / H, h = i % H;
    const int32_t src = rows[r];
    out[i] = (src >= 0 && src < x_rows) ? x[int64_t(src) * H + h] : 0.0f;
  }
}

// src is often the previous kernel's output (the carried ids: an argmax just before), and src[i]'s address depends on
// nothing but the arguments: read it with coherent loads, never ld.global.nc (launch.cuh, "Non-coherent loads").
__global__ void scatter_rows_kernel(const float* src, const int32_t* rows, int64_t R, int64_t H, float* dst,
                                    int64_t dst_rows) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t total = R * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / H, h = i % H;
    const int32_t d = __ldcg(rows + r);
    if (d >= 0 && d < dst_rows) dst[int64_t(d) * H + h] = __ldcg(src + i);
  }
}

// ---- norms: a warp per row

constexpr int kRowsPerBlock = 8;  // warps per block

__global__ void rms_norm_kernel(const float* __restrict__ x, int64_t ldx, int64_t R, int64_t D, const void* w,
                                ElemType w_elem, float eps, bool zero_centred, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= R) return;
  const float* xr = x + r * ldx;
  const float inv = warp_row_inv_rms(xr, D, eps);
  const float one = zero_centred ? 1.0f : 0.0f;
  for (int64_t i = lane; i < D; i += 32) out[r * D + i] = (xr[i] * inv) * (load_elem(w, w_elem, i) + one);
}

// Long rows (D >= 512): a block of 256 threads per row, so that a decode step's single row is not one warp's
// serial walk.
template <int kWElem>  // 0: f32 weights, 1: bf16, -1: any (load_elem)
__device__ __forceinline__ float norm_w(const void* w, ElemType w_elem, int i) {
  if constexpr (kWElem == 0) return static_cast<const float*>(w)[i];
  else if constexpr (kWElem == 1) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(w)[i]) << 16);
  else return load_elem(w, w_elem, i);
}

// The block-per-row RMSNorm body: the row's element i is row_value(i), which keep_row(i, v) may store (the residual
// add writes the sum back); out_row = rmsnorm(row) * (w + one). D <= 4096 is staged in registers (16 per thread, every
// load issued at once) so that the sum of squares and the output come from one read; longer rows read row_after (the
// row as it is after keep_row) again for the output.
template <int kWElem, class RowValue, class KeepRow>
__device__ __forceinline__ void rms_norm_block_row(RowValue row_value, KeepRow keep_row, const float* row_after,
                                                   int64_t D, const void* w, ElemType w_elem, float eps,
                                                   bool zero_centred, float* __restrict__ out_row) {
  __shared__ float red[32];
  const float one = zero_centred ? 1.0f : 0.0f;
  constexpr int kPer = 16;
  if (D <= 256 * kPer) {
    float v[kPer], wv[kPer];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = threadIdx.x + 256 * j;
      const int ic = i < D ? i : int(D) - 1;
      v[j] = row_value(ic);
      wv[j] = norm_w<kWElem>(w, w_elem, ic);
      if (i < D) ss += v[j] * v[j];
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = threadIdx.x + 256 * j;
      if (i < D) keep_row(i, v[j]);
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / float(D) + eps);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = threadIdx.x + 256 * j;
      if (i < D) out_row[i] = (v[j] * inv) * (wv[j] + one);
    }
    return;
  }
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = row_value(i);
    keep_row(i, v);
    ss += v * v;
  }
  ss = block_sum(ss, red);  // its barrier also orders this thread's keep_row writes before the reads below
  const float inv = 1.0f / sqrtf(ss / float(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    out_row[i] = (row_after[i] * inv) * (load_elem(w, w_elem, i) + one);
}

template <int kWElem>
__global__ void __launch_bounds__(256) rms_norm_row_kernel(const float* __restrict__ x, int64_t ldx, int64_t D,
                                                           const void* w, ElemType w_elem, float eps,
                                                           bool zero_centred, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const float* xr = x + int64_t(blockIdx.x) * ldx;
  rms_norm_block_row<kWElem>([xr](int64_t i) { return xr[i]; }, [](int64_t, float) {}, xr, D, w, w_elem, eps,
                             zero_centred, out + int64_t(blockIdx.x) * D);
}

// hidden += y, out = rmsnorm(hidden): a block per row.
template <int kWElem>
__global__ void __launch_bounds__(256) add_rms_norm_row_kernel(float* __restrict__ hidden, const float* __restrict__ y,
                                                               int64_t D, const void* w, ElemType w_elem, float eps,
                                                               bool zero_centred, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  float* hr = hidden + int64_t(blockIdx.x) * D;
  const float* yr = y + int64_t(blockIdx.x) * D;
  rms_norm_block_row<kWElem>([hr, yr](int64_t i) { return hr[i] + yr[i]; }, [hr](int64_t i, float v) { hr[i] = v; },
                             hr, D, w, w_elem, eps, zero_centred, out + int64_t(blockIdx.x) * D);
}

__global__ void gated_rms_norm_kernel(const float* __restrict__ x, const float* __restrict__ z, int64_t R, int64_t D,
                                      const void* w, ElemType w_elem, float eps, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= R) return;
  const float* xr = x + r * D;
  const float inv = warp_row_inv_rms(xr, D, eps);
  for (int64_t i = lane; i < D; i += 32)
    out[r * D + i] = (load_elem(w, w_elem, i) * (xr[i] * inv)) * silu(z[r * D + i]);
}

// ---- RoPE: a thread per (token, head, pair)

// Pair (p, p + half) of one row v rotated by the token's position(s) pos. Same as the CPU: inv_freq in double rounded to
// float, angle = float(pos) * inv_freq in fp32. M-RoPE (pos_stride 3): frequency p takes the position of axis
// (axes >> 2p) & 3 (model::MRopeAxes).
__device__ __forceinline__ void rotate_pair(float* v, int p, int half, int rotary_dim, double theta,
                                            const int32_t* pos, int pos_stride, uint64_t axes_lo, uint64_t axes_hi) {
  const int axis = pos_stride == 1 ? 0 : static_cast<int>(((p < 32 ? axes_lo : axes_hi) >> (2 * (p % 32))) & 3u);
  const float inv_freq = static_cast<float>(1.0 / pow(theta, static_cast<double>(2 * p) / rotary_dim));
  const float angle = static_cast<float>(pos[axis]) * inv_freq;
  float s, c;
  sincosf(angle, &s, &c);
  const float a = v[p], b = v[p + half];
  v[p] = a * c - b * s;
  v[p + half] = b * c + a * s;
}


__global__ void rope_kernel(float* __restrict__ x, int64_t T, int64_t heads, int64_t D,
                            const int32_t* __restrict__ positions, int pos_stride, uint64_t axes_lo, uint64_t axes_hi,
                            int rotary_dim, double theta) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int half = rotary_dim / 2;
  const int64_t total = T * heads * half;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int p = static_cast<int>(i % half);
    const int64_t th = i / half, t = th / heads;
    rotate_pair(x + th * D, p, half, rotary_dim, theta, positions + t * pos_stride, pos_stride, axes_lo, axes_hi);
  }
}

// ---- the full-attention prologue: a warp per (token, head) row, norm then rotation through shared memory

constexpr int kQkWarps = 4;
constexpr int kQkMaxD = 511;  // rms_norm() takes the block-per-row kernel from D = 512 (another summation order)

__global__ void __launch_bounds__(kQkWarps * 32)
    qk_norm_rope_kernel(const float* __restrict__ q, int64_t ldq, int64_t q_head_stride, const float* __restrict__ k,
                        int64_t ldk, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const void* q_w,
                        ElemType q_w_elem, const void* k_w, ElemType k_w_elem, float eps, bool zero_centred,
                        const int32_t* __restrict__ positions, int pos_stride, uint64_t axes_lo, uint64_t axes_hi,
                        int rotary_dim, double theta, float* __restrict__ q_out, float* __restrict__ gate_out,
                        float* __restrict__ k_out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ float qk_rows[];  // [kQkWarps][D]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t H = Hq + Hkv, row = int64_t(blockIdx.x) * kQkWarps + warp;
  if (row >= T * H) return;  // the rest of the kernel synchronises within the warp only
  const int64_t t = row / H, h = row % H;
  const bool is_q = h < Hq;
  const float* src = is_q ? q + t * ldq + h * q_head_stride : k + t * ldk + (h - Hq) * D;
  const void* w = is_q ? q_w : k_w;
  const ElemType w_elem = is_q ? q_w_elem : k_w_elem;
  float* dst = is_q ? q_out + (t * Hq + h) * D : k_out + (t * Hkv + (h - Hq)) * D;
  float* v = qk_rows + warp * D;
  const float inv = warp_row_inv_rms(src, D, eps);
  const float one = zero_centred ? 1.0f : 0.0f;
  for (int64_t i = lane; i < D; i += 32) v[i] = (src[i] * inv) * (load_elem(w, w_elem, i) + one);
  if (is_q && gate_out)
    for (int64_t i = lane; i < D; i += 32) gate_out[(t * Hq + h) * D + i] = src[D + i];
  __syncwarp();
  for (int p = lane; p < rotary_dim / 2; p += 32)
    rotate_pair(v, p, rotary_dim / 2, rotary_dim, theta, positions + t * pos_stride, pos_stride, axes_lo, axes_hi);
  __syncwarp();
  for (int64_t i = lane; i < D; i += 32) dst[i] = v[i];
}

// ---- elementwise

__global__ void add_kernel(const float* a, const float* b, float* out, int64_t n) {
  dev::pdl_enter();  // first statement: see launch.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

__global__ void silu_mul_kernel(const float* g, const float* u, float* out, int64_t n) {
  dev::pdl_enter();  // first statement: see launch.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = silu(g[i]) * u[i];
}

__global__ void sigmoid_mul_kernel(const float* x, const float* g, float* out, int64_t T, int64_t N, int64_t g_cols) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t total = T * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / N, c = i % N;
    out[i] = x[i] * sigmoid(g[t * g_cols + (g_cols == 1 ? 0 : c)]);
  }
}

// Span blockIdx.y; its blocks stride over it. 16-byte words when the span allows, else single bytes.
__global__ void copy_spans_kernel(const ByteSpan* __restrict__ spans) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const ByteSpan s = spans[blockIdx.y];
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (((reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) | s.bytes) & 15) == 0) {
    const uint4* src = static_cast<const uint4*>(s.src);
    uint4* dst = static_cast<uint4*>(s.dst);
    for (uint64_t i = first; i < s.bytes / 16; i += stride) dst[i] = src[i];
  } else {
    const uint8_t* src = static_cast<const uint8_t*>(s.src);
    uint8_t* dst = static_cast<uint8_t*>(s.dst);
    for (uint64_t i = first; i < s.bytes; i += stride) dst[i] = src[i];
  }
}

}  // namespace

void copy_spans(const ByteSpan* spans, int n, uint64_t max_bytes, Stream stream) {
  if (n <= 0 || max_bytes == 0) return;
  if (n > 65535) cuda_fail("copy_spans: {} spans in one launch (at most 65,535)", {n});
  // Enough blocks per span to stream its largest member (16 bytes a thread a round), at most 64 per span.
  const uint64_t words = (max_bytes + 15) / 16;
  const unsigned x = static_cast<unsigned>(std::min<uint64_t>(64, std::max<uint64_t>(1, (words + kBlock - 1) / kBlock)));
  launch_kernel(copy_spans_kernel, dim3(x, static_cast<unsigned>(n)), kBlock, 0, stream, spans);
  KILN_CUDA_CHECK_LAUNCH();
}

void copy_strided(const void* src, void* dst, int elem_bytes, const int64_t shape[4], const int64_t src_strides[4],
                  const int64_t dst_strides[4], Stream stream) {
  CopyShape c;
  int64_t total = 1;
  for (int d = 0; d < 4; ++d) {
    c.shape[d] = shape[d];
    c.ss[d] = src_strides[d];
    c.ds[d] = dst_strides[d];
    total *= shape[d];
  }
  if (total == 0) return;
  const unsigned grid = capped_grid(total);
  switch (elem_bytes) {
    case 1: launch_kernel(copy_kernel<uint8_t>, grid, kBlock, 0, stream, static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), c, total); break;
    case 2: launch_kernel(copy_kernel<uint16_t>, grid, kBlock, 0, stream, static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), c, total); break;
    case 4: launch_kernel(copy_kernel<uint32_t>, grid, kBlock, 0, stream, static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), c, total); break;
    case 8: launch_kernel(copy_kernel<uint64_t>, grid, kBlock, 0, stream, static_cast<const uint64_t*>(src), static_cast<uint64_t*>(dst), c, total); break;
    default: cuda_fail("copy: element size {} is not supported (1, 2, 4 or 8 bytes)", {elem_bytes});
  }
  KILN_CUDA_CHECK_LAUNCH();
}
void max_abs(const float* x, int64_t n, float* result, Stream stream) {
  KILN_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof(float), stream));
  if (n == 0) return;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  launch_kernel(max_abs_kernel, static_cast<unsigned>(blocks < 1024 ? blocks : 1024), kBlock, 0, stream, x, n, reinterpret_cast<unsigned*>(result));
  KILN_CUDA_CHECK_LAUNCH();
}

void embedding(const void* table, ElemType elem, int64_t V, int64_t H, const int32_t* ids, int64_t id_begin, int64_t T,
               float* out, Stream stream) {
  if (T * H == 0) return;
  launch_kernel(embedding_kernel, capped_grid(T * H), kBlock, 0, stream, table, elem, V, H, ids, id_begin, T, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void gather_rows(const float* x, int64_t x_rows, int64_t H, const int32_t* rows, int64_t R, float* out,
                 Stream stream) {
  if (R * H == 0) return;
  launch_kernel(gather_rows_kernel, capped_grid(R * H), kBlock, 0, stream, x, x_rows, H, rows, R, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void rms_norm(const float* x, int64_t ldx, int64_t R, int64_t D, const void* w, ElemType w_elem, float eps,
              bool zero_centred, float* out, Stream stream) {
  if (R == 0) return;
  if (D >= 512) {
    const unsigned g = static_cast<unsigned>(R);
    if (w_elem == ElemType::bf16) launch_kernel(rms_norm_row_kernel<1>, g, 256, 0, stream, x, ldx, D, w, w_elem, eps, zero_centred, out);
    else if (w_elem == ElemType::f32) launch_kernel(rms_norm_row_kernel<0>, g, 256, 0, stream, x, ldx, D, w, w_elem, eps, zero_centred, out);
    else launch_kernel(rms_norm_row_kernel<-1>, g, 256, 0, stream, x, ldx, D, w, w_elem, eps, zero_centred, out);
  } else {
    launch_kernel(rms_norm_kernel, grid_for(R, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream, x, ldx, R, D, w, w_elem, eps,
                                                                              zero_centred, out);
  }
  KILN_CUDA_CHECK_LAUNCH();
}

void add_rms_norm(float* hidden, const float* y, int64_t R, int64_t D, const void* w, ElemType w_elem, float eps,
                  bool zero_centred, float* out, Stream stream) {
  if (R == 0) return;
  const unsigned g = static_cast<unsigned>(R);
  if (w_elem == ElemType::bf16) launch_kernel(add_rms_norm_row_kernel<1>, g, 256, 0, stream, hidden, y, D, w, w_elem, eps, zero_centred, out);
  else if (w_elem == ElemType::f32) launch_kernel(add_rms_norm_row_kernel<0>, g, 256, 0, stream, hidden, y, D, w, w_elem, eps, zero_centred, out);
  else launch_kernel(add_rms_norm_row_kernel<-1>, g, 256, 0, stream, hidden, y, D, w, w_elem, eps, zero_centred, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void gated_rms_norm(const float* x, const float* z, int64_t R, int64_t D, const void* w, ElemType w_elem, float eps,
                    float* out, Stream stream) {
  if (R == 0) return;
  launch_kernel(gated_rms_norm_kernel, grid_for(R, kRowsPerBlock), 32 * kRowsPerBlock, 0, stream, x, z, R, D, w, w_elem, eps,
                                                                                      out);
  KILN_CUDA_CHECK_LAUNCH();
}

bool qk_norm_rope_fits(int64_t D) { return D >= 1 && D <= kQkMaxD; }

void qk_norm_rope(const float* q, int64_t ldq, int64_t q_head_stride, const float* k, int64_t ldk, int64_t T,
                  int64_t Hq, int64_t Hkv, int64_t D, const void* q_w, ElemType q_w_elem, const void* k_w,
                  ElemType k_w_elem, float eps, bool zero_centred, const int32_t* positions, int pos_stride,
                  uint64_t axes_lo, uint64_t axes_hi, int rotary_dim, double theta, float* q_out, float* gate_out,
                  float* k_out, Stream stream) {
  const int64_t rows = T * (Hq + Hkv);
  if (rows == 0) return;
  if (!qk_norm_rope_fits(D)) cuda_fail("qk_norm_rope: head dim {} (at most {})", {D, int64_t(kQkMaxD)});
  launch_kernel(qk_norm_rope_kernel, grid_for(rows, kQkWarps), kQkWarps * 32, kQkWarps * D * sizeof(float), stream, q,
                ldq, q_head_stride, k, ldk, T, Hq, Hkv, D, q_w, q_w_elem, k_w, k_w_elem, eps, zero_centred, positions,
                pos_stride, axes_lo, axes_hi, rotary_dim, theta, q_out, gate_out, k_out);
  KILN_CUDA_CHECK_LAUNCH();
}

void rope(float* x, int64_t T, int64_t heads, int64_t D, const int32_t* positions, int rotary_dim, double theta,
          Stream stream) {
  const int64_t total = T * heads * (rotary_dim / 2);
  if (total == 0) return;
  launch_kernel(rope_kernel, capped_grid(total), kBlock, 0, stream, x, T, heads, D, positions, 1, uint64_t{0},
                uint64_t{0}, rotary_dim, theta);
  KILN_CUDA_CHECK_LAUNCH();
}

void mrope(float* x, int64_t T, int64_t heads, int64_t D, const int32_t* positions, uint64_t axes_lo,
           uint64_t axes_hi, int rotary_dim, double theta, Stream stream) {
  const int64_t total = T * heads * (rotary_dim / 2);
  if (total == 0) return;
  launch_kernel(rope_kernel, capped_grid(total), kBlock, 0, stream, x, T, heads, D, positions, 3, axes_lo, axes_hi,
                rotary_dim, theta);
  KILN_CUDA_CHECK_LAUNCH();
}

void scatter_rows(const float* src, const int32_t* rows, int64_t R, int64_t H, float* dst, int64_t dst_rows,
                  Stream stream) {
  if (R * H == 0) return;
  launch_kernel(scatter_rows_kernel, capped_grid(R * H), kBlock, 0, stream, src, rows, R, H, dst, dst_rows);
  KILN_CUDA_CHECK_LAUNCH();
}

void add(const float* a, const float* b, float* out, int64_t n, Stream stream) {
  if (n == 0) return;
  launch_kernel(add_kernel, capped_grid(n), kBlock, 0, stream, a, b, out, n);
  KILN_CUDA_CHECK_LAUNCH();
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n, Stream stream) {
  if (n == 0) return;
  launch_kernel(silu_mul_kernel, capped_grid(n), kBlock, 0, stream, gate, up, out, n);
  KILN_CUDA_CHECK_LAUNCH();
}

void sigmoid_mul(const float* x, const float* g, float* out, int64_t T, int64_t N, int64_t g_cols, Stream stream) {
  if (T * N == 0) return;
  launch_kernel(sigmoid_mul_kernel, capped_grid(T * N), kBlock, 0, stream, x, g, out, T, N, g_cols);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
