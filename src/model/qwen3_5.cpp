// Qwen3.5 dense (modeling_qwen3_5.py): the same hybrid mixer as Qwen3.5 MoE (Gated DeltaNet + gated full
// attention, zero-centred RMSNorm) with a dense SwiGLU MLP of intermediate_size in every layer.
#include "model/blocks.h"
#include "model/family.h"

namespace kiln::model {
namespace {

class Qwen3_5 final : public Family {
 public:
  format::Arch arch() const override { return format::Arch::qwen3_5; }
  NormKind norm_kind() const override { return NormKind::zero_centred; }

  void bind_layer(WeightBinder& b, int layer, LayerWeights& w) const override {
    bind_hybrid_mixer(b, layer, w, /*fused_qkvz=*/false);
    bind_dense_mlp(b, layer, w.mlp);
  }

  void forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const override {
    const TensorView x = hybrid_mixer(f, layer, w, hidden, gated_deltanet);
    residual_defer(f, mlp(f, w.mlp, x));
  }
};

}  // namespace

const Family& qwen3_5_family() {
  static const Qwen3_5 family;
  return family;
}

}  // namespace kiln::model
