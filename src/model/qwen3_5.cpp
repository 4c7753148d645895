// Qwen3.5 dense (modeling_qwen3_5.py): the same hybrid mixer as Qwen3.5 MoE (Gated DeltaNet + gated full
// attention, zero-centred RMSNorm) with a dense SwiGLU MLP of intermediate_size in every layer.
#include "model/family.h"

namespace kiln::model {

constexpr Family qwen3_5_family{
    .arch = format::Arch::qwen3_5, .mixer = Mixer::hybrid, .ffn = Ffn::dense_mlp, .deltanet = gated_deltanet};

}  // namespace kiln::model
