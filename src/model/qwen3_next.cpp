// Qwen3-Next (modeling_qwen3_next.py): the Qwen3.5 hybrid maths, but the Gated DeltaNet input projections are
// fused and interleaved per key-head group (fix_query_key_value_ordering): in_proj_qkvz rows per group g are
// [q_g (Dk) | k_g (Dk) | v_g (r Dv) | z_g (r Dv)] and in_proj_ba rows [b_g (r) | a_g (r)], r = Hv / Hk.
// MoE with a sigmoid-gated shared expert (top-k renormalised when norm_topk_prob), dense MLP in
// mlp_only_layers / off the decoder_sparse_step.
#include "model/family.h"

namespace kiln::model {
namespace {

TensorView gated_deltanet_fused(Forward& f, int layer, const LinearAttentionWeights& w, const TensorView& x) {
  const auto& c = f.config;
  const int64_t T = x.dim(0), Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim, r = Hv / Hk;
  const int64_t group = 2 * Dk + 2 * r * Dv;  // qkvz columns per key head
  const int64_t C = 2 * Hk * Dk + Hv * Dv;

  TensorView qkvz = f.f32(Shape{T, Hk * group});
  f.ops.linear(x, w.in_proj_qkvz, qkvz);
  TensorView ba = f.f32(Shape{T, Hk * 2 * r});
  f.ops.linear(x, w.in_proj_ba, ba);

  // De-interleave into mixed_qkv = [q (Hk Dk) | k (Hk Dk) | v (Hv Dv)], z [T, Hv Dv], b, a [T, Hv].
  TensorView mixed = f.f32(Shape{T, C});
  f.ops.copy(strided_view(qkvz, 0, Shape{T, Hk, Dk}, {Hk * group, group, 1}),
             strided_view(mixed, 0, Shape{T, Hk, Dk}, {C, Dk, 1}));
  f.ops.copy(strided_view(qkvz, Dk, Shape{T, Hk, Dk}, {Hk * group, group, 1}),
             strided_view(mixed, Hk * Dk, Shape{T, Hk, Dk}, {C, Dk, 1}));
  f.ops.copy(strided_view(qkvz, 2 * Dk, Shape{T, Hk, r * Dv}, {Hk * group, group, 1}),
             strided_view(mixed, 2 * Hk * Dk, Shape{T, Hk, r * Dv}, {C, r * Dv, 1}));
  TensorView z = f.f32(Shape{T, Hv * Dv});
  f.ops.copy(strided_view(qkvz, 2 * Dk + r * Dv, Shape{T, Hk, r * Dv}, {Hk * group, group, 1}),
             reshaped(z, Shape{T, Hk, r * Dv}));
  TensorView b = f.f32(Shape{T, Hv}), a = f.f32(Shape{T, Hv});
  f.ops.copy(strided_view(ba, 0, Shape{T, Hk, r}, {Hk * 2 * r, 2 * r, 1}), reshaped(b, Shape{T, Hk, r}));
  f.ops.copy(strided_view(ba, r, Shape{T, Hk, r}, {Hk * 2 * r, 2 * r, 1}), reshaped(a, Shape{T, Hk, r}));
  return gated_deltanet_core(f, layer, w, mixed, z, b, a);
}

}  // namespace

constexpr Family qwen3_next_family{.arch = format::Arch::qwen3_next,
                                   .mixer = Mixer::hybrid,
                                   .ffn = Ffn::moe_or_mlp,
                                   .shared_expert = true,
                                   .deltanet = gated_deltanet_fused,
                                   .fused_qkvz = true};

}  // namespace kiln::model
