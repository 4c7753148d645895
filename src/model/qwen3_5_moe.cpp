// Qwen3.5 MoE (Qwen3_5MoeForConditionalGeneration / Qwen3_5MoeForCausalLM, transformers 5.17
// modeling_qwen3_5_moe.py): hybrid layers ([linear, linear, linear, full] ...), Gated DeltaNet with separate
// in_proj_qkv / z / b / a, gated full attention with partial RoPE, zero-centred RMSNorm, and in every layer
// a sparse MoE (top-k always renormalised) with a sigmoid-gated shared expert.
#include "model/blocks.h"
#include "model/family.h"

namespace kiln::model {
namespace {

class Qwen3_5Moe final : public Family {
 public:
  format::Arch arch() const override { return format::Arch::qwen3_5_moe; }
  NormKind norm_kind() const override { return NormKind::zero_centred; }

  void bind_layer(WeightBinder& b, int layer, LayerWeights& w) const override {
    bind_hybrid_mixer(b, layer, w, /*fused_qkvz=*/false);
    w.is_moe = true;
    bind_moe(b, layer, w.moe, /*shared_expert=*/true);
  }

  void forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const override {
    const TensorView x = hybrid_mixer(f, layer, w, hidden, gated_deltanet);
    // Qwen3_5MoeTopKRouter renormalises unconditionally.
    residual_defer(f, moe(f, layer, w.moe, x, f.config.experts_per_tok, /*renormalise=*/true));
  }
};

}  // namespace

const Family& qwen3_5_moe_family() {
  static const Qwen3_5Moe family;
  return family;
}

}  // namespace kiln::model
