// A model family: how its checkpoint's layers bind to weights and how one decoder layer runs, written over
// the shared blocks (blocks.h). One file per family (qwen3_5_moe.cpp, ...), all listed in one table
// (families.cpp), looked up by the config's architecture.
#pragma once
#include "format/model_config.h"
#include "model/forward.h"
#include "model/weights.h"

namespace kiln::model {

class Family {
 public:
  virtual ~Family() = default;
  virtual format::Arch arch() const = 0;
  // RMSNorm flavour of the input / post-attention / final / q / k norms.
  virtual NormKind norm_kind() const = 0;
  // Fills w (everything but `type`, set by the caller) for decoder layer `layer`.
  virtual void bind_layer(WeightBinder& b, int layer, LayerWeights& w) const = 0;
  // hidden [T, H] += mixer(norm(hidden)); hidden += ffn(norm(hidden)).
  virtual void forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const = 0;
};

// The family implementing `arch`; kiln::Error naming the supported ones otherwise.
const Family& family_for(format::Arch arch);
// "qwen3_5_moe, qwen3_5, qwen3_next, qwen3_moe, qwen3"
std::string supported_families();

// Defined in each family's file; listed in families.cpp.
const Family& qwen3_5_moe_family();
const Family& qwen3_5_family();
const Family& qwen3_next_family();
const Family& qwen3_moe_family();
const Family& qwen3_family();

}  // namespace kiln::model
