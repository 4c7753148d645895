// Causal GQA attention over the paged KV pool for prefill-shaped steps (the contract: kernels.h).
//
// A block takes 64 consecutive query rows of ONE sequence and ONE KV head, rows being the sequence's (token, query
// head of the group) pairs flattened token-major (row = token * G + head, G = q_heads / kv_heads): 64 / G tokens x
// G heads when G divides 64, rows straddling tokens otherwise. It streams that KV head's keys 0 .. (largest position
// of its rows) through shared memory in tiles of kKeys keys (64; 32 at head_dim 256, for registers), and every tile
// serves all 64 rows. 4 warps, 16 rows each:
//   S = Q K^T     mma.sync m16n8k16 (bf16 in, fp32 accumulate), Q from shared memory, K tile by ldmatrix;
//   online softmax per row in fp32 (running max, running sum, accurate expf), causal mask per row;
//   O += P V      P from the S accumulators (registers), V tile by ldmatrix.trans; O in fp32 registers.
// q and p enter the MMAs in kParts bf16 parts, each part with the same K / V fragment; K and V are exact in bf16 (bf16
// pools as stored; e4m3 codes decoded to bf16 exactly, the k / v scales applied to the fp32 scores / outputs).
// kParts 3 (--dtype float32): x = hi + mid + lo (~24 significant bits), so the result matches the fp32 kernels up to
// summation order. kParts 1 (--dtype bfloat16): q and p rounded once to bf16 (relative error <= 2^-8 each; the
// softmax denominator l sums the fp32 p), a third of the MMAs and of q's shared memory.
//
// Tiles travel global -> shared by cp.async (zero-filled for keys past the block's range or without a page, which are
// also masked): V of tile i loads while S of tile i is computed, K of tile i + 1 while P V of tile i is. e4m3 tiles
// land as codes in a staging area and are decoded to the bf16 tile in shared memory. The pool rows of a tile's keys
// (page table lookups) are computed one tile ahead, into a double-buffered table in shared memory.
//
// Shared memory (bytes): q kParts x 64 x (2D + 16), K and V tiles kKeys x (2D + 16) each (rows padded by 16 bytes so
// the 8 rows of an ldmatrix hit distinct banks), e4m3 staging 2 x kKeys x D, small tables. With 3 parts: D = 256:
// 135,696 (bf16) / 152,080 (e4m3); D = 128: 87,824 / 104,208; D = 64: 46,864 / 55,056 (one block of 128 threads per
// SM at D = 256, two at D = 128). With 1 part, 2 x 64 x (2D + 16) bytes less (D = 256: 68,112 / 84,496).
//
// Grid: x = kv_heads x (row chunks of the longest sequence), heaviest chunks (latest positions) first; y = sequences.
// Blocks past the end of a shorter sequence exit at once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ptx.cuh"

namespace kiln::cuda::ops {
namespace {

constexpr int kRows = 64;  // query rows per block
constexpr int kWarps = 4;  // 16 rows each
constexpr int kThreads = kWarps * 32;

// kElem: 1 bf16, 3 e4m3 (ElemType values); kParts: bf16 parts of q and p (3 or 1).
template <int D, int kElem, int kParts>
struct PrefillSmem {
  // Keys per tile: 64, or 32 at D = 256 (the 128 fp32 O accumulators of a lane leave no room for 32 S ones).
  static constexpr int kKeys = D == 256 ? 32 : 64;
  static constexpr int kElemBytes = kElem == 3 ? 1 : 2;
  static constexpr int kRowBytes = 2 * D + 16;  // a bf16 row of q / K / V, padded
  static constexpr int kQPart = kRows * kRowBytes;
  static constexpr int kTile = kKeys * kRowBytes;
  static constexpr int kRawTile = kElem == 3 ? kKeys * D : 0;  // e4m3 codes as copied
  static constexpr int q = 0;                                   // [kParts][kRows][kRowBytes]
  static constexpr int k = q + kParts * kQPart;                 // [kKeys][kRowBytes]
  static constexpr int v = k + kTile;
  static constexpr int k_raw = v + kTile;                       // [kKeys][D] codes (e4m3)
  static constexpr int v_raw = k_raw + kRawTile;
  static constexpr int krow = v_raw + kRawTile;                 // int [2][kKeys]: pool row of each key, -1 = masked
  static constexpr int pos = krow + 2 * kKeys * 4;              // int [kRows]: position of each row, -1 = no row
  static constexpr int red = pos + kRows * 4;                   // int [kWarps]
  static constexpr int bytes = red + kWarps * 4;
  static_assert(D % 64 == 0 && D <= 256, "head_dim 64, 128 or 256");
};

using dev::pack_bf16x2;
__device__ __forceinline__ float bf16x2_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// (x0, x1) as kParts bf16x2, largest first: 3: hi + mid + lo (each residual is exact in fp32); 1: x rounded to bf16.
template <int kParts>
__device__ __forceinline__ void split_parts(float x0, float x1, uint32_t (&p)[kParts]) {
#pragma unroll
  for (int i = 0; i < kParts; ++i) {
    p[i] = pack_bf16x2(x0, x1);
    if (i + 1 < kParts) {
      x0 -= bf16x2_lo(p[i]);
      x1 -= bf16x2_hi(p[i]);
    }
  }
}

// Two e4m3 codes (low byte first) -> bf16x2, exact (e4m3 -> f16 -> f32 -> bf16 loses nothing; NaN stays NaN).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t codes) {
  const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes & 0xffffu), __NV_E4M3);
  const float2 f = __half22float2(__half2(hr));
  return pack_bf16x2(f.x, f.y);
}

// Pool row of key (position) j of sequence s, or -1 (masked, zero-filled) when j >= n_keys or j has no page. The page
// table load is unconditional (index clamped).
__device__ __forceinline__ int key_row(const StepArgs& step, int s, int j, int n_keys) {
  const int pi = j / step.page_size;
  const int pic = pi < step.max_pages ? pi : step.max_pages - 1;
  const int page = step.page_table[int64_t(s) * step.max_pages + pic];
  const bool ok = j < n_keys && pi < step.max_pages && page >= 0;
  return ok ? page * step.page_size + (j - pi * step.page_size) : -1;
}

// cp.async of one tile of keys (rows from `krow`) of one KV head: bf16 rows straight into the padded tile, e4m3 codes
// into the [kKeys][D] staging area.
template <int D, int kElem>
__device__ __forceinline__ void issue_tile(const char* head, int row_bytes, const int* krow, uint32_t dst, int tid) {
  using L = PrefillSmem<D, kElem, 1>;  // tile sizes (the parts only size q)
  constexpr int kChunks = D * L::kElemBytes / 16;  // 16-byte chunks per key row
  constexpr int kDstRow = kElem == 3 ? D : L::kRowBytes;
  constexpr int kKeys = L::kKeys;
  static_assert(kKeys * kChunks % kThreads == 0, "tile chunks over the block");
#pragma unroll 1
  for (int u = 0; u < kKeys * kChunks / kThreads; ++u) {
    const int idx = tid + u * kThreads;
    const int key = idx / kChunks, c = idx % kChunks;
    const int row = krow[key];
    const char* src = head + int64_t(row < 0 ? 0 : row) * row_bytes + c * 16;
    ptx::cp_async_16(dst + key * kDstRow + c * 16, src, row < 0 ? 0 : 16);
  }
}

// e4m3 staging [kKeys][D] codes -> bf16 tile [kKeys][kRowBytes].
template <int D>
__device__ __forceinline__ void decode_tile(const unsigned char* raw, unsigned char* tile, int tid) {
  constexpr int kRowBytes = PrefillSmem<D, 3, 1>::kRowBytes;
  constexpr int kKeys = PrefillSmem<D, 3, 1>::kKeys;
  constexpr int kChunks = D / 16;  // 16 codes each
#pragma unroll 1
  for (int u = 0; u < kKeys * kChunks / kThreads; ++u) {
    const int idx = tid + u * kThreads;
    const int key = idx / kChunks, c = idx % kChunks;
    const uint4 w = *reinterpret_cast<const uint4*>(raw + key * D + c * 16);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = e4m3x2_to_bf16x2(words[i]);
      o[2 * i + 1] = e4m3x2_to_bf16x2(words[i] >> 16);
    }
    uint4* dst = reinterpret_cast<uint4*>(tile + key * kRowBytes + c * 32);
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

// The block's work (see the top of the file).
template <int D, int kElem, int kParts>
__device__ __forceinline__ void prefill_block(const float* __restrict__ q, int q_heads, const KvPoolArgs& pool,
                                              const StepArgs& step, float scale, int chunks, float* __restrict__ out) {
  using L = PrefillSmem<D, kElem, kParts>;
  constexpr int kRowBytes = L::kRowBytes;
  constexpr int kKeys = L::kKeys;
  extern __shared__ __align__(16) unsigned char smem[];
  int* s_krow = reinterpret_cast<int*>(smem + L::krow);
  int* s_pos = reinterpret_cast<int*>(smem + L::pos);
  int* s_red = reinterpret_cast<int*>(smem + L::red);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kvh = static_cast<int>(blockIdx.x % pool.kv_heads);
  const int chunk = chunks - 1 - static_cast<int>(blockIdx.x / pool.kv_heads);
  const int s = blockIdx.y;
  const int G = q_heads / pool.kv_heads;
  const int tok0 = step.seq_token_begin[s];
  const int seq_len = step.seq_token_begin[s + 1] - tok0;
  const int row0 = chunk * kRows;  // first (token, head) row of the block within the sequence
  if (row0 >= seq_len * G) return;

  // Positions of the block's rows (-1: past the sequence) and their maximum: the block reads keys 0 .. max.
  if (tid < kRows) {
    const int rr = row0 + tid;
    const int tok = rr / G;
    const bool ok = tok < seq_len;
    const int p = step.token_pos[tok0 + (ok ? tok : 0)];
    int m = ok ? p : -1;
    s_pos[tid] = m;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) s_red[warp] = m;
  }
  // q rows -> kParts bf16 parts in shared memory (rows past the sequence: zeros).
  {
    constexpr int kC4 = D / 4;
    for (int i = tid; i < kRows * kC4; i += kThreads) {
      const int r = i / kC4, c4 = i % kC4;
      const int rr = row0 + r;
      const int tok = rr / G, g = rr - tok * G;
      const bool ok = tok < seq_len;
      const int64_t t = tok0 + (ok ? tok : 0);
      float4 x = *reinterpret_cast<const float4*>(q + (t * q_heads + int64_t(kvh) * G + g) * D + c4 * 4);
      if (!ok) x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      uint32_t p0[kParts], p1[kParts];
      split_parts<kParts>(x.x, x.y, p0);
      split_parts<kParts>(x.z, x.w, p1);
#pragma unroll
      for (int part = 0; part < kParts; ++part)
        *reinterpret_cast<uint2*>(smem + L::q + part * L::kQPart + r * kRowBytes + c4 * 8) =
            make_uint2(p0[part], p1[part]);
    }
  }
  __syncthreads();
  const int n_keys = max(s_red[0], s_red[1]) + 1;  // >= 1: the block's first row exists
  const int n_tiles = (n_keys + kKeys - 1) / kKeys;
  if (tid < kKeys) s_krow[tid] = key_row(step, s, tid, n_keys);
  __syncthreads();

  // This KV head's part of pool row 0, and the bytes from one pool row to the next.
  const int row_bytes = pool.kv_heads * D * L::kElemBytes;
  const char* k_head = static_cast<const char*>(pool.k) + int64_t(kvh) * D * L::kElemBytes;
  const char* v_head = static_cast<const char*>(pool.v) + int64_t(kvh) * D * L::kElemBytes;
  const uint32_t sbase = ptx::smem_addr(smem);
  const uint32_t k_dst = sbase + (kElem == 3 ? L::k_raw : L::k);
  const uint32_t v_dst = sbase + (kElem == 3 ? L::v_raw : L::v);
  issue_tile<D, kElem>(k_head, row_bytes, s_krow, k_dst, tid);
  ptx::cp_async_commit();

  // ldmatrix lane addresses. A (q rows): row lane % 16, dims + 8 (lane / 16). B of S (K, [key][dim]): key lane % 8 +
  // 8 (lane / 16), dims + 8 ((lane / 8) % 2). B of O (V, [key][dim], transposed): key lane % 8 + 8 ((lane / 8) % 2),
  // dims + 8 (lane / 16).
  const uint32_t q_addr = sbase + L::q + (warp * 16 + (lane & 15)) * kRowBytes + (lane >> 4) * 16;
  const uint32_t k_addr = sbase + L::k + ((lane & 7) + (lane >> 4) * 8) * kRowBytes + ((lane >> 3) & 1) * 16;
  const uint32_t v_addr = sbase + L::v + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;

  const float k_mul = kElem == 3 ? scale * pool.k_scale : scale;
  const float v_mul = kElem == 3 ? pool.v_scale : 1.0f;
  float o_acc[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // rows g, g + 8 (l: this lane's columns)

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int* krow_t = s_krow + (tile & 1) * kKeys;
    // The next tile's pool rows (stored below, after this tile's last use of the other buffer).
    const int next_row = tid < kKeys ? key_row(step, s, (tile + 1) * kKeys + tid, n_keys) : -1;

    ptx::cp_async_wait_all();  // K of this tile
    __syncthreads();      // ... visible to all; every warp is done with the V tile (previous P V)
    issue_tile<D, kElem>(v_head, row_bytes, krow_t, v_dst, tid);
    ptx::cp_async_commit();
    if constexpr (kElem == 3) {
      decode_tile<D>(smem + L::k_raw, smem + L::k, tid);
      __syncthreads();
    }

    // S = Q K^T: 16 rows x kKeys keys per warp (n-tiles of 8 keys).
    float s_acc[kKeys / 8][4];
#pragma unroll
    for (int i = 0; i < kKeys / 8; ++i) s_acc[i][0] = s_acc[i][1] = s_acc[i][2] = s_acc[i][3] = 0.0f;
#pragma unroll 1
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[kParts][4];
#pragma unroll
      for (int part = 0; part < kParts; ++part) ptx::ldmatrix_x4(a[part], q_addr + part * L::kQPart + ks * 32);
#pragma unroll
      for (int kp = 0; kp < kKeys / 16; ++kp) {
        uint32_t b[4];
        ptx::ldmatrix_x4(b, k_addr + kp * 16 * kRowBytes + ks * 32);
#pragma unroll
        for (int part = kParts - 1; part >= 0; --part) {
          ptx::mma_bf16_16816(s_acc[2 * kp], a[part], b[0], b[1]);
          ptx::mma_bf16_16816(s_acc[2 * kp + 1], a[part], b[2], b[3]);
        }
      }
    }

    // Mask (key without a row, or after the query's position), online softmax.
    const int j0 = tile * kKeys;
    const int pos0 = s_pos[warp * 16 + (lane >> 2)], pos1 = s_pos[warp * 16 + (lane >> 2) + 8];
    float t_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
      const int kl = nt * 8 + 2 * (lane & 3);
      const int2 rows = *reinterpret_cast<const int2*>(krow_t + kl);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + kl + (e & 1);
        const bool ok = ((e & 1) ? rows.y : rows.x) >= 0 && j <= ((e >> 1) ? pos1 : pos0);
        const float sv = ok ? s_acc[nt][e] * k_mul : -INFINITY;
        s_acc[nt][e] = sv;
        t_max[e >> 1] = fmaxf(t_max[e >> 1], sv);
      }
    }
    float base[2], corr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      t_max[r] = fmaxf(t_max[r], __shfl_xor_sync(0xffffffffu, t_max[r], 1));
      t_max[r] = fmaxf(t_max[r], __shfl_xor_sync(0xffffffffu, t_max[r], 2));
      const float m_new = fmaxf(m_run[r], t_max[r]);
      base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row without keys so far: every p is 0
      corr[r] = expf(m_run[r] - base[r]);
      m_run[r] = m_new;
      l_run[r] *= corr[r];
    }
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {  // a running max moved (rare after a few tiles)
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        o_acc[i][0] *= corr[0];
        o_acc[i][1] *= corr[0];
        o_acc[i][2] *= corr[1];
        o_acc[i][3] *= corr[1];
      }
    }
    if (tid < kKeys) s_krow[((tile + 1) & 1) * kKeys + tid] = next_row;

    ptx::cp_async_wait_all();  // V of this tile
    __syncthreads();      // ... visible to all; every warp is done with the K tile; next rows visible
    if (tile + 1 < n_tiles) {
      issue_tile<D, kElem>(k_head, row_bytes, s_krow + ((tile + 1) & 1) * kKeys, k_dst, tid);
      ptx::cp_async_commit();
    }
    if constexpr (kElem == 3) {
      decode_tile<D>(smem + L::v_raw, smem + L::v, tid);
      __syncthreads();
    }

    // O += P V, p = exp(s - base) (summed into l): the S accumulators of n-tiles 2kk, 2kk + 1 are the A fragment of
    // keys [16kk, 16kk + 16).
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = expf(s_acc[2 * kk + h][e] - base[e >> 1]);
          s_acc[2 * kk + h][e] = p;
          l_run[e >> 1] += p;
        }
      uint32_t a[kParts][4], pp[4][kParts];
      split_parts<kParts>(s_acc[2 * kk][0], s_acc[2 * kk][1], pp[0]);
      split_parts<kParts>(s_acc[2 * kk][2], s_acc[2 * kk][3], pp[1]);
      split_parts<kParts>(s_acc[2 * kk + 1][0], s_acc[2 * kk + 1][1], pp[2]);
      split_parts<kParts>(s_acc[2 * kk + 1][2], s_acc[2 * kk + 1][3], pp[3]);
#pragma unroll
      for (int part = 0; part < kParts; ++part)
#pragma unroll
        for (int f = 0; f < 4; ++f) a[part][f] = pp[f][part];
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t b[4];
        ptx::ldmatrix_x4_trans(b, v_addr + kk * 16 * kRowBytes + np * 32);
#pragma unroll
        for (int part = kParts - 1; part >= 0; --part) {
          ptx::mma_bf16_16816(o_acc[2 * np], a[part], b[0], b[1]);
          ptx::mma_bf16_16816(o_acc[2 * np + 1], a[part], b[2], b[3]);
        }
      }
    }
  }

  // out = O / l (a row without keys: 0), rows g and g + 8 of the warp.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int rr = row0 + warp * 16 + (lane >> 2) + 8 * r;
    const int tok = rr / G, g = rr - tok * G;
    if (tok >= seq_len) continue;
    const float inv = l_run[r] > 0.0f ? v_mul / l_run[r] : 0.0f;
    float* o = out + ((int64_t(tok0) + tok) * q_heads + int64_t(kvh) * G + g) * D + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<float2*>(o + i * 8) = make_float2(o_acc[i][2 * r] * inv, o_acc[i][2 * r + 1] * inv);
  }
}

// Shared memory per block of the architecture being compiled: 99 KB on the sm_120 family, where the kernels above it
// are not built (the launcher never picks them: max_smem_optin), 227 KB on sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kArchMaxSmem = 101376;
#else
constexpr int kArchMaxSmem = 232448;
#endif

template <int D, int kElem, int kParts>
__global__ void __launch_bounds__(kThreads, 1)
    attention_prefill_kernel(const float* __restrict__ q, int q_heads, KvPoolArgs pool, StepArgs step, float scale,
                             int chunks, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  static_assert(PrefillSmem<D, kElem, kParts>::kElemBytes == (kElem == 3 ? 1 : 2), "bf16 or e4m3 pools");
  if constexpr (PrefillSmem<D, kElem, kParts>::bytes > kArchMaxSmem)
    __trap();
  else
    prefill_block<D, kElem, kParts>(q, q_heads, pool, step, scale, chunks, out);
}

// The device's opt-in shared memory per block (cached per device).
int max_smem_optin(int device) {
  static std::atomic<int> cache[64] = {};
  if (device >= 0 && device < 64) {
    const int c = cache[device].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int v = 0;
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (device >= 0 && device < 64) cache[device].store(v, std::memory_order_relaxed);
  return v;
}

template <int D, int kElem, int kParts>
bool launch_prefill(const float* q, int q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale,
                    float* out, Stream stream) {
  using L = PrefillSmem<D, kElem, kParts>;
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  if (L::bytes > max_smem_optin(device)) return false;
  // The dynamic shared memory limit, once per device (per instantiation).
  static std::atomic<uint64_t> configured{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (!bit || !(configured.load(std::memory_order_acquire) & bit)) {
    KILN_CUDA_CHECK(
        cudaFuncSetAttribute(attention_prefill_kernel<D, kElem, kParts>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             L::bytes));
    configured.fetch_or(bit, std::memory_order_release);
  }
  const int G = q_heads / pool.kv_heads;
  const int64_t chunks = (int64_t(step.max_seq_tokens) * G + kRows - 1) / kRows;
  const int64_t blocks_x = chunks * pool.kv_heads;
  if (blocks_x > 0x7fffffff) return false;
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(step.num_seqs));
  launch_kernel(attention_prefill_kernel<D, kElem, kParts>, grid, dim3(kThreads), static_cast<size_t>(L::bytes), stream,
                q, q_heads, pool, step, scale, static_cast<int>(chunks), out);
  return true;
}

template <int D, int kParts>
bool launch_prefill_elem(const float* q, int q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale,
                         float* out, Stream stream) {
  switch (pool.elem) {
    case ElemType::bf16: return launch_prefill<D, 1, kParts>(q, q_heads, pool, step, scale, out, stream);
    case ElemType::e4m3: return launch_prefill<D, 3, kParts>(q, q_heads, pool, step, scale, out, stream);
    default: return false;
  }
}

template <int kParts>
bool launch_prefill_dim(const float* q, int q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale,
                        float* out, Stream stream) {
  switch (pool.head_dim) {
    case 64: return launch_prefill_elem<64, kParts>(q, q_heads, pool, step, scale, out, stream);
    case 128: return launch_prefill_elem<128, kParts>(q, q_heads, pool, step, scale, out, stream);
    case 256: return launch_prefill_elem<256, kParts>(q, q_heads, pool, step, scale, out, stream);
    default: return false;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool attention_prefill(const float* q, int64_t q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale,
                       float* out, Stream stream, int mma_parts) {
  if (mma_parts != kMmaPartsFp32 && mma_parts != kMmaPartsBf16)
    cuda_fail("attention_prefill: {} bf16 parts (1 or 3)", {mma_parts});
  if (step.max_seq_tokens < kAttentionPrefillMinTokens || step.num_tokens <= 0 || step.num_seqs <= 0 ||
      step.num_seqs > 65535 || step.page_size <= 0 || step.max_pages <= 0)
    return false;
  if (pool.kv_heads <= 0 || q_heads <= 0 || q_heads % pool.kv_heads != 0 || q_heads > (int64_t{1} << 20)) return false;
  if (!aligned16(q) || !aligned16(out) || !aligned16(pool.k) || !aligned16(pool.v)) return false;
  const int qh = static_cast<int>(q_heads);
  return mma_parts == kMmaPartsFp32 ? launch_prefill_dim<kMmaPartsFp32>(q, qh, pool, step, scale, out, stream)
                                    : launch_prefill_dim<kMmaPartsBf16>(q, qh, pool, step, scale, out, stream);
}

}  // namespace kiln::cuda::ops
