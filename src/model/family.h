// A model family: which shared blocks (blocks.h) its decoder layers are made of, as data. Every supported family
// is a token mixer and a feed-forward part; one file per family (qwen3_5_moe.cpp, ...) defines its Family (and
// any block of its own, like Qwen3-Next's fused DeltaNet projections), all listed in one table (families.cpp),
// looked up by the config's architecture. bind_layer / forward_layer assemble the layer from the parts.
#pragma once
#include "format/model_config.h"
#include "model/blocks.h"
#include "model/forward.h"
#include "model/weights.h"

namespace kiln::model {

// The token mixer of every layer.
enum class Mixer : uint8_t {
  // Qwen3 / Qwen3-MoE: classic attention (no output gate) with q_norm / k_norm, plain RMSNorm throughout.
  full_attention,
  // Qwen3.5 / Qwen3-Next: Gated DeltaNet on linear-attention layers, gated full attention on the others,
  // zero-centred RMSNorm throughout (blocks.h hybrid_mixer_output).
  hybrid,
};

// The feed-forward part of every layer.
enum class Ffn : uint8_t {
  dense_mlp,         // a dense SwiGLU MLP of intermediate_size in every layer
  moe_or_mlp,        // the sparse MoE on config.layer_is_moe layers (top-k renormalised when norm_topk_prob), the MLP
                     // on the others
  moe_renormalised,  // the sparse MoE in every layer, top-k always renormalised
};

struct Family {
  format::Arch arch;
  Mixer mixer;
  Ffn ffn;
  bool shared_expert = false;          // the MoE has a sigmoid-gated shared expert
  GatedDeltaNetFn deltanet = nullptr;  // Mixer::hybrid: the family's Gated DeltaNet (its input projections)
  bool fused_qkvz = false;             // Mixer::hybrid: Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba

  // RMSNorm flavour of the input / post-attention / final / q / k norms.
  NormKind norm_kind() const { return mixer == Mixer::hybrid ? NormKind::zero_centred : NormKind::plain; }
  // Fills w (everything but `type`, set by the caller) for decoder layer `layer`.
  void bind_layer(WeightBinder& b, int layer, LayerWeights& w) const;
  // hidden [T, H] += mixer(norm(hidden)); hidden += ffn(norm(hidden)).
  void forward_layer(Forward& f, int layer, const LayerWeights& w, TensorView hidden) const;
};

// The all-reduces (Ops::all_reduce) one forward pass makes on each rank of a tensor-parallel group of `tp` ranks,
// each of the pass's tokens x hidden_size F32 values: the vocabulary-parallel embedding lookup (blocks.h embed), the
// token mixer's and the feed-forward part's output of every decoder layer (blocks.cpp block_output: every family is
// one of each), and with the MTP head loaded (mtp_head) the head's embedding lookup and its decoder layer (mtp.cpp;
// a decode pass gives it one entry per sequence). 0 for tp 1. Picking the token after the pass is no all-reduce (each
// rank offers its best id; model/tp_runner.h).
int64_t all_reduces_per_pass(const format::ModelConfig& config, int tp, bool mtp_head);

// The family implementing `arch`; kiln::Error naming the supported ones otherwise.
const Family& family_for(format::Arch arch);
// "qwen3_5_moe, qwen3_5, qwen3_next, qwen3_moe, qwen3"
std::string supported_families();

// Defined in each family's file; listed in families.cpp.
extern const Family qwen3_5_moe_family;
extern const Family qwen3_5_family;
extern const Family qwen3_next_family;
extern const Family qwen3_moe_family;
extern const Family qwen3_family;

}  // namespace kiln::model
