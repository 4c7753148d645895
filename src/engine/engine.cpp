// The engine loop and its step.
//
// loop(): take new sequences (each gets its sampler here, once), end the cancelled ones, plan a step
// (Scheduler::plan_step), run it, publish gauges and deliver the step's events.
//
// run_step(plan), one named phase each:
//   1. build_rows          the runner's chunks (page tables) for the plan, and a StepRow for every chunk that wants
//                          logits (row i is the runner's output i);
//   2. choose_output_mode  argmax (every row greedy and plain), device_sample (no row needs penalties, logprobs, an
//                          active grammar or min_tokens still to reach) or host_logits;
//   3. forward             state restores, the runner's forward in that mode, state saves; a failure ends the
//                          step's sequences with FinishReason::error;
//   4. choose_tokens       each row's token(s): the runner's, or its sampler on the host logits (eos / stop ids
//                          masked while min_tokens are not reached: mask_ending_tokens), rows spread over
//                          the sampling thread pool (each row has its own seeded sampler: the tokens do not depend on
//                          the thread count);
//   5. emit_rows           every chosen token appended, timed and sent in order, the stop / length checks after each
//                          token; finished sequences released.
//
// Speculative decoding (EngineOptions::speculative_num_steps > 0, a runner with an MTP head) adds to the same step:
//   - build_rows picks the step's draft length K (DraftLengthChooser from the measured step costs, or the test
//     hook) and each decode row's own k <= K: 0 for rows the drafter cannot serve exactly (penalties, a logit bias,
//     a grammar, sampling with logprobs, min_tokens not reached yet, a boundary snapshot planned this step) and no
//     more than its free KV pages, max_tokens and the context allow; prefill rows are plain;
//   - draft (a phase before forward): the MTP head drafts k greedy tokens per row (ModelRunner::draft); the row's
//     chunk becomes the verify chunk [pending, d_1 .. d_k] with logits for all k + 1 positions. After a greedy step
//     that carried (forward_argmax_carry, below) d_1 is already known and the chain runs k - 1 steps; when that is
//     the step's one chain, its ids stay on the device (draft_deferred) and forward fills them into the rows;
//   - forward: a runner with position checkpoints keeps the state after each verify token (the chunks'
//     checkpoint_positions); otherwise each drafting row's recurrent state is checkpointed (save_state) first. A
//     greedy step on a runner that can also runs the head's entry after each row's argmax (forward_argmax_carry), so
//     keep_carried_drafts can hand each sequence the first draft of its next step;
//   - choose_speculative accepts by engine/speculative.h's rules: greedy rows while d_j is the target's argmax,
//     then the target's token (host rows through the sampler, so logprobs are the target's); sampling rows by
//     rejection sampling against the sampler's filtered distribution, with uniforms from the sequence's own seeded
//     stream (reproducible); a greedy drafter is q = one-hot;
//   - settle_speculation: the DeltaNet recurrent and conv state and the MTP head's hidden state of a row that
//     rejected a draft are set to those after its last accepted token: the position checkpoint of that token
//     (keep_verified), or, without them, the save_state checkpoint restored and [pending, accepted drafts] run again
//     (one batched pass, no logits); KV rows of rejected positions are written again before any read. The
//     scheduler counts the accepted tokens as computed;
//   - emit_rows sends them like any tokens (eos / stop / max_tokens / context checked after each, nothing past).
// A draft-less row after a speculative step thus starts from exactly the state a plain decode would have.
// Another way of getting tokens from the runner (a fused decode path) is one more OutputMode: chosen in
// choose_output_mode, run in forward, read in choose_token.
#include "engine/engine.h"

#include "engine/image_inputs.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "model/sampling.h"

#include "core/error.h"
#include "core/log.h"

namespace kiln::engine {

namespace {

std::vector<double> latency_buckets_s() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
          1.0,   2.5,    5.0,   7.5,  10.0,  20.0,  40.0,  80.0, 160.0};
}

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

SchedulerOptions scheduler_options(const EngineOptions& o, const model::RunnerCapacity& cap,
                                   const model::ModelRunner& runner) {
  SchedulerOptions s;
  s.max_running_requests = o.max_running_requests;
  s.max_queued_requests = o.max_queued_requests;
  s.chunked_prefill_size = o.chunked_prefill_size;
  s.step_budget_while_decoding = o.step_budget_while_decoding;
  s.context_length = o.context_length;
  s.kv_pages = cap.kv_pages;
  s.page_size = cap.page_size;
  s.state_slots = cap.state_slots;
  s.prefix_cache = o.enable_prefix_cache;
  s.needs_state = runner.has_recurrent_state();
  // Slots for pending snapshots: what the runner has per running request beyond its own, at least one and at
  // most two (the prompt's second-to-last page boundary and the latest one after it).
  s.max_snapshots_per_sequence = std::clamp(cap.state_slots / std::max(1, o.max_running_requests) - 1, 1, 2);
  s.decode_lookahead = o.speculative_num_steps;
  s.chunk_snapshots = o.chunk_snapshots && runner.chunk_snapshots();
  return s;
}

EngineOptions resolve_options(EngineOptions o, const model::ModelRunner& runner) {
  const model::RunnerCapacity cap = runner.capacity();
  if (o.context_length <= 0 || (cap.max_context > 0 && o.context_length > cap.max_context))
    o.context_length = cap.max_context;
  // One sequence must fit in the KV pool: a longer context could only end in a request that never finishes.
  const int64_t pool_tokens = cap.kv_pages * cap.page_size;
  if (pool_tokens > 0 && o.context_length > pool_tokens) {
    KILN_LOG_WARN("the KV cache holds {} tokens ({} pages of {}), fewer than the context length of {} tokens: "
                  "the context is capped at {} tokens (raise --max-total-tokens or the memory for the KV cache)",
                  pool_tokens, cap.kv_pages, cap.page_size, o.context_length, pool_tokens);
    o.context_length = pool_tokens;
  }
  if (o.enable_prefix_cache && !runner.can_copy_state()) {
    KILN_LOG_INFO("prefix cache off: this model runner cannot copy state slots");
    o.enable_prefix_cache = false;
  }
  if (o.max_running_requests <= 0) fail("--max-running-requests must be at least 1");
  if (o.max_queued_requests < 0) fail("--max-queued-requests must be 0 or more");
  if (o.context_length <= 1) fail("the context length must be at least 2 tokens (got {})", o.context_length);
  if (o.sampling_threads < 0) fail("sampling threads must be 0 (auto) or more, got {}", o.sampling_threads);
  if (o.sampling_threads == 0)
    o.sampling_threads = static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1u, 8u));
  if (o.speculative_num_steps < 0 || o.speculative_num_steps > DraftLengthChooser::kMaxSteps)
    fail("speculative decoding: {} draft steps (0 = off, at most {})", o.speculative_num_steps,
         DraftLengthChooser::kMaxSteps);
  if (o.speculative_num_steps > 0 && runner.mtp_layers() == 0)
    fail("speculative decoding needs the model's MTP head, and this model runner has none (a checkpoint without "
         "mtp.* tensors, or a runner that does not drive one); turn it off with --speculative-algorithm none");
  if (cap.kv_pages <= 0 || cap.page_size <= 0 || cap.state_slots <= 0)
    fail("the model runner reports no KV capacity (kv_pages {}, page_size {}, state_slots {})", cap.kv_pages,
         cap.page_size, cap.state_slots);
  return o;
}

// A planned chunk as the runner takes it: its tokens and the pages up to its last position.
model::SeqChunk runner_chunk(const PlannedChunk& c, int page_size) {
  model::SeqChunk ch;
  ch.state_slot = c.seq->state_slot;
  ch.tokens = std::span<const int32_t>(c.seq->tokens.data() + c.start_pos, static_cast<size_t>(c.num_tokens));
  ch.start_pos = c.start_pos;
  const int64_t end = c.start_pos + c.num_tokens;
  const size_t pages = static_cast<size_t>((end + page_size - 1) / page_size);
  KILN_CHECK(pages <= c.seq->pages.size(), "sequence {} needs {} pages, holds {}", c.seq->uid, pages,
             c.seq->pages.size());
  ch.page_table = std::span<const int32_t>(c.seq->pages.data(), pages);
  ch.want_logits = c.want_logits;
  for (const PlannedSnapshot& sn : c.snapshots) ch.snapshots.push_back({sn.tokens, sn.slot});
  return ch;
}

// The sequence's sampler: its parameters and seed, and its grammar with the tokens that may end it.
std::unique_ptr<SequenceSampler> make_sampler(const Sequence& seq, const std::vector<int32_t>& eos_token_ids) {
  auto sampler = std::make_unique<SequenceSampler>(seq.request.sampling, seq.seed);
  std::vector<int32_t> stop_ids = eos_token_ids;
  stop_ids.insert(stop_ids.end(), seq.request.stop_token_ids.begin(), seq.request.stop_token_ids.end());
  sampler->set_constraint(seq.request.constraint, std::move(stop_ids));
  return sampler;
}

// Penalties, a logit bias, logprobs, an active grammar or min_tokens still to reach need the row's logits on the host.
bool needs_host_logits(const Sequence& seq) {
  const SamplingParams& sp = seq.request.sampling;
  return sp.repetition_penalty != 1.0f || sp.presence_penalty != 0.0f || sp.frequency_penalty != 0.0f ||
         !sp.logit_bias.empty() || seq.request.want_logprobs || seq.sampler->constrained_now() ||
         seq.num_generated < seq.request.min_tokens;
}

// Before min_tokens are generated, the tokens that would end the sequence (eos unless ignore_eos, stop_token_ids)
// cannot be chosen.
void mask_ending_tokens(std::span<float> logits, const Sequence& seq, const std::vector<int32_t>& eos_token_ids) {
  if (seq.num_generated >= seq.request.min_tokens) return;
  auto mask = [&](int32_t id) {
    if (id >= 0 && static_cast<size_t>(id) < logits.size()) logits[static_cast<size_t>(id)] = -INFINITY;
  };
  if (!seq.request.ignore_eos)
    for (int32_t id : eos_token_ids) mask(id);
  for (int32_t id : seq.request.stop_token_ids) mask(id);
}

// Whether the drafter's tokens can be verified exactly for this sequence. Penalties and a logit bias change the
// target's distribution with every accepted token; a grammar would need masking of both draft and verify (a
// constrained request runs without speculation); a sampled row's logprobs would need the sampler's processed
// distribution at every accepted position (greedy rows with logprobs are fine: the sampler scores each position).
// A sequence still short of its min_tokens decodes plainly (mask_ending_tokens, one token a step) until it has them.
bool can_speculate(const Sequence& seq) {
  const SamplingParams& sp = seq.request.sampling;
  if (sp.repetition_penalty != 1.0f || sp.presence_penalty != 0.0f || sp.frequency_penalty != 0.0f ||
      !sp.logit_bias.empty() || seq.num_generated < seq.request.min_tokens)
    return false;
  // A grammar: greedy rows only (their verify runs through the sampler position by position, masked, the grammar
  // advancing by each chosen token); rejection sampling does not mask the target's distribution.
  if (seq.request.constraint && !model::greedy_temperature(sp.temperature)) return false;
  return !(seq.request.want_logprobs && !model::greedy_temperature(sp.temperature));
}

std::vector<double> accept_length_buckets() { return {1, 2, 3, 4, 5, 6, 7, 8, 9}; }
std::vector<double> draft_length_buckets() { return {0, 1, 2, 3, 4, 5, 6, 7, 8}; }

}  // namespace

Engine::Engine(std::unique_ptr<model::ModelRunner> runner, EngineOptions options)
    : runner_(std::move(runner)),
      opts_(resolve_options(std::move(options), *runner_)),
      capacity_(runner_->capacity()),
      vocab_size_(runner_->vocab_size()),
      scheduler_(scheduler_options(opts_, capacity_, *runner_)),
      sampling_pool_(opts_.sampling_threads),
      ttft_(latency_buckets_s()),
      itl_(latency_buckets_s()),
      e2e_(latency_buckets_s()),
      queue_time_(latency_buckets_s()),
      spec_accept_length_(accept_length_buckets()),
      spec_step_draft_length_(draft_length_buckets()),
      draft_chooser_(opts_.speculative_num_steps),
      position_checkpoints_(opts_.speculative_num_steps > 0 ? runner_->position_checkpoints() : 0) {
  draft_chooser_.set_replays(position_checkpoints_ == 0);
  carry_drafts_ = opts_.speculative_num_steps > 0 && opts_.speculative_carry && runner_->can_carry_drafts();
  draft_chooser_.set_carried_first(carry_drafts_);
  seed_base_ = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  std::sort(opts_.eos_token_ids.begin(), opts_.eos_token_ids.end());
  gauges_.kv_pages_total = capacity_.kv_pages;
  gauges_.page_size = capacity_.page_size;
  gauges_.state_slots_total = capacity_.state_slots;
  gauges_.prefix_cache_enabled = opts_.enable_prefix_cache;
  gauges_.speculative_num_steps = opts_.speculative_num_steps;
}

Engine::~Engine() { stop(); }

void Engine::start() {
  KILN_CHECK(!thread_.joinable(), "engine started twice");
  thread_ = std::thread([this] { loop(); });
}

std::string Engine::check_fits(int64_t prompt_len, int64_t max_tokens) const {
  return scheduler_.check_fits(prompt_len, max_tokens);
}

std::string Engine::check_request(const GenerateRequest& request) const {
  std::string why = check_fits(static_cast<int64_t>(request.prompt.size()), request.max_tokens);
  if (!why.empty()) return why;
  for (int32_t t : request.prompt)
    if (t < 0 || t >= vocab_size_)
      return fmt::format("prompt token id {} is outside the vocabulary [0, {})", t, vocab_size_);
  return {};
}

SubmitResult Engine::submit(std::vector<GenerateRequest> sequences) {
  SubmitResult result;
  if (sequences.empty()) {
    result.status = SubmitStatus::invalid;
    result.message = "no sequences to generate";
    return result;
  }
  for (const auto& r : sequences) {
    if (std::string why = check_request(r); !why.empty()) {
      rejected_too_long_.fetch_add(1);
      result.status = SubmitStatus::invalid;
      result.message = why;
      return result;
    }
  }
  auto channel = std::make_shared<RequestChannel>(static_cast<int>(sequences.size()));
  auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (draining_.load() || stop_requested_) {
      result.status = SubmitStatus::draining;
      result.message = "the server is shutting down";
      return result;
    }
    // Sequences that will start at once (free running places) do not count as waiting.
    int64_t queued = published_waiting_ + static_cast<int64_t>(incoming_.size());
    int64_t free_running = std::max<int64_t>(0, opts_.max_running_requests - gauges_.num_running);
    if (queued + static_cast<int64_t>(sequences.size()) - free_running > opts_.max_queued_requests) {
      rejected_queue_full_.fetch_add(1);
      result.status = SubmitStatus::queue_full;
      // Of the queued sequences, those that take a free running place at the next step are not waiting.
      result.message = fmt::format("the request queue is full ({} waiting, limit {}); retry later",
                                   std::max<int64_t>(0, queued - free_running), opts_.max_queued_requests);
      return result;
    }
    for (size_t i = 0; i < sequences.size(); ++i) {
      auto seq = std::make_unique<Sequence>();
      seq->uid = next_uid_.fetch_add(1);
      seq->index = static_cast<int>(i);
      seq->request = std::move(sequences[i]);
      seq->channel = channel;
      seq->tokens = seq->request.prompt;
      seq->prompt_len = static_cast<int64_t>(seq->tokens.size());
      seq->seed = seq->request.sampling.seed ? *seq->request.sampling.seed
                                             : seed_base_ ^ (seq->uid * 0x9E3779B97F4A7C15ull);
      seq->submitted_at = now;
      incoming_.push_back(std::move(seq));
    }
    published_idle_ = false;
  }
  cv_.notify_all();
  result.channel = std::move(channel);
  return result;
}

bool Engine::drain(std::chrono::milliseconds timeout) {
  draining_.store(true);
  std::unique_lock<std::mutex> lock(mu_);
  bool done = cv_idle_.wait_for(lock, timeout, [&] { return published_idle_ && incoming_.empty(); });
  if (!done) {
    abort_all_ = true;
    cv_.notify_all();
    cv_idle_.wait_for(lock, std::chrono::seconds(30), [&] { return published_idle_ && incoming_.empty(); });
  }
  return done;
}

bool Engine::flush_prefix_cache(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_requested_) return false;
  const uint64_t ticket = ++flushes_asked_;
  cv_.notify_all();
  if (!cv_idle_.wait_for(lock, timeout, [&] { return flushes_done_ >= ticket || stop_requested_; })) return false;
  return flushes_done_ >= ticket && last_flush_ok_;
}

// A flush asked for since the last step: done only when nothing runs or waits (a sequence's pages may be cached).
void Engine::answer_flush() {
  std::lock_guard<std::mutex> lock(mu_);
  if (flushes_asked_ == flushes_done_) return;
  last_flush_ok_ = scheduler_.idle() && incoming_.empty();
  if (last_flush_ok_) KILN_LOG_INFO("prefix cache flushed: {} KV pages freed", scheduler_.flush_prefix_cache());
  flushes_done_ = flushes_asked_;
  cv_idle_.notify_all();
}

void Engine::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_requested_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Engine::publish_gauges() {
  std::lock_guard<std::mutex> lock(mu_);
  published_waiting_ = scheduler_.num_waiting();
  gauges_.num_waiting = scheduler_.num_waiting() + static_cast<int>(incoming_.size());
  gauges_.num_running = scheduler_.num_running();
  gauges_.kv_pages_used = scheduler_.kv_pages_used();
  gauges_.state_slots_used = scheduler_.state_slots_used();
  gauges_.preemptions_total = scheduler_.counters().preemptions;
  gauges_.prefix_cache_query_tokens_total = scheduler_.counters().cache_query_tokens;
  gauges_.prefix_cache_hit_tokens_total = scheduler_.counters().cache_hit_tokens;
  if (const PrefixCache* pc = scheduler_.prefix_cache()) {
    gauges_.kv_pages_cached = pc->num_pages();
    gauges_.state_snapshots_cached = pc->num_snapshots();
    gauges_.prefix_cache_evicted_pages_total = pc->counters().evicted_pages;
    gauges_.prefix_cache_evicted_snapshots_total = pc->counters().evicted_snapshots;
  }
  bool idle = scheduler_.idle() && incoming_.empty();
  if (idle != published_idle_) {
    published_idle_ = idle;
    if (idle) cv_idle_.notify_all();
  }
}

EngineMetricsSnapshot Engine::metrics() const {
  EngineMetricsSnapshot s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = gauges_;
    s.num_waiting = published_waiting_ + static_cast<int>(incoming_.size());
  }
  s.prompt_tokens_total = prompt_tokens_.load();
  s.generation_tokens_total = generation_tokens_.load();
  s.steps_total = steps_.load();
  s.finished_stop = finished_[static_cast<int>(FinishReason::stop)].load();
  s.finished_length = finished_[static_cast<int>(FinishReason::length)].load();
  s.finished_abort = finished_[static_cast<int>(FinishReason::abort)].load();
  s.finished_error = finished_[static_cast<int>(FinishReason::error)].load();
  s.rejected_queue_full = rejected_queue_full_.load();
  s.rejected_too_long = rejected_too_long_.load();
  s.time_to_first_token_s = ttft_.snapshot();
  s.inter_token_latency_s = itl_.snapshot();
  s.e2e_latency_s = e2e_.snapshot();
  s.queue_time_s = queue_time_.snapshot();
  s.spec_draft_tokens_total = spec_draft_tokens_.load();
  s.spec_accepted_tokens_total = spec_accepted_tokens_.load();
  s.spec_carried_drafts_total = spec_carried_drafts_.load();
  s.spec_accept_length = spec_accept_length_.snapshot();
  s.spec_step_draft_length = spec_step_draft_length_.snapshot();
  return s;
}

void Engine::send(const Sequence& seq, TokenEvent event) {
  if (seq.channel) outbox_.push_back({seq.channel, std::move(event)});
}

void Engine::count_finished(const Sequence& seq, FinishReason reason, Clock::time_point now) {
  finished_[static_cast<int>(reason)].fetch_add(1);
  e2e_.observe(seconds_between(seq.submitted_at, now));
}

void Engine::finish(Sequence& seq, FinishReason reason, const std::string& error) {
  TokenEvent ev;
  ev.index = seq.index;
  ev.finished = true;
  ev.finish_reason = reason;
  ev.error = error;
  send(seq, std::move(ev));
  count_finished(seq, reason, Clock::now());
}

void Engine::flush_outbox() {
  for (auto& [channel, ev] : outbox_) channel->push(std::move(ev));
  outbox_.clear();
}

// ---- the loop ----

void Engine::loop() {
  for (;;) {
    bool stopping = false, abort_all = false;
    take_incoming(wait_for_work(stopping, abort_all));
    end_cancelled(abort_all);
    answer_flush();
    if (stopping) {
      publish_gauges();
      flush_outbox();
      return;
    }
    StepPlan plan = scheduler_.plan_step();
    publish_gauges();
    flush_outbox();
    if (plan.empty()) {
      // Only reachable when queued sequences wait for capacity held by nobody (a bug elsewhere); do
      // not spin.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(5));
      continue;
    }
    try {
      run_step(plan);
    } catch (const std::exception& e) {
      // A broken invariant: fail everything in flight rather than die; the loop keeps serving.
      KILN_LOG_ERROR("engine step failed: {}", e.what());
      for (auto& s : scheduler_.release_all())
        finish(*s, FinishReason::error, fmt::format("engine error: {}", e.what()));
    }
    // Gauges first, then the events: a client that sees its final event also sees its pages freed.
    publish_gauges();
    flush_outbox();
  }
}

// Blocks until there is something to do (new sequences, sequences in the scheduler, or stop); returns the new
// sequences.
std::vector<std::unique_ptr<Sequence>> Engine::wait_for_work(bool& stopping, bool& abort_all) {
  std::vector<std::unique_ptr<Sequence>> arrived;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    for (auto& s : incoming_) arrived.push_back(std::move(s));
    incoming_.clear();
    if (stop_requested_ || !arrived.empty() || !scheduler_.idle() || flushes_asked_ != flushes_done_) break;
    abort_all_ = false;  // nothing left to abort
    cv_.wait(lock);
  }
  stopping = stop_requested_;
  abort_all = abort_all_ || stopping;
  return arrived;
}

// Each new sequence gets its sampler here, once: it stays with the sequence through preemptions and goes with it.
// A sequence whose sampler cannot be made (bad parameters) ends before it holds pages or joins a step.
void Engine::take_incoming(std::vector<std::unique_ptr<Sequence>> arrived) {
  for (auto& seq : arrived) {
    try {
      seq->sampler = make_sampler(*seq, opts_.eos_token_ids);
    } catch (const std::exception& e) {
      KILN_LOG_ERROR("sampling failed for request {}: {}", seq->request.id, e.what());
      finish(*seq, FinishReason::error, fmt::format("sampling failed: {}", e.what()));
      continue;
    }
    try {
      prepare_images(*seq, *runner_);  // encodes the prompt's images (none: nothing to do)
    } catch (const std::exception& e) {
      KILN_LOG_ERROR("image input failed for request {}: {}", seq->request.id, e.what());
      finish(*seq, FinishReason::error, fmt::format("image input failed: {}", e.what()));
      continue;
    }
    scheduler_.enqueue(std::move(seq));
  }
}

// Cancellations (client gone, stop string matched, shutdown) leave before the step. A sequence its client stopped
// (a stop string matched) finishes as stop, any other as abort.
void Engine::end_cancelled(bool abort_all) {
  scheduler_.for_each_sequence([&](Sequence& s) {
    if (abort_all || (s.channel && s.channel->sequence_cancelled(s.index))) s.abort_requested = true;
  });
  for (auto& s : scheduler_.take_aborted())
    finish(*s, s->channel && s->channel->sequence_stopped(s->index) ? FinishReason::stop : FinishReason::abort);
}

// ---- the step ----

void Engine::run_step(const StepPlan& plan) {
  step_times_ = {};
  ++step_serial_;
  step_carried_ = false;
  step_uncarried_drafts_ = false;
  const auto t0 = Clock::now();
  build_rows(plan);
  const OutputMode mode = choose_output_mode();
  if (!draft(plan, mode)) return;
  if (!forward(plan, mode)) return;
  choose_tokens(mode);
  settle_speculation();
  keep_carried_drafts();
  emit_rows();
  // Costs of pure decode steps teach the draft-length choice (a prefill chunk would swamp them). Whole steps, not
  // passes alone: the host's work per step (building rows, choosing and emitting tokens) is what a draft saves or
  // adds too; the verify pass is charged with the step less its draft chain and replay.
  if (opts_.speculative_num_steps > 0 && plan.num_prefill_tokens == 0 && !rows_.empty()) {
    const double step_s = seconds_between(t0, Clock::now());
    int drafting = 0;
    int64_t verify_tokens = 0;
    for (const StepRow& row : rows_) {
      drafting += row.draft_k > 0;
      verify_tokens += row.draft_k + 1;
    }
    if (drafting == 0) {
      draft_chooser_.observe_decode(static_cast<int>(rows_.size()), step_s);
    } else {
      draft_chooser_.observe_multi(verify_tokens,
                                   std::max(step_s - step_times_.draft_s - step_times_.replay_s, step_times_.forward_s));
      // The chain steps that ran: K - 1 when every drafting row had its first draft carried (none at K = 1).
      const int chain_steps = step_k_ - (step_uncarried_drafts_ ? 0 : 1);
      if (chain_steps > 0) draft_chooser_.observe_draft(drafting, chain_steps, step_times_.draft_s);
      if (step_times_.replay_tokens > 0) draft_chooser_.observe_multi(step_times_.replay_tokens, step_times_.replay_s);
    }
  }
}

// The step's draft length K: from the measured costs at this many decoding sequences (or the test hook).
int Engine::step_draft_length(const StepPlan& plan) {
  if (opts_.speculative_num_steps <= 0 || plan.num_decodes == 0) return 0;
  const int k = opts_.draft_length_for_step  ? opts_.draft_length_for_step(plan.num_decodes)
                : opts_.speculative_adaptive ? draft_chooser_.choose(plan.num_decodes, plan.num_prefill_tokens)
                                             : opts_.speculative_num_steps;
  const int chosen = std::clamp(k, 0, opts_.speculative_num_steps);
  spec_step_draft_length_.observe(chosen);
  return chosen;
}

// A decode row's drafts: at most k, within its free pages, its max_tokens (k + 1 tokens can come out) and the
// context; 0 when the drafter cannot be verified exactly for it or its state is snapshotted after this token.
int Engine::row_draft_length(const StepPlan& plan, const PlannedChunk& c, int k) const {
  const Sequence& seq = *c.seq;
  if (k <= 0 || c.num_tokens != 1 || !c.want_logits || seq.prefilling() || c.start_pos < 1 || !can_speculate(seq))
    return 0;
  for (const StateCopy& save : plan.saves)
    if (save.src == seq.state_slot) return 0;
  const int64_t pos = c.start_pos;  // the pending token's position; the verify writes [pos, pos + k]
  int64_t most = k;
  most = std::min(most, seq.request.max_tokens - seq.num_generated - 1);
  most = std::min(most, opts_.context_length - 1 - pos);
  most = std::min(most, static_cast<int64_t>(seq.pages.size()) * capacity_.page_size - 1 - pos);
  return static_cast<int>(std::max<int64_t>(most, 0));
}

void Engine::build_rows(const StepPlan& plan) {
  chunks_.clear();
  rows_.clear();
  step_k_ = step_draft_length(plan);
  size_t output = 0;
  int checkpoints_left = position_checkpoints_;  // a verify of k drafts keeps k of them
  for (const PlannedChunk& c : plan.chunks) {
    chunks_.push_back(runner_chunk(c, capacity_.page_size));
    attach_image_inputs(*c.seq, chunks_.back());
    if (!c.want_logits) continue;
    StepRow row;
    row.seq = c.seq;
    row.chunk = chunks_.size() - 1;
    row.output = output;
    row.completes_prompt = c.start_pos + c.num_tokens == c.seq->prompt_len;
    row.draft_k = row_draft_length(plan, c, step_k_);
    if (position_checkpoints_ > 0) {
      row.draft_k = std::min(row.draft_k, checkpoints_left);
      checkpoints_left -= row.draft_k;
    }
    output += static_cast<size_t>(row.draft_k) + 1;
    rows_.push_back(std::move(row));
  }
}

// Every row greedy and plain: the runner picks the tokens (on the GPU only the ids come back, not a vocabulary of
// logits per row). Every row plain but some sample: the runner draws them (model/sampling.h's definition) with each
// row's next uniform. Any row that needs its logits on the host (a penalty, logprobs, an active grammar's mask): the
// whole step takes the host path.
// A speculative row that samples is accepted against its whole distribution: host logits.
Engine::OutputMode Engine::choose_output_mode() const {
  bool all_greedy = true, drafting = false;
  for (const StepRow& row : rows_) {
    if (needs_host_logits(*row.seq)) return OutputMode::host_logits;
    if (row.draft_k > 0 && row.seq->request.constraint) return OutputMode::host_logits;  // masked, position by position
    all_greedy = all_greedy && model::greedy_temperature(row.seq->request.sampling.temperature);
    drafting = drafting || row.draft_k > 0;
  }
  if (all_greedy) return OutputMode::argmax;
  return drafting ? OutputMode::host_logits : OutputMode::device_sample;
}

// Ends every sequence of the step with the runner's error (the others keep going).
void Engine::end_step_sequences(const StepPlan& plan, const std::string& what, const std::exception& e) {
  KILN_LOG_ERROR("{} failed ({} sequences): {}", what, plan.chunks.size(), e.what());
  for (const auto& c : plan.chunks) {
    auto seq = scheduler_.release(c.seq, /*cache=*/false);
    finish(*seq, FinishReason::error, fmt::format("model step failed: {}", e.what()));
  }
}

// The MTP head drafts each speculative row's tokens (rows of one draft length in one call); the row's chunk becomes
// its verify chunk [pending, d_1 .. d_k], logits at every position.
bool Engine::draft(const StepPlan& plan, OutputMode mode) {
  deferred_seqs_ = deferred_steps_ = 0;
  if (step_k_ == 0) return true;
  // The chain stays on the device only when it is the step's one chain: every drafting row carried, one length.
  bool can_defer = mode == OutputMode::argmax && carry_drafts_ && opts_.speculative_defer_chain;
  int one_k = -1;
  for (const StepRow& row : rows_) {
    if (row.draft_k == 0) continue;
    can_defer = can_defer && has_carried_draft(*row.seq) && (one_k < 0 || one_k == row.draft_k);
    one_k = row.draft_k;
  }
  const auto t0 = Clock::now();
  try {
    // One call per draft length, the sequences with a carried first draft apart (with k = 1 theirs is all there
    // is: no call).
    for (int k = 1; k <= step_k_; ++k) for (const bool carried : {false, true}) {
      std::vector<model::DraftSeq> seqs;
      std::vector<StepRow*> of;
      for (StepRow& row : rows_) {
        if (row.draft_k != k || has_carried_draft(*row.seq) != carried) continue;
        const Sequence& seq = *row.seq;
        model::DraftSeq d;
        d.state_slot = seq.state_slot;
        d.token = seq.tokens.back();
        d.pos = static_cast<int64_t>(seq.tokens.size()) - 1;
        d.page_table = std::span<const int32_t>(seq.pages.data(), seq.pages.size());
        d.rope_delta = seq.has_images() ? seq.rope_delta : 0;
        if (carried) {
          d.carried_row = seq.carried_row;
          d.first_draft = seq.carried_draft;
        }
        seqs.push_back(d);
        of.push_back(&row);
      }
      if (seqs.empty()) continue;
      if (carried) spec_carried_drafts_.fetch_add(seqs.size());
      else step_uncarried_drafts_ = true;
      std::vector<int32_t> drafted(seqs.size() * static_cast<size_t>(k));
      // A greedy step's chain after carried first drafts can stay on the device (one chain per step): the verify
      // reads it there, and forward() fills the drafts in.
      const bool defer = can_defer && carried && k >= 2;
      if (carried && k == 1) {
        for (size_t i = 0; i < seqs.size(); ++i) drafted[i] = seqs[i].first_draft;
      } else if (defer) {
        runner_->draft_deferred(seqs, k);
        for (size_t i = 0; i < seqs.size(); ++i) {
          std::fill(drafted.begin() + static_cast<std::ptrdiff_t>(i * k),
                    drafted.begin() + static_cast<std::ptrdiff_t>((i + 1) * k), seqs[i].token);  // placeholders
          drafted[i * k] = seqs[i].first_draft;
          of[i]->device_draft_row = static_cast<int>(i);
        }
        deferred_seqs_ = static_cast<int64_t>(seqs.size());
        deferred_steps_ = k - 1;
      } else {
        runner_->draft(seqs, k, drafted, {});
      }
      for (size_t i = 0; i < of.size(); ++i) {
        StepRow& row = *of[i];
        const Sequence& seq = *row.seq;
        row.verify_tokens.assign(1, seq.tokens.back());
        row.verify_tokens.insert(row.verify_tokens.end(), drafted.begin() + static_cast<std::ptrdiff_t>(i * k),
                                 drafted.begin() + static_cast<std::ptrdiff_t>((i + 1) * k));
        for (int32_t t : row.verify_tokens)
          KILN_CHECK(t >= 0 && t < vocab_size_, "draft token {} outside the vocabulary", t);
        model::SeqChunk& ch = chunks_[row.chunk];
        ch.tokens = std::span<const int32_t>(row.verify_tokens.data(), row.verify_tokens.size());
        const int64_t end = ch.start_pos + static_cast<int64_t>(row.verify_tokens.size());
        ch.page_table = std::span<const int32_t>(
            seq.pages.data(), static_cast<size_t>((end + capacity_.page_size - 1) / capacity_.page_size));
        ch.logits_tokens = k + 1;
        ch.checkpoint_positions = position_checkpoints_ > 0;
        ch.device_draft_row = row.device_draft_row;
        attach_image_inputs(*row.seq, ch);  // the verify tokens' rope positions
      }
    }
  } catch (const std::exception& e) {
    end_step_sequences(plan, "draft step", e);
    return false;
  }
  step_times_.draft_s = seconds_between(t0, Clock::now());
  return true;
}

// Runs the plan's state copies and forward pass; false when the runner failed (the step's sequences are ended with
// the error, the others keep going).
bool Engine::forward(const StepPlan& plan, OutputMode mode) {
  size_t rows = 0;
  for (const StepRow& row : rows_) rows += static_cast<size_t>(row.draft_k) + 1;
  if (mode == OutputMode::host_logits) logits_.resize(rows * static_cast<size_t>(vocab_size_));
  else runner_tokens_.assign(rows, -1);
  // Each sampling row takes its uniform from its own sampler's stream (greedy rows draw none).
  row_sampling_.clear();
  if (mode == OutputMode::device_sample)
    for (const StepRow& row : rows_) row_sampling_.push_back(row.seq->sampler->next_row_sampling());
  const auto t0 = Clock::now();
  try {
    for (const StateCopy& c : plan.restores) runner_->copy_state(c.src, c.dst);
    if (position_checkpoints_ == 0)
      for (const StepRow& row : rows_)
        if (row.draft_k > 0) runner_->save_state(row.seq->state_slot);
    switch (mode) {
      case OutputMode::argmax:
        if (carry_drafts_) {
          runner_next_drafts_.assign(rows, -1);
          runner_device_drafts_.assign(static_cast<size_t>(deferred_seqs_ * deferred_steps_), -1);
          runner_->forward_argmax_carry(chunks_, runner_tokens_, runner_next_drafts_, runner_device_drafts_);
          step_carried_ = true;
          // The deferred chain's drafts into their rows' verify tokens (after the pending token and the first draft).
          for (StepRow& row : rows_) {
            if (row.device_draft_row < 0) continue;
            for (int64_t j = 0; j < deferred_steps_; ++j) {
              const int32_t t = runner_device_drafts_[static_cast<size_t>(row.device_draft_row * deferred_steps_ + j)];
              KILN_CHECK(t >= 0 && t < vocab_size_, "draft token {} outside the vocabulary", t);
              row.verify_tokens[static_cast<size_t>(2 + j)] = t;
            }
          }
        } else {
          runner_->forward_argmax(chunks_, runner_tokens_);
        }
        break;
      case OutputMode::device_sample: runner_->forward_sample(chunks_, row_sampling_, runner_tokens_); break;
      case OutputMode::host_logits: runner_->forward(chunks_, logits_); break;
    }
    for (const StateCopy& c : plan.saves) runner_->copy_state(c.src, c.dst);
  } catch (const std::exception& e) {
    end_step_sequences(plan, "forward step", e);
    return false;
  }
  step_times_.forward_s = seconds_between(t0, Clock::now());
  steps_.fetch_add(1);
  scheduler_.commit_step(plan);
  return true;
}

// Host sampling costs milliseconds per row at a 248k vocabulary, so with enough logits to scan the rows are spread
// over the sampling pool (below 128k logits waking its threads costs more than the scan). Each row has its own
// sampler, logits and history, and catches its own errors.
void Engine::choose_tokens(OutputMode mode) {
  const int64_t n = static_cast<int64_t>(rows_.size());
  const bool spread = mode == OutputMode::host_logits && n * vocab_size_ >= (int64_t(1) << 17);
  if (!spread) {
    for (StepRow& row : rows_) choose_token(row, mode);
    return;
  }
  sampling_pool_.parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) choose_token(rows_[static_cast<size_t>(i)], mode);
  });
}

void Engine::choose_token(StepRow& row, OutputMode mode) {
  if (row.draft_k > 0) return choose_speculative(row, mode);
  try {
    const Sequence& seq = *row.seq;
    SampleResult chosen;
    if (mode == OutputMode::host_logits) {
      std::span<float> logits(logits_.data() + row.output * static_cast<size_t>(vocab_size_),
                              static_cast<size_t>(vocab_size_));
      mask_ending_tokens(logits, seq, opts_.eos_token_ids);
      const int top_n = seq.request.want_logprobs ? seq.request.top_logprobs : 0;
      chosen = seq.sampler->sample(logits, seq.tokens, static_cast<size_t>(seq.prompt_len), top_n,
                                   seq.request.want_logprobs);
    } else {
      chosen.token = runner_tokens_[row.output];
      if (chosen.token < 0) fail("sampling: no finite logit (all -inf or NaN)");
      seq.sampler->observe(chosen.token);
    }
    KILN_CHECK(chosen.token >= 0 && chosen.token < vocab_size_, "sampled token {} outside the vocabulary",
               chosen.token);
    row.tokens.push_back(std::move(chosen));
  } catch (const std::exception& e) {
    row.error = e.what();
  }
}

// A verify row's tokens: the accepted drafts and the target's token after them (engine/speculative.h's rules).
void Engine::choose_speculative(StepRow& row, OutputMode mode) {
  try {
    const Sequence& seq = *row.seq;
    const size_t K = static_cast<size_t>(row.draft_k), V = static_cast<size_t>(vocab_size_);
    const std::span<const int32_t> drafts(row.verify_tokens.data() + 1, K);
    auto row_logits = [&](size_t j) {
      return std::span<float>(logits_.data() + (row.output + j) * V, V);
    };
    if (mode == OutputMode::argmax) {
      const std::span<const int32_t> target(runner_tokens_.data() + row.output, K + 1);
      for (int32_t t : target)
        if (t < 0) fail("sampling: no finite logit (all -inf or NaN)");
      for (int32_t t : accept_greedy(drafts, target)) {
        SampleResult r;
        r.token = t;
        seq.sampler->observe(t);
        row.tokens.push_back(std::move(r));
      }
    } else if (model::greedy_temperature(seq.request.sampling.temperature)) {
      // The sampler scores each position in turn (the target's token and logprobs) until it differs from the draft.
      const int top_n = seq.request.want_logprobs ? seq.request.top_logprobs : 0;
      // With a grammar the sampler masks each position by the state the tokens before it reached; a token that
      // completes the grammar ends the row (the sequence stops there).
      for (size_t j = 0; j <= K; ++j) {
        SampleResult r = seq.sampler->sample(row_logits(j), seq.tokens, static_cast<size_t>(seq.prompt_len), top_n,
                                             seq.request.want_logprobs);
        const bool matches = j < K && r.token == drafts[j];
        row.tokens.push_back(std::move(r));
        if (!matches || seq.sampler->constraint_finished()) break;
      }
    } else {
      // Rejection sampling against the sampler's distribution (temperature, then top-k / top-p / min-p) at each
      // position; the MTP chain drafts greedily, so q_j is one-hot. Uniforms from the sequence's own stream.
      const SamplingParams& sp = seq.request.sampling;
      std::vector<float> target((K + 1) * V, 0.0f), scaled(V);
      model::SampleScratch scratch;
      for (size_t j = 0; j <= K; ++j) {
        std::span<float> l = row_logits(j);
        scaled.assign(l.begin(), l.end());
        model::scale_logits(scaled.data(), vocab_size_, sp.temperature);
        float max_logit = -std::numeric_limits<float>::infinity();
        for (float x : scaled) max_logit = std::max(max_logit, x);
        if (!std::isfinite(max_logit)) fail("sampling: no finite logit (all -inf or NaN)");
        model::filter_scaled_logits(scaled.data(), vocab_size_, sp.top_k, sp.top_p, sp.min_p, scratch);
        for (size_t i = 0; i < scratch.cand.size(); ++i)
          target[j * V + static_cast<size_t>(scratch.cand[i])] = static_cast<float>(scratch.probs[i]);
      }
      const SampledAccept a =
          accept_sampled(drafts, target, {}, vocab_size_, [&] { return seq.sampler->next_row_sampling().u; });
      for (int32_t t : a.tokens) {
        SampleResult r;
        r.token = t;
        seq.sampler->observe(t);
        row.tokens.push_back(std::move(r));
      }
    }
    for (const SampleResult& r : row.tokens)
      KILN_CHECK(r.token >= 0 && r.token < vocab_size_, "sampled token {} outside the vocabulary", r.token);
    row.accepted = static_cast<int>(row.tokens.size()) - 1;
  } catch (const std::exception& e) {
    row.error = e.what();
  }
}

// The state of every verified sequence ends at its last accepted token: a row that rejected a draft takes the position
// checkpoint of that token or, without them, restores the checkpoint taken before the verify and runs [pending,
// accepted drafts] again (one pass for all of them, no logits); the scheduler then counts the accepted drafts as
// computed. A failed replay ends those sequences.
void Engine::settle_speculation() {
  if (step_k_ == 0) return;
  std::vector<model::SeqChunk> replay;
  std::vector<StepRow*> replayed, kept;
  std::vector<model::ModelRunner::VerifiedRow> verified;
  for (StepRow& row : rows_) {
    if (row.draft_k == 0 || !row.error.empty()) continue;
    spec_draft_tokens_.fetch_add(static_cast<uint64_t>(row.draft_k));
    spec_accepted_tokens_.fetch_add(static_cast<uint64_t>(row.accepted));
    spec_accept_length_.observe(row.accepted + 1);
    draft_chooser_.observe_accepts(row.draft_k, row.accepted);
    if (row.accepted == row.draft_k) continue;  // the verify ran exactly the accepted tokens
    if (position_checkpoints_ > 0) {  // settled below, all rows in one call
      verified.push_back({row.seq->state_slot, row.accepted + 1});
      kept.push_back(&row);
      continue;
    }
    model::SeqChunk ch = chunks_[row.chunk];
    ch.tokens = std::span<const int32_t>(row.verify_tokens.data(), static_cast<size_t>(row.accepted) + 1);
    if (!ch.mrope_pos.empty()) ch.mrope_pos = ch.mrope_pos.first(3 * ch.tokens.size());
    ch.want_logits = false;
    ch.logits_tokens = 1;
    replay.push_back(ch);
    replayed.push_back(&row);
  }
  if (!verified.empty()) {
    try {
      runner_->keep_verified_rows(verified);
    } catch (const std::exception& e) {
      KILN_LOG_ERROR("speculative state settle failed ({} sequences): {}", verified.size(), e.what());
      for (StepRow* row : kept) row->error = fmt::format("model step failed: {}", e.what());
    }
  }
  if (!replay.empty()) {
    const auto t0 = Clock::now();
    try {
      for (const StepRow* row : replayed) runner_->restore_state(row->seq->state_slot);
      runner_->forward(replay, {});
    } catch (const std::exception& e) {
      KILN_LOG_ERROR("speculative replay failed ({} sequences): {}", replay.size(), e.what());
      for (StepRow* row : replayed) row->error = fmt::format("model step failed: {}", e.what());
    }
    step_times_.replay_s = seconds_between(t0, Clock::now());
    for (const auto& ch : replay) step_times_.replay_tokens += static_cast<int64_t>(ch.tokens.size());
  }
  for (StepRow& row : rows_)
    if (row.draft_k > 0 && row.error.empty()) scheduler_.commit_accepted(row.seq, row.accepted);
}

bool Engine::has_carried_draft(const Sequence& seq) const {
  return carry_drafts_ && seq.carried_draft >= 0 && seq.carried_step + 1 == step_serial_ &&
         seq.carried_slot == seq.state_slot;
}

// A greedy step that carried: each row's first draft for the next step is the one after its last token (a verify row:
// after its accepted drafts and the target's token, whose state settle_speculation just kept).
void Engine::keep_carried_drafts() {
  if (!step_carried_) return;
  for (StepRow& row : rows_) {
    Sequence& seq = *row.seq;
    seq.carried_draft = -1;
    if (!row.error.empty() || row.tokens.empty()) continue;
    const size_t last = row.tokens.size() - 1;  // its row among the chunk's logits rows
    seq.carried_draft = runner_next_drafts_[row.output + last];
    seq.carried_row = static_cast<int>(last);
    seq.carried_slot = seq.state_slot;
    seq.carried_step = step_serial_;
  }
}

void Engine::emit_rows() {
  const auto now = Clock::now();
  std::vector<Sequence*> done;
  for (StepRow& row : rows_) {
    if (row.completes_prompt) prompt_tokens_.fetch_add(static_cast<uint64_t>(row.seq->prompt_len));
    if (emit_row(row, now)) done.push_back(row.seq);
  }
  for (Sequence* s : done) scheduler_.release(s);
}

// Sends the row's tokens in order; true when the sequence ended (an error, or a token that ends it: the tokens after
// that one are dropped).
bool Engine::emit_row(StepRow& row, Clock::time_point now) {
  Sequence& seq = *row.seq;
  if (!row.error.empty()) {
    KILN_LOG_ERROR("sampling failed for request {}: {}", seq.request.id, row.error);
    finish(seq, FinishReason::error, fmt::format("sampling failed: {}", row.error));
    return true;
  }
  for (size_t i = 0; i < row.tokens.size(); ++i)
    if (emit_token(seq, row.tokens[i], now, /*last_of_row=*/i + 1 == row.tokens.size())) return true;
  return false;
}

// Appends one token to its sequence and sends it, with the finish it causes.
bool Engine::emit_token(Sequence& seq, SampleResult& chosen, Clock::time_point now, bool last_of_row) {
  TokenEvent ev;
  ev.index = seq.index;
  ev.token = chosen.token;
  ev.logprob = chosen.logprob;
  if (seq.request.want_logprobs) ev.top = std::move(chosen.top);
  seq.tokens.push_back(ev.token);
  ++seq.num_generated;
  generation_tokens_.fetch_add(1);
  observe_token_time(seq, ev, now);
  const FinishReason reason = finish_reason_after(seq, last_of_row);
  ev.finished = reason != FinishReason::none;
  ev.finish_reason = reason;
  ev.is_stop_token = reason == FinishReason::stop;
  send(seq, std::move(ev));
  if (reason == FinishReason::none) return false;
  count_finished(seq, reason, now);
  return true;
}

// Whether the sequence's last token ends it: stop for an eos (unless ignore_eos) or stop token, or a grammar that is
// complete (even with ignore_eos); length at max_tokens or the context length.
FinishReason Engine::finish_reason_after(const Sequence& seq, bool last_of_row) const {
  const GenerateRequest& req = seq.request;
  const int32_t token = seq.tokens.back();
  const auto& eos_ids = opts_.eos_token_ids;
  const auto& stop_ids = req.stop_token_ids;
  const bool eos = !req.ignore_eos && std::binary_search(eos_ids.begin(), eos_ids.end(), token);
  const bool stop_token = std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end();
  // The grammar's state is the row's last token's (a verify row stops at the token that completes it).
  if (eos || stop_token || (last_of_row && seq.sampler->constraint_finished())) return FinishReason::stop;
  if (seq.num_generated >= req.max_tokens || static_cast<int64_t>(seq.tokens.size()) >= opts_.context_length)
    return FinishReason::length;
  return FinishReason::none;
}

void Engine::observe_token_time(Sequence& seq, TokenEvent& event, Clock::time_point now) {
  if (!seq.has_first_token) {
    seq.has_first_token = true;
    ttft_.observe(seconds_between(seq.submitted_at, now));
    queue_time_.observe(seconds_between(seq.submitted_at, seq.admitted_at));
    event.queue_ms = seconds_between(seq.submitted_at, seq.admitted_at) * 1e3;
    event.cached_tokens = seq.cached_tokens;
  } else {
    itl_.observe(seconds_between(seq.last_token_at, now));
  }
  seq.last_token_at = now;
}

}  // namespace kiln::engine
