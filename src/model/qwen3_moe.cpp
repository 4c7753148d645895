// Qwen3-MoE (modeling_qwen3_moe.py): classic attention (no output gate) with per-head q_norm / k_norm and
// full RoPE, plain RMSNorm (x_hat * w), sparse MoE without a shared expert (top-k renormalised only when
// norm_topk_prob), dense MLP in mlp_only_layers and in layers off the decoder_sparse_step.
#include "model/blocks.h"
#include "model/family.h"

namespace kiln::model {
namespace {

class Qwen3Moe final : public Family {
 public:
  format::Arch arch() const override { return format::Arch::qwen3_moe; }
  NormKind norm_kind() const override { return NormKind::plain; }

  void bind_layer(WeightBinder& b, int layer, LayerWeights& w) const override {
    bind_layer_norms(b, layer, w);
    bind_full_attention(b, layer, w.attn);
    bind_moe_or_mlp(b, layer, w, /*shared_expert=*/false);
  }

  void forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const override {
    TensorView x = input_norm(f, hidden, w.input_norm, NormKind::plain);
    TensorView a = full_attention(f, layer, w.attn, x, /*output_gate=*/false, NormKind::plain);
    x = residual_norm(f, hidden, a, w.post_attention_norm, NormKind::plain);
    residual_defer(f, moe_or_mlp(f, layer, w, x));
  }
};

}  // namespace

const Family& qwen3_moe_family() {
  static const Qwen3Moe family;
  return family;
}

}  // namespace kiln::model
