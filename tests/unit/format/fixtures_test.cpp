// Whole model folders written by fixture_util: every family in every layout loads and verifies; corrupt
// variants fail with the right clear message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "fixture_util.h"
#include "format/capacity.h"
#include "format/weight_map.h"

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

TEST(Fixtures, EveryFamilyAndLayoutLoads) {
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

TEST(Fixtures, PrefixAndExpertLayoutAreDetected) {
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

TEST(Fixtures, ShardedWithVisionAndMtpIgnored) {
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

TEST(Fixtures, TruncatedFile) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3, Layout::bf16);
  fs::resize_file(tmp.file("model.safetensors"), fs::file_size(tmp.file("model.safetensors")) - 100);
  const std::string msg = load_error(tmp.path());
  EXPECT_THAT(msg, HasSubstr("model.safetensors"));
  EXPECT_THAT(msg, HasSubstr("run past the end of the data"));
  EXPECT_THAT(msg, HasSubstr("truncated"));
}

TEST(Fixtures, BadHeaderLength) {
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

TEST(Fixtures, OverlappingOffsets) {
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

TEST(Fixtures, WrongDtypeAndShapeAreAllReportedAtOnce) {
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

TEST(Fixtures, ManyMismatchesListFirstTwentyAndCount) {
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

TEST(Fixtures, MissingShard) {
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

TEST(Fixtures, DuplicateNamesInOneFile) {
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

TEST(Fixtures, ExtraLayerInCheckpoint) {
  TempDir tmp;
  kiln::test::write_fixture_model(tmp.path(), Family::qwen3, Layout::bf16);
  auto cfg = nlohmann::json::parse(kiln::test::read_file(tmp.file("config.json")));
  cfg["num_hidden_layers"] = 3;
  kiln::test::write_text(tmp.file("config.json"), cfg.dump());
  EXPECT_THAT(load_error(tmp.path()), HasSubstr("layer 3 but the config has 3 layers"));
}

}  // namespace
}  // namespace kiln::format
