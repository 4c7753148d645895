// The vision encoder's kernels (the contracts: vision.h): LayerNorm with bias (a block per row), GELU and the
// table-driven rotary embedding (a thread per element / pair), weighted row gathers (a thread per output element),
// and bidirectional attention within segments.
//
// Attention within segments on tensor cores (attention_segments_mma_kernel), after attention_prefill.cu's flash
// layout without its paging and causal mask: a block takes 64 consecutive query tokens of ONE segment and ONE head and
// streams that segment's keys through shared memory in tiles of kKeys keys (64; 32 above 128 padded columns, for
// registers). 4 warps, 16 query rows each:
//   S = Q K^T      mma.sync m16n8k16 (bf16 in, fp32 accumulate), Q and K tiles by ldmatrix;
//   online softmax per row in fp32 (running max, running sum, accurate expf), keys past the segment masked;
//   O += P V       P from the S accumulators (registers), V tile by ldmatrix.trans; O in fp32 registers.
// Unlike the prefill kernel's bf16 / e4m3 pools, K and V are fp32 here, so every operand is split: q, k, v and p in
// kParts bf16 parts each (3: hi + mid + lo; 1: rounded to bf16), and each product of parts (i, j) with i + j <
// kParts is one MMA (3 parts: 6 MMAs, smallest terms first; 1 part: 1). The head dimension is padded with zeros to
// Dp, a multiple of 16 (72 -> 80), in shared memory; only the D real columns are written out.
// Tiles are converted on the way in: each thread loads float4s of the tile's rows, splits them and stores the parts
// (no cp.async: the data needs converting; several blocks per SM hide the loads). Rows past the segment are zeros.
//
// Shared memory (bytes): (kParts x 64 + 2 x kParts x kKeys) x (2 Dp + 16) (rows padded by 16 bytes so the 8 rows of an
// ldmatrix hit distinct banks). 3 parts: Dp 80: 101,376; Dp 128: 156,672; Dp 256: 202,752 (kKeys 32); 1 part: a third.
//
// Grid: x = heads x (64-row chunks of max_seqlen), y = segments (a block walks segments y, y + gridDim.y, ...: any
// count). Blocks whose chunk starts past their segment's end skip it.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/ptx.cuh"
#include "backend/cuda/vision.h"

namespace kiln::cuda::ops {
namespace {

using namespace dev;

constexpr int kBlock = 256;


// ---- LayerNorm: a block per row

__global__ void layer_norm_kernel(const float* x, int64_t D, const void* w, ElemType w_elem, const void* b,
                                  ElemType b_elem, float eps, float* out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  __shared__ float red[32];
  // x and out may be the same row: every read of the two reductions is done before the first write (block_sum's
  // barriers), and the last pass reads and writes the same element in the same thread.
  const float* xr = x + int64_t(blockIdx.x) * D;
  float* orow = out + int64_t(blockIdx.x) * D;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) sum += xr[i];
  const float mean = block_sum(sum, red) / float(D);
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float c = xr[i] - mean;
    ss += c * c;
  }
  const float rstd = 1.0f / sqrtf(block_sum(ss, red) / float(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
    orow[i] = (xr[i] - mean) * rstd * load_elem(w, w_elem, i) + load_elem(b, b_elem, i);
}

// ---- elementwise

__global__ void gelu_kernel(const float* x, float* out, int64_t n, bool tanh_form) {
  dev::pdl_enter();  // first statement: see launch.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    out[i] = tanh_form ? 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)))
                       : 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
  }
}

// A thread per (token, head, pair i < half).
__global__ void rope_cos_sin_kernel(float* __restrict__ x, int64_t T, int64_t heads, int64_t half,
                                    const float* __restrict__ cos, const float* __restrict__ sin) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t total = T * heads * half;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i % half, th = i / half, t = th / heads;
    const float c = cos[t * half + p], s = sin[t * half + p];
    float* v = x + th * 2 * half;
    const float a = v[p], z = v[p + half];
    v[p] = a * c - z * s;
    v[p + half] = z * c + a * s;
  }
}

// A thread per output element (t, c).
__global__ void weighted_embedding_kernel(const void* __restrict__ table, ElemType elem, int64_t V, int64_t H,
                                          const int32_t* __restrict__ ids, const float* __restrict__ weights,
                                          int64_t T, int64_t J, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t total = T * H;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / H, c = i % H;
    float acc = 0.0f;
    for (int64_t j = 0; j < J; ++j) {
      const int64_t row = ids[t * J + j];
      if (row >= 0 && row < V) acc += load_elem(table, elem, row * H + c) * weights[t * J + j];
    }
    out[i] = acc;
  }
}

// ---- attention within segments: the tensor-core kernel (see the top of the file)

constexpr int kRows = 64;  // query rows per block
constexpr int kWarps = 4;  // 16 rows each
constexpr int kThreads = kWarps * 32;

template <int Dp, int kParts>
struct SegmentSmem {
  static constexpr int kKeys = Dp <= 128 ? 64 : 32;  // keys per tile (Dp 256: the 128 O accumulators of a lane)
  static constexpr int kRowBytes = 2 * Dp + 16;      // a bf16 row of one part, padded
  static constexpr int kQPart = kRows * kRowBytes;
  static constexpr int kTilePart = kKeys * kRowBytes;
  static constexpr int q = 0;                         // [kParts][kRows][kRowBytes]
  static constexpr int k = q + kParts * kQPart;       // [kParts][kKeys][kRowBytes]
  static constexpr int v = k + kParts * kTilePart;    // [kParts][kKeys][kRowBytes]
  static constexpr int bytes = v + kParts * kTilePart;
  static_assert(Dp % 16 == 0 && Dp >= 16 && Dp <= 256, "padded head_dim: a multiple of 16 up to 256");
};

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

// Rows [0, n_rows) of one head into shared memory as kParts bf16 parts ([kParts][n_rows][2 Dp + 16] bytes at dst, a
// part every part_bytes): row r is token t0 + r of `src` [*, heads, D] (row stride ld elements, head offset h_off),
// zeros for r >= n_valid and for the padding columns [D, Dp). Needs D % 4 == 0 and a 16-byte aligned src.
template <int Dp, int kParts>
__device__ __forceinline__ void stage_rows(const float* __restrict__ src, int64_t t0, int n_valid, int n_rows,
                                           int64_t ld, int64_t h_off, int D, unsigned char* dst, int part_bytes,
                                           int tid) {
  constexpr int kC4 = Dp / 4;  // float4 columns of a padded row
  constexpr int kRowBytes = 2 * Dp + 16;
#pragma unroll 2
  for (int i = tid; i < n_rows * kC4; i += kThreads) {
    const int r = i / kC4, c4 = i - r * kC4;
    float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (r < n_valid && c4 * 4 < D) x = *reinterpret_cast<const float4*>(src + (t0 + r) * ld + h_off + c4 * 4);
    uint32_t p0[kParts], p1[kParts];
    split_parts<kParts>(x.x, x.y, p0);
    split_parts<kParts>(x.z, x.w, p1);
#pragma unroll
    for (int part = 0; part < kParts; ++part)
      *reinterpret_cast<uint2*>(dst + part * part_bytes + r * kRowBytes + c4 * 8) = make_uint2(p0[part], p1[part]);
  }
}

// d0 += A B0, d1 += A B1 over the parts: every (a part i, b part j) with i + j < kParts, the smallest terms first.
// b[j][0..1] is B0's fragment of part j, b[j][2..3] B1's.
template <int kParts>
__device__ __forceinline__ void mma_parts(float (&d0)[4], float (&d1)[4], const uint32_t (&a)[kParts][4],
                                          const uint32_t (&b)[kParts][4]) {
#pragma unroll
  for (int sum = kParts - 1; sum >= 0; --sum)
#pragma unroll
    for (int i = 0; i <= sum; ++i) {
      const int j = sum - i;
      ptx::mma_bf16_16816(d0, a[i], b[j][0], b[j][1]);
      ptx::mma_bf16_16816(d1, a[i], b[j][2], b[j][3]);
    }
}

template <int Dp, int kParts>
__device__ __forceinline__ void segment_attention_block(const float* __restrict__ q, const float* __restrict__ k,
                                                        const float* __restrict__ v,
                                                        const int32_t* __restrict__ cu_seqlens, int num_segments,
                                                        int heads, int D, float scale, float* __restrict__ out) {
  using L = SegmentSmem<Dp, kParts>;
  constexpr int kRowBytes = L::kRowBytes;
  constexpr int kKeys = L::kKeys;
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int h = static_cast<int>(blockIdx.x % heads);
  const int row0 = static_cast<int>(blockIdx.x / heads) * kRows;  // first query row of the block within its segment
  const int64_t ld = int64_t(heads) * D;                           // elements from one token to the next
  const int64_t h_off = int64_t(h) * D;

  // ldmatrix lane addresses (as attention_prefill.cu). A (q rows): row lane % 16, dims + 8 (lane / 16). B of S (K,
  // [key][dim]): key lane % 8 + 8 (lane / 16), dims + 8 ((lane / 8) % 2). B of O (V, [key][dim], transposed): key
  // lane % 8 + 8 ((lane / 8) % 2), dims + 8 (lane / 16).
  const uint32_t sbase = ptx::smem_addr(smem);
  const uint32_t q_addr = sbase + L::q + (warp * 16 + (lane & 15)) * kRowBytes + (lane >> 4) * 16;
  const uint32_t k_addr = sbase + L::k + ((lane & 7) + (lane >> 4) * 8) * kRowBytes + ((lane >> 3) & 1) * 16;
  const uint32_t v_addr = sbase + L::v + ((lane & 7) + ((lane >> 3) & 1) * 8) * kRowBytes + (lane >> 4) * 16;

  for (int s = blockIdx.y; s < num_segments; s += gridDim.y) {
    const int tok0 = cu_seqlens[s];
    const int len = cu_seqlens[s + 1] - tok0;
    if (row0 >= len) continue;  // the same for the whole block
    __syncthreads();            // the previous segment's last reads of the tiles are done
    stage_rows<Dp, kParts>(q, int64_t(tok0) + row0, min(kRows, len - row0), kRows, ld, h_off, D, smem + L::q,
                           L::kQPart, tid);

    float o_acc[Dp / 8][4];
#pragma unroll
    for (int i = 0; i < Dp / 8; ++i) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.0f;
    // Rows g and g + 8 of the warp (g = lane / 4): running max, and this lane's part of the running sum.
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

    const int n_tiles = (len + kKeys - 1) / kKeys;
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int j0 = tile * kKeys;
      const int n_keys = min(kKeys, len - j0);  // >= 1
      __syncthreads();  // every warp is done with the previous K / V tiles
      stage_rows<Dp, kParts>(k, int64_t(tok0) + j0, n_keys, kKeys, ld, h_off, D, smem + L::k, L::kTilePart, tid);
      stage_rows<Dp, kParts>(v, int64_t(tok0) + j0, n_keys, kKeys, ld, h_off, D, smem + L::v, L::kTilePart, tid);
      __syncthreads();  // the tiles (and, at the first tile, q) are visible to all

      // S = Q K^T: 16 rows x kKeys keys per warp (n-tiles of 8 keys).
      float s_acc[kKeys / 8][4];
#pragma unroll
      for (int i = 0; i < kKeys / 8; ++i) s_acc[i][0] = s_acc[i][1] = s_acc[i][2] = s_acc[i][3] = 0.0f;
#pragma unroll 1
      for (int ks = 0; ks < Dp / 16; ++ks) {
        uint32_t a[kParts][4];
#pragma unroll
        for (int part = 0; part < kParts; ++part) ptx::ldmatrix_x4(a[part], q_addr + part * L::kQPart + ks * 32);
#pragma unroll
        for (int kp = 0; kp < kKeys / 16; ++kp) {
          uint32_t b[kParts][4];
#pragma unroll
          for (int part = 0; part < kParts; ++part)
            ptx::ldmatrix_x4(b[part], k_addr + part * L::kTilePart + kp * 16 * kRowBytes + ks * 32);
          mma_parts<kParts>(s_acc[2 * kp], s_acc[2 * kp + 1], a, b);
        }
      }

      // Scale, mask the keys past the segment, online softmax. Accumulator element e of n-tile nt: row g + 8 (e / 2),
      // key nt * 8 + 2 (lane % 4) + e % 2.
      float t_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = nt * 8 + 2 * (lane & 3) + (e & 1);
          const float sv = key < n_keys ? s_acc[nt][e] * scale : -INFINITY;
          s_acc[nt][e] = sv;
          t_max[e >> 1] = fmaxf(t_max[e >> 1], sv);
        }
      float corr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // The 4 lanes of a row hold its kKeys scores between them; key 0 of the tile is always valid, so the max is
        // finite (for finite inputs) and the first tile's correction is exp(-inf) = 0.
        t_max[r] = fmaxf(t_max[r], __shfl_xor_sync(0xffffffffu, t_max[r], 1));
        t_max[r] = fmaxf(t_max[r], __shfl_xor_sync(0xffffffffu, t_max[r], 2));
        const float m_new = fmaxf(m_run[r], t_max[r]);
        corr[r] = expf(m_run[r] - m_new);
        m_run[r] = m_new;
        l_run[r] *= corr[r];
      }
      if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {  // a running max moved
#pragma unroll
        for (int i = 0; i < Dp / 8; ++i) {
          o_acc[i][0] *= corr[0];
          o_acc[i][1] *= corr[0];
          o_acc[i][2] *= corr[1];
          o_acc[i][3] *= corr[1];
        }
      }

      // O += P V, p = exp(s - m) (summed into l in fp32): the S accumulators of n-tiles 2kk, 2kk + 1 are the A
      // fragment of keys [16kk, 16kk + 16).
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float p = expf(s_acc[2 * kk + hh][e] - m_run[e >> 1]);
            s_acc[2 * kk + hh][e] = p;
            l_run[e >> 1] += p;
          }
        uint32_t a[kParts][4], pp[4][kParts];
        split_parts<kParts>(s_acc[2 * kk][0], s_acc[2 * kk][1], pp[0]);          // row g, keys 16kk + 2q ..
        split_parts<kParts>(s_acc[2 * kk][2], s_acc[2 * kk][3], pp[1]);          // row g + 8
        split_parts<kParts>(s_acc[2 * kk + 1][0], s_acc[2 * kk + 1][1], pp[2]);  // row g, keys 16kk + 8 + 2q ..
        split_parts<kParts>(s_acc[2 * kk + 1][2], s_acc[2 * kk + 1][3], pp[3]);  // row g + 8
#pragma unroll
        for (int part = 0; part < kParts; ++part)
#pragma unroll
          for (int f = 0; f < 4; ++f) a[part][f] = pp[f][part];
#pragma unroll
        for (int np = 0; np < Dp / 16; ++np) {
          uint32_t b[kParts][4];
#pragma unroll
          for (int part = 0; part < kParts; ++part)
            ptx::ldmatrix_x4_trans(b[part], v_addr + part * L::kTilePart + kk * 16 * kRowBytes + np * 32);
          mma_parts<kParts>(o_acc[2 * np], o_acc[2 * np + 1], a, b);
        }
      }
    }

    // out = O / l for rows g and g + 8 of the warp inside the segment; the D real columns (D % 4 == 0: a lane's column
    // pair is wholly inside or wholly padding).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
      l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + warp * 16 + (lane >> 2) + 8 * r;
      if (row >= len) continue;
      const float inv = 1.0f / l_run[r];  // >= 1: the row's largest score contributes exp(0)
      float* o = out + (int64_t(tok0) + row) * ld + h_off + 2 * (lane & 3);
#pragma unroll
      for (int i = 0; i < Dp / 8; ++i)
        if (i * 8 + 2 * (lane & 3) < D)
          *reinterpret_cast<float2*>(o + i * 8) = make_float2(o_acc[i][2 * r] * inv, o_acc[i][2 * r + 1] * inv);
    }
  }
}

// Shared memory per block of the architecture being compiled: 99 KB on the sm_120 family (the launcher never picks an
// instantiation above the device's limit: attention_segments_mma_supported), 227 KB on sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kArchMaxSmem = 101376;
#else
constexpr int kArchMaxSmem = 232448;
#endif

template <int Dp, int kParts>
__global__ void __launch_bounds__(kThreads)
    attention_segments_mma_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                  const float* __restrict__ v, const int32_t* __restrict__ cu_seqlens,
                                  int num_segments, int heads, int D, float scale, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  if constexpr (SegmentSmem<Dp, kParts>::bytes > kArchMaxSmem)
    __trap();
  else
    segment_attention_block<Dp, kParts>(q, k, v, cu_seqlens, num_segments, heads, D, scale, out);
}

// ---- attention within segments on the CUDA cores: a warp per (token, head)

constexpr int kFp32Warps = 4;

// kPer = ceil(D / 32) output columns per lane (1, 2, 4 or 8). Keys go 32 at a time: lane j scores key j of the chunk
// (q from shared memory, the key row from global memory, fp32 in column order), the warp updates the running max,
// then every lane adds the chunk's p-weighted value rows to its columns.
template <int kPer>
__global__ void __launch_bounds__(kFp32Warps * 32)
    attention_segments_fp32_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                   const float* __restrict__ v, const int32_t* __restrict__ cu_seqlens,
                                   int num_segments, int64_t T, int heads, int D, float scale,
                                   float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  __shared__ float q_s[kFp32Warps][kPer * 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t ld = int64_t(heads) * D, items = T * heads;
  for (int64_t item = int64_t(blockIdx.x) * kFp32Warps + warp; item < items;
       item += int64_t(gridDim.x) * kFp32Warps) {
    const int64_t t = item / heads;
    const int64_t h_off = (item % heads) * D;
    // The segment of t: the largest s with cu_seqlens[s] <= t (cu_seqlens[S] = T > t, so t < cu_seqlens[s + 1]).
    int lo = 0, hi = num_segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (cu_seqlens[mid] <= t) lo = mid;
      else hi = mid - 1;
    }
    const int j_begin = cu_seqlens[lo], j_end = cu_seqlens[lo + 1];
    __syncwarp();  // the previous item's reads of q_s are done
    for (int d = lane; d < D; d += 32) q_s[warp][d] = q[t * ld + h_off + d];
    __syncwarp();
    float m = -INFINITY, l = 0.0f;  // running max (the same in every lane), this lane's part of the running sum
    float o[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) o[i] = 0.0f;
    for (int jb = j_begin; jb < j_end; jb += 32) {
      const int j = jb + lane;
      float s = -INFINITY;
      if (j < j_end) {
        const float* kr = k + int64_t(j) * ld + h_off;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += q_s[warp][d] * kr[d];
        s = dot * scale;
      }
      const float m_new = fmaxf(m, warp_max(s));  // lane 0's key is valid: finite
      const float corr = expf(m - m_new);          // the first chunk: exp(-inf) = 0
      const float p = expf(s - m_new);             // a lane without a key: 0
      l = l * corr + p;
#pragma unroll
      for (int i = 0; i < kPer; ++i) o[i] *= corr;
      m = m_new;
      const int n = min(32, j_end - jb);
      for (int jj = 0; jj < n; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        const float* vr = v + int64_t(jb + jj) * ld + h_off;
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
          const int d = lane + 32 * i;
          if (d < D) o[i] += pj * vr[d];
        }
      }
    }
    const float inv = 1.0f / warp_sum(l);
    float* orow = out + t * ld + h_off;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int d = lane + 32 * i;
      if (d < D) orow[d] = o[i] * inv;
    }
  }
}

// ---- launch helpers

// The device's opt-in shared memory per block (cached per device).
int max_smem_optin(int device) {
  static std::atomic<int> cache[64] = {};
  if (device >= 0 && device < 64) {
    const int c = cache[device].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int value = 0;
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&value, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (device >= 0 && device < 64) cache[device].store(value, std::memory_order_relaxed);
  return value;
}

// The padded head dimension the tensor-core kernel uses for D (0: none).
int padded_head_dim(int64_t D) {
  if (D < 4 || D % 4 != 0 || D > kSegmentAttentionMaxHeadDim) return 0;
  if (D <= 32) return 32;
  if (D <= 64) return 64;
  if (D <= 80) return 80;
  if (D <= 128) return 128;
  return 256;
}

template <int Dp>
int mma_smem_bytes(int parts) {
  return parts == kMmaPartsFp32 ? SegmentSmem<Dp, kMmaPartsFp32>::bytes : SegmentSmem<Dp, kMmaPartsBf16>::bytes;
}
int mma_smem_bytes(int Dp, int parts) {
  switch (Dp) {
    case 32: return mma_smem_bytes<32>(parts);
    case 64: return mma_smem_bytes<64>(parts);
    case 80: return mma_smem_bytes<80>(parts);
    case 128: return mma_smem_bytes<128>(parts);
    case 256: return mma_smem_bytes<256>(parts);
    default: return 0;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

struct SegmentArgs {
  const float *q, *k, *v;
  const int32_t* cu_seqlens;
  int num_segments;
  int64_t max_seqlen, T;
  int heads, D;
  float scale;
  float* out;
};

template <int Dp, int kParts>
void launch_mma(const SegmentArgs& a, Stream stream) {
  using L = SegmentSmem<Dp, kParts>;
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  // The dynamic shared memory limit, once per device (per instantiation).
  static std::atomic<uint64_t> configured{0};
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (!bit || !(configured.load(std::memory_order_acquire) & bit)) {
    KILN_CUDA_CHECK(cudaFuncSetAttribute(attention_segments_mma_kernel<Dp, kParts>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, L::bytes));
    configured.fetch_or(bit, std::memory_order_release);
  }
  const int64_t chunks = (a.max_seqlen + kRows - 1) / kRows;
  const dim3 grid(static_cast<unsigned>(chunks * a.heads),
                  static_cast<unsigned>(a.num_segments < 65535 ? a.num_segments : 65535));
  launch_kernel(attention_segments_mma_kernel<Dp, kParts>, grid, dim3(kThreads), static_cast<size_t>(L::bytes), stream,
                a.q, a.k, a.v, a.cu_seqlens, a.num_segments, a.heads, a.D, a.scale, a.out);
}

template <int kParts>
void launch_mma_dim(const SegmentArgs& a, Stream stream) {
  switch (padded_head_dim(a.D)) {
    case 32: return launch_mma<32, kParts>(a, stream);
    case 64: return launch_mma<64, kParts>(a, stream);
    case 80: return launch_mma<80, kParts>(a, stream);
    case 128: return launch_mma<128, kParts>(a, stream);
    case 256: return launch_mma<256, kParts>(a, stream);
    default: cuda_fail("attention_segments: head_dim {} has no tensor-core kernel", {a.D});
  }
}

template <int kPer>
void launch_fp32(const SegmentArgs& a, Stream stream) {
  const int64_t blocks = (a.T * a.heads + kFp32Warps - 1) / kFp32Warps;
  const unsigned grid = static_cast<unsigned>(blocks < (int64_t{1} << 20) ? blocks : (int64_t{1} << 20));
  launch_kernel(attention_segments_fp32_kernel<kPer>, dim3(grid), dim3(kFp32Warps * 32), 0, stream, a.q, a.k, a.v,
                a.cu_seqlens, a.num_segments, a.T, a.heads, a.D, a.scale, a.out);
}

}  // namespace

void layer_norm(const float* x, int64_t R, int64_t D, const void* w, ElemType w_elem, const void* b, ElemType b_elem,
                float eps, float* out, Stream stream) {
  if (R == 0 || D == 0) return;
  if (R > 0x7fffffff) cuda_fail("layer_norm: {} rows (at most 2^31 - 1)", {R});
  const int threads = D >= 1024 ? 256 : (D >= 256 ? 128 : 64);
  launch_kernel(layer_norm_kernel, dim3(static_cast<unsigned>(R)), dim3(threads), 0, stream, x, D, w, w_elem, b,
                b_elem, eps, out);
  KILN_CUDA_CHECK_LAUNCH();
}

void gelu(const float* x, int64_t n, bool tanh_form, float* out, Stream stream) {
  if (n == 0) return;
  launch_kernel(gelu_kernel, capped_grid(n), kBlock, 0, stream, x, out, n, tanh_form);
  KILN_CUDA_CHECK_LAUNCH();
}

void rope_cos_sin(float* x, int64_t T, int64_t heads, int64_t D, const float* cos, const float* sin, Stream stream) {
  const int64_t total = T * heads * (D / 2);
  if (total == 0) return;
  launch_kernel(rope_cos_sin_kernel, capped_grid(total), kBlock, 0, stream, x, T, heads, D / 2, cos, sin);
  KILN_CUDA_CHECK_LAUNCH();
}

void weighted_embedding(const void* table, ElemType elem, int64_t V, int64_t H, const int32_t* ids,
                        const float* weights, int64_t T, int64_t J, float* out, Stream stream) {
  if (T * H == 0) return;
  launch_kernel(weighted_embedding_kernel, capped_grid(T * H), kBlock, 0, stream, table, elem, V, H, ids, weights, T,
                J, out);
  KILN_CUDA_CHECK_LAUNCH();
}

bool attention_segments_mma_supported(int64_t D, int mma_parts, const void* q, const void* k, const void* v,
                                      const void* out) {
  if (mma_parts != kMmaPartsFp32 && mma_parts != kMmaPartsBf16) return false;
  const int Dp = padded_head_dim(D);
  if (Dp == 0 || !aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out)) return false;
  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  return mma_smem_bytes(Dp, mma_parts) <= max_smem_optin(device);
}

void attention_segments(const float* q, const float* k, const float* v, const int32_t* cu_seqlens,
                        int64_t num_segments, int64_t max_seqlen, int64_t T, int64_t heads, int64_t D, float scale,
                        float* out, int mma_parts, Stream stream) {
  if (T == 0 || heads == 0 || num_segments == 0 || max_seqlen == 0) return;
  if (D < 1 || D > kSegmentAttentionMaxHeadDim || heads > 0x7fffffff || num_segments > 0x7fffffff)
    cuda_fail("attention_segments: head_dim {} (1 to 256), heads {}, {} segments", {D, heads, num_segments});
  if ((max_seqlen + kRows - 1) / kRows * heads > 0x7fffffff)
    cuda_fail("attention_segments: {} heads x a longest segment of {} tokens is too large", {heads, max_seqlen});
  const SegmentArgs a{q, k, v, cu_seqlens, static_cast<int>(num_segments), max_seqlen, T,
                      static_cast<int>(heads), static_cast<int>(D), scale, out};
  if (mma_parts == kMmaPartsFp32) {
    launch_mma_dim<kMmaPartsFp32>(a, stream);
  } else if (mma_parts == kMmaPartsBf16) {
    launch_mma_dim<kMmaPartsBf16>(a, stream);
  } else if (mma_parts == kSegmentAttentionFp32) {
    if (D <= 32) launch_fp32<1>(a, stream);
    else if (D <= 64) launch_fp32<2>(a, stream);
    else if (D <= 128) launch_fp32<4>(a, stream);
    else launch_fp32<8>(a, stream);
  } else {
    cuda_fail("attention_segments: mma_parts {} (3, 1 or 0)", {mma_parts});
  }
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops
