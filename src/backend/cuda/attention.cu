// Gated full attention, head_dim 256, over a paged KV cache (bf16 or F8_E4M3 with per-tensor scales).
//
// attention_prep: per token, zero-centred RMSNorm of q and k per head, partial RoPE (rotate_half),
// q to a contiguous buffer, k and v into their cache rows.
//
// attention: one flash-attention kernel (online softmax, mma.sync m16n8k16 bf16, fp32 accumulators).
// Its query rows pack GQA: a block serves one KV head and the rows (token, head-in-group), so K/V
// tiles are loaded once for all query heads that share them. Prefill: 4 warps (64 rows), 64-key
// tiles. Decode (q_len small): 1 warp (16 rows), 32-key tiles, the keys split over blocks (flash
// decoding), partial results merged by a combine kernel that also applies the output gate.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

using namespace dev;

constexpr int kHeadDim = 256;
constexpr int kRowChunks = kHeadDim * 2 / 16;  // 16-byte chunks per bf16 row

// ---------------------------------------------------------------------------------------------
// Prep: q/k norm, RoPE, cache write
// ---------------------------------------------------------------------------------------------
struct PrepParams {
  const uint16_t* q_proj;
  int64_t ld_q;
  const uint16_t* k_proj;
  int64_t ld_k;
  const uint16_t* v_proj;
  int64_t ld_v;
  const uint16_t* q_norm_w;
  const uint16_t* k_norm_w;
  const int32_t* positions;
  const int64_t* kv_slot;
  int n_heads, n_kv_heads, rotary_dim;
  float eps;
  void* k_cache;
  void* v_cache;
  bool fp8;
  float inv_k_scale, inv_v_scale;
  uint16_t* q_out;
  float inv_freq[kHeadDim / 2];
};

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// grid: T; block: 8 warps looping over the n_heads + 2 * n_kv_heads head vectors of the token.
__global__ void __launch_bounds__(256) attention_prep_kernel(const PrepParams p) {
  const int t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_vecs = p.n_heads + 2 * p.n_kv_heads;
  const float pos = float(p.positions[t]);
  const int64_t slot = p.kv_slot[t];
  for (int vi = warp; vi < n_vecs; vi += blockDim.x / 32) {
    const bool is_q = vi < p.n_heads;
    const bool is_k = !is_q && vi < p.n_heads + p.n_kv_heads;
    const int h = is_q ? vi : is_k ? vi - p.n_heads : vi - p.n_heads - p.n_kv_heads;
    const uint16_t* src = is_q ? p.q_proj + int64_t(t) * p.ld_q + int64_t(h) * 2 * kHeadDim
                          : is_k ? p.k_proj + int64_t(t) * p.ld_k + int64_t(h) * kHeadDim
                                 : p.v_proj + int64_t(t) * p.ld_v + int64_t(h) * kHeadDim;
    float x[8];
    {
      const uint4 v = *reinterpret_cast<const uint4*>(src + lane * 8);
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[2 * i] = bf16_lo(u[i]);
        x[2 * i + 1] = bf16_hi(u[i]);
      }
    }
    if (is_q || is_k) {
      float ss = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += x[i] * x[i];
      const float inv = rsqrtf(warp_sum(ss) / kHeadDim + p.eps);
      const uint4 wv = *reinterpret_cast<const uint4*>((is_q ? p.q_norm_w : p.k_norm_w) + lane * 8);
      const uint32_t wu[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[2 * i] = x[2 * i] * inv * (1.0f + bf16_lo(wu[i]));
        x[2 * i + 1] = x[2 * i + 1] * inv * (1.0f + bf16_hi(wu[i]));
      }
      // rotate_half over dims [0, R): d < R/2 pairs with d + R/2 (lane ^ R/16 holds the partner).
      const int half = p.rotary_dim / 2;
      const int partner_xor = p.rotary_dim / 16;
      float other[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) other[i] = __shfl_xor_sync(0xffffffffu, x[i], partner_xor);
      if (lane * 8 < p.rotary_dim) {
        const bool first_half = lane * 8 < half;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int d = lane * 8 + i;
          const int fi = first_half ? d : d - half;
          float sn, cs;
          sincosf(pos * p.inv_freq[fi], &sn, &cs);
          x[i] = first_half ? x[i] * cs - other[i] * sn : x[i] * cs + other[i] * sn;
        }
      }
    }
    if (is_q) {
      uint4 o;
      o.x = pack_bf16x2(x[0], x[1]);
      o.y = pack_bf16x2(x[2], x[3]);
      o.z = pack_bf16x2(x[4], x[5]);
      o.w = pack_bf16x2(x[6], x[7]);
      *reinterpret_cast<uint4*>(p.q_out + (int64_t(t) * p.n_heads + h) * kHeadDim + lane * 8) = o;
    } else {
      const int64_t off = (slot * p.n_kv_heads + h) * kHeadDim + lane * 8;
      void* cache = is_k ? p.k_cache : p.v_cache;
      if (p.fp8) {
        const float inv_s = is_k ? p.inv_k_scale : p.inv_v_scale;
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          lo |= uint32_t(to_e4m3(x[i] * inv_s)) << (8 * i);
          hi |= uint32_t(to_e4m3(x[4 + i] * inv_s)) << (8 * i);
        }
        *reinterpret_cast<uint2*>(static_cast<uint8_t*>(cache) + off) = make_uint2(lo, hi);
      } else {
        uint4 o;
        o.x = pack_bf16x2(x[0], x[1]);
        o.y = pack_bf16x2(x[2], x[3]);
        o.z = pack_bf16x2(x[4], x[5]);
        o.w = pack_bf16x2(x[6], x[7]);
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(cache) + off) = o;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Flash attention
// ---------------------------------------------------------------------------------------------
struct AttnParams {
  const uint16_t* q;
  const uint16_t* gate;
  int64_t gate_ts, gate_hs;
  uint16_t* out;
  const void* k_cache;
  const void* v_cache;
  int page_size, n_kv_heads, n_heads, group;
  float score_scale_log2;  // 1/sqrt(d) * log2(e) * k_scale
  float v_scale;
  const int32_t* q_start;
  const int32_t* pos0;
  const int32_t* page_table;
  int pt_stride;
  // Split-KV (decode): keys per split (0 = one split covering everything), workspace.
  int split_keys, max_splits;
  float* part_o;   // [S, nkv, max_splits, rows, 256]
  float* part_ml;  // [S, nkv, max_splits, rows, 2]
};

__device__ __forceinline__ int swz32(int row, int chunk) { return row * kRowChunks + (chunk ^ (row & 7)); }

// Loads key/value rows [key0, key0 + kKT) of one KV head into K_s / V_s (bf16, swizzled); rows at or
// past key_end are zero (so masked probabilities never multiply garbage).
template <int kThreads, int kKT, bool kFp8>
__device__ __forceinline__ void load_kv_tile(const AttnParams& p, const int32_t* pages, int kvh, int key0,
                                             int key_end, uint16_t* K_s, uint16_t* V_s) {
  if constexpr (!kFp8) {
    const uint32_t kb = smem_addr(K_s), vb = smem_addr(V_s);
    for (int i = threadIdx.x; i < kKT * kRowChunks; i += kThreads) {
      const int r = i / kRowChunks, c = i % kRowChunks;
      const int key = key0 + r;
      const bool ok = key < key_end;
      int64_t off = 0;
      if (ok) {
        const int64_t row = int64_t(pages[key / p.page_size]) * p.page_size + key % p.page_size;
        off = (row * p.n_kv_heads + kvh) * kHeadDim + c * 8;
      }
      cp_async_16(kb + swz32(r, c) * 16, static_cast<const uint16_t*>(p.k_cache) + off, ok ? 16 : 0);
      cp_async_16(vb + swz32(r, c) * 16, static_cast<const uint16_t*>(p.v_cache) + off, ok ? 16 : 0);
    }
    cp_async_commit();
  } else {
    // 16 fp8 codes per load -> two bf16 chunks (exact: e4m3 values are bf16 values).
    for (int i = threadIdx.x; i < kKT * kRowChunks / 2; i += kThreads) {
      const int r = i / (kRowChunks / 2), c = i % (kRowChunks / 2);
      const int key = key0 + r;
#pragma unroll
      for (int kv = 0; kv < 2; ++kv) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (key < key_end) {
          const int64_t row = int64_t(pages[key / p.page_size]) * p.page_size + key % p.page_size;
          const uint8_t* base = static_cast<const uint8_t*>(kv ? p.v_cache : p.k_cache);
          raw = *reinterpret_cast<const uint4*>(base + (row * p.n_kv_heads + kvh) * kHeadDim + c * 16);
        }
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t o[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
#pragma unroll
          for (int hx = 0; hx < 2; ++hx) {
            const __half2_raw h2 =
                __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * hx)), __NV_E4M3);
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
            o[2 * w + hx] = pack_bf16x2(f.x, f.y);
          }
        }
        uint16_t* dst = kv ? V_s : K_s;
        *reinterpret_cast<uint4*>(dst + swz32(r, 2 * c) * 8) = make_uint4(o[0], o[1], o[2], o[3]);
        *reinterpret_cast<uint4*>(dst + swz32(r, 2 * c + 1) * 8) = make_uint4(o[4], o[5], o[6], o[7]);
      }
    }
  }
}

// grid: (q_tiles * max_splits, n_kv_heads, num_seqs).
template <int kWarps, int kKT, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32) flash_attention_kernel(const AttnParams p) {
  constexpr int kRows = kWarps * 16;
  constexpr int kThreads = kWarps * 32;
  constexpr int kNT = kKT / 8;  // key n-tiles per tile
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint16_t* Q_s = reinterpret_cast<uint16_t*>(smem_raw);  // [kRows][256]
  uint16_t* K_s = Q_s + kRows * kHeadDim;                 // [kKT][256]
  uint16_t* V_s = K_s + kKT * kHeadDim;                   // [kKT][256]

  const int splits = p.split_keys ? p.max_splits : 1;
  const int qtile = blockIdx.x / splits, split = blockIdx.x % splits;
  const int kvh = blockIdx.y, seq = blockIdx.z;
  const int tokens_per_block = kRows / p.group;
  const int q_begin = p.q_start[seq], q_len = p.q_start[seq + 1] - q_begin;
  const int tok0 = qtile * tokens_per_block;
  if (tok0 >= q_len) return;
  const int pos_first = p.pos0[seq];
  const int kv_len = pos_first + q_len;
  const int last_tok = min(tok0 + tokens_per_block, q_len) - 1;
  int key_begin = 0, key_end = pos_first + last_tok + 1;  // causal bound of this block's last row
  if (p.split_keys) {
    key_begin = split * p.split_keys;
    if (key_begin >= kv_len) return;
    key_end = min(key_end, key_begin + p.split_keys);
  }
  const int32_t* pages = p.page_table + int64_t(seq) * p.pt_stride;

  // Q rows: (token tok0 + r / group, head kvh * group + r % group).
  {
    const uint32_t qb = smem_addr(Q_s);
    for (int i = threadIdx.x; i < kRows * kRowChunks; i += kThreads) {
      const int r = i / kRowChunks, c = i % kRowChunks;
      const int tt = tok0 + r / p.group;
      const bool ok = tt < q_len;
      const int head = kvh * p.group + r % p.group;
      const uint16_t* src = p.q + ((int64_t(q_begin) + (ok ? tt : 0)) * p.n_heads + head) * kHeadDim + c * 8;
      cp_async_16(qb + swz32(r, c) * 16, src, ok ? 16 : 0);
    }
    cp_async_commit();
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const int qpos0 = pos_first + tok0 + r0 / p.group;
  const int qpos1 = pos_first + tok0 + r1 / p.group;

  float o_acc[32][4];
#pragma unroll
  for (int i = 0; i < 32; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  const uint32_t q_base = smem_addr(Q_s), k_base = smem_addr(K_s), v_base = smem_addr(V_s);
  for (int key0 = key_begin; key0 < key_end; key0 += kKT) {
    load_kv_tile<kThreads, kKT, kFp8>(p, pages, kvh, key0, key_end, K_s, V_s);
    cp_async_wait<0>();
    __syncthreads();

    float s[kNT][4];
#pragma unroll
    for (int i = 0; i < kNT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      uint32_t qa[4];
      ldmatrix_x4(qa, q_base + swz32(warp * 16 + (lane % 16), ks * 2 + lane / 16) * 16);
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t kr[4];
        ldmatrix_x4(kr, k_base + swz32(np * 16 + (lane % 8) + (lane / 16) * 8, ks * 2 + (lane / 8) % 2) * 16);
        mma_bf16_16816(s[2 * np], qa, kr[0], kr[1]);
        mma_bf16_16816(s[2 * np + 1], qa, kr[2], kr[3]);
      }
    }

    // Mask, scale (log2 domain), online softmax.
    float tmax0 = -INFINITY, tmax1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int key = key0 + nt * 8 + 2 * q4 + (c & 1);
        const int qpos = c < 2 ? qpos0 : qpos1;
        const bool vis = key < key_end && key <= qpos;
        s[nt][c] = vis ? s[nt][c] * p.score_scale_log2 : -INFINITY;
        if (c < 2) tmax0 = fmaxf(tmax0, s[nt][c]);
        else tmax1 = fmaxf(tmax1, s[nt][c]);
      }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      tmax0 = fmaxf(tmax0, __shfl_xor_sync(0xffffffffu, tmax0, o));
      tmax1 = fmaxf(tmax1, __shfl_xor_sync(0xffffffffu, tmax1, o));
    }
    const float mn0 = fmaxf(m0, tmax0), mn1 = fmaxf(m1, tmax1);
    const float ref0 = mn0 == -INFINITY ? 0.0f : mn0, ref1 = mn1 == -INFINITY ? 0.0f : mn1;
    const float alpha0 = exp2f(m0 - ref0), alpha1 = exp2f(m1 - ref1);
    m0 = mn0;
    m1 = mn1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      s[nt][0] = exp2f(s[nt][0] - ref0);
      s[nt][1] = exp2f(s[nt][1] - ref0);
      s[nt][2] = exp2f(s[nt][2] - ref1);
      s[nt][3] = exp2f(s[nt][3] - ref1);
      rs0 += s[nt][0] + s[nt][1];
      rs1 += s[nt][2] + s[nt][3];
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
#pragma unroll
    for (int dt = 0; dt < 32; ++dt) {
      o_acc[dt][0] *= alpha0;
      o_acc[dt][1] *= alpha0;
      o_acc[dt][2] *= alpha1;
      o_acc[dt][3] *= alpha1;
    }

    // O += P V.
#pragma unroll
    for (int kk = 0; kk < kKT / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < 16; ++dp) {
        uint32_t vr[4];
        ldmatrix_x4_trans(vr, v_base + swz32(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, dp * 2 + lane / 16) * 16);
        mma_bf16_16816(o_acc[2 * dp], pa, vr[0], vr[1]);
        mma_bf16_16816(o_acc[2 * dp + 1], pa, vr[2], vr[3]);
      }
    }
    __syncthreads();  // K_s / V_s are overwritten by the next tile
  }

#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = hr ? r1 : r0;
    const int tt = tok0 + r / p.group;
    if (tt >= q_len) continue;
    const int head = kvh * p.group + r % p.group;
    const float l = hr ? l1 : l0, m = hr ? m1 : m0;
    if (p.split_keys) {
      const int64_t part = ((int64_t(seq) * p.n_kv_heads + kvh) * p.max_splits + split) * kRows + r;
      float* po = p.part_o + part * kHeadDim;
#pragma unroll
      for (int dt = 0; dt < 32; ++dt)
        *reinterpret_cast<float2*>(po + dt * 8 + 2 * q4) = make_float2(o_acc[dt][2 * hr], o_acc[dt][2 * hr + 1]);
      if (q4 == 0) *reinterpret_cast<float2*>(p.part_ml + part * 2) = make_float2(m, l);
    } else {
      const int64_t t = int64_t(q_begin) + tt;
      const float inv = p.v_scale / l;
      const uint16_t* gp = p.gate + t * p.gate_ts + int64_t(head) * p.gate_hs;
      uint16_t* op = p.out + (t * p.n_heads + head) * kHeadDim;
#pragma unroll
      for (int dt = 0; dt < 32; ++dt) {
        const int d = dt * 8 + 2 * q4;
        const uint32_t gv = *reinterpret_cast<const uint32_t*>(gp + d);
        *reinterpret_cast<uint32_t*>(op + d) = pack_bf16x2(o_acc[dt][2 * hr] * inv * sigmoid(bf16_lo(gv)),
                                                           o_acc[dt][2 * hr + 1] * inv * sigmoid(bf16_hi(gv)));
      }
    }
  }
}

constexpr int kDecodeWarps = 1, kDecodeKT = 32, kDecodeRows = kDecodeWarps * 16;
constexpr int kPrefillWarps = 4, kPrefillKT = 64, kPrefillRows = kPrefillWarps * 16;

// Merges the split-KV partial results. grid: (16 rows, n_kv_heads, num_seqs); thread = one of 256 dims.
__global__ void split_combine_kernel(const AttnParams p) {
  const int r = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const int q_begin = p.q_start[seq], q_len = p.q_start[seq + 1] - q_begin;
  const int tt = r / p.group;
  if (tt >= q_len) return;
  const int kv_len = p.pos0[seq] + q_len;
  const int n_splits = (kv_len + p.split_keys - 1) / p.split_keys;
  const int64_t base = (int64_t(seq) * p.n_kv_heads + kvh) * p.max_splits;
  float M = -INFINITY;
  for (int s = 0; s < n_splits; ++s) M = fmaxf(M, p.part_ml[((base + s) * kDecodeRows + r) * 2]);
  float L = 0.0f, acc = 0.0f;
  const int d = threadIdx.x;
  for (int s = 0; s < n_splits; ++s) {
    const int64_t part = (base + s) * kDecodeRows + r;
    const float m = p.part_ml[part * 2], l = p.part_ml[part * 2 + 1];
    const float w = m == -INFINITY ? 0.0f : exp2f(m - M);
    L += w * l;
    acc += w * p.part_o[part * kHeadDim + d];
  }
  const int head = kvh * p.group + r % p.group;
  const int64_t t = int64_t(q_begin) + tt;
  const float gv = bf16_bits_to_f32(p.gate[t * p.gate_ts + int64_t(head) * p.gate_hs + d]);
  p.out[(t * p.n_heads + head) * kHeadDim + d] =
      __bfloat16_as_ushort(__float2bfloat16_rn(acc * p.v_scale / L * sigmoid(gv)));
}

struct SplitPlan {
  bool use_split = false;
  int split_keys = 0, max_splits = 1;
};

SplitPlan plan_splits(const AttnBatch& b, int n_heads, const KvCache& c) {
  SplitPlan sp;
  const int group = n_heads / c.n_kv_heads;
  if (b.max_q_len * group > kDecodeRows) return sp;  // prefill path
  sp.use_split = true;
  const int target_blocks = 2 * 132;
  const int per_head = std::max(1, b.num_seqs * c.n_kv_heads);
  int splits = std::max(1, (target_blocks + per_head - 1) / per_head);
  const int max_tiles = std::max(1, (b.max_kv_len + kDecodeKT - 1) / kDecodeKT);
  splits = std::min(splits, max_tiles);
  const int keys = (b.max_kv_len + splits - 1) / splits;
  sp.split_keys = std::max(kDecodeKT, (keys + kDecodeKT - 1) / kDecodeKT * kDecodeKT);
  sp.max_splits = (b.max_kv_len + sp.split_keys - 1) / sp.split_keys;
  return sp;
}

template <int kWarps, int kKT, bool kFp8>
void launch_flash(const AttnParams& p, dim3 grid, Stream stream) {
  constexpr int smem = (kWarps * 16 + 2 * kKT) * kHeadDim * 2;
  static const bool attr_set = [] {
    KILN_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_kernel<kWarps, kKT, kFp8>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)attr_set;
  flash_attention_kernel<kWarps, kKT, kFp8><<<grid, kWarps * 32, smem, stream>>>(p);
  KILN_CUDA_CHECK_LAUNCH();
}

void check_cache(const KvCache& c, int n_heads) {
  if (c.head_dim != kHeadDim) cuda_fail("attention: head_dim {} is not supported (only 256)", {c.head_dim});
  if (c.n_kv_heads <= 0 || n_heads % c.n_kv_heads != 0)
    cuda_fail("attention: {} query heads do not group evenly over {} KV heads", {n_heads, c.n_kv_heads});
  const int group = n_heads / c.n_kv_heads;
  if (kPrefillRows % group != 0) cuda_fail("attention: GQA group size {} is not supported (must divide 64)", {group});
  if (c.page_size <= 0) cuda_fail("attention: page size must be positive (got {})", {c.page_size});
}

}  // namespace

void attention_prep(const uint16_t* q_proj, int64_t ld_q, const uint16_t* k_proj, int64_t ld_k,
                    const uint16_t* v_proj, int64_t ld_v, const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                    const int32_t* positions, const int64_t* kv_slot, int T, int n_heads, float rope_theta,
                    int rotary_dim, float eps, const KvCache& cache, uint16_t* q_out, Stream stream) {
  if (T <= 0) return;
  check_cache(cache, n_heads);
  if (rotary_dim < 16 || rotary_dim > kHeadDim || (rotary_dim & (rotary_dim - 1)) != 0)
    cuda_fail("attention_prep: rotary_dim {} not supported (a power of two in [16, 256])", {rotary_dim});
  PrepParams p{};
  p.q_proj = q_proj;
  p.ld_q = ld_q;
  p.k_proj = k_proj;
  p.ld_k = ld_k;
  p.v_proj = v_proj;
  p.ld_v = ld_v;
  p.q_norm_w = q_norm_w;
  p.k_norm_w = k_norm_w;
  p.positions = positions;
  p.kv_slot = kv_slot;
  p.n_heads = n_heads;
  p.n_kv_heads = cache.n_kv_heads;
  p.rotary_dim = rotary_dim;
  p.eps = eps;
  p.k_cache = cache.k;
  p.v_cache = cache.v;
  p.fp8 = cache.fp8;
  p.inv_k_scale = 1.0f / cache.k_scale;
  p.inv_v_scale = 1.0f / cache.v_scale;
  p.q_out = q_out;
  // inv_freq as the reference model computes it: fp32 of theta^(-2i/R).
  for (int i = 0; i < rotary_dim / 2; ++i)
    p.inv_freq[i] = static_cast<float>(1.0 / std::pow(double(rope_theta), double(2 * i) / rotary_dim));
  attention_prep_kernel<<<T, 256, 0, stream>>>(p);
  KILN_CUDA_CHECK_LAUNCH();
}

size_t attention_workspace_bytes(const AttnBatch& b, int n_heads, const KvCache& c) {
  const SplitPlan sp = plan_splits(b, n_heads, c);
  if (!sp.use_split) return 0;
  return size_t(b.num_seqs) * c.n_kv_heads * sp.max_splits * kDecodeRows * (kHeadDim + 2) * sizeof(float);
}

void attention(const uint16_t* q, const uint16_t* gate, int64_t gate_ts, int64_t gate_hs, const AttnBatch& b,
               int n_heads, const KvCache& c, uint16_t* out, void* workspace, Stream stream) {
  if (b.num_seqs <= 0 || b.max_q_len <= 0) return;
  check_cache(c, n_heads);
  AttnParams p{};
  p.q = q;
  p.gate = gate;
  p.gate_ts = gate_ts;
  p.gate_hs = gate_hs;
  p.out = out;
  p.k_cache = c.k;
  p.v_cache = c.v;
  p.page_size = c.page_size;
  p.n_kv_heads = c.n_kv_heads;
  p.n_heads = n_heads;
  p.group = n_heads / c.n_kv_heads;
  p.score_scale_log2 = (1.0f / std::sqrt(float(kHeadDim))) * 1.4426950408889634f * (c.fp8 ? c.k_scale : 1.0f);
  p.v_scale = c.fp8 ? c.v_scale : 1.0f;
  p.q_start = b.q_start;
  p.pos0 = b.pos0;
  p.page_table = b.page_table;
  p.pt_stride = b.page_table_stride;
  const SplitPlan sp = plan_splits(b, n_heads, c);
  if (sp.use_split) {
    if (!workspace) cuda_fail("attention: decode needs a workspace of attention_workspace_bytes() bytes");
    p.split_keys = sp.split_keys;
    p.max_splits = sp.max_splits;
    p.part_o = static_cast<float*>(workspace);
    p.part_ml = p.part_o + size_t(b.num_seqs) * c.n_kv_heads * sp.max_splits * kDecodeRows * kHeadDim;
    const dim3 grid(sp.max_splits, c.n_kv_heads, b.num_seqs);  // one q tile: max_q_len * group <= 16
    if (c.fp8) launch_flash<kDecodeWarps, kDecodeKT, true>(p, grid, stream);
    else launch_flash<kDecodeWarps, kDecodeKT, false>(p, grid, stream);
    split_combine_kernel<<<dim3(kDecodeRows, c.n_kv_heads, b.num_seqs), kHeadDim, 0, stream>>>(p);
    KILN_CUDA_CHECK_LAUNCH();
  } else {
    const int tokens_per_block = kPrefillRows / p.group;
    const dim3 grid((b.max_q_len + tokens_per_block - 1) / tokens_per_block, c.n_kv_heads, b.num_seqs);
    if (c.fp8) launch_flash<kPrefillWarps, kPrefillKT, true>(p, grid, stream);
    else launch_flash<kPrefillWarps, kPrefillKT, false>(p, grid, stream);
  }
}

}  // namespace kiln::cuda
