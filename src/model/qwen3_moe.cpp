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
    w.is_moe = b.config().layer_is_moe(layer);
    if (w.is_moe)
      bind_moe(b, layer, w.moe, /*shared_expert=*/false);
    else
      bind_mlp(b, b.layer_prefix(layer) + "mlp.", b.config().intermediate_size, w.mlp);
  }

  void forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const override {
    TensorView x = input_norm(f, hidden, w.input_norm, NormKind::plain);
    TensorView a = full_attention(f, layer, w.attn, x, /*output_gate=*/false, NormKind::plain);
    x = residual_norm(f, hidden, a, w.post_attention_norm, NormKind::plain);
    TensorView y = w.is_moe ? moe(f, layer, w.moe, x, f.config.experts_per_tok, f.config.norm_topk_prob)
                            : mlp(f, w.mlp, x);
    residual_defer(f, y);
  }
};

}  // namespace

const Family& qwen3_moe_family() {
  static const Qwen3Moe family;
  return family;
}

}  // namespace kiln::model
