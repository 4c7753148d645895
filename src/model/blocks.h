// Shared building blocks of the Qwen3 / Qwen3-MoE / Qwen3-Next / Qwen3.5 families: weight binding and the
// forward maths of each sub-block, over the Ops interface. Each follows the transformers 5.17 module of the
// same name (cited per function); activations are F32 [T, ...] with T the step's tokens.
#pragma once
#include <string>

#include "model/forward.h"
#include "model/weights.h"

namespace kiln::model {

// ---- binding
// L self_attn.{q,k,v,o}_proj, q_norm, k_norm (+ optional k_proj.k_scale / v_proj.v_scale).
void bind_full_attention(WeightBinder& b, int layer, AttentionWeights& w);
// L linear_attn.*: fused_qkvz selects qwen3_next's in_proj_qkvz / in_proj_ba.
void bind_gated_deltanet(WeightBinder& b, int layer, LinearAttentionWeights& w, bool fused_qkvz);
// prefix + {gate,up,down}_proj, intermediate size `inter`.
void bind_mlp(WeightBinder& b, const std::string& prefix, int64_t inter, MlpWeights& w);
// L mlp.gate, experts (fused BF16 [E, 2I, H] / [E, H, I] or per expert), optional shared expert + gate.
void bind_moe(WeightBinder& b, int layer, MoeWeights& w, bool shared_expert);
// L input_layernorm, post_attention_layernorm.
void bind_layer_norms(WeightBinder& b, int layer, LayerWeights& w);

// ---- forward
// The token embeddings out [T, H] of ids I32 [T]; a vocabulary-parallel rank (tensor parallel) looks up its rows
// (zeros for the other ranks' ids) and the group sums them (Ops::all_reduce).
void embed(Forward& f, const ModelWeights& w, const TensorView& ids, TensorView out);
// RMSNorm over the last dim of x [R, D] -> [R, D].
TensorView rms_norm(Forward& f, const TensorView& x, const TensorView& weight, NormKind kind);
// Qwen3*Attention: q/k/v projections, per-head q_norm/k_norm, RoPE on the first rotary_dim dims, causal
// GQA over the paged cache, optional sigmoid output gate (q_proj emits [q | gate] per head), o_proj.
// x [T, H] -> [T, H].
TensorView full_attention(Forward& f, int layer, const AttentionWeights& w, const TensorView& x,
                          bool output_gate, NormKind qk_norm);
// The Gated DeltaNet after its input projections (Qwen3_5GatedDeltaNet.forward from the conv on):
// mixed_qkv [T, 2 Hk Dk + Hv Dv] (rows q | k | v), z [T, Hv * Dv], b, a [T, Hv] -> [T, H].
TensorView gated_deltanet_core(Forward& f, int layer, const LinearAttentionWeights& w, const TensorView& mixed_qkv,
                               const TensorView& z, const TensorView& b, const TensorView& a);
// Qwen3_5GatedDeltaNet: separate in_proj_qkv / z / b / a. x [T, H] -> [T, H].
TensorView gated_deltanet(Forward& f, int layer, const LinearAttentionWeights& w, const TensorView& x);
// SwiGLU MLP: down(silu(gate x) * up x). x [T, H] -> [T, H].
TensorView mlp(Forward& f, const MlpWeights& w, const TensorView& x);
// Sparse MoE block: fp32 softmax router, top-k, optional renormalisation, experts, plus (when present) the
// shared expert scaled by sigmoid(shared_expert_gate x). x [T, H] -> [T, H].
TensorView moe(Forward& f, int layer, const MoeWeights& w, const TensorView& x, int top_k, bool renormalise);
// The same block after the residual step before it: pre.hidden += pre.y, then moe(rms_norm(pre.hidden)); a backend
// may fold the residual step into its fused block (Ops::moe_block).
TensorView moe_after_residual(Forward& f, int layer, const MoeWeights& w, const ResidualNorm& pre, int top_k,
                              bool renormalise);
// hidden += y (both [T, H]).
void residual_add(Forward& f, TensorView hidden, const TensorView& y);
// The residual stream between blocks (hidden [T, H]), fused where a backend can:
//  - input_norm: adds a deferred block output (if any), then returns rms_norm(hidden);
//  - residual_norm: hidden += y, returns rms_norm(hidden);
//  - residual_defer: y is added by the next input_norm (the next layer's) or residual_flush (the runner's).
TensorView input_norm(Forward& f, TensorView hidden, const TensorView& weight, NormKind kind);
TensorView residual_norm(Forward& f, TensorView hidden, const TensorView& y, const TensorView& weight, NormKind kind);
void residual_defer(Forward& f, const TensorView& y);
void residual_flush(Forward& f, TensorView hidden);

// ---- layer parts several families share
// L mlp.{gate,up,down}_proj of intermediate_size: a layer's dense MLP.
void bind_dense_mlp(WeightBinder& b, int layer, MlpWeights& w);
// The sparse MoE on the layers config.layer_is_moe names (sets w.is_moe), the dense MLP on the others.
void bind_moe_or_mlp(WeightBinder& b, int layer, LayerWeights& w, bool shared_expert);
// Its forward: the MoE (top-k renormalised when norm_topk_prob) or the MLP. x [T, H] -> [T, H].
TensorView moe_or_mlp(Forward& f, int layer, const LayerWeights& w, const TensorView& x);
// The hybrid token mixer of Qwen3.5, Qwen3.5 MoE and Qwen3-Next: the layer norms, then Gated DeltaNet on
// linear-attention layers (fused_qkvz: Qwen3-Next's interleaved projections) and gated full attention on the others.
void bind_hybrid_mixer(WeightBinder& b, int layer, LayerWeights& w, bool fused_qkvz);
// Its forward, zero-centred norms throughout: the mixer's output y = mixer(input_norm(hidden)) (the input norm adds a
// pending residual first), where the mixer is `deltanet` (the family's Gated DeltaNet form) on linear-attention layers
// and gated full attention on the others. The caller adds y to hidden (residual_norm, or moe_after_residual).
// hidden [T, H] -> [T, H].
using GatedDeltaNetFn = TensorView (*)(Forward& f, int layer, const LinearAttentionWeights& w, const TensorView& x);
TensorView hybrid_mixer_output(Forward& f, int layer, const LayerWeights& w, TensorView hidden,
                               GatedDeltaNetFn deltanet);

}  // namespace kiln::model
