// The NVFP4 routed experts of prefill-sized steps on Hopper's warpgroup MMA (moe_prefill_wgmma.cu through
// CudaOps::moe_experts(_shared), --moe-runner-backend kiln-wgmma) against the CPU backend, at the real layer shapes:
// Qwen3.5-35B-A3B (H 2048, 256 experts, top-8, I 512), Qwen3.5-397B-A17B whole and one rank of it at TP 2 and TP 8
// (H 4096, 512 experts, top-10, I 1024 / 512 / 128) and a small shape whose K walks an odd number of 128-k blocks (H 384) and whose steps take both row
// tiles (64 and 128); an expert-parallel rank; a captured step. And, host-only, the index maps of
// moe_wgmma_layout.h that the kernel uses: emulated here the way the hardware reads them.
// The GPU tests skip without an sm_90 GPU.
//
// Tolerance: --dtype bfloat16's expert budget (op_check.h, kBf16InputTol = 1e-2), and above 2e-4 (the bf16 rounding
// of x, silu(gate) * up and the expert outputs happened): ~3e-3 expected, as the cuBLAS path.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/moe_prefill_wgmma.h"
#include "backend/cuda/moe_wgmma_layout.h"
#include "moe_test_util.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

namespace kops = ::kiln::cuda::ops;
namespace wl = ::kiln::cuda::ops::wgmma_layout;
using model::ExpertWeights;
using test::HostExperts;
using test::LayerShape;
using test::make_experts;
using test::place;
using test::read;
using test::rel_err;

// ---- the index maps (host-only)

// Logical k <-> physical k is a permutation of each 128-k block.
TEST(MoeWgmmaLayout, PermutationOfEachBlock) {
  std::set<int> seen;
  for (int L = 0; L < wl::kKBlock; ++L) {
    const int p = wl::phys_k(L);
    ASSERT_GE(p, 0);
    ASSERT_LT(p, wl::kKBlock);
    EXPECT_EQ(wl::logical_k(p), L);
    seen.insert(p);
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(wl::kKBlock));
}

// The kernel's A fragments, emulated: lane (g, t) of a warp holds, for k-step s, register 0 = (row g, logical k 2t,
// 2t + 1), register 2 = (row g, logical k 2t + 8, 2t + 9) (the mma.m16n8k16 / wgmma A layout; registers 1 and 3 the
// same for row g + 8). decode_block fills them from word j = s / 2 of the lane's 16 bytes with e2m1_pair_bits<kI>,
// kI = 2 (s % 2) + half, which puts code kI in the low and code kI + 4 in the high bf16. So the code of (s, half, e)
// is 8 j + kI + 4 e of the lane's 32, physical k 32 t + that; the activations at logical k must be x at that k.
TEST(MoeWgmmaLayout, DecodedFragmentsMeetTheirActivations) {
  for (int t = 0; t < 4; ++t)
    for (int s = 0; s < 8; ++s)
      for (int half = 0; half < 2; ++half)
        for (int e = 0; e < 2; ++e) {
          const int kI = 2 * (s % 2) + half;
          const int code = 8 * (s / 2) + kI + 4 * e;  // what decode_block's pair_bits<kI> of word s / 2 holds
          EXPECT_EQ(wl::lane_code(s, half, e), code);
          const int logical = 16 * s + 8 * half + 2 * t + e;
          EXPECT_EQ(wl::phys_k(logical), 32 * t + code) << "t " << t << " s " << s << " half " << half << " e " << e;
          // The lane's scale byte: code / 16 of its two (16-code blocks), i.e. block (32 t + code) / 16 of the row.
          EXPECT_EQ((32 * t + code) / 16, 2 * t + (s / 2) / 2);
        }
}

// The stage layout against the hardware's reading of a 128-byte-swizzled K-major descriptor: k-step s of row n is
// read at start (kstep_offset) + 1024 (n / 8) + 128 (n % 8) + byte b of the 32, with address bits 4-6 XORed by bits
// 7-9 (the stage is 1024-byte aligned). Every (row, logical k) element lives in its own 2 bytes, and 8 consecutive
// logical k of a row share a 16-byte chunk (the cp.async unit).
TEST(MoeWgmmaLayout, StageMatchesTheSwizzledDescriptor) {
  for (int rows : {64, 128}) {
    std::set<uint32_t> used;
    for (int n = 0; n < rows; ++n)
      for (int s = 0; s < 8; ++s)
        for (int b = 0; b < 32; b += 2) {
          const uint32_t addr = wl::kstep_offset(s, rows) + 1024 * (n / 8) + 128 * (n % 8) + b;
          const uint32_t hw = addr ^ (((addr >> 7) & 7) << 4);
          const int L = 16 * s + b / 2;
          EXPECT_EQ(hw, wl::stage_offset(n, L, rows)) << "rows " << rows << " n " << n << " L " << L;
          used.insert(wl::stage_offset(n, L, rows));
          EXPECT_EQ(wl::stage_offset(n, L, rows) - wl::stage_offset(n, L & ~7, rows), static_cast<uint32_t>(2 * (L & 7)));
        }
    EXPECT_EQ(used.size(), static_cast<size_t>(rows * 128));
    EXPECT_LT(*used.rbegin(), static_cast<uint32_t>(rows * 256));
  }
}

// Gate/up blocks: every intermediate feature is some block's row exactly once, and its output position is logical.
TEST(MoeWgmmaLayout, GateUpBlocksCoverEveryFeatureOnce) {
  for (int I : {128, 512}) {
    std::vector<int> hits(static_cast<size_t>(I), 0);
    for (int fb = 0; fb < I / 64; ++fb)
      for (int m = 0; m < 64; ++m) {
        const int f = wl::gate_up_feature(fb, m);
        ASSERT_GE(f, 0);
        ASSERT_LT(f, I);
        ++hits[static_cast<size_t>(f)];
        const int L = 64 * fb + m;  // where the block writes it
        EXPECT_EQ(f, (L / 128) * 128 + wl::phys_k(L % 128));
      }
    for (int h : hits) EXPECT_EQ(h, 1);
  }
}

TEST(MoeWgmmaLayout, TileRowsAndWorkspace) {
  EXPECT_EQ(kops::moe_prefill_wgmma_tile_rows(4096, 8, 256), 128);  // 35B-A3B: 128 rows per expert on average
  EXPECT_EQ(kops::moe_prefill_wgmma_tile_rows(2048, 8, 256), 64);
  EXPECT_EQ(kops::moe_prefill_wgmma_tile_rows(4096, 10, 512), 64);  // 397B TP-8 rank: 80
  // --moe-wgmma-tile-rows pins one; 0 (or anything else) picks.
  EXPECT_EQ(kops::moe_prefill_wgmma_tile_rows(4096, 8, 256, 64), 64);
  EXPECT_EQ(kops::moe_prefill_wgmma_tile_rows(16, 8, 256, 128), 128);
  EXPECT_EQ(kops::moe_prefill_wgmma_tile_rows(8192, 8, 256, 256), 256);  // experimental, pinned only
  EXPECT_EQ(kops::moe_prefill_wgmma_tile_rows(8192, 8, 256, 0), 128);
  EXPECT_FALSE(kops::moe_wgmma_down_walk_taken(4, 256, 128));  // a 256-row tile's activations: never
  EXPECT_EQ(kops::moe_prefill_wgmma_tile_rows(4096, 8, 256, 0), 128);
  EXPECT_GT(kops::moe_prefill_wgmma_workspace_bytes(8192, 8, 256, 2048, 512, 64),
            kops::moe_prefill_wgmma_workspace_bytes(8192, 8, 256, 2048, 512, 128));  // a longer tile list
  // Within what the memory plan reserves for the experts (moe_workspace_bytes), at the shapes it runs.
  for (const LayerShape& s : {LayerShape{"35B", 2048, 256, 512, 8}, LayerShape{"397B tp8", 4096, 512, 128, 10},
                              LayerShape{"small", 384, 16, 256, 4}})
    for (int64_t T : {1, 8, 256, 1024, 4096, 8192}) {
      const size_t wg = kops::moe_prefill_wgmma_workspace_bytes(T, s.top_k, s.experts, s.hidden, s.inter);
      EXPECT_LE(wg, kops::moe_workspace_bytes(T, s.top_k, s.experts, s.hidden, s.inter)) << s.name << " T=" << T;
      // x once per token, silu(gate) * up and the expert outputs per (token, slot) pair, in bf16.
      EXPECT_GT(wg, static_cast<size_t>((T * s.hidden + T * s.top_k * (s.hidden + s.inter)) * 2)) << s.name << " T=" << T;
    }
}

// The walking down GEMM's stores, emulated for a warpgroup: every lane's register i holds the value of (row, column)
// (acc_row, acc_col); each lane stores its pair with its own register and the one lane ^ 4 hands it (that lane's
// sent_reg). Every (row, column) of the 64 x N tile must be stored exactly once, with its own value, rows in
// adjacent pairs (a 4-byte store at an even row).
TEST(MoeWgmmaLayout, DownStoresCoverTheTileOnce) {
  for (int nt : {64, 128}) {
    std::vector<int> stored(static_cast<size_t>(64 * nt), 0);
    auto id = [&](int row, int col) { return col * 64 + row; };
    for (int warp = 0; warp < 4; ++warp)
      for (int lane = 0; lane < 32; ++lane)
        for (int i = 0; i < nt / 2; i += 2) {
          const int g = lane / 4, q = lane % 4, other_lane = lane ^ 4;
          const wl::PairStore p = wl::down_pair_store(warp, g, q, i);
          const wl::PairStore o = wl::down_pair_store(warp, other_lane / 4, other_lane % 4, i);
          ASSERT_TRUE(p.own_reg == i || p.own_reg == i + 1);
          ASSERT_TRUE(o.sent_reg == i || o.sent_reg == i + 1);
          ASSERT_EQ(p.row % 2, 0);
          // What the two halves of this lane's store hold, by the registers' own (row, column).
          const int own = id(wl::acc_row(warp, g, p.own_reg), wl::acc_col(q, p.own_reg));
          const int got = id(wl::acc_row(warp, other_lane / 4, o.sent_reg), wl::acc_col(other_lane % 4, o.sent_reg));
          const int lo = p.own_low ? own : got, hi = p.own_low ? got : own;
          EXPECT_EQ(lo, id(p.row, p.col)) << "nt " << nt << " warp " << warp << " lane " << lane << " i " << i;
          EXPECT_EQ(hi, id(p.row + 1, p.col)) << "nt " << nt << " warp " << warp << " lane " << lane << " i " << i;
          ++stored[static_cast<size_t>(id(p.row, p.col))];
          ++stored[static_cast<size_t>(id(p.row + 1, p.col))];
        }
    for (int c : stored) EXPECT_EQ(c, 1) << "nt " << nt;
  }
}

// Where the walking down GEMM is taken: its shared memory is the tile's activations (rows x I bf16) plus 5 weight
// stages of 9 KiB plus 1 KiB of alignment; 64-row tiles must keep two blocks per multiprocessor (112.5 KiB each), 128-row
// tiles fit one (224 KiB: the 227 KiB a block may have, less its static shared memory).
TEST(MoeWgmmaLayout, DownWalkWhereItFits) {
  auto smem = [](int rows, int64_t I) { return rows * I * 2 + 5 * 9216 + 1024; };
  for (int rows : {64, 128})
    for (int64_t I = 128; I <= 2048; I += 128) {
      const int64_t limit = rows == 64 ? 115200 : 224 * 1024;
      EXPECT_EQ(kops::moe_wgmma_down_walk_taken(4, rows, I), smem(rows, I) <= limit) << rows << " " << I;
    }
  EXPECT_TRUE(kops::moe_wgmma_down_walk_taken(4, 64, 128));    // the 397B TP-8 rank
  EXPECT_TRUE(kops::moe_wgmma_down_walk_taken(2, 64, 512));    // the 35B-A3B, the 397B TP-2 rank
  EXPECT_TRUE(kops::moe_wgmma_down_walk_taken(8, 128, 512));
  EXPECT_FALSE(kops::moe_wgmma_down_walk_taken(4, 64, 1024));  // the 397B at TP 1: the one-block form
  EXPECT_FALSE(kops::moe_wgmma_down_walk_taken(4, 128, 1024));
  EXPECT_FALSE(kops::moe_wgmma_down_walk_taken(0, 64, 128));   // off
  EXPECT_FALSE(kops::moe_wgmma_down_walk_taken(1, 64, 128));   // a walk of one is the plain form
  EXPECT_FALSE(kops::moe_wgmma_down_walk_taken(4, 32, 128));   // no such tile
}

TEST(MoeWgmmaLayout, ServesNvfp4ExpertsOnSm90Only) {
  alignas(16) static uint8_t codes[64];
  std::vector<kops::WeightDesc> d(6);
  for (kops::WeightDesc& w : d) {
    w.kind = kops::WeightKind::nvfp4;
    w.data = codes;
    w.block_scale = codes;
  }
  EXPECT_TRUE(kops::moe_prefill_wgmma_supported(9, 0, 256, 128, 1, true, d.data(), 2));
  EXPECT_FALSE(kops::moe_prefill_wgmma_supported(12, 0, 256, 128, 1, true, d.data(), 2));  // sm_120: no wgmma
  EXPECT_FALSE(kops::moe_prefill_wgmma_supported(10, 0, 256, 128, 1, true, d.data(), 2));
  EXPECT_FALSE(kops::moe_prefill_wgmma_supported(9, 0, 256, 64, 1, true, d.data(), 2));   // I % 128
  EXPECT_FALSE(kops::moe_prefill_wgmma_supported(9, 0, 320, 128, 1, true, d.data(), 2));  // H % 128
  EXPECT_FALSE(kops::moe_prefill_wgmma_supported(9, 0, 256, 128, 0, true, d.data(), 2));  // bf16 experts
  EXPECT_FALSE(kops::moe_prefill_wgmma_supported(9, 0, 256, 128, 1, false, d.data(), 2));
  d[1].block_scale = codes + 2;  // the scales travel by 8-byte cp.async
  EXPECT_FALSE(kops::moe_prefill_wgmma_supported(9, 0, 256, 128, 1, true, d.data(), 2));
  d[1].block_scale = codes + 8;
  EXPECT_TRUE(kops::moe_prefill_wgmma_supported(9, 0, 256, 128, 1, true, d.data(), 2));
  d[4].bias = codes;
  EXPECT_FALSE(kops::moe_prefill_wgmma_supported(9, 0, 256, 128, 1, true, d.data(), 2));
}

// ---- the path on the GPU

using test::Inputs;
using test::make_inputs;
using test::Outputs;
using test::run;
using test::bf16_options;

// Calls of the wgmma GEMMs in a profile (kiln bench-engine --profile shows them under moe_experts).
int wgmma_rows(const std::vector<model::OpTime>& rows) {
  int n = 0;
  for (const model::OpTime& r : rows)
    if (r.nested && r.label.find("wgmma") != std::string::npos) n += static_cast<int>(r.calls);
  return n;
}

// Calls of the walking down GEMM.
int walk_rows(const std::vector<model::OpTime>& rows) {
  int n = 0;
  for (const model::OpTime& r : rows)
    if (r.nested && r.label.find("down wgmma walk") != std::string::npos) n += static_cast<int>(r.calls);
  return n;
}

#define KILN_REQUIRE_SM90(ops)                                                                   \
  do {                                                                                           \
    if ((ops).device().major != 9 || (ops).device().minor != 0) GTEST_SKIP() << "needs an sm_90 GPU"; \
  } while (0)

class MoePrefillWgmma : public ::testing::TestWithParam<LayerShape> {};

TEST_P(MoePrefillWgmma, MatchesCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s = GetParam();
  HostExperts host = make_experts(s, 31, 0, s.experts);
  // Gate and up of every third expert with different scale_2 (each warpgroup applies its own).
  for (int64_t e = 0; e < s.experts; e += 3) host.experts[static_cast<size_t>(e)].up.scale *= 1.5f;
  CudaOptions producer_options = bf16_options(MoePrefill::wgmma), walk2_options = producer_options,
              walk4_options = producer_options;
  producer_options.moe_wgmma_producer = true;
  walk2_options.moe_wgmma_down_walk = 2;  // the small shape's 3 feature blocks: a walk of 2, then one of 1
  walk4_options.moe_wgmma_down_walk = 4;
  walk4_options.moe_wgmma_narrow = true;  // with narrow MMAs on both GEMMs
  walk4_options.moe_group_wide = true;    // and the grouping over many blocks (rows within an expert reordered: the
                                          // outputs per row do not depend on it)
  CudaOptions narrow_options = bf16_options(MoePrefill::wgmma), tall_options = narrow_options;
  narrow_options.moe_wgmma_narrow = true;
  tall_options.moe_wgmma_tile_rows = 256;  // experimental 256-row tiles, with narrow MMAs
  tall_options.moe_wgmma_narrow = true;
  CudaOps wg(bf16_options(MoePrefill::wgmma)), by_step(bf16_options(MoePrefill::by_step)),
      mma(bf16_options(MoePrefill::mma)), producer(producer_options), walk2(walk2_options), walk4(walk4_options),
      narrow(narrow_options), tall(tall_options);
  KILN_REQUIRE_SM90(wg);
  auto cpu = make_cpu_backend();
  const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
  const std::vector<ExpertWeights> wg_experts = place(wg, host.experts), step_experts = place(by_step, host.experts),
                                   mma_experts = place(mma, host.experts),
                                   producer_experts = place(producer, host.experts),
                                   walk2_experts = place(walk2, host.experts), walk4_experts = place(walk4, host.experts),
                                   narrow_experts = place(narrow, host.experts), tall_experts = place(tall, host.experts);
  const bool small = s.hidden < 1024, large = s.hidden * s.inter >= int64_t(4096) * 512;
  for (int64_t T : small   ? std::vector<int64_t>{3, 256, 1024}
                   : large ? std::vector<int64_t>{256, 1024}  // the CPU reference's time
                           : std::vector<int64_t>{256, 1024, 4096}) {
    for (bool with_shared : {true, false}) {
      if (!with_shared && T != 256) continue;
      const int nt = kops::moe_prefill_wgmma_tile_rows(T, s.top_k, s.experts);
      const std::string label = std::string(s.name) + " T=" + std::to_string(T) + " tile " + std::to_string(nt) +
                                (with_shared ? " +shared" : "");
      SCOPED_TRACE(label);
      const Inputs in = make_inputs(s, T, 800 + T);
      ASSERT_TRUE(wg.profile_begin());
      const Outputs w = run(wg, wg_experts, s, in, with_shared);
      EXPECT_EQ(wgmma_rows(wg.profile_end()), 2);  // gate/up and down
      const Outputs ref = run(*cpu, cpu_experts, s, in, with_shared);
      const Outputs m = run(mma, mma_experts, s, in, with_shared);
      EXPECT_EQ(w.ids, ref.ids);
      const double vs_cpu = rel_err(w.out, ref.out), mma_vs_cpu = rel_err(m.out, ref.out);
      std::printf("[ wgmma    ] %s: rel-L2 vs cpu %.2e (mma kernels vs cpu %.2e), vs mma %.2e\n", label.c_str(),
                  vs_cpu, mma_vs_cpu, rel_err(w.out, m.out));
      EXPECT_LE(vs_cpu, kBf16InputTol);
      if (T > 8) EXPECT_GE(vs_cpu, 2e-4) << "no sign of the bf16 rounding";
      // Run again: the same bits (no races, no order dependence).
      const Outputs again = run(wg, wg_experts, s, in, with_shared);
      EXPECT_EQ(again.out, w.out);
      // The producer form: the same MMAs in the same order, so the same bits.
      EXPECT_EQ(run(producer, producer_experts, s, in, with_shared).out, w.out) << "--enable-wgmma-producer";
      // Narrow tiles: each column's sums are the same k-steps over the same inputs, only fewer columns per MMA; the
      // same bits are expected (a difference would mean the hardware's summation depends on N: then only the bound
      // against the CPU above holds, and this line says so).
      const Outputs nw = run(narrow, narrow_experts, s, in, with_shared);
      EXPECT_LE(rel_err(nw.out, ref.out), kBf16InputTol) << "--enable-wgmma-narrow-tiles";
      EXPECT_EQ(nw.out, w.out) << "--enable-wgmma-narrow-tiles: not bitwise the full-width MMAs' (rel-L2 "
                               << rel_err(nw.out, w.out) << ")";
      // 256-row tiles: each column's sums as in the shorter tiles.
      EXPECT_EQ(run(tall, tall_experts, s, in, with_shared).out, nw.out) << "--moe-wgmma-tile-rows 256";
      // The walking down GEMM: the same MMAs per feature block, its outputs stored from the accumulators: the same
      // bits. Where the activations fit (I <= 512 here) its kernel is the one that ran, else the plain form (the
      // profile's label says which). The walk of 4 also takes narrow MMAs.
      ASSERT_TRUE(walk4.profile_begin());
      EXPECT_EQ(run(walk4, walk4_experts, s, in, with_shared).out, nw.out) << "--moe-wgmma-down-walk 4";
      EXPECT_EQ(walk_rows(walk4.profile_end()), kops::moe_wgmma_down_walk_taken(4, nt, s.inter) ? 1 : 0);
      EXPECT_EQ(kops::moe_wgmma_down_walk_taken(4, nt, s.inter), s.inter <= 512);
      EXPECT_EQ(run(walk2, walk2_experts, s, in, with_shared).out, w.out) << "--moe-wgmma-down-walk 2";
      if (with_shared) {
        // auto: this path (bitwise) from kMoePrefillWgmmaMinTokens, the mma kernels (bitwise kiln-mma) below.
        const Outputs a = run(by_step, step_experts, s, in, with_shared);
        EXPECT_EQ(a.out, T >= kMoePrefillWgmmaMinTokens ? w.out : m.out);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, MoePrefillWgmma,
                         ::testing::Values(LayerShape{"Qwen35B_A3B", 2048, 256, 512, 8},
                                           LayerShape{"Qwen397B_A17B_Tp8Rank", 4096, 512, 128, 10},
                                           LayerShape{"Qwen397B_A17B_Tp2Rank", 4096, 512, 512, 10},
                                           LayerShape{"Qwen397B_A17B_Tp1", 4096, 512, 1024, 10},  // no down walk
                                           LayerShape{"Small_OddK", 384, 16, 256, 4}),
                         [](const ::testing::TestParamInfo<LayerShape>& info) { return std::string(info.param.name); });

// The wide grouping (--enable-wide-moe-grouping: count, scan and place over many blocks) against a host oracle and
// the one-block kernel: the same group and tile offsets (from the host's counts), every valid pair at a row of its own
// inside its expert's group with its token recorded there, invalid ids skipped. Rows within an expert may come in
// another order (nothing depends on it).
TEST(MoeGroupRows, WideGroupingEqualsTheOneBlockKernel) {
  KILN_REQUIRE_CUDA_DEVICE();
  struct Case {
    int64_t T;
    int k;
    int64_t E;
  };
  for (const Case c : {Case{8192, 8, 256}, Case{4096, 10, 512}, Case{3001, 4, 16}}) {
    SCOPED_TRACE("T=" + std::to_string(c.T) + " k=" + std::to_string(c.k) + " E=" + std::to_string(c.E));
    const int64_t P = c.T * c.k;
    std::mt19937_64 rng(77 + c.T);
    std::vector<int32_t> ids(static_cast<size_t>(P));
    for (int64_t t = 0; t < c.T; ++t) {
      std::vector<int32_t> all(static_cast<size_t>(c.E));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      for (int j = 0; j < c.k; ++j) ids[static_cast<size_t>(t * c.k + j)] = all[static_cast<size_t>(j)];
    }
    if (c.E == 16)  // a few ids outside [0, E): skipped
      for (int64_t p = 5; p < P; p += 97) ids[static_cast<size_t>(p)] = p % 2 ? -1 : static_cast<int32_t>(c.E);
    // The host oracle: counts, first rows, 64-row tiles.
    std::vector<int32_t> offset(static_cast<size_t>(c.E + 1), 0), tiles(static_cast<size_t>(c.E + 1), 0);
    for (int32_t e : ids)
      if (e >= 0 && e < c.E) ++offset[static_cast<size_t>(e) + 1];
    for (int64_t e = 0; e < c.E; ++e) {
      const int32_t n = offset[static_cast<size_t>(e) + 1];
      tiles[static_cast<size_t>(e) + 1] = tiles[static_cast<size_t>(e)] + (n + 63) / 64;
      offset[static_cast<size_t>(e) + 1] += offset[static_cast<size_t>(e)];
    }
    int32_t* d_ids = nullptr;
    ASSERT_EQ(cudaMalloc(&d_ids, ids.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    const size_t bytes = kops::moe_row_groups_bytes(c.T, c.k, c.E);
    for (bool wide : {false, true}) {
      SCOPED_TRACE(wide ? "wide" : "one block");
      void* ws = nullptr;
      ASSERT_EQ(cudaMalloc(&ws, bytes), cudaSuccess);
      const kops::MoeRowGroups g = kops::moe_group_rows(d_ids, c.T, c.k, c.E, ws, nullptr, wide);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto down = [](const int32_t* d, int64_t n) {
        std::vector<int32_t> h(static_cast<size_t>(n));
        EXPECT_EQ(cudaMemcpy(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        return h;
      };
      EXPECT_EQ(down(g.group_offset, c.E + 1), offset);
      EXPECT_EQ(down(g.tile_offset, c.E + 1), tiles);
      const std::vector<int32_t> tile_group = down(g.tile_group, tiles.back());
      for (int64_t e = 0; e < c.E; ++e)
        for (int32_t i = tiles[static_cast<size_t>(e)]; i < tiles[static_cast<size_t>(e) + 1]; ++i)
          ASSERT_EQ(tile_group[static_cast<size_t>(i)], e);
      const std::vector<int32_t> pos = down(g.pair_pos, P), tok = down(g.row_token, offset.back());
      std::vector<int> hits(static_cast<size_t>(offset.back()), 0);
      for (int64_t p = 0; p < P; ++p) {
        const int32_t e = ids[static_cast<size_t>(p)], r = pos[static_cast<size_t>(p)];
        if (e < 0 || e >= c.E) {
          EXPECT_EQ(r, -1) << "pair " << p;
          continue;
        }
        ASSERT_GE(r, offset[static_cast<size_t>(e)]) << "pair " << p;
        ASSERT_LT(r, offset[static_cast<size_t>(e) + 1]) << "pair " << p;
        EXPECT_EQ(tok[static_cast<size_t>(r)], p / c.k) << "pair " << p;
        ++hits[static_cast<size_t>(r)];
      }
      for (int h : hits) ASSERT_EQ(h, 1);
      cudaFree(ws);
    }
    cudaFree(d_ids);
  }
}

// An expert-parallel rank (experts [64, 128) of 256): pairs of the other experts contribute nothing, as on the CPU.
TEST(MoePrefillWgmmaExpertParallel, SkipsExpertsOfOtherRanks) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s{"ep", 2048, 256, 512, 8};
  const HostExperts host = make_experts(s, 32, 64, 128);
  CudaOps gpu(bf16_options(MoePrefill::wgmma));
  KILN_REQUIRE_SM90(gpu);
  auto cpu = make_cpu_backend();
  const std::vector<ExpertWeights> cpu_experts = place(*cpu, host.experts);
  const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts);
  const Inputs in = make_inputs(s, 1024, 900);
  const Outputs w = run(gpu, gpu_experts, s, in, true);
  const Outputs ref = run(*cpu, cpu_experts, s, in, true);
  EXPECT_EQ(w.ids, ref.ids);
  const double vs_cpu = rel_err(w.out, ref.out);
  std::printf("[ wgmma ep ] rel-L2 vs cpu %.2e\n", vs_cpu);
  EXPECT_LE(vs_cpu, kBf16InputTol);
}

// Nothing goes back to the host, so under kiln-wgmma a captured step runs the path too: the replayed graph gives the
// eager output bit for bit.
TEST(MoePrefillWgmmaCapture, CapturedStepMatchesEager) {
  KILN_REQUIRE_CUDA_DEVICE();
  const LayerShape s{"capture", 2048, 256, 512, 8};
  const HostExperts host = make_experts(s, 33, 0, s.experts);
  CudaOps gpu(bf16_options(MoePrefill::wgmma)), mma(bf16_options(MoePrefill::mma));
  KILN_REQUIRE_SM90(gpu);
  const std::vector<ExpertWeights> gpu_experts = place(gpu, host.experts), mma_experts = place(mma, host.experts);
  const Inputs in = make_inputs(s, 512, 901);
  const Outputs eager = run(gpu, gpu_experts, s, in, false);
  EXPECT_NE(eager.out, run(mma, mma_experts, s, in, false).out) << "kiln-wgmma took the mma kernels eagerly";
  EXPECT_EQ(test::run_captured(gpu, gpu_experts, s, in), eager.out);
}

}  // namespace
}  // namespace kiln::backend::cuda
