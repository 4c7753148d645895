// Qwen3-MoE (modeling_qwen3_moe.py): classic attention (no output gate) with per-head q_norm / k_norm and
// full RoPE, plain RMSNorm (x_hat * w), sparse MoE without a shared expert (top-k renormalised only when
// norm_topk_prob), dense MLP in mlp_only_layers and in layers off the decoder_sparse_step.
#include "model/family.h"

namespace kiln::model {

constexpr Family qwen3_moe_family{
    .arch = format::Arch::qwen3_moe, .mixer = Mixer::full_attention, .ffn = Ffn::moe_or_mlp, .shared_expert = false};

}  // namespace kiln::model
