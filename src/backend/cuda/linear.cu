// CudaOps linear layers and routed experts, fp32 activations and accumulation, weights decoded as stored
// (dense BF16 / F16 / F32, per-tensor FP8, NVFP4) inside the kernel: no dequantised copy.
//
// Three kernels share one row-tile scheme, so a dense layer and a layer's experts run through the same code:
//  - gemv_stream_kernel (the bandwidth gemv; bf16 and nvfp4 weights, the format code kernels.h's gemv2_kind_host
//    gives): a tile of up to 8 rows; a warp per 1 or 2 output columns streams 16 bytes of each column's weights per
//    lane and step (decode and small batches: reading the weights once per tile is what bounds these shapes);
//  - gemv_any_weight_kernel: the same tiles for the weights gemv_stream_kernel does not take (fp8, f32, f16,
//    unaligned), a warp per output column, 8 weights per lane per step decoded by weight_at8 (or one by weight_at);
//  - gemm_kernel: 64 x 64 tiles in shared memory, 16 outputs per thread (prefill).
// Rows are grouped: group g (an expert) owns sorted rows [group_offset[g], group_offset[g+1]) and row tiles
// [tile_offset[g], tile_offset[g+1]); a dense layer is one group. Row r of a group reads input row row_index[r].
// Each output row is computed on its own (no cross-row arithmetic), so the result does not depend on how the
// rows were grouped or tiled.
//
// Also here: the routed experts' two GEMMs on these kernels (moe_experts_fp32, over moe_routing.cu's grouping) and
// the split / sum kernels around the cuBLASLt GEMMs of dense BF16 linears (split_bf16x3, sum3_rows, which adds the
// bias too; round_bf16 and add_row_bias for --dtype bfloat16, whose GEMM writes the output itself).
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ptx.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;


struct GemmArgs {
  WeightDesc w0, w1;                 // single-group weights (w1: the up projection when dual)
  const WeightDesc* table = nullptr;  // grouped: group g uses table[g * table_stride + {0, 1}]
  int table_stride = 0;
  const int32_t* group_offset = nullptr;  // [G + 1] or null (one group of `rows` rows)
  const int32_t* tile_offset = nullptr;   // [G + 1]
  const int32_t* tile_group = nullptr;    // [tiles] group of each row tile (grouped launches), or null: search
  int num_groups = 1;
  int col_passes = 1;                     // gemv_stream: column groups each warp walks (grid.y shrinks by this)
  int tile_m = 8;                         // gemv_stream: rows per row tile (the grouping's tile height)
  // gemv_stream, several linears of one x in one launch (dense, no groups): segment s owns grid rows (blockIdx.y)
  // [seg_block_begin[s], seg_block_begin[s + 1]) and writes seg_out[s] (row stride seg_ldo[s]).
  static constexpr int kMaxSegments = 4;
  int num_segments = 0;
  int seg_block_begin[kMaxSegments + 1] = {};
  WeightDesc seg_w[kMaxSegments];
  float* seg_out[kMaxSegments] = {};
  int64_t seg_ldo[kMaxSegments] = {};
  // gemv_stream, dense captured PDL launches: before its PDL wait each block of row tile 0 asks L2 for the first
  // prefetch_row_bytes of each of its weight rows (and their NVFP4 block scales with prefetch_scales); 0: none.
  uint32_t prefetch_row_bytes = 0;
  bool prefetch_scales = false;
  int rows = 0;                           // single group: number of rows
  const int32_t* row_index = nullptr;     // [rows]: input row of each sorted row, or null (identity)
  const float* x = nullptr;
  int64_t ldx = 0;
  const float* x2 = nullptr;  // gemv_stream with an input activation (kAct): its second operand, rows ldx2 apart
  int64_t ldx2 = 0;
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

// Output column n from its sums: silu(gate + bias) * (up + bias) for a dual (gate / up) launch, else sum + bias.
template <bool kDual>
__device__ __forceinline__ float linear_output(float s0, float s1, const WeightDesc& w0, const WeightDesc& w1, int n) {
  if constexpr (kDual) return silu(s0 + bias_of(w0, n)) * (s1 + bias_of(w1, n));
  else return s0 + bias_of(w0, n);
}

// The input rows of the tile's rows [rb, rb + nrows): rows past the last one read the last row again (their loads stay
// unconditional, so they are issued together); only real rows are stored.
template <int kRows>
__device__ __forceinline__ void tile_input_rows(const GemmArgs& a, int rb, int nrows, const float* (&xr)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = rb + min(r, nrows - 1);
    xr[r] = a.x + int64_t(a.row_index ? a.row_index[row] : row) * a.ldx;
  }
}

// ---- gemv_any_weight: tile of <= 8 rows, a warp per output column n, any weight format

constexpr int kGemvRows = kGemvTileRows;
constexpr int kGemvWarps = 8;

template <bool kDual, bool kVec>
__global__ void __launch_bounds__(kGemvWarps * 32) gemv_any_weight_kernel(GemmArgs a) {
  dev::pdl_enter();  // first statement: see launch.cuh
  int group, rb, re;
  if (!tile_rows(a, blockIdx.x, kGemvRows, group, rb, re)) return;
  const int n = blockIdx.y * kGemvWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= a.N) return;
  const WeightDesc& w0 = weight_of(a, group, 0);
  const WeightDesc& w1 = weight_of(a, group, kDual ? 1 : 0);
  const int nrows = re - rb;
  const float* xr[kGemvRows];
  tile_input_rows(a, rb, nrows, xr);
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
      if (lane == 0) a.out[int64_t(rb + r) * a.ldo + n] = linear_output<kDual>(s0, s1, w0, w1, n);
    }
  }
}

// ---- gemv_stream: the bandwidth kernel for decode-sized tiles (<= 8 rows), one weight format per instantiation.
// A warp owns kCols output columns; each lane streams 16 bytes of each column's row per step (bf16: 8 weights,
// nvfp4: 32 codes + 2 block scales), two steps in flight, and the tile's rows read x through L1. NVFP4 sums
// x * e2m1 per 16-element block and scales each block sum once (then scale_2 at the end): the same products as
// the CPU backend's, summed in another order (rel ~1e-7).

enum class StreamFormat { bf16, nvfp4 };

template <StreamFormat kKind>
constexpr int kStreamElems = kKind == StreamFormat::bf16 ? 8 : 32;  // weights per 16-byte lane load

// The input activation of a gemv_stream launch, four elements at a time: kAct 0 x as it is, 1 silu(x) * x2, 2 x *
// sigmoid(x2) (silu_mul_kernel's and sigmoid_mul_kernel's arithmetic, so the products equal theirs).
template <int kAct>
__device__ __forceinline__ float4 act_input(const float* x, const float* x2, int k) {
  float4 v = *reinterpret_cast<const float4*>(x + k);
  if constexpr (kAct != 0) {
    const float4 g = *reinterpret_cast<const float4*>(x2 + k);
    if constexpr (kAct == 1) v = make_float4(silu(v.x) * g.x, silu(v.y) * g.y, silu(v.z) * g.z, silu(v.w) * g.w);
    else v = make_float4(v.x * sigmoid(g.x), v.y * sigmoid(g.y), v.z * sigmoid(g.z), v.w * sigmoid(g.w));
  }
  return v;
}

// A dense gemv_stream block's weight rows into L2 (GemmArgs::prefetch_row_bytes): one thread per row. Reads only the
// launch's parameters and asks for weights no kernel writes, so it may run before the PDL wait (launch.cuh).
template <StreamFormat kKind, bool kDual, int kCols>
__device__ __forceinline__ void prefetch_block_weights(const GemmArgs& a) {
  int seg = 0;
  for (int q = 1; q < a.num_segments; ++q)
    if (int(blockIdx.y) >= a.seg_block_begin[q]) seg = q;
  const int by = a.num_segments ? int(blockIdx.y) - a.seg_block_begin[seg] : int(blockIdx.y);
  const WeightDesc& w0 = a.num_segments ? a.seg_w[seg] : a.w0;
  const WeightDesc& w1 = a.num_segments ? a.seg_w[seg] : a.w1;
  const int N = a.num_segments ? w0.n : a.N;
  const int per_block = a.col_passes * 4 * kCols;
  const int n = by * per_block + int(threadIdx.x);
  if (int(threadIdx.x) >= per_block || n >= N) return;
  const int64_t row_bytes = kKind == StreamFormat::bf16 ? int64_t(a.K) * 2 : int64_t(a.K) / 2;
  ptx::prefetch_l2_bulk(static_cast<const char*>(w0.data) + n * row_bytes, a.prefetch_row_bytes);
  if constexpr (kDual) ptx::prefetch_l2_bulk(static_cast<const char*>(w1.data) + n * row_bytes, a.prefetch_row_bytes);
  if constexpr (kKind == StreamFormat::nvfp4) {
    if (a.prefetch_scales) {
      ptx::prefetch_l2_bulk(w0.block_scale + n * int64_t(a.K / 16), static_cast<uint32_t>(a.K / 16));
      if constexpr (kDual) ptx::prefetch_l2_bulk(w1.block_scale + n * int64_t(a.K / 16), static_cast<uint32_t>(a.K / 16));
    }
  }
}

template <StreamFormat kKind, bool kDual, int kCols, int kRows, int kAct = 0>
__global__ void __launch_bounds__(128) gemv_stream_kernel(GemmArgs a) {
  // The one thing before the PDL wait: static weights into L2 (prefetch_block_weights).
  if (a.prefetch_row_bytes > 0 && blockIdx.x == 0) prefetch_block_weights<kKind, kDual, kCols>(a);
  dev::pdl_enter();  // see launch.cuh
  constexpr int kE = kStreamElems<kKind>;
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
  const float* xr[kRows];
  tile_input_rows(a, rb, nrows, xr);
  const float* x2r[kRows];  // kAct: the second operand's rows (x rows' offsets, in x2)
#pragma unroll
  for (int r = 0; r < kRows; ++r) x2r[r] = kAct ? a.x2 + (xr[r] - a.x) / a.ldx * a.ldx2 : nullptr;
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

  const int64_t row_bytes = kKind == StreamFormat::bf16 ? int64_t(a.K) * 2 : int64_t(a.K) / 2;
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
          const int64_t off = kKind == StreamFormat::bf16 ? int64_t(k0) * 2 : int64_t(k0) / 2;
          raw0[u][c] = ptx::ld_stream_16(base0[c] + off);
          if constexpr (kDual) raw1[u][c] = ptx::ld_stream_16(base1[c] + off);
          if constexpr (kKind == StreamFormat::nvfp4) {
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
      if constexpr (kKind == StreamFormat::bf16) {
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
            const float4 xv = act_input<kAct>(xr[r], x2r[r], k0 + 4 * h);
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
              for (int i = 0; i < 8; ++i) wa[c][i] = e2m1_to_f32_branchless(word >> (4 * i));
              if constexpr (kDual) {
                const uint32_t w2 = wi == 0 ? raw1[u][c].x : wi == 1 ? raw1[u][c].y : wi == 2 ? raw1[u][c].z : raw1[u][c].w;
#pragma unroll
                for (int i = 0; i < 8; ++i) wb[c][i] = e2m1_to_f32_branchless(w2 >> (4 * i));
              }
            }
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              const int ko = k0 + 16 * blk + 8 * h;
              const float4 xa = act_input<kAct>(xr[r], x2r[r], ko);
              const float4 xb = act_input<kAct>(xr[r], x2r[r], ko + 4);
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
          if constexpr (kKind == StreamFormat::nvfp4) {
            s0 *= w0.scale;
            if constexpr (kDual) s1 *= w1.scale;
          }
          out[int64_t(rb + r) * ldo + n] = linear_output<kDual>(s0, s1, w0, w1, n);
        }
      }
    }
  }
  }  // pass
}

// ---- gemm: 64 x 64 tiles, BK 16, 256 threads, thread (tx, ty) owns rows ty + 16 i, columns tx + 16 j

constexpr int kTileM = kGemmTileRows, kTileN = 64, kTileK = 16;

template <bool kDual>
__global__ void __launch_bounds__(256) gemm_kernel(GemmArgs a) {
  dev::pdl_enter();  // first statement: see launch.cuh
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
      a.out[int64_t(row) * a.ldo + n] = linear_output<kDual>(acc0[i][j], acc1[i][j], w0, w1, n);
    }
  }
}

bool vec_ok(const WeightDesc& w, const float* x, int64_t ldx) {
  return w.k % 8 == 0 && ldx % 4 == 0 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

template <StreamFormat kKind, bool kDual, int kRows, int kAct = 0>
void launch_gemv_stream_rows(const GemmArgs& b, bool two, dim3 grid, Stream stream) {
  if (two) launch_kernel(gemv_stream_kernel<kKind, kDual, 2, kRows, kAct>, grid, 128, 0, stream, b);
  else launch_kernel(gemv_stream_kernel<kKind, kDual, 1, kRows, kAct>, grid, 128, 0, stream, b);
}

// kAct (an input activation, single weights only): tiles of at most 4 rows.
template <StreamFormat kKind, bool kDual, int kAct = 0>
void launch_gemv_stream_format(const GemmArgs& b, int rows, bool two, dim3 grid, Stream stream) {
  static_assert(kAct == 0 || !kDual, "an input activation applies to single-weight launches");
  if (rows <= 1) launch_gemv_stream_rows<kKind, kDual, 1, kAct>(b, two, grid, stream);
  else if (rows <= 2) launch_gemv_stream_rows<kKind, kDual, 2, kAct>(b, two, grid, stream);
  else if (kAct != 0 || rows <= 4) launch_gemv_stream_rows<kKind, kDual, 4, kAct>(b, two, grid, stream);
  else if constexpr (kAct == 0) launch_gemv_stream_rows<kKind, kDual, 8>(b, two, grid, stream);
}

constexpr int64_t kPrefetchBudget = int64_t(24) << 20;  // bytes one launch may ask L2 to prefetch

// kind_code: 0 bf16, 1 nvfp4. max_rows: the most rows any tile holds (<= 8; sizes the row registers; <= 4 with kAct).
template <bool kDual, int kAct = 0>
void launch_gemv_stream(const GemmArgs& a, int kind_code, int64_t max_tiles, int max_rows, Stream stream) {
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
  // Dense launches that will carry the PDL attribute (captured, few enough blocks): each weight row's first bytes into
  // L2 before the wait, at most kPrefetchBudget per launch in all (L2 is 50 MB on an H100 / H200).
  b.prefetch_row_bytes = 0;
  b.prefetch_scales = false;
  if (weight_prefetch_now() && !a.group_offset && !a.tile_group &&
      uint64_t(grid.x) * grid.y <= kPdlMaxBlocks) {
    int64_t rows = a.num_segments ? 0 : a.N;
    for (int s = 0; s < a.num_segments; ++s) rows += a.seg_w[s].n;
    const int64_t row_bytes = kind_code == 0 ? int64_t(a.K) * 2 : int64_t(a.K) / 2;
    const int64_t share = kPrefetchBudget / std::max<int64_t>(rows * (kDual ? 2 : 1), 1);
    const int64_t bytes = std::min(row_bytes, share) / 16 * 16;
    if (bytes >= 256 && row_bytes % 16 == 0) {
      b.prefetch_row_bytes = static_cast<uint32_t>(bytes);
      // Block scales: K / 16 bytes per row, whole rows only where they stay 16-byte aligned.
      b.prefetch_scales = kind_code == 1 && bytes == row_bytes && a.K % 256 == 0;
    }
  }
  if (kind_code == 0) launch_gemv_stream_format<StreamFormat::bf16, kDual, kAct>(b, max_rows, two, grid, stream);
  else launch_gemv_stream_format<StreamFormat::nvfp4, kDual, kAct>(b, max_rows, two, grid, stream);
}

// Launches a gemv (small tiles) or the gemm over `max_tiles` row tiles (an upper bound when grouped). gemv2_kind:
// the gemv_stream format (gemv2_kind_host: 0 bf16, 1 nvfp4), or -1: gemv_any_weight runs.
void launch_rows(const GemmArgs& a, bool dual, bool use_gemv, bool vec, int64_t max_tiles, Stream stream,
                 int gemv2_kind = -1, int max_rows = kGemvRows) {
  if (max_tiles <= 0 || a.N <= 0) return;
  if (max_tiles > 0x7fffffff) cuda_fail("linear: {} row tiles is too many", {max_tiles});
  if (use_gemv && vec && gemv2_kind >= 0) {
    if (dual) launch_gemv_stream<true>(a, gemv2_kind, max_tiles, max_rows, stream);
    else launch_gemv_stream<false>(a, gemv2_kind, max_tiles, max_rows, stream);
  } else if (use_gemv) {
    const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((a.N + kGemvWarps - 1) / kGemvWarps));
    if (dual) {
      if (vec) launch_kernel(gemv_any_weight_kernel<true, true>, grid, kGemvWarps * 32, 0, stream, a);
      else launch_kernel(gemv_any_weight_kernel<true, false>, grid, kGemvWarps * 32, 0, stream, a);
    } else {
      if (vec) launch_kernel(gemv_any_weight_kernel<false, true>, grid, kGemvWarps * 32, 0, stream, a);
      else launch_kernel(gemv_any_weight_kernel<false, false>, grid, kGemvWarps * 32, 0, stream, a);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((a.N + kTileN - 1) / kTileN));
    if (dual) launch_kernel(gemm_kernel<true>, grid, 256, 0, stream, a);
    else launch_kernel(gemm_kernel<false>, grid, 256, 0, stream, a);
  }
  KILN_CUDA_CHECK_LAUNCH();
}

constexpr int64_t kMultiMaxRows = 64;  // linear_multi: at most this many rows

// x = hi + mid + lo, each bf16 (round to nearest even): the three rows blocks of out [3T, K].
__global__ void split_bf16x3_kernel(const float* __restrict__ x, int64_t ldx, int64_t T, int64_t K,
                                    __nv_bfloat16* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
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

// out [T, K] = x rounded to bf16 (round to nearest even), the input of a one-part GEMM (--dtype bfloat16).
__global__ void round_bf16_kernel(const float* __restrict__ x, int64_t ldx, int64_t T, int64_t K,
                                  __nv_bfloat16* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t n = T * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / K, k = i % K;
    out[i] = __float2bfloat16_rn(x[t * ldx + k]);
  }
}

// out = (lo + mid) + hi of the three partial GEMM outputs, column c of part into the segment whose column range
// holds it (one segment: a plain linear; several: one GEMM over adjacent weights), then + the segment's bias where it
// has one (the order of linear_output: the whole sum, then the bias).
__global__ void sum3_segments_kernel(const float* __restrict__ part, int64_t T, int64_t N, Sum3Segments segs) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t n = T * N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / N, c = i % N;
    int s = 0;
#pragma unroll
    for (int j = 1; j < Sum3Segments::kMax; ++j)
      if (j < segs.count && c >= segs.col0[j]) s = j;
    const int64_t col = c - segs.col0[s];
    float v = (part[2 * n + i] + part[n + i]) + part[i];
    if (segs.bias[s]) v += load_elem(segs.bias[s], segs.bias_elem[s], col);
    segs.out[s][t * segs.ldo[s] + col] = v;
  }
}

// out[t, c] += bias[c]: a thread per column c (its bias read once), walking rows blockIdx.y, + gridDim.y, ...
__global__ void add_row_bias_kernel(float* __restrict__ out, int64_t ldo, int64_t T, int64_t N,
                                    const void* __restrict__ bias, ElemType bias_elem) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= N) return;
  const float b = load_elem(bias, bias_elem, c);
  for (int64_t t = blockIdx.y; t < T; t += gridDim.y) out[t * ldo + c] += b;
}

unsigned fill_grid(int64_t n) {
  const int64_t g = (n + 255) / 256;
  return static_cast<unsigned>(g < 8192 ? (g > 0 ? g : 1) : 8192);
}

}  // namespace

const char* linear_path_name(int64_t T) {
  return T <= kGemvMaxRows ? "bandwidth gemv (16-byte weight streams, 8-row tiles; bf16 / nvfp4, generic for others)"
                           : "fp32 gemm (64x64 smem tiles)";
}

// The arguments of one dense linear: a single group of T rows.
static GemmArgs dense_args(const WeightDesc& w, const float* x, int64_t ldx, int64_t T, float* out, int64_t ldo) {
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
  return a;
}

void linear(const WeightDesc& w, const float* x, int64_t ldx, int64_t T, float* out, int64_t ldo, Stream stream) {
  if (T == 0 || w.n == 0) return;
  const GemmArgs a = dense_args(w, x, ldx, T, out, ldo);
  // Few output columns (gates, routers) stay on the gemv at any T: the gemm's 64-column tiles would leave most of the
  // GPU idle (a 512 x 1 product ran on 8 blocks).
  const bool gemv = T <= kGemvMaxRows || w.n <= 64;
  const int tm = gemv ? kGemvRows : kTileM;
  launch_rows(a, false, gemv, vec_ok(w, x, ldx), (T + tm - 1) / tm, stream, gemv2_kind_host(w),
              static_cast<int>(T < kGemvRows ? T : kGemvRows));
}

bool linear_gated_input(const WeightDesc& w, const float* x, int64_t ldx, const float* x2, int64_t ldx2, int act,
                        int64_t T, float* out, int64_t ldo, Stream stream) {
  const int kind = gemv2_kind_host(w);
  if (T < 1 || T > 4 || w.n < 1 || kind < 0 || (act != 1 && act != 2) || !vec_ok(w, x, ldx) || !vec_ok(w, x2, ldx2))
    return false;
  GemmArgs a = dense_args(w, x, ldx, T, out, ldo);
  a.x2 = x2;
  a.ldx2 = ldx2;
  // One row tile, launched as a dense layer's gemv with the activation on its input.
  if (act == 1) launch_gemv_stream<false, 1>(a, kind, 1, static_cast<int>(T), stream);
  else launch_gemv_stream<false, 2>(a, kind, 1, static_cast<int>(T), stream);
  KILN_CUDA_CHECK_LAUNCH();
  return true;
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
  if (kind == 0) launch_gemv_stream_format<StreamFormat::bf16, false>(a, rows, two, grid, stream);
  else launch_gemv_stream_format<StreamFormat::nvfp4, false>(a, rows, two, grid, stream);
  KILN_CUDA_CHECK_LAUNCH();
  return true;
}

void moe_experts_fp32(const float* x, int64_t T, int64_t H, int64_t I, const WeightDesc* experts, int64_t E,
                      bool experts_vec_ok, bool x_vec, int experts_gemv2_kind, const ExpertGroups& g, float* act,
                      float* y, Stream stream) {
  // act = silu(x W_gate^T) * (x W_up^T), rows in expert order
  GemmArgs up;
  up.table = experts;
  up.table_stride = 3;
  up.group_offset = g.group_offset;
  up.tile_offset = g.tile_offset;
  up.tile_group = g.tile_group;
  up.num_groups = static_cast<int>(E);
  up.row_index = g.row_token;
  up.x = x;
  up.ldx = H;
  up.out = act;
  up.ldo = I;
  up.N = static_cast<int>(I);
  up.K = static_cast<int>(H);
  // A tile holds at most tm of one expert's rows (and at most one per token).
  const int max_rows = static_cast<int>(T < g.tile_m ? T : g.tile_m);
  up.tile_m = g.tile_m;
  launch_rows(up, true, g.gemv, experts_vec_ok && x_vec, g.max_tiles, stream, experts_gemv2_kind, max_rows);

  // y = act W_down^T (table entry 2 of each expert)
  GemmArgs down = up;
  down.table = experts + 2;
  down.row_index = nullptr;
  down.x = act;
  down.ldx = I;
  down.out = y;
  down.ldo = H;
  down.N = static_cast<int>(H);
  down.K = static_cast<int>(I);
  launch_rows(down, false, g.gemv, experts_vec_ok && I % 8 == 0, g.max_tiles, stream, experts_gemv2_kind, max_rows);

}

void split_bf16x3(const float* x, int64_t ldx, int64_t T, int64_t K, uint16_t* out, Stream stream) {
  if (T * K == 0) return;
  launch_kernel(split_bf16x3_kernel, fill_grid(T * K), 256, 0, stream, x, ldx, T, K, reinterpret_cast<__nv_bfloat16*>(out));
  KILN_CUDA_CHECK_LAUNCH();
}

void round_bf16(const float* x, int64_t ldx, int64_t T, int64_t K, uint16_t* out, Stream stream) {
  if (T * K == 0) return;
  launch_kernel(round_bf16_kernel, fill_grid(T * K), 256, 0, stream, x, ldx, T, K, reinterpret_cast<__nv_bfloat16*>(out));
  KILN_CUDA_CHECK_LAUNCH();
}

void sum3_rows_segments(const float* part, int64_t T, int64_t N, const Sum3Segments& segs, Stream stream) {
  if (T * N == 0) return;
  launch_kernel(sum3_segments_kernel, fill_grid(T * N), 256, 0, stream, part, T, N, segs);
  KILN_CUDA_CHECK_LAUNCH();
}

void sum3_rows(const float* part, int64_t T, int64_t N, float* out, int64_t ldo, Stream stream, const void* bias,
               ElemType bias_elem) {
  Sum3Segments one;
  one.out[0] = out;
  one.ldo[0] = ldo;
  one.bias[0] = bias;
  one.bias_elem[0] = bias_elem;
  one.count = 1;
  sum3_rows_segments(part, T, N, one, stream);
}

void add_row_bias(float* out, int64_t ldo, int64_t T, int64_t N, const void* bias, ElemType bias_elem,
                  Stream stream) {
  if (T * N == 0 || !bias) return;
  // ~8K blocks of 256 columns x (T / grid.y) rows each.
  const int64_t col_blocks = (N + 255) / 256;
  if (col_blocks > 0x7fffffff) cuda_fail("add_row_bias: {} columns is too many", {N});
  const int64_t row_blocks = std::min<int64_t>({T, std::max<int64_t>(1, 8192 / col_blocks), 65535});
  launch_kernel(add_row_bias_kernel, dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks)), 256, 0,
                stream, out, ldo, T, N, bias, bias_elem);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
