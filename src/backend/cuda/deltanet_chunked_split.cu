// The chunked gated delta rule in two kernels (the split form; deltanet_chunked.cu's opening comment has the maths,
// the design and the expected speed): a preparation kernel fully parallel over (chunk, value head, sequence) that
// writes each chunk's W, U, P and cumulative decays to a global workspace, then a scan over each sequence's chunks
// with the state slice in shared memory. Tensor cores only (tf32_parts 1 or 3, sm_80+); the tilings and shared
// layouts are deltanet_chunked_tiles.h's (host-emulated by tests/unit/backend/cuda/deltanet_chunked_tiles_test.cpp).
#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/deltanet_chunked_mma.cuh"
#include "backend/cuda/deltanet_chunked_split.h"
#include "backend/cuda/deltanet_chunked_tiles.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace delta_chunked;

// ---- kernel 1: the preparation of one chunk of one value head

// Copies of one value tile (columns c0 .. c0 + DK - 1 of head h) of the chunk, transposed into kqs's q columns (row
// c, column i), zero past the chunk's m tokens and Dv: the loader pattern of deltanet_chunked.cu's copy_chunk (a warp
// reads 4 tokens x 32 contiguous bytes).
template <int DK>
__device__ __forceinline__ void copy_value_tile(float* sm, const float* __restrict__ v, int tok, int m, int h, int Dv,
                                                int64_t ldv, int c0, int warp, int lane) {
  using L = PrepLayout<DK>;
#pragma unroll 4
  for (int n = 0; n < DK / 4; ++n) {
    const int tile = warp + 8 * n;
    const int c = 8 * (tile % (DK / 8)) + (lane & 7), i = 4 * (tile / (DK / 8)) + (lane >> 3), col = c0 + c;
    const bool ok = i < m && col < Dv;
    copy_async(sm + L::kqs + c * L::ldk + L::q_col + i,
               v + int64_t(tok + imin(i, m - 1)) * ldv + int64_t(h) * Dv + imin(col, Dv - 1), ok);
  }
}

// dst[i][c] = sum_j T[i][j] rhs[j][c] scale[j] for the chunk's 64 rows and the DK columns of kqs column block
// col_base (0: k, rhs[j][d] = k_j[d]; q_col: the value tile), columns < cols stored (a multiple of 32). Phase 4's
// tiling (p4_tile, p4_k_end: T is zero right of each row tile's diagonal block).
template <int DK, int PARTS>
__device__ __forceinline__ void prep_rhs_product(const float* sm, int col_base, const float* scale, int warp, int lane,
                                                 float* dst, int64_t ld, int cols) {
  using L = PrepLayout<DK>;
  constexpr int NU = p4_col_tiles(DK);
  float acc[2][NU][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int u = 0; u < NU; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][u][e] = 0.0f;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
    const int row = p4_tile(warp, mi, 0).row, kend = p4_k_end(row);
#pragma unroll 2
    for (int k0 = 0; k0 < kend; k0 += 8) {
      Tf32<PARTS> a[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const Coord f = a_frag(lane, e);
        a[e] = split_tf32<PARTS>(sm[prep_t_offset<L>(row + f.row, k0 + f.col)]);
      }
      const float sc0 = scale[k0 + b_frag(lane, 0).row], sc1 = scale[k0 + b_frag(lane, 1).row];
#pragma unroll
      for (int u = 0; u < NU; ++u) {
        const Tile t = p4_tile(warp, mi, u);
        Tf32<PARTS> b[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const Coord f = b_frag(lane, e);
          b[e] = split_tf32<PARTS>(sm[prep_rhs_offset<L>(col_base, k0 + f.row, t.col + f.col)] * (e ? sc1 : sc0));
        }
        mma_step<PARTS>(acc[mi][u], a, b);
      }
    }
  }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      const Tile t = p4_tile(warp, mi, u);
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {  // accumulators 2 h2, 2 h2 + 1: one row, two adjacent columns
        const Coord f = c_frag(lane, 2 * h2);
        const int i = t.row + f.row, c = t.col + f.col;
        if (c < cols)
          *reinterpret_cast<float2*>(dst + int64_t(i) * ld + c) = make_float2(acc[mi][u][2 * h2], acc[mi][u][2 * h2 + 1]);
      }
    }
}

// Block (chunk c, value head h, sequence s). Stages, barrier-separated:
//   0  k, q (transposed into kqs), g, beta of the chunk
//   1  cs (one thread, token order: the CPU's sums) while the warps run phase 1's key tiles of [k; q] k^T
//   2  gating: A (shared), P (global, zeros right of the computed tiles), bs = beta e^cs, cs (global); value tile 0's
//      copies start into the q columns
//   3  diagonal inverses T_bb (threads 0..63)
//   4  M_b = T_bb A_b,<b in place (threads 0..95); T's diagonal blocks (the others)
//   5-7 T's sub-diagonals 1, 2, 3 (prep_t_step_elem)
//   8  W = T (bs k), U = T (beta v) per value tile of DK columns, stored to the workspace
template <int DK, int PARTS>
__global__ void __launch_bounds__(kThreads, 2)
    delta_prep_kernel(const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ v,
                      const float* __restrict__ g, const float* __restrict__ beta, int Hk, int Hv, int Dk, int Dv,
                      int64_t ldv, StepArgs step, SplitWorkspace wl, float* __restrict__ ws) {
  dev::pdl_enter();  // first statement: see launch.cuh
  using L = PrepLayout<DK>;
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  const int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kh = h / (Hv / Hk);
  const int tok0 = step.seq_token_begin[s], n = step.seq_token_begin[s + 1] - tok0;
  if (kChunk * c >= n) return;  // whole block
  const int tok = tok0 + kChunk * c, m = imin(kChunk, n - kChunk * c);
  const long long row0 = split_row(wl, h, tok0, s, c);
  float* Wg = ws + wl.w + row0 * wl.dk;
  float* Ug = ws + wl.u + row0 * wl.ldu;
  float* Pg = ws + wl.p + row0 * kChunk;
  float* csg = ws + wl.cs + row0;

  // ---- stage 0
#pragma unroll 4
  for (int n2 = 0; n2 < DK / 4; ++n2) {
    const int tile = warp + 8 * n2;
    const int d = 8 * (tile % (DK / 8)) + (lane & 7), i = 4 * (tile / (DK / 8)) + (lane >> 3);
    const bool ok = i < m && d < Dk;
    const int64_t off = (int64_t(tok + imin(i, m - 1)) * Hk + kh) * Dk + imin(d, Dk - 1);
    copy_async(sm + L::kqs + d * L::ldk + i, kn + off, ok);
    copy_async(sm + L::kqs + d * L::ldk + L::q_col + i, qn + off, ok);
  }
  if (tid < kChunk) {
    const Gates x = load_gates(g, beta, tok, m, h, Hv, tid);
    sm[L::graw + tid] = x.g;
    sm[L::beta + tid] = x.beta;
  }
  wait_copies();
  __syncthreads();

  // ---- stage 1: padded tokens have g = 0, so cs[63] = cs[m - 1]
  if (tid == 0) {
    float cum = 0.0f;
    for (int i = 0; i < kChunk; ++i) {
      cum += sm[L::graw + i];
      sm[L::cs + i] = cum;
    }
  }
  constexpr int NJ = p1_key_tiles();
  const int row_x = p1_row_x(warp), row_y = p1_row_y(warp);
  float acc[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
#pragma unroll 2
  for (int k0 = 0; k0 < DK; k0 += 8) {
    Tf32<PARTS> ax[4], ay[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const Coord f = a_frag(lane, e);
      ax[e] = split_tf32<PARTS>(sm[p1_a_offset<L>(0, row_x + f.row, k0 + f.col)]);
      ay[e] = split_tf32<PARTS>(sm[p1_a_offset<L>(0, row_y + f.row, k0 + f.col)]);
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const Tile t = p1_tile(warp, j);
      const bool y = p1_uses_y(warp, j);
      Tf32<PARTS> a[4], b[2];
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = y ? ay[e] : ax[e];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const Coord f = b_frag(lane, e);
        b[e] = split_tf32<PARTS>(sm[p1_b_offset<L>(0, k0 + f.row, t.col + f.col)]);
      }
      mma_step<PARTS>(acc[j], a, b);
    }
  }
  __syncthreads();  // cs

  // ---- stage 2: the gating (selects, never multiplications, for the masks: above the diagonal e^(cs_i - cs_j) may
  // overflow), as the single kernel's
  {
    const float* cs = sm + L::cs;
    const float* bt = sm + L::beta;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const Tile t = p1_tile(warp, j);
      const bool is_q = t.row >= kChunk;  // tile-uniform
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const Coord f = c_frag(lane, 2 * h2);
        const int i = (t.row + f.row) & (kChunk - 1), col = t.col + f.col;
        const float ci = cs[i], bi = bt[i];
        float r[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int jj = col + u;
          const float decayed = acc[j][2 * h2 + u] * expf(ci - cs[jj]);
          r[u] = is_q ? (jj <= i ? decayed : 0.0f) : (jj < i ? bi * decayed : 0.0f);
        }
        if (is_q)
          *reinterpret_cast<float2*>(Pg + i * kChunk + col) = make_float2(r[0], r[1]);
        else
          *reinterpret_cast<float2*>(sm + L::a + i * L::lda + col) = make_float2(r[0], r[1]);
      }
    }
    // P right of a q row tile's computed columns is zero, stored by the warp whose x the tile is (A's are never read).
    if (row_x >= kChunk) {
      const int first = p1_first_unneeded_col(row_x), width = kChunk - first;
      float* z = Pg + (row_x - kChunk) * kChunk + first;
      for (int e = lane; e < kSub * width; e += 32) z[(e / width) * kChunk + e % width] = 0.0f;
    }
    if (tid < kChunk) {
      const float ci = cs[tid];
      sm[L::bs + tid] = bt[tid] * expf(ci);
      csg[tid] = ci;
    }
  }
  copy_value_tile<DK>(sm, v, tok, m, h, Dv, ldv, 0, warp, lane);  // q's last reader was stage 1
  __syncthreads();

  // ---- stage 3
  if (tid < kChunk) diagonal_inverse<L>(sm, tid);
  __syncthreads();

  // ---- stage 4
  if (tid < 96) {
    const int b = tid < 16 ? 1 : (tid < 48 ? 2 : 3), j = tid - 8 * b * (b - 1);
    apply_block_inverse(sm + L::a + kSub * b * L::lda + j, L::lda, sm + L::tbb + b * kSub * kSub);
  } else {
    for (int e = tid - 96; e < 4 * kSub * kSub; e += kThreads - 96) {
      const int b = e / (kSub * kSub), r = (e / kSub) % kSub, cc = e % kSub;
      sm[L::t + (kSub * b + r) * L::lda + kSub * b + cc] = sm[L::tbb + e];
    }
  }
  __syncthreads();

  // ---- stages 5-7: T_bc = -sum_j M_bj T_jc, one sub-diagonal per step
#pragma unroll
  for (int d = 1; d < 4; ++d) {
    for (int e = tid; e < prep_t_step_elems(d); e += kThreads) {
      const Elem x = prep_t_step_elem(d, e);
      const float* mrow = sm + L::a + x.row * L::lda;
      float sum = 0.0f;
      for (int j = x.j_begin; j < x.j_end; ++j) sum = fmaf(mrow[j], sm[L::t + j * L::lda + x.col], sum);
      sm[L::t + x.row * L::lda + x.col] = -sum;
    }
    if (d == 3) wait_copies();  // value tile 0
    __syncthreads();
  }

  // ---- stage 8
  prep_rhs_product<DK, PARTS>(sm, 0, sm + L::bs, warp, lane, Wg, wl.dk, DK);
  const int ldu = static_cast<int>(wl.ldu);
  for (int c0 = 0; c0 < ldu; c0 += DK) {
    if (c0 > 0) {  // block-uniform
      __syncthreads();  // the previous tile's readers are done
      copy_value_tile<DK>(sm, v, tok, m, h, Dv, ldv, c0, warp, lane);
      wait_copies();
      __syncthreads();
    }
    prep_rhs_product<DK, PARTS>(sm, L::q_col, sm + L::beta, warp, lane, Ug + c0, wl.ldu, imin(DK, ldu - c0));
  }
}

// ---- kernel 2: the scan over a sequence's chunks

// Copies of rows tok .. tok + 63 of qn or kn (key head kh) into dst (row stride ld), zero past m tokens and Dk: 16
// bytes at a time where Dk % 4 == 0 and the rows are aligned (vec), else 4.
template <int DK>
__device__ __forceinline__ void copy_key_rows(float* dst, int ld, const float* __restrict__ src, int tok, int m,
                                              int kh, int Hk, int Dk, bool vec, int tid) {
  if (vec) {
#pragma unroll 4
    for (int e = tid; e < kChunk * DK / 4; e += kThreads) {
      const int i = e / (DK / 4), d = 4 * (e % (DK / 4));
      copy_async4(dst + i * ld + d, src + (int64_t(tok + imin(i, m - 1)) * Hk + kh) * Dk + imin(d, Dk - 4),
                  i < m && d < Dk);
    }
  } else {
#pragma unroll 4
    for (int e = tid; e < kChunk * DK; e += kThreads) {
      const int i = e / DK, d = e % DK;
      copy_async(dst + i * ld + d, src + (int64_t(tok + imin(i, m - 1)) * Hk + kh) * Dk + imin(d, Dk - 1),
                 i < m && d < Dk);
    }
  }
}

// Copies of `rows` x `width` floats (width a multiple of 4, both sides 16-byte aligned rows) into shared memory.
__device__ __forceinline__ void copy_block(float* dst, int ld_dst, const float* src, int64_t ld_src, int rows,
                                           int width, int tid) {
  const int per_row = width / 4;
  for (int e = tid; e < rows * per_row; e += kThreads) {
    const int i = e / per_row, c = 4 * (e % per_row);
    copy_async4(dst + i * ld_dst + c, src + int64_t(i) * ld_src + c, true);
  }
}

// Block (sequence s, value head h, value columns col0 .. col0 + 31). Per chunk ci, two barriers:
//   copies: k(ci), P(ci) [group 1]; W(ci + 1), q(ci + 1) into the other set [group 2]
//   (a) [W; q] S -> X = U - G_W (shared), O = e^cs G_q (registers); dec = e^(cs_last - cs_i)
//   wait for group 1; barrier 1 (X, dec, k, P ready; every read of S, U and this set's W / q done)
//   copies: U(ci + 1), cs(ci + 1)
//   (b) out = O + P X -> global; (c) S = e^cs_last S + K'^T X
//   wait for all; barrier 2 (S updated; the next chunk's W, q, U, cs landed; X, k, P free)
template <int DK, int PARTS>
__global__ void __launch_bounds__(kThreads, 1)
    delta_scan_kernel(const float* __restrict__ qn, const float* __restrict__ kn, DeltaStateRef state,
                      const float* ws, SplitWorkspace wl, int Hk, int Hv, int Dk, int Dv, StepArgs step,
                      float* __restrict__ out, bool vec) {
  dev::pdl_enter();  // first statement: see launch.cuh
  using L = ScanLayout<DK>;
  constexpr int DVT = L::dvt, NU = p4_col_tiles(DVT), NT = p5_col_tiles(DK, DVT);
  extern __shared__ float4 smem_f4[];
  float* sm = reinterpret_cast<float*>(smem_f4);
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * DVT;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int kh = h / (Hv / Hk);
  const int tok0 = step.seq_token_begin[s], n = step.seq_token_begin[s + 1] - tok0;
  if (n <= 0) return;  // whole block
  const int64_t S0 = (int64_t(step.seq_state_slot[s]) * Hv + h) * Dk * Dv;  // this head's state, in elements
  const long long r0 = split_row(wl, h, tok0, s, 0);
  const float* Wg = ws + wl.w + r0 * wl.dk;
  const float* Ug = ws + wl.u + r0 * wl.ldu + col0;
  const float* Pg = ws + wl.p + r0 * kChunk;
  const float* csg = ws + wl.cs + r0;
  const int chunks = (n + kChunk - 1) / kChunk;

  // The state slice (zero outside Dk x Dv): an fp32 state by cp.async, a bf16 one widened through registers; chunk
  // 0's W, q, U and cs.
  for (int e = tid; e < DK * DVT; e += kThreads) {
    const int d = e / DVT, c = e % DVT, col = col0 + c;
    const bool ok = d < Dk && col < Dv;
    const int64_t at = S0 + int64_t(imin(d, Dk - 1)) * Dv + imin(col, Dv - 1);
    float* dst = sm + scan_s_offset<L>(d, c);
    if (state.bf16)
      *dst = ok ? dev::load_state(state, at) : 0.0f;
    else
      copy_async(dst, static_cast<const float*>(state.data) + at, ok);
  }
  copy_block(sm + L::w, L::ldw, Wg, DK, kChunk, DK, tid);
  copy_key_rows<DK>(sm + L::q, L::ldw, qn, tok0, imin(kChunk, n), kh, Hk, Dk, vec, tid);
  copy_block(sm + L::u, L::ldv, Ug, wl.ldu, kChunk, DVT, tid);
  if (tid < kChunk) copy_async(sm + L::cs + tid, csg + tid, true);
  commit_copies();
  wait_copies();
  __syncthreads();

  for (int ci = 0; ci < chunks; ++ci) {
    const int set = ci & 1, tok = tok0 + kChunk * ci, m = imin(kChunk, n - kChunk * ci);
    const bool has_next = ci + 1 < chunks;  // block-uniform
    const int64_t row = int64_t(kChunk) * ci;
    copy_key_rows<DK>(sm + L::k, L::ldk, kn, tok, m, kh, Hk, Dk, vec, tid);
    copy_block(sm + L::p, L::ldp, Pg + row * kChunk, kChunk, kChunk, kChunk, tid);
    commit_copies();
    if (has_next) {
      const int nset = (set ^ 1) * kChunk * L::ldw;
      copy_block(sm + L::w + nset, L::ldw, Wg + (row + kChunk) * DK, DK, kChunk, DK, tid);
      copy_key_rows<DK>(sm + L::q + nset, L::ldw, qn, tok + kChunk, imin(kChunk, n - kChunk * (ci + 1)), kh, Hk, Dk,
                        vec, tid);
    }
    commit_copies();
    const float* cs = sm + L::cs + set * kChunk;

    // ---- (a) G = [W; q] S over the key dim
    float acc[4][NU][4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int u = 0; u < NU; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][u][e] = 0.0f;
#pragma unroll 2
    for (int k0 = 0; k0 < DK; k0 += 8) {
      Tf32<PARTS> a[4][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int R = scan_g_tile(warp, mi, 0).row;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const Coord f = a_frag(lane, e);
          a[mi][e] = split_tf32<PARTS>(sm[scan_g_a_offset<L>(set, R + f.row, k0 + f.col)]);
        }
      }
#pragma unroll
      for (int u = 0; u < NU; ++u) {
        const int col = scan_g_tile(warp, 0, u).col;
        Tf32<PARTS> b[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const Coord f = b_frag(lane, e);
          b[e] = split_tf32<PARTS>(sm[scan_s_offset<L>(k0 + f.row, col + f.col)]);
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) mma_step<PARTS>(acc[mi][u], a[mi], b);
      }
    }
    // X = U - W S to shared (rows past m: U and W are zero there, so X is); O_i = e^cs_i q_i S stays in acc[2..3].
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int u = 0; u < NU; ++u) {
        const Tile t = scan_g_tile(warp, mi, u);
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const Coord f = c_frag(lane, 2 * h2);
          const int i = (t.row + f.row) & (kChunk - 1), c = t.col + f.col;
          float& g0 = acc[mi][u][2 * h2];
          float& g1 = acc[mi][u][2 * h2 + 1];
          if (mi < 2) {
            const float2 uu = *reinterpret_cast<const float2*>(sm + scan_u_offset<L>(i, c));
            *reinterpret_cast<float2*>(sm + scan_x_offset<L>(i, c)) = make_float2(uu.x - g0, uu.y - g1);
          } else {
            const float ei = expf(cs[i]);
            g0 *= ei;
            g1 *= ei;
          }
        }
      }
    if (tid < kChunk) sm[L::dec + tid] = expf(cs[kChunk - 1] - cs[tid]);
    wait_copies_but_newest();  // k and P of this chunk (this thread's) ...
    __syncthreads();           // ... everyone's; X and dec written; W / q / U / S reads of (a) done

    if (has_next) {
      copy_block(sm + L::u, L::ldv, Ug + (row + kChunk) * wl.ldu, wl.ldu, kChunk, DVT, tid);
      if (tid < kChunk) copy_async(sm + L::cs + (set ^ 1) * kChunk + tid, csg + row + kChunk + tid, true);
    }
    commit_copies();

    // ---- (b) out = O + P X: phase 4's tiles, whose O the warp holds
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int prow = p4_tile(warp, mi, 0).row, kend = p4_k_end(prow);
#pragma unroll 2
      for (int k0 = 0; k0 < kend; k0 += 8) {
        Tf32<PARTS> a[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const Coord f = a_frag(lane, e);
          a[e] = split_tf32<PARTS>(sm[scan_p_offset<L>(prow + f.row, k0 + f.col)]);
        }
#pragma unroll
        for (int u = 0; u < NU; ++u) {
          const Tile t = p4_tile(warp, mi, u);
          Tf32<PARTS> b[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const Coord f = b_frag(lane, e);
            b[e] = split_tf32<PARTS>(sm[scan_x_offset<L>(k0 + f.row, t.col + f.col)]);
          }
          mma_step<PARTS>(acc[2 + mi][u], a, b);
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int u = 0; u < NU; ++u) {
        const Tile t = p4_tile(warp, mi, u);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const Coord f = c_frag(lane, e);
          const int i = t.row + f.row, c = col0 + t.col + f.col;
          if (i < m && c < Dv) out[(int64_t(tok + i) * Hv + h) * Dv + c] = acc[2 + mi][u][e];
        }
      }

    // ---- (c) S = e^cs_last S + K'^T X, K'[i][d] = k_i[d] e^(cs_last - cs_i) scaled as it is converted. Each S
    // element is read and written by the one lane that owns it.
    {
      const int prow = p5_tile(warp, 0, DK, DVT).row;
      const float* dec = sm + L::dec;
      float sacc[NT][4];
#pragma unroll
      for (int u = 0; u < NT; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[u][e] = 0.0f;
#pragma unroll 2
      for (int k0 = 0; k0 < kChunk; k0 += 8) {
        Tf32<PARTS> a[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const Coord f = a_frag(lane, e);
          a[e] = split_tf32<PARTS>(sm[scan_k_offset<L>(prow + f.row, k0 + f.col)] * dec[k0 + f.col]);
        }
#pragma unroll
        for (int u = 0; u < NT; ++u) {
          const Tile t = p5_tile(warp, u, DK, DVT);
          Tf32<PARTS> b[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const Coord f = b_frag(lane, e);
            b[e] = split_tf32<PARTS>(sm[scan_x_offset<L>(k0 + f.row, t.col + f.col)]);
          }
          mma_step<PARTS>(sacc[u], a, b);
        }
      }
      const float decay = expf(cs[kChunk - 1]);
#pragma unroll
      for (int u = 0; u < NT; ++u) {
        const Tile t = p5_tile(warp, u, DK, DVT);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const Coord f = c_frag(lane, e);
          float* sp = sm + scan_s_offset<L>(t.row + f.row, t.col + f.col);
          *sp = fmaf(*sp, decay, sacc[u][e]);
        }
      }
    }
    wait_copies();    // the next chunk's W, q, U, cs (this thread's) ...
    __syncthreads();  // ... everyone's; S updated; X, k, P free
  }

  // The loop's last barrier published the final state: rounded once if bf16.
  for (int e = tid; e < DK * DVT; e += kThreads) {
    const int d = e / DVT, c = e % DVT, col = col0 + c;
    if (d < Dk && col < Dv) dev::store_state(state, S0 + int64_t(d) * Dv + col, sm[scan_s_offset<L>(d, c)]);
  }
}

template <int DK, int PARTS>
void launch_split(const float* qn, const float* kn, const float* v, const float* g, const float* beta,
                  DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t ldv,
                  const StepArgs& step, float* out, void* workspace, cudaStream_t stream) {
  const SplitWorkspace wl = split_workspace(step.num_tokens, step.num_seqs, Hv, Dk, Dv);
  float* ws = static_cast<float*>(workspace);
  auto prep = delta_prep_kernel<DK, PARTS>;
  auto scan = delta_scan_kernel<DK, PARTS>;
  constexpr size_t prep_bytes = PrepLayout<DK>::bytes, scan_bytes = ScanLayout<DK>::bytes;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(prep_bytes)));
  KILN_CUDA_CHECK(cudaFuncSetAttribute(scan, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(scan_bytes)));
  const int longest = step.max_seq_tokens > 0 ? step.max_seq_tokens : step.num_tokens;
  const dim3 grid1(static_cast<unsigned>((longest + kChunk - 1) / kChunk), static_cast<unsigned>(Hv),
                   static_cast<unsigned>(step.num_seqs));
  launch_kernel(prep, grid1, kThreads, prep_bytes, stream, qn, kn, v, g, beta, static_cast<int>(Hk),
                static_cast<int>(Hv), static_cast<int>(Dk), static_cast<int>(Dv), ldv, step, wl, ws);
  KILN_CUDA_CHECK_LAUNCH();
  const bool vec = Dk % 4 == 0 && reinterpret_cast<uintptr_t>(qn) % 16 == 0 && reinterpret_cast<uintptr_t>(kn) % 16 == 0;
  const dim3 grid2(static_cast<unsigned>(step.num_seqs), static_cast<unsigned>(Hv),
                   static_cast<unsigned>((Dv + ScanLayout<DK>::dvt - 1) / ScanLayout<DK>::dvt));
  launch_kernel(scan, grid2, kThreads, scan_bytes, stream, qn, kn, state, static_cast<const float*>(ws), wl,
                static_cast<int>(Hk), static_cast<int>(Hv), static_cast<int>(Dk), static_cast<int>(Dv), step, out,
                vec);
  KILN_CUDA_CHECK_LAUNCH();
}

template <int DK>
void launch_split_parts(int tf32_parts, const float* qn, const float* kn, const float* v, const float* g,
                        const float* beta, DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv,
                        int64_t ldv, const StepArgs& step, float* out, void* workspace, cudaStream_t stream) {
  if (tf32_parts == 1)
    launch_split<DK, 1>(qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, workspace, stream);
  else
    launch_split<DK, 3>(qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, workspace, stream);
}

}  // namespace

size_t delta_rule_split_shared_bytes(int64_t Dk) {
  switch (chunk_key_tile(Dk)) {
    case 32: return std::max<size_t>(PrepLayout<32>::bytes, ScanLayout<32>::bytes);
    case 64: return std::max<size_t>(PrepLayout<64>::bytes, ScanLayout<64>::bytes);
    default: return std::max<size_t>(PrepLayout<128>::bytes, ScanLayout<128>::bytes);
  }
}

void gated_delta_rule_chunked_split(const float* qn, const float* kn, const float* v, const float* g,
                                    const float* beta, DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk,
                                    int64_t Dv, int64_t ldv, const StepArgs& step, float* out, void* workspace,
                                    cudaStream_t stream, int tf32_parts) {
  switch (chunk_key_tile(Dk)) {
    case 32:
      launch_split_parts<32>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, workspace, stream);
      break;
    case 64:
      launch_split_parts<64>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, workspace, stream);
      break;
    default:
      launch_split_parts<128>(tf32_parts, qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, workspace,
                              stream);
      break;
  }
}

}  // namespace kiln::cuda::ops
