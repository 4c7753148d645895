// The one table of supported model families, by architecture, and how a family's parts make a decoder layer.
#include "core/error.h"
#include "model/family.h"

namespace kiln::model {
namespace {

constexpr const Family* kFamilies[] = {
    &qwen3_5_moe_family, &qwen3_5_family, &qwen3_next_family, &qwen3_moe_family, &qwen3_family,
};

}  // namespace

std::string supported_families() {
  std::string s;
  for (const Family* f : kFamilies) s += (s.empty() ? "" : ", ") + std::string(format::arch_name(f->arch));
  return s;
}

const Family& family_for(format::Arch arch) {
  for (const Family* f : kFamilies)
    if (f->arch == arch) return *f;
  fail("model family '{}' is not supported (supported: {})", format::arch_name(arch), supported_families());
}

int64_t all_reduces_per_pass(const format::ModelConfig& config, int tp, bool mtp_head) {
  if (tp <= 1) return 0;
  const int64_t per_layer = 2;  // the mixer's output and the feed-forward part's (Family::forward_layer)
  return 1 + per_layer * config.num_layers + (mtp_head ? 1 + per_layer : 0);
}

void Family::bind_layer(WeightBinder& b, int layer, LayerWeights& w) const {
  if (mixer == Mixer::hybrid) {
    bind_hybrid_mixer(b, layer, w, fused_qkvz);
  } else {
    bind_layer_norms(b, layer, w);
    bind_full_attention(b, layer, w.attn);
  }
  switch (ffn) {
    case Ffn::dense_mlp: bind_dense_mlp(b, layer, w.mlp); break;
    case Ffn::moe_or_mlp: bind_moe_or_mlp(b, layer, w, shared_expert); break;
    case Ffn::moe_renormalised:
      w.is_moe = true;
      bind_moe(b, layer, w.moe, shared_expert);
      break;
  }
}

void Family::forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const {
  TensorView x;
  if (mixer == Mixer::hybrid) {
    const TensorView y = hybrid_mixer_output(f, layer, w, hidden, deltanet);
    const bool moe_layer = ffn == Ffn::moe_renormalised || (ffn == Ffn::moe_or_mlp && w.is_moe);
    if (moe_layer) {  // the post-attention residual step goes with the MoE block (fused there where the backend can)
      const ResidualNorm pre{hidden, y, w.post_attention_norm, static_cast<float>(f.config.rms_norm_eps),
                             NormKind::zero_centred};
      const bool renormalise = ffn == Ffn::moe_renormalised || f.config.norm_topk_prob;
      residual_defer(f, moe_after_residual(f, layer, w.moe, pre, f.config.experts_per_tok, renormalise));
      return;
    }
    x = residual_norm(f, hidden, y, w.post_attention_norm, NormKind::zero_centred);
  } else {
    x = input_norm(f, hidden, w.input_norm, NormKind::plain);
    const TensorView y = full_attention(f, layer, w.attn, x, /*output_gate=*/false, NormKind::plain);
    x = residual_norm(f, hidden, y, w.post_attention_norm, NormKind::plain);
  }
  switch (ffn) {
    case Ffn::dense_mlp: residual_defer(f, mlp(f, w.mlp, x)); break;
    case Ffn::moe_or_mlp: residual_defer(f, moe_or_mlp(f, layer, w, x)); break;
    case Ffn::moe_renormalised:
      residual_defer(f, moe(f, layer, w.moe, x, f.config.experts_per_tok, /*renormalise=*/true));
      break;
  }
}

}  // namespace kiln::model
