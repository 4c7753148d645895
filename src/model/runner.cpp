#include "model/runner.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "model/blocks.h"
#include "model/mtp.h"

namespace kiln::model {

namespace {
// The most tokens per sequence of a pass that is captured as a CUDA graph (a verify pass of up to 7 drafts).
constexpr int64_t kGraphMaxTokensPerSeq = 8;

// A chunk with prefix-cache snapshots (SeqChunk::snapshots) of at most this many tokens runs whole in one pass that
// writes them as position checkpoints (its delta rule then runs as the recurrence, which the chunked form replaces
// from kChunkedDeltaMinTokens = 32 tokens on: a short prompt tail costs little either way). A longer one runs up to
// its first snapshot as ordinary passes and a state copy; when the rest is this short and holds its other snapshots
// (a prompt's second-to-last and last page boundaries are a page apart), the rest is one such pass, else passes that
// end at each snapshot, each followed by a copy.
constexpr int64_t kSnapshotInPassMaxTokens = 64;

// Rows [begin, begin + n) of a contiguous [R, H] view.
TensorView row_range(const TensorView& t, int64_t begin, int64_t n) {
  return TensorView(static_cast<char*>(t.data) + begin * t.shape.dims[1] * static_cast<int64_t>(dtype_size(t.dtype)),
                    t.dtype, Shape{n, t.shape.dims[1]});
}
}  // namespace

Runner::Runner(std::unique_ptr<Ops> ops, const format::ModelDir& dir, const RunnerOptions& options)
    : ops_(std::move(ops)), options_(options) {
  model_ = load_model(dir, *ops_, options_.load_format, options_.shard ? &*options_.shard : nullptr, options_.mtp,
                      options_.vision);
  const auto& c = model_->config;
  if (options_.kv_dtype != DType::BF16 && options_.kv_dtype != DType::F32 && options_.kv_dtype != DType::F8_E4M3)
    fail("KV cache dtype {} is not supported (BF16, F32 or F8_E4M3)", dtype_name(options_.kv_dtype));
  if (options_.page_size <= 0 || options_.state_slots <= 0 || options_.prefill_chunk <= 0)
    fail("runner options: page_size, state_slots and prefill_chunk must be positive");
  if (options_.max_context <= 0) options_.max_context = c.max_position_embeddings;
  if (options_.kv_pages <= 0)
    options_.kv_pages = options_.state_slots * ((options_.max_context + options_.page_size - 1) / options_.page_size);

  const int64_t Hkv = c.num_kv_heads, D = c.head_dim;
  const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim, Kc = c.linear_conv_kernel;
  const int64_t C = 2 * Hk * Dk + Hv * Dv;
  const DType state_dtype = ops_->recurrent_state_dtype();  // F32, or BF16 where the backend keeps it so
  if (state_dtype != DType::F32 && state_dtype != DType::BF16)
    fail("recurrent state dtype {} is not supported (F32 or BF16)", dtype_name(state_dtype));
  kv_index_.assign(c.num_layers, -1);
  linear_index_.assign(c.num_layers, -1);
  // With an MTP head every state tensor has a spare row per slot after the live ones: save_state's checkpoints, or a
  // forward call's position checkpoints.
  spare_rows_ = model_->weights.has_mtp ? options_.state_slots : 0;
  const int64_t state_rows = options_.state_slots + spare_rows_;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.layer_is_full_attention(l)) {
      kv_index_[l] = static_cast<int>(kv_.size());
      KvLayerView v;
      v.k = ops_->allocate(options_.kv_dtype, Shape{options_.kv_pages, options_.page_size, Hkv, D});
      v.v = ops_->allocate(options_.kv_dtype, Shape{options_.kv_pages, options_.page_size, Hkv, D});
      const AttentionWeights& aw = model_->weights.layers[l].attn;
      if (options_.kv_dtype == DType::F8_E4M3) {
        // 0 = not known yet: taken from the first chunk stored in this layer (full_attention()).
        v.k_scale = aw.k_scale;
        v.v_scale = aw.v_scale;
      }
      kv_.push_back(v);
    } else {
      linear_index_[l] = static_cast<int>(conv_state_.size());
      conv_state_.push_back(ops_->allocate(DType::F32, Shape{state_rows, C, Kc - 1}));
      recurrent_state_.push_back(ops_->allocate(state_dtype, Shape{state_rows, Hv, Dk, Dv}));
    }
  }
  if (model_->weights.has_mtp) {
    // The MTP head's layer (index num_layers): its KV cache in the same pages, and the rows its hidden-state inputs
    // are gathered from.
    const int L = c.num_layers;
    kv_index_.push_back(static_cast<int>(kv_.size()));
    linear_index_.push_back(-1);
    KvLayerView v;
    v.k = ops_->allocate(options_.kv_dtype, Shape{options_.kv_pages, options_.page_size, Hkv, D});
    v.v = ops_->allocate(options_.kv_dtype, Shape{options_.kv_pages, options_.page_size, Hkv, D});
    if (options_.kv_dtype == DType::F8_E4M3) {
      v.k_scale = model_->weights.mtp.layer.attn.k_scale;
      v.v_scale = model_->weights.mtp.layer.attn.v_scale;
    }
    kv_.push_back(v);
    // A runner that picks whole-vocabulary ids can carry drafts (forward_argmax_carry): each slot keeps the head's
    // output of up to kGraphMaxTokensPerSeq logits rows of its last chunk.
    carry_rows_per_slot_ = model_->weights.vocab_parallel ? 0 : kGraphMaxTokensPerSeq;
    carry_row0_ = state_rows + options_.prefill_chunk;
    mtp_rows_ = ops_->allocate(DType::F32, Shape{carry_row0_ + options_.state_slots * carry_rows_per_slot_,
                                                 c.hidden_size});
    chain_ids_ = ops_->allocate(DType::I32, Shape{kGraphMaxTokensPerSeq * options_.state_slots});
    ops_->fill_zero(chain_ids_);
    ops_->fill_zero(mtp_rows_);
    (void)L;
  }
  if (options_.kv_dtype == DType::F8_E4M3 && !kv_.empty()) {
    const bool from_ckpt = kv_.front().k_scale > 0 && kv_.front().v_scale > 0;
    if (from_ckpt)
      KILN_LOG_INFO("FP8 KV cache: using the checkpoint's k_scale / v_scale");
    else
      KILN_LOG_WARN("FP8 KV cache: the checkpoint has no k_scale / v_scale; scales will be computed from the "
                    "first prompt chunk of each layer (use a BF16 KV cache for full accuracy)");
  }
  capacity_.kv_pages = options_.kv_pages;
  capacity_.page_size = options_.page_size;
  capacity_.state_slots = options_.state_slots;
  capacity_.max_context = options_.max_context;
  capacity_.kv_bytes_per_token =
      static_cast<int64_t>(kv_.size()) * 2 * Hkv * D * static_cast<int64_t>(dtype_size(options_.kv_dtype));
  capacity_.state_bytes_per_slot =
      static_cast<int64_t>(conv_state_.size()) * (spare_rows_ > 0 ? 2 : 1) *
      (C * (Kc - 1) * 4 + Hv * Dk * Dv * static_cast<int64_t>(dtype_size(state_dtype)));
}

Runner::~Runner() = default;

std::string Runner::describe() const {
  const auto& w = model_->weights;
  return fmt::format(
      "{} | {} ({} layers) | weights: dense {:.1f} MB, fp8 {:.1f} MB, nvfp4 {:.1f} MB | KV {} x {} pages of {} "
      "tokens ({} B/token) | {} state slots ({:.2f} MB each{}) | prefill chunk {}{}",
      ops_->describe(), format::arch_name(model_->config.arch), model_->config.num_layers, w.bytes_by_format[0] / 1e6,
      w.bytes_by_format[1] / 1e6, w.bytes_by_format[2] / 1e6, dtype_name(options_.kv_dtype), capacity_.kv_pages,
      capacity_.page_size, capacity_.kv_bytes_per_token, capacity_.state_slots, capacity_.state_bytes_per_slot / 1e6,
      recurrent_state_.empty() ? "" : fmt::format(", {} recurrent", dtype_name(recurrent_state_.front().dtype)),
      options_.prefill_chunk, w.has_mtp ? " | MTP head (KV in the same pages, position checkpoints)" : "") +
      (options_.summary.empty() ? std::string() : " | " + options_.summary);
}

std::vector<std::pair<float, float>> Runner::kv_scales() const {
  std::vector<std::pair<float, float>> out;
  for (const auto& v : kv_) out.emplace_back(v.k_scale, v.v_scale);
  return out;
}

void Runner::reset_slot(int slot) {
  for (size_t i = 0; i < conv_state_.size(); ++i) {
    ops_->fill_zero(conv_state_[i].row(slot));
    ops_->fill_zero(recurrent_state_[i].row(slot));
  }
}

void Runner::copy_state(int src_slot, int dst_slot) {
  if (src_slot < 0 || src_slot >= options_.state_slots || dst_slot < 0 || dst_slot >= options_.state_slots)
    fail("copy_state: slots {} -> {} outside [0, {})", src_slot, dst_slot, options_.state_slots);
  copy_state_row(src_slot, dst_slot);
}

void Runner::copy_state_row(int64_t src, int64_t dst) {
  std::vector<Ops::CopySpan> spans;
  state_row_spans(src, dst, spans);
  ops_->copy_spans(spans);
}

void Runner::state_row_spans(int64_t src, int64_t dst, std::vector<Ops::CopySpan>& spans) const {
  if (src == dst) return;
  // Byte copies on the backend's stream. The recurrent slots may be BF16 (Ops::recurrent_state_dtype): their bytes
  // move as they are. Every row is contiguous (a slot's row of each state tensor, the MTP head's hidden row).
  auto add = [&](const TensorView& t) {
    const TensorView a = t.row(src), b = t.row(dst);
    KILN_CHECK(a.is_contiguous() && b.is_contiguous(), "state rows must be contiguous");
    spans.push_back({a.data, b.data, a.nbytes()});
  };
  for (size_t i = 0; i < conv_state_.size(); ++i) {
    add(conv_state_[i]);
    add(recurrent_state_[i]);
  }
  if (mtp_rows_.data) add(mtp_rows_);
}

void Runner::save_state(int slot) { copy_checkpoint(slot, /*save=*/true); }

void Runner::restore_state(int slot) { copy_checkpoint(slot, /*save=*/false); }

void Runner::copy_checkpoint(int slot, bool save) {
  const char* what = save ? "save_state" : "restore_state";
  if (spare_rows_ == 0) fail("{}: the runner keeps no state checkpoints (no MTP head)", what);
  if (slot < 0 || slot >= options_.state_slots) fail("{}: slot {} outside [0, {})", what, slot, options_.state_slots);
  // The checkpoint is the slot's spare row. The head's input for the slot's next entry (its last hidden state)
  // belongs to it too: a replay after a rejected draft starts its head entries from it.
  const int64_t spare = options_.state_slots + slot;
  if (save)
    copy_state_row(slot, spare);
  else
    copy_state_row(spare, slot);
}

void Runner::keep_verified(int slot, int tokens) {
  const VerifiedRow row{slot, tokens};
  keep_verified_rows({&row, 1});
}

void Runner::keep_verified_rows(std::span<const VerifiedRow> rows) {
  // Every row checked before anything moves; then one copy_spans for all of them.
  for (const VerifiedRow& r : rows) {
    const auto it = kept_.find(r.slot);
    if (it == kept_.end())
      fail("keep_verified: the last forward call kept no position checkpoints for slot {}", r.slot);
    const int n = static_cast<int>(it->second.size()) + 1;
    if (r.tokens < 1 || r.tokens > n) fail("keep_verified: {} tokens of a chunk of {}", r.tokens, n);
  }
  std::vector<Ops::CopySpan> spans;
  for (const VerifiedRow& r : rows) {
    const auto it = kept_.find(r.slot);
    if (it == kept_.end()) fail("keep_verified: slot {} given twice", r.slot);
    const int n = static_cast<int>(it->second.size()) + 1;
    if (r.tokens < n) state_row_spans(it->second[static_cast<size_t>(r.tokens - 1)], r.slot, spans);
    kept_.erase(it);
  }
  ops_->copy_spans(spans);
}

void Runner::draft(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens, std::span<float> logits) {
  if (model_->weights.vocab_parallel && !options_.lone_rank)
    fail("draft on one tensor-parallel rank (its logits are a slice)");
  const int64_t S = static_cast<int64_t>(seqs.size()), V = logits_width();
  if (steps >= 1 && static_cast<int64_t>(tokens.size()) < S * steps)
    fail("draft: {} ids for {} x {} drafts", tokens.size(), S, steps);
  if (!logits.empty() && static_cast<int64_t>(logits.size()) < S * steps * V)
    fail("draft: logits buffer holds {} floats, {} rows of {} needed", logits.size(), S * steps, V);
  const bool carried = !seqs.empty() && seqs.front().carried_row >= 0;
  for (const DraftSeq& d : seqs)
    if ((d.carried_row >= 0) != carried) fail("draft: sequences with and without carried first drafts in one call");
  if (carried) {
    if (!logits.empty()) fail("draft: no logits for carried first drafts (they ran in the step that carried them)");
    draft_carried(seqs, steps, tokens);
    return;
  }
  if (logits.empty()) {
    draft_device(seqs, steps, tokens);
    return;
  }
  // The logits asked for: each step's rows come back to the host, and so do its ids.
  const int32_t id0 = static_cast<int32_t>(model_->weights.vocab_begin);  // a lone rank's slice; else 0
  draft_chain(seqs, steps, [&](int k, const TensorView& out, std::span<int32_t> chosen) {
    std::vector<float> host(static_cast<size_t>(S * V));
    ops_->download(out, host.data());
    for (int64_t s = 0; s < S; ++s)
      std::memcpy(logits.data() + (s * steps + k) * V, host.data() + s * V, static_cast<size_t>(V) * sizeof(float));
    std::vector<int32_t> ids(static_cast<size_t>(S));
    ops_->argmax_rows(out, ids);
    for (int64_t s = 0; s < S; ++s) {
      chosen[s] = id0 + ids[s];
      tokens[static_cast<size_t>(s * steps + k)] = chosen[s];
    }
  });
}

void Runner::draft_rank(std::span<const DraftSeq> seqs, int steps, const DraftPick& pick,
                        const DraftLogits& logits_slice) {
  const int64_t S = static_cast<int64_t>(seqs.size()), V = logits_width();
  const int32_t id0 = static_cast<int32_t>(model_->weights.vocab_begin);
  draft_chain(seqs, steps, [&](int k, const TensorView& out, std::span<int32_t> chosen) {
    if (logits_slice) {
      std::vector<float> host(static_cast<size_t>(S * V));
      ops_->download(out, host.data());
      for (int64_t s = 0; s < S; ++s) logits_slice(k, s, std::span<const float>(host.data() + s * V, V));
    }
    std::vector<int32_t> ids(static_cast<size_t>(S));
    std::vector<float> values(static_cast<size_t>(S));
    ops_->argmax_rows_best(out, ids, values);
    for (int32_t& id : ids) id += id0;
    pick(k, ids, values, chosen);
  });
}

void Runner::draft_carried(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens) {
  if (steps < 1) fail("draft: {} steps (at least 1)", steps);
  const int64_t S = static_cast<int64_t>(seqs.size());
  std::vector<DraftSeq> next;
  std::vector<int32_t> hidden_rows;
  carried_chain_inputs(seqs, next, hidden_rows);
  for (int64_t s = 0; s < S; ++s) tokens[static_cast<size_t>(s * steps)] = seqs[s].first_draft;
  if (steps == 1) return;
  std::vector<int32_t> rest(static_cast<size_t>(S * (steps - 1)));
  draft_device(next, steps - 1, rest, hidden_rows);
  for (int64_t s = 0; s < S; ++s)
    for (int k = 1; k < steps; ++k)
      tokens[static_cast<size_t>(s * steps + k)] = rest[static_cast<size_t>(s * (steps - 1) + k - 1)];
}

void Runner::carried_chain_inputs(std::span<const DraftSeq> seqs, std::vector<DraftSeq>& next,
                                  std::vector<int32_t>& hidden_rows) const {
  if (!can_carry_drafts()) fail("draft: this runner carries no first drafts");
  // The chain goes on from the carried entry: step 2 runs at the pending token's position with the first draft and
  // the carried entry's head output (kept in the slot's carry row).
  next.assign(seqs.begin(), seqs.end());
  hidden_rows.resize(seqs.size());
  for (size_t s = 0; s < seqs.size(); ++s) {
    const DraftSeq& d = seqs[s];
    if (d.carried_row < 0 || d.carried_row >= carry_rows_per_slot_)
      fail("draft: carried row {} (a slot keeps {})", d.carried_row, carry_rows_per_slot_);
    if (d.first_draft < 0 || d.first_draft >= model_->config.vocab_size)
      fail("draft: carried first draft {} outside the vocabulary", d.first_draft);
    if (d.state_slot < 0 || d.state_slot >= options_.state_slots)
      fail("draft: state slot {} out of range [0, {})", d.state_slot, options_.state_slots);
    next[s].token = d.first_draft;
    next[s].pos = d.pos + 1;
    hidden_rows[s] = static_cast<int32_t>(carry_row0_ + d.state_slot * carry_rows_per_slot_ + d.carried_row);
  }
}

void Runner::draft_deferred(std::span<const DraftSeq> seqs, int steps) {
  const int64_t S = static_cast<int64_t>(seqs.size());
  if (S == 0) fail("draft_deferred: no sequences");
  if (steps < 2) fail("draft_deferred: {} steps (a carried first draft and at least one chain step)", steps);
  if ((steps - 1) * S > chain_ids_.numel())
    fail("draft_deferred: {} sequences x {} chain steps (at most {} ids)", S, steps - 1, chain_ids_.numel());
  std::vector<DraftSeq> next;
  std::vector<int32_t> hidden_rows;
  carried_chain_inputs(seqs, next, hidden_rows);
  draft_device(next, steps - 1, {}, hidden_rows, /*defer=*/true);
}

int Runner::check_draft(std::span<const DraftSeq> seqs, int steps) const {
  if (!model_->weights.has_mtp) fail("draft: the model has no MTP head");
  if (seqs.empty()) return 0;
  if (steps < 1) fail("draft: {} steps (at least 1)", steps);
  const auto& c = model_->config;
  std::vector<int> slots;
  int max_pages = 1;
  for (const DraftSeq& d : seqs) {
    if (d.state_slot < 0 || d.state_slot >= options_.state_slots)
      fail("draft: state slot {} out of range [0, {})", d.state_slot, options_.state_slots);
    if (std::find(slots.begin(), slots.end(), d.state_slot) != slots.end())
      fail("draft: two sequences use state slot {}", d.state_slot);
    slots.push_back(d.state_slot);
    if (d.pos < 1 || d.pos - 1 + steps > options_.max_context)
      fail("draft: positions [{}, {}) outside the context [1, {}]", d.pos - 1, d.pos - 1 + steps, options_.max_context);
    if (d.token < 0 || d.token >= c.vocab_size) fail("draft: token id {} outside the vocabulary", d.token);
    const int64_t pages = (d.pos - 1 + steps + options_.page_size - 1) / options_.page_size;
    if (static_cast<int64_t>(d.page_table.size()) < pages)
      fail("draft: page table has {} pages, positions up to {} need {}", d.page_table.size(), d.pos - 1 + steps, pages);
    for (int64_t p = 0; p < pages; ++p)
      if (d.page_table[p] < 0 || d.page_table[p] >= options_.kv_pages)
        fail("draft: page id {} out of range [0, {})", d.page_table[p], options_.kv_pages);
    max_pages = std::max<int>(max_pages, static_cast<int>(pages));
  }
  return max_pages;
}

Runner::DraftInputs Runner::upload_draft(std::span<const DraftSeq> seqs, int steps, int pages_per_seq,
                                         std::span<const int32_t> hidden_rows) {
  const int64_t S = static_cast<int64_t>(seqs.size()), P = pages_per_seq;
  // One host block, one upload. Its sections (each on a 256-byte boundary): the token ranges [S + 1] and the state
  // slots [S] (also the rows of mtp_rows_ holding each sequence's last hidden state), shared by every step; the page
  // tables [S, P] (every page the chain's positions reach: a step reads none past its own position); the positions
  // [steps, S] (step k's entries run at pos - 1 + k: its token_pos and seq_start_pos alike); the pending tokens [S].
  auto padded = [](int64_t n) { return (n + 63) / 64 * 64; };
  // Sequences with images add their M-RoPE positions [steps, S, 3]: text positions shifted by the rope delta.
  bool any_delta = false;
  for (const DraftSeq& d : seqs) any_delta = any_delta || d.rope_delta != 0;
  const int64_t o_slot = padded(S + 1), o_pages = o_slot + padded(S), o_pos = o_pages + padded(S * P),
                o_ids = o_pos + padded(steps * S), o_hid = o_ids + padded(S), o_mrope = o_hid + padded(S),
                n = o_mrope + (any_delta ? padded(steps * S * 3) : 0);
  std::vector<int32_t> blob(static_cast<size_t>(n), 0);
  std::fill(blob.begin() + o_pages, blob.begin() + o_pages + S * P, -1);
  for (int64_t s = 0; s < S; ++s) {
    const DraftSeq& d = seqs[s];
    blob[static_cast<size_t>(s + 1)] = static_cast<int32_t>(s + 1);
    blob[static_cast<size_t>(o_slot + s)] = d.state_slot;
    const int64_t pages = (d.pos - 1 + steps + options_.page_size - 1) / options_.page_size;
    for (int64_t p = 0; p < pages; ++p) blob[static_cast<size_t>(o_pages + s * P + p)] = d.page_table[p];
    for (int k = 0; k < steps; ++k) blob[static_cast<size_t>(o_pos + k * S + s)] = static_cast<int32_t>(d.pos - 1 + k);
    blob[static_cast<size_t>(o_ids + s)] = d.token;
    blob[static_cast<size_t>(o_hid + s)] = hidden_rows.empty() ? d.state_slot : hidden_rows[static_cast<size_t>(s)];
    if (any_delta)
      for (int k = 0; k < steps; ++k)
        for (int a = 0; a < 3; ++a)
          blob[static_cast<size_t>(o_mrope + (k * S + s) * 3 + a)] = static_cast<int32_t>(d.pos - 1 + k + d.rope_delta);
  }
  const TensorView dev = ops_->upload(blob.data(), DType::I32, Shape{n});
  auto view = [&](int64_t offset, Shape shape) {
    return TensorView(static_cast<int32_t*>(dev.data) + offset, DType::I32, shape);
  };
  auto host = [&](int64_t offset, int64_t count) {
    return std::vector<int32_t>(blob.begin() + offset, blob.begin() + offset + count);
  };
  DraftInputs in;
  in.steps.resize(static_cast<size_t>(steps));
  for (int k = 0; k < steps; ++k) {
    StepLayout& st = in.steps[static_cast<size_t>(k)];
    st.num_tokens = S;
    st.num_seqs = static_cast<int>(S);
    st.page_size = options_.page_size;
    st.max_pages_per_seq = pages_per_seq;
    st.token_pos = view(o_pos + k * S, Shape{S});
    st.seq_token_begin = view(0, Shape{S + 1});
    st.seq_start_pos = st.token_pos;
    st.seq_state_slot = view(o_slot, Shape{S});
    st.page_table = view(o_pages, Shape{S, P});
    st.host_token_pos = host(o_pos + k * S, S);
    st.host_seq_token_begin = host(0, S + 1);
    st.host_seq_start_pos = st.host_token_pos;
    st.host_seq_state_slot = host(o_slot, S);
    st.host_page_table = host(o_pages, S * P);
    if (any_delta) {
      st.token_mrope_pos = view(o_mrope + k * S * 3, Shape{S, 3});
      st.host_token_mrope_pos = host(o_mrope + k * S * 3, S * 3);
    }
  }
  in.first_ids = view(o_ids, Shape{S});
  in.slot_rows = view(o_slot, Shape{S});
  in.hidden_rows = view(o_hid, Shape{S});
  return in;
}

void Runner::draft_body(const DraftInputs& in, const std::function<TensorView(int, const TensorView&)>& pick) {
  const auto& c = model_->config;
  Ops& ops = *ops_;
  const int64_t S = in.first_ids.numel(), V = logits_width();
  TensorView hidden = ops.scratch(DType::F32, Shape{S, c.hidden_size});
  ops.gather_rows(mtp_rows_, in.hidden_rows, hidden);
  TensorView ids = in.first_ids;
  for (size_t k = 0; k < in.steps.size(); ++k) {
    Forward f{ops, c, in.steps[k], kv_, kv_index_, conv_state_, recurrent_state_, linear_index_,
              options_.prefill_delta_rule, trace_ ? &trace_ : nullptr};
    TensorView g = mtp_forward(f, model_->weights, *model_->family, c.num_layers, ids, hidden);
    TensorView out = f.f32(Shape{S, V});
    ops.linear(g, model_->weights.lm_head, out);
    ids = pick(static_cast<int>(k), out);
    hidden = g;
  }
}

std::vector<float> Runner::encode_image(std::span<const float> pixel_values, int64_t grid_t, int64_t grid_h,
                                       int64_t grid_w) {
  if (!model_->vision) return ModelRunner::encode_image(pixel_values, grid_t, grid_h, grid_w);
  const format::VisionConfig& v = model_->full_config.vision;
  const ImageGrid grid{grid_t, grid_h, grid_w};
  if (grid_t < 1 || grid_h < 1 || grid_w < 1 || grid_h % v.spatial_merge_size || grid_w % v.spatial_merge_size)
    fail("encode_image: a grid of {} x {} x {} patches (each side a multiple of the merge size {})", grid_t, grid_h,
         grid_w, v.spatial_merge_size);
  if (static_cast<int64_t>(pixel_values.size()) != grid.patches() * v.patch_dim())
    fail("encode_image: {} pixel values for {} patches of {}", pixel_values.size(), grid.patches(), v.patch_dim());
  Ops& ops = *ops_;
  ops.reset_scratch();
  const TensorView px = ops.upload(pixel_values.data(), DType::F32, Shape{grid.patches(), v.patch_dim()});
  const TensorView out = vision_forward(ops, *model_->vision, v, px, std::span<const ImageGrid>(&grid, 1));
  std::vector<float> host(static_cast<size_t>(out.numel()));
  ops.download(out, host.data());
  return host;
}

void Runner::draft_chain(std::span<const DraftSeq> seqs, int steps,
                         const std::function<void(int, const TensorView&, std::span<int32_t>)>& next) {
  const int pages = check_draft(seqs, steps);
  if (seqs.empty()) return;
  Ops& ops = *ops_;
  ops.reset_scratch();
  const DraftInputs in = upload_draft(seqs, steps, pages);
  std::vector<int32_t> chosen(seqs.size());
  draft_body(in, [&](int k, const TensorView& logits) {
    next(k, logits, chosen);
    return ops.upload(chosen.data(), DType::I32, Shape{static_cast<int64_t>(chosen.size())});
  });
}

void Runner::draft_device(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens,
                          std::span<const int32_t> hidden_rows, bool defer) {
  deferred_seqs_ = deferred_steps_ = 0;
  int pages = check_draft(seqs, steps);
  if (seqs.empty()) return;
  const int64_t S = static_cast<int64_t>(seqs.size());
  // A chain of decode-sized steps is captured once per shape (sequences, pages per sequence rounded up as run_pass
  // rounds them, steps) and replayed: its inputs are all uploaded before the compute, and each step's ids stay on the
  // device.
  const bool graphable =
      !trace_ && graphs_enabled_ && options_.graph_max_batch > 0 && S <= options_.graph_max_batch;
  if (graphable) pages = graph_pages(pages);
  Ops& ops = *ops_;
  ops.reset_scratch();
  const DraftInputs in = upload_draft(seqs, steps, pages, hidden_rows);
  // Row k: step k's picks; in chain_ids_ where they fit (a deferred chain's must).
  const bool in_chain_ids = chain_ids_.data && steps * S <= chain_ids_.numel();
  KILN_CHECK(in_chain_ids || !defer, "draft_device: a deferred chain of {} x {} ids", steps, S);
  const TensorView ids =
      in_chain_ids ? TensorView(chain_ids_.data, DType::I32, Shape{steps, S}) : ops.scratch(DType::I32, Shape{steps, S});
  const int32_t id0 = static_cast<int32_t>(model_->weights.vocab_begin);  // a lone rank's slice; else 0
  GraphKey key{static_cast<int>(S), pages, 1, false, steps};
  for (const DraftSeq& d : seqs) key.mrope = key.mrope || d.rope_delta != 0;
  const TensorView out = run_graphed(graphable, key, [&] {
    draft_body(in, [&](int k, const TensorView& logits) {
      TensorView row = ids.row(k);
      ops.argmax_rows_into(logits, row, id0);
      return row;
    });
    return ids;
  });
  if (defer) {  // the ids stay where they are for the next forward_argmax_carry
    deferred_seqs_ = S;
    deferred_steps_ = steps;
    return;
  }
  std::vector<int32_t> host(static_cast<size_t>(S * steps));
  ops.download(out, host.data());
  for (int64_t s = 0; s < S; ++s)
    for (int k = 0; k < steps; ++k)
      tokens[static_cast<size_t>(s * steps + k)] = host[static_cast<size_t>(k * S + s)];
}

int64_t Runner::check_chunks(std::span<const SeqChunk> chunks) const {
  const int64_t V = model_->config.vocab_size;
  int64_t rows = 0;
  std::vector<int> slots;
  for (const SeqChunk& ch : chunks) {
    if (ch.tokens.empty()) fail("forward: a chunk has no tokens");
    if (ch.state_slot < 0 || ch.state_slot >= options_.state_slots)
      fail("forward: state slot {} out of range [0, {})", ch.state_slot, options_.state_slots);
    if (std::find(slots.begin(), slots.end(), ch.state_slot) != slots.end())
      fail("forward: two chunks use state slot {} in one step", ch.state_slot);
    slots.push_back(ch.state_slot);
    const int64_t end = ch.start_pos + static_cast<int64_t>(ch.tokens.size());
    if (ch.start_pos < 0 || end > options_.max_context)
      fail("forward: positions [{}, {}) exceed the context limit {}", ch.start_pos, end, options_.max_context);
    const int64_t pages_needed = (end + options_.page_size - 1) / options_.page_size;
    if (!kv_.empty() && static_cast<int64_t>(ch.page_table.size()) < pages_needed)
      fail("forward: page table has {} pages, positions up to {} need {}", ch.page_table.size(), end, pages_needed);
    for (int64_t p = 0; p < pages_needed && !kv_.empty(); ++p)
      if (ch.page_table[p] < 0 || ch.page_table[p] >= options_.kv_pages)
        fail("forward: page id {} out of range [0, {})", ch.page_table[p], options_.kv_pages);
    for (int32_t t : ch.tokens)
      if (t < 0 || t >= V) fail("forward: token id {} outside the vocabulary [0, {})", t, V);
    if (!ch.mrope_pos.empty() && ch.mrope_pos.size() != 3 * ch.tokens.size())
      fail("forward: {} M-RoPE positions for a chunk of {} tokens (3 each)", ch.mrope_pos.size(), ch.tokens.size());
    if (!ch.embed_offsets.empty()) {
      const int64_t H = model_->config.hidden_size;
      if (static_cast<int64_t>(ch.embeds.size()) != static_cast<int64_t>(ch.embed_offsets.size()) * H)
        fail("forward: {} embedding values for {} rows of {}", ch.embeds.size(), ch.embed_offsets.size(), H);
      for (size_t i = 0; i < ch.embed_offsets.size(); ++i)
        if (ch.embed_offsets[i] < 0 || ch.embed_offsets[i] >= static_cast<int32_t>(ch.tokens.size()) ||
            (i > 0 && ch.embed_offsets[i] <= ch.embed_offsets[i - 1]))
          fail("forward: embedding offsets must ascend within the chunk's {} tokens", ch.tokens.size());
    }
    if (ch.want_logits) {
      if (ch.logits_tokens < 1 || ch.logits_tokens > static_cast<int64_t>(ch.tokens.size()))
        fail("forward: logits for the last {} of a chunk's {} tokens", ch.logits_tokens, ch.tokens.size());
      rows += ch.logits_tokens;
    }
  }
  return rows;
}

void Runner::forward(std::span<const SeqChunk> chunks, std::span<float> logits) {
  const int64_t V = logits_width();
  const int64_t rows = check_chunks(chunks);
  if (static_cast<int64_t>(logits.size()) < rows * V)
    fail("forward: logits buffer holds {} floats, {} rows of {} needed", logits.size(), rows, V);
  run_passes(chunks, [&](const TensorView& out, const std::vector<int64_t>& out_rows) {
    const int64_t R = static_cast<int64_t>(out_rows.size());
    std::vector<float> host(static_cast<size_t>(R * V));
    ops_->download(out, host.data());
    for (int64_t i = 0; i < R; ++i)
      std::memcpy(logits.data() + out_rows[i] * V, host.data() + i * V, static_cast<size_t>(V) * sizeof(float));
  });
}

void Runner::forward_argmax(std::span<const SeqChunk> chunks, std::span<int32_t> tokens) {
  if (model_->weights.vocab_parallel && !options_.lone_rank)
    fail("forward_argmax on one tensor-parallel rank (its logits are a slice)");
  const int64_t rows = check_chunks(chunks);
  if (static_cast<int64_t>(tokens.size()) < rows)
    fail("forward_argmax: token buffer holds {} ids, {} needed", tokens.size(), rows);
  const int32_t id0 = static_cast<int32_t>(model_->weights.vocab_begin);  // a lone rank's slice; else 0
  run_passes(chunks, [&](const TensorView& out, const std::vector<int64_t>& out_rows) {
    std::vector<int32_t> ids(out_rows.size());
    ops_->argmax_rows(out, ids);
    for (size_t i = 0; i < ids.size(); ++i) tokens[out_rows[i]] = id0 + ids[i];
  });
}

void Runner::forward_argmax_carry(std::span<const SeqChunk> chunks, std::span<int32_t> tokens,
                                  std::span<int32_t> next_drafts, std::span<int32_t> device_drafts) {
  if (!can_carry_drafts()) fail("forward_argmax_carry: this runner carries no drafts (no MTP head, or a rank)");
  const int64_t rows = check_chunks(chunks);
  if (static_cast<int64_t>(tokens.size()) < rows || static_cast<int64_t>(next_drafts.size()) < rows)
    fail("forward_argmax_carry: {} ids and {} next drafts for {} rows", tokens.size(), next_drafts.size(), rows);
  // Chunks that read a deferred chain's ids: that chain's row each, whole, carried (checked again per pass).
  std::vector<bool> row_taken(static_cast<size_t>(deferred_seqs_), false);
  for (const SeqChunk& ch : chunks) {
    if (ch.device_draft_row < 0) continue;
    if (ch.device_draft_row >= deferred_seqs_ || row_taken[static_cast<size_t>(ch.device_draft_row)])
      fail("forward_argmax_carry: chunk reads row {} of a deferred chain of {} sequences (each row once)",
           ch.device_draft_row, deferred_seqs_);
    row_taken[static_cast<size_t>(ch.device_draft_row)] = true;
    if (static_cast<int64_t>(ch.tokens.size()) != 2 + deferred_steps_ || !ch.want_logits ||
        ch.logits_tokens != static_cast<int>(ch.tokens.size()))
      fail("forward_argmax_carry: a chunk reading a deferred chain of {} steps is [pending, first draft, chain] with "
           "logits for all ({} tokens, {} logits rows)", deferred_steps_, ch.tokens.size(), ch.logits_tokens);
  }
  if (deferred_seqs_ > 0 && static_cast<int64_t>(device_drafts.size()) < deferred_seqs_ * deferred_steps_)
    fail("forward_argmax_carry: {} device drafts for a deferred chain of {} x {}", device_drafts.size(), deferred_seqs_,
         deferred_steps_);
  for (const SeqChunk& ch : chunks)
    if (ch.want_logits && ch.logits_tokens > carry_rows_per_slot_)
      fail("forward_argmax_carry: {} logits rows in a chunk (a slot carries at most {})", ch.logits_tokens,
           carry_rows_per_slot_);
  // Each pass's output: its rows' target ids, then their next drafts (I32 [2, R]), then the deferred chain's ids it
  // read (pass_deferred_out_: where each goes in device_drafts).
  carry_ = true;
  try {
    run_passes(chunks, [&](const TensorView& out, const std::vector<int64_t>& out_rows) {
      const size_t R = out_rows.size();
      std::vector<int32_t> ids(static_cast<size_t>(out.numel()));
      KILN_CHECK(ids.size() == 2 * R + pass_deferred_out_.size(), "forward_argmax_carry: {} ids back for {} rows",
                 ids.size(), R);
      ops_->download(out, ids.data());
      for (size_t i = 0; i < R; ++i) {
        tokens[static_cast<size_t>(out_rows[i])] = ids[i];
        next_drafts[static_cast<size_t>(out_rows[i])] = ids[R + i];
      }
      for (size_t i = 0; i < pass_deferred_out_.size(); ++i)
        device_drafts[static_cast<size_t>(pass_deferred_out_[i])] = ids[2 * R + i];
    });
  } catch (...) {
    carry_ = false;
    deferred_seqs_ = deferred_steps_ = 0;
    throw;
  }
  carry_ = false;
  deferred_seqs_ = deferred_steps_ = 0;
}

void Runner::forward_best(std::span<const SeqChunk> chunks, std::span<int32_t> ids, std::span<float> values) {
  const int64_t rows = check_chunks(chunks);
  if (static_cast<int64_t>(ids.size()) < rows || static_cast<int64_t>(values.size()) < rows)
    fail("forward_best: {} ids and {} values for {} rows", ids.size(), values.size(), rows);
  const int32_t id0 = static_cast<int32_t>(model_->weights.vocab_begin);  // the rank's slice; 0 unsharded
  run_passes(chunks, [&](const TensorView& out, const std::vector<int64_t>& out_rows) {
    std::vector<int32_t> pass_ids(out_rows.size());
    std::vector<float> pass_values(out_rows.size());
    ops_->argmax_rows_best(out, pass_ids, pass_values);
    for (size_t i = 0; i < out_rows.size(); ++i) {
      ids[static_cast<size_t>(out_rows[i])] = id0 + pass_ids[i];
      values[static_cast<size_t>(out_rows[i])] = pass_values[i];
    }
  });
}

void Runner::forward_sample(std::span<const SeqChunk> chunks, std::span<const RowSampling> rows,
                            std::span<int32_t> tokens) {
  if (model_->weights.vocab_parallel && !options_.lone_rank)
    fail("forward_sample on one tensor-parallel rank (its logits are a slice)");
  const int64_t n = check_chunks(chunks);
  if (static_cast<int64_t>(tokens.size()) < n || static_cast<int64_t>(rows.size()) < n)
    fail("forward_sample: {} ids and {} sampling rows for {} rows", tokens.size(), rows.size(), n);
  const int32_t id0 = static_cast<int32_t>(model_->weights.vocab_begin);  // a lone rank's slice; else 0
  run_passes(chunks, [&](const TensorView& out, const std::vector<int64_t>& out_rows) {
    std::vector<RowSampling> sub(out_rows.size());
    for (size_t i = 0; i < out_rows.size(); ++i) sub[i] = rows[static_cast<size_t>(out_rows[i])];
    std::vector<int32_t> ids(out_rows.size());
    ops_->sample_rows(out, sub, ids);
    for (size_t i = 0; i < ids.size(); ++i) tokens[out_rows[i]] = id0 + ids[i];
  });
}

void Runner::run_passes(std::span<const SeqChunk> chunks,
                        const std::function<void(const TensorView&, const std::vector<int64_t>&)>& emit) {
  // Passes of at most prefill_chunk tokens; a chunk longer than the budget continues in the next pass. A chunk that
  // keeps position checkpoints runs whole in one pass, and when the call also has longer chunks, the checkpoint
  // chunks and the one-token chunks go first, in passes of their own: such a pass runs the delta rule as the
  // recurrence, which keeps the checkpoints (a prompt's pass takes the chunked form).
  kept_.clear();
  spare_used_ = 0;
  std::vector<int64_t> done(chunks.size(), 0), logits_row(chunks.size(), -1);
  in_pass_from_.assign(chunks.size(), 0);
  int64_t r = 0;
  bool any_checkpoints = false, any_long = false, any_tail = false;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].want_logits) {
      logits_row[i] = r;
      r += chunks[i].logits_tokens;
    }
    const int64_t size = static_cast<int64_t>(chunks[i].tokens.size());
    const std::vector<ChunkSnapshot>& snaps = chunks[i].snapshots;
    int64_t prev = 0;
    for (const ChunkSnapshot& sn : snaps) {
      if (sn.tokens <= prev || sn.tokens >= size || sn.slot < 0 || sn.slot >= options_.state_slots ||
          sn.slot == chunks[i].state_slot)
        fail("forward: a snapshot after {} of a chunk's {} tokens into slot {} (slot {}, {} slots)", sn.tokens, size,
             sn.slot, chunks[i].state_slot, options_.state_slots);
      prev = sn.tokens;
    }
    if (!snaps.empty() && chunks[i].checkpoint_positions)
      fail("forward: a chunk with both position checkpoints and snapshots");
    // Where the chunk's in-pass part starts (see in_pass_from_): a short chunk whole; a long one's short tail after its
    // first snapshot, when more snapshots lie there (the prompt's second-to-last and last page boundaries: one pass
    // fewer); else none.
    const int64_t fits = std::min<int64_t>(kSnapshotInPassMaxTokens, options_.prefill_chunk);
    in_pass_from_[i] = size;
    if (!snaps.empty() && size <= fits) in_pass_from_[i] = 0;
    else if (snaps.size() >= 2 && size - snaps.front().tokens <= fits) in_pass_from_[i] = snaps.front().tokens;
    const bool whole_recurrent = chunks[i].checkpoint_positions || in_pass_from_[i] == 0;
    if (chunks[i].checkpoint_positions && spare_rows_ == 0)
      fail("forward: position checkpoints asked of a runner that keeps none");
    if (chunks[i].checkpoint_positions && size > options_.prefill_chunk)
      fail("forward: a chunk of {} tokens with position checkpoints is longer than a pass ({})", chunks[i].tokens.size(),
           options_.prefill_chunk);
    const bool tail = in_pass_from_[i] > 0 && in_pass_from_[i] < size;
    any_checkpoints = any_checkpoints || whole_recurrent || tail;
    any_tail = any_tail || tail;
    any_long = any_long || (!whole_recurrent && size > 1);
  }
  auto size_of = [&](size_t i) { return static_cast<int64_t>(chunks[i].tokens.size()); };
  auto first_phase = [&](size_t i) {
    return chunks[i].checkpoint_positions || in_pass_from_[i] == 0 || chunks[i].tokens.size() == 1;
  };
  if (any_checkpoints && any_long) {
    // Passes that keep checkpoints run the recurrence: apart from the long chunks. First the chunks that run whole that
    // way, then the long ones up to their tails, then the tails.
    run_phase(chunks, done, logits_row, [&](size_t i) { return first_phase(i); }, size_of, emit);
    run_phase(chunks, done, logits_row, [&](size_t i) { return !first_phase(i); },
              [&](size_t i) { return in_pass_from_[i]; }, emit);
    if (any_tail)
      run_phase(chunks, done, logits_row, [&](size_t i) { return !first_phase(i); }, size_of, emit);
  } else {
    run_phase(chunks, done, logits_row, [](size_t) { return true; }, size_of, emit);
  }
}

void Runner::run_phase(std::span<const SeqChunk> chunks, std::vector<int64_t>& done,
                       const std::vector<int64_t>& logits_row, const std::function<bool(size_t)>& in_phase,
                       const std::function<int64_t(size_t)>& limit,
                       const std::function<void(const TensorView&, const std::vector<int64_t>&)>& emit) {
  for (;;) {
    std::vector<Piece> pieces;
    int64_t budget = options_.prefill_chunk;
    for (size_t i = 0; i < chunks.size() && budget > 0; ++i) {
      if (!in_phase(i)) continue;
      const int64_t left = limit(i) - done[i];
      if (left <= 0) continue;
      // A chunk with position checkpoints, or the in-pass part of one with snapshots: the rest whole in one pass.
      const bool whole = chunks[i].checkpoint_positions || done[i] >= in_pass_from_[i];
      if (whole && left > budget) continue;  // whole, in the next pass
      int64_t n = std::min(left, budget);
      // A snapshot the pass does not write ends the piece: the state is copied after the pass (below).
      if (!whole)
        for (const ChunkSnapshot& sn : chunks[i].snapshots)
          if (sn.tokens > done[i]) {
            n = std::min(n, sn.tokens - done[i]);
            break;
          }
      budget -= n;
      Piece p{i, done[i], n, -1};
      // The chunk's logits tokens [size - logits_tokens, size) that fall in this piece.
      const int64_t size = static_cast<int64_t>(chunks[i].tokens.size());
      const int64_t lt = chunks[i].want_logits ? chunks[i].logits_tokens : 0;
      const int64_t first = std::max(done[i], size - lt), last = done[i] + n;
      if (lt > 0 && first < last) {
        p.logits_first = first - done[i];
        p.logits_count = last - first;
        p.logits_row = logits_row[i] + (first - (size - lt));
      }
      pieces.push_back(p);
    }
    if (pieces.empty()) break;
    run_pass(chunks, pieces, emit);
    for (const Piece& p : pieces) {
      done[p.chunk] += p.n_tokens;
      for (const ChunkSnapshot& sn : chunks[p.chunk].snapshots)
        if (sn.tokens == done[p.chunk] && sn.tokens <= in_pass_from_[p.chunk])
          copy_state_row(chunks[p.chunk].state_slot, sn.slot);
    }
  }
}

TensorView Runner::pass_body(const StepLayout& step, const TensorView& id_view, const TensorView& row_ids,
                             const MtpPass* mtp, const PassEmbeds* embeds) {
  const auto& c = model_->config;
  Ops& ops = *ops_;
  // A pass that keeps position checkpoints runs the recurrence (run_passes gives it no long chunk).
  const DeltaRuleMode mode =
      step.host_token_checkpoint_slot.empty() ? options_.prefill_delta_rule : DeltaRuleMode::recurrent;
  Forward f{ops, c, step, kv_, kv_index_, conv_state_, recurrent_state_, linear_index_, mode,
            trace_ ? &trace_ : nullptr};
  const int64_t T = step.num_tokens;
  // A deferred draft chain's ids into the pass's tokens (SeqChunk::device_draft_row), before the embedding.
  TensorView deferred_got;
  if (mtp && mtp->deferred_src.data) {
    const int64_t D = mtp->deferred_src.numel();
    deferred_got = ops.scratch(DType::I32, Shape{D, 1});
    ops.gather_rows(TensorView(chain_ids_.data, DType::I32, Shape{chain_ids_.numel(), 1}), mtp->deferred_src,
                    deferred_got);
    ops.scatter_rows(deferred_got, mtp->deferred_dst, TensorView(id_view.data, DType::I32, Shape{T, 1}));
  }
  TensorView hidden = f.f32(Shape{T, c.hidden_size});
  embed(f, model_->weights, id_view, hidden);
  if (embeds) ops.scatter_rows(embeds->values, embeds->rows, hidden);
  f.name("embed", -1, hidden);
  // Large passes (prefill) free each layer's scratch when the layer is done: its block output is added to the
  // residual stream there (one add; smaller passes fuse it into the next layer's norm), so a pass holds one layer's
  // buffers at a time instead of every layer's (the memory plan's activation estimate counts on this).
  const bool free_layers = T >= kLayerScratchReleaseMinTokens && !(f.trace && *f.trace);
  for (int l = 0; l < c.num_layers; ++l) {
    const Ops::ScratchMark mark = free_layers ? ops.scratch_mark() : Ops::ScratchMark{};
    model_->family->forward_layer(f, l, model_->weights.layers[l], hidden);
    if (free_layers) {
      residual_flush(f, hidden);
      ops.scratch_release(mark);
    }
    if (f.trace && *f.trace) residual_flush(f, hidden);  // a traced layer output is the whole residual stream
    f.name("layer_out", l, hidden);
  }
  residual_flush(f, hidden);
  if (mtp) {
    // Every token's final-norm output goes to mtp_rows_ (after the slots' and the spare rows): the MTP head's entries
    // of this pass read their hidden states from there, each slot keeps its last one (and each position checkpoint
    // its token's), and the logits rows are gathered from it.
    const int64_t kept_rows = options_.state_slots + spare_rows_, H = c.hidden_size;
    TensorView normed_all = row_range(mtp_rows_, kept_rows, T);
    ops.rms_norm(hidden, model_->weights.final_norm, static_cast<float>(c.rms_norm_eps), model_->family->norm_kind(),
                 normed_all);
    const TensorView rows_all = row_range(mtp_rows_, 0, kept_rows + T);
    if (mtp->carry && row_ids.data) return carry_body(f, *mtp, normed_all, rows_all, row_ids, deferred_got);
    if (mtp->step.num_seqs > 0) {
      TensorView h_in = f.f32(Shape{mtp->step.num_tokens, H});
      ops.gather_rows(rows_all, mtp->hidden_rows, h_in);
      Forward fm{ops, c, mtp->step, kv_, kv_index_, conv_state_, recurrent_state_, linear_index_,
                 options_.prefill_delta_rule, trace_ ? &trace_ : nullptr};
      mtp_forward(fm, model_->weights, *model_->family, c.num_layers, mtp->ids, h_in);
    }
    TensorView keep = f.f32(Shape{kept_rows, H});
    ops.gather_rows(rows_all, mtp->keep_rows, keep);
    ops.copy(keep, row_range(mtp_rows_, 0, kept_rows));
    if (!row_ids.data) return {};
    TensorView normed = f.f32(Shape{row_ids.numel(), H});
    ops.gather_rows(normed_all, row_ids, normed);
    f.name("final_norm", -1, normed);
    TensorView out = f.f32(Shape{row_ids.numel(), logits_width()});
    ops.linear(normed, model_->weights.lm_head, out);
    return out;
  }
  if (!row_ids.data) return {};
  const int64_t R = row_ids.numel();
  TensorView last = f.f32(Shape{R, c.hidden_size});
  ops.gather_rows(hidden, row_ids, last);
  TensorView normed = rms_norm(f, last, model_->weights.final_norm, model_->family->norm_kind());
  f.name("final_norm", -1, normed);
  TensorView out = f.f32(Shape{R, logits_width()});
  ops.linear(normed, model_->weights.lm_head, out);
  return out;
}

TensorView Runner::carry_body(Forward& f, const MtpPass& mtp, const TensorView& normed_all, const TensorView& rows_all,
                              const TensorView& row_ids, const TensorView& deferred_got) {
  const auto& c = model_->config;
  Ops& ops = *ops_;
  const int64_t kept_rows = options_.state_slots + spare_rows_, H = c.hidden_size, R = row_ids.numel();
  const int64_t V = logits_width(), M = mtp.step.num_tokens;
  // The target's logits and ids first: the head's carried entries embed them.
  TensorView normed = f.f32(Shape{R, H});
  ops.gather_rows(normed_all, row_ids, normed);
  f.name("final_norm", -1, normed);
  TensorView logits = f.f32(Shape{R, V});
  ops.linear(normed, model_->weights.lm_head, logits);
  const int64_t D = deferred_got.data ? deferred_got.numel() : 0;
  const TensorView out = ops.scratch(DType::I32, Shape{2 * R + D});
  const TensorView target(out.data, DType::I32, Shape{R});
  const TensorView drafts(static_cast<int32_t*>(out.data) + R, DType::I32, Shape{R});
  if (D > 0)
    ops.copy(TensorView(deferred_got.data, DType::I32, Shape{D}),
             TensorView(static_cast<int32_t*>(out.data) + 2 * R, DType::I32, Shape{D}));
  ops.argmax_rows_into(logits, target, 0);
  ops.scatter_rows(TensorView(target.data, DType::I32, Shape{R, 1}), mtp.carry_entry,
                   TensorView(mtp.ids.data, DType::I32, Shape{M, 1}));
  // The head over every entry (its hidden states gathered before the slots' rows move below).
  TensorView h_in = f.f32(Shape{M, H});
  ops.gather_rows(rows_all, mtp.hidden_rows, h_in);
  Forward fm{ops, c, mtp.step, kv_, kv_index_, conv_state_, recurrent_state_, linear_index_, options_.prefill_delta_rule,
             trace_ ? &trace_ : nullptr};
  const TensorView g = mtp_forward(fm, model_->weights, *model_->family, c.num_layers, mtp.ids, h_in);
  TensorView keep = f.f32(Shape{kept_rows, H});
  ops.gather_rows(rows_all, mtp.keep_rows, keep);
  ops.copy(keep, row_range(mtp_rows_, 0, kept_rows));
  // The carried entries' outputs: kept per slot for the next chain, and their greedy drafts.
  TensorView gc = f.f32(Shape{R, H});
  ops.gather_rows(g, mtp.carry_entry, gc);
  ops.scatter_rows(gc, mtp.carry_slot_rows, mtp_rows_);
  TensorView draft_logits = f.f32(Shape{R, V});
  ops.linear(gc, model_->weights.lm_head, draft_logits);
  ops.argmax_rows_into(draft_logits, drafts, 0);
  return out;
}

void Runner::run_pass(std::span<const SeqChunk> chunks, const std::vector<Piece>& pieces,
                      const std::function<void(const TensorView&, const std::vector<int64_t>&)>& emit) {
  Ops& ops = *ops_;
  ops.reset_scratch();
  for (const Piece& p : pieces) {
    const SeqChunk& ch = chunks[p.chunk];
    if (p.offset == 0 && ch.start_pos == 0) reset_slot(ch.state_slot);
  }
  // A decode pass (one token and its logits per sequence) or a verify pass (every sequence the same n <=
  // kGraphMaxTokensPerSeq tokens, each with logits, a whole chunk) can be captured and replayed: its shape is
  // (sequences, pages per sequence, n, position checkpoints or not), the pages rounded up to a power of two so that a
  // few graphs serve every context length.
  const int64_t n_uniform = pieces.empty() ? 0 : pieces.front().n_tokens;
  // The pass's tokens stay within graph_max_batch, the step sizes the decode graphs were always captured at.
  bool graphable = !trace_ && graphs_enabled_ && options_.graph_max_batch > 0 && n_uniform >= 1 &&
                   n_uniform <= (options_.graph_verify_passes ? kGraphMaxTokensPerSeq : 1) &&
                   static_cast<int64_t>(pieces.size()) * n_uniform <= options_.graph_max_batch;
  bool any_checkpoints = false, any_mrope = false, any_embeds = false;
  for (const Piece& p : pieces) {
    const SeqChunk& ch = chunks[p.chunk];
    graphable = graphable && p.n_tokens == n_uniform && p.logits_count == n_uniform && p.offset == 0 &&
                ch.checkpoint_positions == chunks[pieces.front().chunk].checkpoint_positions && ch.snapshots.empty();
    any_checkpoints = any_checkpoints || ch.checkpoint_positions || in_pass_piece(chunks, p);
    any_mrope = any_mrope || !ch.mrope_pos.empty();
    for (int32_t o : ch.embed_offsets) any_embeds = any_embeds || (o >= p.offset && o < p.offset + p.n_tokens);
  }
  graphable = graphable && !any_embeds;  // image embeddings come with prompts: never a decode or verify pass
  const bool has_mtp = model_->weights.has_mtp;
  // With the MTP head a captured decode pass has one head entry per sequence: none may be at position 0.
  if (has_mtp)
    for (const Piece& p : pieces) graphable = graphable && chunks[p.chunk].start_pos + p.offset >= 1;

  StepLayout step;
  step.num_seqs = static_cast<int>(pieces.size());
  step.page_size = options_.page_size;
  std::vector<int32_t> ids;
  step.host_seq_token_begin.push_back(0);
  for (const Piece& p : pieces) {
    const SeqChunk& ch = chunks[p.chunk];
    const int64_t start = ch.start_pos + p.offset;
    for (int64_t t = 0; t < p.n_tokens; ++t) {
      ids.push_back(ch.tokens[p.offset + t]);
      step.host_token_pos.push_back(static_cast<int32_t>(start + t));
    }
    if (any_mrope)
      for (int64_t t = 0; t < p.n_tokens; ++t)
        for (int a = 0; a < 3; ++a)
          step.host_token_mrope_pos.push_back(ch.mrope_pos.empty() ? static_cast<int32_t>(start + t)
                                                                   : ch.mrope_pos[3 * (p.offset + t) + a]);
    step.host_seq_token_begin.push_back(static_cast<int32_t>(ids.size()));
    step.host_seq_start_pos.push_back(static_cast<int32_t>(start));
    step.host_seq_state_slot.push_back(ch.state_slot);
    const int64_t pages = (start + p.n_tokens + options_.page_size - 1) / options_.page_size;
    step.max_pages_per_seq = std::max<int>(step.max_pages_per_seq, static_cast<int>(pages));
  }
  step.max_pages_per_seq = std::max(step.max_pages_per_seq, 1);
  if (graphable) step.max_pages_per_seq = graph_pages(step.max_pages_per_seq);
  step.host_page_table.assign(static_cast<size_t>(step.num_seqs) * step.max_pages_per_seq, -1);
  if (!kv_.empty()) {
    for (size_t s = 0; s < pieces.size(); ++s) {
      const SeqChunk& ch = chunks[pieces[s].chunk];
      const int64_t end = ch.start_pos + pieces[s].offset + pieces[s].n_tokens;
      const int64_t pages = (end + options_.page_size - 1) / options_.page_size;
      for (int64_t p = 0; p < pages; ++p) step.host_page_table[s * step.max_pages_per_seq + p] = ch.page_table[p];
    }
  }
  step.num_tokens = static_cast<int64_t>(ids.size());
  const int64_t T = step.num_tokens;
  // Position checkpoints: each checkpoint chunk's tokens but the last get the next spare rows.
  const int32_t slots = options_.state_slots;
  std::vector<std::pair<int64_t, int64_t>> checkpoint_rows;  // (pass token, spare row)
  if (any_checkpoints) {
    step.host_token_checkpoint_slot.assign(static_cast<size_t>(T), -1);
    for (size_t s = 0; s < pieces.size(); ++s) {
      const SeqChunk& ch = chunks[pieces[s].chunk];
      if (in_pass_piece(chunks, pieces[s])) {
        // Prefix-cache snapshots as position checkpoints into their own slots (with the MTP head: its hidden row too).
        KILN_CHECK(pieces[s].offset + pieces[s].n_tokens == static_cast<int64_t>(ch.tokens.size()),
                   "the in-pass part of a chunk with snapshots was split over passes");
        for (const ChunkSnapshot& sn : ch.snapshots) {
          if (sn.tokens <= pieces[s].offset) continue;  // copied after an earlier pass
          const int64_t token = step.host_seq_token_begin[s] + (sn.tokens - pieces[s].offset) - 1;
          step.host_token_checkpoint_slot[static_cast<size_t>(token)] = static_cast<int32_t>(sn.slot);
          checkpoint_rows.emplace_back(token, sn.slot);
        }
        continue;
      }
      if (!ch.checkpoint_positions) continue;
      KILN_CHECK(pieces[s].offset == 0 && pieces[s].n_tokens == static_cast<int64_t>(ch.tokens.size()),
                 "a chunk with position checkpoints was split over passes");
      if (spare_used_ + pieces[s].n_tokens - 1 > spare_rows_)
        fail("forward: the chunks ask for more than the {} position checkpoints a call keeps", spare_rows_);
      std::vector<int64_t>& kept = kept_[ch.state_slot];
      for (int64_t t = 0; t + 1 < pieces[s].n_tokens; ++t) {
        const int64_t row = slots + spare_used_++;
        const int64_t token = step.host_seq_token_begin[s] + t;
        step.host_token_checkpoint_slot[static_cast<size_t>(token)] = static_cast<int32_t>(row);
        checkpoint_rows.emplace_back(token, row);
        kept.push_back(row);
      }
    }
  }
  std::vector<int32_t> rows;
  std::vector<int64_t> out_rows;
  for (size_t s = 0; s < pieces.size(); ++s) {
    if (pieces[s].logits_row < 0) continue;
    for (int64_t k = 0; k < pieces[s].logits_count; ++k) {
      rows.push_back(static_cast<int32_t>(step.host_seq_token_begin[s] + pieces[s].logits_first + k));
      out_rows.push_back(pieces[s].logits_row + k);
    }
  }
  // The MTP head's entries of this pass: (t[p], h[p - 1]) at position p - 1 for every token at p >= 1; h[p - 1] is
  // the pass's row of p - 1 or, for a piece's first token, the slot's last hidden state.
  MtpPass mtp;
  std::vector<int32_t> mtp_ids, mtp_hidden_rows, mtp_keep_rows, carry_entry, carry_slot_rows;
  // forward_argmax_carry: a chunk's head entries up to its first logits token are the plain ones; then one entry per
  // logits row, at that row's position, fed the row's argmax (filled in on the device) and the row's hidden state.
  mtp.carry = has_mtp && carry_ && !rows.empty();
  if (has_mtp) {
    const int32_t pass_row0 = static_cast<int32_t>(slots + spare_rows_);  // mtp_rows_: slots, spare rows, the pass's
    StepLayout& ms = mtp.step;
    ms.page_size = options_.page_size;
    ms.max_pages_per_seq = step.max_pages_per_seq;
    ms.host_seq_token_begin.push_back(0);
    mtp_keep_rows.resize(static_cast<size_t>(pass_row0));
    for (int32_t i = 0; i < pass_row0; ++i) mtp_keep_rows[i] = i;
    for (const auto& [token, row] : checkpoint_rows) mtp_keep_rows[row] = static_cast<int32_t>(pass_row0 + token);
    for (size_t s = 0; s < pieces.size(); ++s) {
      const Piece& p = pieces[s];
      const SeqChunk& ch = chunks[p.chunk];
      const int64_t start = ch.start_pos + p.offset, row0 = step.host_seq_token_begin[s];
      mtp_keep_rows[ch.state_slot] = static_cast<int32_t>(pass_row0 + row0 + p.n_tokens - 1);
      const int64_t first = std::max<int64_t>(start, 1), end = start + p.n_tokens;
      int64_t L = 0;  // carried entries (the piece's logits rows)
      if (mtp.carry && p.logits_row >= 0) {
        KILN_CHECK(p.logits_count == ch.logits_tokens && p.logits_first + p.logits_count == p.n_tokens,
                   "forward_argmax_carry: a chunk's logits rows were split over passes");
        L = p.logits_count;
      }
      const int64_t plain_end = L > 0 ? end - L + 1 : end;  // plain entries for the tokens at [first, plain_end)
      if (first >= plain_end && L == 0) continue;
      ms.host_seq_start_pos.push_back(static_cast<int32_t>(first < plain_end ? first - 1 : end - L));
      for (int64_t pos = first; pos < plain_end; ++pos) {
        mtp_ids.push_back(ch.tokens[p.offset + (pos - start)]);
        mtp_hidden_rows.push_back(pos - 1 >= start ? static_cast<int32_t>(pass_row0 + row0 + (pos - 1 - start))
                                                   : ch.state_slot);
        ms.host_token_pos.push_back(static_cast<int32_t>(pos - 1));
        // The entry's rope position is that of the token at pos - 1 (whose hidden state it carries).
        const int64_t prev = pos - 1 - ch.start_pos;  // chunk index of the token at pos - 1 (-1: before the chunk)
        if (any_mrope)
          for (int a = 0; a < 3; ++a)
            ms.host_token_mrope_pos.push_back(ch.mrope_pos.empty() ? static_cast<int32_t>(pos - 1)
                                              : prev < 0          ? ch.mrope_prev[a]
                                                                  : ch.mrope_pos[3 * prev + a]);
      }
      for (int64_t i = 0; i < L; ++i) {
        const int64_t q = end - L + i;  // the logits row's position: its entry carries h[q] and the argmax after it
        carry_entry.push_back(static_cast<int32_t>(mtp_ids.size()));
        carry_slot_rows.push_back(static_cast<int32_t>(carry_row0_ + ch.state_slot * carry_rows_per_slot_ + i));
        mtp_ids.push_back(0);  // the row's argmax, written on the device
        mtp_hidden_rows.push_back(static_cast<int32_t>(pass_row0 + row0 + (q - start)));
        ms.host_token_pos.push_back(static_cast<int32_t>(q));
        if (any_mrope)
          for (int a = 0; a < 3; ++a)
            ms.host_token_mrope_pos.push_back(ch.mrope_pos.empty() ? static_cast<int32_t>(q)
                                                                   : ch.mrope_pos[3 * (q - ch.start_pos) + a]);
      }
      ms.host_seq_token_begin.push_back(static_cast<int32_t>(mtp_ids.size()));
      ms.host_seq_state_slot.push_back(ch.state_slot);
      ms.host_page_table.insert(ms.host_page_table.end(), step.host_page_table.begin() + s * step.max_pages_per_seq,
                                step.host_page_table.begin() + (s + 1) * step.max_pages_per_seq);
      ++ms.num_seqs;
    }
    ms.num_tokens = static_cast<int64_t>(mtp_ids.size());
  }
  // Tokens of a deferred draft chain (SeqChunk::device_draft_row): where each is in chain_ids_ and in this pass.
  std::vector<int32_t> deferred_src, deferred_dst;
  pass_deferred_out_.clear();
  for (size_t s = 0; s < pieces.size(); ++s) {
    const SeqChunk& ch = chunks[pieces[s].chunk];
    if (ch.device_draft_row < 0) continue;
    KILN_CHECK(mtp.carry && deferred_seqs_ > 0 && pieces[s].offset == 0 &&
                   pieces[s].n_tokens == static_cast<int64_t>(ch.tokens.size()),
               "forward: a chunk reads a deferred draft chain outside a whole carried pass");
    for (int64_t k = 0; k < deferred_steps_; ++k) {
      deferred_src.push_back(static_cast<int32_t>(k * deferred_seqs_ + ch.device_draft_row));
      deferred_dst.push_back(static_cast<int32_t>(step.host_seq_token_begin[s] + 2 + k));
      pass_deferred_out_.push_back(ch.device_draft_row * deferred_steps_ + k);
    }
  }
  // Every upload comes before the compute, in a fixed order: a replayed pass finds its inputs where the captured
  // one read them.
  // All of them in one host-to-device copy (I32Upload).
  I32Upload up;
  const StagedStep at_step = stage_step(up, step);
  const int64_t at_ids = up.add(ids), at_rows = rows.empty() ? -1 : up.add(rows);
  StagedStep at_mtp;
  int64_t at_mtp_ids = -1, at_hidden = -1, at_keep = -1, at_carry = -1, at_carry_rows = -1;
  if (has_mtp) {
    if (mtp.step.num_seqs > 0) {
      at_mtp = stage_step(up, mtp.step);
      at_mtp_ids = up.add(mtp_ids);
      at_hidden = up.add(mtp_hidden_rows);
    }
    at_keep = up.add(mtp_keep_rows);
    if (mtp.carry) {
      KILN_CHECK(carry_entry.size() == rows.size(), "forward_argmax_carry: {} carried entries for {} logits rows",
                 carry_entry.size(), rows.size());
      at_carry = up.add(carry_entry);
      at_carry_rows = up.add(carry_slot_rows);
    }
  }
  const int64_t at_dsrc = deferred_src.empty() ? -1 : up.add(deferred_src),
                at_ddst = deferred_dst.empty() ? -1 : up.add(deferred_dst);
  up.upload(ops);
  bind_step(up, at_step, step);
  const TensorView id_view = up.view(at_ids, Shape{T});
  const TensorView row_ids = at_rows < 0 ? TensorView() : up.view(at_rows, Shape{static_cast<int64_t>(rows.size())});
  if (has_mtp) {
    if (mtp.step.num_seqs > 0) {
      bind_step(up, at_mtp, mtp.step);
      mtp.ids = up.view(at_mtp_ids, Shape{mtp.step.num_tokens});
      mtp.hidden_rows = up.view(at_hidden, Shape{mtp.step.num_tokens});
    }
    mtp.keep_rows = up.view(at_keep, Shape{static_cast<int64_t>(mtp_keep_rows.size())});
    if (mtp.carry) {
      const int64_t R = static_cast<int64_t>(rows.size());
      mtp.carry_entry = up.view(at_carry, Shape{R});
      mtp.carry_slot_rows = up.view(at_carry_rows, Shape{R});
    }
    if (at_dsrc >= 0) {
      const int64_t D = static_cast<int64_t>(deferred_src.size());
      mtp.deferred_src = up.view(at_dsrc, Shape{D});
      mtp.deferred_dst = up.view(at_ddst, Shape{D});
    }
  }
  const MtpPass* mtp_pass = has_mtp ? &mtp : nullptr;
  // Image embeddings of this pass's tokens (never in a captured pass): their pass rows and values.
  PassEmbeds pass_embeds;
  if (any_embeds) {
    const int64_t H = model_->config.hidden_size;
    std::vector<int32_t> rows_of;
    std::vector<float> values;
    for (size_t s = 0; s < pieces.size(); ++s) {
      const Piece& p = pieces[s];
      const SeqChunk& ch = chunks[p.chunk];
      for (size_t i = 0; i < ch.embed_offsets.size(); ++i) {
        const int32_t o = ch.embed_offsets[i];
        if (o < p.offset || o >= p.offset + p.n_tokens) continue;
        rows_of.push_back(static_cast<int32_t>(step.host_seq_token_begin[s] + (o - p.offset)));
        values.insert(values.end(), ch.embeds.begin() + static_cast<int64_t>(i) * H,
                      ch.embeds.begin() + static_cast<int64_t>(i + 1) * H);
      }
    }
    const int64_t R = static_cast<int64_t>(rows_of.size());
    pass_embeds.rows = ops.upload(rows_of.data(), DType::I32, Shape{R});
    pass_embeds.values = ops.upload(values.data(), DType::F32, Shape{R, H});
  }

  GraphKey key{step.num_seqs, step.max_pages_per_seq, static_cast<int>(n_uniform), any_checkpoints};
  key.mrope = any_mrope;
  key.carry = mtp.carry;
  key.deferred = static_cast<int>(deferred_src.size());
  const PassEmbeds* embeds = any_embeds ? &pass_embeds : nullptr;  // never in a graphable pass
  const TensorView out =
      run_graphed(graphable, key, [&] { return pass_body(step, id_view, row_ids, mtp_pass, embeds); });
  if (!rows.empty()) emit(out, out_rows);
}

int Runner::graph_pages(int pages) const {
  const int cap = static_cast<int>((options_.max_context + options_.page_size - 1) / options_.page_size);
  int bucket = 1;
  while (bucket < pages) bucket *= 2;
  return std::max(pages, std::min(bucket, cap));
}

TensorView Runner::run_graphed(bool graphable, const GraphKey& key, const std::function<TensorView()>& body) {
  Ops& ops = *ops_;
  if (graphable) {
    auto it = graphs_.find(key);
    if (it != graphs_.end()) {
      if (ops.graph_launch(it->second.handle)) return it->second.out;
      graphs_.erase(it);  // scratch memory moved: capture again below
    }
    if (graph_seen_[key]++ >= 1) {  // the first run of a shape is eager (lazy setup, scratch growth)
      if (graphs_.size() >= 512) {  // bound the graphs kept (serving with ever new shapes)
        ops.graph_reset();
        graphs_.clear();
      }
      if (ops.graph_capture_begin()) {
        TensorView o;
        try {
          o = body();
        } catch (...) {
          ops.graph_capture_end();  // leave the stream usable, then report
          throw;
        }
        const int handle = ops.graph_capture_end();
        if (handle >= 0 && ops.graph_launch(handle)) {
          graphs_[key] = Graph{handle, o};
          return o;
        }
      }
    }
  }
  return body();
}

std::vector<DeviceMemory> Runner::device_memory() const {
  std::optional<DeviceMemory> d = ops_->device_memory();
  if (!d) return {};
  d->kv_bytes = capacity_.kv_pages * capacity_.page_size * capacity_.kv_bytes_per_token;
  d->state_bytes = static_cast<int64_t>(capacity_.state_slots) * capacity_.state_bytes_per_slot;
  return {*d};
}

}  // namespace kiln::model
