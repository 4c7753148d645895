// --load-format dummy: the deterministic random fill, the synthetic checkpoint, and whole models loaded from
// config.json alone (kiln-tiny's config) giving finite logits. Also Runner::forward_argmax against forward().
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "model/dummy_weights.h"
#include "model/runner.h"

namespace kiln::model {
namespace {

const std::string kTiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";

TEST(RandomFill, BytesStayInTheirRangeWithBalancedSigns) {
  RandomFill f;
  f.kind = RandomFill::Kind::bytes;
  f.byte_lo = 0x28;
  f.byte_hi = 0x48;
  f.random_sign = true;
  f.seed = 42;
  std::vector<uint8_t> b(100000);
  fill_random_host(DType::F8_E4M3, static_cast<int64_t>(b.size()), f, b.data());
  int neg = 0;
  std::vector<int> seen(256, 0);
  for (uint8_t x : b) {
    neg += x >> 7;
    const int mag = x & 0x7f;
    ASSERT_GE(mag, 0x28);
    ASSERT_LT(mag, 0x48);
    ++seen[mag];
  }
  EXPECT_NEAR(neg / 100000.0, 0.5, 0.01);
  for (int m = 0x28; m < 0x48; ++m) EXPECT_NEAR(seen[m] / 100000.0, 1.0 / 32, 0.004) << m;
  // Deterministic per seed, different across seeds.
  std::vector<uint8_t> again(b.size()), other(b.size());
  fill_random_host(DType::F8_E4M3, static_cast<int64_t>(b.size()), f, again.data());
  EXPECT_EQ(b, again);
  f.seed = 43;
  fill_random_host(DType::F8_E4M3, static_cast<int64_t>(b.size()), f, other.data());
  EXPECT_NE(b, other);
}

TEST(RandomFill, UniformFloatsCoverTheirRange) {
  RandomFill f;
  f.lo = -0.25f;
  f.hi = 0.75f;
  f.seed = 7;
  const int64_t n = 200000;
  std::vector<float> x(n);
  fill_random_host(DType::F32, n, f, x.data());
  double sum = 0, sq = 0;
  float lo = 1e9f, hi = -1e9f;
  for (float v : x) {
    sum += v;
    sq += (v - 0.25) * (v - 0.25);
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  EXPECT_GE(lo, -0.25f);
  EXPECT_LT(hi, 0.75f);
  EXPECT_LT(lo, -0.249f);
  EXPECT_GT(hi, 0.749f);
  EXPECT_NEAR(sum / n, 0.25, 0.005);
  EXPECT_NEAR(sq / n, 1.0 / 12, 0.002);  // variance of U(a, a + 1)
  std::vector<uint16_t> bf(n);
  fill_random_host(DType::BF16, n, f, bf.data());
  for (int64_t i = 0; i < n; i += 997) EXPECT_EQ(bf[i], f32_to_bf16(x[i]));  // same value, rounded
  EXPECT_THROW(fill_random_host(DType::I32, 4, f, x.data()), Error);
}

TEST(DummyCheckpoint, HasTheRealCheckpointsTensorsWithTheirDtypesAndShapes) {
  const format::ModelDir dir = format::ModelDir::open(kTiny);
  const format::ModelConfig config = format::load_model_config(dir);
  const format::QuantConfig quant = format::load_quant_config(dir);
  const format::Checkpoint real = format::Checkpoint::open(dir);
  const format::Checkpoint dummy = dummy_checkpoint(dir, config, quant);
  EXPECT_TRUE(dummy.is_synthetic());
  EXPECT_GT(dummy.size(), 1000u);
  for (const auto& [name, t] : dummy.tensors()) {
    const format::TensorInfo* r = real.find(name);
    ASSERT_NE(r, nullptr) << name << " is not in the real kiln-tiny checkpoint";
    EXPECT_EQ(t.dtype, r->dtype) << name;
    EXPECT_EQ(t.shape.numel(), r->shape.numel()) << name;
    EXPECT_EQ(t.data, nullptr);
  }
  // Every real language-model tensor but the optional ones (input scales are; kv scales too) is there.
  int missing = 0;
  for (const auto& [name, t] : real.tensors())
    if (!dummy.has(name) && !name.ends_with("input_scale") && !name.ends_with("_scale_k") && !name.starts_with("mtp"))
      ++missing;
  EXPECT_LE(missing, 0);
}

TEST(DummyWeights, ScalarsGiveUnitVarianceWeights) {
  const format::ModelDir dir = format::ModelDir::open(kTiny);
  const format::ModelConfig config = format::load_model_config(dir);
  const format::QuantConfig quant = format::load_quant_config(dir);
  const format::Checkpoint dummy = dummy_checkpoint(dir, config, quant);
  for (const auto& [name, t] : dummy.tensors()) {
    if (!name.ends_with(".weight_scale_2")) continue;
    const std::string module = name.substr(0, name.size() - 15);
    const format::TensorInfo& w = dummy.get(module + ".weight");
    const double K = 2.0 * static_cast<double>(w.shape[1]);
    // E2M1 codes uniform over 16: mean square (0 + .25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8; block scales [0.5, 2)
    // with E4M3's 8 steps per octave: mean square of the 16 values 0.5 .. 1.875 (independent arithmetic).
    double block_sq = 0;
    for (int e = 0; e < 2; ++e)
      for (int m = 0; m < 8; ++m) block_sq += std::pow(std::ldexp(1.0 + m / 8.0, e - 1), 2) / 16;
    const double code_sq = (0 + .25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8;
    const double s2 = dummy_scalar(name, dummy);
    const double var = code_sq * block_sq * s2 * s2 * K;  // sum over K of w^2: the output variance for unit x
    EXPECT_NEAR(var, 1.0, 0.5) << name;
    break;
  }
}

struct TinyRunner {
  std::unique_ptr<Runner> runner;
  std::vector<std::vector<int32_t>> pages;
  explicit TinyRunner(LoadFormat lf, int slots = 4) {
    RunnerOptions ro;
    ro.load_format = lf;
    ro.state_slots = slots;
    ro.max_context = 128;
    runner = std::make_unique<Runner>(backend::make_cpu_backend(), format::ModelDir::open(kTiny), ro);
    const int64_t per = runner->capacity().kv_pages / slots;
    for (int s = 0; s < slots; ++s) {
      pages.emplace_back(per);
      for (int64_t p = 0; p < per; ++p) pages.back()[p] = static_cast<int32_t>(s * per + p);
    }
  }
};

TEST(DummyWeights, WholeModelGivesFiniteLogitsOfSaneSize) {
  TinyRunner t(LoadFormat::dummy);
  std::vector<int32_t> prompt = {1, 50, 300, 7, 1999, 42, 42, 42};
  SeqChunk ch;
  ch.state_slot = 0;
  ch.tokens = prompt;
  ch.page_table = t.pages[0];
  std::vector<float> logits(t.runner->vocab_size());
  t.runner->forward({&ch, 1}, logits);
  double sq = 0;
  for (float v : logits) {
    ASSERT_TRUE(std::isfinite(v));
    sq += double(v) * v;
  }
  const double rms = std::sqrt(sq / logits.size());
  EXPECT_GT(rms, 1e-3);
  EXPECT_LT(rms, 1e3);
  // Same weights again: same logits (the fill is deterministic).
  TinyRunner u(LoadFormat::dummy);
  ch.page_table = u.pages[0];
  std::vector<float> again(logits.size());
  u.runner->forward({&ch, 1}, again);
  EXPECT_EQ(logits, again);
}

TEST(HostArgmax, LowestIndexOnTiesAndNaNNeverWins) {
  const float nan = std::nanf("");
  const float a[] = {1.0f, 3.0f, 2.0f, 3.0f};
  EXPECT_EQ(host_argmax(a, 4), 1);
  const float b[] = {nan, -5.0f, nan, -7.0f};
  EXPECT_EQ(host_argmax(b, 4), 1);
  const float c[] = {nan, nan};
  EXPECT_EQ(host_argmax(c, 2), 0);
  const float d[] = {-INFINITY, -INFINITY, 0.5f};
  EXPECT_EQ(host_argmax(d, 3), 2);
}

TEST(Runner, ForwardArgmaxPicksTheLargestLogitOfEachSequence) {
  TinyRunner t(LoadFormat::safetensors);
  std::vector<std::vector<int32_t>> prompts = {{5, 6, 7}, {100}, {9, 9, 9, 9, 9, 200}};
  auto chunks_for = [&](const TinyRunner& r) {
    std::vector<SeqChunk> chunks(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      chunks[i].state_slot = static_cast<int>(i);
      chunks[i].tokens = prompts[i];
      chunks[i].page_table = r.pages[i];
    }
    chunks[1].want_logits = false;
    return chunks;
  };
  const int64_t V = t.runner->vocab_size();
  std::vector<float> logits(2 * V);
  t.runner->forward(chunks_for(t), logits);
  TinyRunner u(LoadFormat::safetensors);
  std::vector<int32_t> ids(2, -1);
  u.runner->forward_argmax(chunks_for(u), ids);
  for (int r = 0; r < 2; ++r) {
    const float* row = logits.data() + r * V;
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (row[v] > row[best]) best = v;
    EXPECT_EQ(ids[r], best) << "row " << r;
  }
  std::vector<int32_t> too_small(1);
  EXPECT_THROW(u.runner->forward_argmax(chunks_for(u), too_small), Error);
}

}  // namespace
}  // namespace kiln::model
