// kiln quantize at the checkpoint level (format/quantize_checkpoint.h): a tiny qwen3_5_moe BF16
// checkpoint in, the ModelOpt NVFP4 layout out; checked with kiln's reader and weight map, against the
// source weights, and with the independent Python dequantiser (tools/tiny/nvfp4.py) when python3 exists.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <unistd.h>

#include "core/dtype.h"
#include "core/error.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/nvfp4_quant.h"
#include "format/quant_config.h"
#include "format/quantize_checkpoint.h"
#include "format/safetensors.h"
#include "format/weight_map.h"

namespace {

using namespace kiln;
using namespace kiln::format;
namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = (fs::temp_directory_path() /
             ("kiln_quantize_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++)))
                .string();
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}
std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Tiny qwen3_5_moe text model: hidden 32, layers [linear, full], 4 experts of 16, shared expert 32.
constexpr int64_t H = 32, E = 4, I = 16, S = 32, V = 64;

const char* kConfig = R"({
  "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
  "hidden_size": 32, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
  "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
  "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
  "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
  "vocab_size": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "hidden_act": "silu",
  "max_position_embeddings": 256, "eos_token_id": 1, "pad_token_id": 0,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                      "mrope_section": [1, 1, 0], "mrope_interleaved": true}
})";

struct Source {
  std::map<std::string, std::pair<Shape, std::vector<uint16_t>>> tensors;  // name -> (shape, bf16 bits)
  std::mt19937 rng{42};

  void add(const std::string& name, Shape shape, float stddev = 0.05f) {
    std::normal_distribution<float> d(0.0f, stddev);
    std::vector<uint16_t> v(static_cast<size_t>(shape.numel()));
    for (auto& x : v) x = f32_to_bf16(d(rng));
    tensors[name] = {shape, std::move(v)};
  }
  // Float copy of rows [r0, r0 + n) of expert e of a 3-D (or the whole of a 2-D) tensor.
  std::vector<float> rows(const std::string& name, int64_t e, int64_t r0, int64_t n) const {
    const auto& [shape, v] = tensors.at(name);
    const int64_t k = shape[shape.ndim - 1];
    const int64_t per_expert = shape.ndim == 3 ? shape[1] * k : 0;
    std::vector<float> out;
    for (int64_t i = 0; i < n * k; ++i) out.push_back(bf16_to_f32(v[static_cast<size_t>(e * per_expert + r0 * k + i)]));
    return out;
  }
  void write(const std::string& dir) const {
    SafetensorsWriter w;
    for (const auto& [name, t] : tensors)
      w.add(name, DType::BF16, t.first,
            {reinterpret_cast<const uint8_t*>(t.second.data()), t.second.size() * 2});
    w.write(dir + "/model.safetensors");
    write_text(dir + "/config.json", kConfig);
    write_text(dir + "/tokenizer.json", "{\"model\": {}}\n");
    write_text(dir + "/chat_template.jinja", "{{ messages }}\n");
    write_text(dir + "/generation_config.json", "{\"eos_token_id\": [1, 0]}\n");
  }
};

// per_expert: routed experts as mlp.experts.{e}.{gate,up,down}_proj.weight instead of fused tensors.
Source make_source(bool per_expert) {
  Source s;
  s.add("model.embed_tokens.weight", {V, H});
  s.add("model.norm.weight", {H});
  s.add("lm_head.weight", {V, H});
  for (int l = 0; l < 2; ++l) {
    const std::string L = "model.layers." + std::to_string(l) + ".";
    s.add(L + "input_layernorm.weight", {H});
    s.add(L + "post_attention_layernorm.weight", {H});
    if (l == 0) {
      s.add(L + "linear_attn.in_proj_qkv.weight", {64, H});
      s.add(L + "linear_attn.in_proj_z.weight", {32, H});
      s.add(L + "linear_attn.in_proj_b.weight", {2, H});
      s.add(L + "linear_attn.in_proj_a.weight", {2, H});
      s.add(L + "linear_attn.conv1d.weight", {64, 1, 4});
      s.add(L + "linear_attn.A_log", {2});
      s.add(L + "linear_attn.dt_bias", {2});
      s.add(L + "linear_attn.norm.weight", {16});
      s.add(L + "linear_attn.out_proj.weight", {H, 32});
    } else {
      s.add(L + "self_attn.q_proj.weight", {64, H});
      s.add(L + "self_attn.k_proj.weight", {16, H});
      s.add(L + "self_attn.v_proj.weight", {16, H});
      s.add(L + "self_attn.o_proj.weight", {H, 32});
      s.add(L + "self_attn.q_norm.weight", {16});
      s.add(L + "self_attn.k_norm.weight", {16});
    }
    s.add(L + "mlp.gate.weight", {E, H});
    s.add(L + "mlp.shared_expert.gate_proj.weight", {S, H});
    s.add(L + "mlp.shared_expert.up_proj.weight", {S, H});
    s.add(L + "mlp.shared_expert.down_proj.weight", {H, S});
    s.add(L + "mlp.shared_expert_gate.weight", {1, H});
    // Experts with a different magnitude per expert, so per-expert global scales differ.
    s.add(L + "mlp.experts.gate_up_proj", {E, 2 * I, H}, 0.02f);
    s.add(L + "mlp.experts.down_proj", {E, H, I}, 0.03f);
    if (per_expert) {
      Source fused = s;  // same values, stored per expert
      for (int64_t e = 0; e < E; ++e) {
        const std::string X = L + "mlp.experts." + std::to_string(e) + ".";
        auto put = [&](const std::string& name, Shape shape, const std::vector<float>& vals) {
          std::vector<uint16_t> bits;
          for (float f : vals) bits.push_back(f32_to_bf16(f));
          s.tensors[name] = {shape, bits};
        };
        put(X + "gate_proj.weight", {I, H}, fused.rows(L + "mlp.experts.gate_up_proj", e, 0, I));
        put(X + "up_proj.weight", {I, H}, fused.rows(L + "mlp.experts.gate_up_proj", e, I, I));
        put(X + "down_proj.weight", {H, I}, fused.rows(L + "mlp.experts.down_proj", e, 0, H));
      }
      s.tensors.erase(L + "mlp.experts.gate_up_proj");
      s.tensors.erase(L + "mlp.experts.down_proj");
    }
  }
  return s;
}

struct QuantizedView {
  std::vector<uint8_t> packed, scales;
  float s2 = 0, input_scale = 0;
};

QuantizedView read_linear(const Checkpoint& ck, const std::string& module, int64_t n, int64_t k) {
  const TensorInfo& w = ck.get(module + ".weight");
  const TensorInfo& sc = ck.get(module + ".weight_scale");
  const TensorInfo& s2 = ck.get(module + ".weight_scale_2");
  const TensorInfo& in = ck.get(module + ".input_scale");
  EXPECT_EQ(w.dtype, DType::U8) << module;
  EXPECT_EQ(w.shape, (Shape{n, k / 2})) << module;
  EXPECT_EQ(sc.dtype, DType::F8_E4M3) << module;
  EXPECT_EQ(sc.shape, (Shape{n, k / 16})) << module;
  EXPECT_EQ(s2.dtype, DType::F32) << module;
  EXPECT_EQ(s2.shape.ndim, 0) << module;
  EXPECT_EQ(in.dtype, DType::F32) << module;
  EXPECT_EQ(in.shape.ndim, 0) << module;
  QuantizedView q;
  q.packed.assign(w.data, w.data + w.nbytes);
  q.scales.assign(sc.data, sc.data + sc.nbytes);
  std::memcpy(&q.s2, s2.data, 4);
  std::memcpy(&q.input_scale, in.data, 4);
  return q;
}

TEST(QuantizeCheckpoint, FusedExpertsBecomePerExpertNvfp4) {
  TempDir tmp;
  const std::string in = tmp.sub("bf16"), out = tmp.sub("nvfp4");
  fs::create_directories(in);
  Source src = make_source(false);
  src.write(in);

  QuantizeOptions opt;
  // Own calibration for two modules; the layer's other gate_proj / down_proj take the layer's largest.
  opt.input_amax["model.layers.0.mlp.experts.1.gate_proj"] = 5.376f;
  opt.input_amax["model.layers.0.mlp.experts.2.down_proj"] = 2.688f;
  int64_t progress_calls = 0;
  opt.on_progress = [&](const QuantizeProgress& p) {
    ++progress_calls;
    EXPECT_LE(p.linears_done, p.linears_total);
  };
  QuantizeSummary sum = quantize_checkpoint_nvfp4(in, out, opt);
  EXPECT_EQ(sum.quantized_linears, 2 * E * 3);
  EXPECT_EQ(progress_calls, 2 * E * 3);
  EXPECT_EQ(sum.calibrated, 2);
  EXPECT_EQ(sum.calibrated_from_layer, 2 * (E - 1));
  EXPECT_EQ(sum.uncalibrated, 2 * E * 3 - 2 - 2 * (E - 1));

  ModelDir dir = ModelDir::open(out);
  Checkpoint ck = Checkpoint::open(dir);
  for (int l = 0; l < 2; ++l) {
    const std::string L = "model.layers." + std::to_string(l) + ".";
    EXPECT_FALSE(ck.has(L + "mlp.experts.gate_up_proj"));
    EXPECT_FALSE(ck.has(L + "mlp.experts.down_proj"));
    for (int64_t e = 0; e < E; ++e) {
      const std::string X = L + "mlp.experts." + std::to_string(e) + ".";
      struct P {
        const char* proj;
        int64_t row0, n, k;
        const char* src;
      } parts[] = {{"gate_proj", 0, I, H, "mlp.experts.gate_up_proj"},
                   {"up_proj", I, I, H, "mlp.experts.gate_up_proj"},
                   {"down_proj", 0, H, I, "mlp.experts.down_proj"}};
      for (const P& p : parts) {
        SCOPED_TRACE(X + p.proj);
        QuantizedView q = read_linear(ck, X + p.proj, p.n, p.k);
        const std::vector<float> w = src.rows(L + p.src, e, p.row0, p.n);
        // Same bytes as quantising the slice directly.
        nvfp4::QuantizedLinear want = nvfp4::quantize(w, p.n, p.k);
        EXPECT_EQ(q.packed, want.packed);
        EXPECT_EQ(q.scales, want.scales);
        EXPECT_EQ(q.s2, want.weight_scale_2);
        float amax = 0;
        for (float v : w) amax = std::fmax(amax, std::fabs(v));
        EXPECT_FLOAT_EQ(q.s2, amax / 2688.0f);
        // Dequantised weights stay within one block step of the source (bound derived in nvfp4_quant_test).
        std::vector<float> deq(w.size());
        nvfp4::dequantize(q.packed.data(), q.scales.data(), q.s2, p.n, p.k, deq.data());
        for (size_t i = 0; i < w.size(); ++i) {
          const float step = e4m3_to_f32(q.scales[i / 16]) * q.s2;
          ASSERT_LE(std::fabs(w[i] - deq[i]), 1.0001f * step) << i;
        }
        float want_in = 1.0f;
        if (l == 0 && std::string(p.proj) == "gate_proj") want_in = 5.376f / 2688.0f;
        if (l == 0 && std::string(p.proj) == "down_proj") want_in = 2.688f / 2688.0f;
        EXPECT_FLOAT_EQ(q.input_scale, want_in);
      }
    }
  }
  // Everything else is byte-identical.
  for (const auto& [name, t] : src.tensors) {
    if (name.find("mlp.experts.") != std::string::npos) continue;
    const TensorInfo& got = ck.get(name);
    EXPECT_EQ(got.dtype, DType::BF16) << name;
    EXPECT_EQ(got.shape, t.first) << name;
    ASSERT_EQ(got.nbytes, t.second.size() * 2) << name;
    EXPECT_EQ(std::memcmp(got.data, t.second.data(), got.nbytes), 0) << name;
  }
  EXPECT_EQ(ck.size(), src.tensors.size() - 4 + 2 * E * 3 * 4);

  // hf_quant_config.json: ModelOpt NVFP4, every unquantised linear (routers included) excluded.
  auto q = nlohmann::json::parse(read_text(out + "/hf_quant_config.json"));
  EXPECT_EQ(q["producer"]["name"], "modelopt");
  EXPECT_EQ(q["quantization"]["quant_algo"], "NVFP4");
  EXPECT_EQ(q["quantization"]["group_size"], 16);
  EXPECT_TRUE(q["quantization"]["kv_cache_quant_algo"].is_null());
  std::set<std::string> excl = q["quantization"]["exclude_modules"].get<std::set<std::string>>();
  for (const char* m : {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate",
                        "model.layers.0.mlp.shared_expert_gate", "model.layers.0.mlp.shared_expert.down_proj",
                        "model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_b",
                        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj"})
    EXPECT_TRUE(excl.count(m)) << m;
  for (const auto& m : excl) {
    EXPECT_EQ(m.find("mlp.experts."), std::string::npos) << m;
    EXPECT_EQ(m.find("embed_tokens"), std::string::npos) << m;
    EXPECT_EQ(m.find("norm"), std::string::npos) << m;
  }
  // kiln's own quantisation-config reader sees experts as NVFP4 and everything else as unquantised.
  QuantConfig qc = load_quant_config(dir);
  EXPECT_EQ(qc.scheme_for("model.layers.1.mlp.experts.3.up_proj"), QuantScheme::nvfp4);
  EXPECT_EQ(qc.scheme_for("model.layers.1.self_attn.q_proj"), QuantScheme::none);
  EXPECT_EQ(qc.scheme_for("model.layers.0.mlp.gate"), QuantScheme::none);

  // Other files copied as they were.
  for (const char* f : {"config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json"})
    EXPECT_EQ(read_text(out + "/" + f), read_text(in + "/" + f)) << f;
}

TEST(QuantizeCheckpoint, OutputPassesKilnWeightMapVerification) {
  TempDir tmp;
  const std::string in = tmp.sub("bf16"), out = tmp.sub("nvfp4");
  fs::create_directories(in);
  make_source(false).write(in);
  quantize_checkpoint_nvfp4(in, out, {});
  ModelDir dir = ModelDir::open(out);
  Checkpoint ck = Checkpoint::open(dir);
  ModelConfig cfg = load_model_config(dir);
  VerifyReport r = verify_checkpoint(ck, cfg, load_quant_config(dir));
  EXPECT_EQ(r.unexpected, 0);
  EXPECT_GT(r.matched, 0);
  EXPECT_EQ(cfg.expert_layout, ExpertLayout::per_expert);
}

TEST(QuantizeCheckpoint, PerExpertSourceGivesTheSameCheckpoint) {
  TempDir tmp;
  fs::create_directories(tmp.sub("fused"));
  fs::create_directories(tmp.sub("split"));
  make_source(false).write(tmp.sub("fused"));
  make_source(true).write(tmp.sub("split"));
  quantize_checkpoint_nvfp4(tmp.sub("fused"), tmp.sub("q1"), {});
  quantize_checkpoint_nvfp4(tmp.sub("split"), tmp.sub("q2"), {});
  EXPECT_EQ(read_text(tmp.sub("q1") + "/model.safetensors"), read_text(tmp.sub("q2") + "/model.safetensors"));
  EXPECT_EQ(read_text(tmp.sub("q1") + "/hf_quant_config.json"), read_text(tmp.sub("q2") + "/hf_quant_config.json"));
}

TEST(QuantizeCheckpoint, AllLinearsScopeKeepsRoutersEmbeddingsAndLmHead) {
  TempDir tmp;
  fs::create_directories(tmp.sub("bf16"));
  make_source(false).write(tmp.sub("bf16"));
  QuantizeOptions opt;
  opt.scope = QuantizeScope::all_linears;
  opt.exclude = {"*.linear_attn.in_proj_b", "*.linear_attn.in_proj_a"};
  quantize_checkpoint_nvfp4(tmp.sub("bf16"), tmp.sub("q"), opt);
  Checkpoint ck = Checkpoint::open(ModelDir::open(tmp.sub("q")));
  EXPECT_EQ(ck.get("model.layers.1.self_attn.q_proj.weight").dtype, DType::U8);
  EXPECT_EQ(ck.get("model.layers.0.linear_attn.in_proj_qkv.weight").dtype, DType::U8);
  EXPECT_EQ(ck.get("model.layers.0.mlp.shared_expert.down_proj.weight").dtype, DType::U8);
  EXPECT_EQ(ck.get("model.layers.0.linear_attn.in_proj_b.weight").dtype, DType::BF16);  // excluded by glob
  EXPECT_EQ(ck.get("model.layers.0.mlp.gate.weight").dtype, DType::BF16);
  EXPECT_EQ(ck.get("model.layers.0.mlp.shared_expert_gate.weight").dtype, DType::BF16);
  EXPECT_EQ(ck.get("lm_head.weight").dtype, DType::BF16);
  EXPECT_EQ(ck.get("model.embed_tokens.weight").dtype, DType::BF16);
  EXPECT_EQ(ck.get("model.layers.0.linear_attn.conv1d.weight").dtype, DType::BF16);
  auto q = nlohmann::json::parse(read_text(tmp.sub("q") + "/hf_quant_config.json"));
  std::set<std::string> excl = q["quantization"]["exclude_modules"].get<std::set<std::string>>();
  EXPECT_EQ(excl, (std::set<std::string>{"lm_head", "model.layers.0.linear_attn.in_proj_a",
                                         "model.layers.0.linear_attn.in_proj_b", "model.layers.0.mlp.gate",
                                         "model.layers.0.mlp.shared_expert_gate", "model.layers.1.mlp.gate",
                                         "model.layers.1.mlp.shared_expert_gate"}));
}

TEST(QuantizeCheckpoint, ExcludingAFusedLayerKeepsItWhole) {
  TempDir tmp;
  fs::create_directories(tmp.sub("bf16"));
  make_source(false).write(tmp.sub("bf16"));
  QuantizeOptions opt;
  opt.exclude = {"model.layers.1.mlp.experts.*"};
  QuantizeSummary s = quantize_checkpoint_nvfp4(tmp.sub("bf16"), tmp.sub("q"), opt);
  EXPECT_EQ(s.quantized_linears, E * 3);
  Checkpoint ck = Checkpoint::open(ModelDir::open(tmp.sub("q")));
  EXPECT_TRUE(ck.has("model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(ck.has("model.layers.0.mlp.experts.0.gate_proj.weight"));
  // Only some experts of a fused tensor: refused with a clear message.
  opt.exclude = {"model.layers.1.mlp.experts.2.*"};
  EXPECT_THROW(quantize_checkpoint_nvfp4(tmp.sub("bf16"), tmp.sub("q2"), opt), Error);
}

TEST(QuantizeCheckpoint, RefusesBadInputsClearly) {
  TempDir tmp;
  fs::create_directories(tmp.sub("bf16"));
  make_source(false).write(tmp.sub("bf16"));
  quantize_checkpoint_nvfp4(tmp.sub("bf16"), tmp.sub("q"), {});
  try {
    quantize_checkpoint_nvfp4(tmp.sub("q"), tmp.sub("qq"), {});
    FAIL() << "quantising a quantised checkpoint must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already quantised"), std::string::npos) << e.what();
  }
  EXPECT_THROW(quantize_checkpoint_nvfp4(tmp.sub("bf16"), tmp.sub("q"), {}), Error);  // output holds weights
  EXPECT_THROW(quantize_checkpoint_nvfp4(tmp.sub("bf16"), tmp.sub("bf16"), {}), Error);
  EXPECT_THROW(load_calibration_amax(tmp.sub("missing.json")), Error);
  write_text(tmp.sub("bad.json"), "{\"amax\": {\"x\": -1}}");
  EXPECT_THROW(load_calibration_amax(tmp.sub("bad.json")), Error);
  write_text(tmp.sub("good.json"), "{\"format\": \"kiln-calibration-amax/1\", \"amax\": {\"m.a\": 2.5}}");
  EXPECT_EQ(load_calibration_amax(tmp.sub("good.json")).at("m.a"), 2.5f);
}

// The independent Python reader/quantiser (pure Python, no numpy) re-derives the bytes of kiln's output.
TEST(QuantizeCheckpoint, MatchesPythonReference) {
  if (std::system("python3 -c 'import struct, json' > /dev/null 2>&1") != 0) GTEST_SKIP() << "python3 not found";
  TempDir tmp;
  for (bool per_expert : {false, true}) {
    const std::string in = tmp.sub(per_expert ? "split" : "fused"), out = in + "_q";
    fs::create_directories(in);
    make_source(per_expert).write(in);
    quantize_checkpoint_nvfp4(in, out, {});
    const std::string cmd = "python3 " + std::string(KILN_SOURCE_DIR) + "/tools/tiny/nvfp4.py check " + out + " " +
                            in + " > " + tmp.sub("py.log") + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << read_text(tmp.sub("py.log"));
  }
}

}  // namespace
