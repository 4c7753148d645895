// Qwen3 dense (modeling_qwen3.py): classic attention with q_norm / k_norm and full RoPE, plain RMSNorm,
// dense SwiGLU MLP; small checkpoints tie lm_head to the embedding.
#include "model/blocks.h"
#include "model/family.h"

namespace kiln::model {
namespace {

class Qwen3 final : public Family {
 public:
  format::Arch arch() const override { return format::Arch::qwen3; }
  NormKind norm_kind() const override { return NormKind::plain; }

  void bind_layer(WeightBinder& b, int layer, LayerWeights& w) const override {
    bind_layer_norms(b, layer, w);
    bind_full_attention(b, layer, w.attn);
    bind_dense_mlp(b, layer, w.mlp);
  }

  void forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const override {
    TensorView x = input_norm(f, hidden, w.input_norm, NormKind::plain);
    TensorView y = full_attention(f, layer, w.attn, x, /*output_gate=*/false, NormKind::plain);
    x = residual_norm(f, hidden, y, w.post_attention_norm, NormKind::plain);
    residual_defer(f, mlp(f, w.mlp, x));
  }
};

}  // namespace

const Family& qwen3_family() {
  static const Qwen3 family;
  return family;
}

}  // namespace kiln::model
