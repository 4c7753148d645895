// The tensor-core tiling of the chunked gated delta rule (src/backend/cuda/deltanet_chunked_tiles.h), checked on the
// host: no GPU needed. The kernel's own index maps (fragment coordinates, each warp's tiles, shared-memory offsets)
// drive an emulated warp mma.m16n8k8 whose fragment layout is written out here a second time from the PTX ISA
// tables; each phase's loop runs as the kernel runs it, for all 8 warps and every tile shape, on a shared-memory image
// where everything the phase must not read is NaN, and the result is compared with a plain triple loop. Integer
// inputs keep every product and sum exact, so a wrong mapping shows as a mismatch, not as rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/deltanet_chunked_tiles.h"

namespace kiln::cuda::ops::delta_chunked {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- the PTX ISA's mma.m16n8k8 .tf32 layout, written independently of the header: groupID = lane >> 2,
// threadID_in_group = lane % 4. A: row groupID for a0 / a2, + 8 for a1 / a3; col threadID_in_group for a0 / a1, + 4
// for a2 / a3. B: row threadID_in_group for b0, + 4 for b1; col groupID. C / D: row groupID for c0 / c1, + 8 for
// c2 / c3; col threadID_in_group * 2 + (i & 1).
Coord ptx_a(int lane, int i) {
  const int g = lane / 4, t = lane % 4;
  return {(i == 0 || i == 2) ? g : g + 8, (i == 0 || i == 1) ? t : t + 4};
}
Coord ptx_b(int lane, int i) { return {i == 0 ? lane % 4 : lane % 4 + 4, lane / 4}; }
Coord ptx_c(int lane, int i) { return {i < 2 ? lane / 4 : lane / 4 + 8, (lane % 4) * 2 + (i & 1)}; }

// One warp's mma: d += A B from the lanes' fragments, rebuilt through the PTX layout. Every A / B element must come
// from exactly one (lane, register). The products are summed in k order in fp32 (tf32 x tf32 products are exact in
// fp32; the integer tests' sums are exact in any order).
using FragA = float[32][4];
using FragB = float[32][2];
using FragC = float[32][4];
void warp_mma(FragC& d, const FragA& a, const FragB& b) {
  float A[16][8], B[8][8];
  int seen_a[16][8] = {}, seen_b[8][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const Coord x = ptx_a(lane, i);
      A[x.row][x.col] = a[lane][i];
      ++seen_a[x.row][x.col];
    }
    for (int i = 0; i < 2; ++i) {
      const Coord x = ptx_b(lane, i);
      B[x.row][x.col] = b[lane][i];
      ++seen_b[x.row][x.col];
    }
  }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 8; ++c) ASSERT_EQ(seen_a[r][c], 1);
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 8; ++c) ASSERT_EQ(seen_b[r][c], 1);
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const Coord x = ptx_c(lane, i);
      float s = d[lane][i];
      for (int k = 0; k < 8; ++k) s += A[x.row][k] * B[k][x.col];
      d[lane][i] = s;
    }
}

TEST(DeltaChunkedTiles, FragmentLayoutIsThePtxIsas) {
  int seen_a[16][8] = {}, seen_b[8][8] = {}, seen_c[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(a_frag(lane, i).row, ptx_a(lane, i).row) << lane << " a" << i;
      EXPECT_EQ(a_frag(lane, i).col, ptx_a(lane, i).col) << lane << " a" << i;
      EXPECT_EQ(c_frag(lane, i).row, ptx_c(lane, i).row) << lane << " c" << i;
      EXPECT_EQ(c_frag(lane, i).col, ptx_c(lane, i).col) << lane << " c" << i;
      ++seen_a[a_frag(lane, i).row][a_frag(lane, i).col];
      ++seen_c[c_frag(lane, i).row][c_frag(lane, i).col];
    }
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(b_frag(lane, i).row, ptx_b(lane, i).row) << lane << " b" << i;
      EXPECT_EQ(b_frag(lane, i).col, ptx_b(lane, i).col) << lane << " b" << i;
      ++seen_b[b_frag(lane, i).row][b_frag(lane, i).col];
    }
  }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 8; ++c) {
      EXPECT_EQ(seen_a[r][c], 1);
      EXPECT_EQ(seen_c[r][c], 1);
      if (r < 8) EXPECT_EQ(seen_b[r][c], 1);
    }
}

// ---- the tf32 rounding of cvt.rna.tf32.f32 (nearest, ties away from zero, 10 mantissa bits) and the kernel's split
float tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}
struct Split {
  float hi, lo;
};
Split split(float x, int parts) {
  const float hi = tf32(x);
  return {hi, parts == 3 ? tf32(x - hi) : 0.0f};
}
// d += a b as the kernel's mma_step does it: lo hi, hi lo, hi hi with 3 parts; hi hi with 1; parts 0: the raw values
// (the integer mapping tests).
void mma_step(FragC& d, const FragA& a, const FragB& b, int parts) {
  if (parts == 0) {
    warp_mma(d, a, b);
    return;
  }
  FragA ah, al;
  FragB bh, bl;
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < 4; ++i) {
      const Split s = split(a[l][i], parts);
      ah[l][i] = s.hi;
      al[l][i] = s.lo;
    }
    for (int i = 0; i < 2; ++i) {
      const Split s = split(b[l][i], parts);
      bh[l][i] = s.hi;
      bl[l][i] = s.lo;
    }
  }
  if (parts == 3) {
    warp_mma(d, al, bh);
    warp_mma(d, ah, bl);
  }
  warp_mma(d, ah, bh);
}

int random_int(std::mt19937& rng) { return static_cast<int>(rng() % 9) - 4; }

bool HasFatalFailureNow() { return ::testing::Test::HasFatalFailure(); }

// A shared-memory image of Layout<DK, DVT>, all NaN.
template <class L>
std::vector<float> poisoned() {
  return std::vector<float>(L::floats, kNaN);
}

// ---- phase 1: G = [k; q] [k^T | S] over the key dim, as chunk_products_tc runs it for every warp. k / q tokens past
// m and key dims past Dk are zero (as the loader stores them); the other k set, the pads and everything else are NaN.
template <int DK, int DVT>
void check_phase1(int set, int m, int Dk, uint32_t seed) {
  using L = Layout<DK, DVT, true>;
  const std::string where = "phase 1 DK " + std::to_string(DK) + " DVT " + std::to_string(DVT) + " set " +
                            std::to_string(set) + " m " + std::to_string(m) + " Dk " + std::to_string(Dk);
  std::mt19937 rng(seed);
  std::vector<float> sm = poisoned<L>();
  std::vector<float> K(kChunk * DK), Q(kChunk * DK), S(DK * DVT);  // [i][d], [i][d], [d][c]
  for (int d = 0; d < DK; ++d) {
    for (int i = 0; i < kChunk; ++i) {
      const bool ok = i < m && d < Dk;
      K[i * DK + d] = ok ? static_cast<float>(random_int(rng)) : 0.0f;
      Q[i * DK + d] = ok ? static_cast<float>(random_int(rng)) : 0.0f;
      sm[L::kqs + d * L::ldk + L::k_col(set) + i] = K[i * DK + d];
      sm[L::kqs + d * L::ldk + L::q_col + i] = Q[i * DK + d];
    }
    for (int c = 0; c < DVT; ++c) {
      S[d * DVT + c] = d < Dk ? static_cast<float>(random_int(rng)) : 0.0f;
      sm[L::kqs + d * L::ldk + L::s_col + c] = S[d * DVT + c];
    }
  }
  constexpr int NJ = p1_tiles(DVT), NC = kChunk + DVT;
  std::vector<float> G(2 * kChunk * NC, kNaN);
  std::vector<int> written(2 * kChunk * NC, 0);
  for (int warp = 0; warp < kWarps; ++warp) {
    const int row_x = p1_row_x(warp), row_y = p1_row_y(warp);
    FragC acc[NJ] = {};
    for (int k0 = 0; k0 < DK; k0 += 8) {
      FragA ax, ay;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) {
          const Coord f = a_frag(lane, e);
          ax[lane][e] = sm[p1_a_offset<L>(set, row_x + f.row, k0 + f.col)];
          ay[lane][e] = sm[p1_a_offset<L>(set, row_y + f.row, k0 + f.col)];
        }
      for (int j = 0; j < NJ; ++j) {
        const Tile t = p1_tile(warp, j);
        FragB b;
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 2; ++e) {
            const Coord f = b_frag(lane, e);
            b[lane][e] = sm[p1_b_offset<L>(set, k0 + f.row, t.col + f.col)];
          }
        mma_step(acc[j], p1_uses_y(warp, j) ? ay : ax, b, 0);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    for (int j = 0; j < NJ; ++j) {
      const Tile t = p1_tile(warp, j);
      ASSERT_TRUE(t.row == row_x || t.row == row_y) << where << " warp " << warp << " slot " << j;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) {
          const Coord f = c_frag(lane, e);
          const int R = t.row + f.row, C = t.col + f.col;
          ASSERT_TRUE(R >= 0 && R < 2 * kChunk && C >= 0 && C < NC) << where;
          G[R * NC + C] = acc[j][lane][e];
          ++written[R * NC + C];
        }
    }
    // The warp's row tile x is the one whose unneeded key columns it zeroes: every row tile is one warp's x.
    EXPECT_EQ(p1_first_unneeded_col(row_x), (row_x % kChunk) + 16) << where;
  }
  int x_owner[8] = {};
  for (int warp = 0; warp < kWarps; ++warp) ++x_owner[p1_row_x(warp) / 16];
  for (int r = 0; r < 8; ++r) EXPECT_EQ(x_owner[r], 1) << where << " row tile " << r;
  // Every needed element (state columns; key columns j below the row tile's end) exactly once, nothing else; and
  // equal to the triple loop.
  for (int R = 0; R < 2 * kChunk; ++R) {
    const float* x = R < kChunk ? &K[R * DK] : &Q[(R - kChunk) * DK];
    for (int C = 0; C < NC; ++C) {
      const bool needed = C >= kChunk || C < p1_first_unneeded_col(R - R % 16);
      ASSERT_EQ(written[R * NC + C], needed ? 1 : 0) << where << " R " << R << " C " << C;
      if (!needed) continue;
      float ref = 0.0f;
      for (int d = 0; d < DK; ++d) ref += x[d] * (C < kChunk ? K[C * DK + d] : S[d * DVT + C - kChunk]);
      ASSERT_EQ(G[R * NC + C], ref) << where << " R " << R << " C " << C;
    }
  }
  // The work is balanced: every warp issues the same number of mmas per 8 key dims.
  EXPECT_EQ(NJ, 5 + DVT / 8);
}

TEST(DeltaChunkedTiles, Phase1ProductMatchesTripleLoop) {
  for (int set = 0; set < 2; ++set) {
    check_phase1<32, 32>(set, 64, 32, 1);
    check_phase1<32, 64>(set, 17, 32, 2);
    check_phase1<64, 32>(set, 64, 40, 3);  // Dk 40: key dims 40..63 zero
    check_phase1<64, 64>(set, 1, 64, 4);
    check_phase1<128, 32>(set, 37, 100, 5);
    check_phase1<128, 64>(set, 64, 128, 6);
    if (HasFatalFailure()) return;
  }
}

// ---- phase 4: out = O + P V, as chunk_output_tc runs it. P is NaN right of each row tile's end (never read), V's
// other set NaN; only rows < m and columns < cols are stored.
template <int DK, int DVT>
void check_phase4(int set, int m, int cols, uint32_t seed) {
  using L = Layout<DK, DVT, true>;
  const std::string where = "phase 4 DK " + std::to_string(DK) + " DVT " + std::to_string(DVT) + " set " +
                            std::to_string(set) + " m " + std::to_string(m) + " cols " + std::to_string(cols);
  std::mt19937 rng(seed);
  std::vector<float> sm = poisoned<L>();
  for (int i = 0; i < kChunk; ++i) {
    for (int j = 0; j < p4_k_end(i - i % 16); ++j) sm[p4_a_offset<L>(i, j)] = static_cast<float>(random_int(rng));
    for (int c = 0; c < DVT; ++c) {
      sm[v_offset<L>(set, i, c)] = static_cast<float>(random_int(rng));
      sm[p4_o_offset<L>(i, c)] = static_cast<float>(random_int(rng));
    }
  }
  constexpr int NU = p4_col_tiles(DVT);
  const int64_t ld = DVT + 7;  // any row stride of out
  std::vector<float> out(kChunk * ld, kNaN);
  std::vector<int> written(kChunk * ld, 0);
  int steps[kWarps] = {};
  for (int warp = 0; warp < kWarps; ++warp) {
    FragC acc[2][NU];
    for (int mi = 0; mi < 2; ++mi)
      for (int u = 0; u < NU; ++u) {
        const Tile t = p4_tile(warp, mi, u);
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 4; ++e) {
            const Coord f = c_frag(lane, e);
            acc[mi][u][lane][e] = sm[p4_o_offset<L>(t.row + f.row, t.col + f.col)];
          }
      }
    for (int mi = 0; mi < 2; ++mi) {
      const int row = p4_tile(warp, mi, 0).row;
      for (int k0 = 0; k0 < p4_k_end(row); k0 += 8) {
        FragA a;
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 4; ++e) {
            const Coord f = a_frag(lane, e);
            a[lane][e] = sm[p4_a_offset<L>(row + f.row, k0 + f.col)];
          }
        for (int u = 0; u < NU; ++u) {
          const Tile t = p4_tile(warp, mi, u);
          ASSERT_EQ(t.row, row) << where;
          FragB b;
          for (int lane = 0; lane < 32; ++lane)
            for (int e = 0; e < 2; ++e) {
              const Coord f = b_frag(lane, e);
              b[lane][e] = sm[v_offset<L>(set, k0 + f.row, t.col + f.col)];
            }
          mma_step(acc[mi][u], a, b, 0);
          ++steps[warp];
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
    for (int mi = 0; mi < 2; ++mi)
      for (int u = 0; u < NU; ++u) {
        const Tile t = p4_tile(warp, mi, u);
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 4; ++e) {
            const Coord f = c_frag(lane, e);
            const int i = t.row + f.row, c = t.col + f.col;
            if (i < m && c < cols) {
              out[i * ld + c] = acc[mi][u][lane][e];
              ++written[i * ld + c];
            }
          }
      }
  }
  for (int warp = 1; warp < kWarps; ++warp) EXPECT_EQ(steps[warp], steps[0]) << where << " balance";
  for (int i = 0; i < kChunk; ++i)
    for (int c = 0; c < ld; ++c) {
      const bool inside = i < m && c < cols && c < DVT;
      ASSERT_EQ(written[i * ld + c], inside ? 1 : 0) << where << " i " << i << " c " << c;
      if (!inside) continue;
      float ref = sm[p4_o_offset<L>(i, c)];
      for (int j = 0; j < p4_k_end(i - i % 16); ++j) ref += sm[p4_a_offset<L>(i, j)] * sm[v_offset<L>(set, j, c)];
      ASSERT_EQ(out[i * ld + c], ref) << where << " i " << i << " c " << c;
    }
}

TEST(DeltaChunkedTiles, Phase4OutputMatchesTripleLoop) {
  for (int set = 0; set < 2; ++set) {
    check_phase4<32, 32>(set, 64, 32, 11);
    check_phase4<32, 64>(set, 64, 64, 12);
    check_phase4<64, 32>(set, 37, 8, 13);     // a partial chunk; Dv 40: the second tile's 8 columns
    check_phase4<64, 64>(set, 1, 40, 14);     // one token; Dv 40 in one 64-column tile
    check_phase4<128, 32>(set, 63, 32, 15);
    check_phase4<128, 64>(set, 64, 64, 16);
    if (HasFatalFailure()) return;
  }
}

// ---- phase 5: S = e^cs_last S + K' V, as state_update_tc runs it: every S element of the tile updated exactly once.
template <int DK, int DVT>
void check_phase5(int set, uint32_t seed) {
  using L = Layout<DK, DVT, true>;
  const std::string where =
      "phase 5 DK " + std::to_string(DK) + " DVT " + std::to_string(DVT) + " set " + std::to_string(set);
  std::mt19937 rng(seed);
  std::vector<float> sm = poisoned<L>();
  for (int d = 0; d < DK; ++d) {
    for (int i = 0; i < kChunk; ++i) sm[p5_a_offset<L>(set, d, i)] = static_cast<float>(random_int(rng));
    for (int c = 0; c < DVT; ++c) sm[p5_s_offset<L>(d, c)] = static_cast<float>(random_int(rng));
  }
  for (int i = 0; i < kChunk; ++i)
    for (int c = 0; c < DVT; ++c) sm[v_offset<L>(set, i, c)] = static_cast<float>(random_int(rng));
  const std::vector<float> before = sm;
  constexpr float decay = 0.5f;
  constexpr int NT = p5_col_tiles(DK, DVT);
  std::vector<int> written(DK * DVT, 0);
  for (int warp = 0; warp < kWarps; ++warp) {
    const int row = p5_tile(warp, 0, DK, DVT).row;
    FragC acc[NT] = {};
    for (int k0 = 0; k0 < kChunk; k0 += 8) {
      FragA a;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) {
          const Coord f = a_frag(lane, e);
          a[lane][e] = sm[p5_a_offset<L>(set, row + f.row, k0 + f.col)];
        }
      for (int u = 0; u < NT; ++u) {
        const Tile t = p5_tile(warp, u, DK, DVT);
        ASSERT_EQ(t.row, row) << where;
        FragB b;
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 2; ++e) {
            const Coord f = b_frag(lane, e);
            b[lane][e] = sm[v_offset<L>(set, k0 + f.row, t.col + f.col)];
          }
        mma_step(acc[u], a, b, 0);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    for (int u = 0; u < NT; ++u) {
      const Tile t = p5_tile(warp, u, DK, DVT);
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) {
          const Coord f = c_frag(lane, e);
          const int d = t.row + f.row, c = t.col + f.col;
          ASSERT_TRUE(d < DK && c < DVT) << where;
          float& s = sm[p5_s_offset<L>(d, c)];
          s = std::fma(s, decay, acc[u][lane][e]);
          ++written[d * DVT + c];
        }
    }
  }
  for (int d = 0; d < DK; ++d)
    for (int c = 0; c < DVT; ++c) {
      ASSERT_EQ(written[d * DVT + c], 1) << where << " d " << d << " c " << c;
      float sum = 0.0f;
      for (int i = 0; i < kChunk; ++i) sum += before[p5_a_offset<L>(set, d, i)] * before[v_offset<L>(set, i, c)];
      ASSERT_EQ(sm[p5_s_offset<L>(d, c)], before[p5_s_offset<L>(d, c)] * decay + sum) << where << " d " << d;
    }
  // Nothing outside S changed.
  for (int x = 0; x < L::floats; ++x) {
    const bool in_s = x >= L::kqs && x < L::kqs + DK * L::ldk && (x - L::kqs) % L::ldk >= L::s_col &&
                      (x - L::kqs) % L::ldk < L::s_col + DVT;
    if (!in_s) ASSERT_TRUE(std::memcmp(&sm[x], &before[x], 4) == 0) << where << " offset " << x;
  }
}

TEST(DeltaChunkedTiles, Phase5StateUpdateMatchesTripleLoop) {
  for (int set = 0; set < 2; ++set) {
    check_phase5<32, 32>(set, 21);
    check_phase5<32, 64>(set, 22);
    check_phase5<64, 32>(set, 23);
    check_phase5<64, 64>(set, 24);
    check_phase5<128, 32>(set, 25);
    check_phase5<128, 64>(set, 26);
    if (HasFatalFailure()) return;
  }
}

// Every fragment load of the three phases reads 32 distinct banks of the tensor-core layout, except phase 5's A
// (kqs read as row g, column t against phase 1's row t, column g): at most 2 lanes per bank there.
template <int DK, int DVT>
void check_banks() {
  using L = Layout<DK, DVT, true>;
  for (int e = 0; e < 4; ++e)
    for (int warp = 0; warp < kWarps; ++warp)
      for (int set = 0; set < 2; ++set) {
        int bank[6][32] = {};
        for (int lane = 0; lane < 32; ++lane) {
          const Coord fa = a_frag(lane, e), fb = b_frag(lane, e & 1);
          ++bank[0][p1_a_offset<L>(set, p1_row_x(warp) + fa.row, 8 + fa.col) % 32];
          ++bank[1][p1_a_offset<L>(set, p1_row_y(warp) + fa.row, 8 + fa.col) % 32];
          ++bank[2][p1_b_offset<L>(set, 16 + fb.row, p1_tile(warp, p1_tiles(DVT) - 1).col + fb.col) % 32];
          ++bank[3][p4_a_offset<L>(p4_tile(warp, 1, 0).row + fa.row, 8 + fa.col) % 32];
          ++bank[4][v_offset<L>(set, 8 + fb.row, p4_tile(warp, 0, p4_col_tiles(DVT) - 1).col + fb.col) % 32];
          ++bank[5][p5_a_offset<L>(set, p5_tile(warp, 0, DK, DVT).row + fa.row, 24 + fa.col) % 32];
        }
        for (int x = 0; x < 6; ++x) {
          int worst = 0;
          for (int n : bank[x]) worst = std::max(worst, n);
          EXPECT_EQ(worst, x == 5 ? 2 : 1) << "DK " << DK << " DVT " << DVT << " load " << x << " register " << e
                                            << " warp " << warp;
        }
      }
}

TEST(DeltaChunkedTiles, FragmentLoadsAreBankConflictFree) {
  check_banks<32, 32>();
  check_banks<64, 64>();
  check_banks<128, 32>();
  check_banks<128, 64>();
}

// The tensor-core layout fits where the FMA kernel's does: the H100 / H200's 227 KB opt-in limit for every tile, the
// 99 KB parts for Dk <= 32 with 32 value columns.
TEST(DeltaChunkedTiles, TensorCoreLayoutKeepsTheSharedMemoryBudget) {
  constexpr unsigned long tc128 = Layout<128, 64, true>::bytes, fma128 = Layout<128, 64, false>::bytes;
  constexpr unsigned long tc32 = Layout<32, 32, true>::bytes, fma32x64 = Layout<32, 64, false>::bytes;
  EXPECT_LE(tc128, 227u * 1024);
  EXPECT_LE(tc32, 99u * 1024);
  EXPECT_GT(fma32x64, 99u * 1024);  // as before: 64 columns need the larger parts
  EXPECT_EQ(tc128 - fma128, 16u * 128 + 3072);
}

// The 3-part split (lo hi + hi lo + hi hi) through the emulated mma on a 16 x 8 x 64 product of random fp32 values
// of mixed magnitude: within a few fp32 ulps of the double product (relative to the sum of |products|), where one
// tf32 part is ~2^-11 per input. Checks the split and its order, not the hardware.
TEST(DeltaChunkedTiles, ThreeTf32PartsKeepFp32Accuracy) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<float> A(16 * 64), B(64 * 8);
  for (float& x : A) x = uni(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
  for (float& x : B) x = uni(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 9) - 4);
  double worst[4] = {};
  for (int parts : {1, 3}) {
    FragC d = {};
    for (int k0 = 0; k0 < 64; k0 += 8) {
      FragA a;
      FragB b;
      for (int lane = 0; lane < 32; ++lane) {
        for (int e = 0; e < 4; ++e) a[lane][e] = A[a_frag(lane, e).row * 64 + k0 + a_frag(lane, e).col];
        for (int e = 0; e < 2; ++e) b[lane][e] = B[(k0 + b_frag(lane, e).row) * 8 + b_frag(lane, e).col];
      }
      mma_step(d, a, b, parts);
    }
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const Coord f = c_frag(lane, e);
        double ref = 0, mag = 0;
        for (int k = 0; k < 64; ++k) {
          ref += double(A[f.row * 64 + k]) * B[k * 8 + f.col];
          mag += std::fabs(double(A[f.row * 64 + k]) * B[k * 8 + f.col]);
        }
        worst[parts] = std::max(worst[parts], std::fabs(d[lane][e] - ref) / mag);
      }
  }
  std::printf("[ tf32     ] worst |error| / sum |products|: 1 part %.2e, 3 parts %.2e\n", worst[1], worst[3]);
  EXPECT_LT(worst[3], 2e-6);
  EXPECT_GT(worst[1], 1e-5);  // the rounding happened
  EXPECT_LT(worst[1], 2e-3);  // 2 x 2^-11 per product at most
}

// ==== the split form (deltanet_chunked_split.cu): kernel 1's products and T's sub-diagonal steps, kernel 2's three
// products, each on its own shared layout, as the kernels run them.

// One warp's tile product over k steps [0, kend): acc += A[row + ..][k] B[k][col + ..] with the fragments read
// through a(R, k) / b(k, C) (shared offsets), each element converted by fa / fb (the kernels' scaling) before the
// emulated mma. Integer data: exact.
template <class AOff, class BOff, class AScale, class BScale>
void warp_tile_product(FragC& acc, const std::vector<float>& sm, int row, int col, int kend, AOff a, BOff b,
                       AScale fa, BScale fb) {
  for (int k0 = 0; k0 < kend; k0 += 8) {
    FragA fragA;
    FragB fragB;
    for (int lane = 0; lane < 32; ++lane) {
      for (int e = 0; e < 4; ++e) {
        const Coord f = a_frag(lane, e);
        fragA[lane][e] = fa(sm[a(row + f.row, k0 + f.col)], row + f.row, k0 + f.col);
      }
      for (int e = 0; e < 2; ++e) {
        const Coord f = b_frag(lane, e);
        fragB[lane][e] = fb(sm[b(k0 + f.row, col + f.col)], k0 + f.row, col + f.col);
      }
    }
    mma_step(acc, fragA, fragB, 0);
    if (::testing::Test::HasFatalFailure()) return;
  }
}
const auto kPlain = [](float x, int, int) { return x; };

// ---- kernel 1, stage 1: phase 1's key tiles on PrepLayout (k at column 0, q at q_col; no state columns): A and P
// need key columns below each row tile's end, every one computed once.
template <int DK>
void check_prep_products(int m, int Dk, uint32_t seed) {
  using L = PrepLayout<DK>;
  const std::string where = "prep products DK " + std::to_string(DK) + " m " + std::to_string(m);
  std::mt19937 rng(seed);
  std::vector<float> sm(L::floats, kNaN);
  std::vector<float> K(kChunk * DK), Q(kChunk * DK);
  for (int d = 0; d < DK; ++d)
    for (int i = 0; i < kChunk; ++i) {
      const bool ok = i < m && d < Dk;
      K[i * DK + d] = ok ? static_cast<float>(random_int(rng)) : 0.0f;
      Q[i * DK + d] = ok ? static_cast<float>(random_int(rng)) : 0.0f;
      sm[p1_a_offset<L>(0, i, d)] = K[i * DK + d];
      sm[p1_a_offset<L>(0, kChunk + i, d)] = Q[i * DK + d];
      ASSERT_EQ(p1_b_offset<L>(0, d, i), p1_a_offset<L>(0, i, d)) << where;
    }
  std::vector<int> written(2 * kChunk * kChunk, 0);
  for (int warp = 0; warp < kWarps; ++warp)
    for (int j = 0; j < p1_key_tiles(); ++j) {
      const Tile t = p1_tile(warp, j);
      ASSERT_LT(t.col, kChunk) << where;
      FragC acc = {};
      warp_tile_product(
          acc, sm, t.row, t.col, DK, [](int R, int d) { return p1_a_offset<L>(0, R, d); },
          [](int d, int C) { return p1_b_offset<L>(0, d, C); }, kPlain, kPlain);
      if (HasFatalFailureNow()) return;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) {
          const Coord f = c_frag(lane, e);
          const int R = t.row + f.row, C = t.col + f.col;
          const float* x = R < kChunk ? &K[R * DK] : &Q[(R - kChunk) * DK];
          float ref = 0.0f;
          for (int d = 0; d < DK; ++d) ref += x[d] * K[C * DK + d];
          ASSERT_EQ(acc[lane][e], ref) << where << " R " << R << " C " << C;
          ++written[R * kChunk + C];
        }
    }
  for (int R = 0; R < 2 * kChunk; ++R)
    for (int C = 0; C < kChunk; ++C)
      ASSERT_EQ(written[R * kChunk + C], C < p1_first_unneeded_col(R - R % 16) ? 1 : 0) << where << " R " << R << " C " << C;
}

TEST(DeltaChunkedTiles, SplitPrepProductsMatchTripleLoop) {
  check_prep_products<32>(64, 32, 31);
  check_prep_products<64>(37, 40, 32);
  check_prep_products<128>(1, 128, 33);
  check_prep_products<128>(64, 100, 34);
}

// ---- kernel 1, stages 4-7: T's diagonal blocks copied from tbb, then the three sub-diagonal steps. (a) the index
// maps on integers: every element below the diagonal blocks written exactly once, each step reading only what
// earlier steps wrote (everything else NaN), equal to the block recursion written plainly; (b) the algorithm on
// random A in double: with T_bb = (I + A_bb)^-1 and M_b = T_bb A_b,<b, the result is (I + A)^-1.
template <class Real>
void run_t_steps(std::vector<Real>& T, const std::vector<Real>& M, int ld) {
  for (int d = 1; d < 4; ++d) {
    std::vector<std::pair<int, Real>> out;
    for (int tid = 0; tid < kThreads; ++tid)
      for (int e = tid; e < prep_t_step_elems(d); e += kThreads) {
        const Elem x = prep_t_step_elem(d, e);
        Real sum = 0;
        for (int j = x.j_begin; j < x.j_end; ++j) sum += M[x.row * ld + j] * T[j * ld + x.col];
        out.push_back({x.row * ld + x.col, -sum});
      }
    for (const auto& [at, val] : out) T[at] = val;  // a step's writes land after its reads (as its barrier)
  }
}

TEST(DeltaChunkedTiles, SplitPrepSubDiagonalStepsBuildTheInverse) {
  using L = PrepLayout<128>;
  constexpr int ld = L::lda;
  std::mt19937 rng(41);
  // (a) integers
  std::vector<float> T(kChunk * ld, kNaN), M(kChunk * ld, kNaN);
  for (int b = 0; b < 4; ++b)
    for (int r = 0; r < kSub; ++r)
      for (int c = 0; c < kSub; ++c) T[(kSub * b + r) * ld + kSub * b + c] = c > r ? 0.0f : (c == r ? 1.0f : random_int(rng) % 2);
  for (int i = kSub; i < kChunk; ++i)
    for (int j = 0; j < i - i % kSub; ++j) M[i * ld + j] = static_cast<float>(random_int(rng) % 2);
  std::vector<int> seen(kChunk * kChunk, 0);
  for (int d = 1; d < 4; ++d)
    for (int e = 0; e < prep_t_step_elems(d); ++e) {
      const Elem x = prep_t_step_elem(d, e);
      ASSERT_EQ(x.row / kSub - x.col / kSub, d) << "step " << d << " e " << e;
      ++seen[x.row * kChunk + x.col];
    }
  for (int i = 0; i < kChunk; ++i)
    for (int j = 0; j < kChunk; ++j) ASSERT_EQ(seen[i * kChunk + j], j < i - i % kSub ? 1 : 0) << i << " " << j;
  std::vector<float> ref = T;
  for (int b = 1; b < 4; ++b)  // plain recursion, block row by block row
    for (int c = 0; c < b; ++c)
      for (int r = 0; r < kSub; ++r)
        for (int cc = 0; cc < kSub; ++cc) {
          float sum = 0;
          for (int j = kSub * c; j < kSub * b; ++j) sum += M[(kSub * b + r) * ld + j] * ref[j * ld + kSub * c + cc];
          ref[(kSub * b + r) * ld + kSub * c + cc] = -sum;
        }
  run_t_steps(T, M, ld);
  for (int i = 0; i < kChunk; ++i)
    for (int j = 0; j < i - i % kSub + kSub; ++j) ASSERT_EQ(T[i * ld + j], ref[i * ld + j]) << i << " " << j;

  // (b) the maths, in double: A strictly lower, |A_ij| < 0.3 / 8
  std::uniform_real_distribution<double> uni(-0.3 / 8, 0.3 / 8);
  std::vector<double> A(kChunk * ld, 0.0), Td(kChunk * ld, std::nan("")), Md(kChunk * ld, std::nan(""));
  for (int i = 0; i < kChunk; ++i)
    for (int j = 0; j < i; ++j) A[i * ld + j] = uni(rng);
  for (int b = 0; b < 4; ++b) {
    double tb[kSub][kSub];
    for (int c = 0; c < kSub; ++c) {  // (I + A_bb)^-1 column c by forward substitution
      double x[kSub];
      for (int r = 0; r < kSub; ++r) {
        x[r] = r == c ? 1.0 : 0.0;
        for (int j = 0; j < r; ++j) x[r] -= A[(kSub * b + r) * ld + kSub * b + j] * x[j];
      }
      for (int r = 0; r < kSub; ++r) tb[r][c] = x[r];
    }
    for (int r = 0; r < kSub; ++r) {
      for (int c = 0; c < kSub; ++c) Td[(kSub * b + r) * ld + kSub * b + c] = tb[r][c];
      for (int j = 0; j < kSub * b; ++j) {  // M_b = T_bb A_b,<b
        double sum = 0;
        for (int r2 = 0; r2 < kSub; ++r2) sum += tb[r][r2] * A[(kSub * b + r2) * ld + j];
        Md[(kSub * b + r) * ld + j] = sum;
      }
    }
  }
  run_t_steps(Td, Md, ld);
  double worst = 0;
  for (int i = 0; i < kChunk; ++i)
    for (int j = 0; j < kChunk; ++j) {  // ((I + A) T)_ij, T zero above the diagonal blocks
      double sum = 0;
      for (int l = j; l <= i; ++l) sum += ((l == i ? 1.0 : 0.0) + A[i * ld + l]) * Td[l * ld + j];
      worst = std::max(worst, std::fabs(sum - (i == j ? 1.0 : 0.0)));
    }
  EXPECT_LT(worst, 1e-12);
}

// ---- kernel 1, stage 8: [W | U] = T [bs k | beta v] on phase 4's tiling over PrepLayout: T NaN right of each row
// tile's diagonal block; the right-hand side read from kqs column block 0 (k) or q_col (the value tile, transposed),
// scaled per token; columns < cols stored, each once.
template <int DK>
void check_prep_rhs(int col_base, int cols, uint32_t seed) {
  using L = PrepLayout<DK>;
  const std::string where = "prep rhs DK " + std::to_string(DK) + " base " + std::to_string(col_base) + " cols " +
                            std::to_string(cols);
  std::mt19937 rng(seed);
  std::vector<float> sm(L::floats, kNaN), scale(kChunk);
  for (int i = 0; i < kChunk; ++i) {
    scale[i] = static_cast<float>(random_int(rng));
    for (int j = 0; j < p4_k_end(i - i % 16); ++j) sm[prep_t_offset<L>(i, j)] = static_cast<float>(random_int(rng));
    for (int c = 0; c < DK; ++c) sm[prep_rhs_offset<L>(col_base, i, c)] = static_cast<float>(random_int(rng));
  }
  constexpr int NU = p4_col_tiles(DK);
  std::vector<float> dst(kChunk * DK, kNaN);
  std::vector<int> written(kChunk * DK, 0);
  int steps[kWarps] = {};
  for (int warp = 0; warp < kWarps; ++warp)
    for (int mi = 0; mi < 2; ++mi)
      for (int u = 0; u < NU; ++u) {
        const Tile t = p4_tile(warp, mi, u);
        FragC acc = {};
        warp_tile_product(
            acc, sm, t.row, t.col, p4_k_end(t.row), [](int i, int j) { return prep_t_offset<L>(i, j); },
            [col_base](int j, int c) { return prep_rhs_offset<L>(col_base, j, c); }, kPlain,
            [&scale](float x, int j, int) { return x * scale[j]; });
        if (HasFatalFailureNow()) return;
        steps[warp] += p4_k_end(t.row) / 8;
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 4; ++e) {
            const Coord f = c_frag(lane, e);
            const int i = t.row + f.row, c = t.col + f.col;
            if (c >= cols) continue;
            dst[i * DK + c] = acc[lane][e];
            ++written[i * DK + c];
          }
      }
  for (int warp = 1; warp < kWarps; ++warp) EXPECT_EQ(steps[warp], steps[0]) << where << " balance";
  for (int i = 0; i < kChunk; ++i)
    for (int c = 0; c < DK; ++c) {
      ASSERT_EQ(written[i * DK + c], c < cols ? 1 : 0) << where << " i " << i << " c " << c;
      if (c >= cols) continue;
      float ref = 0.0f;
      for (int j = 0; j < p4_k_end(i - i % 16); ++j)
        ref += sm[prep_t_offset<L>(i, j)] * (sm[prep_rhs_offset<L>(col_base, j, c)] * scale[j]);
      ASSERT_EQ(dst[i * DK + c], ref) << where << " i " << i << " c " << c;
    }
}

TEST(DeltaChunkedTiles, SplitPrepRightHandSidesMatchTripleLoop) {
  check_prep_rhs<32>(0, 32, 51);
  check_prep_rhs<32>(PrepLayout<32>::q_col, 32, 52);
  check_prep_rhs<64>(0, 64, 53);
  check_prep_rhs<64>(PrepLayout<64>::q_col, 32, 54);  // the last value tile of Dv 96: 32 columns stored
  check_prep_rhs<128>(0, 128, 55);
  check_prep_rhs<128>(PrepLayout<128>::q_col, 128, 56);
}

// ---- kernel 2: (a) G = [W; q] S, (b) out = O + P X with the O of (a)'s q tiles, (c) S = decay S + K'^T X, on
// ScanLayout for both W / q sets. Everything a product must not read is NaN; every output once; triple loops.
template <int DK>
void check_scan(int set, int m, int cols, uint32_t seed) {
  using L = ScanLayout<DK>;
  constexpr int DVT = L::dvt, NU = p4_col_tiles(DVT), NT = p5_col_tiles(DK, DVT);
  const std::string where = "scan DK " + std::to_string(DK) + " set " + std::to_string(set) + " m " +
                            std::to_string(m) + " cols " + std::to_string(cols);
  std::mt19937 rng(seed);
  std::vector<float> sm(L::floats, kNaN), dec(kChunk);
  for (int i = 0; i < kChunk; ++i) {
    dec[i] = static_cast<float>(random_int(rng));
    for (int d = 0; d < DK; ++d) {
      sm[scan_g_a_offset<L>(set, i, d)] = static_cast<float>(random_int(rng));
      sm[scan_g_a_offset<L>(set, kChunk + i, d)] = static_cast<float>(random_int(rng));
      sm[scan_k_offset<L>(d, i)] = static_cast<float>(random_int(rng));
    }
    for (int j = 0; j < p4_k_end(i - i % 16); ++j) sm[scan_p_offset<L>(i, j)] = static_cast<float>(random_int(rng));
    for (int c = 0; c < DVT; ++c) sm[scan_u_offset<L>(i, c)] = static_cast<float>(random_int(rng));
  }
  for (int d = 0; d < DK; ++d)
    for (int c = 0; c < DVT; ++c) sm[scan_s_offset<L>(d, c)] = static_cast<float>(random_int(rng));
  const std::vector<float> before = sm;

  // (a), then X = U - G_W into shared (as the kernel's epilogue); the O tiles kept per warp.
  std::vector<int> g_written(2 * kChunk * DVT, 0);
  std::vector<float> O(kWarps * 2 * NU * 128);  // per (warp, row tile, column tile): a FragC
  for (int warp = 0; warp < kWarps; ++warp)
    for (int mi = 0; mi < 4; ++mi)
      for (int u = 0; u < NU; ++u) {
        const Tile t = scan_g_tile(warp, mi, u);
        if (mi >= 2) {
          const Tile o = p4_tile(warp, mi - 2, u);
          ASSERT_EQ(t.row, kChunk + o.row) << where;  // the O a warp keeps is the one its (b) tile needs
          ASSERT_EQ(t.col, o.col) << where;
        }
        FragC acc = {};
        warp_tile_product(
            acc, sm, t.row, t.col, DK, [set](int R, int d) { return scan_g_a_offset<L>(set, R, d); },
            [](int d, int c) { return scan_s_offset<L>(d, c); }, kPlain, kPlain);
        if (HasFatalFailureNow()) return;
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 4; ++e) {
            const Coord f = c_frag(lane, e);
            const int R = t.row + f.row, c = t.col + f.col;
            float ref = 0.0f;
            for (int d = 0; d < DK; ++d) ref += before[scan_g_a_offset<L>(set, R, d)] * before[scan_s_offset<L>(d, c)];
            ASSERT_EQ(acc[lane][e], ref) << where << " (a) R " << R << " c " << c;
            ++g_written[R * DVT + c];
            if (mi < 2) sm[scan_x_offset<L>(R, c)] = before[scan_u_offset<L>(R, c)] - acc[lane][e];
          }
        if (mi >= 2) std::memcpy(&O[((warp * 2 + mi - 2) * NU + u) * 128], &acc, sizeof(acc));
      }
  for (int x = 0; x < 2 * kChunk * DVT; ++x) ASSERT_EQ(g_written[x], 1) << where << " (a) element " << x;

  // (b)
  const int64_t ld = DVT + 3;
  std::vector<float> out(kChunk * ld, kNaN);
  std::vector<int> written(kChunk * ld, 0);
  for (int warp = 0; warp < kWarps; ++warp)
    for (int mi = 0; mi < 2; ++mi)
      for (int u = 0; u < NU; ++u) {
        const Tile t = p4_tile(warp, mi, u);
        FragC acc;
        std::memcpy(&acc, &O[((warp * 2 + mi) * NU + u) * 128], sizeof(acc));
        warp_tile_product(
            acc, sm, t.row, t.col, p4_k_end(t.row), [](int i, int j) { return scan_p_offset<L>(i, j); },
            [](int j, int c) { return scan_x_offset<L>(j, c); }, kPlain, kPlain);
        if (HasFatalFailureNow()) return;
        for (int lane = 0; lane < 32; ++lane)
          for (int e = 0; e < 4; ++e) {
            const Coord f = c_frag(lane, e);
            const int i = t.row + f.row, c = t.col + f.col;
            if (i < m && c < cols) {
              out[i * ld + c] = acc[lane][e];
              ++written[i * ld + c];
            }
          }
      }
  for (int i = 0; i < kChunk; ++i)
    for (int c = 0; c < ld; ++c) {
      const bool inside = i < m && c < cols && c < DVT;
      ASSERT_EQ(written[i * ld + c], inside ? 1 : 0) << where << " (b) i " << i << " c " << c;
      if (!inside) continue;
      float ref = 0.0f;
      for (int d = 0; d < DK; ++d)
        ref += before[scan_g_a_offset<L>(set, kChunk + i, d)] * before[scan_s_offset<L>(d, c)];
      for (int j = 0; j < p4_k_end(i - i % 16); ++j) ref += before[scan_p_offset<L>(i, j)] * sm[scan_x_offset<L>(j, c)];
      ASSERT_EQ(out[i * ld + c], ref) << where << " (b) i " << i << " c " << c;
    }

  // (c)
  const std::vector<float> mid = sm;
  constexpr float decay = 0.5f;
  std::vector<int> s_written(DK * DVT, 0);
  for (int warp = 0; warp < kWarps; ++warp) {
    const int row = p5_tile(warp, 0, DK, DVT).row;
    for (int u = 0; u < NT; ++u) {
      const Tile t = p5_tile(warp, u, DK, DVT);
      ASSERT_EQ(t.row, row) << where;
      FragC acc = {};
      warp_tile_product(
          acc, sm, t.row, t.col, kChunk, [](int d, int i) { return scan_k_offset<L>(d, i); },
          [](int i, int c) { return scan_x_offset<L>(i, c); }, [&dec](float x, int, int i) { return x * dec[i]; },
          kPlain);
      if (HasFatalFailureNow()) return;
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) {
          const Coord f = c_frag(lane, e);
          const int d = t.row + f.row, c = t.col + f.col;
          float& sv = sm[scan_s_offset<L>(d, c)];
          sv = std::fma(sv, decay, acc[lane][e]);
          ++s_written[d * DVT + c];
        }
    }
  }
  for (int d = 0; d < DK; ++d)
    for (int c = 0; c < DVT; ++c) {
      ASSERT_EQ(s_written[d * DVT + c], 1) << where << " (c) d " << d << " c " << c;
      float sum = 0.0f;
      for (int i = 0; i < kChunk; ++i) sum += (mid[scan_k_offset<L>(d, i)] * dec[i]) * mid[scan_x_offset<L>(i, c)];
      ASSERT_EQ(sm[scan_s_offset<L>(d, c)], mid[scan_s_offset<L>(d, c)] * decay + sum) << where << " (c) d " << d;
    }
}

TEST(DeltaChunkedTiles, SplitScanProductsMatchTripleLoop) {
  for (int set = 0; set < 2; ++set) {
    check_scan<32>(set, 64, 32, 61);
    check_scan<32>(set, 1, 8, 62);     // Dv 8: one masked tile
    check_scan<64>(set, 37, 32, 63);
    check_scan<128>(set, 64, 32, 64);
    check_scan<128>(set, 63, 17, 65);
    if (HasFatalFailure()) return;
  }
}

// The split form's fragment loads: all 32 banks distinct for every register of every warp (kernel 1: T's A; kernel
// 2: W / q's A, S's B, P's A, X's B, k's transposed A), except kernel 1's right-hand-side B, which reads kqs the other
// way from phase 1 (row g, column t: bank 8 g + t, as phase 5's A): at most 2 lanes per bank there.
template <int DK>
void check_split_banks() {
  using P = PrepLayout<DK>;
  using S = ScanLayout<DK>;
  for (int e = 0; e < 4; ++e)
    for (int warp = 0; warp < kWarps; ++warp) {
      int bank[9][32] = {};
      for (int lane = 0; lane < 32; ++lane) {
        const Coord fa = a_frag(lane, e), fb = b_frag(lane, e & 1);
        const Tile t4 = p4_tile(warp, 1, 0), t5 = p5_tile(warp, 0, DK, S::dvt);
        ++bank[0][prep_t_offset<P>(t4.row + fa.row, 8 + fa.col) % 32];
        ++bank[1][prep_rhs_offset<P>(0, 8 + fb.row, t4.col + fb.col) % 32];
        ++bank[2][prep_rhs_offset<P>(P::q_col, 8 + fb.row, t4.col + fb.col) % 32];
        for (int set = 0; set < 2; ++set) ++bank[3 + set][scan_g_a_offset<S>(set, scan_g_tile(warp, 2 + set, 0).row + fa.row, 8 + fa.col) % 32];
        ++bank[5][scan_s_offset<S>(16 + fb.row, scan_g_tile(warp, 0, 0).col + fb.col) % 32];
        ++bank[6][scan_p_offset<S>(t4.row + fa.row, 8 + fa.col) % 32];
        ++bank[7][scan_x_offset<S>(8 + fb.row, t5.col + fb.col) % 32];
        ++bank[8][scan_k_offset<S>(t5.row + fa.row, 8 + fa.col) % 32];
      }
      for (int x = 0; x < 9; ++x) {
        int worst = 0;
        for (int n : bank[x]) worst = std::max(worst, n);
        EXPECT_EQ(worst, x == 1 || x == 2 ? 2 : 1) << "DK " << DK << " load " << x << " register " << e << " warp "
                                                    << warp;
      }
    }
}

TEST(DeltaChunkedTiles, SplitFragmentLoadsAreBankConflictFree) {
  check_split_banks<32>();
  check_split_banks<64>();
  check_split_banks<128>();
}

// Shared memory: the preparation kernel runs two blocks per SM at Dk 128 (2 x (bytes + 1 KB reserved) within the
// H100's 228 KB); the scan fits the 227 KB opt-in limit at Dk 128 and the 99 KB parts at Dk 32.
TEST(DeltaChunkedTiles, SplitLayoutsKeepTheSharedMemoryBudget) {
  EXPECT_LE(2 * (PrepLayout<128>::bytes + 1024), 228u * 1024);
  EXPECT_LE(ScanLayout<128>::bytes, 227u * 1024);
  EXPECT_LE(ScanLayout<32>::bytes, 99u * 1024);
  EXPECT_LE(PrepLayout<32>::bytes, 99u * 1024);
  // cp.async 16-byte destinations: every buffer and row starts at a multiple of 4 floats.
  using S = ScanLayout<128>;
  for (int x : {S::w, S::q, S::k, S::u, S::p, S::s, S::x, S::cs, S::dec, S::ldw, S::ldk, S::ldv, S::ldp, S::ldw * kChunk})
    EXPECT_EQ(x % 4, 0) << x;
}

// The workspace: every sequence's chunks take rows of their own, inside `rows`; arrays 256-byte aligned; the size
// quoted for the 35B-A3B.
TEST(DeltaChunkedTiles, SplitWorkspaceRowsDoNotOverlap) {
  std::mt19937 rng(71);
  for (int trial = 0; trial < 200; ++trial) {
    const int S = 1 + static_cast<int>(rng() % 9);
    std::vector<int> lens(S), begin(S + 1, 0);
    for (int s = 0; s < S; ++s) {
      const int pick = static_cast<int>(rng() % 6);
      lens[s] = pick == 0 ? 0 : (pick == 1 ? 64 * static_cast<int>(rng() % 4) : static_cast<int>(rng() % 300));
      begin[s + 1] = begin[s] + lens[s];
    }
    const int Hv = 3;
    const SplitWorkspace wl = split_workspace(begin[S], S, Hv, 40, 40);
    std::vector<int> owner(wl.rows * Hv, -1);
    for (int h = 0; h < Hv; ++h)
      for (int s = 0; s < S; ++s)
        for (int c = 0; 64 * c < lens[s]; ++c)
          for (int i = 0; i < kChunk; ++i) {
            const long long r = split_row(wl, h, begin[s], s, c) + i;
            ASSERT_GE(r, wl.rows * h);
            ASSERT_LT(r, wl.rows * (h + 1));
            ASSERT_EQ(owner[r], -1) << "row " << r << " trial " << trial;
            owner[r] = s;
          }
    for (long long a : {wl.w, wl.u, wl.p, wl.cs, wl.floats}) EXPECT_EQ(a % 64, 0);
    EXPECT_GE(wl.u, wl.w + Hv * wl.rows * wl.dk);
    EXPECT_GE(wl.p, wl.u + Hv * wl.rows * wl.ldu);
    EXPECT_GE(wl.cs, wl.p + Hv * wl.rows * kChunk);
    EXPECT_GE(wl.floats, wl.cs + Hv * wl.rows);
  }
  const SplitWorkspace big = split_workspace(8192, 1, 32, 128, 128);
  EXPECT_EQ(big.floats * 4, 339222528LL);
  EXPECT_EQ(split_workspace(10, 1, 1, 17, 8).dk, 32);
  EXPECT_EQ(split_workspace(10, 1, 1, 17, 8).ldu, 32);
  EXPECT_EQ(split_workspace(10, 1, 1, 32, 96).ldu, 96);
}

}  // namespace
}  // namespace kiln::cuda::ops::delta_chunked
