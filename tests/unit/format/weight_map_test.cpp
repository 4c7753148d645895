// Expected tensor names/shapes/dtypes, written out by hand from the transformers modeling files
// (modeling_qwen3_5_moe.py, modeling_qwen3_next.py, modeling_qwen3_moe.py, modeling_qwen3.py) and the
// ModelOpt NVFP4/FP8 storage rules, for the tiny configs of fixture_util (hidden 64, 4 query / 2 KV heads
// x 16, linear 2 key / 4 value heads x 16, 8 experts of 32, shared expert 32, dense 96, vocab 96).
// Then whole model folders written by fixture_util, through verify_checkpoint: every family in every layout loads
// and verifies; corrupt variants (cut files, bad headers, overlapping offsets, missing shards: found by the
// safetensors reader and the model folder) fail with the right clear message.
#include "format/weight_map.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "fixture_util.h"
#include "format/capacity.h"

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

// ---- whole model folders

namespace kiln::format {
namespace {

using kiln::test::Family;
using kiln::test::FixtureOptions;
using kiln::test::Layout;
using kiln::test::TempDir;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

struct Loaded {
  ModelConfig config;
  QuantConfig quant;
  Checkpoint ckpt;
  VerifyReport report;
};

Loaded load(const std::string& path) {
  ModelDir dir = ModelDir::open(path);
  ModelConfig cfg = load_model_config(dir);
  QuantConfig quant = load_quant_config(dir);
  Checkpoint ckpt = Checkpoint::open(dir);
  VerifyReport rep = verify_checkpoint(ckpt, cfg, quant);
  return {cfg, quant, std::move(ckpt), rep};
}

std::string load_error(const std::string& path) {
  try {
    load(path);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(WeightMapModelFolders, EveryFamilyAndLayoutLoads) {
  for (Family f : kiln::test::all_families()) {
    for (Layout l : {Layout::bf16, Layout::nvfp4, Layout::fp8_mixed}) {
      SCOPED_TRACE(std::string(kiln::test::family_name(f)) + " layout " + std::to_string(int(l)));
      TempDir tmp;
      kiln::test::write_fixture_model(tmp.path(), f, l);
      Loaded x = load(tmp.path());
      const auto expected = expected_tensors(x.config, x.quant);
      int64_t optional = 0;
      for (const auto& t : expected) optional += t.optional;
      EXPECT_EQ(x.report.matched, static_cast<int64_t>(expected.size()));
      EXPECT_EQ(x.report.unexpected, 0);
      EXPECT_EQ(x.ckpt.size(), expected.size());
      // Real sizes agree with the computed ones.
      CapacityPlan real = plan_capacity(x.config, expected, {}, &x.ckpt);
      CapacityPlan computed = plan_capacity(x.config, expected, {});
      EXPECT_EQ(real.weight_bytes, computed.weight_bytes);
      EXPECT_EQ(real.weight_bytes, x.ckpt.total_bytes());
      EXPECT_TRUE(real.sizes_from_checkpoint);
    }
  }
}

TEST(WeightMapModelFolders, PrefixAndExpertLayoutAreDetected) {
  TempDir vl, text;
  kiln::test::write_fixture_model(vl.path(), Family::qwen3_5_moe, Layout::bf16);
  kiln::test::write_fixture_model(text.path(), Family::qwen3_5_moe_text, Layout::bf16);
  EXPECT_EQ(load(vl.path()).config.tensor_prefix, "model.language_model.");
  EXPECT_EQ(load(text.path()).config.tensor_prefix, "model.");
  EXPECT_EQ(load(vl.path()).config.expert_layout, ExpertLayout::fused);
  TempDir moe;
  kiln::test::write_fixture_model(moe.path(), Family::qwen3_moe, Layout::bf16);
  EXPECT_EQ(load(moe.path()).config.expert_layout, ExpertLayout::per_expert);
}

TEST(WeightMapModelFolders, ShardedWithVisionAndMtpIgnored) {
  TempDir tmp;
  FixtureOptions o;
  o.max_shard_bytes = 16 * 1024;
  o.with_vision = true;
  o.with_mtp = true;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3_5_moe, Layout::nvfp4, o);
  EXPECT_TRUE(fs::exists(tmp.file("model.safetensors.index.json")));
  Loaded x = load(tmp.path());
  EXPECT_GT(x.ckpt.files().size(), 2u);
  EXPECT_EQ(x.report.ignored_vision, 2);
  EXPECT_EQ(x.report.ignored_mtp, 1);
  EXPECT_EQ(x.report.unexpected, 0);
}

TEST(WeightMapModelFolders, TruncatedFile) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3, Layout::bf16);
  fs::resize_file(tmp.file("model.safetensors"), fs::file_size(tmp.file("model.safetensors")) - 100);
  const std::string msg = load_error(tmp.path());
  EXPECT_THAT(msg, HasSubstr("model.safetensors"));
  EXPECT_THAT(msg, HasSubstr("run past the end of the data"));
  EXPECT_THAT(msg, HasSubstr("truncated"));
}

TEST(WeightMapModelFolders, BadHeaderLength) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3, Layout::bf16);
  auto bytes = kiln::test::read_file(tmp.file("model.safetensors"));
  bytes[6] = 0x7f;  // header length now ~ 2^54
  kiln::test::write_file(tmp.file("model.safetensors"), bytes);
  EXPECT_THAT(load_error(tmp.path()), HasSubstr("model.safetensors: safetensors header length"));
}

// Rewrites the header of `file` through `edit` (keeping data and header size, padding with spaces).
void edit_header(const std::string& file, const std::function<void(nlohmann::ordered_json&)>& edit) {
  auto bytes = kiln::test::read_file(file);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  auto j = nlohmann::ordered_json::parse(std::string(bytes.begin() + 8, bytes.begin() + 8 + n));
  edit(j);
  std::string text = j.dump();
  ASSERT_LE(text.size(), n);
  text.append(n - text.size(), ' ');
  std::copy(text.begin(), text.end(), bytes.begin() + 8);
  kiln::test::write_file(file, bytes);
}

TEST(WeightMapModelFolders, OverlappingOffsets) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3, Layout::bf16);
  edit_header(tmp.file("model.safetensors"), [](nlohmann::ordered_json& j) {
    // Point the final norm at the embedding's first bytes.
    auto emb = j["model.embed_tokens.weight"]["data_offsets"];
    uint64_t b = emb[0];
    j["model.norm.weight"]["data_offsets"] = {b, b + 128};
  });
  const std::string msg = load_error(tmp.path());
  EXPECT_THAT(msg, HasSubstr("overlap"));
  EXPECT_THAT(msg, HasSubstr("model.norm.weight"));
}

TEST(WeightMapModelFolders, WrongDtypeAndShapeAreAllReportedAtOnce) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3_5_moe, Layout::bf16);
  // The checkpoint was written for a model whose config we now change: bigger MLP, and the
  // checkpoint's embedding claims to be U8 (same bytes, twice the elements).
  edit_header(tmp.file("model.safetensors"), [](nlohmann::ordered_json& j) {
    auto& e = j["model.language_model.embed_tokens.weight"];
    e["dtype"] = "U8";
    e["shape"] = {96, 128};
  });
  auto cfg = nlohmann::json::parse(kiln::test::read_file(tmp.file("config.json")));
  cfg["text_config"]["moe_intermediate_size"] = 48;
  kiln::test::write_text(tmp.file("config.json"), cfg.dump());
  const std::string msg = load_error(tmp.path());
  EXPECT_THAT(msg, HasSubstr("checkpoint does not match config.json (qwen3_5_moe)"));
  EXPECT_THAT(msg, HasSubstr("model.language_model.embed_tokens.weight: dtype U8, expected BF16 or F16 or F32"));
  EXPECT_THAT(msg, HasSubstr("model.language_model.embed_tokens.weight: shape [96, 128], expected [96, 64]"));
  EXPECT_THAT(msg, HasSubstr("model.language_model.layers.0.mlp.experts.gate_up_proj: shape [8, 64, 64], expected [8, 96, 64]"));
  // 2 embedding problems + 2 expert tensors x 4 MoE layers = 10 problems, all listed.
  EXPECT_THAT(msg, HasSubstr(": 10 problems"));
  EXPECT_THAT(msg, ::testing::Not(HasSubstr("more")));
}

TEST(WeightMapModelFolders, ManyMismatchesListFirstTwentyAndCount) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3_5_moe, Layout::bf16);
  // Claim NVFP4 experts: every per-expert tensor is now missing (4 layers x 8 experts x 3 x 4 = 384).
  kiln::test::write_text(tmp.file("hf_quant_config.json"), kiln::test::tiny_quant_json(Family::qwen3_5_moe, Layout::nvfp4));
  const std::string msg = load_error(tmp.path());
  EXPECT_THAT(msg, HasSubstr("(qwen3_5_moe, NVFP4): 384 problems"));
  EXPECT_THAT(msg, HasSubstr("missing model.language_model.layers.0.mlp.experts.0.gate_proj.weight (U8 [32, 32])"));
  EXPECT_THAT(msg, HasSubstr("... and 364 more"));
  EXPECT_EQ(std::count(msg.begin(), msg.end(), '\n'), 21);
}

TEST(WeightMapModelFolders, MissingShard) {
  TempDir tmp;
  FixtureOptions o;
  o.max_shard_bytes = 8 * 1024;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3_next, Layout::bf16, o);
  auto index = nlohmann::json::parse(kiln::test::read_file(tmp.file("model.safetensors.index.json")));
  std::set<std::string> shards;
  for (auto& [tensor, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  ASSERT_GE(shards.size(), 3u);
  fs::remove(tmp.file(*std::next(shards.begin())));
  const std::string msg = load_error(tmp.path());
  EXPECT_THAT(msg, HasSubstr("shard 'model-00002-of-"));
  EXPECT_THAT(msg, HasSubstr("is missing"));
}

TEST(WeightMapModelFolders, DuplicateNamesInOneFile) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3, Layout::bf16);
  // Rename a tensor to an existing name of the same length in the raw header text (a JSON object
  // would silently drop the duplicate).
  auto bytes = kiln::test::read_file(tmp.file("model.safetensors"));
  const std::string from = "\"model.layers.1.mlp.up_proj.weight\"", to = "\"model.layers.0.mlp.up_proj.weight\"";
  std::string all(bytes.begin(), bytes.end());
  auto pos = all.find(from);
  ASSERT_NE(pos, std::string::npos);
  std::copy(to.begin(), to.end(), bytes.begin() + pos);
  kiln::test::write_file(tmp.file("model.safetensors"), bytes);
  const std::string msg = load_error(tmp.path());
  EXPECT_THAT(msg, HasSubstr("'model.layers.0.mlp.up_proj.weight' appears more than once"));
}

TEST(WeightMapModelFolders, ExtraLayerInCheckpoint) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3, Layout::bf16);
  auto cfg = nlohmann::json::parse(kiln::test::read_file(tmp.file("config.json")));
  cfg["num_hidden_layers"] = 3;
  kiln::test::write_text(tmp.file("config.json"), cfg.dump());
  EXPECT_THAT(load_error(tmp.path()), HasSubstr("layer 3 but the config has 3 layers"));
}

TEST(WeightMap, VisionTowerOfThe397BRelease) {
  // The names and shapes of the released Qwen3.5 checkpoints' model.visual.* (transformers' Qwen3_5MoeVisionModel
  // parameter names under model.visual.), for configs/qwen3.5-397b-a17b-nvfp4's vision_config.
  ModelConfig c = load_model_config(ModelDir::open(std::string(KILN_SOURCE_DIR) + "/configs/qwen3.5-397b-a17b-nvfp4"));
  ASSERT_TRUE(c.has_vision);
  const std::vector<ExpectedTensor> ts = expected_vision_tensors(c, "model.visual.");
  EXPECT_EQ(ts.size(), 3u + 27u * 12u + 6u);
  std::map<std::string, Shape> by_name;
  int64_t params = 0;
  for (const auto& t : ts) {
    by_name[t.name] = t.shape;
    params += t.params;
    EXPECT_EQ(t.role, role::kVision);
    EXPECT_EQ(t.dtypes.front(), DType::BF16);
  }
  const std::map<std::string, Shape> want = {
      {"model.visual.patch_embed.proj.weight", Shape{1152, 3, 2, 16, 16}},
      {"model.visual.patch_embed.proj.bias", Shape{1152}},
      {"model.visual.pos_embed.weight", Shape{2304, 1152}},
      {"model.visual.blocks.0.norm1.weight", Shape{1152}},
      {"model.visual.blocks.0.norm1.bias", Shape{1152}},
      {"model.visual.blocks.0.norm2.weight", Shape{1152}},
      {"model.visual.blocks.0.attn.qkv.weight", Shape{3456, 1152}},
      {"model.visual.blocks.0.attn.qkv.bias", Shape{3456}},
      {"model.visual.blocks.0.attn.proj.weight", Shape{1152, 1152}},
      {"model.visual.blocks.0.attn.proj.bias", Shape{1152}},
      {"model.visual.blocks.26.mlp.linear_fc1.weight", Shape{4304, 1152}},
      {"model.visual.blocks.26.mlp.linear_fc1.bias", Shape{4304}},
      {"model.visual.blocks.26.mlp.linear_fc2.weight", Shape{1152, 4304}},
      {"model.visual.blocks.26.mlp.linear_fc2.bias", Shape{1152}},
      {"model.visual.merger.norm.weight", Shape{1152}},
      {"model.visual.merger.norm.bias", Shape{1152}},
      {"model.visual.merger.linear_fc1.weight", Shape{4608, 4608}},
      {"model.visual.merger.linear_fc1.bias", Shape{4608}},
      {"model.visual.merger.linear_fc2.weight", Shape{4096, 4608}},
      {"model.visual.merger.linear_fc2.bias", Shape{4096}},
  };
  for (const auto& [name, shape] : want) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_EQ(by_name[name], shape) << name;
  }
  EXPECT_FALSE(by_name.count("model.visual.blocks.27.norm1.weight"));
  EXPECT_FALSE(by_name.count("model.visual.deepstack_merger_list.0.norm.weight"));  // Qwen3-VL's, not Qwen3.5's
  // ~0.4 B parameters: 27 blocks of ~15.2 M, the merger ~40 M, the position table ~2.7 M.
  EXPECT_GT(params, 400'000'000);
  EXPECT_LT(params, 480'000'000);
}

}  // namespace
}  // namespace kiln::format
