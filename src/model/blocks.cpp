#include "model/blocks.h"

#include <cmath>
#include <optional>

#include "core/error.h"
#include "core/log.h"

namespace kiln::model {

using format::LayerType;

// ---------------------------------------------------------------------------------------------------
// Binding

void bind_layer_norms(WeightBinder& b, int layer, LayerWeights& w) {
  const std::string L = b.layer_prefix(layer);
  const int64_t H = b.config().hidden_size;
  w.input_norm = b.tensor(L + "input_layernorm.weight", Shape{H});
  w.post_attention_norm = b.tensor(L + "post_attention_layernorm.weight", Shape{H});
}

void bind_full_attention(WeightBinder& b, int layer, AttentionWeights& w) {
  const auto& c = b.config();
  const std::string A = b.layer_prefix(layer) + "self_attn.";
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_attention_heads, Hkv = c.num_kv_heads;
  w.q_proj = b.linear(A + "q_proj", Hq * D * (c.attn_output_gate ? 2 : 1), H);
  w.k_proj = b.linear(A + "k_proj", Hkv * D, H);
  w.v_proj = b.linear(A + "v_proj", Hkv * D, H);
  w.o_proj = b.linear(A + "o_proj", H, Hq * D);
  w.q_norm = b.tensor(A + "q_norm.weight", Shape{D});
  w.k_norm = b.tensor(A + "k_norm.weight", Shape{D});
  if (b.has(A + "k_proj.k_scale")) w.k_scale = b.scalar(A + "k_proj.k_scale");
  if (b.has(A + "v_proj.v_scale")) w.v_scale = b.scalar(A + "v_proj.v_scale");
}

void bind_gated_deltanet(WeightBinder& b, int layer, LinearAttentionWeights& w, bool fused_qkvz) {
  const auto& c = b.config();
  const std::string P = b.layer_prefix(layer) + "linear_attn.";
  const int64_t H = c.hidden_size, Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim, Kc = c.linear_conv_kernel;
  if (Hk <= 0 || Hv % Hk) fail("linear attention: {} value heads is not a multiple of {} key heads", Hv, Hk);
  const int64_t C = 2 * Hk * Dk + Hv * Dv;
  if (fused_qkvz) {
    w.in_proj_qkvz = b.linear(P + "in_proj_qkvz", 2 * Hk * Dk + 2 * Hv * Dv, H);
    w.in_proj_ba = b.linear(P + "in_proj_ba", 2 * Hv, H);
  } else {
    w.in_proj_qkv = b.linear(P + "in_proj_qkv", C, H);
    w.in_proj_z = b.linear(P + "in_proj_z", Hv * Dv, H);
    w.in_proj_b = b.linear(P + "in_proj_b", Hv, H);
    w.in_proj_a = b.linear(P + "in_proj_a", Hv, H);
  }
  w.conv1d = b.tensor(P + "conv1d.weight", Shape{C, Kc});
  w.A_log = b.tensor(P + "A_log", Shape{Hv});
  w.dt_bias = b.tensor(P + "dt_bias", Shape{Hv});
  w.norm = b.tensor(P + "norm.weight", Shape{Dv});
  w.out_proj = b.linear(P + "out_proj", H, Hv * Dv);
}

void bind_mlp(WeightBinder& b, const std::string& prefix, int64_t inter, MlpWeights& w) {
  const int64_t H = b.config().hidden_size;
  w.gate_proj = b.linear(prefix + "gate_proj", inter, H);
  w.up_proj = b.linear(prefix + "up_proj", inter, H);
  w.down_proj = b.linear(prefix + "down_proj", H, inter);
}

void bind_moe(WeightBinder& b, int layer, MoeWeights& w, bool shared_expert) {
  const auto& c = b.config();
  const std::string M = b.layer_prefix(layer) + "mlp.";
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size;
  w.router = b.linear(M + "gate", E, H);
  // The shared expert right after the router: a backend that places weights in binding order then holds the router
  // and the shared expert's gate / up projections back to back (one GEMM for all three; CudaOps::linear_multi).
  w.has_shared_expert = shared_expert && c.shared_expert_intermediate_size > 0;
  if (w.has_shared_expert) {
    bind_mlp(b, M + "shared_expert.", c.shared_expert_intermediate_size, w.shared_expert);
    w.shared_expert_gate = b.linear(M + "shared_expert_gate", 1, H);
  }
  w.experts.resize(E);
  if (b.has(M + "experts.gate_up_proj")) {
    // BF16 fused layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
    for (int64_t e = 0; e < E; ++e) {
      w.experts[e].gate = b.dense_slice(M + "experts.gate_up_proj", e, 0, I);
      w.experts[e].up = b.dense_slice(M + "experts.gate_up_proj", e, I, I);
      w.experts[e].down = b.dense_slice(M + "experts.down_proj", e, 0, H);
    }
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const std::string X = M + "experts." + std::to_string(e) + ".";
      w.experts[e].gate = b.linear(X + "gate_proj", I, H);
      w.experts[e].up = b.linear(X + "up_proj", I, H);
      w.experts[e].down = b.linear(X + "down_proj", H, I);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Forward

void embed(Forward& f, const ModelWeights& w, const TensorView& ids, TensorView out) {
  if (!w.vocab_parallel) {
    f.ops.embedding(w.embed_tokens, ids, out);
    return;
  }
  f.ops.embedding_shard(w.embed_tokens, ids, w.vocab_begin, out);
  f.ops.all_reduce(out);
}

TensorView rms_norm(Forward& f, const TensorView& x, const TensorView& weight, NormKind kind) {
  TensorView out = f.f32(x.shape);
  f.ops.rms_norm(x, weight, static_cast<float>(f.config.rms_norm_eps), kind, out);
  return out;
}

void residual_add(Forward& f, TensorView hidden, const TensorView& y) { f.ops.add(hidden, y, hidden); }

TensorView residual_norm(Forward& f, TensorView hidden, const TensorView& y, const TensorView& weight, NormKind kind) {
  TensorView out = f.f32(hidden.shape);
  f.ops.add_rms_norm(hidden, y, weight, static_cast<float>(f.config.rms_norm_eps), kind, out);
  return out;
}

TensorView input_norm(Forward& f, TensorView hidden, const TensorView& weight, NormKind kind) {
  if (!f.pending_residual.data) return rms_norm(f, hidden, weight, kind);
  const TensorView y = f.pending_residual;
  f.pending_residual = TensorView();
  return residual_norm(f, hidden, y, weight, kind);
}

void residual_defer(Forward& f, const TensorView& y) {
  KILN_CHECK(!f.pending_residual.data, "residual_defer: a block output is already pending");
  f.pending_residual = y;
}

void residual_flush(Forward& f, TensorView hidden) {
  if (!f.pending_residual.data) return;
  residual_add(f, hidden, f.pending_residual);
  f.pending_residual = TensorView();
}

void bind_dense_mlp(WeightBinder& b, int layer, MlpWeights& w) {
  bind_mlp(b, b.layer_prefix(layer) + "mlp.", b.config().intermediate_size, w);
}

void bind_moe_or_mlp(WeightBinder& b, int layer, LayerWeights& w, bool shared_expert) {
  w.is_moe = b.config().layer_is_moe(layer);
  if (w.is_moe)
    bind_moe(b, layer, w.moe, shared_expert);
  else
    bind_dense_mlp(b, layer, w.mlp);
}

TensorView moe_or_mlp(Forward& f, int layer, const LayerWeights& w, const TensorView& x) {
  return w.is_moe ? moe(f, layer, w.moe, x, f.config.experts_per_tok, f.config.norm_topk_prob) : mlp(f, w.mlp, x);
}

void bind_hybrid_mixer(WeightBinder& b, int layer, LayerWeights& w, bool fused_qkvz) {
  bind_layer_norms(b, layer, w);
  if (w.type == format::LayerType::linear_attention)
    bind_gated_deltanet(b, layer, w.linear, fused_qkvz);
  else
    bind_full_attention(b, layer, w.attn);
}

static TensorView block_output(Forward& f, TensorView y);

// A Qwen3.5 DeltaNet layer's tensors as Ops::deltanet_block reads them (the rank's heads, from its config).
static Ops::DeltaNetBlockWeights deltanet_block_weights(const LinearAttentionWeights& lw,
                                                        const format::ModelConfig& c) {
  Ops::DeltaNetBlockWeights dw;
  dw.in_proj_qkv = &lw.in_proj_qkv;
  dw.in_proj_z = &lw.in_proj_z;
  dw.in_proj_b = &lw.in_proj_b;
  dw.in_proj_a = &lw.in_proj_a;
  dw.conv1d = lw.conv1d;
  dw.A_log = lw.A_log;
  dw.dt_bias = lw.dt_bias;
  dw.norm = lw.norm;
  dw.out_proj = &lw.out_proj;
  dw.Hk = c.linear_num_key_heads;
  dw.Hv = c.linear_num_value_heads;
  dw.Dk = c.linear_key_head_dim;
  dw.Dv = c.linear_value_head_dim;
  return dw;
}

TensorView hybrid_mixer_output(Forward& f, int layer, const LayerWeights& w, TensorView hidden,
                               GatedDeltaNetFn deltanet) {
  // A Qwen3.5 DeltaNet layer as one op where the backend fuses it, the input norm included (never in a traced run,
  // which names the intermediate tensors).
  if (w.type == format::LayerType::linear_attention && deltanet == &gated_deltanet && !(f.trace && *f.trace)) {
    const int li = f.linear_index[layer];
    KILN_CHECK(li >= 0, "layer {} has no recurrent state", layer);
    const float eps = static_cast<float>(f.config.rms_norm_eps);
    const ResidualNorm in{hidden, f.pending_residual, w.input_norm, eps, NormKind::zero_centred};
    TensorView out = f.f32(hidden.shape);
    if (f.ops.deltanet_block(in, deltanet_block_weights(w.linear, f.config), f.conv_state[li], f.recurrent_state[li],
                             f.step, eps, out)) {
      f.pending_residual = TensorView();  // added to hidden by the op
      return block_output(f, out);
    }
  }
  const TensorView x = input_norm(f, hidden, w.input_norm, NormKind::zero_centred);
  return w.type == format::LayerType::linear_attention
             ? deltanet(f, layer, w.linear, x)
             : full_attention(f, layer, w.attn, x, /*output_gate=*/true, NormKind::zero_centred);
}

static TensorView linear(Forward& f, const TensorView& x, const LinearWeight& w) {
  TensorView out = f.f32(Shape{x.dim(0), w.out_features});
  f.ops.linear(x, w, out);
  return out;
}

// A block's output, summed over the tensor-parallel group (Ops::all_reduce; a no-op on one device). Every block
// that returns into the residual stream ends here: attention, DeltaNet, MLP, MoE.
static TensorView block_output(Forward& f, TensorView y) {
  f.ops.all_reduce(y);
  return y;
}

TensorView full_attention(Forward& f, int layer, const AttentionWeights& w, const TensorView& x, bool output_gate,
                          NormKind qk_norm) {
  const auto& c = f.config;
  const int64_t T = x.dim(0), Hq = c.num_attention_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const int kv_layer = f.kv_index[layer];
  KILN_CHECK(kv_layer >= 0, "layer {} has no KV cache", layer);

  TensorView q_proj = f.f32(Shape{T, w.q_proj.out_features});  // [T, Hq * D * (gate ? 2 : 1)]
  TensorView k = f.f32(Shape{T, w.k_proj.out_features});       // [T, Hkv * D]
  TensorView v = f.f32(Shape{T, w.v_proj.out_features});
  {
    const LinearWeight* ws[] = {&w.q_proj, &w.k_proj, &w.v_proj};
    const TensorView outs[] = {q_proj, k, v};
    f.ops.linear_multi(x, ws, outs);
  }
  // q / k norms and rotary embedding (and the output gate's split from q) as one op (a backend may fuse them).
  TensorView qn = f.f32(Shape{T, Hq, D}), kn = f.f32(Shape{T, Hkv, D});
  TensorView gate = output_gate ? f.f32(Shape{T, Hq * D}) : TensorView();
  std::optional<MRopeAxes> axes;
  if (f.step.token_mrope_pos.data) {  // a step with image tokens: three positions per token
    if (c.mrope_section.empty()) fail("image positions given to a model without M-RoPE ({})", format::arch_name(c.arch));
    axes = MRopeAxes::from_sections(c.mrope_section, c.mrope_interleaved, c.rotary_dim() / 2);
  }
  f.ops.qk_norm_rope(q_proj, k, output_gate, w.q_norm, w.k_norm, static_cast<float>(c.rms_norm_eps), qk_norm,
                     axes ? f.step.token_mrope_pos : f.step.token_pos, c.rotary_dim(), c.rope_theta,
                     axes ? &*axes : nullptr, qn, gate, kn);
  f.name("q_rope", layer, qn);
  f.name("k_rope", layer, kn);

  KvLayerView& cache = f.kv[kv_layer];
  TensorView v3 = reshaped(v, Shape{T, Hkv, D});
  if (cache.k.dtype == DType::F8_E4M3 && (cache.k_scale <= 0.0f || cache.v_scale <= 0.0f)) {
    // No checkpoint scales: take them from the first chunk stored in this layer (amax / 448).
    const float k_amax = f.ops.max_abs(kn), v_amax = f.ops.max_abs(v3);
    cache.k_scale = k_amax > 0 ? k_amax / 448.0f : 1.0f;
    cache.v_scale = v_amax > 0 ? v_amax / 448.0f : 1.0f;
    KILN_LOG_INFO("layer {}: FP8 KV cache scales from the first prompt chunk (no k_scale/v_scale in the "
                  "checkpoint): k_scale {:.4g}, v_scale {:.4g}", layer, cache.k_scale, cache.v_scale);
  }
  f.ops.kv_store(kn, v3, cache, f.step);

  TensorView attn = f.f32(Shape{T, Hq, D});
  f.ops.attention(qn, cache, f.step, 1.0f / std::sqrt(static_cast<float>(D)), attn);
  TensorView attn2 = reshaped(attn, Shape{T, Hq * D});
  if (output_gate && !(f.trace && *f.trace)) {
    // The output gate applied as o_proj reads its input (a traced run keeps the gated output as its own tensor).
    TensorView o = f.f32(Shape{T, w.o_proj.out_features});
    f.ops.linear_gated_input(attn2, gate, InputAct::sigmoid_mul, w.o_proj, o);
    return block_output(f, o);
  }
  if (output_gate) f.ops.sigmoid_mul(attn2, gate, attn2);
  f.name("attn_out", layer, attn2);
  return block_output(f, linear(f, attn2, w.o_proj));
}

TensorView gated_deltanet_core(Forward& f, int layer, const LinearAttentionWeights& w, const TensorView& mixed_qkv,
                               const TensorView& z, const TensorView& b, const TensorView& a) {
  const auto& c = f.config;
  const int64_t T = mixed_qkv.dim(0), Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim;
  const int64_t C = 2 * Hk * Dk + Hv * Dv;
  const int li = f.linear_index[layer];
  KILN_CHECK(li >= 0, "layer {} has no recurrent state", layer);

  TensorView conv = f.f32(Shape{T, C});
  f.ops.causal_conv1d_silu(mixed_qkv, w.conv1d, f.conv_state[li], f.step, conv);
  f.name("conv_out", layer, conv);
  // q, k, v are views of the conv output's rows (the delta rule takes strided rows).
  const TensorView q = strided_view(conv, 0, Shape{T, Hk, Dk}, {C, Dk, 1});
  const TensorView k = strided_view(conv, Hk * Dk, Shape{T, Hk, Dk}, {C, Dk, 1});
  const TensorView v = strided_view(conv, 2 * Hk * Dk, Shape{T, Hv, Dv}, {C, Dv, 1});

  TensorView g = f.f32(Shape{T, Hv}), beta = f.f32(Shape{T, Hv});
  TensorView core = f.f32(Shape{T, Hv, Dv});
  TensorView normed = f.f32(Shape{T * Hv, Dv});
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (f.trace && *f.trace) {  // a traced run keeps the two ops (the delta rule's output is a named tensor)
    f.ops.gated_delta_rule_with_gates(q, k, v, a, b, w.A_log, w.dt_bias, g, beta, f.recurrent_state[li], f.step,
                                      f.delta_mode, core);
    f.name("delta_out", layer, core);
    f.ops.gated_rms_norm(reshaped(core, Shape{T * Hv, Dv}), reshaped(z, Shape{T * Hv, Dv}), w.norm, eps, normed);
  } else {
    // The recurrence and the output norm as one op (a backend may run both in one kernel).
    f.ops.gated_delta_rule_norm(q, k, v, a, b, w.A_log, w.dt_bias, g, beta, f.recurrent_state[li], f.step,
                                f.delta_mode, reshaped(z, Shape{T * Hv, Dv}), w.norm, eps, core, normed);
  }
  return block_output(f, linear(f, reshaped(normed, Shape{T, Hv * Dv}), w.out_proj));
}

TensorView gated_deltanet(Forward& f, int layer, const LinearAttentionWeights& w, const TensorView& x) {
  const int64_t T = x.dim(0);
  TensorView mixed = f.f32(Shape{T, w.in_proj_qkv.out_features});
  TensorView z = f.f32(Shape{T, w.in_proj_z.out_features});
  TensorView b = f.f32(Shape{T, w.in_proj_b.out_features});
  TensorView a = f.f32(Shape{T, w.in_proj_a.out_features});
  const LinearWeight* ws[] = {&w.in_proj_qkv, &w.in_proj_z, &w.in_proj_b, &w.in_proj_a};
  const TensorView outs[] = {mixed, z, b, a};
  f.ops.linear_multi(x, ws, outs);
  return gated_deltanet_core(f, layer, w, mixed, z, b, a);
}

TensorView mlp(Forward& f, const MlpWeights& w, const TensorView& x) {
  TensorView g = linear(f, x, w.gate_proj);
  TensorView u = linear(f, x, w.up_proj);
  TensorView y = f.f32(Shape{x.dim(0), w.down_proj.out_features});
  f.ops.linear_gated_input(g, u, InputAct::silu_mul, w.down_proj, y);
  return block_output(f, y);
}

// The whole block as one op where the backend fuses it (Ops::moe_block: input x, or the residual step `pre`); never in a
// traced run, which keeps the named intermediate tensors. Empty when not taken.
static TensorView moe_fused(Forward& f, const MoeWeights& w, const TensorView& x, const ResidualNorm* pre, int top_k,
                            bool renormalise) {
  if (!w.has_shared_expert || (f.trace && *f.trace)) return TensorView();
  TensorView out = f.f32(pre ? pre->hidden.shape : x.shape);
  if (!f.ops.moe_block(x, pre, w.router, w.shared_expert.gate_proj, w.shared_expert.up_proj, w.shared_expert.down_proj,
                       w.shared_expert_gate, w.experts, top_k, renormalise, out))
    return TensorView();
  return block_output(f, out);
}

static TensorView moe_unfused(Forward& f, int layer, const MoeWeights& w, const TensorView& x, int top_k,
                              bool renormalise);

TensorView moe_after_residual(Forward& f, int layer, const MoeWeights& w, const ResidualNorm& pre, int top_k,
                              bool renormalise) {
  const TensorView fused = moe_fused(f, w, TensorView(), &pre, top_k, renormalise);
  if (fused.data) return fused;
  return moe_unfused(f, layer, w, residual_norm(f, pre.hidden, pre.y, pre.weight, pre.kind), top_k, renormalise);
}

TensorView moe(Forward& f, int layer, const MoeWeights& w, const TensorView& x, int top_k, bool renormalise) {
  const TensorView fused = moe_fused(f, w, x, nullptr, top_k, renormalise);
  return fused.data ? fused : moe_unfused(f, layer, w, x, top_k, renormalise);
}

// model::moe's ops one by one (backends may still fuse the routing with the experts: Ops::moe_route_experts).
static TensorView moe_unfused(Forward& f, int layer, const MoeWeights& w, const TensorView& x, int top_k,
                              bool renormalise) {
  const int64_t T = x.dim(0);
  TensorView out = f.f32(x.shape);
  const bool traced = f.trace && *f.trace;
  TensorView logits = f.f32(Shape{T, w.router.out_features});  // [T, E]
  TensorView shared_g, shared_u, shared_gate;
  if (w.has_shared_expert) {
    // The router and the shared expert's input projections read the same x: one multi-linear.
    shared_g = f.f32(Shape{T, w.shared_expert.gate_proj.out_features});
    shared_u = f.f32(Shape{T, w.shared_expert.up_proj.out_features});
    shared_gate = f.f32(Shape{T, w.shared_expert_gate.out_features});  // [T, 1]
    const LinearWeight* ws[] = {&w.router, &w.shared_expert.gate_proj, &w.shared_expert.up_proj,
                                &w.shared_expert_gate};
    const TensorView outs[] = {logits, shared_g, shared_u, shared_gate};
    f.ops.linear_multi(x, ws, outs);
  } else {
    f.ops.linear(x, w.router, logits);
  }
  TensorView ids = f.ops.scratch(DType::I32, Shape{T, top_k});
  TensorView weights = f.f32(Shape{T, top_k});
  // Routing and routed experts as one op (a backend may fuse them: Ops::moe_route_experts).
  if (!w.has_shared_expert) {
    f.ops.moe_route_experts(x, logits, top_k, renormalise, w.experts, TensorView(), TensorView(), ids, weights, out);
    f.name("moe_routed", layer, out);
    return block_output(f, out);
  }
  // The shared expert first, then the routed experts with its gated output folded into their combine; a traced run
  // keeps the routed output on its own (Ops::moe_experts_shared's default steps, written out).
  TensorView shared = f.f32(Shape{T, w.shared_expert.down_proj.out_features});
  f.ops.linear_gated_input(shared_g, shared_u, InputAct::silu_mul, w.shared_expert.down_proj, shared);
  if (traced) {
    f.ops.moe_route(logits, top_k, renormalise, ids, weights);
    f.ops.moe_experts(x, ids, weights, w.experts, out);
    f.name("moe_routed", layer, out);
    f.ops.sigmoid_mul(shared, shared_gate, shared);
    f.ops.add(out, shared, out);
  } else {
    f.ops.moe_route_experts(x, logits, top_k, renormalise, w.experts, shared, shared_gate, ids, weights, out);
  }
  return block_output(f, out);
}

}  // namespace kiln::model
