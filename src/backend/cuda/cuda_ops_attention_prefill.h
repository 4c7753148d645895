// Causal GQA attention over the paged KV pool for prefill-shaped steps (flash-attention style, tensor cores at fp32
// accuracy; cuda_ops_attention_prefill.cu). Same maths and layouts as ops::attention (cuda_ops_kernels.h): q, out
// [T, q_heads, head_dim]; a query at position p sees keys 0..p of its own sequence; a row with no keys gives 0.
// Plain C++ (no CUDA syntax, no fmt) so that g++ translation units can call it.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cuda/cuda_ops_kernels.h"

namespace kiln::cuda::ops {

// attention_prefill runs only when the step's longest sequence (StepArgs::max_seq_tokens, host-known) has at least
// this many tokens: below that the split-over-keys kernels of ops::attention are the better fit.
constexpr int kAttentionPrefillMinTokens = 16;

// Launches the prefill kernel and returns true, or launches nothing and returns false when the case is not served:
// head_dim not 64, 128 or 256; pool elements not bf16 or e4m3 (f32 pools fall back); q_heads not a multiple of
// kv_heads; step.max_seq_tokens < kAttentionPrefillMinTokens; more than 65535 sequences; q / out / pool pointers not
// 16-byte aligned; or the kernel's shared memory above the device's per-block limit. No workspace.
bool attention_prefill(const float* q, int64_t q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale,
                       float* out, Stream stream);

}  // namespace kiln::cuda::ops
