// What one forward pass (a "step") reads and writes, handed to every block: the backend, the step layout,
// the KV pool and the recurrent state, and an optional trace hook that names every intermediate (for
// diffing against a reference dump).
#pragma once
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "format/model_config.h"
#include "model/ops.h"

namespace kiln::model {

// trace(name, layer, view): called with each named intermediate when set (layer -1 for model-level ones).
using TraceFn = std::function<void(std::string_view name, int layer, const TensorView& value)>;

struct Forward {
  Ops& ops;
  const format::ModelConfig& config;
  const StepLayout& step;
  std::span<KvLayerView> kv;             // per full-attention layer, indexed by kv_index[layer] (FP8 scales
                                         // are filled in on first use when the checkpoint has none)
  std::span<const int> kv_index;         // [num_layers] full-attention index, -1 for linear layers
  std::span<const TensorView> conv_state;       // per linear layer: F32 [slots, C, Kc - 1]
  std::span<const TensorView> recurrent_state;  // per linear layer: [slots, Hv, Dk, Dv], Ops::recurrent_state_dtype()
  std::span<const int> linear_index;     // [num_layers] linear-attention index, -1 for full layers
  DeltaRuleMode delta_mode = DeltaRuleMode::chunked;  // for sequences with more than one token in the step
  const TraceFn* trace = nullptr;
  // A block output not yet added to the residual stream: the next input_norm() adds it and normalises in one op
  // (add_rms_norm), residual_flush() adds it alone. Empty (data null) when none.
  TensorView pending_residual;

  TensorView f32(Shape shape) const { return ops.scratch(DType::F32, shape); }
  void name(std::string_view what, int layer, const TensorView& value) const {
    if (trace && *trace) (*trace)(what, layer, value);
  }
};

}  // namespace kiln::model
