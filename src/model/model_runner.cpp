#include "model/model_runner.h"

#include "core/error.h"
#include "model/ops.h"

namespace kiln::model {

void ModelRunner::copy_state(int src_slot, int dst_slot) {
  fail("this model runner cannot copy state slots ({} -> {})", src_slot, dst_slot);
}

void ModelRunner::draft(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens,
                        std::span<float> logits) {
  (void)seqs, (void)steps, (void)tokens, (void)logits;
  fail("this model runner has no MTP head to draft with (speculative decoding needs one)");
}

std::vector<float> ModelRunner::encode_image(std::span<const float> pixel_values, int64_t grid_t, int64_t grid_h,
                                             int64_t grid_w) {
  (void)pixel_values;
  fail("this model has no vision encoder: an image of {} x {} x {} patches cannot be read", grid_t, grid_h, grid_w);
}
void ModelRunner::forward_argmax_carry(std::span<const SeqChunk> chunks, std::span<int32_t> tokens,
                                       std::span<int32_t> next_drafts, std::span<int32_t> device_drafts) {
  (void)chunks, (void)tokens, (void)next_drafts, (void)device_drafts;
  fail("this model runner cannot carry drafts from a step (forward_argmax_carry)");
}
void ModelRunner::draft_deferred(std::span<const DraftSeq> seqs, int steps) {
  (void)seqs, (void)steps;
  fail("this model runner cannot keep a draft chain on the device (draft_deferred)");
}
void ModelRunner::save_state(int slot) { fail("this model runner cannot checkpoint state slot {}", slot); }
void ModelRunner::restore_state(int slot) { fail("this model runner cannot restore state slot {}", slot); }
void ModelRunner::keep_verified(int slot, int tokens) {
  fail("this model runner keeps no position checkpoints (slot {}, {} tokens)", slot, tokens);
}
void ModelRunner::keep_verified_rows(std::span<const VerifiedRow> rows) {
  for (const VerifiedRow& r : rows) keep_verified(r.slot, r.tokens);
}

void ModelRunner::forward_argmax(std::span<const SeqChunk> chunks, std::span<int32_t> tokens) {
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) rows += ch.want_logits ? ch.logits_tokens : 0;
  if (static_cast<int64_t>(tokens.size()) < rows)
    fail("forward_argmax: token buffer holds {} ids, {} needed", tokens.size(), rows);
  const int64_t V = vocab_size();
  std::vector<float> logits(static_cast<size_t>(rows * V));
  forward(chunks, logits);
  for (int64_t r = 0; r < rows; ++r) tokens[static_cast<size_t>(r)] = host_argmax(logits.data() + r * V, V);
}

void ModelRunner::forward_sample(std::span<const SeqChunk> chunks, std::span<const RowSampling> rows,
                                 std::span<int32_t> tokens) {
  int64_t n = 0;
  for (const SeqChunk& ch : chunks) n += ch.want_logits ? ch.logits_tokens : 0;
  if (static_cast<int64_t>(tokens.size()) < n || static_cast<int64_t>(rows.size()) < n)
    fail("forward_sample: {} ids and {} sampling rows for {} rows", tokens.size(), rows.size(), n);
  const int64_t V = vocab_size();
  std::vector<float> logits(static_cast<size_t>(n * V));
  forward(chunks, logits);
  SampleScratch scratch;
  for (int64_t r = 0; r < n; ++r)
    tokens[static_cast<size_t>(r)] =
        sample_row_host(logits.data() + r * V, V, rows[static_cast<size_t>(r)], scratch);
}

}  // namespace kiln::model
