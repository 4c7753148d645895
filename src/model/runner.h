// The generic ModelRunner: any backend's Ops + a loaded model + the per-sequence memory (paged KV pool for the
// full-attention layers, conv + recurrent state slots for the linear-attention layers). Splits a step's
// chunks into forward passes of at most `prefill_chunk` tokens, builds each pass's StepLayout, runs the
// family's layers and writes the requested logits. Backends only provide the Ops (and the load options).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "core/dtype.h"
#include "format/model_dir.h"
#include "model/forward.h"
#include "model/model.h"
#include "model/model_runner.h"
#include "model/ops.h"

namespace kiln::model {

// Forward passes of at least this many tokens free each layer's scratch once the layer is done (Runner::pass_body),
// so a prefill pass holds one layer's buffers at a time. Above the decode graphs' default largest batch, so decode and
// verify passes keep the residual add fused into the next layer's norm.
inline constexpr int64_t kLayerScratchReleaseMinTokens = 257;

struct RunnerOptions {
  DType kv_dtype = DType::BF16;  // BF16 (default), F32 (exact reference checks) or F8_E4M3 (scaled)
  int64_t max_context = 0;       // 0: max_position_embeddings
  int page_size = 16;
  int state_slots = 4;           // sequences alive at once
  int64_t kv_pages = 0;          // 0: state_slots * ceil(max_context / page_size)
  int64_t prefill_chunk = 512;   // most tokens in one forward pass (longer chunks are split)
  DeltaRuleMode prefill_delta_rule = DeltaRuleMode::chunked;  // sequences with > 1 token in a pass
  LoadFormat load_format = LoadFormat::safetensors;
  // Decode passes (one token per sequence) of at most this many sequences are captured once per shape and
  // replayed (CUDA graphs) on backends that can; 0 disables.
  int graph_max_batch = 256;
  // Also capture speculative verify passes (every sequence the same n <= 8 tokens, each with logits) as graphs.
  // Checked by test_cuda's CudaRunner.SpeculativeVerifyWithPositionCheckpointsEqualsGreedyAndGraphsEqualEager; the
  // servers' default (backend::GpuLoadOptions::cuda_graph_verify; --disable-cuda-graph-verify turns it off).
  bool graph_verify_passes = false;
  std::string summary;  // backend-specific lines for describe() (kernel choices, memory plan)
  // A rank of a tensor-parallel group (model/tp_runner.h): load only its slices, run with its local sizes; its
  // Ops carry the group's communicator.
  std::optional<format::RankShard> shard;
  // One rank run alone (bench-engine --single-rank): forward_argmax / forward_sample take the best id of the
  // rank's vocabulary slice (a benchmark of one GPU's share; the ids mean nothing).
  bool lone_rank = false;
  // Load and run the checkpoint's MTP head when it has one (speculative decoding; model/mtp.h): every pass then also
  // runs the head (its KV entries) and each state slot gets a checkpoint. Off (the default until the engine drives
  // speculation): the head is left unloaded and no pass runs it.
  bool mtp = false;
  // Load the checkpoint's vision tower when it has one it can run (image inputs; model/qwen3_5_vision.h).
  bool vision = false;
};

class Runner : public ModelRunner {
 public:
  Runner(std::unique_ptr<Ops> ops, const format::ModelDir& dir, const RunnerOptions& options);
  ~Runner() override;

  RunnerCapacity capacity() const override { return capacity_; }
  int64_t vocab_size() const override { return model_->config.vocab_size; }
  void forward(std::span<const SeqChunk> chunks, std::span<float> logits) override;
  void forward_argmax(std::span<const SeqChunk> chunks, std::span<int32_t> tokens) override;
  // A tensor-parallel rank's greedy offer (TpRunner): per want_logits chunk, the best id over this rank's logits
  // (its vocabulary slice; the slice's first id added) and that logit (NaN: no number in the slice). The backend
  // picks them (a GPU copies back 8 bytes per row instead of the slice's logits).
  void forward_best(std::span<const SeqChunk> chunks, std::span<int32_t> ids, std::span<float> values);
  void forward_sample(std::span<const SeqChunk> chunks, std::span<const RowSampling> rows,
                      std::span<int32_t> tokens) override;
  std::string describe() const override;
  bool can_copy_state() const override { return true; }
  void copy_state(int src_slot, int dst_slot) override;
  bool has_recurrent_state() const override { return !conv_state_.empty(); }
  bool chunk_snapshots() const override { return true; }
  int mtp_layers() const override { return model_->weights.has_mtp ? 1 : 0; }
  // With an MTP head on a runner that picks whole-vocabulary ids (not a tensor-parallel rank): see ModelRunner.
  bool can_carry_drafts() const override { return carry_rows_per_slot_ > 0; }
  void forward_argmax_carry(std::span<const SeqChunk> chunks, std::span<int32_t> tokens,
                            std::span<int32_t> next_drafts, std::span<int32_t> device_drafts = {}) override;
  void draft_deferred(std::span<const DraftSeq> seqs, int steps) override;
  void draft(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens, std::span<float> logits) override;
  // A tensor-parallel rank's share of a draft (TpRunner::draft): the same chain, but each step's next tokens come from
  // pick(step, this rank's best global id and logit per sequence (NaN: none in its slice), out: the chosen ids), which
  // meets the other ranks; logits_slice(step, sequence, this rank's logits row over its vocabulary slice), when given,
  // receives the draft logits.
  using DraftPick = std::function<void(int step, std::span<const int32_t> ids, std::span<const float> values,
                                       std::span<int32_t> chosen)>;
  using DraftLogits = std::function<void(int step, int64_t seq, std::span<const float> row)>;
  void draft_rank(std::span<const DraftSeq> seqs, int steps, const DraftPick& pick, const DraftLogits& logits_slice);
  void save_state(int slot) override;
  void restore_state(int slot) override;
  int position_checkpoints() const override { return static_cast<int>(spare_rows_); }
  int vision_merge_size() const override {
    return model_->vision ? model_->full_config.vision.spatial_merge_size : 0;
  }
  std::vector<float> encode_image(std::span<const float> pixel_values, int64_t grid_t, int64_t grid_h,
                                  int64_t grid_w) override;
  void keep_verified(int slot, int tokens) override;
  void keep_verified_rows(std::span<const VerifiedRow> rows) override;
  // Its Ops' device figures with the KV pool and state slots it allocated (one entry, rank 0; none on the CPU).
  std::vector<DeviceMemory> device_memory() const override;

  const format::ModelConfig& config() const { return model_->config; }
  // Floats per logits row forward() writes: vocab_size(), or a tensor-parallel rank's vocabulary slice.
  int64_t logits_width() const { return model_->weights.lm_head.out_features; }
  const LoadedModel& model() const { return *model_; }
  const RunnerOptions& options() const { return options_; }
  Ops& ops() { return *ops_; }
  // Called with every named intermediate of later forward passes (debugging against a reference dump).
  void set_trace(TraceFn trace) { trace_ = std::move(trace); }
  // Turns decode-step graphs on / off for later passes (profiling runs op by op).
  void set_graphs_enabled(bool on) { graphs_enabled_ = on; }
  // The KV-cache scales in use per full-attention layer (FP8 pools; 1 otherwise).
  std::vector<std::pair<float, float>> kv_scales() const;
  // Keeps a communicator the runner's Ops uses (set_communicator) alive as long as the runner.
  void keep_alive(std::unique_ptr<Communicator> comm) { owned_comm_ = std::move(comm); }

 private:
  struct Piece {
    size_t chunk;
    int64_t offset;    // first token of the chunk in this pass
    int64_t n_tokens;
    int64_t logits_row;  // the row of its first logits token; -1: no logits
    int64_t logits_first = 0;  // the piece's first token with logits (index within the piece)
    int64_t logits_count = 0;
  };
  // What a pass hands the MTP head (uploaded before the compute, so a captured pass replays with new values).
  struct MtpPass {
    StepLayout step;          // the entries: (t[p], h[p - 1]) at position p - 1 for each pass token at p >= 1
    TensorView ids;           // I32 [M] t[p]
    TensorView hidden_rows;   // I32 [M] rows of mtp_rows_ holding h[p - 1]
    TensorView keep_rows;     // I32 [slots + spare rows] the rows of mtp_rows_ each slot's new last hidden state and
                              // each spare row's (a position checkpoint's token; else itself) come from
    // forward_argmax_carry: per logits row r of the pass, the head entry fed the row's argmax (an index into ids and
    // into the head's output rows) and the row of mtp_rows_' carry region that keeps its head output.
    bool carry = false;
    TensorView carry_entry;      // I32 [R]
    TensorView carry_slot_rows;  // I32 [R]
    // Tokens from a deferred chain (SeqChunk::device_draft_row): D of them, their flat index in chain_ids_ and their
    // pass token index; they are copied into the pass's ids before the embedding and returned after the 2 R ids.
    TensorView deferred_src, deferred_dst;  // I32 [D] each
  };
  // A pass's input embeddings that replace token embeddings (SeqChunk::embeds): values F32 [R, H] for pass rows I32 [R].
  struct PassEmbeds {
    TensorView rows, values;
  };
  // Checks the chunks; returns the number of logits rows they ask for.
  int64_t check_chunks(std::span<const SeqChunk> chunks) const;
  // Runs the passes; the last pass's logits rows (chunk order) are handed to `emit`.
  void run_passes(std::span<const SeqChunk> chunks, const std::function<void(const TensorView&,
                  const std::vector<int64_t>&)>& emit);
  // The passes over the chunks for which in_phase(index) holds (done: tokens of each chunk run so far).
  void run_phase(std::span<const SeqChunk> chunks, std::vector<int64_t>& done, const std::vector<int64_t>& logits_row,
                 const std::function<bool(size_t)>& in_phase, const std::function<int64_t(size_t)>& limit,
                 const std::function<void(const TensorView&, const std::vector<int64_t>&)>& emit);
  // pass_body's end in a forward_argmax_carry pass: the target's logits and argmax, the head's entries (the carried
  // ones fed that argmax), the carried outputs kept and drafted from; returns I32 [2 R] (target ids, next drafts).
  // deferred_got: the deferred chain's ids the pass read (I32 [D, 1]; empty: none), returned after the 2 R ids.
  TensorView carry_body(Forward& f, const MtpPass& mtp, const TensorView& normed_all, const TensorView& rows_all,
                        const TensorView& row_ids, const TensorView& deferred_got);
  void run_pass(std::span<const SeqChunk> chunks, const std::vector<Piece>& pieces,
                const std::function<void(const TensorView&, const std::vector<int64_t>&)>& emit);
  // The compute of one pass after its uploads: embedding, layers, final norm and lm_head of `row_ids`.
  TensorView pass_body(const StepLayout& step, const TensorView& id_view, const TensorView& row_ids,
                       const MtpPass* mtp, const PassEmbeds* embeds);
  void reset_slot(int slot);
  // save_state (save: the slot's live state -> its checkpoint, its spare row) and restore_state (back).
  void copy_checkpoint(int slot, bool save);
  // Copies row src of every state tensor (conv, recurrent, the MTP head's input rows) to row dst.
  void copy_state_row(int64_t src, int64_t dst);
  // The byte ranges that copy_state_row(src, dst) copies, appended to spans.
  void state_row_spans(int64_t src, int64_t dst, std::vector<Ops::CopySpan>& spans) const;

  std::unique_ptr<Communicator> owned_comm_;  // destroyed after ops_
  std::unique_ptr<Ops> ops_;
  std::unique_ptr<LoadedModel> model_;
  RunnerOptions options_;
  RunnerCapacity capacity_;
  std::vector<KvLayerView> kv_;             // per full-attention layer
  std::vector<int> kv_index_, linear_index_;  // per layer
  std::vector<TensorView> conv_state_, recurrent_state_;  // per linear layer
  // A draft chain's inputs, uploaded in one piece before any compute (a replayed chain finds them where the captured
  // one read them): each step's layout (its entries at positions pos - 1 + k), the pending tokens and the rows of
  // mtp_rows_ holding each sequence's last hidden state.
  struct DraftInputs {
    std::vector<StepLayout> steps;
    TensorView first_ids;    // I32 [S]
    TensorView slot_rows;    // I32 [S]
    TensorView hidden_rows;  // I32 [S] the rows of mtp_rows_ the first step's hidden states come from
  };
  // Checks a draft's sequences; the pages per sequence its positions reach (the most of any sequence; 0: none).
  int check_draft(std::span<const DraftSeq> seqs, int steps) const;
  // hidden_rows: the rows of mtp_rows_ holding each sequence's first hidden state (empty: its slot's last one).
  DraftInputs upload_draft(std::span<const DraftSeq> seqs, int steps, int pages_per_seq,
                           std::span<const int32_t> hidden_rows = {});
  // The chain's compute: step k runs the head over (ids, hidden), step 0's being the pending tokens and each slot's
  // last hidden state, then lm_head; pick(k, logits [S, V local]) returns the I32 [S] device ids step k + 1 embeds.
  void draft_body(const DraftInputs& in, const std::function<TensorView(int, const TensorView&)>& pick);
  // The chain with each step's ids chosen on the host (draft() with logits, draft_rank()): next(step, logits [S, V
  // local], chosen ids) picks them; eager.
  void draft_chain(std::span<const DraftSeq> seqs, int steps,
                   const std::function<void(int, const TensorView&, std::span<int32_t>)>& next);
  // draft() without logits: each step's argmax stays on the device (Ops::argmax_rows_into) and feeds the next step, the
  // S x steps ids come back in one download, and the whole chain is captured and replayed as one graph per shape.
  // defer: the ids stay in chain_ids_ for the next forward_argmax_carry (nothing is downloaded; tokens unused).
  void draft_device(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens,
                    std::span<const int32_t> hidden_rows = {}, bool defer = false);
  // The chain after carried first drafts: the sequences one step on, and the carry rows their hidden states are in.
  void carried_chain_inputs(std::span<const DraftSeq> seqs, std::vector<DraftSeq>& next,
                            std::vector<int32_t>& hidden_rows) const;
  // draft() of sequences with carried first drafts (DraftSeq::carried_row): the first drafts as they are, then the
  // device chain of steps - 1 from the head outputs the carrying step kept.
  void draft_carried(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens);
  // Spare state rows (with an MTP head: one per slot, rows [slots, 2 slots) of every state tensor and of mtp_rows_):
  // save_state's checkpoints, or the current forward call's position checkpoints, handed out in order.
  int64_t spare_rows_ = 0;
  int64_t spare_used_ = 0;
  // The position checkpoints of the last forward call: per slot, the spare row holding the state after each of its
  // chunk's tokens but the last.
  std::map<int, std::vector<int64_t>> kept_;
  // Per chunk of this call: the chunk offset from which its snapshots are written in the pass as position checkpoints
  // (the rest of the chunk then runs whole in one pass, the delta rule as the recurrence): 0 for a short chunk, its
  // first snapshot for a long one whose later snapshots lie in a short tail, its size for none. Snapshots at or before
  // it are state copies after the pass that ends there (run_passes).
  std::vector<int64_t> in_pass_from_;
  bool in_pass_piece(std::span<const SeqChunk> chunks, const Piece& p) const {
    return in_pass_from_[p.chunk] < static_cast<int64_t>(chunks[p.chunk].tokens.size()) &&
           p.offset >= in_pass_from_[p.chunk];
  }
  // With an MTP head: rows [0, slots) hold each slot's last hidden state (final norm's output at its last run
  // position), then the spare rows, then the current pass's rows, then (runners that can carry drafts) the carry
  // region: per slot, carry_rows_per_slot_ rows, row i the head's output (g) of the entry fed the argmax of the
  // slot's chunk's logits row i in the last forward_argmax_carry. F32 [2 slots + prefill_chunk + carry rows, H].
  TensorView mtp_rows_;
  int64_t carry_rows_per_slot_ = 0;  // 0: no carrying (no head, or a tensor-parallel rank)
  int64_t carry_row0_ = 0;           // the carry region's first row in mtp_rows_
  bool carry_ = false;               // the passes running belong to a forward_argmax_carry call
  // Where device draft chains leave their ids (I32 [kGraphMaxTokensPerSeq * slots]: step k's ids of S sequences at
  // [k S, (k + 1) S)), and the chain draft_deferred left there for the next forward_argmax_carry (0 sequences: none).
  TensorView chain_ids_;
  int64_t deferred_seqs_ = 0, deferred_steps_ = 0;
  std::vector<int64_t> pass_deferred_out_;  // the pass's deferred tokens: their index in device_drafts
  TraceFn trace_;
  // Captured passes, by shape: decode passes (one token and its logits per sequence) and speculative verify passes
  // (every sequence the same few tokens, all with logits, maybe keeping position checkpoints).
  // And draft chains (draft_steps > 0: the MTP head's chain of that many steps, one token per sequence each).
  struct GraphKey {
    int seqs = 0, pages = 0, tokens_per_seq = 1;
    bool checkpoints = false;
    int draft_steps = 0;
    bool mrope = false;  // three rope positions per token (sequences with images)
    bool carry = false;  // a forward_argmax_carry pass (its output: target and next-draft ids)
    int deferred = 0;    // tokens read from a deferred draft chain
    auto operator<=>(const GraphKey&) const = default;
  };
  struct Graph {
    int handle = -1;
    TensorView out;  // where the replayed pass leaves its logits (a draft chain: its ids)
  };
  std::map<GraphKey, Graph> graphs_;
  std::map<GraphKey, int> graph_seen_;
  // The pages per sequence a captured step is laid out for: `pages` rounded up to a power of two (at most the
  // context's), so that a few graphs serve every context length.
  int graph_pages(int pages) const;
  // Runs body (the compute after a step's uploads; it returns the step's output view) eagerly, or, when graphable,
  // from the graph captured for `key`: the first run of a shape is eager, the second is captured and launched, later
  // ones replay it (a stale graph is captured again).
  TensorView run_graphed(bool graphable, const GraphKey& key, const std::function<TensorView()>& body);
  bool graphs_enabled_ = true;  // eager runs per shape before capturing
};

}  // namespace kiln::model
