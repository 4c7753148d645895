// Qwen3.5 MoE (Qwen3_5MoeForConditionalGeneration / Qwen3_5MoeForCausalLM, transformers 5.17
// modeling_qwen3_5_moe.py): hybrid layers ([linear, linear, linear, full] ...), Gated DeltaNet with separate
// in_proj_qkv / z / b / a, gated full attention with partial RoPE, zero-centred RMSNorm, and in every layer
// a sparse MoE (top-k always renormalised: Qwen3_5MoeTopKRouter) with a sigmoid-gated shared expert.
#include "model/family.h"

namespace kiln::model {

constexpr Family qwen3_5_moe_family{.arch = format::Arch::qwen3_5_moe,
                                    .mixer = Mixer::hybrid,
                                    .ffn = Ffn::moe_renormalised,
                                    .shared_expert = true,
                                    .deltanet = gated_deltanet};

}  // namespace kiln::model
