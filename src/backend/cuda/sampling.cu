// Token sampling on the device (CudaOps::sample_rows): one block per row, model::sample_row_host's definition.
// The algorithm and where it can differ from the host: kernels.h. Also the greedy argmax over rows (argmax_rows).
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda::ops {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;
constexpr int kUnroll = 4;     // strided passes: loads in flight per thread (indices clamped, values masked)
constexpr int kSegUnroll = 8;  // segment passes
constexpr unsigned kFull = 0xffffffffu;
constexpr int kNoBucket = 256;  // a lane without a token in a radix pass

struct Smem {
  double whist[kWarps][256];  // mass radix passes: one histogram per warp; select_ascending's segment ends
  double tot[256];            // a radix pass's bucket totals (mass or count)
  unsigned cnt[256];          // a radix pass's bucket counts
  double red[kWarps];               // dev::block_sum; select_ascending's segment sums
  double red2[kWarps];              // select_ascending's scan of them
  float redf[kWarps];               // dev::block_max of floats
  unsigned long long redu[kWarps];  // dev::block_max of argmax keys
  // radix_select's result
  unsigned prefix, mask, tie;
  int found;
  double above;
  // select_ascending
  int sel, sel_token;
};

// Order-preserving key of a float (larger value, larger key); -0 and +0 get the same key, as they compare equal.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(__fadd_rn(x, 0.0f));  // -0 + 0 = +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ bool finite_value(float x) { return x > -INFINITY && x < INFINITY; }

// f(scaled value, index, in range) over the row, strided by the block: kUnroll loads issued before any use. The row
// is the previous kernel's output: coherent loads (see argmax_chunk_kernel).
template <class F>
__device__ __forceinline__ void for_row(const float* row, int n, float inv, F&& f) {
  for (int base = 0; base < n; base += kThreads * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      v[u] = __ldcg(row + (i < n ? i : n - 1));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      f(__fmul_rn(v[u], inv), i, i < n);
    }
  }
}

// ---- radix passes. Lanes of a warp with the same bucket are combined first (one shared update per bucket).
__device__ __forceinline__ void warp_count_add(unsigned* cnt, int b) {
  if (!__any_sync(kFull, b != kNoBucket)) return;
  const unsigned peers = __match_any_sync(kFull, b);
  const int lane = threadIdx.x & 31;
  if (b != kNoBucket && (peers & ((1u << lane) - 1u)) == 0) atomicAdd(&cnt[b], unsigned(__popc(peers)));
}

// The warp's histogram wh (its own: no other warp writes it) gets each bucket's mass summed over its lanes by a tree
// over the lanes' ranks within the bucket: a fixed order, so the sums do not depend on scheduling.
__device__ __forceinline__ void warp_mass_add(double* wh, unsigned* cnt, int b, double w) {
  if (!__any_sync(kFull, b != kNoBucket)) return;
  const unsigned peers = __match_any_sync(kFull, b);
  const int lane = threadIdx.x & 31;
  const int rank = __popc(peers & ((1u << lane) - 1u));
  double acc = w;
#pragma unroll
  for (int s = 1; s < 32; s <<= 1) {
    const unsigned src = __fns(peers, unsigned(lane), s + 1);  // the lane of rank (rank + s), or 0xffffffff
    const double other = __shfl_sync(kFull, acc, src < 32u ? int(src) : lane);
    if ((rank & (2 * s - 1)) == 0 && src < 32u) acc += other;
  }
  if (b != kNoBucket && rank == 0) {
    wh[b] += acc;
    atomicAdd(&cnt[b], unsigned(__popc(peers)));
  }
  __syncwarp();  // the next call's leader of this bucket may be another lane
}

// Warp 0 after a radix pass: scanning the buckets from the top, the first one with members where the running total
// (from sm.above) reaches target. Found: the prefix takes its digit, sm.above becomes the total above it and sm.tie
// its count. None (a mass pass's rounding, or fewer participants than a count target): with stop_if_none the select
// ends (sm.found = 0), otherwise the lowest bucket with members is taken.
__device__ void find_bucket(Smem& sm, int shift, double target, bool stop_if_none) {
  const int lane = threadIdx.x & 31;
  const int top = 255 - 8 * lane;  // this lane: buckets top .. top - 7
  double ls = 0.0;
#pragma unroll
  for (int j = 0; j < 8; ++j) ls += sm.tot[top - j];
  const double incl = dev::warp_inclusive_scan(ls);
  double excl = __shfl_up_sync(kFull, incl, 1);
  if (lane == 0) excl = 0.0;
  double c = sm.above + excl;
  int hit = -1, low = -1;
  double hit_above = 0.0, low_above = 0.0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int b = top - j;
    const bool members = sm.cnt[b] > 0;
    const double nc = c + sm.tot[b];
    if (members && hit < 0 && nc >= target) {
      hit = b;
      hit_above = c;
    }
    if (members) {
      low = b;
      low_above = c;
    }
    c = nc;
  }
  const unsigned hits = __ballot_sync(kFull, hit >= 0);
  const unsigned lows = __ballot_sync(kFull, low >= 0);
  int b = -1;
  double above = 0.0;
  if (hits) {
    const int src = __ffs(hits) - 1;
    b = __shfl_sync(kFull, hit, src);
    above = __shfl_sync(kFull, hit_above, src);
  } else if (lows && !stop_if_none) {
    const int src = 31 - __clz(lows);
    b = __shfl_sync(kFull, low, src);
    above = __shfl_sync(kFull, low_above, src);
  }
  if (lane == 0) {
    if (b >= 0) {
      sm.prefix |= unsigned(b) << shift;
      sm.mask |= 255u << shift;
      sm.above = above;
      sm.tie = sm.cnt[b];
    } else {
      sm.found = 0;
    }
  }
}

// Radix select over the keys of the tokens with part(x, key, i), 8 bits a pass from the top: the key where the count
// (kMass false) or the mass weight(x) (kMass true) summed from the largest keys down first reaches target. Leaves
// sm.prefix = that key, sm.above = the total of the larger keys, sm.tie = the number of tokens with that key, and
// sm.found = 0 when a mass select's first pass never reaches the target (then nothing else is meaningful).
template <bool kMass, class Part, class Weight>
__device__ void radix_select(const float* __restrict__ row, int n, float inv, Smem& sm, double target, Part part,
                             Weight weight) {
  const int warp = threadIdx.x >> 5;
  __syncthreads();
  if (threadIdx.x == 0) {
    sm.prefix = 0;
    sm.mask = 0;
    sm.above = 0.0;
    sm.tie = 0;
    sm.found = 1;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) sm.cnt[i] = 0;
    if constexpr (kMass) {
      double* wh = &sm.whist[0][0];
      for (int i = threadIdx.x; i < kWarps * 256; i += kThreads) wh[i] = 0.0;
    }
    __syncthreads();
    const unsigned prefix = sm.prefix, mask = sm.mask;
    for_row(row, n, inv, [&](float x, int i, bool ok) {
      const uint32_t k = order_key(x);
      const bool in = ok && (k & mask) == prefix && part(x, k, i);
      const int b = in ? int((k >> shift) & 255u) : kNoBucket;
      if constexpr (kMass) {
        warp_mass_add(sm.whist[warp], sm.cnt, b, in ? weight(x) : 0.0);
      } else {
        warp_count_add(sm.cnt, b);
      }
    });
    __syncthreads();
    if (threadIdx.x < 256) {
      double t = 0.0;
      if constexpr (kMass) {
        for (int w = 0; w < kWarps; ++w) t += sm.whist[w][threadIdx.x];
      } else {
        t = double(sm.cnt[threadIdx.x]);
      }
      sm.tot[threadIdx.x] = t;
    }
    __syncthreads();
    if (threadIdx.x < 32) find_bucket(sm, shift, target, kMass && shift == 24);
    __syncthreads();
    if (!sm.found) break;
  }
}

// The first index (ascending) whose inclusive prefix sum of weight(x, i) >= 0 exceeds the target (t * the total
// weight when scale_by_total, else t); the last index with a positive weight when none does (rounding); -1 when every
// weight is 0. Each thread owns one contiguous segment of the row: segment sums, a scan in thread order, then the
// thread whose segment the target falls in walks it. The same index is returned to every thread.
template <class W>
__device__ int select_ascending(const float* row, int n, float inv, Smem& sm, bool scale_by_total,
                                double t, W weight) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg = ((n + kThreads - 1) / kThreads + 31) & ~31;
  const int begin = int(threadIdx.x) * seg;
  // The weights of kSegUnroll indices of this thread's segment from j0 (0 past n), all loads issued before any is
  // used (past n: the last value).
  auto segment_weights = [&](int j0, double (&w)[kSegUnroll]) {
    float v[kSegUnroll];
#pragma unroll
    for (int u = 0; u < kSegUnroll; ++u) {
      const int i = begin + j0 + u;
      v[u] = __ldcg(row + (i < n ? i : n - 1));
    }
#pragma unroll
    for (int u = 0; u < kSegUnroll; ++u) {
      const int i = begin + j0 + u;
      w[u] = i < n ? weight(__fmul_rn(v[u], inv), i) : 0.0;
    }
  };
  double s = 0.0;
  int last = -1;
  for (int j0 = 0; j0 < seg; j0 += kSegUnroll) {
    double w[kSegUnroll];
    segment_weights(j0, w);
#pragma unroll
    for (int u = 0; u < kSegUnroll; ++u) {
      s += w[u];
      if (w[u] > 0.0) last = begin + j0 + u;
    }
  }
  const double incl = dev::warp_inclusive_scan(s);
  __syncthreads();
  if (lane == 31) sm.red[warp] = incl;
  __syncthreads();
  if (warp == 0) sm.red2[lane] = dev::warp_inclusive_scan(sm.red[lane]);
  __syncthreads();
  const double end = (warp ? sm.red2[warp - 1] : 0.0) + incl;  // the prefix sum through this segment
  const double target = scale_by_total ? t * sm.red2[kWarps - 1] : t;
  double* ends = &sm.whist[0][0];
  ends[threadIdx.x] = end;
  if (threadIdx.x == 0) sm.sel = INT_MAX;
  // The last positive index of the row (the fallback); its reduction's barriers also publish ends and sel.
  const int last_any = int(static_cast<long long>(dev::block_max(static_cast<unsigned long long>(last + 1), sm.redu))) - 1;
  if (target < end) atomicMin(&sm.sel, int(threadIdx.x));
  __syncthreads();
  const int sel = sm.sel;
  if (int(threadIdx.x) == sel) {
    double cum = sel > 0 ? ends[sel - 1] : 0.0;  // <= target: thread sel - 1 did not claim
    int chosen = -1, last_pos = -1;
    for (int j0 = 0; j0 < seg && chosen < 0; j0 += kSegUnroll) {
      double w[kSegUnroll];
      segment_weights(j0, w);
#pragma unroll
      for (int u = 0; u < kSegUnroll; ++u) {
        if (w[u] > 0.0 && chosen < 0) {
          cum += w[u];
          last_pos = begin + j0 + u;
          if (target < cum) chosen = last_pos;
        }
      }
    }
    sm.sel_token = chosen >= 0 ? chosen : last_pos;
  }
  __syncthreads();
  int r = sel == INT_MAX ? -1 : sm.sel_token;
  if (r < 0) r = last_any;
  return r;
}

// logits: the previous kernel's output, so no __restrict__ (no non-coherent loads; see argmax_chunk_kernel).
__global__ void __launch_bounds__(kThreads) sample_rows_kernel(const float* logits, int64_t ld, int n,
                                                               const SampleRowArgs* __restrict__ rows,
                                                               int32_t* __restrict__ ids) {
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const SampleRowArgs a = rows[blockIdx.x];
  const float* row = logits + int64_t(blockIdx.x) * ld;

  if (a.temperature < 1e-6f) {  // greedy: the largest value, lowest id on ties (key: value above, ~id below)
    unsigned long long best = 0;
    for_row(row, n, 1.0f, [&](float x, int i, bool ok) {
      const unsigned long long k = ok ? dev::argmax_key(x, i) : 0ull;
      best = k > best ? k : best;
    });
    best = dev::block_max(best, sm.redu);
    if (threadIdx.x == 0)
      ids[blockIdx.x] = best != 0 && finite_value(key_value(unsigned(best >> 32)))
                            ? int32_t(0xffffffffu - unsigned(best & 0xffffffffu))
                            : -1;
    return;
  }

  const float inv = __fdiv_rn(1.0f, a.temperature);  // the host's 1.0f / temperature (x * 1 when it is 1)
  float mx = -INFINITY;
  for_row(row, n, inv, [&](float x, int, bool ok) {
    if (ok) mx = fmaxf(mx, x);  // NaN never wins
  });
  mx = dev::block_max(mx, sm.redf);
  if (!finite_value(mx)) {
    if (threadIdx.x == 0) ids[blockIdx.x] = -1;
    return;
  }
  const double m = mx;
  auto e_of = [m](float x) { return exp(double(x) - m); };

  // top-k: the candidates are the finite values >= the k-th largest (ties stay).
  uint32_t kth = 0;
  if (a.top_k > 0 && a.top_k < n) {
    radix_select<false>(
        row, n, inv, sm, double(a.top_k), [](float x, uint32_t, int) { return x == x; },
        [](float) { return 0.0; });
    kth = sm.prefix;
  }
  auto cand = [kth](float x, uint32_t k) { return x == x && x != -INFINITY && k >= kth; };

  // top-p: keep the keys above cut_key and, of the tokens at cut_key, the ids up to cut_id.
  uint32_t cut_key = 0;
  int cut_id = INT_MAX;
  if (a.top_p < 1.0f) {
    double s1 = 0.0;
    for_row(row, n, inv, [&](float x, int, bool ok) {
      if (ok && cand(x, order_key(x))) s1 += e_of(x);
    });
    s1 = dev::block_sum(s1, sm.red);
    const double target = double(a.top_p) * s1;
    radix_select<true>(
        row, n, inv, sm, target, [&](float x, uint32_t k, int) { return cand(x, k); }, e_of);
    if (sm.found) {
      cut_key = sm.prefix;
      const double above = sm.above;
      const int ties = int(sm.tie);
      // How many of the equal-probability tokens at the cut the sorted cumulative sum needs (the crossing one too),
      // in the host's arithmetic: p = e / s added one token at a time to the larger tokens' sum until it reaches
      // top_p. (Exactly the host's steps when that sum is exact, e.g. 0 for a tie of the largest logits: a row of
      // equal logits keeps exactly the host's number of tokens. The loop is as long as the tie, 1 for distinct
      // logits.)
      const double p = exp(double(key_value(cut_key)) - m) / s1;
      double cum = above / s1;
      int j = 0;
      while (j < ties) {
        cum += p;
        ++j;
        if (cum >= double(a.top_p)) break;
      }
      if (j < ties) {
        const uint32_t ck = cut_key;
        cut_id = select_ascending(row, n, inv, sm, false, double(j - 1), [&](float x, int) {
          const uint32_t k = order_key(x);
          return cand(x, k) && k == ck ? 1.0 : 0.0;
        });
      }
    }
  }
  auto survives = [&](float x, uint32_t k, int i) {
    return cand(x, k) && (k > cut_key || (k == cut_key && i <= cut_id));
  };

  // min-p: p = e / S over the top-p survivors; dropped when p < min_p * (1 / S) (the largest p: e = 1).
  const bool use_min_p = a.min_p > 0.0f;
  double s2 = 1.0, thr = 0.0;
  if (use_min_p) {
    double s = 0.0;
    for_row(row, n, inv, [&](float x, int i, bool ok) {
      if (ok && survives(x, order_key(x), i)) s += e_of(x);
    });
    s2 = dev::block_sum(s, sm.red);
    thr = double(a.min_p) * (1.0 / s2);
  }

  // The draw: the first survivor (ascending id) whose cumulative mass exceeds u * the survivors' mass.
  const int token = select_ascending(row, n, inv, sm, true, a.u, [&](float x, int i) -> double {
    if (!survives(x, order_key(x), i)) return 0.0;
    const double e = e_of(x);
    return use_min_p && e / s2 < thr ? 0.0 : e;
  });
  if (threadIdx.x == 0) ids[blockIdx.x] = token;
}

// ---- argmax over rows: a block per (row, chunk of kArgChunk values) keeps the best as one packed 64-bit key (ordered
// float bits above, ~index below: the larger value wins, ties go to the lower index; NaN never enters, key 0 means
// "none"), then a block per row reduces the chunks' keys.

constexpr int kArgChunk = 4096, kArgThreads = 256, kArgPer = kArgChunk / kArgThreads;

// grid (chunks, R): keys[r * chunks + c] = the best key of row r's chunk c.
// The logits are the previous kernel's output (the lm_head): read with coherent loads (__ldcg), never through the
// non-coherent path that a const __restrict__ pointer allows, which may be scheduled ahead of the PDL wait
// (launch.cuh: this kernel gave stale argmaxes in captured draft and verify chains).
__global__ void __launch_bounds__(kArgThreads) argmax_chunk_kernel(const float* logits, int64_t ld, int64_t V,
                                                                   uint64_t* __restrict__ keys) {
  dev::pdl_enter();  // first statement: see launch.cuh
  __shared__ unsigned long long red[32];
  const int64_t r = blockIdx.y, c = blockIdx.x;
  const float* row = logits + r * ld;
  const int64_t base = c * kArgChunk + threadIdx.x;
  float v[kArgPer];
#pragma unroll
  for (int u = 0; u < kArgPer; ++u) {  // every load issued before any compare (indices clamped, masked below)
    const int64_t i = base + int64_t(u) * kArgThreads;
    v[u] = __ldcg(row + (i < V ? i : V - 1));
  }
  unsigned long long best = 0;
#pragma unroll
  for (int u = 0; u < kArgPer; ++u) {
    const int64_t i = base + int64_t(u) * kArgThreads;
    const unsigned long long k = i < V ? dev::argmax_key(v[u], i) : 0;
    best = k > best ? k : best;
  }
  best = dev::block_max(best, red);
  if (threadIdx.x == 0) keys[r * gridDim.x + c] = best;
}

// values (optional): the best logit itself (NaN for a row without a number), for a tensor-parallel rank whose slice
// competes with the others'. ids get id_offset added (the row's own index still reads the value).
// keys and logits are earlier kernels' outputs: coherent loads, as in argmax_chunk_kernel.
__global__ void __launch_bounds__(kArgThreads) argmax_final_kernel(const uint64_t* keys, int chunks,
                                                                   int32_t* __restrict__ ids, const float* logits,
                                                                   int64_t ld, float* __restrict__ values,
                                                                   int32_t id_offset) {
  dev::pdl_enter();  // first statement: see launch.cuh
  __shared__ unsigned long long red[32];
  const int64_t r = blockIdx.x;
  unsigned long long best = 0;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const unsigned long long k = __ldcg(reinterpret_cast<const unsigned long long*>(keys) + r * chunks + c);
    best = k > best ? k : best;
  }
  best = dev::block_max(best, red);
  if (threadIdx.x == 0) {
    const int32_t id = best == 0 ? 0 : int32_t(0xffffffffu - uint32_t(best & 0xffffffffu));
    ids[r] = id + id_offset;
    if (values) values[r] = best == 0 ? __int_as_float(0x7fc00000) : __ldcg(logits + r * ld + id);
  }
}

}  // namespace

void sample_rows(const float* logits, int64_t ld, int64_t R, int64_t V, const SampleRowArgs* rows, int32_t* ids,
                 Stream stream) {
  if (R == 0) return;
  if (V <= 0 || V > (int64_t(1) << 30)) cuda_fail("sample_rows: vocabulary {} is not supported", {V});
  if (R > INT_MAX) cuda_fail("sample_rows: {} rows", {R});
  const size_t smem = sizeof(Smem);
  KILN_CUDA_CHECK(
      cudaFuncSetAttribute(sample_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  launch_kernel(sample_rows_kernel, dim3(static_cast<unsigned>(R)), dim3(kThreads), smem, stream, logits, ld,
                static_cast<int>(V), rows, ids);
}

size_t argmax_workspace_bytes(int64_t R, int64_t V) {
  return static_cast<size_t>(R * ((V + kArgChunk - 1) / kArgChunk)) * sizeof(uint64_t);
}

void argmax_rows(const float* logits, int64_t ld, int64_t R, int64_t V, int32_t* ids, void* work, Stream stream,
                 float* values, int32_t id_offset) {
  if (R == 0) return;
  if (V <= 0 || V > 0x7fffffff) cuda_fail("argmax: vocabulary {} is not supported", {V});
  const int64_t chunks = (V + kArgChunk - 1) / kArgChunk;
  uint64_t* keys = static_cast<uint64_t*>(work);
  for (int64_t r0 = 0; r0 < R; r0 += 65535) {  // grid.y limit
    const int64_t n = R - r0 < 65535 ? R - r0 : 65535;
    launch_kernel(argmax_chunk_kernel, dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(n)), kArgThreads, 0,
                  stream, logits + r0 * ld, ld, V, keys + r0 * chunks);
    launch_kernel(argmax_final_kernel, static_cast<unsigned>(n), kArgThreads, 0, stream, keys + r0 * chunks,
                  static_cast<int>(chunks), ids + r0, logits + r0 * ld, ld, values ? values + r0 : nullptr, id_offset);
  }
}


}  // namespace kiln::cuda::ops
