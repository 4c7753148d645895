// The routed experts of a decode-sized step (at most kMoeDecodeMaxTokens tokens) in two kernels: the router's
// softmax + top-k, the grouping by expert, gate/up, SiLU * up (moe_decode_up_kernel), then down and the weighted
// combine with the gated shared expert (moe_decode_down_kernel). The unfused path (moe_routing.cu) runs route, group,
// split x, gate/up, down and combine as six kernels, each waiting for the previous one's tail: at batch 1 those
// boundaries, not the weight bytes, are the cost (docs/perf/decode-latency.md).
//
// Maths: the same as the unfused path's.
//  - Routing: moe_route_warp_kernel's (softmax in fp32 with the same per-lane and butterfly sums, top-k as repeated
//    argmax, ties to the lower id, renormalised by the running sum of the picks): ids and weights are bitwise the
//    same. The picks use two warp reductions per round (__reduce_max_sync over the probabilities' bits, which order
//    like the non-negative floats they are, then __reduce_min_sync over the ids that reach it) instead of a shuffle
//    butterfly of (value, id) pairs: the same choice.
//  - Experts: NVFP4 codes decoded as the tensor-core kernels decode them (e2m1 * e4m3 block scale, exact in bf16,
//    dev::e2m1_pair_bits / nvfp4_scale_bf16x2), products summed in fp32 on the CUDA cores, times scale_2 * 256 at
//    the end. x and silu(gate) * up enter as fp32 (--dtype float32: the tensor-core path's 3 bf16 parts carry the
//    same ~24 bits) or rounded once to bf16 (--dtype bfloat16, as the tensor-core path rounds them). What differs is
//    the order of the fp32 sums inside each dot product (a lane's 32-code chunks, then a butterfly over the lanes):
//    rel ~1e-7 per output.
//  - Combine: per token, its experts' outputs in ascending expert id, acc += y * w, then + shared * sigmoid(gate):
//    moe_combine_kernel's order and expressions.
// No floating-point atomics: every sum has a fixed order, so a step gives the same bits on every run.
//
// Work split. Kernel 1: a block per (distinct expert of the step, 8 or 16 rows of I); every block routes the step's
// tokens itself (a warp per token; the logits are 2 KB per token in L2), so no block waits for another. Block (0, 0)
// also writes the ids and weights (Ops::moe_route's outputs). Each warp owns 2 (H > 2048) or 4 rows of gate and of
// up; lane l streams the 16-byte chunks l, l + 32, ... of those rows (all of a pass's loads issued before any is
// used) and reads x's matching 32 values once for all of them. Kernel 2: a block per 16-64 rows of H, all experts;
// lanes split a down row into 16-byte chunks (I / 32 lanes per row), each lane 4 rows (the act values it loads serve
// all 4), 2 items of rows in flight per warp; the outputs of every (token, expert) go to shared memory, then each
// thread sums one (token, h) in ascending expert id.
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe_decode_common.cuh"
#include "backend/cuda/moe_decode_fused.h"
#include "backend/cuda/ptx.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;
using namespace moe_decode;

constexpr int kMaxTokens = static_cast<int>(kMoeDecodeMaxTokens);
constexpr int kMaxTopK = kMoeDecodeMaxTopK;
constexpr int kMaxPairs = kMaxTokens * kMaxTopK;
constexpr int kMaxExperts = kMoeDecodeMaxExperts;  // 32 per lane in the routing warp
constexpr int kExpertWords = kMaxExperts / 32;

constexpr int kUpWarps = 4;
constexpr int kUpThreads = 32 * kUpWarps;
// Rows of gate and of up per warp: 2 at kKC 4 (H 4096), 4 below (H 2048: the same 16 loads per lane in flight, and
// half the blocks, so that the 35B's batch-1 grid fits in one wave at 2 blocks per SM).
template <int kKC>
constexpr int up_rows() {
  return kKC >= 4 ? 2 : 4;
}

constexpr int kDownWarps = 8;
constexpr int kDownThreads = 32 * kDownWarps;
constexpr int kDownRowsPerLane = 4;  // down rows per lane (its act values serve all of them)
constexpr int kDownItems = 2;        // items (row groups) whose loads a warp has in flight together

struct UpArgs {
  const float* logits = nullptr;  // [T, E]
  const float* x = nullptr;       // [T, H]
  int T = 0, H = 0, E = 0, top_k = 0;
  bool renormalise = false;
  int32_t* ids = nullptr;     // [T, top_k] out
  float* weights = nullptr;   // [T, top_k] out
  const WeightDesc* table = nullptr;  // [E_held][3] {gate, up, down}
  int held_begin = 0, E_held = 0, I = 0;
  float* act = nullptr;       // [T * top_k, I] out: silu(gate) * up of each valid (token, slot) pair
};

struct DownArgs {
  const int32_t* ids = nullptr;    // [T, top_k] (kernel 1's)
  const float* weights = nullptr;  // [T, top_k]
  int T = 0, top_k = 0, held_begin = 0, E_held = 0, H = 0, I = 0;
  const WeightDesc* table = nullptr;
  const float* act = nullptr;      // [T * top_k, I]
  const float* shared = nullptr;   // [T, H] or null
  const float* shared_gate = nullptr;  // [T] or null
  float* out = nullptr;            // [T, H]
  int lanes_per_row = 0;           // power of two >= I / 32
  int rows_per_item = 0;           // (32 / lanes_per_row) * kDownRowsPerLane
  int block_rows = 0;              // rows of H per block: a multiple of rows_per_item
};

// ---- the step's grouping, in shared memory: the distinct held experts of the step in ascending id and the rank
// of each (token, slot) pair among them (-1: an expert another expert-parallel rank holds).
struct Grouping {
  uint32_t bits[kExpertWords];  // held experts picked by some token (local ids)
  int32_t rank[kMaxPairs];
  int32_t n_unique;
};

// ids: the step's global ids in shared memory. Synchronises the block (3 barriers); every thread takes part.
__device__ __forceinline__ void group_pairs(const int32_t* ids, int P, int held_begin, int E_held, Grouping& g) {
  const int tid = threadIdx.x, nt = blockDim.x;
  for (int w = tid; w < kExpertWords; w += nt) g.bits[w] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += nt) {
    const int e = ids[p] - held_begin;
    if (e >= 0 && e < E_held) atomicOr(&g.bits[e >> 5], 1u << (e & 31));
  }
  __syncthreads();
  for (int p = tid; p < P; p += nt) {
    const int e = ids[p] - held_begin;
    int r = -1;
    if (e >= 0 && e < E_held) {
      r = __popc(g.bits[e >> 5] & ((1u << (e & 31)) - 1u));
      for (int w = 0; w < (e >> 5); ++w) r += __popc(g.bits[w]);
    }
    g.rank[p] = r;
  }
  if (tid == 0) {
    int n = 0;
    for (int w = 0; w < kExpertWords; ++w) n += __popc(g.bits[w]);
    g.n_unique = n;
  }
  __syncthreads();
}

// 32 consecutive fp32 values (16-byte aligned), optionally rounded to bf16 (nearest even).
template <bool kBf16>
__device__ __forceinline__ void load32(const float* __restrict__ src, float (&v)[32]) {
  const float4* s = reinterpret_cast<const float4*>(src);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 q = __ldg(s + i);
    v[4 * i] = q.x;
    v[4 * i + 1] = q.y;
    v[4 * i + 2] = q.z;
    v[4 * i + 3] = q.w;
  }
  if constexpr (kBf16) {
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(v[i]));
  }
}

// ---- kernel 1: routing + gate/up + silu * up
// grid (min(E_held, T * top_k), ceil(I / (kUpWarps * up_rows<kKC>()))). kKC: 16-byte chunks per lane per row and
// pass (a pass covers 32 kKC chunks = 1024 kKC inputs; more passes for larger H).
template <int kKC, bool kBf16>
__global__ void __launch_bounds__(kUpThreads) moe_decode_up_kernel(const UpArgs a) {
  dev::pdl_enter();  // first statement: see launch.cuh
  constexpr int kUpRows = up_rows<kKC>();
  __shared__ int32_t s_ids[kMaxPairs];
  __shared__ float s_w[kMaxPairs];
  __shared__ Grouping s_g;
  __shared__ int32_t s_token_pair[kMaxTokens];  // pair of token t with this block's expert, or -1
  __shared__ int32_t s_expert;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int P = a.T * a.top_k;
  const int u = blockIdx.x;

  for (int t = warp; t < a.T; t += kUpWarps) {
    int idx;
    float val;
    route_token(a.logits + int64_t(t) * a.E, a.E, a.top_k, a.renormalise, lane, idx, val);
    if (lane < a.top_k) {
      s_ids[t * a.top_k + lane] = idx;
      s_w[t * a.top_k + lane] = val;
    }
  }
  if (tid < kMaxTokens) s_token_pair[tid] = -1;
  __syncthreads();
  group_pairs(s_ids, P, a.held_begin, a.E_held, s_g);
  if (blockIdx.x == 0 && blockIdx.y == 0)
    for (int p = tid; p < P; p += kUpThreads) {
      a.ids[p] = s_ids[p];
      a.weights[p] = s_w[p];
    }
  for (int p = tid; p < P; p += kUpThreads)
    if (s_g.rank[p] == u) {
      s_expert = s_ids[p] - a.held_begin;  // every writer writes the same value
      s_token_pair[p / a.top_k] = p;       // a token picks an expert at most once
    }
  __syncthreads();
  if (u >= s_g.n_unique) return;

  const int e = s_expert;
  const WeightDesc* dg = a.table + int64_t(e) * 3;
  const uint8_t* wdata[2] = {static_cast<const uint8_t*>(dg[0].data), static_cast<const uint8_t*>(dg[1].data)};
  const uint8_t* wscale[2] = {dg[0].block_scale, dg[1].block_scale};
  const int n0 = (blockIdx.y * kUpWarps + warp) * kUpRows;
  const int C = a.H / 32;  // chunks per row
  const int64_t row_bytes = a.H / 2, row_scales = a.H / 16;
  float acc[kUpRows][2][kMaxTokens];
#pragma unroll
  for (int r = 0; r < kUpRows; ++r)
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int t = 0; t < kMaxTokens; ++t) acc[r][m][t] = 0.0f;

  for (int c0 = 0; c0 < C; c0 += 32 * kKC) {
    uint4 w[kUpRows][2][kKC];
    uint32_t sc[kUpRows][2][kKC];
#pragma unroll
    for (int r = 0; r < kUpRows; ++r)
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int i = 0; i < kKC; ++i) {
          const int c = c0 + 32 * i + lane, n = n0 + r;
          if (c < C && n < a.I) {
            w[r][m][i] = ptx::ld_stream_16(wdata[m] + n * row_bytes + 16 * c);
            sc[r][m][i] = __ldg(reinterpret_cast<const uint16_t*>(wscale[m] + n * row_scales + 2 * c));
          } else {
            w[r][m][i] = make_uint4(0, 0, 0, 0);
            sc[r][m][i] = 0;
          }
        }
#pragma unroll
    for (int i = 0; i < kKC; ++i) {
      const int c = c0 + 32 * i + lane;
      if (c >= C) continue;
      uint2 scb[kUpRows][2];
#pragma unroll
      for (int r = 0; r < kUpRows; ++r)
#pragma unroll
        for (int m = 0; m < 2; ++m) scb[r][m] = chunk_scales(sc[r][m][i]);
#pragma unroll
      for (int t = 0; t < kMaxTokens; ++t) {
        if (t >= a.T || s_token_pair[t] < 0) continue;  // the same for the whole block
        float xv[32];
        load32<kBf16>(a.x + int64_t(t) * a.H + 32 * c, xv);
#pragma unroll
        for (int r = 0; r < kUpRows; ++r)
#pragma unroll
          for (int m = 0; m < 2; ++m) acc[r][m][t] = dot_chunk(w[r][m][i], scb[r][m], xv, acc[r][m][t]);
      }
    }
  }

  const float gscale[2] = {dg[0].scale * kNvfp4AccumScale, dg[1].scale * kNvfp4AccumScale};
#pragma unroll
  for (int t = 0; t < kMaxTokens; ++t) {
    const int p = t < a.T ? s_token_pair[t] : -1;
    if (p < 0) continue;
#pragma unroll
    for (int r = 0; r < kUpRows; ++r) {
      const float g = warp_sum(acc[r][0][t]) * gscale[0];
      const float up = warp_sum(acc[r][1][t]) * gscale[1];
      const int n = n0 + r;
      if (lane == 0 && n < a.I) {
        float v = silu(g) * up;
        if constexpr (kBf16) v = __bfloat162float(__float2bfloat16_rn(v));
        a.act[int64_t(p) * a.I + n] = v;
      }
    }
  }
}

// ---- kernel 2: down + combine
// grid ceil(H / block_rows). Dynamic shared memory: [T * top_k][block_rows] floats (each pair's expert output).
__global__ void __launch_bounds__(kDownThreads) moe_decode_down_kernel(const DownArgs a) {
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ float s_y[];
  __shared__ int32_t s_ids[kMaxPairs];
  __shared__ float s_w[kMaxPairs];
  __shared__ Grouping s_g;
  __shared__ int32_t s_unique[kMaxPairs];                 // local expert of each rank
  __shared__ int32_t s_upairs[kMaxPairs][kMaxTokens];     // [rank][token]: its pair, or -1
  __shared__ int32_t s_order[kMaxTokens][kMaxTopK];       // a token's valid pairs in ascending expert id
  __shared__ int32_t s_nvalid[kMaxTokens];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int P = a.T * a.top_k, HT = a.block_rows;
  const int h0 = blockIdx.x * HT;

  for (int p = tid; p < P; p += kDownThreads) {
    s_ids[p] = a.ids[p];
    s_w[p] = a.weights[p];
  }
  for (int i = tid; i < kMaxPairs * kMaxTokens; i += kDownThreads) (&s_upairs[0][0])[i] = -1;
  __syncthreads();
  group_pairs(s_ids, P, a.held_begin, a.E_held, s_g);
  for (int p = tid; p < P; p += kDownThreads) {
    const int r = s_g.rank[p];
    if (r >= 0) {
      s_unique[r] = s_ids[p] - a.held_begin;
      s_upairs[r][p / a.top_k] = p;
    }
  }
  if (tid < a.T) {
    // Insertion sort of the token's valid slots by (expert id, slot): moe_combine_kernel's order.
    const int t = tid;
    int n = 0;
    for (int j = 0; j < a.top_k; ++j) {
      const int p = t * a.top_k + j;
      if (s_g.rank[p] < 0) continue;
      int pos = n++;
      while (pos > 0 && s_ids[s_order[t][pos - 1]] > s_ids[p]) {
        s_order[t][pos] = s_order[t][pos - 1];
        --pos;
      }
      s_order[t][pos] = p;
    }
    s_nvalid[t] = n;
  }
  __syncthreads();

  // Items: (distinct expert u, group g of rows_per_item rows of this block). Lane: chunk c of the row (I / 32
  // chunks, lanes_per_row lanes), row slot lane / lanes_per_row, rows slot + k * (32 / lanes_per_row).
  const int G = a.lanes_per_row, row_stride = 32 / G;
  const int C = a.I / 32, c = lane % G, slot = lane / G;
  const int groups = HT / a.rows_per_item;
  const int n_items = s_g.n_unique * groups;
  const int64_t row_bytes = a.I / 2, row_scales = a.I / 16;
  // Round b: warp w takes items b + w and b + w + kDownWarps (spread over the warps when there are few).
  for (int base = 0; base < n_items; base += kDownWarps * kDownItems) {
    uint4 w[kDownItems][kDownRowsPerLane];
    uint32_t sc[kDownItems][kDownRowsPerLane];
#pragma unroll
    for (int q = 0; q < kDownItems; ++q) {
      const int it = base + q * kDownWarps + warp;
      const bool live = it < n_items;
      const int uq = live ? it / groups : 0, gq = live ? it % groups : 0;
      const WeightDesc* d = a.table + int64_t(live ? s_unique[uq] : 0) * 3 + 2;
      const uint8_t* data = static_cast<const uint8_t*>(d->data);
      const uint8_t* bs = d->block_scale;
#pragma unroll
      for (int k = 0; k < kDownRowsPerLane; ++k) {
        const int h = h0 + gq * a.rows_per_item + k * row_stride + slot;
        if (live && c < C && h < a.H) {
          w[q][k] = ptx::ld_stream_16(data + h * row_bytes + 16 * c);
          sc[q][k] = __ldg(reinterpret_cast<const uint16_t*>(bs + h * row_scales + 2 * c));
        } else {
          w[q][k] = make_uint4(0, 0, 0, 0);
          sc[q][k] = 0;
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kDownItems; ++q) {
      const int it = base + q * kDownWarps + warp;
      if (it >= n_items) break;
      const int uq = it / groups, gq = it % groups;
      const float gscale = a.table[int64_t(s_unique[uq]) * 3 + 2].scale * kNvfp4AccumScale;
      uint2 scb[kDownRowsPerLane];
#pragma unroll
      for (int k = 0; k < kDownRowsPerLane; ++k) scb[k] = chunk_scales(sc[q][k]);
      for (int t = 0; t < a.T; ++t) {
        const int p = s_upairs[uq][t];
        if (p < 0) continue;
        float xv[32];
        if (c < C) {
          load32<false>(a.act + int64_t(p) * a.I + 32 * c, xv);
        } else {
#pragma unroll
          for (int i = 0; i < 32; ++i) xv[i] = 0.0f;
        }
        float acc[kDownRowsPerLane];
#pragma unroll
        for (int k = 0; k < kDownRowsPerLane; ++k) acc[k] = dot_chunk(w[q][k], scb[k], xv, 0.0f);
        // Sum over the row's lanes (an xor butterfly inside each group of G lanes).
        for (int o = G >> 1; o > 0; o >>= 1)
#pragma unroll
          for (int k = 0; k < kDownRowsPerLane; ++k) acc[k] += __shfl_xor_sync(0xffffffffu, acc[k], o);
        if (c == 0)
#pragma unroll
          for (int k = 0; k < kDownRowsPerLane; ++k) {
            const int hl = gq * a.rows_per_item + k * row_stride + slot;
            if (h0 + hl < a.H) s_y[p * HT + hl] = acc[k] * gscale;
          }
      }
    }
  }
  __syncthreads();

  for (int i = tid; i < a.T * HT; i += kDownThreads) {
    const int t = i / HT, hl = i % HT, h = h0 + hl;
    if (h >= a.H) continue;
    float acc = 0.0f;
    for (int n = 0; n < s_nvalid[t]; ++n) {
      const int p = s_order[t][n];
      acc += s_y[p * HT + hl] * s_w[p];
    }
    const int64_t o = int64_t(t) * a.H + h;
    if (a.shared) {
      const float gate = sigmoid(a.shared_gate[t]);
      const float sh = a.shared[o] * gate;
      acc = acc + sh;
    }
    a.out[o] = acc;
  }
}

struct DownShape {
  int lanes_per_row, rows_per_item, block_rows;
};
DownShape down_shape(int64_t I) {
  DownShape s{};
  int g = 1;
  while (g < I / 32) g *= 2;
  s.lanes_per_row = g;
  s.rows_per_item = (32 / g) * kDownRowsPerLane;
  s.block_rows = s.rows_per_item < 16 ? 16 : s.rows_per_item;
  return s;
}

template <int kKC>
void launch_up(const UpArgs& a, int64_t max_unique, bool bf16, Stream stream) {
  constexpr int kBlockRows = kUpWarps * up_rows<kKC>();
  const dim3 grid(static_cast<unsigned>(max_unique), static_cast<unsigned>((a.I + kBlockRows - 1) / kBlockRows));
  if (bf16) launch_kernel(moe_decode_up_kernel<kKC, true>, grid, kUpThreads, 0, stream, a);
  else launch_kernel(moe_decode_up_kernel<kKC, false>, grid, kUpThreads, 0, stream, a);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace

bool moe_decode_fused_supported(int64_t T, int64_t H, int64_t I, int64_t E, int top_k, int experts_gemv2_kind) {
  return T >= 1 && T <= kMoeDecodeMaxTokens && experts_gemv2_kind == 1 && H > 0 && H % 32 == 0 && I >= 64 &&
         I <= 1024 && I % 32 == 0 && E >= top_k && E <= kMoeDecodeMaxExperts && top_k >= 1 &&
         top_k <= kMoeDecodeMaxTopK;
}

size_t moe_decode_fused_workspace_bytes(int64_t T, int top_k, int64_t I) {
  return static_cast<size_t>(T * top_k * I) * sizeof(float);
}

void moe_decode_fused(const float* logits, const float* x, int64_t T, int64_t H, int64_t E, int top_k,
                      bool renormalise, int32_t* ids, float* weights, const WeightDesc* experts, int32_t held_begin,
                      int64_t E_held, int64_t I, void* workspace, float* out, const float* shared,
                      const float* shared_gate, int mma_parts, Stream stream) {
  if (T == 0) return;
  if (T > kMoeDecodeMaxTokens || top_k < 1 || top_k > kMoeDecodeMaxTopK || E > kMoeDecodeMaxExperts ||
      E_held > kMoeDecodeMaxExperts || I < 64 || I > 1024 || I % 32 != 0 || H % 32 != 0)
    cuda_fail("moe_decode_fused: T {} top_k {} E {} I {} H {} outside the fused kernels' shapes",
              {T, top_k, E, I, H});
  if (mma_parts != kMmaPartsFp32 && mma_parts != kMmaPartsBf16)
    cuda_fail("moe_decode_fused: {} bf16 parts (1 or 3)", {mma_parts});
  auto* act = static_cast<float*>(workspace);
  UpArgs up;
  up.logits = logits;
  up.x = x;
  up.T = static_cast<int>(T);
  up.H = static_cast<int>(H);
  up.E = static_cast<int>(E);
  up.top_k = top_k;
  up.renormalise = renormalise;
  up.ids = ids;
  up.weights = weights;
  up.table = experts;
  up.held_begin = held_begin;
  up.E_held = static_cast<int>(E_held);
  up.I = static_cast<int>(I);
  up.act = act;
  const int64_t max_unique = std::min<int64_t>(E_held, T * top_k);
  const bool bf16 = mma_parts == kMmaPartsBf16;
  const int64_t chunks = H / 32;
  if (chunks <= 32) launch_up<1>(up, max_unique, bf16, stream);
  else if (chunks <= 64) launch_up<2>(up, max_unique, bf16, stream);
  else launch_up<4>(up, max_unique, bf16, stream);
  profile_mark("route + gate/up (fused)");

  DownArgs down;
  down.ids = ids;
  down.weights = weights;
  down.T = up.T;
  down.top_k = top_k;
  down.held_begin = held_begin;
  down.E_held = up.E_held;
  down.H = up.H;
  down.I = up.I;
  down.table = experts;
  down.act = act;
  down.shared = shared;
  down.shared_gate = shared_gate;
  down.out = out;
  const DownShape s = down_shape(I);
  down.lanes_per_row = s.lanes_per_row;
  down.rows_per_item = s.rows_per_item;
  down.block_rows = s.block_rows;
  const size_t smem = static_cast<size_t>(T * top_k * s.block_rows) * sizeof(float);
  launch_kernel(moe_decode_down_kernel, static_cast<unsigned>((H + s.block_rows - 1) / s.block_rows), kDownThreads,
                smem, stream, down);
  KILN_CUDA_CHECK_LAUNCH();
  profile_mark("down + combine (fused)");
}

}  // namespace kiln::cuda::ops
