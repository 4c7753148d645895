// Expected tensor names/shapes/dtypes, written out by hand from the transformers modeling files
// (modeling_qwen3_5_moe.py, modeling_qwen3_next.py, modeling_qwen3_moe.py, modeling_qwen3.py) and the
// ModelOpt NVFP4/FP8 storage rules, for the tiny configs of fixture_util (hidden 64, 4 query / 2 KV heads
// x 16, linear 2 key / 4 value heads x 16, 8 experts of 32, shared expert 32, dense 96, vocab 96).
#include "format/weight_map.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "fixture_util.h"

namespace kiln::format {
namespace {

using kiln::test::Family;
using kiln::test::Layout;
using ::testing::HasSubstr;

struct Want {
  DType dtype;
  Shape shape;
};

std::map<std::string, ExpectedTensor> index(const std::vector<ExpectedTensor>& v) {
  std::map<std::string, ExpectedTensor> m;
  for (const auto& t : v) EXPECT_TRUE(m.emplace(t.name, t).second) << "duplicate " << t.name;
  return m;
}

void expect_has(const std::map<std::string, ExpectedTensor>& m, const std::string& name, DType dtype, Shape shape) {
  auto it = m.find(name);
  ASSERT_NE(it, m.end()) << "missing " << name;
  EXPECT_EQ(it->second.dtypes.front(), dtype) << name;
  EXPECT_EQ(it->second.shape, shape) << name << " " << it->second.shape.str();
}

ModelConfig tiny(Family f) { return parse_model_config(kiln::test::tiny_config_json(f)); }
QuantConfig tiny_quant(Family f, Layout l) {
  const std::string q = kiln::test::tiny_quant_json(f, l);
  return q.empty() ? QuantConfig{} : parse_hf_quant_config(q);
}

TEST(WeightMap, Qwen35MoeBf16) {
  const auto all = expected_tensors(tiny(Family::qwen3_5_moe), {});
  EXPECT_EQ(all.size(), 72u);  // 3 linear layers x 18 + 1 full layer x 15 + embed, norm, lm_head
  auto m = index(all);
  const std::string P = "model.language_model.";
  const DType B = DType::BF16;
  expect_has(m, P + "embed_tokens.weight", B, Shape{96, 64});
  expect_has(m, P + "norm.weight", B, Shape{64});
  expect_has(m, "lm_head.weight", B, Shape{96, 64});
  const std::string L0 = P + "layers.0.";
  expect_has(m, L0 + "input_layernorm.weight", B, Shape{64});
  expect_has(m, L0 + "post_attention_layernorm.weight", B, Shape{64});
  expect_has(m, L0 + "linear_attn.in_proj_qkv.weight", B, Shape{2 * 2 * 16 + 4 * 16, 64});
  expect_has(m, L0 + "linear_attn.in_proj_z.weight", B, Shape{4 * 16, 64});
  expect_has(m, L0 + "linear_attn.in_proj_b.weight", B, Shape{4, 64});
  expect_has(m, L0 + "linear_attn.in_proj_a.weight", B, Shape{4, 64});
  expect_has(m, L0 + "linear_attn.conv1d.weight", B, Shape{128, 1, 4});
  expect_has(m, L0 + "linear_attn.A_log", B, Shape{4});
  expect_has(m, L0 + "linear_attn.dt_bias", B, Shape{4});
  expect_has(m, L0 + "linear_attn.norm.weight", B, Shape{16});
  expect_has(m, L0 + "linear_attn.out_proj.weight", B, Shape{64, 64});
  expect_has(m, L0 + "mlp.gate.weight", B, Shape{8, 64});
  expect_has(m, L0 + "mlp.experts.gate_up_proj", B, Shape{8, 64, 64});
  expect_has(m, L0 + "mlp.experts.down_proj", B, Shape{8, 64, 32});
  expect_has(m, L0 + "mlp.shared_expert.gate_proj.weight", B, Shape{32, 64});
  expect_has(m, L0 + "mlp.shared_expert.up_proj.weight", B, Shape{32, 64});
  expect_has(m, L0 + "mlp.shared_expert.down_proj.weight", B, Shape{64, 32});
  expect_has(m, L0 + "mlp.shared_expert_gate.weight", B, Shape{1, 64});
  const std::string L3 = P + "layers.3.";
  expect_has(m, L3 + "self_attn.q_proj.weight", B, Shape{4 * 16 * 2, 64});  // [q | gate] per head
  expect_has(m, L3 + "self_attn.k_proj.weight", B, Shape{2 * 16, 64});
  expect_has(m, L3 + "self_attn.v_proj.weight", B, Shape{2 * 16, 64});
  expect_has(m, L3 + "self_attn.o_proj.weight", B, Shape{64, 4 * 16});
  expect_has(m, L3 + "self_attn.q_norm.weight", B, Shape{16});
  expect_has(m, L3 + "self_attn.k_norm.weight", B, Shape{16});
  EXPECT_EQ(m.count(L3 + "linear_attn.in_proj_qkv.weight"), 0u);
  EXPECT_EQ(m.count(L0 + "self_attn.q_proj.weight"), 0u);
}

TEST(WeightMap, Qwen35MoeNvfp4ExpertsOnlyRoutersStayBf16) {
  const auto all = expected_tensors(tiny(Family::qwen3_5_moe), tiny_quant(Family::qwen3_5_moe, Layout::nvfp4));
  auto m = index(all);
  const std::string L = "model.language_model.layers.2.mlp.";
  expect_has(m, L + "experts.7.gate_proj.weight", DType::U8, Shape{32, 32});  // [I, H/2]
  expect_has(m, L + "experts.7.gate_proj.weight_scale", DType::F8_E4M3, Shape{32, 4});  // [I, H/16]
  expect_has(m, L + "experts.7.gate_proj.weight_scale_2", DType::F32, Shape{});
  expect_has(m, L + "experts.7.gate_proj.input_scale", DType::F32, Shape{});
  expect_has(m, L + "experts.0.up_proj.weight", DType::U8, Shape{32, 32});
  expect_has(m, L + "experts.0.down_proj.weight", DType::U8, Shape{64, 16});  // [H, I/2]
  expect_has(m, L + "experts.0.down_proj.weight_scale", DType::F8_E4M3, Shape{64, 2});
  EXPECT_EQ(m.count(L + "experts.gate_up_proj"), 0u);
  // The exclude list does not name mlp.gate: it stays BF16 anyway.
  expect_has(m, L + "gate.weight", DType::BF16, Shape{8, 64});
  EXPECT_EQ(m.count(L + "gate.weight_scale"), 0u);
  expect_has(m, L + "shared_expert.up_proj.weight", DType::BF16, Shape{32, 64});
  expect_has(m, "model.language_model.layers.3.self_attn.q_proj.weight", DType::BF16, Shape{128, 64});
  expect_has(m, "lm_head.weight", DType::BF16, Shape{96, 64});
  EXPECT_EQ(effective_scheme(tiny(Family::qwen3_5_moe), tiny_quant(Family::qwen3_5_moe, Layout::nvfp4), L + "gate"),
            QuantScheme::none);
  // 18 + (8 experts x 3 x 4 - 2 fused) per MoE layer... counted: 3 x (18 - 2 + 96) + (15 - 2 + 96) + 3.
  EXPECT_EQ(all.size(), 3u * (16 + 96) + (13 + 96) + 3);
}

TEST(WeightMap, Fp8MixedAttentionAndKvScales) {
  const auto all = expected_tensors(tiny(Family::qwen3_5_moe), tiny_quant(Family::qwen3_5_moe, Layout::fp8_mixed));
  auto m = index(all);
  const std::string A = "model.language_model.layers.3.self_attn.";
  expect_has(m, A + "q_proj.weight", DType::F8_E4M3, Shape{128, 64});
  expect_has(m, A + "q_proj.weight_scale", DType::F32, Shape{});
  expect_has(m, A + "q_proj.input_scale", DType::F32, Shape{});
  expect_has(m, A + "o_proj.weight", DType::F8_E4M3, Shape{64, 64});
  expect_has(m, A + "k_proj.k_scale", DType::F32, Shape{});
  expect_has(m, A + "v_proj.v_scale", DType::F32, Shape{});
  EXPECT_TRUE(m.at(A + "k_proj.k_scale").optional);
  EXPECT_FALSE(m.at(A + "k_proj.weight").optional);
  expect_has(m, "model.language_model.layers.0.mlp.experts.1.down_proj.weight", DType::U8, Shape{64, 16});
  expect_has(m, "model.language_model.layers.0.linear_attn.in_proj_qkv.weight", DType::BF16, Shape{128, 64});
}

TEST(WeightMap, Qwen3NextFusedLinearAttentionProjections) {
  ModelConfig c = tiny(Family::qwen3_next);
  auto m = index(expected_tensors(c, {}));
  const std::string G = "model.layers.0.linear_attn.";
  // in_proj_qkvz: key_dim * 2 + value_dim * 2 rows; in_proj_ba: num_v_heads * 2 rows.
  expect_has(m, G + "in_proj_qkvz.weight", DType::BF16, Shape{2 * 32 + 2 * 64, 64});
  expect_has(m, G + "in_proj_ba.weight", DType::BF16, Shape{2 * 4, 64});
  expect_has(m, G + "conv1d.weight", DType::BF16, Shape{2 * 32 + 64, 1, 4});
  EXPECT_EQ(m.count(G + "in_proj_qkv.weight"), 0u);
  // Released Qwen3-Next checkpoints store experts one by one.
  expect_has(m, "model.layers.0.mlp.experts.3.gate_proj.weight", DType::BF16, Shape{32, 64});
  expect_has(m, "model.layers.0.mlp.experts.3.down_proj.weight", DType::BF16, Shape{64, 32});
  expect_has(m, "model.layers.0.mlp.shared_expert_gate.weight", DType::BF16, Shape{1, 64});
}

TEST(WeightMap, Qwen3MoeAndQwen3) {
  auto moe = index(expected_tensors(tiny(Family::qwen3_moe), {}));
  expect_has(moe, "model.layers.0.self_attn.q_proj.weight", DType::BF16, Shape{64, 64});  // no output gate
  expect_has(moe, "model.layers.0.self_attn.q_norm.weight", DType::BF16, Shape{16});
  expect_has(moe, "model.layers.0.mlp.gate.weight", DType::BF16, Shape{8, 64});
  expect_has(moe, "model.layers.0.mlp.experts.7.up_proj.weight", DType::BF16, Shape{32, 64});
  EXPECT_EQ(moe.count("model.layers.0.mlp.shared_expert.up_proj.weight"), 0u);
  // mlp_only_layers [1]: a dense MLP there.
  expect_has(moe, "model.layers.1.mlp.gate_proj.weight", DType::BF16, Shape{96, 64});
  expect_has(moe, "model.layers.1.mlp.down_proj.weight", DType::BF16, Shape{64, 96});
  EXPECT_EQ(moe.count("model.layers.1.mlp.gate.weight"), 0u);

  auto dense = index(expected_tensors(tiny(Family::qwen3), {}));
  expect_has(dense, "model.layers.3.mlp.up_proj.weight", DType::BF16, Shape{96, 64});
  expect_has(dense, "model.embed_tokens.weight", DType::BF16, Shape{96, 64});
  EXPECT_EQ(dense.count("lm_head.weight"), 0u);  // tied
  EXPECT_EQ(dense.size(), 4u * 11 + 2);
}

TEST(WeightMap, AttentionBiasAndParams) {
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "vocab_size": 10,
      "attention_bias": true})");
  auto m = index(expected_tensors(c, {}));
  expect_has(m, "model.layers.0.self_attn.q_proj.bias", DType::BF16, Shape{32});
  expect_has(m, "model.layers.0.self_attn.k_proj.bias", DType::BF16, Shape{16});
  expect_has(m, "model.layers.0.self_attn.o_proj.bias", DType::BF16, Shape{32});
  EXPECT_EQ(m.at("model.layers.0.self_attn.k_proj.weight").params, 16 * 32);
}

TEST(WeightMap, Nvfp4NeedsInputsDivisibleBy16) {
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3_moe", "hidden_size": 40, "num_hidden_layers": 1,
      "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 2, "num_experts_per_tok": 1,
      "moe_intermediate_size": 16, "vocab_size": 10})");
  QuantConfig q = parse_hf_quant_config(R"({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*", "lm_head"]}})");
  try {
    expected_tensors(c, q);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.layers.0.mlp.experts.0.gate_proj has 40 inputs, not a multiple of the NVFP4 group size 16"));
  }
}

}  // namespace
}  // namespace kiln::format
