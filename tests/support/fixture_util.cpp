#include "fixture_util.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>

#include "core/dtype.h"
#include "format/weight_map.h"

namespace kiln::test {
namespace fs = std::filesystem;
using nlohmann::json;

TempDir::TempDir() {
  std::string tmpl = (fs::temp_directory_path() / "kiln-test-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

const char* family_name(Family f) {
  switch (f) {
    case Family::qwen3_5_moe: return "qwen3_5_moe";
    case Family::qwen3_5_moe_text: return "qwen3_5_moe_text";
    case Family::qwen3_5: return "qwen3_5";
    case Family::qwen3_next: return "qwen3_next";
    case Family::qwen3_moe: return "qwen3_moe";
    case Family::qwen3: return "qwen3";
  }
  return "?";
}

std::vector<Family> all_families() {
  return {Family::qwen3_5_moe, Family::qwen3_5_moe_text, Family::qwen3_5, Family::qwen3_next, Family::qwen3_moe,
          Family::qwen3};
}

std::string tiny_config_json(Family family) {
  // Shared small sizes: hidden 64, 4 layers (3 linear + 1 full for the hybrids), 4 query / 2 KV heads x 16.
  json text = {{"vocab_size", 96},          {"hidden_size", 64},       {"num_hidden_layers", 4},
               {"num_attention_heads", 4},  {"num_key_value_heads", 2}, {"head_dim", 16},
               {"rms_norm_eps", 1e-6},      {"max_position_embeddings", 256}, {"tie_word_embeddings", false},
               {"eos_token_id", 95}};
  const bool hybrid = family != Family::qwen3_moe && family != Family::qwen3;
  if (hybrid) {
    text["linear_num_key_heads"] = 2;
    text["linear_num_value_heads"] = 4;
    text["linear_key_head_dim"] = 16;
    text["linear_value_head_dim"] = 16;
    text["linear_conv_kernel_dim"] = 4;
    text["full_attention_interval"] = 4;
    text["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000000.0}, {"partial_rotary_factor", 0.25}};
  } else {
    text["rope_theta"] = 1000000.0;
  }
  switch (family) {
    case Family::qwen3_5_moe:
    case Family::qwen3_5_moe_text:
    case Family::qwen3_next:
      text["num_experts"] = 8;
      text["num_experts_per_tok"] = 2;
      text["moe_intermediate_size"] = 32;
      text["shared_expert_intermediate_size"] = 32;
      if (family == Family::qwen3_next) text["intermediate_size"] = 96;
      break;
    case Family::qwen3_moe:
      text["num_experts"] = 8;
      text["num_experts_per_tok"] = 2;
      text["moe_intermediate_size"] = 32;
      text["intermediate_size"] = 96;
      text["norm_topk_prob"] = true;
      text["mlp_only_layers"] = json::array({1});
      break;
    case Family::qwen3_5:
    case Family::qwen3:
      text["intermediate_size"] = 96;
      break;
  }
  json cfg;
  switch (family) {
    case Family::qwen3_5_moe:
      cfg = {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}}, {"model_type", "qwen3_5_moe"}};
      text["model_type"] = "qwen3_5_moe_text";
      cfg["text_config"] = text;
      cfg["vision_config"] = {{"depth", 1},        {"hidden_size", 32},     {"num_heads", 2},
                              {"intermediate_size", 64}, {"out_hidden_size", 64}, {"num_position_embeddings", 16}};
      cfg["tie_word_embeddings"] = false;
      return cfg.dump(2);
    case Family::qwen3_5:
      cfg = {{"architectures", {"Qwen3_5ForConditionalGeneration"}}, {"model_type", "qwen3_5"}};
      text["model_type"] = "qwen3_5_text";
      cfg["text_config"] = text;
      cfg["tie_word_embeddings"] = false;
      return cfg.dump(2);
    case Family::qwen3_5_moe_text:
      text["architectures"] = {"Qwen3_5MoeForCausalLM"};
      text["model_type"] = "qwen3_5_moe_text";
      return text.dump(2);
    case Family::qwen3_next:
      text["architectures"] = {"Qwen3NextForCausalLM"};
      text["model_type"] = "qwen3_next";
      return text.dump(2);
    case Family::qwen3_moe:
      text["architectures"] = {"Qwen3MoeForCausalLM"};
      text["model_type"] = "qwen3_moe";
      return text.dump(2);
    case Family::qwen3:
      text["architectures"] = {"Qwen3ForCausalLM"};
      text["model_type"] = "qwen3";
      text["tie_word_embeddings"] = true;
      return text.dump(2);
  }
  return {};
}

std::string tiny_quant_json(Family family, Layout layout) {
  if (layout == Layout::bf16) return {};
  const std::string p = family == Family::qwen3_5_moe || family == Family::qwen3_5 ? "model.language_model." : "model.";
  json q = {{"producer", {{"name", "modelopt"}, {"version", "test"}}}};
  if (layout == Layout::nvfp4) {
    // Routed experts only; like the first 397B release, the router is not excluded.
    q["quantization"] = {{"quant_algo", "NVFP4"},
                         {"group_size", 16},
                         {"kv_cache_quant_algo", nullptr},
                         {"exclude_modules",
                          {"lm_head", p + "layers.*.self_attn*", p + "layers.*.linear_attn*",
                           p + "layers.*.mlp.shared_expert*", p + "layers.*.mlp.gate_proj",
                           p + "layers.*.mlp.up_proj", p + "layers.*.mlp.down_proj", "model.visual*", "mtp*"}}};
  } else {
    // NVFP4 experts + FP8 attention projections, FP8 KV cache.
    json layers = json::object();
    const auto cfg = format::parse_model_config(tiny_config_json(family));
    for (int l = 0; l < cfg.num_layers; ++l) {
      const std::string L = p + "layers." + std::to_string(l) + ".";
      if (cfg.layer_is_full_attention(l))
        for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"}) layers[L + "self_attn." + m] = {{"quant_algo", "FP8"}};
      if (cfg.layer_is_moe(l))
        for (int e = 0; e < cfg.num_experts; ++e)
          for (const char* m : {"gate_proj", "up_proj", "down_proj"})
            layers[L + "mlp.experts." + std::to_string(e) + "." + m] = {{"quant_algo", "NVFP4"}, {"group_size", 16}};
    }
    q["quantization"] = {{"quant_algo", "MIXED_PRECISION"}, {"kv_cache_quant_algo", "FP8"}, {"quantized_layers", layers}};
  }
  return q.dump(2);
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

void write_text(const std::string& path, const std::string& text) {
  write_file(path, std::vector<uint8_t>(text.begin(), text.end()));
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::vector<uint8_t> raw_safetensors(const std::string& header_json, const std::vector<uint8_t>& data,
                                     std::optional<uint64_t> header_len_override) {
  std::vector<uint8_t> out(8);
  const uint64_t len = header_len_override.value_or(header_json.size());
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(len >> (8 * i));
  out.insert(out.end(), header_json.begin(), header_json.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

format::ModelConfig write_fixture_model(const std::string& dir, Family family, Layout layout,
                                        const FixtureOptions& options) {
  fs::create_directories(dir);
  const std::string cfg_text = tiny_config_json(family);
  write_text(dir + "/config.json", cfg_text);
  const std::string quant_text = tiny_quant_json(family, layout);
  if (!quant_text.empty()) write_text(dir + "/hf_quant_config.json", quant_text);

  format::ModelConfig cfg = format::parse_model_config(cfg_text);
  const format::QuantConfig quant =
      quant_text.empty() ? format::QuantConfig{} : format::parse_hf_quant_config(quant_text);
  std::mt19937 rng(options.seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  format::SafetensorsWriter w;
  auto random_bytes = [&](DType dtype, const Shape& shape, bool positive) {
    const size_t n = static_cast<size_t>(shape.numel());
    std::vector<uint8_t> bytes(n * dtype_size(dtype));
    for (size_t i = 0; i < n; ++i) {
      float v = positive ? 0.01f + std::abs(uni(rng)) * 0.1f : uni(rng);
      switch (dtype) {
        case DType::BF16: { uint16_t h = f32_to_bf16(v); std::memcpy(&bytes[i * 2], &h, 2); break; }
        case DType::F32: std::memcpy(&bytes[i * 4], &v, 4); break;
        case DType::F8_E4M3: bytes[i] = f32_to_e4m3(positive ? v * 100 : v); break;
        case DType::U8: bytes[i] = static_cast<uint8_t>(rng()); break;
        default: break;
      }
    }
    return bytes;
  };
  for (const auto& t : format::expected_tensors(cfg, quant)) {
    const bool scale = t.name.ends_with("scale") || t.name.ends_with("scale_2");
    w.add(t.name, t.dtypes.front(), t.shape, random_bytes(t.dtypes.front(), t.shape, scale));
  }
  if (options.with_vision) {
    w.add("model.visual.patch_embed.proj.weight", DType::BF16, Shape{4, 4}, random_bytes(DType::BF16, Shape{4, 4}, false));
    w.add("model.visual.blocks.0.norm1.weight", DType::BF16, Shape{4}, random_bytes(DType::BF16, Shape{4}, false));
  }
  if (options.with_mtp) {
    w.add("mtp.fc.weight", DType::BF16, Shape{4, 8}, random_bytes(DType::BF16, Shape{4, 8}, false));
  }
  w.set_metadata("format", "pt");
  if (options.max_shard_bytes) w.write_sharded(dir, options.max_shard_bytes);
  else w.write(dir + "/model.safetensors");
  return cfg;
}

}  // namespace kiln::test
