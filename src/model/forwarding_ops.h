// A model::Ops that forwards every call to an inner Ops, for wrappers that change or watch a few ops (the
// calibration recorder of `kiln quantize`, a perturbed backend the op-check harness must catch). Override the ops to
// change; call the base (or inner()) to forward.
#pragma once
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/ops.h"

namespace kiln::model {

class ForwardingOps : public Ops {
 public:
  explicit ForwardingOps(std::unique_ptr<Ops> inner) : inner_(std::move(inner)) {}
  model::Ops& inner() { return *inner_; }

  std::string name() const override { return inner_->name(); }
  std::string describe() const override { return inner_->describe(); }
  TensorView allocate(DType dtype, Shape shape) override { return inner_->allocate(dtype, shape); }
  TensorView place_weight(const TensorView& host) override { return inner_->place_weight(host); }
  TensorView place_random(DType dtype, Shape shape, const model::RandomFill& fill) override {
    return inner_->place_random(dtype, shape, fill);
  }
  TensorView place_random_slice(DType dtype, const Shape& stored, const format::TensorSlice& slice,
                                const model::RandomFill& fill) override {
    return inner_->place_random_slice(dtype, stored, slice, fill);
  }
  void finish_weights() override { inner_->finish_weights(); }
  TensorView scratch(DType dtype, Shape shape) override { return inner_->scratch(dtype, shape); }
  void reset_scratch() override { inner_->reset_scratch(); }
  ScratchMark scratch_mark() override { return inner_->scratch_mark(); }
  void scratch_release(const ScratchMark& mark) override { inner_->scratch_release(mark); }
  size_t scratch_peak_bytes() const override { return inner_->scratch_peak_bytes(); }
  TensorView upload(const void* host, DType dtype, Shape shape) override { return inner_->upload(host, dtype, shape); }
  void download(const TensorView& src, void* host) override { inner_->download(src, host); }
  void fill_zero(TensorView t) override { inner_->fill_zero(t); }
  void copy(const TensorView& src, TensorView dst) override { inner_->copy(src, dst); }
  void copy_spans(std::span<const CopySpan> spans) override { inner_->copy_spans(spans); }
  float max_abs(const TensorView& x) override { return inner_->max_abs(x); }
  bool graph_capture_begin() override { return inner_->graph_capture_begin(); }
  int graph_capture_end() override { return inner_->graph_capture_end(); }
  bool graph_launch(int handle) override { return inner_->graph_launch(handle); }
  void graph_reset() override { inner_->graph_reset(); }
  bool profile_begin() override { return inner_->profile_begin(); }
  std::vector<model::OpTime> profile_end() override { return inner_->profile_end(); }
  void embedding(const TensorView& table, const TensorView& ids, TensorView out) override {
    inner_->embedding(table, ids, out);
  }
  void embedding_shard(const TensorView& table, const TensorView& ids, int64_t vocab_begin, TensorView out) override {
    inner_->embedding_shard(table, ids, vocab_begin, out);
  }
  void linear(const TensorView& x, const model::LinearWeight& w, TensorView out) override { inner_->linear(x, w, out); }
  void linear_multi(const TensorView& x, std::span<const model::LinearWeight* const> ws,
                    std::span<const TensorView> outs) override {
    inner_->linear_multi(x, ws, outs);
  }
  void rms_norm(const TensorView& x, const TensorView& weight, float eps, model::NormKind kind,
                TensorView out) override {
    inner_->rms_norm(x, weight, eps, kind, out);
  }
  void add_rms_norm(TensorView hidden, const TensorView& y, const TensorView& weight, float eps, model::NormKind kind,
                    TensorView out) override {
    inner_->add_rms_norm(hidden, y, weight, eps, kind, out);
  }
  void gated_rms_norm(const TensorView& x, const TensorView& z, const TensorView& weight, float eps,
                      TensorView out) override {
    inner_->gated_rms_norm(x, z, weight, eps, out);
  }
  void rope(TensorView x, const TensorView& positions, int rotary_dim, double theta) override {
    inner_->rope(x, positions, rotary_dim, theta);
  }
  void mrope(TensorView x, const TensorView& positions, int rotary_dim, double theta,
             const model::MRopeAxes& axes) override {
    inner_->mrope(x, positions, rotary_dim, theta, axes);
  }
  void linear_gated_input(const TensorView& x, const TensorView& x2, model::InputAct act, const model::LinearWeight& w,
                          TensorView out) override {
    inner_->linear_gated_input(x, x2, act, w, out);
  }
  void qk_norm_rope(const TensorView& q_proj, const TensorView& k, bool gated, const TensorView& q_norm,
                    const TensorView& k_norm, float eps, model::NormKind kind, const TensorView& positions,
                    int rotary_dim, double theta, const model::MRopeAxes* axes, TensorView q_out, TensorView gate_out,
                    TensorView k_out) override {
    inner_->qk_norm_rope(q_proj, k, gated, q_norm, k_norm, eps, kind, positions, rotary_dim, theta, axes, q_out,
                         gate_out, k_out);
  }
  void scatter_rows(const TensorView& src, const TensorView& rows, TensorView dst) override {
    inner_->scatter_rows(src, rows, dst);
  }
  void add(const TensorView& a, const TensorView& b, TensorView out) override { inner_->add(a, b, out); }
  void silu_mul(const TensorView& gate, const TensorView& up, TensorView out) override {
    inner_->silu_mul(gate, up, out);
  }
  void sigmoid_mul(const TensorView& x, const TensorView& g, TensorView out) override {
    inner_->sigmoid_mul(x, g, out);
  }
  void gather_rows(const TensorView& x, const TensorView& rows, TensorView out) override {
    inner_->gather_rows(x, rows, out);
  }
  void kv_store(const TensorView& k, const TensorView& v, model::KvLayerView cache,
                const model::StepLayout& step) override {
    inner_->kv_store(k, v, cache, step);
  }
  void attention(const TensorView& q, model::KvLayerView cache, const model::StepLayout& step, float scale,
                 TensorView out) override {
    inner_->attention(q, cache, step, scale, out);
  }
  void causal_conv1d_silu(const TensorView& x, const TensorView& weight, TensorView conv_state,
                          const model::StepLayout& step, TensorView out) override {
    inner_->causal_conv1d_silu(x, weight, conv_state, step, out);
  }
  void delta_rule_gates(const TensorView& a, const TensorView& b, const TensorView& A_log, const TensorView& dt_bias,
                        TensorView g, TensorView beta) override {
    inner_->delta_rule_gates(a, b, A_log, dt_bias, g, beta);
  }
  void gated_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& beta, TensorView state, const model::StepLayout& step,
                        model::DeltaRuleMode mode, TensorView out) override {
    inner_->gated_delta_rule(q, k, v, g, beta, state, step, mode, out);
  }
  void gated_delta_rule_with_gates(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& a,
                                   const TensorView& b, const TensorView& A_log, const TensorView& dt_bias,
                                   TensorView g, TensorView beta, TensorView state, const model::StepLayout& step,
                                   model::DeltaRuleMode mode, TensorView out) override {
    inner_->gated_delta_rule_with_gates(q, k, v, a, b, A_log, dt_bias, g, beta, state, step, mode, out);
  }
  void gated_delta_rule_norm(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& a,
                             const TensorView& b, const TensorView& A_log, const TensorView& dt_bias, TensorView g,
                             TensorView beta, TensorView state, const model::StepLayout& step, model::DeltaRuleMode mode,
                             const TensorView& z, const TensorView& norm_weight, float eps, TensorView core,
                             TensorView out) override {
    inner_->gated_delta_rule_norm(q, k, v, a, b, A_log, dt_bias, g, beta, state, step, mode, z, norm_weight, eps, core,
                                  out);
  }
  void moe_route(const TensorView& logits, int top_k, bool renormalise, TensorView expert_ids,
                 TensorView weights) override {
    inner_->moe_route(logits, top_k, renormalise, expert_ids, weights);
  }
  void moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                   std::span<const model::ExpertWeights> experts, TensorView out) override {
    inner_->moe_experts(x, expert_ids, weights, experts, out);
  }
  void moe_experts_shared(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                          std::span<const model::ExpertWeights> experts, TensorView shared,
                          const TensorView& shared_gate, TensorView out) override {
    inner_->moe_experts_shared(x, expert_ids, weights, experts, shared, shared_gate, out);
  }
  void layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias, float eps,
                  TensorView out) override {
    inner_->layer_norm(x, weight, bias, eps, out);
  }
  void gelu(const TensorView& x, model::GeluKind kind, TensorView out) override { inner_->gelu(x, kind, out); }
  void rope_cos_sin(TensorView x, const TensorView& cos, const TensorView& sin) override {
    inner_->rope_cos_sin(x, cos, sin);
  }
  void attention_segments(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cu_seqlens,
                          int64_t max_seqlen, float scale, TensorView out) override {
    inner_->attention_segments(q, k, v, cu_seqlens, max_seqlen, scale, out);
  }
  void weighted_embedding(const TensorView& table, const TensorView& ids, const TensorView& weights,
                          TensorView out) override {
    inner_->weighted_embedding(table, ids, weights, out);
  }
  void all_reduce(TensorView x) override { inner_->all_reduce(x); }
  void argmax_rows(const TensorView& logits, std::span<int32_t> ids) override { inner_->argmax_rows(logits, ids); }
  void argmax_rows_best(const TensorView& logits, std::span<int32_t> ids, std::span<float> values) override {
    inner_->argmax_rows_best(logits, ids, values);
  }
  void argmax_rows_into(const TensorView& logits, TensorView ids, int32_t id_offset) override {
    inner_->argmax_rows_into(logits, ids, id_offset);
  }
  void sample_rows(const TensorView& logits, std::span<const model::RowSampling> rows,
                   std::span<int32_t> ids) override {
    inner_->sample_rows(logits, rows, ids);
  }
  std::optional<model::DeviceMemory> device_memory() const override { return inner_->device_memory(); }

 private:
  std::unique_ptr<model::Ops> inner_;
};

}  // namespace kiln::model
