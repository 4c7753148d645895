// config.json parsing for every supported family; expected values come from the transformers
// configuration_*.py defaults and the configs written here by hand.
#include "format/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "fixture_util.h"
#include "format/embedded_model.h"

namespace kiln::format {
namespace {

using ::testing::HasSubstr;
using LT = LayerType;

std::string error_of(const std::string& json, const std::string& gen = "") {
  try {
    parse_model_config(json, gen, "test/config.json");
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(ModelConfig, Qwen35MoeDefaultsMatchTransformers) {
  // Every setting missing: configuration_qwen3_5_moe.py defaults (the "35B-A3B" shape).
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3_5_moe"})");
  EXPECT_EQ(c.arch, Arch::qwen3_5_moe);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_layers, 40);
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel, 4);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.mrope_section, (std::vector<int>{11, 11, 10}));
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_TRUE(c.norm_zero_centred);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_full_attention_layers(), 10);
  EXPECT_EQ(c.layer_types[3], LT::full_attention);
  EXPECT_EQ(c.layer_types[4], LT::linear_attention);
  EXPECT_EQ(c.layer_pattern(), "10 x [linear, linear, linear, full]");
  for (int l = 0; l < 40; ++l) EXPECT_TRUE(c.layer_is_moe(l));
  EXPECT_EQ(c.tensor_prefix, "model.");
  EXPECT_EQ(c.expert_layout, ExpertLayout::fused);
}

TEST(ModelConfig, Bundled397BConfig) {
  ModelConfig c = load_model_config(ModelDir::open(std::string(KILN_SOURCE_DIR) + "/configs/qwen3.5-397b-a17b-nvfp4"));
  EXPECT_EQ(c.arch, Arch::qwen3_5_moe);
  EXPECT_EQ(c.architecture, "Qwen3_5MoeForConditionalGeneration");
  EXPECT_TRUE(c.has_vision);
  EXPECT_EQ(c.tensor_prefix, "model.language_model.");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_layers, 60);
  EXPECT_EQ(c.num_linear_attention_layers(), 45);
  EXPECT_EQ(c.layer_pattern(), "15 x [linear, linear, linear, full]");
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.linear_num_value_heads, 64);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.experts_per_tok, 10);
  EXPECT_EQ(c.moe_intermediate_size, 1024);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
}

TEST(ModelConfig, TextOnlyCausalLmAtTopLevel) {
  ModelConfig c = parse_model_config(kiln::test::tiny_config_json(kiln::test::Family::qwen3_5_moe_text));
  EXPECT_EQ(c.arch, Arch::qwen3_5_moe);
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.tensor_prefix, "model.");
  EXPECT_FALSE(c.has_vision);
}

TEST(ModelConfig, NestedTextConfigWinsOverDefaults) {
  ModelConfig c = parse_model_config(kiln::test::tiny_config_json(kiln::test::Family::qwen3_5_moe));
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.layer_pattern(), "1 x [linear, linear, linear, full]");
  EXPECT_EQ(c.tensor_prefix, "model.language_model.");
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{95}));
}

TEST(ModelConfig, Qwen3NextDefaults) {
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]})");
  EXPECT_EQ(c.arch, Arch::qwen3_next);
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.num_layers, 48);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.experts_per_tok, 10);
  EXPECT_EQ(c.intermediate_size, 5632);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_TRUE(c.norm_zero_centred);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_TRUE(c.mrope_section.empty());
  EXPECT_EQ(c.expert_layout, ExpertLayout::per_expert);
}

TEST(ModelConfig, Qwen3MoeSparseStepAndMlpOnlyLayers) {
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                         "mlp_only_layers": [3], "hidden_size": 256, "num_attention_heads": 8,
                                         "num_key_value_heads": 2})");
  EXPECT_EQ(c.head_dim, 32);  // no head_dim: hidden / heads
  EXPECT_FALSE(c.norm_topk_prob);  // qwen3_moe default
  EXPECT_FALSE(c.norm_zero_centred);
  EXPECT_FALSE(c.attn_output_gate);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 1.0);
  EXPECT_EQ(c.intermediate_size, 6144);
  // MoE where (i + 1) % 2 == 0 and i not in mlp_only_layers.
  std::vector<bool> moe;
  for (int l = 0; l < 6; ++l) moe.push_back(c.layer_is_moe(l));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, false, false, true}));
  EXPECT_EQ(c.layer_pattern(), "6 x [full]");
}

TEST(ModelConfig, Qwen3DenseDefaultsAndNullKvHeads) {
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3", "num_key_value_heads": null, "rope_theta": 1000000})");
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 22016);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.num_experts, 0);
  EXPECT_FALSE(c.layer_is_moe(0));
  EXPECT_EQ(c.num_full_attention_layers(), 32);
}

TEST(ModelConfig, RopeSourcesInPriorityOrder) {
  // rope_scaling (legacy) beats rope_parameters; keys inside beat top-level ones.
  auto theta = [](const std::string& extra) {
    return parse_model_config(R"({"model_type": "qwen3", "rope_theta": 5.0)" + extra + "}").rope_theta;
  };
  EXPECT_DOUBLE_EQ(theta(""), 5.0);
  EXPECT_DOUBLE_EQ(theta(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0})"), 7.0);
  EXPECT_DOUBLE_EQ(theta(R"(, "rope_parameters": {"rope_type": "default"})"), 5.0);
  EXPECT_DOUBLE_EQ(theta(R"(, "rope_scaling": {"type": "default", "rope_theta": 9.0}, "rope_parameters": {"rope_theta": 7.0})"), 9.0);
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3_5", "partial_rotary_factor": 0.5,
      "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [8, 12, 12], "mrope_interleaved": false}})");
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 0.5);
  EXPECT_EQ(c.mrope_section, (std::vector<int>{8, 12, 12}));
  EXPECT_FALSE(c.mrope_interleaved);
  EXPECT_THAT(error_of(R"({"model_type": "qwen3", "rope_parameters": {"rope_type": "yarn", "factor": 4}})"),
              HasSubstr("rope type 'yarn' is not supported"));
}

TEST(ModelConfig, EosIsTheUnionOfConfigAndGenerationConfig) {
  ModelConfig c = parse_model_config(
      R"({"model_type": "qwen3_5_moe", "eos_token_id": 7, "text_config": {"eos_token_id": [5, 6]}, "bos_token_id": 1})",
      R"({"eos_token_id": [6, 9], "pad_token_id": 3})");
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{5, 6, 7, 9}));
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.pad_token_id, 3);
  ModelConfig d = parse_model_config(R"({"model_type": "qwen3"})", R"({"eos_token_id": 4})");
  EXPECT_EQ(d.eos_token_ids, (std::vector<int64_t>{4}));
  EXPECT_FALSE(d.bos_token_id.has_value());
}

TEST(ModelConfig, ExplicitLayerTypes) {
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3_5", "num_hidden_layers": 3,
      "layer_types": ["full_attention", "linear_attention", "linear_attention"]})");
  EXPECT_EQ(c.layer_types, (std::vector<LT>{LT::full_attention, LT::linear_attention, LT::linear_attention}));
  EXPECT_EQ(c.layer_pattern(), "1 x [full, linear, linear]");
  ModelConfig irregular = parse_model_config(R"({"model_type": "qwen3_5", "num_hidden_layers": 10,
      "layer_types": ["full_attention", "linear_attention", "linear_attention", "linear_attention", "linear_attention",
                      "linear_attention", "linear_attention", "linear_attention", "linear_attention", "full_attention"]})");
  EXPECT_EQ(irregular.layer_pattern(), "10 layers: 8 linear, 2 full (irregular)");
  ModelConfig interval = parse_model_config(R"({"model_type": "qwen3_5", "num_hidden_layers": 6, "full_attention_interval": 2})");
  EXPECT_EQ(interval.layer_pattern(), "3 x [linear, full]");
}

TEST(ModelConfig, ClearErrors) {
  EXPECT_THAT(error_of(R"({"model_type": "llama"})"),
              HasSubstr("unsupported model_type 'llama' (supported: qwen3_5_moe, qwen3_5, qwen3_next, qwen3_moe, qwen3)"));
  EXPECT_THAT(error_of(R"({"hidden_size": 4})"), HasSubstr("no \"model_type\""));
  EXPECT_THAT(error_of("{"), HasSubstr("test/config.json: not valid JSON"));
  EXPECT_THAT(error_of(R"({"model_type": "qwen3", "hidden_size": "big"})"), HasSubstr("\"hidden_size\" must be an integer"));
  EXPECT_THAT(error_of(R"({"model_type": "qwen3_5", "num_hidden_layers": 3, "layer_types": ["linear_attention"]})"),
              HasSubstr("layer_types has 1 entries but num_hidden_layers is 3"));
  EXPECT_THAT(error_of(R"({"model_type": "qwen3_5", "num_hidden_layers": 1, "layer_types": ["sliding_attention"]})"),
              HasSubstr("layer_types[0] is 'sliding_attention'"));
  EXPECT_THAT(error_of(R"({"model_type": "qwen3", "num_attention_heads": 6, "num_key_value_heads": 4})"),
              HasSubstr("not a multiple of num_key_value_heads"));
  EXPECT_THAT(error_of(R"({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 8})"),
              HasSubstr("num_experts_per_tok 8 exceeds num_experts 4"));
  EXPECT_THAT(error_of(R"({"model_type": "qwen3", "hidden_size": 0})"), HasSubstr("\"hidden_size\" must be positive"));
  EXPECT_THAT(error_of(R"({"model_type": "qwen3", "use_sliding_window": true})"), HasSubstr("sliding-window"));
  EXPECT_THAT(error_of(R"({"model_type": "qwen3"})", "[1"), HasSubstr("generation_config.json: not valid JSON"));
}

TEST(ModelDir, OpenErrorsAndFiles) {
  kiln::test::TempDir tmp;
  auto err = [](const std::string& p) {
    try {
      ModelDir::open(p);
      return std::string();
    } catch (const Error& e) {
      return std::string(e.what());
    }
  };
  EXPECT_THAT(err(tmp.path() + "/nope"), HasSubstr("does not exist"));
  EXPECT_THAT(err(tmp.path()), HasSubstr("has no config.json"));
  kiln::test::write_text(tmp.file("x.txt"), "hello");
  EXPECT_THAT(err(tmp.file("x.txt")), HasSubstr("is not a directory"));
  kiln::test::write_text(tmp.file("config.json"), "{}");
  kiln::test::write_text(tmp.file("empty.bin"), "");
  ModelDir d = ModelDir::open(tmp.path());
  EXPECT_FALSE(d.is_embedded());
  EXPECT_EQ(d.display_path(), tmp.path());
  EXPECT_EQ(d.files(), (std::vector<std::string>{"config.json", "empty.bin", "x.txt"}));
  EXPECT_TRUE(d.has("x.txt"));
  EXPECT_FALSE(d.has("y.txt"));
  EXPECT_EQ(d.read_text("x.txt"), "hello");
  EXPECT_EQ(d.map("empty.bin").size(), 0u);
  auto a = d.map("x.txt");
  EXPECT_EQ(a.data(), d.map("x.txt").data());  // mapped once, shared
  ModelDir copy = d;
  EXPECT_EQ(copy.map("x.txt").data(), a.data());
  try {
    d.map("y.txt");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("y.txt"));
  }
  EXPECT_THROW(d.map("../x.txt"), Error);
  EXPECT_THROW(d.map("/etc/passwd"), Error);
}

TEST(ModelDir, EmbeddedModelMatchesTheRepoFolder) {
  namespace fs = std::filesystem;
  const fs::path folder = embedded::kSourceDir;  // models/kiln-tiny unless KILN_EMBED_MODEL_DIR says otherwise
  if (!ModelDir::has_embedded()) {
    EXPECT_FALSE(fs::exists(folder / "config.json")) << "models/kiln-tiny exists but was not embedded";
    try {
      ModelDir::embedded();
      FAIL();
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("no embedded model"));
    }
    return;
  }
  ModelDir d = ModelDir::embedded();
  EXPECT_TRUE(d.is_embedded());
  EXPECT_EQ(d.display_path(), "embedded:kiln-tiny");
  EXPECT_TRUE(d.has("config.json"));
  for (const auto& f : d.files()) {
    SCOPED_TRACE(f);
    auto bytes = d.map(f);
    auto disk = kiln::test::read_file((folder / f).string());
    ASSERT_EQ(bytes.size(), disk.size()) << "rebuild after changing models/kiln-tiny";
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), disk.begin()));
  }
}

TEST(ModelConfig, Qwen3MoeReadsNumLocalExperts) {
  // transformers 5.x saves qwen3_moe configs with num_local_experts instead of num_experts.
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3_moe", "num_local_experts": 6, "num_experts_per_tok": 2})");
  EXPECT_EQ(c.num_experts, 6);
}

TEST(ModelConfig, ArchitecturesOfAnotherFamilyIsAWarning) {
  // The issue's case: a Llama class name over a qwen3_5_moe_text model_type loads by model_type, with a warning.
  ModelConfig c = parse_model_config(R"({"model_type": "qwen3_5_moe_text", "architectures": ["LlamaForCausalLM"]})",
                                     "", "test/config.json");
  EXPECT_EQ(c.arch, Arch::qwen3_5_moe);
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_THAT(c.warnings[0], HasSubstr("LlamaForCausalLM"));
  EXPECT_THAT(c.warnings[0], HasSubstr("qwen3_5_moe_text"));
  EXPECT_THAT(c.warnings[0], HasSubstr("test/config.json"));
  // Another kiln family's class is a mismatch too.
  EXPECT_EQ(parse_model_config(R"({"model_type": "qwen3", "architectures": ["Qwen3MoeForCausalLM"]})").warnings.size(),
            1u);
  // The transformers classes of each family, and no architectures at all, are fine.
  for (const char* ok : {R"({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]})",
                         R"({"model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"]})",
                         R"({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]})",
                         R"({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]})",
                         R"({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]})",
                         R"({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})",
                         R"({"model_type": "qwen3"})"})
    EXPECT_TRUE(parse_model_config(ok).warnings.empty()) << ok;
}

// ---- vision_config (the Qwen3.5 vision tower)

// A qwen3_5_moe config whose text hidden size is 64, with `vision` as its vision_config (JSON object text).
std::string with_vision(const std::string& vision, const std::string& extra_top = "") {
  return R"({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
             "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 64},)" +
         extra_top + R"( "vision_config": )" + vision + "}";
}

TEST(ModelConfig, VisionConfigOfThe397BRelease) {
  // configs/qwen3.5-397b-a17b-nvfp4: transformers' vision defaults with out_hidden_size 4096; its vision_config says
  // model_type "qwen3_5_moe" (older releases' spelling, which transformers rewrites) and has no rope_parameters.
  ModelConfig c = load_model_config(ModelDir::open(std::string(KILN_SOURCE_DIR) + "/configs/qwen3.5-397b-a17b-nvfp4"));
  ASSERT_TRUE(c.has_vision) << c.vision_problem;
  const VisionConfig& v = c.vision;
  EXPECT_EQ(v.depth, 27);
  EXPECT_EQ(v.hidden_size, 1152);
  EXPECT_EQ(v.num_heads, 16);
  EXPECT_EQ(v.head_dim(), 72);
  EXPECT_EQ(v.intermediate_size, 4304);
  EXPECT_EQ(v.hidden_act, "gelu_pytorch_tanh");
  EXPECT_EQ(v.in_channels, 3);
  EXPECT_EQ(v.patch_size, 16);
  EXPECT_EQ(v.temporal_patch_size, 2);
  EXPECT_EQ(v.spatial_merge_size, 2);
  EXPECT_EQ(v.out_hidden_size, 4096);
  EXPECT_EQ(v.num_position_embeddings, 2304);
  EXPECT_EQ(v.position_grid_side(), 48);
  EXPECT_EQ(v.patch_dim(), 1536);
  EXPECT_EQ(v.merged_hidden(), 4608);
  EXPECT_DOUBLE_EQ(v.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(v.layer_norm_eps, 1e-6);
  EXPECT_EQ(c.image_token_id, 248056);
  EXPECT_EQ(c.video_token_id, 248057);
  EXPECT_EQ(c.vision_start_token_id, 248053);
  EXPECT_EQ(c.vision_end_token_id, 248054);
  EXPECT_TRUE(c.warnings.empty());
}

TEST(ModelConfig, VisionConfigAsTransformers517WritesIt) {
  // rope_parameters {"rope_type": "axial", "rope_theta": ...} and patch sizes as lists; token ids from the top level.
  ModelConfig c = parse_model_config(with_vision(
      R"({"model_type": "qwen3_5_moe_vision", "depth": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128,
          "out_hidden_size": 64, "num_position_embeddings": 64, "patch_size": [16, 16], "temporal_patch_size": 2,
          "rope_parameters": {"rope_type": "axial", "rope_theta": 20000.0}})",
      R"("image_token_id": 500, "video_token_id": 501, "vision_start_token_id": 498, "vision_end_token_id": 499,)"));
  ASSERT_TRUE(c.has_vision) << c.vision_problem;
  EXPECT_EQ(c.vision.depth, 2);
  EXPECT_EQ(c.vision.head_dim(), 16);
  EXPECT_EQ(c.vision.patch_size, 16);
  EXPECT_EQ(c.vision.position_grid_side(), 8);
  EXPECT_DOUBLE_EQ(c.vision.rope_theta, 20000.0);
  EXPECT_EQ(c.image_token_id, 500);
  EXPECT_EQ(c.video_token_id, 501);
  EXPECT_EQ(c.vision_start_token_id, 498);
  EXPECT_EQ(c.vision_end_token_id, 499);
}

TEST(ModelConfig, NoVisionConfigMeansNoVision) {
  for (const std::string& text :
       {std::string(R"({"model_type": "qwen3_5_moe"})"), std::string(R"({"model_type": "qwen3_5_moe_text"})"),
        std::string(R"({"model_type": "qwen3_5_moe", "vision_config": null})"),
        // Families without a vision tower ignore the block.
        std::string(R"({"model_type": "qwen3", "vision_config": {"depth": "?"}})")}) {
    ModelConfig c = parse_model_config(text);
    EXPECT_FALSE(c.has_vision) << text;
    EXPECT_TRUE(c.vision_problem.empty()) << text;
    EXPECT_EQ(c.image_token_id, -1) << text;
  }
}

TEST(ModelConfig, MalformedVisionConfigIsAClearError) {
  EXPECT_THAT(error_of(with_vision(R"("yes")")), HasSubstr("test/config.json: \"vision_config\" must be an object"));
  EXPECT_THAT(error_of(with_vision(R"({"depth": "two"})")),
              HasSubstr("test/config.json vision_config: \"depth\" must be an integer, got \"two\""));
  EXPECT_THAT(error_of(with_vision(R"({"hidden_act": 3})")), HasSubstr("\"hidden_act\" must be a string"));
  EXPECT_THAT(error_of(with_vision(R"({"patch_size": [16, 14]})")),
              HasSubstr("\"patch_size\" [16,14] must be one size"));
  EXPECT_THAT(error_of(with_vision(R"({"rope_parameters": 10000})")), HasSubstr("rope_parameters must be an object"));
  EXPECT_THAT(error_of(with_vision(R"({"out_hidden_size": 64})", R"("image_token_id": "pad",)")),
              HasSubstr("\"image_token_id\" must be an integer"));
}

TEST(ModelConfig, VisionConfigThatCannotRunTurnsImagesOffWithAWarning) {
  // The text model still loads; has_vision is false and vision_problem (also a warning) says why.
  const std::pair<std::string, std::string> cases[] = {
      {R"({"out_hidden_size": 64, "num_heads": 5})", "hidden_size 1152 is not a multiple of num_heads 5"},
      {R"({"out_hidden_size": 64, "hidden_size": 12, "num_heads": 2})", "the head size 6 is not a multiple of 4"},
      {R"({"out_hidden_size": 64, "num_position_embeddings": 2300})", "num_position_embeddings 2300 is not a square"},
      {R"({"out_hidden_size": 64, "hidden_act": "quick_gelu"})", "hidden_act 'quick_gelu' is not supported"},
      {R"({"out_hidden_size": 64, "rope_parameters": {"rope_type": "yarn"}})", "rope_parameters.rope_type 'yarn' is not supported"},
      {R"({"out_hidden_size": 4096})", "out_hidden_size 4096 differs from the language model's hidden_size 64"},
      {R"({"out_hidden_size": 64, "depth": 0})", "\"depth\" is 0 (expected 1 .. 1024)"},
      {R"({"out_hidden_size": 64, "spatial_merge_size": -2})", "\"spatial_merge_size\" is -2"},
  };
  for (const auto& [vision, why] : cases) {
    ModelConfig c = parse_model_config(with_vision(vision), "", "test/config.json");
    EXPECT_FALSE(c.has_vision) << vision;
    EXPECT_THAT(c.vision_problem, HasSubstr(why)) << vision;
    ASSERT_EQ(c.warnings.size(), 1u) << vision;
    EXPECT_THAT(c.warnings[0], HasSubstr("test/config.json vision_config: " + why));
    EXPECT_THAT(c.warnings[0], HasSubstr("images are not supported with this checkpoint (text is unaffected)"));
    EXPECT_EQ(c.hidden_size, 64);
  }
  EXPECT_TRUE(parse_model_config(with_vision(R"({"out_hidden_size": 64})")).has_vision);
}

}  // namespace
}  // namespace kiln::format
