// Qwen3 dense (modeling_qwen3.py): classic attention with q_norm / k_norm and full RoPE, plain RMSNorm,
// dense SwiGLU MLP; small checkpoints tie lm_head to the embedding.
#include "model/family.h"

namespace kiln::model {

constexpr Family qwen3_family{.arch = format::Arch::qwen3, .mixer = Mixer::full_attention, .ffn = Ffn::dense_mlp};

}  // namespace kiln::model
