// The engine loop and its step.
//
// loop(): take new sequences (each gets its sampler here, once), end the cancelled ones, plan a step
// (Scheduler::plan_step), run it, publish gauges and deliver the step's events.
//
// run_step(plan), one named phase each:
//   1. build_rows          the runner's chunks (page tables) for the plan, and a StepRow for every chunk that wants
//                          logits (row i is the runner's output i);
//   2. choose_output_mode  argmax (every row greedy and plain), device_sample (no row needs penalties, logprobs or an
//                          active grammar) or host_logits;
//   3. forward             state restores, the runner's forward in that mode, state saves; a failure ends the
//                          step's sequences with FinishReason::error;
//   4. choose_tokens       each row's token(s): the runner's, or its sampler on the host logits, rows spread over
//                          the sampling thread pool (each row has its own seeded sampler: the tokens do not depend on
//                          the thread count);
//   5. emit_rows           every chosen token appended, timed and sent in order, the stop / length checks after each
//                          token; finished sequences released.
//
// Where the next changes plug in. A speculative step (draft K tokens, verify K+1 per sequence): build_rows gives a
// verify chunk's row its K+1 outputs, choose_tokens accepts a prefix of the draft plus one token into
// StepRow::tokens, and emit_rows already sends any number of tokens per row, checking stop / max_tokens / the
// context after each and dropping the rest once one ends the sequence. Another way of getting tokens from the runner
// (a fused decode path) is one more OutputMode: chosen in choose_output_mode, run in forward, read in choose_token.
#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <random>

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
  s.context_length = o.context_length;
  s.kv_pages = cap.kv_pages;
  s.page_size = cap.page_size;
  s.state_slots = cap.state_slots;
  s.prefix_cache = o.enable_prefix_cache;
  s.needs_state = runner.has_recurrent_state();
  // Slots for pending snapshots: what the runner has per running request beyond its own, at least one and at
  // most two (the prompt's second-to-last page boundary and the latest one after it).
  s.max_snapshots_per_sequence = std::clamp(cap.state_slots / std::max(1, o.max_running_requests) - 1, 1, 2);
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
      queue_time_(latency_buckets_s()) {
  seed_base_ = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  std::sort(opts_.eos_token_ids.begin(), opts_.eos_token_ids.end());
  gauges_.kv_pages_total = capacity_.kv_pages;
  gauges_.page_size = capacity_.page_size;
  gauges_.state_slots_total = capacity_.state_slots;
  gauges_.prefix_cache_enabled = opts_.enable_prefix_cache;
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
  build_rows(plan);
  const OutputMode mode = choose_output_mode();
  if (!forward(plan, mode)) return;
  choose_tokens(mode);
  emit_rows();
}

void Engine::build_rows(const StepPlan& plan) {
  chunks_.clear();
  rows_.clear();
  for (const PlannedChunk& c : plan.chunks) {
    chunks_.push_back(runner_chunk(c, capacity_.page_size));
    if (!c.want_logits) continue;
    StepRow row;
    row.seq = c.seq;
    row.output = rows_.size();
    row.completes_prompt = c.start_pos + c.num_tokens == c.seq->prompt_len;
    rows_.push_back(std::move(row));
  }
}

// Every row greedy and plain: the runner picks the tokens (on the GPU only the ids come back, not a vocabulary of
// logits per row). Every row plain but some sample: the runner draws them (model/sampling.h's definition) with each
// row's next uniform. Any row that needs its logits on the host (a penalty, logprobs, an active grammar's mask): the
// whole step takes the host path.
Engine::OutputMode Engine::choose_output_mode() const {
  bool all_greedy = true;
  for (const StepRow& row : rows_) {
    if (needs_host_logits(*row.seq)) return OutputMode::host_logits;
    all_greedy = all_greedy && model::greedy_temperature(row.seq->request.sampling.temperature);
  }
  return all_greedy ? OutputMode::argmax : OutputMode::device_sample;
}

// Runs the plan's state copies and forward pass; false when the runner failed (the step's sequences are ended with
// the error, the others keep going).
bool Engine::forward(const StepPlan& plan, OutputMode mode) {
  const size_t rows = rows_.size();
  if (mode == OutputMode::host_logits) logits_.resize(rows * static_cast<size_t>(vocab_size_));
  else runner_tokens_.assign(rows, -1);
  // Each sampling row takes its uniform from its own sampler's stream (greedy rows draw none).
  row_sampling_.clear();
  if (mode == OutputMode::device_sample)
    for (const StepRow& row : rows_) row_sampling_.push_back(row.seq->sampler->next_row_sampling());
  try {
    for (const StateCopy& c : plan.restores) runner_->copy_state(c.src, c.dst);
    switch (mode) {
      case OutputMode::argmax: runner_->forward_argmax(chunks_, runner_tokens_); break;
      case OutputMode::device_sample: runner_->forward_sample(chunks_, row_sampling_, runner_tokens_); break;
      case OutputMode::host_logits: runner_->forward(chunks_, logits_); break;
    }
    for (const StateCopy& c : plan.saves) runner_->copy_state(c.src, c.dst);
  } catch (const std::exception& e) {
    KILN_LOG_ERROR("forward step failed ({} sequences): {}", plan.chunks.size(), e.what());
    for (const auto& c : plan.chunks) {
      auto seq = scheduler_.release(c.seq, /*cache=*/false);
      finish(*seq, FinishReason::error, fmt::format("model step failed: {}", e.what()));
    }
    return false;
  }
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
  for (SampleResult& chosen : row.tokens)
    if (emit_token(seq, chosen, now)) return true;
  return false;
}

// Appends one token to its sequence and sends it, with the finish it causes.
bool Engine::emit_token(Sequence& seq, SampleResult& chosen, Clock::time_point now) {
  TokenEvent ev;
  ev.index = seq.index;
  ev.token = chosen.token;
  ev.logprob = chosen.logprob;
  if (seq.request.want_logprobs) ev.top = std::move(chosen.top);
  seq.tokens.push_back(ev.token);
  ++seq.num_generated;
  generation_tokens_.fetch_add(1);
  observe_token_time(seq, ev, now);
  const FinishReason reason = finish_reason_after(seq);
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
FinishReason Engine::finish_reason_after(const Sequence& seq) const {
  const GenerateRequest& req = seq.request;
  const int32_t token = seq.tokens.back();
  const auto& eos_ids = opts_.eos_token_ids;
  const auto& stop_ids = req.stop_token_ids;
  const bool eos = !req.ignore_eos && std::binary_search(eos_ids.begin(), eos_ids.end(), token);
  const bool stop_token = std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end();
  if (eos || stop_token || seq.sampler->constraint_finished()) return FinishReason::stop;
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
