// The tensor / expert-parallel shard plan against arithmetic written out from the model sizes (the bundled 397B and
// 35B configs, configs/) and against itself across ranks: every split tensor is partitioned exactly (each element
// on one rank), replicated ones are held whole by every rank, and the sums over ranks equal the full tensor times
// its replication.
#include "format/shard_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/error.h"

namespace kiln::format {
namespace {

struct Model {
  ModelConfig config;
  QuantConfig quant;
  std::vector<ExpectedTensor> tensors;
};
Model load(const std::string& dir) {
  ModelDir d = ModelDir::open(dir);
  Model m{load_model_config(d), load_quant_config(d), {}};
  m.tensors = expected_tensors(m.config, m.quant);
  return m;
}
Model bundled(const std::string& name) { return load(std::string(KILN_SOURCE_DIR) + "/configs/" + name); }
Model fixture(const std::string& name) {
  return load(std::string(KILN_SOURCE_DIR) + "/tests/fixtures/reference/" + name + "/model");
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// How many ranks hold each element of t, by an independent rule: the replication the sharding promises.
int64_t expected_copies(const Model& m, const ShardPlan& p, const ExpectedTensor& t, int64_t row) {
  const auto& c = m.config;
  const int tp = p.tp;
  const bool scalar = t.shape.ndim == 0 || t.name.ends_with("_scale_2") || t.name.ends_with("input_scale") ||
                      (t.name.ends_with("weight_scale") && t.shape.ndim < 2);
  if (t.role == role::kNorm || t.role == role::kRouter || t.role == role::kKvScale) return tp;
  if (t.role == role::kRoutedExpert) return scalar ? tp / p.ep : 1;  // scalars: on each rank of the expert's group
  if (scalar) return tp;
  if (t.role == role::kAttention && (t.name.find(".k_proj.") != std::string::npos ||
                                     t.name.find(".v_proj.") != std::string::npos))
    return p.kv_replicas;
  if (t.role == role::kLinearAttention &&
      (t.name.find("in_proj_qkv.") != std::string::npos || t.name.find("conv1d") != std::string::npos)) {
    const int64_t key_rows = 2 * int64_t(c.linear_num_key_heads) * c.linear_key_head_dim;
    return row < key_rows ? p.key_head_replicas : 1;  // q and k rows follow the key heads, v rows the value heads
  }
  if (t.role == role::kLinearAttention && t.name.find("in_proj_qkvz.") != std::string::npos) {
    // Per key-head group: [q_g | k_g] (key head) then [v_g | z_g] (its value heads).
    const int64_t dk = c.linear_key_head_dim, rv = c.linear_num_value_heads / c.linear_num_key_heads;
    const int64_t group = 2 * dk + 2 * rv * c.linear_value_head_dim;
    return row % group < 2 * dk ? p.key_head_replicas : 1;
  }
  return 1;
}

// Checks the plan tensor by tensor: exact cover with the expected multiplicity (element-wise through
// slice_source_index for tensors up to max_elems; by element counts for larger ones).
void check_cover(const Model& m, const ShardPlan& p, int64_t max_elems, int max_layer = 1 << 30) {
  for (const ExpectedTensor& t : m.tensors) {
    if (t.layer >= max_layer) continue;
    int64_t held_elems = 0;
    std::vector<int> count;
    const bool elementwise = t.shape.numel() <= max_elems;
    if (elementwise) count.assign(t.shape.numel(), 0);
    for (const RankShard& r : p.ranks) {
      const TensorSlice s = slice_tensor(m.config, r, t, t.shape);
      if (!s.held) continue;
      held_elems += s.shape.numel();
      if (elementwise)
        for (int64_t i = 0; i < s.shape.numel(); ++i) {
          const int64_t src = slice_source_index(s, t.shape, i);
          ASSERT_GE(src, 0);
          ASSERT_LT(src, t.shape.numel()) << t.name;
          ++count[src];
        }
    }
    const int64_t row_elems = t.shape.ndim >= 2 ? t.shape.numel() / t.shape[0] : 1;
    int64_t want_total = 0;
    const int64_t rows = t.shape.ndim >= 1 ? t.shape[0] : 1;
    const bool per_row = t.name.find("in_proj_qkv") != std::string::npos || t.name.find("conv1d") != std::string::npos;
    const int64_t copies0 = expected_copies(m, p, t, 0);
    if (!per_row && !elementwise) {
      EXPECT_EQ(held_elems, copies0 * t.shape.numel()) << t.name << " tp " << p.tp << " ep " << p.ep;
      continue;
    }
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t copies = per_row ? expected_copies(m, p, t, row) : copies0;
      want_total += copies * (t.shape.ndim >= 1 ? row_elems : 1);
      if (elementwise)
        for (int64_t e = 0; e < (t.shape.ndim >= 1 ? row_elems : 1); ++e)
          ASSERT_EQ(count[row * (t.shape.ndim >= 1 ? row_elems : 1) + e], copies)
              << t.name << " row " << row << " tp " << p.tp << " ep " << p.ep;
    }
    EXPECT_EQ(held_elems, want_total) << t.name << " tp " << p.tp << " ep " << p.ep;
  }
}

TEST(ShardPlan, Qwen35_397B_Ranks) {
  const Model m = bundled("qwen3.5-397b-a17b-nvfp4");
  // 32 q / 2 KV heads, 16 key / 64 value heads, 512 experts of 1024, shared 1024, vocab 248320.
  for (int tp : {1, 2, 4, 8}) {
    const ShardPlan p = plan_shards(m.config, m.quant, tp, 1);
    ASSERT_EQ(static_cast<int>(p.ranks.size()), tp);
    for (const RankShard& r : p.ranks) {
      EXPECT_EQ(r.q_heads, (Range{r.rank * (32 / tp), 32 / tp}));
      if (tp <= 2) EXPECT_EQ(r.kv_heads, (Range{r.rank * (2 / tp), 2 / tp}));
      else EXPECT_EQ(r.kv_heads, (Range{r.rank / (tp / 2), 1}));  // one replica per rank
      EXPECT_EQ(r.key_heads, (Range{r.rank * (16 / tp), 16 / tp}));
      EXPECT_EQ(r.value_heads, (Range{r.rank * (64 / tp), 64 / tp}));
      EXPECT_EQ(r.experts, (Range{0, 512}));
      EXPECT_EQ(r.expert_inter, (Range{r.rank * (1024 / tp), 1024 / tp}));
      EXPECT_EQ(r.shared_inter, (Range{r.rank * (1024 / tp), 1024 / tp}));
      EXPECT_EQ(r.vocab, (Range{r.rank * (248320 / tp), 248320 / tp}));
      const ModelConfig lc = rank_config(m.config, r);
      EXPECT_EQ(lc.num_attention_heads, 32 / tp);
      EXPECT_EQ(lc.num_kv_heads, tp <= 2 ? 2 / tp : 1);
      EXPECT_EQ(lc.linear_num_value_heads, 64 / tp);
      EXPECT_EQ(lc.moe_intermediate_size, 1024 / tp);
      EXPECT_EQ(lc.num_experts, 512);        // the router still scores every expert
      EXPECT_EQ(lc.vocab_size, 248320);      // token ids stay global
    }
    EXPECT_EQ(p.kv_replicas, tp <= 2 ? 1 : tp / 2);
    EXPECT_EQ(p.key_head_replicas, 1);
  }
  // EP: experts whole over the EP groups, each expert's intermediate over the group's tp / ep ranks.
  for (int ep : {2, 8}) {
    const ShardPlan p = plan_shards(m.config, m.quant, 8, ep);
    for (const RankShard& r : p.ranks) {
      const int group = 8 / ep;
      EXPECT_EQ(r.ep_rank, r.rank / group);
      EXPECT_EQ(r.experts, (Range{(r.rank / group) * (512 / ep), 512 / ep}));
      EXPECT_EQ(r.expert_inter, (Range{(r.rank % group) * (1024 / group), 1024 / group}));
      EXPECT_EQ(r.shared_inter, (Range{r.rank * 128, 128}));  // the shared expert always over all 8
    }
  }
}

TEST(ShardPlan, Qwen35_35B_Ranks) {
  const Model m = bundled("qwen3.5-35b-a3b-nvfp4");
  // 16 q / 2 KV heads, 16 key / 32 value heads, 256 experts of 512.
  for (int tp : {1, 2, 4, 8})
    for (int ep : {1, 2, 8}) {
      if (ep > tp) {
        EXPECT_THAT(error_of([&] { plan_shards(m.config, m.quant, tp, ep); }),
                    ::testing::HasSubstr(fmt::format("--ep-size {} must divide --tp-size {}", ep, tp)));
        continue;
      }
      const ShardPlan p = plan_shards(m.config, m.quant, tp, ep);
      for (const RankShard& r : p.ranks) {
        EXPECT_EQ(r.q_heads.count, 16 / tp);
        EXPECT_EQ(r.kv_heads.count, tp <= 2 ? 2 / tp : 1);
        EXPECT_EQ(r.key_heads.count, 16 / tp);
        EXPECT_EQ(r.value_heads.count, 32 / tp);
        EXPECT_EQ(r.experts.count, 256 / ep);
        EXPECT_EQ(r.expert_inter.count, 512 / (tp / ep));
      }
    }
}

TEST(ShardPlan, SumsOverRanksEqualTheFullTensors) {
  // By element counts on the big configs (one [linear x3, full] period of layers, every expert, embeddings, final
  // norm, lm_head), element by element up to 64K elements.
  const Model big = bundled("qwen3.5-397b-a17b-nvfp4");
  for (auto [tp, ep] : {std::pair{2, 1}, {8, 1}, {8, 8}})
    check_cover(big, plan_shards(big.config, big.quant, tp, ep), 1 << 16, 4);
  const Model mid = bundled("qwen3.5-35b-a3b-nvfp4");
  for (auto [tp, ep] : {std::pair{4, 1}, {8, 8}})
    check_cover(mid, plan_shards(mid.config, mid.quant, tp, ep), 1 << 16, 4);
}

TEST(ShardPlan, FixturesPartitionElementByElement) {
  // Every fixture family at the sizes it divides, every element of every tensor (with KV-head and key-head
  // replication at tp 4: 2 KV heads, 2 key heads).
  for (const char* name : {"qwen3_5_moe_bf16", "qwen3_5_moe_nvfp4", "qwen3_5_moe_nvfp4all", "qwen3_5_moe_mixed",
                           "qwen3_5_bf16", "qwen3_next_bf16", "qwen3_next_nvfp4", "qwen3_moe_bf16", "qwen3_bf16"}) {
    const Model m = fixture(name);
    for (auto [tp, ep] : {std::pair{2, 1}, {2, 2}, {4, 2}, {4, 4}}) {
      if (ep > 1 && !m.config.is_moe()) continue;
      ShardPlan p;
      try {
        p = plan_shards(m.config, m.quant, tp, ep);
      } catch (const Error& e) {
        continue;  // sizes this fixture cannot take (checked by name in Nvfp4BlocksAreNeverCut)
      }
      SCOPED_TRACE(fmt::format("{} tp {} ep {}", name, tp, ep));
      check_cover(m, p, 1 << 22);
    }
  }
}

TEST(ShardPlan, FusedDeltaNetGroupsKeepTheirHeads) {
  // qwen3_next in_proj_qkvz rows per key-head group g: [q_g 16 | k_g 16 | v_g 2x32 | z_g 2x32] (2 key heads,
  // 4 value heads). At tp 4 rank 1 holds key head 0 (replicated) and value head 1: q_0, k_0, v rows of head 1, z
  // rows of head 1.
  const Model m = fixture("qwen3_next_bf16");
  const ShardPlan p = plan_shards(m.config, m.quant, 4, 1);
  const RankShard& r = p.ranks[1];
  EXPECT_EQ(r.key_heads, (Range{0, 1}));
  EXPECT_EQ(r.value_heads, (Range{1, 1}));
  for (const ExpectedTensor& t : m.tensors) {
    if (t.name == "model.layers.0.linear_attn.in_proj_qkvz.weight") {
      const TensorSlice s = slice_tensor(m.config, r, t, t.shape);
      const int64_t group = 2 * 16 + 2 * 2 * 32;
      ASSERT_EQ(s.rows.size(), 3u);
      EXPECT_EQ(s.rows[0], (Range{0, 32}));                    // q_0 | k_0
      EXPECT_EQ(s.rows[1], (Range{32 + 32, 32}));              // v of value head 1 (second in group 0)
      EXPECT_EQ(s.rows[2], (Range{32 + 64 + 32, 32}));         // z of value head 1
      EXPECT_EQ(s.shape, (Shape{96, 64}));
      EXPECT_LT(s.rows[2].end(), group + 1);
    }
    if (t.name == "model.layers.0.linear_attn.in_proj_ba.weight") {
      const TensorSlice s = slice_tensor(m.config, r, t, t.shape);
      ASSERT_EQ(s.rows.size(), 2u);
      EXPECT_EQ(s.rows[0], (Range{1, 1}));  // b of value head 1
      EXPECT_EQ(s.rows[1], (Range{3, 1}));  // a of value head 1
    }
  }
}

TEST(ShardPlan, Qwen35InProjQkvSections) {
  // 397B at tp 8, rank 3: key heads 6-7, value heads 24-31 (128 dims each): q rows, k rows after 16 x 128, v rows
  // after 2 x 16 x 128; conv1d channels the same.
  const Model m = bundled("qwen3.5-397b-a17b-nvfp4");
  const ShardPlan p = plan_shards(m.config, m.quant, 8, 1);
  for (const ExpectedTensor& t : m.tensors) {
    if (t.name != "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" &&
        t.name != "model.language_model.layers.0.linear_attn.conv1d.weight")
      continue;
    const TensorSlice s = slice_tensor(m.config, p.ranks[3], t, t.shape);
    ASSERT_EQ(s.rows.size(), 3u) << t.name;
    EXPECT_EQ(s.rows[0], (Range{6 * 128, 2 * 128}));
    EXPECT_EQ(s.rows[1], (Range{2048 + 6 * 128, 2 * 128}));
    EXPECT_EQ(s.rows[2], (Range{4096 + 24 * 128, 8 * 128}));
    EXPECT_EQ(s.shape[0], 2 * 256 + 1024);
  }
}

TEST(ShardPlan, RowParallelBiasOnRankZeroOnly) {
  // qwen3 with attention_bias: o_proj's bias is added once (rank 0), q/k/v biases split with their rows.
  ModelConfig c = fixture("qwen3_bf16").config;
  c.attention_bias = true;
  const auto tensors = expected_tensors(c, QuantConfig{});
  const ShardPlan p = plan_shards(c, tensors, 2, 1);
  for (const ExpectedTensor& t : tensors) {
    if (t.name == "model.layers.0.self_attn.o_proj.bias") {
      EXPECT_TRUE(slice_tensor(c, p.ranks[0], t, t.shape).whole());
      EXPECT_FALSE(slice_tensor(c, p.ranks[1], t, t.shape).held);
    }
    if (t.name == "model.layers.0.self_attn.q_proj.bias")
      EXPECT_EQ(slice_tensor(c, p.ranks[1], t, t.shape).shape, (Shape{32}));  // 2 of 4 heads x 16
  }
}

TEST(ShardPlan, Nvfp4BlocksAreNeverCut) {
  // The fixtures' experts have 32 intermediate rows: TP 4 would give each rank 8 inputs of down_proj (half an
  // NVFP4 block); EP 2 / EP 4 keep 16 / 32.
  const Model m = fixture("qwen3_5_moe_nvfp4");
  EXPECT_THAT(error_of([&] { plan_shards(m.config, m.quant, 4, 1); }),
              ::testing::AllOf(::testing::HasSubstr("down_proj"), ::testing::HasSubstr("32 inputs"),
                               ::testing::HasSubstr("NVFP4 block"), ::testing::HasSubstr("--tp-size 4")));
  EXPECT_NO_THROW(plan_shards(m.config, m.quant, 4, 2));
  EXPECT_NO_THROW(plan_shards(m.config, m.quant, 4, 4));
  // The same split in BF16 is fine (no blocks).
  const Model b = fixture("qwen3_5_moe_bf16");
  EXPECT_NO_THROW(plan_shards(b.config, b.quant, 4, 1));
}

TEST(ShardPlan, ErrorsNameTheNumbers) {
  const Model m = bundled("qwen3.5-397b-a17b-nvfp4");
  EXPECT_THAT(error_of([&] { plan_shards(m.config, m.quant, 3, 1); }),
              ::testing::HasSubstr("32 query heads do not split over 3 ranks"));
  EXPECT_THAT(error_of([&] { plan_shards(m.config, m.quant, 64, 1); }),
              ::testing::HasSubstr("32 query heads do not split over 64 ranks"));
  EXPECT_THAT(error_of([&] { plan_shards(m.config, m.quant, 8, 3); }),
              ::testing::HasSubstr("--ep-size 3 must divide --tp-size 8"));
  EXPECT_THAT(error_of([&] { plan_shards(m.config, m.quant, 0, 1); }), ::testing::HasSubstr("at least 1"));
  const Model dense = fixture("qwen3_bf16");
  EXPECT_THAT(error_of([&] { plan_shards(dense.config, dense.quant, 2, 2); }),
              ::testing::HasSubstr("no routed experts"));
  // 3 KV heads over 2 ranks: neither split nor replicated.
  ModelConfig c = dense.config;
  c.num_kv_heads = 3;
  c.num_attention_heads = 6;
  EXPECT_THAT(error_of([&] { plan_shards(c, expected_tensors(c, QuantConfig{}), 2, 1); }),
              ::testing::HasSubstr("3 KV heads do not split over 2 ranks"));
}

// Any vocabulary size: rows over the ranks in order, the first V % N ranks one more, every id held exactly once.
TEST(ShardPlan, VocabularyOfAnySize) {
  ModelConfig c = fixture("qwen3_bf16").config;
  for (int64_t vocab : {101, 509, 512, 151669}) {
    c.vocab_size = vocab;
    for (int tp : {2, 4}) {
      const ShardPlan p = plan_shards(c, expected_tensors(c, QuantConfig{}), tp, 1);
      int64_t next = 0;
      for (const RankShard& r : p.ranks) {
        EXPECT_EQ(r.vocab.begin, next) << vocab << " tp " << tp;
        const int64_t want = vocab / tp + (r.rank < vocab % tp ? 1 : 0);
        EXPECT_EQ(r.vocab.count, want) << vocab << " tp " << tp << " rank " << r.rank;
        next = r.vocab.end();
      }
      EXPECT_EQ(next, vocab);
    }
  }
  c.vocab_size = 3;
  EXPECT_THAT(error_of([&] { plan_shards(c, expected_tensors(c, QuantConfig{}), 4, 1); }),
              ::testing::HasSubstr("3 vocabulary rows cannot be spread over 4 ranks"));
}

TEST(ShardPlan, CopySliceMovesTheRightElements) {
  // A [4, 6] tensor of values 10 * row + col; rows {1} and {3}, columns part 1 of 3 (cols 2, 3).
  TensorSlice s;
  s.rows = {{1, 1}, {3, 1}};
  s.col_parts = 3;
  s.col_part = 1;
  s.shape = Shape{2, 2};
  const Shape stored{4, 6};
  std::vector<int32_t> full(24), out(4);
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 6; ++c) full[r * 6 + c] = 10 * r + c;
  copy_slice(s, stored, sizeof(int32_t), full.data(), out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{12, 13, 32, 33}));
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(full[slice_source_index(s, stored, i)], out[i]);
  // Fused experts [E 3, R 4, K 2]: experts [1, 3), rows {0, 2}.
  TensorSlice f;
  f.split_dim = 1;
  f.outer = {1, 2};
  f.rows = {{0, 1}, {2, 1}};
  f.shape = Shape{2, 2, 2};
  const Shape st3{3, 4, 2};
  std::vector<int32_t> full3(24), out3(8);
  for (int i = 0; i < 24; ++i) full3[i] = i;
  copy_slice(f, st3, sizeof(int32_t), full3.data(), out3.data());
  EXPECT_EQ(out3, (std::vector<int32_t>{8, 9, 12, 13, 16, 17, 20, 21}));
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(full3[slice_source_index(f, st3, i)], out3[i]);
}

}  // namespace
}  // namespace kiln::format
