// CudaOps linear layers and routed experts, fp32 activations and accumulation, weights decoded as stored
// (dense BF16 / F16 / F32, per-tensor FP8, NVFP4) inside the kernel: no dequantised copy.
//
// Two kernels share one row-tile scheme, so a dense layer and a layer's experts run through the same code:
//  - gemv: a tile of up to 8 rows; a warp per output column walks K once, 8 weights per lane per step (decode and
//    small batches: the weights are read once per tile, which is what bounds these shapes);
//  - gemm: 64 x 64 tiles in shared memory, 16 outputs per thread (prefill).
// Rows are grouped: group g (an expert) owns sorted rows [group_offset[g], group_offset[g+1]) and row tiles
// [tile_offset[g], tile_offset[g+1]); a dense layer is one group. Row r of a group reads input row row_index[r].
// Each output row is computed on its own (no cross-row arithmetic), so the result does not depend on how the
// rows were grouped or tiled.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops_device.cuh"
#include "backend/cuda/device_utils.cuh"  // ld_stream_16
#include "backend/cuda/cuda_ops_kernels.h"
#include "backend/cuda/cuda_ops_launch.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;

// Launch shapes are sized for the H200's 132 SMs (the tuned target; other GPUs get the same shapes).
constexpr int64_t kSms = 132;
constexpr int64_t kTwoBlocksPerSm = 2 * kSms;

struct GemmArgs {
  WeightDesc w0, w1;                 // single-group weights (w1: the up projection when dual)
  const WeightDesc* table = nullptr;  // grouped: group g uses table[g * table_stride + {0, 1}]
  int table_stride = 0;
  const int32_t* group_offset = nullptr;  // [G + 1] or null (one group of `rows` rows)
  const int32_t* tile_offset = nullptr;   // [G + 1]
  const int32_t* tile_group = nullptr;    // [tiles] group of each row tile (grouped launches), or null: search
  int num_groups = 1;
  int col_passes = 1;                     // gemv2: column groups each warp walks (grid.y shrinks by this)
  int tile_m = 8;                         // gemv2: rows per row tile (the grouping's tile height)
  // gemv2, several linears of one x in one launch (dense, no groups): segment s owns grid rows (blockIdx.y)
  // [seg_block_begin[s], seg_block_begin[s + 1]) and writes seg_out[s] (row stride seg_ldo[s]).
  static constexpr int kMaxSegments = 4;
  int num_segments = 0;
  int seg_block_begin[kMaxSegments + 1] = {};
  WeightDesc seg_w[kMaxSegments];
  float* seg_out[kMaxSegments] = {};
  int64_t seg_ldo[kMaxSegments] = {};
  int rows = 0;                           // single group: number of rows
  const int32_t* row_index = nullptr;     // [rows]: input row of each sorted row, or null (identity)
  const float* x = nullptr;
  int64_t ldx = 0;
  float* out = nullptr;  // [sorted rows, N]
  int64_t ldo = 0;
  int N = 0, K = 0;
};

// The group and row range of row tile `tile` (tile height tm); false when the tile is past the last group's.
__device__ __forceinline__ bool tile_rows(const GemmArgs& a, int tile, int tm, int& group, int& row_begin,
                                          int& row_end) {
  if (!a.group_offset) {
    group = 0;
    row_begin = tile * tm;
    row_end = min(a.rows, row_begin + tm);
    return row_begin < a.rows;
  }
  if (tile >= a.tile_offset[a.num_groups]) return false;
  int lo = 0;
  if (a.tile_group) {
    lo = a.tile_group[tile];
  } else {
    int hi = a.num_groups - 1;  // last g with tile_offset[g] <= tile
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (a.tile_offset[mid] <= tile) lo = mid;
      else hi = mid - 1;
    }
  }
  group = lo;
  row_begin = a.group_offset[lo] + (tile - a.tile_offset[lo]) * tm;
  row_end = min(a.group_offset[lo + 1], row_begin + tm);
  return row_begin < row_end;
}

__device__ __forceinline__ const WeightDesc& weight_of(const GemmArgs& a, int group, int which) {
  if (a.table) return a.table[group * a.table_stride + which];
  return which == 0 ? a.w0 : a.w1;
}

__device__ __forceinline__ float bias_of(const WeightDesc& w, int n) {
  return w.bias ? load_elem(w.bias, w.bias_elem, n) : 0.0f;
}

// ---- gemv: tile of <= 8 rows, a warp per output column n

constexpr int kGemvRows = 8;
constexpr int kGemvWarps = 8;

template <bool kDual, bool kVec>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_kernel(GemmArgs a) {
  dev::pdl_enter();
  int group, rb, re;
  if (!tile_rows(a, blockIdx.x, kGemvRows, group, rb, re)) return;
  const int n = blockIdx.y * kGemvWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= a.N) return;
  const WeightDesc& w0 = weight_of(a, group, 0);
  const WeightDesc& w1 = weight_of(a, group, kDual ? 1 : 0);
  const int nrows = re - rb;
  const float* xr[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    const int row = rb + min(r, nrows - 1);
    xr[r] = a.x + int64_t(a.row_index ? a.row_index[row] : row) * a.ldx;
  }
  float acc0[kGemvRows], acc1[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) acc0[r] = acc1[r] = 0.0f;

  if constexpr (kVec) {
    for (int k0 = lane * 8; k0 < a.K; k0 += 32 * 8) {
      float wa[8], wb[8];
      weight_at8(w0, n, k0, wa);
      if constexpr (kDual) weight_at8(w1, n, k0, wb);
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) {
        if (r < nrows) {
          const float4 xa = *reinterpret_cast<const float4*>(xr[r] + k0);
          const float4 xb = *reinterpret_cast<const float4*>(xr[r] + k0 + 4);
          const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            acc0[r] += xv[i] * wa[i];
            if constexpr (kDual) acc1[r] += xv[i] * wb[i];
          }
        }
      }
    }
  } else {
    for (int k = lane; k < a.K; k += 32) {
      const float wa = weight_at(w0, n, k);
      const float wb = kDual ? weight_at(w1, n, k) : 0.0f;
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) {
        if (r < nrows) {
          const float xv = xr[r][k];
          acc0[r] += xv * wa;
          if constexpr (kDual) acc1[r] += xv * wb;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    if (r < nrows) {  // nrows is uniform over the warp: the shuffles see every lane
      const float s0 = warp_sum(acc0[r]);
      const float s1 = kDual ? warp_sum(acc1[r]) : 0.0f;
      if (lane == 0) {
        float y;
        if constexpr (kDual) y = silu(s0 + bias_of(w0, n)) * (s1 + bias_of(w1, n));
        else y = s0 + bias_of(w0, n);
        a.out[int64_t(rb + r) * a.ldo + n] = y;
      }
    }
  }
}

// ---- gemv2: the bandwidth kernel for decode-sized tiles (<= 8 rows), one weight format per instantiation.
// A warp owns kCols output columns; each lane streams 16 bytes of each column's row per step (bf16: 8 weights,
// nvfp4: 32 codes + 2 block scales), two steps in flight, and the tile's rows read x through L1. NVFP4 sums
// x * e2m1 per 16-element block and scales each block sum once (then scale_2 at the end): the same products as
// the CPU backend's, summed in another order (rel ~1e-7).

enum class G2Kind { bf16, nvfp4 };

template <G2Kind kKind>
struct G2 {
  static constexpr int kElems = kKind == G2Kind::bf16 ? 8 : 32;  // weights per 16-byte lane load
};

__device__ __forceinline__ float e2m1_fast(uint32_t c) {
  // bits: sign -> 31, exponent/mantissa (3 bits) -> 24..22: the value times 2^-126 (code 1: the subnormal 2^-127),
  // scaled back exactly by 2^126.
  return __uint_as_float(((c & 7u) << 22) | ((c & 8u) << 28)) * 8.507059173023462e+37f;
}

template <G2Kind kKind, bool kDual, int kCols, int kRows>
__global__ void __launch_bounds__(128) gemv2_kernel(GemmArgs a) {
  dev::pdl_enter();
  constexpr int kE = G2<kKind>::kElems;
  constexpr int kU = 2;  // steps in flight
  int group, rb, re;
  if (!tile_rows(a, blockIdx.x, a.tile_m, group, rb, re)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Segment (multi-linear launches): its weight, output and column-block offset.
  int seg = 0;
  for (int q = 1; q < a.num_segments; ++q)
    if (int(blockIdx.y) >= a.seg_block_begin[q]) seg = q;
  const int by = a.num_segments ? int(blockIdx.y) - a.seg_block_begin[seg] : int(blockIdx.y);
  const WeightDesc& w0 = a.num_segments ? a.seg_w[seg] : weight_of(a, group, 0);
  const WeightDesc& w1 = a.num_segments ? a.seg_w[seg] : weight_of(a, group, kDual ? 1 : 0);
  const int N = a.num_segments ? w0.n : a.N;
  float* const out = a.num_segments ? a.seg_out[seg] : a.out;
  const int64_t ldo = a.num_segments ? a.seg_ldo[seg] : a.ldo;
  const int nrows = re - rb;
  // Rows past the tile's last one read the last row again (their loads stay unconditional, so they are issued
  // together); only real rows are stored.
  const float* xr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = rb + min(r, nrows - 1);
    xr[r] = a.x + int64_t(a.row_index ? a.row_index[row] : row) * a.ldx;
  }
  for (int pass = 0; pass < a.col_passes; ++pass) {
  const int n0 = ((by * a.col_passes + pass) * 4 + warp) * kCols;
  if (n0 >= N) break;
  int ncol[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) ncol[c] = min(n0 + c, N - 1);  // duplicates of the last column are not stored
  float acc0[kRows][kCols], acc1[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc0[r][c] = acc1[r][c] = 0.0f;

  const int64_t row_bytes = kKind == G2Kind::bf16 ? int64_t(a.K) * 2 : int64_t(a.K) / 2;
  const char* base0[kCols];
  const char* base1[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    base0[c] = static_cast<const char*>(w0.data) + ncol[c] * row_bytes;
    base1[c] = static_cast<const char*>(w1.data) + ncol[c] * row_bytes;
  }
  for (int kb = lane * kE; kb < a.K; kb += 32 * kE * kU) {
    uint4 raw0[kU][kCols], raw1[kU][kCols];
    uint32_t sc0[kU][kCols], sc1[kU][kCols];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k0 = kb + u * 32 * kE;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        if (k0 < a.K) {
          const int64_t off = kKind == G2Kind::bf16 ? int64_t(k0) * 2 : int64_t(k0) / 2;
          raw0[u][c] = ::kiln::cuda::dev::ld_stream_16(base0[c] + off);
          if constexpr (kDual) raw1[u][c] = ::kiln::cuda::dev::ld_stream_16(base1[c] + off);
          if constexpr (kKind == G2Kind::nvfp4) {
            sc0[u][c] = __ldg(reinterpret_cast<const uint16_t*>(w0.block_scale + ncol[c] * int64_t(a.K / 16) + k0 / 16));
            if constexpr (kDual)
              sc1[u][c] = __ldg(reinterpret_cast<const uint16_t*>(w1.block_scale + ncol[c] * int64_t(a.K / 16) + k0 / 16));
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k0 = kb + u * 32 * kE;
      if (k0 >= a.K) break;
      if constexpr (kKind == G2Kind::bf16) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // 4 weights at a time
          float wa[kCols][4], wb[kCols][4];
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            const uint32_t p0 = h ? raw0[u][c].z : raw0[u][c].x, p1 = h ? raw0[u][c].w : raw0[u][c].y;
            wa[c][0] = __uint_as_float(p0 << 16); wa[c][1] = __uint_as_float(p0 & 0xffff0000u);
            wa[c][2] = __uint_as_float(p1 << 16); wa[c][3] = __uint_as_float(p1 & 0xffff0000u);
            if constexpr (kDual) {
              const uint32_t q0 = h ? raw1[u][c].z : raw1[u][c].x, q1 = h ? raw1[u][c].w : raw1[u][c].y;
              wb[c][0] = __uint_as_float(q0 << 16); wb[c][1] = __uint_as_float(q0 & 0xffff0000u);
              wb[c][2] = __uint_as_float(q1 << 16); wb[c][3] = __uint_as_float(q1 & 0xffff0000u);
            }
          }
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const float4 xv = *reinterpret_cast<const float4*>(xr[r] + k0 + 4 * h);
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
              acc0[r][c] += xv.x * wa[c][0] + xv.y * wa[c][1] + xv.z * wa[c][2] + xv.w * wa[c][3];
              if constexpr (kDual) acc1[r][c] += xv.x * wb[c][0] + xv.y * wb[c][1] + xv.z * wb[c][2] + xv.w * wb[c][3];
            }
          }
        }
      } else {
#pragma unroll
        for (int blk = 0; blk < 2; ++blk) {  // two 16-code blocks per 16-byte load
          float part0[kRows][kCols], part1[kRows][kCols];
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int c = 0; c < kCols; ++c) part0[r][c] = part1[r][c] = 0.0f;
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // 8 codes (one 32-bit word) at a time
            float wa[kCols][8], wb[kCols][8];
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
              const int wi = blk * 2 + h;
              const uint32_t word = wi == 0 ? raw0[u][c].x : wi == 1 ? raw0[u][c].y : wi == 2 ? raw0[u][c].z : raw0[u][c].w;
#pragma unroll
              for (int i = 0; i < 8; ++i) wa[c][i] = e2m1_fast(word >> (4 * i));
              if constexpr (kDual) {
                const uint32_t w2 = wi == 0 ? raw1[u][c].x : wi == 1 ? raw1[u][c].y : wi == 2 ? raw1[u][c].z : raw1[u][c].w;
#pragma unroll
                for (int i = 0; i < 8; ++i) wb[c][i] = e2m1_fast(w2 >> (4 * i));
              }
            }
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              const float4 xa = *reinterpret_cast<const float4*>(xr[r] + k0 + 16 * blk + 8 * h);
              const float4 xb = *reinterpret_cast<const float4*>(xr[r] + k0 + 16 * blk + 8 * h + 4);
#pragma unroll
              for (int c = 0; c < kCols; ++c) {
                part0[r][c] += xa.x * wa[c][0] + xa.y * wa[c][1] + xa.z * wa[c][2] + xa.w * wa[c][3] +
                               xb.x * wa[c][4] + xb.y * wa[c][5] + xb.z * wa[c][6] + xb.w * wa[c][7];
                if constexpr (kDual)
                  part1[r][c] += xa.x * wb[c][0] + xa.y * wb[c][1] + xa.z * wb[c][2] + xa.w * wb[c][3] +
                                 xb.x * wb[c][4] + xb.y * wb[c][5] + xb.z * wb[c][6] + xb.w * wb[c][7];
              }
            }
          }
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            const float bs0 = e4m3_to_f32((sc0[u][c] >> (8 * blk)) & 0xffu);
            const float bs1 = kDual ? e4m3_to_f32((sc1[u][c] >> (8 * blk)) & 0xffu) : 0.0f;
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              acc0[r][c] += part0[r][c] * bs0;
              if constexpr (kDual) acc1[r][c] += part1[r][c] * bs1;
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r < nrows) {  // uniform over the warp
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        float s0 = warp_sum(acc0[r][c]);
        float s1 = kDual ? warp_sum(acc1[r][c]) : 0.0f;
        const int n = n0 + c;
        if (lane == 0 && n < N) {
          if constexpr (kKind == G2Kind::nvfp4) {
            s0 *= w0.scale;
            if constexpr (kDual) s1 *= w1.scale;
          }
          float y;
          if constexpr (kDual) y = silu(s0 + bias_of(w0, n)) * (s1 + bias_of(w1, n));
          else y = s0 + bias_of(w0, n);
          out[int64_t(rb + r) * ldo + n] = y;
        }
      }
    }
  }
  }  // pass
}

// ---- gemm: 64 x 64 tiles, BK 16, 256 threads, thread (tx, ty) owns rows ty + 16 i, columns tx + 16 j

constexpr int kTileM = 64, kTileN = 64, kTileK = 16;

template <bool kDual>
__global__ void __launch_bounds__(256) gemm_kernel(GemmArgs a) {
  dev::pdl_enter();
  __shared__ float xs[kTileK][kTileM + 1];
  __shared__ float ws0[kTileK][kTileN + 1];
  __shared__ float ws1[kDual ? kTileK : 1][kTileN + 1];
  int group, rb, re;
  if (!tile_rows(a, blockIdx.x, kTileM, group, rb, re)) return;
  const int n0 = blockIdx.y * kTileN;
  const WeightDesc& w0 = weight_of(a, group, 0);
  const WeightDesc& w1 = weight_of(a, group, kDual ? 1 : 0);
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  float acc0[4][4], acc1[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc0[i][j] = acc1[i][j] = 0.0f;

  for (int k0 = 0; k0 < a.K; k0 += kTileK) {
#pragma unroll
    for (int i = 0; i < (kTileM * kTileK) / 256; ++i) {
      const int e = tid + 256 * i, m = e / kTileK, kk = e % kTileK;
      const int row = rb + m, k = k0 + kk;
      float xv = 0.0f;
      if (row < re && k < a.K) xv = a.x[int64_t(a.row_index ? a.row_index[row] : row) * a.ldx + k];
      xs[kk][m] = xv;
    }
#pragma unroll
    for (int i = 0; i < (kTileN * kTileK) / 256; ++i) {
      const int e = tid + 256 * i, nn = e / kTileK, kk = e % kTileK;
      const int n = n0 + nn, k = k0 + kk;
      const bool ok = n < a.N && k < a.K;
      ws0[kk][nn] = ok ? weight_at(w0, n, k) : 0.0f;
      if constexpr (kDual) ws1[kk][nn] = ok ? weight_at(w1, n, k) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
      float xv[4], wa[4], wb[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) xv[i] = xs[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        wa[j] = ws0[kk][tx + 16 * j];
        if constexpr (kDual) wb[j] = ws1[kk][tx + 16 * j];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc0[i][j] += xv[i] * wa[j];
          if constexpr (kDual) acc1[i][j] += xv[i] * wb[j];
        }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = rb + ty + 16 * i;
    if (row >= re) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx + 16 * j;
      if (n >= a.N) continue;
      float y;
      if constexpr (kDual) y = silu(acc0[i][j] + bias_of(w0, n)) * (acc1[i][j] + bias_of(w1, n));
      else y = acc0[i][j] + bias_of(w0, n);
      a.out[int64_t(row) * a.ldo + n] = y;
    }
  }
}

bool vec_ok(const WeightDesc& w, const float* x, int64_t ldx) {
  return w.k % 8 == 0 && ldx % 4 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

// Launches gemv (small tiles) or gemm over `max_tiles` row tiles (an upper bound when grouped).
// Which gemv2 instantiation serves these weights (-1: none; the generic gemv then runs). kind_code: 0 bf16, 1 nvfp4.
template <G2Kind kKind, bool kDual, int kRows>
void launch_gemv2_rows(const GemmArgs& b, bool two, dim3 grid, Stream stream) {
  if (two) launch_kernel(gemv2_kernel<kKind, kDual, 2, kRows>, grid, 128, 0, stream, b);
  else launch_kernel(gemv2_kernel<kKind, kDual, 1, kRows>, grid, 128, 0, stream, b);
}

template <G2Kind kKind, bool kDual>
void launch_gemv2_kind(const GemmArgs& b, int rows, bool two, dim3 grid, Stream stream) {
  if (rows <= 1) launch_gemv2_rows<kKind, kDual, 1>(b, two, grid, stream);
  else if (rows <= 2) launch_gemv2_rows<kKind, kDual, 2>(b, two, grid, stream);
  else if (rows <= 4) launch_gemv2_rows<kKind, kDual, 4>(b, two, grid, stream);
  else launch_gemv2_rows<kKind, kDual, 8>(b, two, grid, stream);
}

// kind_code: 0 bf16, 1 nvfp4. max_rows: the most rows any tile holds (<= 8; sizes the row registers).
template <bool kDual>
void launch_gemv2(const GemmArgs& a, int kind_code, int64_t max_tiles, int max_rows, Stream stream) {
  // Two columns per warp when that still gives every SM two blocks; else one.
  const bool two = (a.N + 7) / 8 * max_tiles >= kTwoBlocksPerSm;
  const int cols_per_pass = two ? 8 : 4;
  const int64_t col_blocks = (a.N + cols_per_pass - 1) / cols_per_pass;
  // Many row tiles (grouped experts at larger batches): each block walks several column groups, so that blocks
  // are few enough to amortise their setup (tile lookup, descriptors, x rows) while ~8 per SM stay resident.
  int passes = 1;
  while (a.tile_group && passes < 64 && max_tiles * ((col_blocks + 2 * passes - 1) / (2 * passes)) >= kSms * 8)
    passes *= 2;
  GemmArgs b = a;
  b.col_passes = passes;
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((col_blocks + passes - 1) / passes));
  if (kind_code == 0) launch_gemv2_kind<G2Kind::bf16, kDual>(b, max_rows, two, grid, stream);
  else launch_gemv2_kind<G2Kind::nvfp4, kDual>(b, max_rows, two, grid, stream);
}

void launch_rows(const GemmArgs& a, bool dual, bool use_gemv, bool vec, int64_t max_tiles, Stream stream,
                 int gemv2_kind = -1, int max_rows = kGemvRows) {
  if (max_tiles <= 0 || a.N <= 0) return;
  if (max_tiles > 0x7fffffff) cuda_fail("linear: {} row tiles is too many", {max_tiles});
  if (use_gemv && vec && gemv2_kind >= 0) {
    if (dual) launch_gemv2<true>(a, gemv2_kind, max_tiles, max_rows, stream);
    else launch_gemv2<false>(a, gemv2_kind, max_tiles, max_rows, stream);
  } else if (use_gemv) {
    const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((a.N + kGemvWarps - 1) / kGemvWarps));
    if (dual) {
      if (vec) launch_kernel(gemv_kernel<true, true>, grid, kGemvWarps * 32, 0, stream, a);
      else launch_kernel(gemv_kernel<true, false>, grid, kGemvWarps * 32, 0, stream, a);
    } else {
      if (vec) launch_kernel(gemv_kernel<false, true>, grid, kGemvWarps * 32, 0, stream, a);
      else launch_kernel(gemv_kernel<false, false>, grid, kGemvWarps * 32, 0, stream, a);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((a.N + kTileN - 1) / kTileN));
    if (dual) launch_kernel(gemm_kernel<true>, grid, 256, 0, stream, a);
    else launch_kernel(gemm_kernel<false>, grid, 256, 0, stream, a);
  }
  KILN_CUDA_CHECK_LAUNCH();
}

constexpr int64_t kMultiMaxRows = 64;  // linear_multi: at most this many rows

// ---- MoE routing: a block per token

constexpr int kRouteThreads = 128;

__global__ void moe_route_kernel(const float* __restrict__ logits, int E, int top_k, bool renormalise,
                                 int32_t* __restrict__ ids, float* __restrict__ weights) {
  dev::pdl_enter();
  extern __shared__ float p[];  // [E]
  __shared__ float red[32];
  __shared__ float best_val[32];
  __shared__ int best_idx[32];
  __shared__ float chosen_val[64];
  __shared__ int chosen_idx[64];
  const int t = blockIdx.x, tid = threadIdx.x;
  const float* l = logits + int64_t(t) * E;
  float m = -INFINITY;
  for (int e = tid; e < E; e += blockDim.x) m = fmaxf(m, l[e]);
  m = block_max(m, red);
  float sum = 0.0f;
  for (int e = tid; e < E; e += blockDim.x) {
    const float x = expf(l[e] - m);
    p[e] = x;
    sum += x;
  }
  sum = block_sum(sum, red);
  for (int e = tid; e < E; e += blockDim.x) p[e] = p[e] / sum;
  __syncthreads();
  for (int j = 0; j < top_k; ++j) {
    // argmax over p (ties: lower id), chosen entries are -inf
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = tid; e < E; e += blockDim.x)
      if (p[e] > bv || (p[e] == bv && e < bi)) {
        bv = p[e];
        bi = e;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if ((tid & 31) == 0) {
      best_val[tid >> 5] = bv;
      best_idx[tid >> 5] = bi;
    }
    __syncthreads();
    if (tid == 0) {
      float v = best_val[0];
      int i = best_idx[0];
      for (int w = 1; w < int(blockDim.x >> 5); ++w)
        if (best_val[w] > v || (best_val[w] == v && best_idx[w] < i)) {
          v = best_val[w];
          i = best_idx[w];
        }
      if (i < 0 || i >= E) i = 0;  // only when every p is NaN
      chosen_val[j] = p[i];
      chosen_idx[j] = i;
      p[i] = -INFINITY;
    }
    __syncthreads();
  }
  if (tid == 0) {
    float top_sum = 0.0f;
    for (int j = 0; j < top_k; ++j) top_sum += chosen_val[j];
    for (int j = 0; j < top_k; ++j) {
      ids[int64_t(t) * top_k + j] = chosen_idx[j];
      weights[int64_t(t) * top_k + j] = renormalise ? chosen_val[j] / top_sum : chosen_val[j];
    }
  }
}

// Up to 1024 experts: a warp per token, lane l holding experts l, l + 32, ... in registers; the top-k picks are
// warp argmax reductions (ties: lower id), no block barriers.
// kPer = experts per lane (E <= 32 kPer): a template so that p[] stays in registers (every index is static).
constexpr int kRouteWarpMaxE = 1024;
template <int kPer>
__global__ void moe_route_warp_kernel(const float* __restrict__ logits, int64_t T, int E, int top_k,
                                      bool renormalise, int32_t* __restrict__ ids, float* __restrict__ weights) {
  dev::pdl_enter();
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (t >= T) return;
  const float* l = logits + t * E;
  float p[kPer];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? l[e] : -INFINITY;
    m = fmaxf(m, p[i]);
  }
  m = warp_max(m);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? expf(p[i] - m) : 0.0f;
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPer; ++i) p[i] = lane + 32 * i < E ? p[i] / sum : -INFINITY;
  float chosen_sum = 0.0f, my_val = 0.0f;
  int my_idx = 0;
  for (int j = 0; j < top_k; ++j) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + 32 * i;
      if (p[i] > bv || (p[i] == bv && e < bi && e < E)) {
        bv = p[i];
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    if (bi < 0 || bi >= E) bi = 0;  // only when every p is NaN
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i == bi) p[i] = -INFINITY;
    const float v = __shfl_sync(0xffffffffu, bv, 0);
    chosen_sum += v;
    if (lane == j) {
      my_val = v;
      my_idx = bi;
    }
  }
  if (lane < top_k) {
    ids[t * top_k + lane] = my_idx;
    weights[t * top_k + lane] = renormalise ? my_val / chosen_sum : my_val;
  }
}

// ---- MoE grouping: one block. Pairs p = t * k + j are grouped by expert; sorted row of pair p = pair_pos[p].

struct MoeLayout {
  int32_t* group_offset;  // [E + 1]
  int32_t* tile_offset;   // [E + 1]
  int32_t* tile_group;    // [max tiles] expert of each row tile
  int4* tile_info;        // [max tiles] {expert, first sorted row, end row, 0}; expert -1 past the last tile (or null)
  int max_tiles;          // entries of tile_info
  int32_t* row_token;     // [P]  token of each sorted row
  int32_t* pair_pos;      // [P]  sorted row of each pair (-1: invalid expert id)
};

// One block (a multiple of 32 threads, at most 1024): counts each expert's pairs in shared memory, scans rows and
// row tiles over the experts (thread i owns the contiguous chunk of ceil(E / blockDim) experts from i * chunk: local
// sums, a two-level warp-shuffle block scan, then the chunk's offsets and tiles), then places every pair through a
// shared-memory cursor per expert (the order of rows within an expert follows the atomics).
__global__ void __launch_bounds__(1024) moe_group_kernel(const int32_t* __restrict__ ids, int P, int top_k, int E,
                                                         int tile_rows_m, MoeLayout lay) {
  dev::pdl_enter();
  extern __shared__ int32_t cursor[];  // [E] pairs of each expert, then its next free sorted row
  __shared__ int warp_rows[32], warp_tiles[32];
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
  // The expert of this thread's first pair, loaded before the counters are cleared (its latency overlaps that).
  const int first_e = tid < P ? ids[tid] : -1;
  for (int e = tid; e < E; e += nt) cursor[e] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += nt) {
    const int e = p == tid ? first_e : ids[p];
    if (e >= 0 && e < E) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();
  const int chunk = (E + nt - 1) / nt, e_begin = min(E, tid * chunk), e_end = min(E, e_begin + chunk);
  int rows = 0, tiles = 0;
  for (int e = e_begin; e < e_end; ++e) {
    const int c = cursor[e];
    rows += c;
    tiles += (c + tile_rows_m - 1) / tile_rows_m;
  }
  // Inclusive scans within the warp, then over the warp totals (every warp redoes that second level itself).
  const int rows_incl = warp_inclusive_scan(rows), tiles_incl = warp_inclusive_scan(tiles);
  if (lane == 31) {
    warp_rows[warp] = rows_incl;
    warp_tiles[warp] = tiles_incl;
  }
  __syncthreads();
  const int wrows = warp_inclusive_scan(lane < nwarps ? warp_rows[lane] : 0);
  const int wtiles = warp_inclusive_scan(lane < nwarps ? warp_tiles[lane] : 0);
  const int total_rows = __shfl_sync(0xffffffffu, wrows, 31), total_tiles = __shfl_sync(0xffffffffu, wtiles, 31);
  const int prev_rows = __shfl_sync(0xffffffffu, wrows, (warp + 31) & 31);
  const int prev_tiles = __shfl_sync(0xffffffffu, wtiles, (warp + 31) & 31);
  int row = (warp > 0 ? prev_rows : 0) + rows_incl - rows;  // first sorted row of the chunk
  int tile = (warp > 0 ? prev_tiles : 0) + tiles_incl - tiles;
  for (int e = e_begin; e < e_end; ++e) {
    const int c = cursor[e], tl = (c + tile_rows_m - 1) / tile_rows_m;
    lay.group_offset[e] = row;
    lay.tile_offset[e] = tile;
    cursor[e] = row;  // only this thread touches its chunk's entries until the barrier below
    for (int i = 0; i < tl; ++i) lay.tile_group[tile + i] = e;
    if (lay.tile_info)
      for (int i = 0; i < tl; ++i) {
        const int rb = row + i * tile_rows_m;
        lay.tile_info[tile + i] = make_int4(e, rb, min(row + c, rb + tile_rows_m), 0);
      }
    row += c;
    tile += tl;
  }
  if (tid == 0) {
    lay.group_offset[E] = total_rows;
    lay.tile_offset[E] = total_tiles;
  }
  if (lay.tile_info)
    for (int i = total_tiles + tid; i < lay.max_tiles; i += nt) lay.tile_info[i] = make_int4(-1, 0, 0, 0);
  __syncthreads();
  for (int p = tid; p < P; p += nt) {
    const int e = p == tid ? first_e : ids[p];
    if (e >= 0 && e < E) {
      const int pos = atomicAdd(&cursor[e], 1);
      lay.row_token[pos] = p / top_k;
      lay.pair_pos[p] = pos;
    } else {
      lay.pair_pos[p] = -1;
    }
  }
}

constexpr int kCombineThreads = 128;
constexpr int kCombineCols = 4 * kCombineThreads;  // columns per block, 4 per thread
constexpr int kCombineBatch = 8;                   // slots whose y loads are in flight together

// out[t, h] = sum over the token's slots in ascending (expert id, slot) order of w * y[pair_pos] (pair_pos < 0:
// skipped). Grid (T, ceil(H / 512)): every block of a token sorts the token's valid slots (top_k <= 64) in shared
// memory, then each of its 128 threads covers 4 of the block's 512 columns (kVec: 4 consecutive, one float4; else 4
// columns 128 apart), loading y for 8 slots at a time and summing them in order.
// shared / shared_gate (optional): out += shared[t] * sigmoid(shared_gate[t]) after the experts' sum (written as the
// product, then the add; nvcc contracts the two into one fma, as it did in the block-per-token kernel).
template <bool kVec>
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const float* __restrict__ y, const int32_t* __restrict__ ids, const float* __restrict__ weights,
                       const int32_t* __restrict__ pair_pos, int top_k, int H, float* __restrict__ out,
                       const float* __restrict__ shared, const float* __restrict__ shared_gate) {
  dev::pdl_enter();
  __shared__ int skey[64];       // expert id of each slot; 0x7fffffff for skipped slots (they sort last)
  __shared__ int64_t srow[64];   // y offset pos * H of the n-th valid slot in ascending (id, slot) order
  __shared__ float sw[64];       // its weight
  const int t = blockIdx.x, tid = threadIdx.x;
  int id = 0, pos = -1;
  float w = 0.0f;
  if (tid < top_k) {
    const int64_t s = int64_t(t) * top_k + tid;
    id = ids[s];
    pos = pair_pos[s];
    w = weights[s];
    skey[tid] = pos >= 0 ? id : 0x7fffffff;
  }
  const int valid = __syncthreads_count(pos >= 0);
  if (pos >= 0) {
    // rank of slot tid among the valid slots in ascending (id, slot) order
    int rank = 0;
    for (int i = 0; i < top_k; ++i) rank += skey[i] < id || (skey[i] == id && i < tid);
    srow[rank] = int64_t(pos) * H;
    sw[rank] = w;
  }
  __syncthreads();
  constexpr int kStep = kVec ? 1 : kCombineThreads;  // between this thread's columns
  const int h = blockIdx.y * kCombineCols + (kVec ? 4 * tid : tid);
  if (h >= H) return;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int n0 = 0; n0 < valid; n0 += kCombineBatch) {
    float v[kCombineBatch][4];
#pragma unroll
    for (int u = 0; u < kCombineBatch; ++u) {
      if (n0 + u < valid) {
        const float* src = y + srow[n0 + u] + h;
        if constexpr (kVec) {
          const float4 q = *reinterpret_cast<const float4*>(src);
          v[u][0] = q.x;
          v[u][1] = q.y;
          v[u][2] = q.z;
          v[u][3] = q.w;
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) v[u][i] = h + i * kStep < H ? src[i * kStep] : 0.0f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineBatch; ++u) {
      if (n0 + u < valid) {
        const float wn = sw[n0 + u];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += v[u][i] * wn;
      }
    }
  }
  const int64_t o = int64_t(t) * H + h;
  if (shared) {
    const float gate = sigmoid(shared_gate[t]);
    float s[4];
    if constexpr (kVec) {
      const float4 q = *reinterpret_cast<const float4*>(shared + o);
      s[0] = q.x;
      s[1] = q.y;
      s[2] = q.z;
      s[3] = q.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[i] = h + i * kStep < H ? shared[o + i * kStep] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float sh = s[i] * gate;
      acc[i] = acc[i] + sh;
    }
  }
  if constexpr (kVec) {
    *reinterpret_cast<float4*>(out + o) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (h + i * kStep < H) out[o + i * kStep] = acc[i];
  }
}

// The combine over T tokens: float4 columns when H % 4 == 0 and y, out and shared are 16-byte aligned.
void launch_combine(const float* y, const int32_t* ids, const float* weights, const int32_t* pair_pos, int top_k,
                    int64_t T, int64_t H, float* out, const float* shared, const float* shared_gate, Stream stream) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };  // null counts as aligned
  const bool vec = H % 4 == 0 && aligned(y) && aligned(out) && aligned(shared);
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>((H + kCombineCols - 1) / kCombineCols));
  const int h = static_cast<int>(H);
  if (vec) launch_kernel(moe_combine_kernel<true>, grid, kCombineThreads, 0, stream, y, ids, weights, pair_pos, top_k, h,
                         out, shared, shared_gate);
  else launch_kernel(moe_combine_kernel<false>, grid, kCombineThreads, 0, stream, y, ids, weights, pair_pos, top_k, h,
                     out, shared, shared_gate);
  KILN_CUDA_CHECK_LAUNCH();
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

const char* linear_path_name(int64_t T) {
  return T <= kGemvMaxRows ? "bandwidth gemv (16-byte weight streams, 8-row tiles; bf16 / nvfp4, generic for others)"
                           : "fp32 gemm (64x64 smem tiles)";
}

void linear(const WeightDesc& w, const float* x, int64_t ldx, int64_t T, float* out, int64_t ldo, Stream stream) {
  if (T == 0 || w.n == 0) return;
  GemmArgs a;
  a.w0 = w;
  a.w1 = w;
  a.rows = static_cast<int>(T);
  a.x = x;
  a.ldx = ldx;
  a.out = out;
  a.ldo = ldo;
  a.N = w.n;
  a.K = w.k;
  // Few output columns (gates, routers) stay on the gemv at any T: the gemm's 64-column tiles would leave most of the
  // GPU idle (a 512 x 1 product ran on 8 blocks).
  const bool gemv = T <= kGemvMaxRows || w.n <= 64;
  const int tm = gemv ? kGemvRows : kTileM;
  launch_rows(a, false, gemv, vec_ok(w, x, ldx), (T + tm - 1) / tm, stream, gemv2_kind_host(w),
              static_cast<int>(T < kGemvRows ? T : kGemvRows));
}

bool linear_multi(const WeightDesc* ws, int count, const float* x, int64_t ldx, int64_t T, float* const* outs,
                  const int64_t* ldos, Stream stream) {
  if (count < 1 || count > GemmArgs::kMaxSegments || T < 1 || T > kMultiMaxRows) return false;
  const int kind = gemv2_kind_host(ws[0]);
  if (kind < 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 || ldx % 4 != 0) return false;
  for (int i = 0; i < count; ++i)
    if (gemv2_kind_host(ws[i]) != kind || ws[i].k != ws[0].k || ws[i].n < 1) return false;
  GemmArgs a;
  a.rows = static_cast<int>(T);
  a.x = x;
  a.ldx = ldx;
  a.K = ws[0].k;
  a.num_segments = count;
  // One column layout for all segments: two columns per warp when the total still fills the GPU.
  int64_t total_n = 0;
  for (int i = 0; i < count; ++i) total_n += ws[i].n;
  const bool two = (total_n + 7) / 8 >= kTwoBlocksPerSm;
  const int cols_per_block = two ? 8 : 4;
  int blocks = 0;
  for (int i = 0; i < count; ++i) {
    a.seg_block_begin[i] = blocks;
    a.seg_w[i] = ws[i];
    a.seg_out[i] = outs[i];
    a.seg_ldo[i] = ldos[i];
    blocks += (ws[i].n + cols_per_block - 1) / cols_per_block;
  }
  a.seg_block_begin[count] = blocks;
  a.N = ws[0].n;
  // Row tiles of 8 (the weights of the later tiles come from L2).
  const dim3 grid(static_cast<unsigned>((T + kGemvRows - 1) / kGemvRows), static_cast<unsigned>(blocks));
  const int rows = static_cast<int>(T < kGemvRows ? T : kGemvRows);
  if (kind == 0) launch_gemv2_kind<G2Kind::bf16, false>(a, rows, two, grid, stream);
  else launch_gemv2_kind<G2Kind::nvfp4, false>(a, rows, two, grid, stream);
  KILN_CUDA_CHECK_LAUNCH();
  return true;
}

void moe_route(const float* logits, int64_t T, int64_t E, int top_k, bool renormalise, int32_t* ids, float* weights,
               Stream stream) {
  if (T == 0) return;
  if (top_k < 1 || top_k > 64 || top_k > E) cuda_fail("moe_route: top_k {} of {} experts (1 to 64)", {top_k, E});
  const size_t smem = static_cast<size_t>(E) * sizeof(float);
  if (smem > 48 * 1024) cuda_fail("moe_route: {} experts is too many (at most 12288)", {E});
  if (E <= kRouteWarpMaxE && top_k <= 32) {
    const unsigned grid = static_cast<unsigned>((T + 3) / 4);
    const int e = static_cast<int>(E);
    if (E <= 64) launch_kernel(moe_route_warp_kernel<2>, grid, 128, 0, stream, logits, T, e, top_k, renormalise, ids, weights);
    else if (E <= 128) launch_kernel(moe_route_warp_kernel<4>, grid, 128, 0, stream, logits, T, e, top_k, renormalise, ids, weights);
    else if (E <= 256) launch_kernel(moe_route_warp_kernel<8>, grid, 128, 0, stream, logits, T, e, top_k, renormalise, ids, weights);
    else if (E <= 512) launch_kernel(moe_route_warp_kernel<16>, grid, 128, 0, stream, logits, T, e, top_k, renormalise, ids, weights);
    else launch_kernel(moe_route_warp_kernel<32>, grid, 128, 0, stream, logits, T, e, top_k, renormalise, ids, weights);
  } else {
    launch_kernel(moe_route_kernel, static_cast<unsigned>(T), kRouteThreads, smem, stream, logits, static_cast<int>(E), top_k,
                                                                                renormalise, ids, weights);
  }
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {
struct MoeCarve {
  MoeLayout lay;
  float* act;  // [P, I]
  float* y;    // [P, H]
  uint16_t* xs;     // [T, H] split in up to 3 bf16 parts (tensor-core path)
  uint16_t* act_s;  // [P, I] split in up to 3 bf16 parts (tensor-core path)
  size_t bytes;
};
MoeCarve moe_carve(void* base, int64_t T, int top_k, int64_t E, int64_t H, int64_t I) {
  const int64_t P = T * top_k;
  MoeCarve c{};
  size_t off = 0;
  char* b = static_cast<char*>(base);
  auto take = [&](size_t bytes) {
    void* p = b ? b + off : nullptr;
    off += align256(bytes);
    return p;
  };
  c.lay.group_offset = static_cast<int32_t*>(take((E + 1) * 4));
  c.lay.tile_offset = static_cast<int32_t*>(take((E + 1) * 4));
  c.lay.tile_group = static_cast<int32_t*>(take((P + E) * 4));  // tiles <= P / tm + E
  c.lay.tile_info = static_cast<int4*>(take((P + E) * 16));
  c.lay.max_tiles = 0;  // set per launch
  c.lay.row_token = static_cast<int32_t*>(take(P * 4));
  c.lay.pair_pos = static_cast<int32_t*>(take(P * 4));
  c.act = static_cast<float*>(take(P * I * 4));
  c.y = static_cast<float*>(take(P * H * 4));
  c.xs = static_cast<uint16_t*>(take(T * H * 3 * 2));
  c.act_s = static_cast<uint16_t*>(take(P * I * 3 * 2));
  c.bytes = off;
  return c;
}
}  // namespace

size_t moe_workspace_bytes(int64_t T, int top_k, int64_t E, int64_t H, int64_t I) {
  return moe_carve(nullptr, T, top_k, E, H, I).bytes;
}

void moe_experts(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* weights, int top_k,
                 const WeightDesc* experts, bool experts_vec_ok, int experts_gemv2_kind, int64_t E, int64_t I,
                 void* workspace, float* out, Stream stream, const MoeTuning& tuning, const float* shared,
                 const float* shared_gate) {
  if (T == 0) return;
  if (top_k < 1 || top_k > 64) cuda_fail("moe_experts: top_k {} is not supported (1 to 64)", {top_k});
  if (E * 4 > 48 * 1024) cuda_fail("moe_experts: {} experts is too many (at most 12288)", {E});
  const int64_t P = T * top_k;
  MoeCarve c = moe_carve(workspace, T, top_k, E, H, I);
  // Small groups (decode, small batches: a few rows per expert) take the gemv path. With the bandwidth gemv the
  // tile height follows the expected rows per expert (pairs / experts, rounded up to 1, 2, 4 or 8): rows
  // are registers, and fewer of them keep more warps resident.
  const bool gemv = P <= kGemvMaxRows * E;
  int tm = gemv ? kGemvRows : kTileM;
  const bool x_vec = H % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const bool mma = (tuning.mma_parts == 2 || tuning.mma_parts == 3) && experts_vec_ok &&
                   moe_mma_supported(H, I, experts_gemv2_kind);
  if (mma) {
    // Tensor cores: 8 rows per MMA tile; a row tile of up to 64 rows walks them with its weights in L2 (taller
    // minimum tiles for prefill measured slower: 512-token prefill 7,830-7,870 tok/s with 32 or 64, 8,180 with 16).
    tm = 8;
    while (tm < 64 && int64_t(tm) * E < P) tm *= 2;
  } else if (gemv && experts_gemv2_kind >= 0 && experts_vec_ok && x_vec) {
    tm = 1;
    while (tm < kGemvRows && int64_t(tm) * E < P) tm *= 2;
  }
  const int64_t max_tiles = (P + tm - 1) / tm + (E < P ? E : P);
  MoeLayout lay = c.lay;
  if (mma) lay.max_tiles = static_cast<int>(max_tiles);
  else lay.tile_info = nullptr;
  // One block: 256 threads for decode-sized work (at most 4 experts and 16 pairs per thread), else 1024.
  const int group_threads = E <= 1024 && P <= 4096 ? 256 : 1024;
  launch_kernel(moe_group_kernel, 1, group_threads, static_cast<size_t>(E) * 4, stream, ids, static_cast<int>(P), top_k,
                static_cast<int>(E), tm, lay);
  KILN_CUDA_CHECK_LAUNCH();
  profile_mark("group");
  if (mma) {
    MoeMmaPlan plan;
    plan.parts = tuning.mma_parts;
    plan.tile_m = tm;
    // Row tiles per block: as wide as keeps >= 2 blocks per SM (132 SMs) over the tiles that have rows (about
    // min(P, E) of them): wide blocks pay the tile and descriptor lookups once, narrow ones fill the GPU at batch 1.
    const int64_t live_tiles = std::min<int64_t>(P, E);
    // (Measured on the H200: up to 4 for gate/up, 8 for down, which has a quarter of the k-steps.)
    auto widest = [&](int64_t n, int most) {
      int mt = most;
      while (mt > 1 && live_tiles * (n / (16 * mt)) < kTwoBlocksPerSm) mt /= 2;
      return mt;
    };
    plan.mt_up = tuning.mt_up > 0 ? tuning.mt_up : widest(I, 4);
    plan.mt_down = tuning.mt_down > 0 ? tuning.mt_down : widest(H, 8);
    plan.sub = tuning.sub;
    // Blocks per SM (H200, 35B-A3B shape, KILN_MOE_OCC): gate/up at 3 (80 registers, small spills) is faster once
    // its grid outgrows 2 blocks per SM (batch 16 10.67 -> 10.55 ms, batch 64 19.89 -> 19.57) but slower below
    // (batch 1 3.50 -> 3.60 ms, mt 1); down at 4 (64 registers) is faster at every batch (batch 1 3.54 -> 3.50 ms).
    const int64_t up_blocks = live_tiles * (I / (16 * plan.mt_up));
    plan.occ_up = tuning.occ_up >= 0 ? tuning.occ_up : up_blocks > kTwoBlocksPerSm ? 3 : 0;
    plan.occ_down = tuning.occ_down >= 0 ? tuning.occ_down : 4;
    plan.max_tiles = max_tiles;
    plan.tile_info = c.lay.tile_info;
    plan.row_token = c.lay.row_token;
    plan.xs = c.xs;
    plan.act_s = c.act_s;
    plan.y = c.y;
    moe_experts_mma(x, T, H, I, experts, E, plan, stream);
    launch_combine(c.y, ids, weights, c.lay.pair_pos, top_k, T, H, out, shared, shared_gate, stream);
    profile_mark("combine");
    return;
  }

  // act = silu(x W_gate^T) * (x W_up^T), rows in expert order
  GemmArgs up;
  up.table = experts;
  up.table_stride = 3;
  up.group_offset = c.lay.group_offset;
  up.tile_offset = c.lay.tile_offset;
  up.tile_group = c.lay.tile_group;
  up.num_groups = static_cast<int>(E);
  up.row_index = c.lay.row_token;
  up.x = x;
  up.ldx = H;
  up.out = c.act;
  up.ldo = I;
  up.N = static_cast<int>(I);
  up.K = static_cast<int>(H);
  // A tile holds at most tm of one expert's rows (and at most one per token).
  const int max_rows = static_cast<int>(T < tm ? T : tm);
  up.tile_m = tm;
  launch_rows(up, true, gemv, experts_vec_ok && x_vec, max_tiles, stream, experts_gemv2_kind, max_rows);

  // y = act W_down^T (table entry 2 of each expert)
  GemmArgs down = up;
  down.table = experts + 2;
  down.row_index = nullptr;
  down.x = c.act;
  down.ldx = I;
  down.out = c.y;
  down.ldo = H;
  down.N = static_cast<int>(H);
  down.K = static_cast<int>(I);
  launch_rows(down, false, gemv, experts_vec_ok && I % 8 == 0, max_tiles, stream, experts_gemv2_kind, max_rows);

  launch_combine(c.y, ids, weights, c.lay.pair_pos, top_k, T, H, out, shared, shared_gate, stream);
}

}  // namespace kiln::cuda::ops
