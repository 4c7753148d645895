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
    bind_layer_norms(b, layer, w);
    if (w.type == format::LayerType::linear_attention)
      bind_gated_deltanet(b, layer, w.linear, /*fused_qkvz=*/false);
    else
      bind_full_attention(b, layer, w.attn);
    bind_mlp(b, b.layer_prefix(layer) + "mlp.", b.config().intermediate_size, w.mlp);
  }

  void forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const override {
    TensorView x = input_norm(f, hidden, w.input_norm, NormKind::zero_centred);
    TensorView y = w.type == format::LayerType::linear_attention
                       ? gated_deltanet(f, layer, w.linear, x)
                       : full_attention(f, layer, w.attn, x, /*output_gate=*/true, NormKind::zero_centred);
    x = residual_norm(f, hidden, y, w.post_attention_norm, NormKind::zero_centred);
    residual_defer(f, mlp(f, w.mlp, x));
  }
};

}  // namespace

const Family& qwen3_5_family() {
  static const Qwen3_5 family;
  return family;
}

}  // namespace kiln::model
