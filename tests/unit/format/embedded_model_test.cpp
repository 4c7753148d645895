// The committed default model (models/kiln-tiny, which the binary embeds: src/format/embedded_model.h): a
// qwen3_5_moe checkpoint in nvidia's NVFP4 layout (routed experts NVFP4, the rest BF16), as kiln quantize wrote it.
// Checks the files agree with each other and with kiln's weight map; the Python reader (tools/tiny/nvfp4.py)
// re-checks the layout.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/dtype.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "format/weight_map.h"

namespace {

using namespace kiln;
using namespace kiln::format;

const std::string kDir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(KilnTiny, ConfigIsTheQwen35MoeShapeWeTrained) {
  ModelDir dir = ModelDir::open(kDir);
  ModelConfig cfg = load_model_config(dir);
  EXPECT_EQ(cfg.arch, Arch::qwen3_5_moe);
  EXPECT_EQ(cfg.hidden_size, 256);
  EXPECT_EQ(cfg.num_layers, 8);
  EXPECT_EQ(cfg.layer_pattern(), "2 x [linear, linear, linear, full]");
  EXPECT_EQ(cfg.num_experts, 16);
  EXPECT_EQ(cfg.experts_per_tok, 2);
  EXPECT_EQ(cfg.moe_intermediate_size, 128);
  EXPECT_EQ(cfg.shared_expert_intermediate_size, 256);
  EXPECT_EQ(cfg.linear_num_key_heads, 2);
  EXPECT_EQ(cfg.linear_num_value_heads, 4);
  EXPECT_TRUE(cfg.attn_output_gate);
  EXPECT_TRUE(cfg.norm_zero_centred);
  EXPECT_EQ(cfg.rotary_dim(), 16);
  EXPECT_EQ(cfg.vocab_size, 2112);
  EXPECT_EQ(cfg.eos_token_ids, (std::vector<int64_t>{2048, 2050}));
  EXPECT_FALSE(cfg.bos_token_id.has_value());
}

TEST(KilnTiny, CheckpointHasNvfp4ExpertsAndBf16Rest) {
  ModelDir dir = ModelDir::open(kDir);
  Checkpoint ck = Checkpoint::open(dir);
  ModelConfig cfg = load_model_config(dir);
  QuantConfig quant = load_quant_config(dir);
  EXPECT_EQ(quant.quant_algo, "NVFP4");
  EXPECT_EQ(quant.group_size, 16);
  VerifyReport report = verify_checkpoint(ck, cfg, quant);
  EXPECT_EQ(report.unexpected, 0);
  EXPECT_EQ(cfg.expert_layout, ExpertLayout::per_expert);

  int64_t nvfp4_linears = 0;
  for (const auto& [name, t] : ck.tensors()) {
    const bool expert = name.find(".mlp.experts.") != std::string::npos;
    if (!expert) {
      EXPECT_EQ(t.dtype, DType::BF16) << name;
      continue;
    }
    if (name.ends_with(".weight_scale_2")) {
      ++nvfp4_linears;
      float s2, in;
      std::memcpy(&s2, t.data, 4);
      const std::string base = name.substr(0, name.size() - std::strlen(".weight_scale_2"));
      std::memcpy(&in, ck.get(base + ".input_scale").data, 4);
      EXPECT_GT(s2, 0.0f) << name;
      EXPECT_GT(in, 0.0f) << name;
      EXPECT_NE(in, 1.0f) << name << ": input_scale should come from calibration";
    }
  }
  EXPECT_EQ(nvfp4_linears, 8 * 16 * 3);
  // Routers are listed as excluded (nvidia's first 397B release forgot them).
  auto q = nlohmann::json::parse(read_text(kDir + "/hf_quant_config.json"));
  std::set<std::string> excl = q["quantization"]["exclude_modules"].get<std::set<std::string>>();
  for (int l = 0; l < 8; ++l) {
    EXPECT_TRUE(excl.count("model.layers." + std::to_string(l) + ".mlp.gate")) << l;
    EXPECT_TRUE(excl.count("model.layers." + std::to_string(l) + ".mlp.shared_expert_gate")) << l;
  }
  EXPECT_TRUE(excl.count("lm_head"));
}

TEST(KilnTiny, TokenizerAndTemplateFilesAgree) {
  auto tc = nlohmann::json::parse(read_text(kDir + "/tokenizer_config.json"));
  EXPECT_EQ(tc["eos_token"], "<|im_end|>");
  EXPECT_EQ(tc["pad_token"], "<|endoftext|>");
  EXPECT_TRUE(tc["bos_token"].is_null());
  EXPECT_FALSE(tc.contains("chat_template"));
  auto tok = nlohmann::json::parse(read_text(kDir + "/tokenizer.json"));
  std::map<std::string, int> added;
  for (const auto& t : tok["added_tokens"]) added[t["content"]] = t["id"];
  EXPECT_EQ(added.at("<|endoftext|>"), 2048);
  EXPECT_EQ(added.at("<|im_start|>"), 2049);
  EXPECT_EQ(added.at("<|im_end|>"), 2050);
  // Same offsets from <|endoftext|> as Qwen3.5 (248044 ...): <tool_call> +14, <think> +24, </think> +25.
  EXPECT_EQ(added.at("<tool_call>"), 2048 + 14);
  EXPECT_EQ(added.at("<tool_response>"), 2048 + 22);
  EXPECT_EQ(added.at("<think>"), 2048 + 24);
  EXPECT_EQ(added.at("</think>"), 2048 + 25);
  EXPECT_EQ(read_text(kDir + "/chat_template.jinja"),
            read_text(std::string(KILN_SOURCE_DIR) + "/tools/tiny/chat_template.jinja"));
  auto gen = nlohmann::json::parse(read_text(kDir + "/generation_config.json"));
  EXPECT_EQ(gen["eos_token_id"], (std::vector<int>{2050, 2048}));
}

TEST(KilnTiny, PythonReaderAcceptsTheLayout) {
  if (std::system("python3 -c 'import struct, json' > /dev/null 2>&1") != 0) GTEST_SKIP() << "python3 not found";
  const std::string cmd = "python3 " + std::string(KILN_SOURCE_DIR) + "/tools/tiny/nvfp4.py check " + kDir +
                          " > /dev/null 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
}

}  // namespace
