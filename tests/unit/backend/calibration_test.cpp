// kiln quantize's calibration through kiln's own engine (backend/calibration.h): the recorded max |input| of
// linears and routed experts checked against direct computations written out in this test, the forward
// pass unchanged by the recording wrapper, and input_scale = amax / (6 * 448) in the quantised checkpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "fixture_util.h"
#include "backend/calibration.h"
#include "backend/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "format/model_dir.h"
#include "format/quantize_checkpoint.h"
#include "format/safetensors.h"
#include "model/runner.h"

namespace {

using namespace kiln;
using kiln::test::Family;
using kiln::test::Layout;
using kiln::test::TempDir;

float bf16_at(const format::TensorInfo& t, int64_t i) {
  uint16_t h;
  std::memcpy(&h, t.data + i * 2, 2);
  return bf16_to_f32(h);
}

std::vector<std::vector<int32_t>> sample_prompts(int64_t vocab) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  std::vector<std::vector<int32_t>> prompts;
  for (int n : {9, 23, 4}) {
    std::vector<int32_t> p(n);
    for (auto& t : p) t = id(rng);
    prompts.push_back(p);
  }
  return prompts;
}

struct Fixture {
  TempDir tmp;
  format::ModelConfig config;
  Fixture() { config = kiln::test::write_fixture_model(tmp.path(), Family::qwen3_5_moe, Layout::bf16); }
};

// The first layer's first projection reads input_layernorm(embedding): its amax, by hand in double.
TEST(EngineCalibration, FirstLayerInputAmaxMatchesTheNormalisedEmbedding) {
  Fixture f;
  auto dir = format::ModelDir::open(f.tmp.path());
  const auto prompts = sample_prompts(f.config.vocab_size);
  const auto amax = backend::calibrate_input_amax(dir, prompts);

  const auto ckpt = format::Checkpoint::open(dir);
  const std::string P = ckpt.has("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  const auto& embed = ckpt.get(P + "embed_tokens.weight");
  const auto& norm = ckpt.get(P + "layers.0.input_layernorm.weight");
  const int64_t H = f.config.hidden_size;
  double expected = 0;
  for (const auto& p : prompts)
    for (int32_t tok : p) {
      double ss = 0;
      for (int64_t i = 0; i < H; ++i) ss += double(bf16_at(embed, tok * H + i)) * bf16_at(embed, tok * H + i);
      const double inv = 1.0 / std::sqrt(ss / H + f.config.rms_norm_eps);
      for (int64_t i = 0; i < H; ++i)  // qwen3_5: zero-centred norm weight, x_hat * (1 + w)
        expected = std::max(expected, std::abs(bf16_at(embed, tok * H + i) * inv * (1.0 + bf16_at(norm, i))));
    }
  const bool linear0 = f.config.layer_types[0] == format::LayerType::linear_attention;
  const std::vector<std::string> readers =
      linear0 ? std::vector<std::string>{"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
                                         "linear_attn.in_proj_b"}
              : std::vector<std::string>{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"};
  for (const auto& m : readers) {
    const std::string module = P + "layers.0." + m;
    ASSERT_TRUE(amax.count(module)) << module;
    EXPECT_NEAR(amax.at(module), expected, 1e-5 * expected) << module;
  }
  // Routed experts get per-expert names, like the quantised checkpoint's modules.
  EXPECT_TRUE(amax.count(P + "layers.0.mlp.experts.0.gate_proj") || amax.count(P + "layers.0.mlp.experts.1.gate_proj"));
  for (const auto& [module, value] : amax) {
    EXPECT_GT(value, 0.0f) << module;
    EXPECT_EQ(module.find("gate_up_proj"), std::string::npos) << module;
  }
}

// moe_experts through the wrapper: same output as the inner backend, and per expert the amax of the routed
// rows and of silu(gate x) * up x, computed here with plain loops over the checkpoint's BF16 weights.
TEST(EngineCalibration, ExpertAmaxIsOverTheRoutedRowsOnly) {
  Fixture f;
  auto dir = format::ModelDir::open(f.tmp.path());
  const auto ckpt = format::Checkpoint::open(dir);
  const std::string P = ckpt.has("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  const std::string X = P + "layers.1.mlp.experts.";
  const auto& gate_up = ckpt.get(X + "gate_up_proj");  // [E, 2I, H]
  const auto& down = ckpt.get(X + "down_proj");        // [E, H, I]
  const int64_t E = gate_up.shape[0], I = gate_up.shape[1] / 2, H = gate_up.shape[2];

  backend::CalibratingOps ops(backend::make_cpu_backend());
  ops.set_checkpoint(&ckpt);
  auto inner = backend::make_cpu_backend();
  const TensorView gu = ops.place_weight(gate_up.view()), dn = ops.place_weight(down.view());
  std::vector<model::ExpertWeights> experts(E);
  auto slice = [](const TensorView& t, int64_t e, int64_t row0, int64_t rows) {
    model::LinearWeight w;
    w.out_features = rows;
    w.in_features = t.dim(2);
    w.weight = TensorView(static_cast<uint8_t*>(t.data) + ((e * t.dim(1) + row0) * t.dim(2)) * 2, DType::BF16,
                          Shape{rows, t.dim(2)});
    return w;
  };
  for (int64_t e = 0; e < E; ++e) {
    experts[e].gate = slice(gu, e, 0, I);
    experts[e].up = slice(gu, e, I, I);
    experts[e].down = slice(dn, e, 0, H);
  }
  // 6 tokens, top-2; expert E-1 never chosen. Token rows scaled differently so the routed max differs
  // from the global max.
  const int64_t T = 6, k = 2;
  std::vector<int32_t> ids = {0, 1, 1, 2, 0, 2, 3, 0, 1, 3, 2, 0};
  std::vector<float> route_w(T * k, 0.5f), x(T * H);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) x[t * H + i] = nd(rng) * float(t + 1);
  ASSERT_GT(E, 4);

  std::vector<float> out_wrapped(T * H), out_plain(T * H);
  const TensorView xv(x.data(), DType::F32, Shape{T, H}), idv(ids.data(), DType::I32, Shape{T, k}),
      wv(route_w.data(), DType::F32, Shape{T, k});
  ops.moe_experts(xv, idv, wv, experts, TensorView(out_wrapped.data(), DType::F32, Shape{T, H}));
  inner->moe_experts(xv, idv, wv, experts, TensorView(out_plain.data(), DType::F32, Shape{T, H}));
  EXPECT_EQ(out_wrapped, out_plain);

  const auto& amax = ops.amax();
  for (int64_t e = 0; e < E; ++e) {
    double x_max = 0, h_max = 0;
    bool routed = false;
    for (int64_t t = 0; t < T; ++t) {
      if (ids[t * k] != e && ids[t * k + 1] != e) continue;
      routed = true;
      for (int64_t i = 0; i < H; ++i) x_max = std::max(x_max, double(std::abs(x[t * H + i])));
      for (int64_t n = 0; n < I; ++n) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < H; ++i) {
          g += double(x[t * H + i]) * bf16_at(gate_up, (e * 2 * I + n) * H + i);
          u += double(x[t * H + i]) * bf16_at(gate_up, (e * 2 * I + I + n) * H + i);
        }
        h_max = std::max(h_max, std::abs(g / (1.0 + std::exp(-g)) * u));
      }
    }
    const std::string base = X + std::to_string(e) + ".";
    if (!routed) {
      EXPECT_FALSE(amax.count(base + "gate_proj")) << e;
      continue;
    }
    ASSERT_TRUE(amax.count(base + "gate_proj")) << e;
    EXPECT_FLOAT_EQ(amax.at(base + "gate_proj"), x_max) << e;
    EXPECT_FLOAT_EQ(amax.at(base + "up_proj"), x_max) << e;
    EXPECT_NEAR(amax.at(base + "down_proj"), h_max, 1e-4 * h_max) << e;
  }
}

TEST(EngineCalibration, WrapperLeavesTheLogitsUnchanged) {
  Fixture f;
  auto dir = format::ModelDir::open(f.tmp.path());
  model::RunnerOptions ro;
  ro.state_slots = 1;
  ro.max_context = 64;
  model::Runner plain(backend::make_cpu_backend(), dir, ro);
  model::Runner wrapped(std::make_unique<backend::CalibratingOps>(backend::make_cpu_backend()), dir, ro);
  dynamic_cast<backend::CalibratingOps&>(wrapped.ops()).set_checkpoint(wrapped.model().checkpoint.get());
  std::vector<int32_t> pages(plain.capacity().kv_pages);
  for (size_t p = 0; p < pages.size(); ++p) pages[p] = static_cast<int32_t>(p);
  const auto prompt = sample_prompts(f.config.vocab_size)[1];
  std::vector<float> a(plain.vocab_size()), b(plain.vocab_size());
  model::SeqChunk c;
  c.state_slot = 0;
  c.tokens = prompt;
  c.page_table = pages;
  plain.forward({&c, 1}, a);
  wrapped.forward({&c, 1}, b);
  EXPECT_EQ(a, b);
  EXPECT_FALSE(dynamic_cast<backend::CalibratingOps&>(wrapped.ops()).amax().empty());
}

TEST(EngineCalibration, QuantisedInputScaleIsAmaxOver6x448) {
  Fixture f;
  auto dir = format::ModelDir::open(f.tmp.path());
  format::QuantizeOptions opt;
  opt.input_amax = backend::calibrate_input_amax(dir, sample_prompts(f.config.vocab_size));
  TempDir out;
  const std::string out_dir = out.path() + "/q";
  const auto summary = format::quantize_checkpoint_nvfp4(f.tmp.path(), out_dir, opt);
  EXPECT_GT(summary.calibrated, 0);
  EXPECT_EQ(summary.uncalibrated, 0);
  const auto q = format::Checkpoint::open(format::ModelDir::open(out_dir));
  int checked = 0;
  for (const auto& [module, amax] : opt.input_amax) {
    const auto* s = q.find(module + ".input_scale");
    if (s == nullptr) continue;
    float v;
    std::memcpy(&v, s->data, 4);
    EXPECT_FLOAT_EQ(v, amax / (6.0f * 448.0f)) << module;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

}  // namespace
