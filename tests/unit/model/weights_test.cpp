// The WeightBinder (src/model/weights.*) through load_model, with a backend that copies its weights in the
// background (as the CUDA backend does): the binder must call finish_weights() once, after the last placement and
// before anything runs; host bytes (mmapped or a tensor-parallel rank's slice buffers) must still be alive then;
// and the progress total must be the bytes placed.
// Host-only: the "device" is host memory written at finish_weights().
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"
#include "core/progress.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/shard_plan.h"
#include "model/model.h"

namespace kiln::model {
namespace {

const std::string kTiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";

// Places into memory of its own; the bytes are copied only at finish_weights(). Any compute op fails.
class DeferredOps final : public Ops {
 public:
  int finishes = 0;
  int placed_after_finish = 0;
  uint64_t placed_bytes = 0;
  uint64_t progress_total_seen = 0;  // weight_progress().total() while finishing (the load still in)

  std::string name() const override { return "deferred"; }
  std::string describe() const override { return "deferred"; }
  TensorView allocate(DType d, Shape s) override { return keep(d, s); }
  TensorView place_weight(const TensorView& h) override {
    if (finishes) ++placed_after_finish;
    TensorView v = keep(h.dtype, h.shape);
    pending_.push_back({v.data, h.data, h.nbytes()});
    placed_bytes += h.nbytes();
    return v;
  }
  void finish_weights() override {
    ++finishes;
    progress_total_seen = weight_progress().total();
    for (const Copy& c : pending_) std::memcpy(c.dst, c.src, c.bytes);
    pending_.clear();
  }
  TensorView scratch(DType d, Shape s) override { return keep(d, s); }
  void reset_scratch() override {}
  TensorView upload(const void*, DType, Shape) override { unused("upload"); }
  void download(const TensorView&, void*) override { unused("download"); }
  void fill_zero(TensorView) override { unused("fill_zero"); }
  void copy(const TensorView&, TensorView) override { unused("copy"); }
  float max_abs(const TensorView&) override { unused("max_abs"); }
  void embedding(const TensorView&, const TensorView&, TensorView) override { unused("embedding"); }
  void linear(const TensorView&, const LinearWeight&, TensorView) override { unused("linear"); }
  void rms_norm(const TensorView&, const TensorView&, float, NormKind, TensorView) override { unused("rms_norm"); }
  void gated_rms_norm(const TensorView&, const TensorView&, const TensorView&, float, TensorView) override {
    unused("gated_rms_norm");
  }
  void rope(TensorView, const TensorView&, int, double) override { unused("rope"); }
  void add(const TensorView&, const TensorView&, TensorView) override { unused("add"); }
  void silu_mul(const TensorView&, const TensorView&, TensorView) override { unused("silu_mul"); }
  void sigmoid_mul(const TensorView&, const TensorView&, TensorView) override { unused("sigmoid_mul"); }
  void gather_rows(const TensorView&, const TensorView&, TensorView) override { unused("gather_rows"); }
  void kv_store(const TensorView&, const TensorView&, KvLayerView, const StepLayout&) override { unused("kv_store"); }
  void attention(const TensorView&, KvLayerView, const StepLayout&, float, TensorView) override {
    unused("attention");
  }
  void causal_conv1d_silu(const TensorView&, const TensorView&, TensorView, const StepLayout&, TensorView) override {
    unused("causal_conv1d_silu");
  }
  void delta_rule_gates(const TensorView&, const TensorView&, const TensorView&, const TensorView&, TensorView,
                        TensorView) override {
    unused("delta_rule_gates");
  }
  void gated_delta_rule(const TensorView&, const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                        TensorView, const StepLayout&, DeltaRuleMode, TensorView) override {
    unused("gated_delta_rule");
  }
  void moe_route(const TensorView&, int, bool, TensorView, TensorView) override { unused("moe_route"); }
  void moe_experts(const TensorView&, const TensorView&, const TensorView&, std::span<const ExpertWeights>,
                   TensorView) override {
    unused("moe_experts");
  }

 private:
  [[noreturn]] void unused(const char* op) { fail("DeferredOps: {} called while loading", op); }
  TensorView keep(DType d, Shape s) {
    mem_.push_back(std::make_unique<uint8_t[]>(std::max<size_t>(static_cast<size_t>(s.numel()) * dtype_size(d), 16)));
    return TensorView(mem_.back().get(), d, s);
  }
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  std::vector<Copy> pending_;
  std::vector<std::unique_ptr<uint8_t[]>> mem_;
};

void expect_same_bytes(const TensorView& a, const TensorView& b, const std::string& what) {
  ASSERT_EQ(a.data != nullptr, b.data != nullptr) << what;
  if (!a.data) return;
  ASSERT_EQ(a.nbytes(), b.nbytes()) << what;
  EXPECT_EQ(0, std::memcmp(a.data, b.data, a.nbytes())) << what;
}

// Every weight view of the two loads holds the same bytes.
void expect_same_weights(const LoadedModel& a, const LoadedModel& b) {
  expect_same_bytes(a.weights.embed_tokens, b.weights.embed_tokens, "embed_tokens");
  expect_same_bytes(a.weights.final_norm, b.weights.final_norm, "final_norm");
  expect_same_bytes(a.weights.lm_head.weight, b.weights.lm_head.weight, "lm_head");
  ASSERT_EQ(a.weights.layers.size(), b.weights.layers.size());
  for (size_t l = 0; l < a.weights.layers.size(); ++l) {
    const LayerWeights &x = a.weights.layers[l], &y = b.weights.layers[l];
    const std::string at = "layer " + std::to_string(l) + " ";
    expect_same_bytes(x.input_norm, y.input_norm, at + "input_norm");
    expect_same_bytes(x.post_attention_norm, y.post_attention_norm, at + "post_attention_norm");
    for (auto [p, q, n] : {std::tuple{&x.attn.q_proj, &y.attn.q_proj, "q_proj"},
                           std::tuple{&x.attn.o_proj, &y.attn.o_proj, "o_proj"},
                           std::tuple{&x.linear.in_proj_qkv, &y.linear.in_proj_qkv, "in_proj_qkv"},
                           std::tuple{&x.linear.out_proj, &y.linear.out_proj, "out_proj"},
                           std::tuple{&x.mlp.down_proj, &y.mlp.down_proj, "down_proj"},
                           std::tuple{&x.moe.router, &y.moe.router, "router"}}) {
      expect_same_bytes(p->weight, q->weight, at + n);
      expect_same_bytes(p->block_scale, q->block_scale, at + n + " block_scale");
    }
    expect_same_bytes(x.linear.conv1d, y.linear.conv1d, at + "conv1d");
    ASSERT_EQ(x.moe.experts.size(), y.moe.experts.size());
    for (size_t e = 0; e < x.moe.experts.size(); ++e) {
      expect_same_bytes(x.moe.experts[e].down.weight, y.moe.experts[e].down.weight, at + "expert down");
      expect_same_bytes(x.moe.experts[e].gate.weight, y.moe.experts[e].gate.weight, at + "expert gate");
    }
  }
}

TEST(WeightLoading, FinishesOnceAfterTheLastPlacementWithTheCheckpointBytes) {
  const format::ModelDir dir = format::ModelDir::open(kTiny);
  DeferredOps ops;
  auto cpu = backend::make_cpu_backend();
  const auto a = load_model(dir, ops);
  const auto b = load_model(dir, *cpu);
  EXPECT_EQ(ops.finishes, 1);
  EXPECT_EQ(ops.placed_after_finish, 0);
  EXPECT_GT(ops.placed_bytes, 0u);
  EXPECT_EQ(ops.progress_total_seen, ops.placed_bytes);  // the progress line's total is what gets placed
  EXPECT_EQ(weight_progress().loaders(), 0);
  expect_same_weights(*a, *b);
}

TEST(WeightLoading, TensorParallelSlicesStayAliveUntilCopied) {
  const format::ModelDir dir = format::ModelDir::open(kTiny);
  const format::ModelConfig config = format::load_model_config(dir);
  const format::QuantConfig quant = format::load_quant_config(dir);
  const format::ShardPlan plan = format::plan_shards(config, quant, 2);
  for (const format::RankShard& shard : plan.ranks) {
    DeferredOps ops;
    auto cpu = backend::make_cpu_backend();
    const auto a = load_model(dir, ops, LoadFormat::safetensors, &shard);
    const auto b = load_model(dir, *cpu, LoadFormat::safetensors, &shard);
    EXPECT_EQ(ops.finishes, 1);
    EXPECT_EQ(ops.placed_after_finish, 0);
    EXPECT_EQ(ops.progress_total_seen, ops.placed_bytes) << "rank " << shard.rank;
    // The copying backend's slice buffers are freed once copied; the CPU's stay (it reads them in place).
    EXPECT_TRUE(a->weights.slice_storage.empty());
    EXPECT_FALSE(b->weights.slice_storage.empty());
    expect_same_weights(*a, *b);
  }
}

TEST(WeightLoading, DummyLoadFinishesToo) {
  const format::ModelDir dir = format::ModelDir::open(kTiny);
  DeferredOps ops;  // the default place_random: filled on the host, then placed
  const auto a = load_model(dir, ops, LoadFormat::dummy);
  EXPECT_EQ(ops.finishes, 1);
  EXPECT_EQ(ops.progress_total_seen, ops.placed_bytes);
  auto cpu = backend::make_cpu_backend();
  const auto b = load_model(dir, *cpu, LoadFormat::dummy);
  expect_same_weights(*a, *b);
}

}  // namespace
}  // namespace kiln::model
