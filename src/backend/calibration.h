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
#include "model/forwarding_ops.h"

namespace kiln::backend {

class CalibratingOps final : public model::ForwardingOps {
 public:
  explicit CalibratingOps(std::unique_ptr<model::Ops> inner);

  // The checkpoint the placed weights came from (call once the model is loaded, before forward passes).
  void set_checkpoint(const format::Checkpoint* checkpoint) { checkpoint_ = checkpoint; }
  // module name -> max |input| seen so far.
  const std::map<std::string, float>& amax() const { return amax_; }
  // The module name of a placed weight's data pointer ("" when it is not from the checkpoint).
  std::string module_name(const void* placed_data);

  // What it watches; every other op is forwarded unchanged (model::ForwardingOps).
  std::string describe() const override { return "calibrating(" + ForwardingOps::describe() + ")"; }
  TensorView place_weight(const TensorView& host) override;
  void linear(const TensorView& x, const model::LinearWeight& w, TensorView out) override;
  void moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                   std::span<const model::ExpertWeights> experts, TensorView out) override;
  // The fused forms run as model::Ops composes them, through linear() / moe_experts() above, so every input is seen.
  void linear_multi(const TensorView& x, std::span<const model::LinearWeight* const> ws,
                    std::span<const TensorView> outs) override {
    model::Ops::linear_multi(x, ws, outs);
  }
  void moe_experts_shared(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                          std::span<const model::ExpertWeights> experts, TensorView shared,
                          const TensorView& shared_gate, TensorView out) override {
    model::Ops::moe_experts_shared(x, expert_ids, weights, experts, shared, shared_gate, out);
  }
  void linear_gated_input(const TensorView& x, const TensorView& x2, model::InputAct act, const model::LinearWeight& w,
                          TensorView out) override {
    model::Ops::linear_gated_input(x, x2, act, w, out);
  }

 private:
  void record(const void* placed_data, float value);

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
