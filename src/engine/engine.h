// The engine loop: one thread owns the ModelRunner (and so its KV pool and state slots) and runs
// continuous-batching steps; client threads submit requests and read their tokens through a
// RequestChannel. No HTTP, no JSON.
//
//   Engine engine(std::move(runner), opts);
//   engine.start();
//   SubmitResult r = engine.submit({request});          // n requests = n choices of one channel
//   if (r.status != SubmitStatus::ok) ... r.message
//   std::vector<TokenEvent> events; r.channel->wait(events, 100ms); ...
//
// A bad request never stops the loop: errors in the runner or the sampler end the affected
// sequences with FinishReason::error (and a message); the loop goes on.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/thread_pool.h"
#include "engine/channel.h"
#include "engine/metrics.h"
#include "engine/request.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/speculative.h"
#include "model/model_runner.h"

namespace kiln::engine {

struct EngineOptions {
  int max_running_requests = 64;
  int max_queued_requests = 256;
  int64_t chunked_prefill_size = kDefaultChunkedPrefillSize;  // tokens per step, decodes included (scheduler.h)
  int64_t step_budget_while_decoding = 0;  // the budget of steps with decodes when smaller (scheduler.h); <= 0: none
  int64_t context_length = 0;          // 0: the runner's max_context; never more than it
  std::vector<int32_t> eos_token_ids;  // end a sequence unless ignore_eos
  // Threads (a pool made once, the engine thread included) that sample a step's rows on the host when the step has
  // >= 128k logits (each row with its own sampler and logits, so the draws are the same for any count).
  // 0: min(8, hardware threads).
  int sampling_threads = 0;
  // Prefix cache over KV pages + state snapshots (SGLang's radix cache; --disable-radix-cache turns it off).
  // Needs a runner that can copy state slots; otherwise it is off.
  bool enable_prefix_cache = true;
  // With the prefix cache on a model with recurrent state: the prompt's snapshotted page boundaries are saved inside
  // the step (SchedulerOptions::chunk_snapshots) where the runner can; false cuts the prompt there (one more step per
  // prompt; --disable-chunk-snapshots, for A/B runs).
  bool chunk_snapshots = true;
  // Speculative decoding with the model's MTP head (engine.cpp's speculative step; SGLang's
  // --speculative-num-steps): the most draft tokens per sequence per step, 0 = off. Needs a runner with an MTP head
  // (ModelRunner::mtp_layers). Each step drafts 0 .. this many, chosen from measured step costs
  // (DraftLengthChooser) unless draft_length_for_step says, or every step drafts this many when speculative_adaptive is
  // false (--speculative-fixed-steps, SGLang's behaviour).
  int speculative_num_steps = 0;
  bool speculative_adaptive = true;
  // Greedy steps carry the next step's first draft (ModelRunner::forward_argmax_carry, on runners that can): the MTP
  // head's entry after each row's token runs inside the step, so the next step's chain is one step shorter (with
  // K = 1, no chain at all). --disable-draft-carry turns it off.
  bool speculative_carry = true;
  // With carrying: the step's draft chain stays on the device and the verify pass reads it there
  // (ModelRunner::draft_deferred), so no host round trip lies between them. --disable-draft-defer turns it off.
  bool speculative_defer_chain = true;
  // Tests and benchmarks: the draft length of every step from its number of decoding sequences (clamped to
  // 0 .. speculative_num_steps), instead of the adaptive choice.
  std::function<int(int batch)> draft_length_for_step;
};

enum class SubmitStatus { ok, queue_full, invalid, draining };

struct SubmitResult {
  SubmitStatus status = SubmitStatus::ok;
  std::string message;                      // why, when status != ok
  std::shared_ptr<RequestChannel> channel;  // when ok
};

class Engine {
 public:
  Engine(std::unique_ptr<model::ModelRunner> runner, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void start();

  // Queues the sequences (the n choices of one client request) as one unit: all or none. Thread-safe.
  // invalid: a sequence can never run (too long, empty, token ids out of range): the message has the
  // numbers. queue_full: the waiting queue has no room now (retry later). draining: shutting down.
  SubmitResult submit(std::vector<GenerateRequest> sequences);

  // Why a sequence of this size can never run here (empty when it can). Thread-safe.
  std::string check_fits(int64_t prompt_len, int64_t max_tokens) const;

  // Stops taking requests, lets running and queued ones finish for up to `timeout`, then aborts the
  // rest (their clients get FinishReason::abort). Returns true when everything finished in time.
  bool drain(std::chrono::milliseconds timeout);
  // Aborts everything and joins the loop thread. Called by the destructor.
  void stop();

  // Empties the prefix cache on the engine thread (SGLang's /flush_cache). Only when no request is running or
  // waiting (false otherwise, and when the engine stops or does not answer within `timeout`). Thread-safe.
  bool flush_prefix_cache(std::chrono::milliseconds timeout = std::chrono::seconds(10));

  EngineMetricsSnapshot metrics() const;
  const EngineOptions& options() const { return opts_; }
  int64_t context_length() const { return opts_.context_length; }
  int64_t vocab_size() const { return vocab_size_; }
  const model::RunnerCapacity& capacity() const { return capacity_; }
  std::string describe() const { return runner_->describe(); }
  // The runner's fatal error ("" while it works; model_runner.h), for /health. Any thread.
  std::string fatal_error() const { return runner_->fatal_error(); }
  // Each rank's device memory (model::ModelRunner::device_memory; empty on the CPU).
  std::vector<model::DeviceMemory> device_memory() const { return runner_->device_memory(); }
  bool draining() const { return draining_.load(); }

 private:
  // How a step's tokens come back from the runner (choose_output_mode).
  enum class OutputMode {
    argmax,         // every row greedy and plain: forward_argmax, only the ids come back
    device_sample,  // no penalties / logprobs / active grammar, some rows sample: forward_sample
    host_logits,    // some row needs its logits on the host: forward, then each row's SequenceSampler
  };
  // One sequence's share of a step's output: one logits row, or for a speculative verify row the K + 1 rows of its
  // chunk [pending token, d_1 .. d_K], from which it chooses 1 .. K + 1 tokens (the accepted drafts and the target's
  // next token); emit_row sends them in order.
  struct StepRow {
    Sequence* seq = nullptr;
    size_t chunk = 0;                  // its chunk in chunks_
    size_t output = 0;                 // its first row in the runner's outputs (runner_tokens_ / logits_)
    bool completes_prompt = false;     // its chunk ends at the prompt's last token
    int draft_k = 0;                   // drafts verified (0: a plain row)
    int device_draft_row = -1;         // its drafts after the first are row this of the deferred chain (forward fills)
    std::vector<int32_t> verify_tokens;  // [pending, d_1 .. d_K] (the chunk's tokens) when draft_k > 0
    int accepted = 0;                  // drafts accepted (choose_tokens)
    std::vector<SampleResult> tokens;  // chosen this step, in order
    std::string error;                 // choosing failed: the sequence ends with FinishReason::error
  };

  void loop();
  std::vector<std::unique_ptr<Sequence>> wait_for_work(bool& stopping, bool& abort_all);
  void take_incoming(std::vector<std::unique_ptr<Sequence>> arrived);
  void end_cancelled(bool abort_all);
  void answer_flush();
  std::string check_request(const GenerateRequest& request) const;

  // The step (engine.cpp's opening comment names the phases).
  void run_step(const StepPlan& plan);
  void build_rows(const StepPlan& plan);
  int step_draft_length(const StepPlan& plan);
  int row_draft_length(const StepPlan& plan, const PlannedChunk& c, int k) const;
  OutputMode choose_output_mode() const;
  bool draft(const StepPlan& plan, OutputMode mode);
  bool forward(const StepPlan& plan, OutputMode mode);
  void choose_tokens(OutputMode mode);
  void choose_token(StepRow& row, OutputMode mode);
  void choose_speculative(StepRow& row, OutputMode mode);
  void settle_speculation();
  void end_step_sequences(const StepPlan& plan, const std::string& what, const std::exception& e);
  void emit_rows();
  bool emit_row(StepRow& row, Clock::time_point now);
  // last_of_row: the row's last token (a verify row's grammar state is its last token's).
  bool emit_token(Sequence& seq, SampleResult& chosen, Clock::time_point now, bool last_of_row);
  FinishReason finish_reason_after(const Sequence& seq, bool last_of_row) const;

  // Sends the final event and records the finish; the sequence's sampler goes with the sequence.
  void finish(Sequence& seq, FinishReason reason, const std::string& error = {});
  void count_finished(const Sequence& seq, FinishReason reason, Clock::time_point now);
  void observe_token_time(Sequence& seq, TokenEvent& event, Clock::time_point now);
  void send(const Sequence& seq, TokenEvent event);
  void publish_gauges();  // engine thread, takes mu_
  void flush_outbox();    // engine thread: delivers the step's events

  std::unique_ptr<model::ModelRunner> runner_;
  EngineOptions opts_;
  model::RunnerCapacity capacity_;
  int64_t vocab_size_ = 0;
  Scheduler scheduler_;  // engine thread only (check_fits is const and reads immutable options)

  mutable std::mutex mu_;
  std::condition_variable cv_;       // new work / stop
  std::condition_variable cv_idle_;  // drain waits on it
  std::vector<std::unique_ptr<Sequence>> incoming_;
  int published_waiting_ = 0;  // scheduler's waiting queue size after the last step
  bool published_idle_ = true;
  bool stop_requested_ = false;
  uint64_t flushes_asked_ = 0, flushes_done_ = 0;  // flush_prefix_cache requests, answered by the loop
  bool last_flush_ok_ = false;
  bool abort_all_ = false;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> next_uid_{1};
  uint64_t seed_base_ = 0;
  std::thread thread_;

  // Engine-thread state, reused from step to step.
  ThreadPool sampling_pool_;                  // opts_.sampling_threads, the engine thread included
  std::vector<model::SeqChunk> chunks_;       // the runner's chunks
  std::vector<StepRow> rows_;                 // one per chunk that wants logits, in chunk order
  std::vector<model::RowSampling> row_sampling_;  // device_sample: each row's parameters and uniform
  std::vector<int32_t> runner_tokens_;        // argmax / device_sample: the runner's token per row (-1: none)
  std::vector<float> logits_;                 // host_logits: [rows, vocab]
  std::vector<std::pair<std::shared_ptr<RequestChannel>, TokenEvent>> outbox_;  // events of this step

  // Metrics (gauges published under mu_, counters atomic, histograms have their own locks).
  EngineMetricsSnapshot gauges_;
  std::atomic<uint64_t> prompt_tokens_{0}, generation_tokens_{0}, steps_{0};
  std::atomic<uint64_t> finished_[5] = {};
  std::atomic<uint64_t> rejected_queue_full_{0}, rejected_too_long_{0};
  std::atomic<uint64_t> spec_draft_tokens_{0}, spec_accepted_tokens_{0}, spec_carried_drafts_{0};
  Histogram ttft_, itl_, e2e_, queue_time_;
  Histogram spec_accept_length_;  // tokens per verified sequence per step (accepted drafts + 1)
  Histogram spec_step_draft_length_;  // the draft length K chosen for each step with decode rows (0: a plain step)

  // Speculative decoding (engine thread).
  DraftLengthChooser draft_chooser_;
  int step_k_ = 0;  // the draft length chosen for the step being run
  // The runner's position checkpoints (ModelRunner::position_checkpoints) when speculating: a step's drafts, summed
  // over its rows, stay within them; 0: save_state / restore_state and a replay.
  int position_checkpoints_ = 0;
  // Greedy steps carry the next step's first drafts (EngineOptions::speculative_carry and a runner that can).
  bool carry_drafts_ = false;
  bool step_carried_ = false;               // this step ran forward_argmax_carry
  bool step_uncarried_drafts_ = false;      // this step drafted some rows without a carried first draft
  uint64_t step_serial_ = 0;                // run_step calls so far (a carried draft is valid in the next one)
  std::vector<int32_t> runner_next_drafts_;  // forward_argmax_carry: each row's next first draft
  // A draft chain left on the device this step (ModelRunner::draft_deferred): its sequences and steps, and its ids
  // as forward_argmax_carry returns them.
  int64_t deferred_seqs_ = 0, deferred_steps_ = 0;
  std::vector<int32_t> runner_device_drafts_;
  // Whether the sequence's carried first draft belongs to this step (carried by the step before, same slot).
  bool has_carried_draft(const Sequence& seq) const;
  void keep_carried_drafts();  // after the tokens are chosen and the state settled
  struct StepTimes {
    double draft_s = 0, forward_s = 0, replay_s = 0;
    int64_t replay_tokens = 0;
  } step_times_;
};

}  // namespace kiln::engine
