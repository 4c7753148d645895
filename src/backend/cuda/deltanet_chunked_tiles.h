// The chunked gated delta rule's shared-memory layout and the tensor-core tiling of its three matrix products
// (deltanet_chunked.cu): which 16 x 8 output tiles each of the block's 8 warps computes in phases 1, 4 and 5, where
// every operand element lives in shared memory, and the mma.m16n8k8 .tf32 fragment layout. Plain C++ that the kernel
// and the host emulation (tests/unit/backend/cuda/deltanet_chunked_tiles_test.cpp: the same functions driving an
// emulated warp mma against a plain triple loop) both compile, so the emulation checks the kernel's own index maps.
#pragma once

#if defined(__CUDACC__)
#define KILN_HOST_DEVICE __host__ __device__
#else
#define KILN_HOST_DEVICE
#endif

namespace kiln::cuda::ops::delta_chunked {

constexpr int kChunk = 64;     // tokens per chunk, as the CPU form
constexpr int kThreads = 256;  // 8 warps; every thread mapping is written for exactly this
constexpr int kWarps = kThreads / 32;
constexpr int kSub = 16;       // rows of the diagonal blocks of the triangular solve

// Shared memory of one block, in floats. k and v are double-buffered (chunk ci uses set ci & 1) so that the next
// chunk's copies run while this chunk still reads them; q is read by phase 1 alone and needs one buffer. Row strides
// are multiples of 4 (float4 rows). The FMA kernel's (TC false) are 4 mod 32: the loader's transposed copies (8 key
// dims x 4 tokens per warp) and phase 5's float4 reads of 8 consecutive rows hit 32 distinct banks. The tensor-core
// kernel's kqs and vx / o strides are 8 mod 32: its fragment loads read row t (+ 4) and column g (+ 8) of kqs (phase
// 1's A and B: the key dim is the mma's k) and of vx (phases 4 and 5's B), bank 8 t + g, all 32 distinct (4 mod 32
// would give 4 t + g: 20 banks). Phase 5's A reads kqs the other way (row g, column t: bank 8 g + t, 2-way) and
// phase 4's A reads P as row g, column t (lda stays 4 mod 32: 4 g + t, conflict-free). The wider pads cost
// 16 DK + 3072 bytes: Dk 128 with 64 value columns 225.25 KB (the H100's / H200's opt-in limit is 227 KB), Dk 32
// with 32 columns 98.25 KB (99 KB parts), so the tensor-core kernel serves the same shapes.
template <int DK, int DVT, bool TC = false>
struct Layout {
  static_assert(DK == 32 || DK == 64 || DK == 128, "key dim tile");
  static_assert(DVT == 32 || DVT == 64, "value column tile");
  static constexpr int pad = TC ? 8 : 4;
  // kqs row d: k[0..64)[d] of set 0, q[0..64)[d], k[0..64)[d] of set 1, S[d][0..DVT), pad
  static constexpr int q_col = kChunk;
  static constexpr int s_col = 3 * kChunk;
  static constexpr int ldk = s_col + DVT + pad;
  static constexpr int lda = kChunk + 4;           // rows of a, p
  static constexpr int ldv = DVT + pad;            // rows of vx, o
  static constexpr int kqs = 0;                    // [DK][ldk]
  static constexpr int a = kqs + DK * ldk;         // [64][lda] A; its blocks left of the diagonal become M_b
  static constexpr int p = a + kChunk * lda;       // [64][lda] P
  static constexpr int vx = p + kChunk * lda;      // [2][64][ldv] v, then X, then Z, then V
  static constexpr int o = vx + 2 * kChunk * ldv;  // [64][ldv] O
  static constexpr int tbb = o + kChunk * ldv;     // [4][16][16] (I + A_bb)^-1, zeros above the diagonal
  static constexpr int cs = tbb + 4 * kSub * kSub; // [2][64] cumulative log-decay: chunk ci uses half ci & 1
  static constexpr int graw = cs + 2 * kChunk;     // [64] the next chunk's g
  static constexpr int beta = graw + kChunk;       // [64]
  static constexpr int dec = beta + kChunk;        // [64] e^(cs_last - cs_i)
  static constexpr int floats = dec + kChunk;
  static constexpr unsigned long bytes = static_cast<unsigned long>(floats) * sizeof(float);
  static_assert(ldk % 32 == pad && ldv % 32 == pad && lda % 32 == 4, "strides (bank spread)");
  static constexpr KILN_HOST_DEVICE int k_col(int set) { return set ? 2 * kChunk : 0; }
};

// ---- mma.m16n8k8 with .tf32 inputs (PTX ISA, "Matrix fragments for mma.m16n8k8"): lane = 4 g + t (g = groupID,
// t = threadID_in_group). D[16 x 8] += A[16 x 8] (row) B[8 x 8] (col).
struct Coord {
  int row, col;
};
// a0 (g, t) a1 (g + 8, t) a2 (g, t + 4) a3 (g + 8, t + 4)
KILN_HOST_DEVICE constexpr Coord a_frag(int lane, int i) {
  return {(lane >> 2) + 8 * (i & 1), (lane & 3) + 4 * (i >> 1)};
}
// b0 (k t, n g) b1 (k t + 4, n g); row = k
KILN_HOST_DEVICE constexpr Coord b_frag(int lane, int i) { return {(lane & 3) + 4 * i, lane >> 2}; }
// c0 c1 (g, 2 t .. 2 t + 1) c2 c3 (g + 8, 2 t .. 2 t + 1)
KILN_HOST_DEVICE constexpr Coord c_frag(int lane, int i) {
  return {(lane >> 2) + 8 * (i >> 1), 2 * (lane & 3) + (i & 1)};
}

// ---- phase 1: G = [k; q] [k^T | S] over the key dim. Rows 0..63 are the chunk's k tokens, 64..127 its q tokens;
// columns 0..63 are key tokens j, 64 .. 64 + DVT - 1 state columns. A row tile r (rows 16 r .. 16 r + 15 of k or of
// q) needs key columns j <= 16 r + 15 only (A is zero for j >= i, P for j > i): 2 r + 2 tiles of 8, and all DVT / 8
// state tiles. Per half (k or q) that is 20 key tiles and 4 * DVT / 8 state tiles; warp 4 h + p of half h takes 5
// key tiles and the state tiles of its row tile x:
//   p 0: x = 0: key tiles 0..1 of row tile 0, 0..2 of row tile 3 (its y)
//   p 1: x = 3: key tiles 3..7 of row tile 3
//   p 2: x = 1: key tiles 0..3 of row tile 1, 0 of row tile 2 (its y)
//   p 3: x = 2: key tiles 1..5 of row tile 2
// so every warp issues 5 + DVT / 8 mmas per 8 key dims. A warp loads the A fragments of at most two row tiles.
struct Tile {
  int row, col;  // first row and column of a 16 x 8 output tile
};
KILN_HOST_DEVICE constexpr int p1_key_tiles() { return 5; }
KILN_HOST_DEVICE constexpr int p1_tiles(int dvt) { return p1_key_tiles() + dvt / 8; }
KILN_HOST_DEVICE constexpr int p1_tile_x(int p) { return p == 0 ? 0 : (p == 1 ? 3 : (p == 2 ? 1 : 2)); }
KILN_HOST_DEVICE constexpr int p1_tile_y(int p) { return 3 - (p >> 1); }
KILN_HOST_DEVICE constexpr int p1_row_x(int warp) { return kChunk * (warp >> 2) + 16 * p1_tile_x(warp & 3); }
KILN_HOST_DEVICE constexpr int p1_row_y(int warp) { return kChunk * (warp >> 2) + 16 * p1_tile_y(warp & 3); }
// Whether the warp's slot (0 .. p1_tiles - 1) uses row tile y's A fragment.
KILN_HOST_DEVICE constexpr bool p1_uses_y(int warp, int slot) {
  const int p = warp & 3;
  return (p == 0 && slot >= 2 && slot < 5) || (p == 2 && slot == 4);
}
KILN_HOST_DEVICE constexpr Tile p1_tile(int warp, int slot) {
  const int p = warp & 3;
  if (slot >= p1_key_tiles()) return {p1_row_x(warp), kChunk + 8 * (slot - p1_key_tiles())};
  const int row = p1_uses_y(warp, slot) ? p1_row_y(warp) : p1_row_x(warp);
  const int n = p == 0 ? (slot < 2 ? slot : slot - 2) : (p == 1 ? slot + 3 : (p == 2 ? (slot < 4 ? slot : 0) : slot + 1));
  return {row, 8 * n};
}
// Key columns from here on are not computed for the row tile at `row` (A and P are zero there; the warp whose x it is
// stores those zeros).
KILN_HOST_DEVICE constexpr int p1_first_unneeded_col(int row) { return (row & (kChunk - 1)) + 16; }
// Shared offsets of phase 1's operands (L: Layout<DK, DVT, true>): A[R][d] = [k; q] row R at key dim d; B[d][C] = [k^T | S] at (d, column C).
template <class L>
KILN_HOST_DEVICE constexpr int p1_a_offset(int set, int R, int d) {
  return L::kqs + d * L::ldk + (R < kChunk ? L::k_col(set) + R : L::q_col + R - kChunk);
}
template <class L>
KILN_HOST_DEVICE constexpr int p1_b_offset(int set, int d, int C) {
  return L::kqs + d * L::ldk + (C < kChunk ? L::k_col(set) + C : L::s_col + C - kChunk);
}

// ---- phase 4: out = O + P V, rows i (4 row tiles), columns c (DVT / 8 tiles), over j (row tile r: j < 16 r + 16,
// 2 r + 2 steps of 8). Warp w takes row tiles w & 1 and 3 - (w & 1) (2 + 8 or 4 + 6 steps: 10 either way) and
// column tiles (w >> 1) + 4 u, u < DVT / 32.
KILN_HOST_DEVICE constexpr int p4_col_tiles(int dvt) { return dvt / 32; }
KILN_HOST_DEVICE constexpr Tile p4_tile(int warp, int mi, int u) {
  return {16 * (mi ? 3 - (warp & 1) : (warp & 1)), 8 * ((warp >> 1) + 4 * u)};
}
KILN_HOST_DEVICE constexpr int p4_k_end(int row) { return row + 16; }  // j < this for the row tile at `row`
template <class L>
KILN_HOST_DEVICE constexpr int p4_a_offset(int i, int j) {  // P[i][j]
  return L::p + i * L::lda + j;
}
template <class L>
KILN_HOST_DEVICE constexpr int v_offset(int set, int j, int c) {  // V[j][c] (vx set `set`), phases 4 and 5
  return L::vx + set * kChunk * L::ldv + j * L::ldv + c;
}
template <class L>
KILN_HOST_DEVICE constexpr int p4_o_offset(int i, int c) {  // O[i][c]
  return L::o + i * L::ldv + c;
}

// ---- phase 5: S = e^cs_last S + K' V with K'[d][i] = k_i[d] e^(cs_last - cs_i) (kqs's k set, scaled in place),
// rows d (DK / 16 tiles), columns c (DVT / 8 tiles), over the 64 tokens i. The warps split the row tiles first
// (DK / 16 of them, at most 8), then the column tiles: warp w takes row tile w % (DK / 16) and p5_col_tiles
// consecutive column tiles.
KILN_HOST_DEVICE constexpr int p5_row_warps(int dk) { return dk / 16 < kWarps ? dk / 16 : kWarps; }
KILN_HOST_DEVICE constexpr int p5_col_tiles(int dk, int dvt) { return (dvt / 8) * p5_row_warps(dk) / kWarps; }
KILN_HOST_DEVICE constexpr Tile p5_tile(int warp, int u, int dk, int dvt) {
  return {16 * (warp % p5_row_warps(dk)), 8 * ((warp / p5_row_warps(dk)) * p5_col_tiles(dk, dvt) + u)};
}
template <class L>
KILN_HOST_DEVICE constexpr int p5_a_offset(int set, int d, int i) {  // K'[d][i]
  return L::kqs + d * L::ldk + L::k_col(set) + i;
}
template <class L>
KILN_HOST_DEVICE constexpr int p5_s_offset(int d, int c) {  // S[d][c]
  return L::kqs + d * L::ldk + L::s_col + c;
}

// ==== the split form (deltanet_chunked_split.cu): a per-chunk preparation kernel, parallel over (chunk, value head,
// sequence), then the inter-chunk scan, a block per (sequence, value head, 32 value columns). Both reuse the tilings
// above: the preparation runs phase 1's key tiles (k.k and q.k) and phase 4's tiling for T [bs k | beta v]; the scan
// runs phase 4's row / column split for [W; q] S and P X, and phase 5's for the state update.

// The key dim as the kernels pad it: 32, 64 or 128 (Dk <= 128).
KILN_HOST_DEVICE constexpr int chunk_key_tile(long long Dk) { return Dk <= 32 ? 32 : (Dk <= 64 ? 64 : 128); }

// The global workspace between the two kernels, in floats, per value head h: W [rows][dk], U [rows][ldu], P
// [rows][64] and cs [rows], each array [Hv] of those, every array starting at a multiple of 64 floats (256 bytes).
// Sequence s's chunk c takes rows tok0_s + 64 s + 64 c .. + 63 (tok0_s its first token): sequence s's
// ceil(n_s / 64) chunks fit before tok0_{s+1} + 64 (s + 1) = tok0_s + n_s + 64 + 64 s, so rows = T + 64 S. Every
// chunk's 64 rows are written by the preparation kernel (rows past the chunk's m tokens are exactly zero in W, U and P,
// cs_last in cs), so the scan copies whole 16-byte rows without masks. dk = chunk_key_tile(Dk) (W's columns past Dk
// are zero), ldu = Dv rounded up to 32 (U's columns past Dv are zero: the scan's 32-column tiles).
// For the 35B-A3B (Hv 32, Dk = Dv = 128) one 8192-token sequence: rows 8256, 32 x 8256 x (128 + 128 + 64 + 1)
// floats = 339,222,528 bytes (323.5 MiB): 41 KiB per token.
struct SplitWorkspace {
  long long rows, dk, ldu, w, u, p, cs, floats;
};
KILN_HOST_DEVICE constexpr long long align64(long long x) { return (x + 63) / 64 * 64; }
KILN_HOST_DEVICE constexpr SplitWorkspace split_workspace(long long T, long long S, long long Hv, long long Dk,
                                                         long long Dv) {
  SplitWorkspace x{};
  x.rows = T + kChunk * S;
  x.dk = chunk_key_tile(Dk);
  x.ldu = (Dv + 31) / 32 * 32;
  x.w = 0;
  x.u = align64(x.w + Hv * x.rows * x.dk);
  x.p = align64(x.u + Hv * x.rows * x.ldu);
  x.cs = align64(x.p + Hv * x.rows * kChunk);
  x.floats = align64(x.cs + Hv * x.rows);
  return x;
}
// The first row of sequence s's chunk c of head h (in rows of any of the four arrays).
KILN_HOST_DEVICE constexpr long long split_row(const SplitWorkspace& x, int h, int tok0, int s, int c) {
  return x.rows * h + tok0 + kChunk * (s + c);
}

// ---- kernel 1 (preparation), one chunk of one value head. Shared memory in floats: kqs as Layout's (row d: k[0..64)
// [d], then q[0..64)[d], which a value tile transposed (v[0..64)[c] in row c) replaces once G is done), A (gated
// k.k, then M_b = T_bb A_b,<b in place, as the single kernel's solve), T = (I + A)^-1, the diagonal inverses, gates.
// Strides as the tensor-core Layout: kqs 8 mod 32 (phase 1's fragments conflict-free; T [bs k | beta v]'s B fragments
// read it the other way, row = key dim / value column g, column = token t: bank 8 g + t, 2-way, as phase 5's A), a
// and t 4 mod 32 (A fragments row g, column t).
// Dk 128: 107 KB, two blocks per SM.
template <int DK>
struct PrepLayout {
  static_assert(DK == 32 || DK == 64 || DK == 128, "key dim tile");
  static constexpr int q_col = kChunk;      // q, later the value tile transposed
  static constexpr int s_col = 2 * kChunk;  // no state here: p1_b_offset's state columns are never asked for
  static constexpr int ldk = 2 * kChunk + 8;
  static constexpr int lda = kChunk + 4;
  static constexpr int kqs = 0;                     // [DK][ldk]
  static constexpr int a = kqs + DK * ldk;          // [64][lda] A, M_b left of the diagonal blocks
  static constexpr int t = a + kChunk * lda;        // [64][lda] T, lower triangular (above: never read)
  static constexpr int tbb = t + kChunk * lda;      // [4][16][16] (I + A_bb)^-1
  static constexpr int graw = tbb + 4 * kSub * kSub;  // [64] g
  static constexpr int beta = graw + kChunk;        // [64]
  static constexpr int cs = beta + kChunk;          // [64] cumulative log-decay
  static constexpr int bs = cs + kChunk;            // [64] beta_i e^cs_i
  static constexpr int floats = bs + kChunk;
  static constexpr unsigned long bytes = static_cast<unsigned long>(floats) * sizeof(float);
  static_assert(ldk % 32 == 8 && lda % 32 == 4, "strides (bank spread)");
  static constexpr KILN_HOST_DEVICE int k_col(int) { return 0; }
};
// T [bs k | beta v] = [W | U] on phase 4's tiling (p4_tile with DK / 32 column tiles per row tile, p4_k_end): A is
// T[i][j], B the right-hand side at (token j, column c): column block `col_base` 0 (k: c a key dim) or q_col (the
// value tile: c a value column), scaled by bs_j / beta_j as it is converted.
template <class L>
KILN_HOST_DEVICE constexpr int prep_t_offset(int i, int j) {
  return L::t + i * L::lda + j;
}
template <class L>
KILN_HOST_DEVICE constexpr int prep_rhs_offset(int col_base, int j, int c) {
  return L::kqs + c * L::ldk + col_base + j;
}
// The off-diagonal blocks of T, one sub-diagonal per step d = 1, 2, 3 (every block of a sub-diagonal depends on the
// ones nearer the diagonal only): T_bc = -sum_{c <= j' < b} M_bj' T_j'c with c = b - d, 256 elements per block,
// (4 - d) blocks. Element e (< 256 (4 - d)) of step d: block b = d + e / 256, row 16 b + (e % 256) / 16, column
// 16 (b - d) + e % 16. Thread tid takes e = tid + 256 n.
struct Elem {
  int row, col, j_begin, j_end;  // T[row][col] = -sum_{j_begin <= j < j_end} M[row][j] T[j][col]
};
KILN_HOST_DEVICE constexpr int prep_t_step_elems(int d) { return kSub * kSub * (4 - d); }
KILN_HOST_DEVICE constexpr Elem prep_t_step_elem(int d, int e) {
  const int b = d + e / (kSub * kSub), c = b - d, r = (e % (kSub * kSub)) / kSub;
  return {kSub * b + r, kSub * c + e % kSub, kSub * c, kSub * b};
}

// ---- kernel 2 (scan), one block per (sequence, value head, 32 value columns). Per chunk, with S the block's
// [DK, 32] state slice (fp32, shared):
//   (a) G = [W; q] S (rows 0..63 W, 64..127 q) -> X = U - G_W (shared), O = e^cs G_q (registers)
//   (b) out = O + P X                              phase 4's tiling: the warp holds O for its own tiles
//   (c) S = e^cs_last S + K'^T X, K'[i][d] = k_i[d] e^(cs_last - cs_i)   phase 5's tiling
// Warp w's tiles in (a): W rows and q rows of phase 4's row tiles (w & 1, 3 - (w & 1)) x column tile w >> 1, so the
// O it keeps is the one its (b) tiles need. Shared memory in floats: W and q double-buffered (set ci & 1: the next
// chunk's land while this chunk runs), k, U and P single (each copied while the phase before its readers runs), S,
// X, cs (two halves), the decays e^(cs_last - cs_i). Strides: W / q 4 mod 32 (A fragments row g, column t), k 8 mod
// 32 (read transposed: row t, column g), U / X / S 8 mod 32 (B fragments row t, column g; float2 stores of
// accumulators conflict-free per half warp), P 4 mod 32. Dk 128: 223.75 KB (the H100's / H200's opt-in limit is
// 227 KB); Dk 64: 133.75 KB; Dk 32: 88.75 KB (within the 99 KB parts).
template <int DK>
struct ScanLayout {
  static_assert(DK == 32 || DK == 64 || DK == 128, "key dim tile");
  static constexpr int dvt = 32;
  static constexpr int ldw = DK + 4;    // rows of W and q
  static constexpr int ldk = DK + 8;    // rows of k
  static constexpr int ldv = dvt + 8;   // rows of U, X, S
  static constexpr int ldp = kChunk + 4;
  static constexpr int w = 0;                              // [2][64][ldw]
  static constexpr int q = w + 2 * kChunk * ldw;           // [2][64][ldw]
  static constexpr int k = q + 2 * kChunk * ldw;           // [64][ldk]
  static constexpr int u = k + kChunk * ldk;               // [64][ldv]
  static constexpr int p = u + kChunk * ldv;               // [64][ldp]
  static constexpr int s = p + kChunk * ldp;               // [DK][ldv]
  static constexpr int x = s + DK * ldv;                   // [64][ldv]
  static constexpr int cs = x + kChunk * ldv;              // [2][64]
  static constexpr int dec = cs + 2 * kChunk;              // [64] e^(cs_last - cs_i)
  static constexpr int floats = dec + kChunk;
  static constexpr unsigned long bytes = static_cast<unsigned long>(floats) * sizeof(float);
  static_assert(ldw % 32 == 4 && ldk % 32 == 8 && ldv % 32 == 8 && ldp % 32 == 4, "strides (bank spread)");
};
// (a)'s tiles: mi 0, 1 W rows of phase 4's row tiles mi, mi 2, 3 q rows (64 + that), column tiles as phase 4's.
KILN_HOST_DEVICE constexpr Tile scan_g_tile(int warp, int mi, int u) {
  const Tile t = p4_tile(warp, mi & 1, u);
  return {kChunk * (mi >> 1) + t.row, t.col};
}
template <class L>
KILN_HOST_DEVICE constexpr int scan_g_a_offset(int set, int R, int d) {  // [W; q][R][d]
  return (R < kChunk ? L::w + R * L::ldw : L::q + (R - kChunk) * L::ldw) + set * kChunk * L::ldw + d;
}
template <class L>
KILN_HOST_DEVICE constexpr int scan_s_offset(int d, int c) {  // S[d][c]
  return L::s + d * L::ldv + c;
}
template <class L>
KILN_HOST_DEVICE constexpr int scan_u_offset(int i, int c) {  // U[i][c]
  return L::u + i * L::ldv + c;
}
template <class L>
KILN_HOST_DEVICE constexpr int scan_x_offset(int i, int c) {  // X[i][c], (b)'s and (c)'s B
  return L::x + i * L::ldv + c;
}
template <class L>
KILN_HOST_DEVICE constexpr int scan_p_offset(int i, int j) {  // P[i][j], (b)'s A
  return L::p + i * L::ldp + j;
}
template <class L>
KILN_HOST_DEVICE constexpr int scan_k_offset(int d, int i) {  // k_i[d] (unscaled), (c)'s A at (d, i)
  return L::k + i * L::ldk + d;
}

}  // namespace kiln::cuda::ops::delta_chunked
