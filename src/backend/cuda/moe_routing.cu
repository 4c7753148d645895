// MoE routing on the device: the router's softmax + top-k (moe_route), the grouping of (token, slot) pairs by
// expert into row tiles (moe_group_kernel), the weighted combine of the experts' rows per token with the optional
// gated shared expert, and moe_experts(), which runs group -> experts (tensor cores: moe_experts.cu; CUDA cores:
// linear.cu's kernels) -> combine.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;

// ---- MoE routing: a block per token

constexpr int kRouteThreads = 128;

__global__ void moe_route_kernel(const float* __restrict__ logits, int E, int top_k, bool renormalise,
                                 int32_t* __restrict__ ids, float* __restrict__ weights) {
  dev::pdl_enter();  // first statement: see launch.cuh
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
    warp_argmax(bv, bi);
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
  dev::pdl_enter();  // first statement: see launch.cuh
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
    warp_argmax(bv, bi);
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

// The scan over the experts of one block (a multiple of 32 threads, at most 1024): from each expert's pair count in
// cursor[e], its first sorted row and first row tile (lay.group_offset, tile_offset, tile_group, tile_info where
// given); cursor[e] becomes the expert's first sorted row. Thread i owns the contiguous chunk of ceil(E / blockDim)
// experts from i * chunk: local sums, a two-level warp-shuffle block scan, then the chunk's offsets and tiles.
__device__ __forceinline__ void scan_groups(int32_t* cursor, int E, int tile_rows_m, const MoeLayout& lay) {
  __shared__ int warp_rows[32], warp_tiles[32];
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
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
}

// Pair p (expert e) takes the next free sorted row of its expert (cursor: shared memory); an expert id outside [0, E)
// is skipped (pair_pos -1).
__device__ __forceinline__ void place_pair(int p, int e, int E, int top_k, int32_t* cursor, const MoeLayout& lay) {
  if (e >= 0 && e < E) {
    const int pos = atomicAdd(&cursor[e], 1);
    lay.row_token[pos] = p / top_k;
    lay.pair_pos[p] = pos;
  } else {
    lay.pair_pos[p] = -1;
  }
}

// One block (a multiple of 32 threads, at most 1024): counts each expert's pairs in shared memory, scans rows and
// row tiles over the experts (thread i owns the contiguous chunk of ceil(E / blockDim) experts from i * chunk: local
// sums, a two-level warp-shuffle block scan, then the chunk's offsets and tiles), then places every pair through a
// shared-memory cursor per expert (the order of rows within an expert follows the atomics).
__global__ void __launch_bounds__(1024) moe_group_kernel(const int32_t* __restrict__ ids, int P, int top_k, int E,
                                                         int tile_rows_m, MoeLayout lay) {
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ int32_t cursor[];  // [E] pairs of each expert, then its next free sorted row
  const int tid = threadIdx.x, nt = blockDim.x;
  // The expert of this thread's first pair, loaded before the counters are cleared (its latency overlaps that).
  const int first_e = tid < P ? ids[tid] : -1;
  for (int e = tid; e < E; e += nt) cursor[e] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += nt) {
    const int e = p == tid ? first_e : ids[p];
    if (e >= 0 && e < E) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();
  scan_groups(cursor, E, tile_rows_m, lay);
  __syncthreads();
  for (int p = tid; p < P; p += nt) place_pair(p, p == tid ? first_e : ids[p], E, top_k, cursor, lay);
}

// ---- The grouping of large steps over many blocks (moe_group_rows with wide: one block is one multiprocessor, and
// for the 65,536 pairs of an 8192-token pass of the 35B-A3B it took ~96 us). Block b of the count and place kernels
// takes pairs [b * kGroupPairsPerBlock, (b + 1) * kGroupPairsPerBlock); hist[b][e] holds block b's pairs of expert e,
// then (after the scan) block b's first sorted row within expert e. Rows within an expert: blocks in order, within
// a block the order of the shared-memory atomics (as the one-block kernel; no result depends on it).
constexpr int kGroupPairsPerBlock = 2048;
constexpr int kGroupThreads = 1024;
int64_t group_blocks(int64_t P) { return (P + kGroupPairsPerBlock - 1) / kGroupPairsPerBlock; }

__global__ void __launch_bounds__(kGroupThreads) moe_group_count_kernel(const int32_t* __restrict__ ids, int P, int E,
                                                                       int32_t* __restrict__ hist) {
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ int32_t count[];  // [E]
  const int tid = threadIdx.x, p0 = blockIdx.x * kGroupPairsPerBlock, p1 = min(P, p0 + kGroupPairsPerBlock);
  for (int e = tid; e < E; e += kGroupThreads) count[e] = 0;
  __syncthreads();
  for (int p = p0 + tid; p < p1; p += kGroupThreads) {
    const int e = ids[p];
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  for (int e = tid; e < E; e += kGroupThreads) hist[int64_t(blockIdx.x) * E + e] = count[e];
}

// One block: each expert's pairs summed over the count blocks, the scan of scan_groups, then each count block's first
// row within each expert (hist rewritten in place, expert by expert).
__global__ void __launch_bounds__(kGroupThreads) moe_group_scan_kernel(int E, int blocks, int tile_rows_m,
                                                                      int32_t* hist, MoeLayout lay) {
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ int32_t cursor[];  // [E]
  for (int e = threadIdx.x; e < E; e += kGroupThreads) {
    int c = 0;
    for (int b = 0; b < blocks; ++b) c += hist[int64_t(b) * E + e];
    cursor[e] = c;
  }
  __syncthreads();
  scan_groups(cursor, E, tile_rows_m, lay);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kGroupThreads) {
    int row = cursor[e];
    for (int b = 0; b < blocks; ++b) {
      const int c = hist[int64_t(b) * E + e];
      hist[int64_t(b) * E + e] = row;
      row += c;
    }
  }
}

__global__ void __launch_bounds__(kGroupThreads) moe_group_place_kernel(const int32_t* __restrict__ ids, int P,
                                                                       int top_k, int E, const int32_t* hist,
                                                                       MoeLayout lay) {
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ int32_t cursor[];  // [E] this block's next sorted row of each expert
  const int tid = threadIdx.x, p0 = blockIdx.x * kGroupPairsPerBlock, p1 = min(P, p0 + kGroupPairsPerBlock);
  for (int e = tid; e < E; e += kGroupThreads) cursor[e] = hist[int64_t(blockIdx.x) * E + e];
  __syncthreads();
  for (int p = p0 + tid; p < p1; p += kGroupThreads) place_pair(p, ids[p], E, top_k, cursor, lay);
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
// y's rows as fp32 (Y float) or bf16 (Y uint16_t: the dequantised cuBLAS path's output, moe_prefill_blas.cu).
__device__ __forceinline__ void load_y4(const float* p, float (&v)[4]) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x;
  v[1] = q.y;
  v[2] = q.z;
  v[3] = q.w;
}
__device__ __forceinline__ void load_y4(const uint16_t* p, float (&v)[4]) {
  const uint2 q = *reinterpret_cast<const uint2*>(p);
  v[0] = bf16_to_f32(uint16_t(q.x & 0xffffu));
  v[1] = bf16_to_f32(uint16_t(q.x >> 16));
  v[2] = bf16_to_f32(uint16_t(q.y & 0xffffu));
  v[3] = bf16_to_f32(uint16_t(q.y >> 16));
}
__device__ __forceinline__ float load_y(const float* p) { return *p; }
__device__ __forceinline__ float load_y(const uint16_t* p) { return bf16_to_f32(*p); }

template <bool kVec, typename Y>
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const Y* __restrict__ y, const int32_t* __restrict__ ids, const float* __restrict__ weights,
                       const int32_t* __restrict__ pair_pos, int top_k, int H, float* __restrict__ out,
                       const float* __restrict__ shared, const float* __restrict__ shared_gate) {
  dev::pdl_enter();  // first statement: see launch.cuh
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
        const Y* src = y + srow[n0 + u] + h;
        if constexpr (kVec) {
          load_y4(src, v[u]);
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) v[u][i] = h + i * kStep < H ? load_y(src + i * kStep) : 0.0f;
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

// The combine over T tokens: 4-wide loads of y (float4; bf16: 8 bytes) and float4 stores when H % 4 == 0 and y,
// out and shared are 16-byte aligned.
template <typename Y>
void launch_combine(const Y* y, const int32_t* ids, const float* weights, const int32_t* pair_pos, int top_k,
                    int64_t T, int64_t H, float* out, const float* shared, const float* shared_gate, Stream stream) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };  // null counts as aligned
  const bool vec = H % 4 == 0 && aligned(y) && aligned(out) && aligned(shared);
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>((H + kCombineCols - 1) / kCombineCols));
  const int h = static_cast<int>(H);
  if (vec) launch_kernel(moe_combine_kernel<true, Y>, grid, kCombineThreads, 0, stream, y, ids, weights, pair_pos, top_k,
                         h, out, shared, shared_gate);
  else launch_kernel(moe_combine_kernel<false, Y>, grid, kCombineThreads, 0, stream, y, ids, weights, pair_pos, top_k,
                     h, out, shared, shared_gate);
  KILN_CUDA_CHECK_LAUNCH();
}

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
  WorkspaceCarve w(base);
  auto take = [&](size_t n) { return w.take(n); };
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
  c.bytes = w.bytes;
  return c;
}

}  // namespace

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

// The grouping alone (moe_prefill_blas.cu): group_offset, tile_offset, tile_group (row tiles of kRowGroupTile rows,
// unused by the caller but written by the kernel), row_token, pair_pos.
constexpr int kRowGroupTile = 64;
// The grouping's buffers, and the wide grouping's per-block counts (hist) after them.
static MoeRowGroups carve_row_groups(void* base, int64_t P, int64_t E, size_t* bytes, int32_t** hist = nullptr) {
  WorkspaceCarve w(base);
  auto take = [&](size_t n) { return static_cast<int32_t*>(w.take(n)); };
  MoeRowGroups g;
  g.group_offset = take((E + 1) * 4);
  g.tile_offset = take((E + 1) * 4);
  g.tile_group = take((P / kRowGroupTile + E + 1) * 4);
  g.row_token = take(P * 4);
  g.pair_pos = take(P * 4);
  int32_t* h = take(static_cast<size_t>(group_blocks(P) * E) * 4);
  if (hist) *hist = h;
  if (bytes) *bytes = w.bytes;
  return g;
}

size_t moe_row_groups_bytes(int64_t T, int top_k, int64_t E) {
  size_t bytes = 0;
  carve_row_groups(nullptr, T * top_k, E, &bytes);
  return bytes;
}

MoeRowGroups moe_group_rows(const int32_t* ids, int64_t T, int top_k, int64_t E, void* workspace, Stream stream,
                            bool wide) {
  if (top_k < 1 || top_k > 64) cuda_fail("moe_group_rows: top_k {} is not supported (1 to 64)", {top_k});
  if (E * 4 > 48 * 1024) cuda_fail("moe_group_rows: {} experts is too many (at most 12288)", {E});
  const int64_t P = T * top_k;
  int32_t* hist = nullptr;
  MoeRowGroups g = carve_row_groups(workspace, P, E, nullptr, &hist);
  if (T == 0) return g;
  MoeLayout lay{};
  lay.group_offset = g.group_offset;
  lay.tile_offset = g.tile_offset;
  lay.tile_group = g.tile_group;
  lay.tile_info = nullptr;
  lay.max_tiles = 0;
  lay.row_token = g.row_token;
  lay.pair_pos = g.pair_pos;
  const size_t smem = static_cast<size_t>(E) * 4;
  const int64_t blocks = group_blocks(P);
  if (wide && blocks > 1) {
    launch_kernel(moe_group_count_kernel, static_cast<unsigned>(blocks), kGroupThreads, smem, stream, ids,
                  static_cast<int>(P), static_cast<int>(E), hist);
    KILN_CUDA_CHECK_LAUNCH();
    launch_kernel(moe_group_scan_kernel, 1, kGroupThreads, smem, stream, static_cast<int>(E), static_cast<int>(blocks),
                  kRowGroupTile, hist, lay);
    KILN_CUDA_CHECK_LAUNCH();
    launch_kernel(moe_group_place_kernel, static_cast<unsigned>(blocks), kGroupThreads, smem, stream, ids,
                  static_cast<int>(P), top_k, static_cast<int>(E), static_cast<const int32_t*>(hist), lay);
    KILN_CUDA_CHECK_LAUNCH();
    return g;
  }
  const int group_threads = E <= 1024 && P <= 4096 ? 256 : 1024;
  launch_kernel(moe_group_kernel, 1, group_threads, smem, stream, ids, static_cast<int>(P), top_k,
                static_cast<int>(E), kRowGroupTile, lay);
  KILN_CUDA_CHECK_LAUNCH();
  return g;
}

void moe_combine(const float* y, const int32_t* ids, const float* weights, const int32_t* pair_pos, int top_k,
                 int64_t T, int64_t H, float* out, const float* shared, const float* shared_gate, Stream stream) {
  if (T == 0) return;
  launch_combine(y, ids, weights, pair_pos, top_k, T, H, out, shared, shared_gate, stream);
}
void moe_combine_bf16(const uint16_t* y, const int32_t* ids, const float* weights, const int32_t* pair_pos, int top_k,
                      int64_t T, int64_t H, float* out, const float* shared, const float* shared_gate, Stream stream) {
  if (T == 0) return;
  launch_combine(y, ids, weights, pair_pos, top_k, T, H, out, shared, shared_gate, stream);
}

size_t moe_workspace_bytes(int64_t T, int top_k, int64_t E, int64_t H, int64_t I) {
  return moe_carve(nullptr, T, top_k, E, H, I).bytes;
}
void moe_experts(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* weights, int top_k,
                 const WeightDesc* experts, bool experts_vec_ok, int experts_gemv2_kind, int64_t E, int64_t I,
                 void* workspace, float* out, Stream stream, bool tensor_cores, const float* shared,
                 const float* shared_gate, int mma_parts) {
  if (T == 0) return;
  if (top_k < 1 || top_k > 64) cuda_fail("moe_experts: top_k {} is not supported (1 to 64)", {top_k});
  if (E * 4 > 48 * 1024) cuda_fail("moe_experts: {} experts is too many (at most 12288)", {E});
  const int64_t P = T * top_k;
  MoeCarve c = moe_carve(workspace, T, top_k, E, H, I);
  // Small groups (decode, small batches: a few rows per expert) take the gemv path. With the bandwidth gemv the
  // tile height follows the expected rows per expert (pairs / experts, rounded up to 1, 2, 4 or 8): rows
  // are registers, and fewer of them keep more warps resident.
  const bool gemv = P <= kGemvMaxRows * E;
  int tm = gemv ? kGemvTileRows : kGemmTileRows;
  const bool x_vec = H % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const bool mma = tensor_cores && experts_vec_ok &&
                   moe_mma_supported(H, I, experts_gemv2_kind);
  if (mma) {
    // Tensor cores: 8 rows per MMA tile; a row tile of up to 64 rows walks them with its weights in L2 (taller
    // minimum tiles measured slower for prefill: docs/perf/cuda-ops.md).
    tm = 8;
    while (tm < 64 && int64_t(tm) * E < P) tm *= 2;
  } else if (gemv && experts_gemv2_kind >= 0 && experts_vec_ok && x_vec) {
    tm = 1;
    while (tm < kGemvTileRows && int64_t(tm) * E < P) tm *= 2;
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
    plan.tile_m = tm;
    // Row tiles per block: as wide as keeps >= 2 blocks per SM (132 SMs) over the tiles that have rows (about
    // min(P, E) of them): wide blocks pay the tile and descriptor lookups once, narrow ones fill the GPU at batch 1.
    const int64_t live_tiles = std::min<int64_t>(P, E);
    // Up to 4 for gate/up, 8 for down, which has a quarter of the k-steps (the widths that measured best).
    auto widest = [&](int64_t n, int most) {
      int mt = most;
      while (mt > 1 && live_tiles * (n / (16 * mt)) < kTwoBlocksPerSm) mt /= 2;
      return mt;
    };
    plan.mt_up = widest(I, 4);
    plan.mt_down = widest(H, 8);
    // Blocks per SM: gate/up at 3 (80 registers, small spills) once its grid outgrows 2 blocks per SM (faster there,
    // slower below); down at 4 (64 registers) at every batch. Measurements: docs/perf/cuda-ops.md.
    const int64_t up_blocks = live_tiles * (I / (16 * plan.mt_up));
    plan.occ_up = up_blocks > kTwoBlocksPerSm ? 3 : 0;
    plan.occ_down = 4;
    plan.max_tiles = max_tiles;
    plan.parts = mma_parts;  // the workspace holds 3 parts: the most either form needs
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

  ExpertGroups groups;
  groups.group_offset = c.lay.group_offset;
  groups.tile_offset = c.lay.tile_offset;
  groups.tile_group = c.lay.tile_group;
  groups.row_token = c.lay.row_token;
  groups.tile_m = tm;
  groups.max_tiles = max_tiles;
  groups.gemv = gemv;
  moe_experts_fp32(x, T, H, I, experts, E, experts_vec_ok, x_vec, experts_gemv2_kind, groups, c.act, c.y, stream);
  launch_combine(c.y, ids, weights, c.lay.pair_pos, top_k, T, H, out, shared, shared_gate, stream);
}


__global__ void moe_local_ids_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t begin, int32_t count,
                                     int32_t* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t e = ids[i] - begin;
    out[i] = e >= 0 && e < count ? e : -1;
  }
}

void moe_local_ids(const int32_t* ids, int64_t n, int32_t begin, int32_t count, int32_t* out, Stream stream) {
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 1024));
  launch_kernel(moe_local_ids_kernel, blocks, 256, 0, stream, ids, n, begin, count, out);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
