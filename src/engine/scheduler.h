// Continuous-batching scheduler: pure host logic over request lists (no model, no threads), so every
// policy below is unit-tested with plain data.
//
// Policy
//  - Waiting queue: FIFO, bounded (max_queued_requests; beyond it the engine answers "queue full").
//  - Admission, between steps, in arrival order: a sequence joins the running batch when a running
//    place (max_running_requests), a recurrent-state slot and KV pages for its whole budget
//    (prompt + max_tokens, capped at the context length) are free. Reserving the whole budget up
//    front means a running sequence never runs out of pages, so nothing is ever preempted or
//    recomputed; the price is that pages reserved for max_tokens the request never uses sit idle
//    until it ends. The head of the queue blocks the ones behind it (no overtaking: no starvation).
//  - A sequence that can never fit (prompt + max_tokens over the context length, or more pages than
//    the whole pool) is rejected before it is queued (check_fits) with the numbers.
//  - Each step = one token for every running sequence that is decoding + prompt chunks for the
//    sequences still prefilling, oldest first, up to chunked_prefill_size prompt tokens in all. Long
//    prompts are thus prefilled over several steps while running decodes keep flowing.
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
#include "engine/request.h"

namespace kiln::engine {

class RequestChannel;

struct SchedulerOptions {
  int max_running_requests = 64;
  int max_queued_requests = 256;
  int64_t chunked_prefill_size = 2048;  // prompt tokens per step; <= 0: whole prompts in one step
  int64_t context_length = 4096;        // longest sequence (prompt + output), tokens
  int64_t kv_pages = 0;
  int page_size = 16;
  int state_slots = 0;
};

using Clock = std::chrono::steady_clock;

// One sequence (one of the n choices of a request) as the scheduler and engine see it.
struct Sequence {
  uint64_t uid = 0;
  int index = 0;                            // within its submission (TokenEvent::index)
  GenerateRequest request;
  std::shared_ptr<RequestChannel> channel;  // may be null in scheduler tests
  std::vector<int32_t> tokens;              // prompt, then generated tokens
  int64_t prompt_len = 0;
  int64_t num_cached = 0;                   // leading tokens whose KV / state the runner holds
  int64_t num_generated = 0;
  std::vector<int32_t> pages;               // page table, covers the whole reserved budget
  int state_slot = -1;
  bool abort_requested = false;
  uint64_t seed = 0;

  Clock::time_point submitted_at{};
  Clock::time_point admitted_at{};
  Clock::time_point last_token_at{};
  bool has_first_token = false;

  bool prefilling() const { return num_cached < prompt_len; }
  // The budget this sequence reserves: prompt + max_tokens, capped at the context length.
  int64_t reserved_tokens(int64_t context_length) const;
};

// One sequence's share of a step: tokens [start_pos, start_pos + num_tokens) of seq->tokens.
struct PlannedChunk {
  Sequence* seq = nullptr;
  int64_t start_pos = 0;
  int64_t num_tokens = 0;
  bool want_logits = false;  // the chunk ends the prompt, or it is a decode token
};

struct StepPlan {
  std::vector<PlannedChunk> chunks;  // decodes first, then prefill chunks
  int num_decodes = 0;
  int64_t num_prefill_tokens = 0;
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);

  const SchedulerOptions& options() const { return opts_; }

  // Pages a sequence of this size reserves.
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
  // Removes a running sequence (finished or failed), freeing its pages and slot.
  std::unique_ptr<Sequence> release(Sequence* seq);
  // Removes every sequence (shutdown, runner failure), freeing everything.
  std::vector<std::unique_ptr<Sequence>> release_all();

  void for_each_sequence(const std::function<void(Sequence&)>& fn);

  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  int num_running() const { return static_cast<int>(running_.size()); }
  int64_t kv_pages_used() const { return pages_.num_used(); }
  int64_t kv_pages_total() const { return pages_.size(); }
  int state_slots_used() const { return static_cast<int>(slots_.num_used()); }
  bool idle() const { return waiting_.empty() && running_.empty(); }

 private:
  void admit(Clock::time_point now);
  void free_resources(Sequence& seq);

  SchedulerOptions opts_;
  IdPool pages_;
  IdPool slots_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order
};

}  // namespace kiln::engine
