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
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops_device.cuh"
#include "backend/cuda/cuda_ops_kernels.h"

namespace kiln::cuda::ops {
namespace {

using namespace dev;

struct GemmArgs {
  WeightDesc w0, w1;                 // single-group weights (w1: the up projection when dual)
  const WeightDesc* table = nullptr;  // grouped: group g uses table[g * table_stride + {0, 1}]
  int table_stride = 0;
  const int32_t* group_offset = nullptr;  // [G + 1] or null (one group of `rows` rows)
  const int32_t* tile_offset = nullptr;   // [G + 1]
  int num_groups = 1;
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
  int lo = 0, hi = a.num_groups - 1;  // last g with tile_offset[g] <= tile
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.tile_offset[mid] <= tile) lo = mid;
    else hi = mid - 1;
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

// ---- gemm: 64 x 64 tiles, BK 16, 256 threads, thread (tx, ty) owns rows ty + 16 i, columns tx + 16 j

constexpr int kTileM = 64, kTileN = 64, kTileK = 16;

template <bool kDual>
__global__ void __launch_bounds__(256) gemm_kernel(GemmArgs a) {
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
void launch_rows(const GemmArgs& a, bool dual, bool use_gemv, bool vec, int64_t max_tiles, Stream stream) {
  if (max_tiles <= 0 || a.N <= 0) return;
  if (max_tiles > 0x7fffffff) cuda_fail("linear: {} row tiles is too many", {max_tiles});
  if (use_gemv) {
    const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((a.N + kGemvWarps - 1) / kGemvWarps));
    if (dual) {
      if (vec) gemv_kernel<true, true><<<grid, kGemvWarps * 32, 0, stream>>>(a);
      else gemv_kernel<true, false><<<grid, kGemvWarps * 32, 0, stream>>>(a);
    } else {
      if (vec) gemv_kernel<false, true><<<grid, kGemvWarps * 32, 0, stream>>>(a);
      else gemv_kernel<false, false><<<grid, kGemvWarps * 32, 0, stream>>>(a);
    }
  } else {
    const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((a.N + kTileN - 1) / kTileN));
    if (dual) gemm_kernel<true><<<grid, 256, 0, stream>>>(a);
    else gemm_kernel<false><<<grid, 256, 0, stream>>>(a);
  }
  KILN_CUDA_CHECK_LAUNCH();
}

constexpr int64_t kGemvMaxRows = 16;  // dense layers with at most this many rows take the gemv path

// ---- MoE routing: a block per token

constexpr int kRouteThreads = 128;

__global__ void moe_route_kernel(const float* __restrict__ logits, int E, int top_k, bool renormalise,
                                 int32_t* __restrict__ ids, float* __restrict__ weights) {
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

// ---- MoE grouping: one block. Pairs p = t * k + j are grouped by expert; sorted row of pair p = pair_pos[p].

struct MoeLayout {
  int32_t* group_offset;  // [E + 1]
  int32_t* tile_offset;   // [E + 1]
  int32_t* row_token;     // [P]  token of each sorted row
  int32_t* pair_pos;      // [P]  sorted row of each pair (-1: invalid expert id)
  int32_t* cursor;        // [E]
};

__global__ void moe_group_kernel(const int32_t* __restrict__ ids, int P, int top_k, int E, int tile_rows_m,
                                 MoeLayout lay) {
  extern __shared__ int32_t counts[];  // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < E) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int rows = 0, tiles = 0;
    for (int e = 0; e < E; ++e) {
      lay.group_offset[e] = rows;
      lay.tile_offset[e] = tiles;
      lay.cursor[e] = rows;
      rows += counts[e];
      tiles += (counts[e] + tile_rows_m - 1) / tile_rows_m;
    }
    lay.group_offset[E] = rows;
    lay.tile_offset[E] = tiles;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < E) {
      const int pos = atomicAdd(&lay.cursor[e], 1);
      lay.row_token[pos] = p / top_k;
      lay.pair_pos[p] = pos;
    } else {
      lay.pair_pos[p] = -1;
    }
  }
}

// out[t, h] = sum over the token's slots in ascending (expert id, slot) order of w * y[pair_pos]. A block per token.
__global__ void moe_combine_kernel(const float* __restrict__ y, const int32_t* __restrict__ ids,
                                   const float* __restrict__ weights, const int32_t* __restrict__ pair_pos, int top_k,
                                   int H, float* __restrict__ out) {
  __shared__ int order[64];
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {
    // selection sort of the k slots by (id, slot)
    int prev_id = -1, prev_slot = -1;
    for (int n = 0; n < top_k; ++n) {
      int best = -1;
      for (int j = 0; j < top_k; ++j) {
        const int id = ids[int64_t(t) * top_k + j];
        const bool after_prev = id > prev_id || (id == prev_id && j > prev_slot);
        if (!after_prev) continue;
        if (best < 0) {
          best = j;
          continue;
        }
        const int bid = ids[int64_t(t) * top_k + best];
        if (id < bid || (id == bid && j < best)) best = j;
      }
      order[n] = best;
      prev_id = ids[int64_t(t) * top_k + best];
      prev_slot = best;
    }
  }
  __syncthreads();
  for (int h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.0f;
    for (int n = 0; n < top_k; ++n) {
      const int j = order[n];
      const int pos = pair_pos[int64_t(t) * top_k + j];
      if (pos >= 0) acc += y[int64_t(pos) * H + h] * weights[int64_t(t) * top_k + j];
    }
    out[int64_t(t) * H + h] = acc;
  }
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

const char* linear_path_name(int64_t T) {
  return T <= kGemvMaxRows ? "fp32 gemv (warp per output, 8-row tiles)" : "fp32 gemm (64x64 smem tiles)";
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
  const bool gemv = T <= kGemvMaxRows;
  const int tm = gemv ? kGemvRows : kTileM;
  launch_rows(a, false, gemv, vec_ok(w, x, ldx), (T + tm - 1) / tm, stream);
}

void moe_route(const float* logits, int64_t T, int64_t E, int top_k, bool renormalise, int32_t* ids, float* weights,
               Stream stream) {
  if (T == 0) return;
  if (top_k < 1 || top_k > 64 || top_k > E) cuda_fail("moe_route: top_k {} of {} experts (1 to 64)", {top_k, E});
  const size_t smem = static_cast<size_t>(E) * sizeof(float);
  if (smem > 48 * 1024) cuda_fail("moe_route: {} experts is too many (at most 12288)", {E});
  moe_route_kernel<<<static_cast<unsigned>(T), kRouteThreads, smem, stream>>>(logits, static_cast<int>(E), top_k,
                                                                              renormalise, ids, weights);
  KILN_CUDA_CHECK_LAUNCH();
}

namespace {
struct MoeCarve {
  MoeLayout lay;
  float* act;  // [P, I]
  float* y;    // [P, H]
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
  c.lay.row_token = static_cast<int32_t*>(take(P * 4));
  c.lay.pair_pos = static_cast<int32_t*>(take(P * 4));
  c.lay.cursor = static_cast<int32_t*>(take(E * 4));
  c.act = static_cast<float*>(take(P * I * 4));
  c.y = static_cast<float*>(take(P * H * 4));
  c.bytes = off;
  return c;
}
}  // namespace

size_t moe_workspace_bytes(int64_t T, int top_k, int64_t E, int64_t H, int64_t I) {
  return moe_carve(nullptr, T, top_k, E, H, I).bytes;
}

void moe_experts(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* weights, int top_k,
                 const WeightDesc* experts, bool experts_vec_ok, int64_t E, int64_t I, void* workspace, float* out,
                 Stream stream) {
  if (T == 0) return;
  if (top_k < 1 || top_k > 64) cuda_fail("moe_experts: top_k {} is not supported (1 to 64)", {top_k});
  if (E * 4 > 48 * 1024) cuda_fail("moe_experts: {} experts is too many (at most 12288)", {E});
  const int64_t P = T * top_k;
  MoeCarve c = moe_carve(workspace, T, top_k, E, H, I);
  // Small groups (decode, small batches: a few rows per expert) take the gemv path.
  const bool gemv = P <= kGemvMaxRows * E;
  const int tm = gemv ? kGemvRows : kTileM;
  moe_group_kernel<<<1, 1024, static_cast<size_t>(E) * 4, stream>>>(ids, static_cast<int>(P), top_k,
                                                                    static_cast<int>(E), tm, c.lay);
  KILN_CUDA_CHECK_LAUNCH();
  const int64_t max_tiles = (P + tm - 1) / tm + (E < P ? E : P);

  // act = silu(x W_gate^T) * (x W_up^T), rows in expert order
  GemmArgs up;
  up.table = experts;
  up.table_stride = 3;
  up.group_offset = c.lay.group_offset;
  up.tile_offset = c.lay.tile_offset;
  up.num_groups = static_cast<int>(E);
  up.row_index = c.lay.row_token;
  up.x = x;
  up.ldx = H;
  up.out = c.act;
  up.ldo = I;
  up.N = static_cast<int>(I);
  up.K = static_cast<int>(H);
  const bool x_vec = H % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  launch_rows(up, true, gemv, experts_vec_ok && x_vec, max_tiles, stream);

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
  launch_rows(down, false, gemv, experts_vec_ok && I % 8 == 0, max_tiles, stream);

  moe_combine_kernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(c.y, ids, weights, c.lay.pair_pos, top_k,
                                                                   static_cast<int>(H), out);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
