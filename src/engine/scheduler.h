// Continuous-batching scheduler: pure host logic over request lists (no model, no threads), so every
// policy below is unit-tested with plain data.
//
// Policy
//  - Waiting queue: FIFO, bounded (max_queued_requests; beyond it the engine answers "queue full").
//  - Admission, between steps, in arrival order: a sequence joins the running batch when a running
//    place (max_running_requests), a recurrent-state slot and KV pages for its first prompt chunk (plus
//    one page of headroom per running sequence) are free or can be freed by evicting the prefix cache.
//    The head of the queue blocks the ones behind it (no overtaking: no starvation).
//  - Pages are allocated as a sequence grows, one page at a time, not reserved for max_tokens. When the
//    pool runs out: the prefix cache is evicted first (LRU); then the newest running sequence is
//    preempted: its pages and slot are freed (its KV and state handed to the prefix cache when it is on),
//    and it goes back to the front of the queue to recompute prompt + tokens generated so far, then goes
//    on generating (nothing already sent is sent again; greedy output does not change).
//  - A sequence that can never fit (prompt + max_tokens over the context length, or more pages than
//    the whole pool) is rejected before it is queued (check_fits) with the numbers.
//  - Per-step token budget (chunked_prefill_size, decodes included): each step carries one token for every
//    running sequence that is decoding, then prompt chunks for the sequences still prefilling, oldest first,
//    up to (budget - decode tokens) prompt tokens in all. Long prompts are thus prefilled over several steps
//    while running decodes keep flowing, and a step's size (what its decodes wait for) stays within the
//    budget. Every decode is in every step: when the decodes alone leave less than one page of the budget, the
//    step still takes one page (page_size tokens) of prompt so that prompts are never starved; only then does a
//    step exceed the budget (decodes + page_size tokens at most). chunked_prefill_size <= 0: no budget (whole
//    prompts in one step). While any running sequence is decoding, the budget is step_budget_while_decoding when that
//    is smaller (> 0): a step's decodes then wait for fewer prompt tokens (the ITL of running streams stays bounded
//    while long prompts arrive), and a prompt that arrives alone still gets the whole budget.
//  - Prefix cache (engine/prefix_cache.h, when on): at admission a sequence takes the longest cached
//    prefix that ends at a state snapshot: its page table starts with the cached pages (shared, locked),
//    the snapshot is copied into its own slot (StepPlan::restores) and only the rest is prefilled. Its
//    state is snapshotted at page boundaries (StepPlan::saves), into at most max_snapshots_per_sequence
//    slots of its own: the prompt's chunks stop at the prompt's second-to-last page boundary (one page or
//    more before its end) and at its last one so that the state there is saved; further boundaries
//    (decode) replace the newest snapshot but never the second-to-last boundary's. When the sequence ends
//    or is preempted its full pages up to its deepest snapshot go to the tree with all its snapshots.
//    Why two: the next turn of a conversation re-sends this prompt + the answer + a new message, but
//    re-tokenized text (the answer's, a last word merging with what follows) or a chat template's
//    generation-prompt tail (`<|im_start|>assistant\n<think>\n`, rendered otherwise for a past turn) makes
//    the new prompt leave this one's tokens within its last page; a snapshot a page or more before the end
//    still matches, one deep in the answer matches when the client re-sends the same token ids.
//  - Speculative decoding (decode_lookahead > 0): a decode also takes pages for the positions its verify may write,
//    from free pages only; the engine drafts no further than the pages reach. Its accepted drafts count as computed
//    (commit_accepted). A decode with a boundary snapshot planned is verified without drafts (the save copies the
//    state after exactly one token).
//  - A cancelled sequence (abort_requested) leaves at the next step and frees everything it held.
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/kv_pool.h"
#include "engine/prefix_cache.h"
#include "engine/request.h"

namespace kiln::engine {

class RequestChannel;
class SequenceSampler;  // engine/sampler.h

// The step budget of an engine made without one (tests, library use). kiln's commands resolve --chunked-prefill-size
// per device instead (backend::resolve_prefill_sizes: auto is 8192 on a GPU of 80 GB or more, 2048 below, 512 on
// the CPU) and pass the result in.
constexpr int64_t kDefaultChunkedPrefillSize = 2048;

// A running sequence's own state slot plus, with the prefix cache, the page-boundary snapshots it keeps in slots of
// its own (see the policy above).
constexpr int kDefaultMaxSnapshotsPerSequence = 2;
// State slots kiln serve plans per running request (serve and inspect's plan of serve use this one rule).
constexpr int state_slots_per_request(bool prefix_cache) {
  return prefix_cache ? 1 + kDefaultMaxSnapshotsPerSequence : 1;
}

struct SchedulerOptions {
  int max_running_requests = 64;
  int max_queued_requests = 256;
  // Tokens per step, decodes + prompt chunks (the policy above); <= 0: whole prompts in one step.
  int64_t chunked_prefill_size = kDefaultChunkedPrefillSize;
  // The budget of steps that carry decodes, when smaller (the policy above); <= 0: chunked_prefill_size's.
  int64_t step_budget_while_decoding = 0;
  int64_t context_length = 4096;        // longest sequence (prompt + output), tokens
  int64_t kv_pages = 0;
  int page_size = 16;
  int state_slots = 0;
  bool prefix_cache = false;  // radix cache over KV pages + state snapshots
  bool needs_state = true;    // the model has recurrent state: a cache hit needs a snapshot
  // State slots a running sequence may hold for its pending snapshots (besides its own state slot). The engine
  // gives state_slots / max_running_requests - 1, so that running sequences never hold the slots that
  // admitting more needs.
  int max_snapshots_per_sequence = kDefaultMaxSnapshotsPerSequence;
  // The runner writes snapshots inside a chunk (model::ModelRunner::chunk_snapshots): a prompt chunk is not cut at the
  // page boundaries the cache snapshots (its second-to-last and last); the snapshots ride in the chunk
  // (PlannedChunk::snapshots), so a prompt takes one step, not two or three. false: the chunk stops there.
  bool chunk_snapshots = false;
  // Speculative decoding: a decode may verify this many positions past its token (the engine's draft length at
  // most). Each decode then takes pages for them when free pages are there (never by evicting the cache or
  // preempting: a decode without them just drafts fewer), and counts 1 + this many tokens in the step's budget.
  int decode_lookahead = 0;
};

using Clock = std::chrono::steady_clock;

// One sequence (one of the n choices of a request) as the scheduler and engine see it.
struct Sequence {
  Sequence();
  ~Sequence();  // frees the sampler (defined where SequenceSampler is complete)

  uint64_t uid = 0;
  int index = 0;                            // within its submission (TokenEvent::index)
  GenerateRequest request;
  std::shared_ptr<RequestChannel> channel;  // may be null in scheduler tests
  std::vector<int32_t> tokens;              // prompt, then generated tokens
  int64_t prompt_len = 0;
  int64_t num_cached = 0;                   // leading tokens whose KV / state the runner holds
  int64_t num_generated = 0;
  // Tokens to prefill before decoding: the prompt, or after a preemption every token so far.
  int64_t prefill_target = 0;
  std::vector<int32_t> pages;               // page table: the pages of [0, num_cached) and of this step
  int state_slot = -1;
  // Prefix cache: the tree nodes whose pages lead the page table (locked while running), the slots with
  // the state after `pos` tokens (page boundaries, ascending; `keep`: the prompt's second-to-last boundary,
  // which later saves do not replace), the prompt tokens found cached at first admission.
  struct Snapshot {
    int64_t pos = 0;
    int slot = -1;
    bool keep = false;
  };
  std::vector<PrefixCache::Node*> cache_path;
  std::vector<Snapshot> snaps;
  int64_t cached_tokens = 0;
  bool admitted_once = false;
  int preemptions = 0;
  bool abort_requested = false;
  uint64_t seed = 0;
  // Speculative decoding: the first draft a greedy step carried for this sequence (ModelRunner::forward_argmax_carry:
  // next_drafts of the row of its last token) and that row's index in its chunk's logits rows. Valid in the engine
  // step right after carried_step, while the sequence keeps carried_slot.
  int32_t carried_draft = -1;
  int carried_row = -1;
  int carried_slot = -1;
  uint64_t carried_step = 0;
  // Made once when the engine takes the sequence (before it is queued), kept through preemptions, freed with the
  // sequence. Null in scheduler tests.
  std::unique_ptr<SequenceSampler> sampler;

  // Image inputs (request.images, engine/image_inputs.h), set when the engine takes the sequence: the encoded
  // placeholder embeddings in prompt order (image_embeds [image tokens, hidden]), their prompt indices (ascending),
  // their prefix-cache key ids (negative: never a real token; from the image's content hash), the prompt's M-RoPE
  // positions [prompt_len * 3] and the rope delta of every later token. All empty for text prompts.
  std::vector<float> image_embeds;
  std::vector<int32_t> image_token_index, image_token_key, mrope_pos;
  int32_t rope_delta = 0;
  bool has_images() const { return !image_token_index.empty(); }
  // The M-RoPE positions of this step's chunk (the runner reads them through SeqChunk spans) and the chunk-relative
  // offsets of its image tokens.
  std::vector<int32_t> step_mrope_pos, step_embed_offsets;

  Clock::time_point submitted_at{};
  Clock::time_point admitted_at{};
  Clock::time_point last_token_at{};
  bool has_first_token = false;

  bool prefilling() const { return num_cached < prefill_target; }
};

// A state-slot copy the runner makes (ModelRunner::copy_state).
struct StateCopy {
  int src = -1;
  int dst = -1;
};

// One sequence's share of a step: tokens [start_pos, start_pos + num_tokens) of seq->tokens.
// A snapshot inside a planned chunk (SchedulerOptions::chunk_snapshots): the sequence's state after the chunk's first
// `tokens` tokens goes into `slot` during the step.
struct PlannedSnapshot {
  int64_t tokens = 0;
  int slot = -1;
};

struct PlannedChunk {
  Sequence* seq = nullptr;
  int64_t start_pos = 0;
  int64_t num_tokens = 0;
  bool want_logits = false;  // the chunk ends the prompt, or it is a decode token
  std::vector<PlannedSnapshot> snapshots;  // ascending tokens, each inside (0, num_tokens)
};

struct StepPlan {
  std::vector<StateCopy> restores;   // before the forward, in order: cached snapshots into new sequences' slots
  std::vector<PlannedChunk> chunks;  // decodes first, then prefill chunks
  std::vector<StateCopy> saves;      // after the forward: sequences' slots into their boundary snapshots
  int num_decodes = 0;
  int64_t num_prefill_tokens = 0;
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);

  const SchedulerOptions& options() const { return opts_; }

  // Pages a sequence of this size needs at its longest.
  int64_t pages_for(int64_t prompt_len, int64_t max_tokens) const;
  // Empty if such a sequence can run once the engine is idle; otherwise why it never can (one line,
  // with the numbers).
  std::string check_fits(int64_t prompt_len, int64_t max_tokens) const;
  // Whether n more sequences fit in the waiting queue.
  bool queue_has_room(int n) const;

  void enqueue(std::unique_ptr<Sequence> seq);

  // Removes every sequence with abort_requested (waiting or running), freeing pages and slots.
  std::vector<std::unique_ptr<Sequence>> take_aborted();
  // Admits waiting sequences while capacity allows, then plans one step (may be empty).
  StepPlan plan_step(Clock::time_point now = Clock::now());
  // Records that the runner processed the planned chunks.
  void commit_step(const StepPlan& plan);
  // After commit_step: a decode's verify also kept `tokens` accepted draft tokens (speculative decoding), which the
  // engine appends to the sequence; they are computed (their KV and state are the runner's).
  void commit_accepted(Sequence* seq, int64_t tokens);
  // Removes a running sequence (finished or failed), freeing its pages and slot. cache: hand its KV and
  // state to the prefix cache (false after a failed step: its memory may be garbage).
  std::unique_ptr<Sequence> release(Sequence* seq, bool cache = true);
  // Removes every sequence (shutdown, runner failure), freeing everything.
  std::vector<std::unique_ptr<Sequence>> release_all();

  void for_each_sequence(const std::function<void(Sequence&)>& fn);
  // Drops every cached prefix and gives its pages and snapshot slots back (SGLang's flush_cache). Only while idle (no
  // sequence holds cached pages); returns the pages freed.
  int64_t flush_prefix_cache();

  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  int num_running() const { return static_cast<int>(running_.size()); }
  // Pages / slots that running sequences hold (cached pages they share count; the rest of the cache not).
  int64_t kv_pages_used() const { return pages_.num_used() - (cache_ ? cache_->evictable_pages() : 0); }
  int64_t kv_pages_total() const { return pages_.size(); }
  int64_t kv_pages_free() const { return pages_.num_free(); }
  int state_slots_used() const {
    return static_cast<int>(slots_.num_used() - (cache_ ? cache_->num_snapshots() : 0));
  }
  bool idle() const { return waiting_.empty() && running_.empty(); }

  struct Counters {
    uint64_t preemptions = 0;
    uint64_t cache_query_tokens = 0;  // prompt tokens looked up at first admission
    uint64_t cache_hit_tokens = 0;    // of them, found cached
  };
  const Counters& counters() const { return counters_; }
  const PrefixCache* prefix_cache() const { return cache_.get(); }

 private:
  void admit(Clock::time_point now, StepPlan& plan);
  void plan_chunks(StepPlan& plan);
  void free_resources(Sequence& seq, bool cache);
  // Gives seq pages up to `tokens` positions, evicting the cache if needed; false when they cannot be had.
  bool grow_pages(Sequence& seq, int64_t tokens);
  bool take_slot(int& slot);  // a free slot, evicting a cached snapshot if needed
  void preempt(size_t running_index);
  void give_back(std::vector<int32_t>& pages, std::vector<int32_t>& slots);

  SchedulerOptions opts_;
  IdPool pages_;
  IdPool slots_;
  std::unique_ptr<PrefixCache> cache_;
  Counters counters_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order
};

}  // namespace kiln::engine
