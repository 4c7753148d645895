// ModelOpt quantisation configs: both spellings, globs, per-layer MIXED_PRECISION, errors.
#include "format/quant_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "fixture_util.h"

namespace kiln::format {
namespace {

using ::testing::HasSubstr;

TEST(Glob, WholeNameStarMatchesAnyRunIncludingDots) {
  EXPECT_TRUE(glob_match("lm_head", "lm_head"));
  EXPECT_FALSE(glob_match("lm_head", "lm_head2"));
  EXPECT_FALSE(glob_match("lm_head", "model.lm_head"));
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("*", "a.b.c"));
  EXPECT_TRUE(glob_match("model.layers.*.mlp.gate", "model.layers.12.mlp.gate"));
  EXPECT_TRUE(glob_match("model.layers.*.mlp.gate", "model.layers.1.2.mlp.gate"));  // '*' crosses dots
  EXPECT_FALSE(glob_match("model.layers.*.mlp.gate", "model.layers.12.mlp.gate_proj"));
  EXPECT_TRUE(glob_match("*self_attn*", "model.language_model.layers.3.self_attn.q_proj"));
  EXPECT_TRUE(glob_match("*.mlp.shared_expert*", "x.mlp.shared_expert_gate"));
  EXPECT_TRUE(glob_match("a?c", "abc"));
  EXPECT_FALSE(glob_match("a?c", "ac"));
  EXPECT_TRUE(glob_match("**a**", "xxaxx"));
  EXPECT_FALSE(glob_match("*a*b", "xxbxxa"));
  EXPECT_TRUE(glob_match("*a*b", "xxaxxbxxb"));
  // Pathological backtracking stays fast (linear-ish).
  EXPECT_FALSE(glob_match("*a*a*a*a*a*a*a*a*b", std::string(5000, 'a')));
}

TEST(QuantConfig, HfQuantConfigNvfp4) {
  QuantConfig q = parse_hf_quant_config(R"({
    "producer": {"name": "modelopt", "version": "0.37"},
    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                     "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.shared_expert*"]}})");
  EXPECT_TRUE(q.is_quantized());
  EXPECT_EQ(q.quant_algo, "NVFP4");
  EXPECT_EQ(q.group_size, 16);
  EXPECT_FALSE(q.kv_cache_fp8());
  EXPECT_EQ(q.scheme_for("model.layers.0.mlp.experts.5.up_proj"), QuantScheme::nvfp4);
  EXPECT_EQ(q.scheme_for("model.layers.0.self_attn.q_proj"), QuantScheme::none);
  EXPECT_EQ(q.scheme_for("lm_head"), QuantScheme::none);
  EXPECT_EQ(q.scheme_for("model.layers.0.mlp.shared_expert.up_proj"), QuantScheme::none);
  // The exclude list forgot the router: by this config alone it would be NVFP4 (weight_map overrides).
  EXPECT_EQ(q.scheme_for("model.layers.0.mlp.gate"), QuantScheme::nvfp4);
}

TEST(QuantConfig, ConfigJsonQuantizationConfig) {
  QuantConfig q = parse_quantization_config(R"({"quant_method": "modelopt", "quant_algo": "FP8",
      "ignore": ["lm_head", "*.mlp.gate"], "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": false}})");
  EXPECT_EQ(q.quant_algo, "FP8");
  EXPECT_TRUE(q.kv_cache_fp8());
  EXPECT_EQ(q.scheme_for("model.layers.0.self_attn.o_proj"), QuantScheme::fp8);
  EXPECT_EQ(q.scheme_for("model.layers.0.mlp.gate"), QuantScheme::none);
}

TEST(QuantConfig, MixedPrecisionPerLayer) {
  QuantConfig q = parse_hf_quant_config(R"({"producer": {"name": "modelopt"}, "quantization": {
      "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8",
      "quantized_layers": {"model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
                           "model.layers.0.mlp.experts.0.up_proj": {"quant_algo": "NVFP4", "group_size": 16}},
      "exclude_modules": ["lm_head"]}})");
  EXPECT_TRUE(q.kv_cache_fp8());
  EXPECT_EQ(q.scheme_for("model.layers.0.self_attn.q_proj"), QuantScheme::fp8);
  EXPECT_EQ(q.scheme_for("model.layers.0.mlp.experts.0.up_proj"), QuantScheme::nvfp4);
  EXPECT_EQ(q.scheme_for("model.layers.0.mlp.experts.1.up_proj"), QuantScheme::none);  // not listed
  EXPECT_EQ(q.scheme_for("lm_head"), QuantScheme::none);
}

TEST(QuantConfig, NotQuantised) {
  QuantConfig q;
  EXPECT_FALSE(q.is_quantized());
  EXPECT_EQ(q.scheme_for("anything"), QuantScheme::none);
}

TEST(QuantConfig, ClearErrors) {
  auto err = [](auto fn) {
    try {
      fn();
      return std::string();
    } catch (const Error& e) {
      return std::string(e.what());
    }
  };
  EXPECT_THAT(err([] { parse_hf_quant_config(R"({"quantization": {"quant_algo": "INT4_AWQ"}})"); }),
              HasSubstr("quant_algo 'INT4_AWQ' is not supported (supported: NVFP4, FP8, MIXED_PRECISION)"));
  EXPECT_THAT(err([] { parse_hf_quant_config(R"({"producer": {"name": "other"}, "quantization": {"quant_algo": "NVFP4"}})"); }),
              HasSubstr("producer 'other' is not supported"));
  EXPECT_THAT(err([] { parse_hf_quant_config(R"({"producer": {"name": "modelopt"}})"); }), HasSubstr("\"quantization\""));
  EXPECT_THAT(err([] { parse_quantization_config(R"({"quant_method": "gptq", "bits": 4})"); }),
              HasSubstr("quant_method 'gptq' is not supported"));
  EXPECT_THAT(err([] { parse_hf_quant_config(R"({"quantization": {"quant_algo": "NVFP4", "group_size": 32}})"); }),
              HasSubstr("group_size 32 is not supported"));
  EXPECT_THAT(err([] { parse_hf_quant_config(R"({"quantization": {"quant_algo": "MIXED_PRECISION"}})"); }),
              HasSubstr("needs a \"quantized_layers\""));
  EXPECT_THAT(err([] { parse_hf_quant_config(R"({"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}})"); }),
              HasSubstr("\"exclude_modules\" must be a list"));
  EXPECT_THAT(err([] { parse_hf_quant_config("nope", "x/hf_quant_config.json"); }),
              HasSubstr("x/hf_quant_config.json: not valid JSON"));
}

TEST(QuantConfig, LoadPrefersHfQuantConfigThenConfigJson) {
  kiln::test::TempDir tmp;
  kiln::test::write_text(tmp.file("config.json"),
                         R"({"model_type": "qwen3", "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}})");
  QuantConfig a = load_quant_config(ModelDir::open(tmp.path()));
  EXPECT_EQ(a.quant_algo, "FP8");
  EXPECT_THAT(a.source, HasSubstr("config.json quantization_config"));
  kiln::test::write_text(tmp.file("hf_quant_config.json"),
                         R"({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}})");
  QuantConfig b = load_quant_config(ModelDir::open(tmp.path()));
  EXPECT_EQ(b.quant_algo, "NVFP4");
  EXPECT_THAT(b.source, HasSubstr("hf_quant_config.json"));
  kiln::test::TempDir plain;
  kiln::test::write_text(plain.file("config.json"), R"({"model_type": "qwen3"})");
  EXPECT_FALSE(load_quant_config(ModelDir::open(plain.path())).is_quantized());
}

}  // namespace
}  // namespace kiln::format
