// The contract between the engine loop (host-only scheduling) and a loaded model on some backend.
//
// The engine owns the bookkeeping: which sequences run, which KV pages and recurrent-state slots they
// hold. A ModelRunner owns the memory those ids refer to (the KV page pool and the state slots, on
// the CPU or a GPU) and runs forward passes over a batch of sequence chunks.
//
// Paged KV: the pool has `kv_pages` pages of `page_size` tokens (all full-attention layers of one token
// position live in the same page slot). A sequence's KV for position p lives in page
// page_table[p / page_size], row p % page_size. Linear-attention (Gated DeltaNet) layers keep a fixed
// per-sequence state in `state_slot`.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/device_memory.h"
#include "model/sampling.h"

namespace kiln::model {

struct RunnerCapacity {
  int64_t kv_pages = 0;        // pages in the KV pool
  int page_size = 16;          // tokens per page
  int state_slots = 0;         // recurrent-state slots (max sequences alive at once)
  int64_t max_context = 0;     // longest sequence the model supports (tokens)
  int64_t kv_bytes_per_token = 0;
  int64_t state_bytes_per_slot = 0;
};

// One sequence's piece of work in a forward step: `tokens` at positions
// [start_pos, start_pos + tokens.size()). start_pos == 0 means a fresh sequence: the runner
// resets the state slot before use. A decode step is a chunk of one token.
// A prefix-cache snapshot inside a chunk: after the chunk's first `tokens` tokens (0 < tokens < the chunk's size), the
// sequence's state, as copy_state copies it, goes into `slot` (a slot no chunk of the call runs in). So a prompt whose
// page boundary the prefix cache snapshots runs in one engine step instead of being cut there.
struct ChunkSnapshot {
  int64_t tokens = 0;
  int slot = -1;
};

struct SeqChunk {
  int state_slot = -1;
  std::span<const int32_t> tokens;
  int64_t start_pos = 0;
  std::span<const int32_t> page_table;  // pages covering [0, start_pos + tokens.size())
  bool want_logits = true;              // logits for the chunk's last token
  // With want_logits: logits rows for the chunk's last `logits_tokens` tokens (in token order; a speculative verify
  // asks for all K + 1), each counted as one row by forward / forward_argmax / forward_sample.
  int logits_tokens = 1;
  // Keep the state after each of the chunk's tokens but the last (position checkpoints), so that keep_verified can
  // settle a speculative verify without running it again. Only for runners with position_checkpoints() > 0.
  bool checkpoint_positions = false;
  // Image inputs (a prompt with images, and every later chunk of that sequence). Empty for text-only sequences.
  // mrope_pos: the M-RoPE positions (t, h, w) of each token, [tokens.size() * 3]; mrope_prev: those of the token at
  // start_pos - 1 (the MTP head's first entry of the chunk sits there). A text token's three positions are equal.
  std::span<const int32_t> mrope_pos;
  std::array<int32_t, 3> mrope_prev{0, 0, 0};
  // Input embeddings that replace the token embeddings (image tokens): embed_offsets (ascending, chunk-relative) and
  // their rows, embeds [embed_offsets.size() * hidden_size] floats in that order.
  std::span<const int32_t> embed_offsets;
  std::span<const float> embeds;
  // forward_argmax_carry after draft_deferred: tokens [2, 2 + C) of this chunk (its chain's drafts after the carried
  // first one; C = the chain's steps) are row `device_draft_row` of that chain, still on the device (the chunk's own
  // tokens there are placeholders). -1: all tokens are the chunk's.
  int device_draft_row = -1;
  // Snapshots inside the chunk (ascending `tokens`); only for runners whose chunk_snapshots() is true.
  std::vector<ChunkSnapshot> snapshots;
};

// One sequence's draft chain (speculative decoding with the model's MTP head): `token` is the sequence's pending
// token (sampled, not yet run) at position `pos`; every position before it has been run (its KV, state and the MTP
// head's entries are in the cache). page_table covers [0, pos + steps).
struct DraftSeq {
  int state_slot = -1;
  int32_t token = 0;
  int64_t pos = 0;
  std::span<const int32_t> page_table;
  // M-RoPE sequences (a prompt with images): the rope position of every position q >= pos - 1 is q + rope_delta on
  // all three axes. 0 for text-only sequences.
  int32_t rope_delta = 0;
  // A first draft carried by the last forward_argmax_carry call (the head's entry at pos - 1 already ran there):
  // carried_row is the logits row of the sequence's chunk, counted from the chunk's first logits row, whose target
  // token became `token` (a verify row: the accepted drafts' count); first_draft is next_drafts of that row. The chain
  // then emits first_draft and runs steps - 1 more steps from the head state that call kept. -1: none.
  int carried_row = -1;
  int32_t first_draft = -1;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  virtual RunnerCapacity capacity() const = 0;
  virtual int64_t vocab_size() const = 0;

  // Runs all chunks as one step. For each chunk with want_logits, writes vocab_size() floats (fp32
  // logits of its last token) into `logits`, in chunk order. Throws kiln::Error on failure.
  virtual void forward(std::span<const SeqChunk> chunks, std::span<float> logits) = 0;

  // Like forward(), but writes the greedy token (argmax of the logits; lowest id on ties) of each want_logits
  // chunk instead of its logits. A GPU runner picks them on the device and copies back only the ids. The default
  // runs forward() and scans the logits on the host.
  virtual void forward_argmax(std::span<const SeqChunk> chunks, std::span<int32_t> tokens);

  // Like forward_argmax(), but each want_logits chunk's token is drawn as rows[i] says (i-th want_logits chunk;
  // model/sampling.h's sample_row_host: temperature, top-k, top-p, min-p, the draw with rows[i].u; -1 for a row
  // without a finite logit). A GPU runner samples on the device and copies back only the ids. The default runs
  // forward() and samples the logits on the host.
  virtual void forward_sample(std::span<const SeqChunk> chunks, std::span<const RowSampling> rows,
                              std::span<int32_t> tokens);

  // Copies the recurrent / conv state of slot src into slot dst (every linear-attention layer), in order with the
  // forward passes (the prefix cache snapshots a sequence's state and restores it into another's slot). Runners
  // that cannot say false in can_copy_state(); the engine then serves without the prefix cache.
  virtual bool can_copy_state() const { return false; }
  virtual void copy_state(int src_slot, int dst_slot);
  // Whether the model keeps per-sequence recurrent state (a cache hit then needs a state snapshot).
  virtual bool has_recurrent_state() const { return true; }
  // Whether forward* honour SeqChunk::snapshots (else a caller cuts its chunks at the snapshot positions).
  virtual bool chunk_snapshots() const { return false; }

  // ---- Speculative decoding with the model's MTP head (model/mtp.h). Runners without one say 0 and throw.
  // While a runner has an MTP head, every forward pass also runs the head over the pass's tokens (its KV entries),
  // so a draft can start after any step.
  virtual int mtp_layers() const { return 0; }
  // Greedy steps that also draft (the first draft of the next step comes out of this one): forward_argmax, and for
  // every logits row r, next_drafts[r] = the MTP head's greedy token after the target's token of row r, as if the
  // sequence's tokens ended with that row's token (for a verify row: with the drafts before it accepted). The head's
  // entries of a chunk with logits L rows then run on the target's argmax ids: (t[p], h[p - 1]) for the chunk's
  // positions up to the first logits token, then (argmax of row i, h[that row's position]) for each row i. Entries
  // past the accepted tokens are never read before they are written again, so the head's KV stays what the plain
  // scheme leaves. Only for greedy steps (the next token must be the argmax). can_carry_drafts(): whether the runner
  // does it (false: the default, and forward_argmax_carry fails).
  virtual bool can_carry_drafts() const { return false; }
  // device_drafts (empty unless a draft_deferred chain is pending): that chain's ids, [its sequences, its steps].
  virtual void forward_argmax_carry(std::span<const SeqChunk> chunks, std::span<int32_t> tokens,
                                    std::span<int32_t> next_drafts, std::span<int32_t> device_drafts = {});
  // draft() of sequences with carried first drafts whose chain (steps - 1 > 0 steps) stays on the device: nothing comes
  // back to the host, and the next forward_argmax_carry reads the chain's ids where its chunks say
  // (SeqChunk::device_draft_row: sequence i of this call is row i) and returns them. One chain at a time; the default
  // fails.
  virtual void draft_deferred(std::span<const DraftSeq> seqs, int steps);
  // Drafts `steps` greedy tokens per sequence (the MTP head chained on its own output): tokens [S * steps], row-major
  // per sequence; `logits` (empty, or [S * steps, vocab_size()]) gets each step's draft logits. Writes only the MTP
  // head's KV entries at positions [pos - 1, pos - 1 + steps) of each sequence.
  virtual void draft(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens, std::span<float> logits);
  // A checkpoint of the slot's recurrent / conv state and the MTP head's input hidden state (one per slot), in order
  // with the forward passes: taken before
  // a verify pass, restored when drafts were rejected (the accepted tokens are then run again). KV needs none: the
  // entries of rejected positions are never read before they are written again.
  virtual void save_state(int slot);
  virtual void restore_state(int slot);
  // Position checkpoints, the alternative without a replay: a forward call keeps, for each chunk with
  // checkpoint_positions, the state after each of its tokens but the last; keep_verified then makes the slot's state
  // (recurrent, conv, the MTP head's input) the one after the chunk's first `tokens` tokens (1 .. its size), before
  // the next forward or draft. position_checkpoints(): how many token states one forward call can keep (the sizes
  // less one of its checkpoint_positions chunks, summed, must not exceed it); 0: none (save_state / restore_state and
  // a replay then). A caller uses one scheme or the other: both share the runner's spare state rows.
  virtual int position_checkpoints() const { return 0; }
  // Image inputs. vision_merge_size(): 0 when the model has no vision tower (the default), else its spatial merge
  // size. encode_image: one image's patches, pixel_values [grid_t * grid_h * grid_w, patch values] (transformers'
  // layout); returns [grid_t * grid_h * grid_w / merge^2, text hidden size] floats (the text model's input embeddings
  // of its placeholder tokens). The default fails.
  virtual int vision_merge_size() const { return 0; }
  virtual std::vector<float> encode_image(std::span<const float> pixel_values, int64_t grid_t, int64_t grid_h,
                                          int64_t grid_w);
  virtual void keep_verified(int slot, int tokens);
  // keep_verified for several slots at once (a speculative step's rows; each slot once): a runner may move all their
  // state in one device launch. Default: keep_verified for each.
  struct VerifiedRow {
    int slot = -1;
    int tokens = 0;
  };
  virtual void keep_verified_rows(std::span<const VerifiedRow> rows);

  // Why this runner can no longer run steps ("" while it can): a multi-node group whose link failed. Safe to call
  // from any thread (the server's /health reports it).
  virtual std::string fatal_error() const { return {}; }

  // Human-readable description for the startup summary (backend, kernels, memory plan).
  virtual std::string describe() const = 0;

  // The memory each of this node's ranks holds on its device, one entry per rank (/get_server_info, /metrics);
  // empty when the model runs on no device (the CPU backend). Figures fixed at load (weights, KV pool, state), the
  // scratch arena as of the last step.
  virtual std::vector<DeviceMemory> device_memory() const { return {}; }
};

}  // namespace kiln::model
