// Activation calibration through kiln's own engine (for `kiln quantize`): runs sample prompts through a
// model on an inner backend (the CPU oracle) and records, per linear layer, the max |x| entering it.
//
// CalibratingOps wraps any model::Ops: every call is forwarded unchanged (the forward output is the inner
// backend's), and on the way it records
//  - linear(x, W): max |x| under W's module name;
//  - moe_experts(x, ids, ...): per expert e, max |x| over the rows routed to e (the input of its gate_proj
//    and up_proj) and max |silu(gate x) * up x| over those rows (the input of its down_proj), computed with
//    the inner ops on the gathered rows.
// Weights are named by data pointer: place_weight() remembers which checkpoint bytes each placed view came
// from, and the checkpoint tells which tensor holds those bytes. Fused routed experts
// (`<L>mlp.experts.gate_up_proj` [E, 2I, H], `<L>mlp.experts.down_proj` [E, H, I]) get the per-expert names
// `kiln quantize` writes: `<L>mlp.experts.{e}.{gate,up,down}_proj`; other linears their tensor name
// without ".weight".
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "format/model_dir.h"
#include "format/safetensors.h"
#include "model/ops.h"

namespace kiln::backend {

class CalibratingOps final : public model::Ops {
 public:
  explicit CalibratingOps(std::unique_ptr<model::Ops> inner);

  // The checkpoint the placed weights came from (call once the model is loaded, before forward passes).
  void set_checkpoint(const format::Checkpoint* checkpoint) { checkpoint_ = checkpoint; }
  // module name -> max |input| seen so far.
  const std::map<std::string, float>& amax() const { return amax_; }
  // The module name of a placed weight's data pointer ("" when it is not from the checkpoint).
  std::string module_name(const void* placed_data);
  model::Ops& inner() { return *inner_; }

  std::string name() const override { return inner_->name(); }
  std::string describe() const override { return "calibrating(" + inner_->describe() + ")"; }
  TensorView allocate(DType dtype, Shape shape) override { return inner_->allocate(dtype, shape); }
  TensorView place_weight(const TensorView& host) override;
  void finish_weights() override { inner_->finish_weights(); }
  TensorView scratch(DType dtype, Shape shape) override { return inner_->scratch(dtype, shape); }
  void reset_scratch() override { inner_->reset_scratch(); }
  TensorView upload(const void* host, DType dtype, Shape shape) override { return inner_->upload(host, dtype, shape); }
  void download(const TensorView& src, void* host) override { inner_->download(src, host); }
  void fill_zero(TensorView t) override { inner_->fill_zero(t); }
  void copy(const TensorView& src, TensorView dst) override { inner_->copy(src, dst); }
  float max_abs(const TensorView& x) override { return inner_->max_abs(x); }
  void embedding(const TensorView& table, const TensorView& ids, TensorView out) override {
    inner_->embedding(table, ids, out);
  }
  void linear(const TensorView& x, const model::LinearWeight& w, TensorView out) override;
  void rms_norm(const TensorView& x, const TensorView& weight, float eps, model::NormKind kind,
                TensorView out) override {
    inner_->rms_norm(x, weight, eps, kind, out);
  }
  void gated_rms_norm(const TensorView& x, const TensorView& z, const TensorView& weight, float eps,
                      TensorView out) override {
    inner_->gated_rms_norm(x, z, weight, eps, out);
  }
  void rope(TensorView x, const TensorView& positions, int rotary_dim, double theta) override {
    inner_->rope(x, positions, rotary_dim, theta);
  }
  void add(const TensorView& a, const TensorView& b, TensorView out) override { inner_->add(a, b, out); }
  void silu_mul(const TensorView& gate, const TensorView& up, TensorView out) override {
    inner_->silu_mul(gate, up, out);
  }
  void sigmoid_mul(const TensorView& x, const TensorView& g, TensorView out) override {
    inner_->sigmoid_mul(x, g, out);
  }
  void gather_rows(const TensorView& x, const TensorView& rows, TensorView out) override {
    inner_->gather_rows(x, rows, out);
  }
  void kv_store(const TensorView& k, const TensorView& v, model::KvLayerView cache,
                const model::StepLayout& step) override {
    inner_->kv_store(k, v, cache, step);
  }
  void attention(const TensorView& q, model::KvLayerView cache, const model::StepLayout& step, float scale,
                 TensorView out) override {
    inner_->attention(q, cache, step, scale, out);
  }
  void causal_conv1d_silu(const TensorView& x, const TensorView& weight, TensorView conv_state,
                          const model::StepLayout& step, TensorView out) override {
    inner_->causal_conv1d_silu(x, weight, conv_state, step, out);
  }
  void delta_rule_gates(const TensorView& a, const TensorView& b, const TensorView& A_log,
                        const TensorView& dt_bias, TensorView g, TensorView beta) override {
    inner_->delta_rule_gates(a, b, A_log, dt_bias, g, beta);
  }
  void gated_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& beta, TensorView state, const model::StepLayout& step,
                        model::DeltaRuleMode mode, TensorView out) override {
    inner_->gated_delta_rule(q, k, v, g, beta, state, step, mode, out);
  }
  void moe_route(const TensorView& logits, int top_k, bool renormalise, TensorView expert_ids,
                 TensorView weights) override {
    inner_->moe_route(logits, top_k, renormalise, expert_ids, weights);
  }
  void moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                   std::span<const model::ExpertWeights> experts, TensorView out) override;

 private:
  void record(const void* placed_data, float value);

  std::unique_ptr<model::Ops> inner_;
  const format::Checkpoint* checkpoint_ = nullptr;
  struct Placed {
    const uint8_t* end;   // one past the placed bytes
    const uint8_t* host;  // the checkpoint bytes they were placed from
  };
  std::map<const uint8_t*, Placed> placed_;                         // by placed start address
  std::map<const uint8_t*, const format::TensorInfo*> by_address_;  // checkpoint tensors by start address
  std::unordered_map<const void*, std::string> name_cache_;
  std::map<std::string, float> amax_;
};

struct CalibrationProgress {
  size_t prompts_done = 0, prompts_total = 0;
  int64_t tokens_done = 0;
};

struct CalibrationOptions {
  int64_t max_tokens_per_prompt = 1024;  // longer prompts are truncated
  std::function<void(const CalibrationProgress&)> on_progress;
};

// Loads the (BF16) model in `dir` on the CPU backend wrapped in CalibratingOps, prefills every prompt
// (token ids) as its own sequence and returns module name -> max |input activation|.
std::map<std::string, float> calibrate_input_amax(const format::ModelDir& dir,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  const CalibrationOptions& options = {});

}  // namespace kiln::backend
