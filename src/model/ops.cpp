#include "model/ops.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "format/shard_plan.h"

namespace kiln::model {

TensorView strided_view(const TensorView& base, int64_t offset, Shape shape, std::initializer_list<int64_t> strides) {
  KILN_CHECK(static_cast<int>(strides.size()) == shape.ndim, "strides {} for shape {}", strides.size(), shape.str());
  TensorView v;
  v.data = static_cast<char*>(base.data) + offset * static_cast<int64_t>(dtype_size(base.dtype));
  v.dtype = base.dtype;
  v.shape = shape;
  int i = 0;
  for (int64_t s : strides) v.strides[i++] = s;
  return v;
}

TensorView reshaped(const TensorView& base, Shape shape) {
  KILN_CHECK(base.numel() == shape.numel(), "reshape {} -> {}", base.shape.str(), shape.str());
  KILN_CHECK(base.is_contiguous(), "reshape of a strided view");
  return TensorView(base.data, base.dtype, shape);
}

int32_t host_argmax(const float* row, int64_t n) {
  int64_t b = -1;
  for (int64_t v = 0; v < n; ++v)
    if (!std::isnan(row[v]) && (b < 0 || row[v] > row[b])) b = v;
  return static_cast<int32_t>(b < 0 ? 0 : b);
}

namespace {
// The value of element `i` of the random tensor `fill` describes, stored as dtype at out[j].
inline void random_element(DType dtype, const RandomFill& fill, uint64_t i, void* out, int64_t j) {
  const uint64_t h = random_fill_hash(fill.seed, i);
  if (fill.kind == RandomFill::Kind::bytes) {
    uint32_t b = fill.byte_lo + static_cast<uint32_t>((h >> 32) % (fill.byte_hi - fill.byte_lo));
    if (fill.random_sign && (h & 1)) b |= 0x80;
    static_cast<uint8_t*>(out)[j] = static_cast<uint8_t>(b);
    return;
  }
  const float d = fill.hi - fill.lo;
  const float u = static_cast<float>(h >> 40) * 0x1p-24f;  // exact
  const float m = d * u;
  const float v = fill.lo + m;
  switch (dtype) {
    case DType::F32: static_cast<float*>(out)[j] = v; break;
    case DType::BF16: static_cast<uint16_t*>(out)[j] = f32_to_bf16(v); break;
    case DType::F16: static_cast<uint16_t*>(out)[j] = f32_to_f16(v); break;
    default: fail("random uniform values for a {} tensor", dtype_name(dtype));
  }
}
}  // namespace

void fill_random_host(DType dtype, int64_t numel, const RandomFill& fill, void* out) {
  fill_random_host_range(dtype, 0, numel, fill, out);
}

void fill_random_host_range(DType dtype, int64_t first, int64_t count, const RandomFill& fill, void* out) {
  if (fill.kind == RandomFill::Kind::bytes) {
    KILN_CHECK(dtype_size(dtype) == 1, "random bytes for a {} tensor", dtype_name(dtype));
    KILN_CHECK(fill.byte_hi > fill.byte_lo && fill.byte_hi <= 256, "random byte range [{}, {})", fill.byte_lo,
               fill.byte_hi);
  }
  for (int64_t j = 0; j < count; ++j) random_element(dtype, fill, static_cast<uint64_t>(first + j), out, j);
}

void fill_random_host_slice(DType dtype, const Shape& stored, const format::TensorSlice& slice, const RandomFill& fill,
                            void* out) {
  if (fill.kind == RandomFill::Kind::bytes) {
    KILN_CHECK(dtype_size(dtype) == 1, "random bytes for a {} tensor", dtype_name(dtype));
    KILN_CHECK(fill.byte_hi > fill.byte_lo && fill.byte_hi <= 256, "random byte range [{}, {})", fill.byte_lo,
               fill.byte_hi);
  }
  const int64_t n = slice.shape.numel();
  for (int64_t j = 0; j < n; ++j)
    random_element(dtype, fill, static_cast<uint64_t>(format::slice_source_index(slice, stored, j)), out, j);
}

void upload_step(Ops& ops, StepLayout& step) {
  const int64_t T = step.num_tokens, S = step.num_seqs;
  step.token_pos = ops.upload(step.host_token_pos.data(), DType::I32, Shape{T});
  step.seq_token_begin = ops.upload(step.host_seq_token_begin.data(), DType::I32, Shape{S + 1});
  step.seq_start_pos = ops.upload(step.host_seq_start_pos.data(), DType::I32, Shape{S});
  step.seq_state_slot = ops.upload(step.host_seq_state_slot.data(), DType::I32, Shape{S});
  step.page_table = ops.upload(step.host_page_table.data(), DType::I32, Shape{S, step.max_pages_per_seq});
  step.token_mrope_pos = step.host_token_mrope_pos.empty()
                             ? TensorView()
                             : ops.upload(step.host_token_mrope_pos.data(), DType::I32, Shape{T, 3});
  step.token_checkpoint_slot = step.host_token_checkpoint_slot.empty()
                                   ? TensorView()
                                   : ops.upload(step.host_token_checkpoint_slot.data(), DType::I32, Shape{T});
}

int64_t I32Upload::add(std::span<const int32_t> data) {
  const int64_t offset = static_cast<int64_t>(host_.size());
  host_.insert(host_.end(), data.begin(), data.end());
  host_.resize((host_.size() + 63) / 64 * 64, 0);
  return offset;
}

void I32Upload::upload(Ops& ops) {
  KILN_CHECK(!dev_.data, "I32Upload: uploaded twice");
  if (host_.empty()) host_.resize(64, 0);
  dev_ = ops.upload(host_.data(), DType::I32, Shape{static_cast<int64_t>(host_.size())});
}

TensorView I32Upload::view(int64_t offset, Shape shape) const {
  KILN_CHECK(dev_.data && offset >= 0 && offset + shape.numel() <= dev_.numel(), "I32Upload: view [{}, +{}) of {}",
             offset, shape.numel(), dev_.numel());
  return TensorView(static_cast<int32_t*>(dev_.data) + offset, DType::I32, shape);
}

StagedStep stage_step(I32Upload& up, const StepLayout& step) {
  StagedStep at;
  at.token_pos = up.add(step.host_token_pos);
  at.seq_token_begin = up.add(step.host_seq_token_begin);
  at.seq_start_pos = up.add(step.host_seq_start_pos);
  at.seq_state_slot = up.add(step.host_seq_state_slot);
  at.page_table = up.add(step.host_page_table);
  if (!step.host_token_mrope_pos.empty()) at.token_mrope_pos = up.add(step.host_token_mrope_pos);
  if (!step.host_token_checkpoint_slot.empty()) at.token_checkpoint_slot = up.add(step.host_token_checkpoint_slot);
  return at;
}

void bind_step(const I32Upload& up, const StagedStep& at, StepLayout& step) {
  const int64_t T = step.num_tokens, S = step.num_seqs;
  step.token_pos = up.view(at.token_pos, Shape{T});
  step.seq_token_begin = up.view(at.seq_token_begin, Shape{S + 1});
  step.seq_start_pos = up.view(at.seq_start_pos, Shape{S});
  step.seq_state_slot = up.view(at.seq_state_slot, Shape{S});
  step.page_table = up.view(at.page_table, Shape{S, step.max_pages_per_seq});
  step.token_mrope_pos = at.token_mrope_pos < 0 ? TensorView() : up.view(at.token_mrope_pos, Shape{T, 3});
  step.token_checkpoint_slot = at.token_checkpoint_slot < 0 ? TensorView() : up.view(at.token_checkpoint_slot, Shape{T});
}

TensorView Ops::place_random(DType dtype, Shape shape, const RandomFill& fill) {
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  random_storage_.push_back(std::make_unique<uint8_t[]>(std::max<size_t>(bytes, 16)));
  fill_random_host(dtype, shape.numel(), fill, random_storage_.back().get());
  return place_weight(TensorView(random_storage_.back().get(), dtype, shape));
}

TensorView Ops::place_random_slice(DType dtype, const Shape& stored, const format::TensorSlice& slice,
                                   const RandomFill& fill) {
  const size_t bytes = static_cast<size_t>(slice.shape.numel()) * dtype_size(dtype);
  random_storage_.push_back(std::make_unique<uint8_t[]>(std::max<size_t>(bytes, 16)));
  fill_random_host_slice(dtype, stored, slice, fill, random_storage_.back().get());
  return place_weight(TensorView(random_storage_.back().get(), dtype, slice.shape));
}

void Ops::embedding_shard(const TensorView& table, const TensorView& ids, int64_t vocab_begin, TensorView out) {
  (void)table, (void)ids, (void)vocab_begin, (void)out;
  fail("the {} backend has no vocabulary-parallel embedding (needed for --tp-size > 1)", name());
}

MRopeAxes MRopeAxes::from_sections(const std::vector<int>& sections, bool interleaved, int half) {
  if (half < 1 || half > 64) fail("M-RoPE: {} rotary frequencies (1 to 64 supported)", half);
  if (sections.size() != 3) fail("M-RoPE: mrope_section has {} entries, expected 3 (t, h, w)", sections.size());
  if (sections[0] < 0 || sections[1] < 0 || sections[2] < 0 || sections[0] + sections[1] + sections[2] != half)
    fail("M-RoPE: mrope_section [{}, {}, {}] does not sum to the {} rotary frequencies", sections[0], sections[1],
         sections[2], half);
  MRopeAxes a;
  for (int i = 0; i < half; ++i) {
    int axis = 0;
    if (interleaved) {
      if (i % 3 == 1 && i < 3 * sections[1]) axis = 1;
      else if (i % 3 == 2 && i < 3 * sections[2]) axis = 2;
    } else {
      axis = i < sections[0] ? 0 : i < sections[0] + sections[1] ? 1 : 2;
    }
    a.bits[i / 32] |= static_cast<uint64_t>(axis) << (2 * (i % 32));
  }
  return a;
}

void Ops::mrope(TensorView x, const TensorView& positions, int rotary_dim, double theta, const MRopeAxes& axes) {
  (void)x, (void)positions, (void)rotary_dim, (void)theta, (void)axes;
  fail("the {} backend has no multimodal rope (needed for image inputs)", name());
}

void Ops::scatter_rows(const TensorView& src, const TensorView& rows, TensorView dst) {
  (void)src, (void)rows, (void)dst;
  fail("the {} backend cannot place image embeddings (scatter_rows)", name());
}

void Ops::copy_spans(std::span<const CopySpan> spans) {
  for (const CopySpan& c : spans) {
    if (c.bytes == 0) continue;
    const int64_t n = static_cast<int64_t>(c.bytes);
    copy(TensorView(const_cast<void*>(c.src), DType::U8, Shape{n}), TensorView(c.dst, DType::U8, Shape{n}));
  }
}

void Ops::all_reduce(TensorView x) {
  (void)x;
  if (comm_ && comm_->size() > 1)
    fail("the {} backend has no tensor-parallel all-reduce (needed for --tp-size {})", name(), comm_->size());
}

void Ops::linear_gated_input(const TensorView& x, const TensorView& x2, InputAct act, const LinearWeight& w,
                             TensorView out) {
  KILN_CHECK(x.shape == x2.shape && x.ndim() == 2 && x.is_contiguous() && x2.is_contiguous(),
             "linear_gated_input: x {} x2 {}", x.shape.str(), x2.shape.str());
  TensorView a = scratch(DType::F32, x.shape);
  if (act == InputAct::silu_mul) silu_mul(x, x2, a);
  else sigmoid_mul(x, x2, a);
  linear(a, w, out);
}

void Ops::linear_multi(const TensorView& x, std::span<const LinearWeight* const> ws,
                       std::span<const TensorView> outs) {
  KILN_CHECK(ws.size() == outs.size(), "linear_multi: {} weights, {} outputs", ws.size(), outs.size());
  for (size_t i = 0; i < ws.size(); ++i) linear(x, *ws[i], outs[i]);
}

void check_qk_norm_rope(const TensorView& q_proj, const TensorView& k, bool gated, const TensorView& q_out,
                        const TensorView& gate_out, const TensorView& k_out) {
  KILN_CHECK(q_out.ndim() == 3 && k_out.ndim() == 3 && q_proj.ndim() == 2 && k.ndim() == 2,
             "qk_norm_rope: q_proj {} k {} q_out {} k_out {}", q_proj.shape.str(), k.shape.str(), q_out.shape.str(),
             k_out.shape.str());
  const int64_t T = q_out.dim(0), Hq = q_out.dim(1), D = q_out.dim(2), Hkv = k_out.dim(1);
  KILN_CHECK(q_proj.dim(0) == T && q_proj.dim(1) == Hq * D * (gated ? 2 : 1) && k.dim(0) == T &&
                 k.dim(1) == Hkv * D && k_out.dim(0) == T && k_out.dim(2) == D && q_proj.is_contiguous() &&
                 k.is_contiguous() && (!gated || (gate_out.numel() == T * Hq * D && gate_out.is_contiguous())),
             "qk_norm_rope: q_proj {} k {} for q_out {} k_out {} (gated {})", q_proj.shape.str(), k.shape.str(),
             q_out.shape.str(), k_out.shape.str(), gated);
}

void Ops::qk_norm_rope(const TensorView& q_proj, const TensorView& k, bool gated, const TensorView& q_norm,
                       const TensorView& k_norm, float eps, NormKind kind, const TensorView& positions, int rotary_dim,
                       double theta, const MRopeAxes* axes, TensorView q_out, TensorView gate_out, TensorView k_out) {
  check_qk_norm_rope(q_proj, k, gated, q_out, gate_out, k_out);
  const int64_t T = q_out.dim(0), Hq = q_out.dim(1), D = q_out.dim(2), Hkv = k_out.dim(1);
  TensorView q = q_proj;
  if (gated) {
    // Per head [q (D) | gate (D)] (Qwen3_5Attention: view(..., -1, 2D).chunk(2)).
    q = scratch(DType::F32, Shape{T, Hq, D});
    copy(strided_view(q_proj, 0, Shape{T, Hq, D}, {Hq * 2 * D, 2 * D, 1}), q);
    copy(strided_view(q_proj, D, Shape{T, Hq, D}, {Hq * 2 * D, 2 * D, 1}), reshaped(gate_out, Shape{T, Hq, D}));
  }
  rms_norm(reshaped(q, Shape{T * Hq, D}), q_norm, eps, kind, reshaped(q_out, Shape{T * Hq, D}));
  rms_norm(reshaped(k, Shape{T * Hkv, D}), k_norm, eps, kind, reshaped(k_out, Shape{T * Hkv, D}));
  if (axes) {
    mrope(q_out, positions, rotary_dim, theta, *axes);
    mrope(k_out, positions, rotary_dim, theta, *axes);
  } else {
    rope(q_out, positions, rotary_dim, theta);
    rope(k_out, positions, rotary_dim, theta);
  }
}

void Ops::add_rms_norm(TensorView hidden, const TensorView& y, const TensorView& weight, float eps, NormKind kind,
                       TensorView out) {
  add(hidden, y, hidden);
  rms_norm(hidden, weight, eps, kind, out);
}

void Ops::gated_delta_rule_with_gates(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& a, const TensorView& b, const TensorView& A_log,
                                      const TensorView& dt_bias, TensorView g, TensorView beta, TensorView state,
                                      const StepLayout& step, DeltaRuleMode mode, TensorView out) {
  delta_rule_gates(a, b, A_log, dt_bias, g, beta);
  gated_delta_rule(q, k, v, g, beta, state, step, mode, out);
}

void Ops::gated_delta_rule_norm(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& a,
                                const TensorView& b, const TensorView& A_log, const TensorView& dt_bias, TensorView g,
                                TensorView beta, TensorView state, const StepLayout& step, DeltaRuleMode mode,
                                const TensorView& z, const TensorView& norm_weight, float eps, TensorView core,
                                TensorView out) {
  KILN_CHECK(core.ndim() == 3, "gated_delta_rule_norm: core {}", core.shape.str());
  const Shape rows{core.dim(0) * core.dim(1), core.dim(2)};
  KILN_CHECK(z.shape == rows && out.shape == rows, "gated_delta_rule_norm: z {} out {} for core {}", z.shape.str(),
             out.shape.str(), core.shape.str());
  gated_delta_rule_with_gates(q, k, v, a, b, A_log, dt_bias, g, beta, state, step, mode, core);
  gated_rms_norm(reshaped(core, rows), z, norm_weight, eps, out);
}

void Ops::moe_experts_shared(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                             std::span<const ExpertWeights> experts, TensorView shared, const TensorView& shared_gate,
                             TensorView out) {
  moe_experts(x, expert_ids, weights, experts, out);
  sigmoid_mul(shared, shared_gate, shared);
  add(out, shared, out);
}

void Ops::moe_route_experts(const TensorView& x, const TensorView& logits, int top_k, bool renormalise,
                            std::span<const ExpertWeights> experts, TensorView shared, const TensorView& shared_gate,
                            TensorView expert_ids, TensorView weights, TensorView out) {
  moe_route(logits, top_k, renormalise, expert_ids, weights);
  if (shared.data) moe_experts_shared(x, expert_ids, weights, experts, shared, shared_gate, out);
  else moe_experts(x, expert_ids, weights, experts, out);
}

void Ops::layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias, float eps,
                     TensorView out) {
  (void)x, (void)weight, (void)bias, (void)eps, (void)out;
  fail("layer_norm is not implemented on the {} backend (needed by the vision encoder)", name());
}

void Ops::gelu(const TensorView& x, GeluKind kind, TensorView out) {
  (void)x, (void)kind, (void)out;
  fail("gelu is not implemented on the {} backend (needed by the vision encoder)", name());
}

void Ops::rope_cos_sin(TensorView x, const TensorView& cos, const TensorView& sin) {
  (void)x, (void)cos, (void)sin;
  fail("rope_cos_sin is not implemented on the {} backend (needed by the vision encoder)", name());
}

void Ops::attention_segments(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& cu_seqlens, int64_t max_seqlen, float scale, TensorView out) {
  (void)q, (void)k, (void)v, (void)cu_seqlens, (void)max_seqlen, (void)scale, (void)out;
  fail("attention_segments is not implemented on the {} backend (needed by the vision encoder)", name());
}

void Ops::weighted_embedding(const TensorView& table, const TensorView& ids, const TensorView& weights,
                             TensorView out) {
  (void)table, (void)ids, (void)weights, (void)out;
  fail("weighted_embedding is not implemented on the {} backend (needed by the vision encoder)", name());
}

void Ops::argmax_rows(const TensorView& logits, std::span<int32_t> ids) {
  std::vector<float> values(ids.size());
  argmax_rows_best(logits, ids, values);
}

void Ops::argmax_rows_best(const TensorView& logits, std::span<int32_t> ids, std::span<float> values) {
  KILN_CHECK(logits.ndim() == 2 && logits.dtype == DType::F32 && static_cast<int64_t>(ids.size()) == logits.dim(0) &&
                 values.size() == ids.size(),
             "argmax_rows_best: logits {} for {} ids, {} values", logits.shape.str(), ids.size(), values.size());
  const int64_t R = logits.dim(0), V = logits.dim(1);
  std::vector<float> host(static_cast<size_t>(R * V));
  download(logits, host.data());
  for (int64_t r = 0; r < R; ++r) {
    const float* row = host.data() + r * V;
    const int32_t id = host_argmax(row, V);
    ids[static_cast<size_t>(r)] = id;
    values[static_cast<size_t>(r)] = row[id];  // NaN when the whole row is (host_argmax gives 0 then)
  }
}

void Ops::argmax_rows_into(const TensorView& logits, TensorView ids, int32_t id_offset) {
  KILN_CHECK(logits.ndim() == 2 && logits.dtype == DType::F32 && ids.dtype == DType::I32 && ids.is_contiguous() &&
                 ids.numel() == logits.dim(0),
             "argmax_rows_into: logits {} for ids {} {}", logits.shape.str(), ids.shape.str(), dtype_name(ids.dtype));
  std::vector<int32_t> host(static_cast<size_t>(ids.numel()));
  argmax_rows(logits, host);
  for (int32_t& id : host) id += id_offset;
  copy(upload(host.data(), DType::I32, ids.shape), ids);
}

void Ops::sample_rows(const TensorView& logits, std::span<const RowSampling> rows, std::span<int32_t> ids) {
  KILN_CHECK(logits.ndim() == 2 && logits.dtype == DType::F32 && static_cast<int64_t>(ids.size()) == logits.dim(0) &&
                 rows.size() == ids.size(),
             "sample_rows: logits {} for {} ids, {} rows", logits.shape.str(), ids.size(), rows.size());
  const int64_t R = logits.dim(0), V = logits.dim(1);
  std::vector<float> host(static_cast<size_t>(R * V));
  download(logits, host.data());
  SampleScratch scratch;
  for (int64_t r = 0; r < R; ++r)
    ids[static_cast<size_t>(r)] = sample_row_host(host.data() + r * V, V, rows[static_cast<size_t>(r)], scratch);
}

}  // namespace kiln::model
