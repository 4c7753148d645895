#include "engine/engine.h"

#include <algorithm>
#include <random>

#include "core/error.h"
#include "core/log.h"
#include "engine/sampler.h"

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

}  // namespace

Engine::Engine(std::unique_ptr<model::ModelRunner> runner, EngineOptions options)
    : runner_(std::move(runner)),
      opts_(resolve_options(std::move(options), *runner_)),
      capacity_(runner_->capacity()),
      vocab_size_(runner_->vocab_size()),
      scheduler_(scheduler_options(opts_, capacity_, *runner_)),
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

SubmitResult Engine::submit(std::vector<GenerateRequest> sequences) {
  SubmitResult result;
  if (sequences.empty()) {
    result.status = SubmitStatus::invalid;
    result.message = "no sequences to generate";
    return result;
  }
  for (const auto& r : sequences) {
    std::string why = check_fits(static_cast<int64_t>(r.prompt.size()), r.max_tokens);
    if (why.empty()) {
      for (int32_t t : r.prompt)
        if (t < 0 || t >= vocab_size_) {
          why = fmt::format("prompt token id {} is outside the vocabulary [0, {})", t, vocab_size_);
          break;
        }
    }
    if (!why.empty()) {
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

void Engine::finish(Sequence& seq, FinishReason reason, const std::string& error) {
  TokenEvent ev;
  ev.index = seq.index;
  ev.finished = true;
  ev.finish_reason = reason;
  ev.error = error;
  if (seq.channel) outbox_.push_back({seq.channel, std::move(ev)});
  finished_[static_cast<int>(reason)].fetch_add(1);
  e2e_.observe(seconds_between(seq.submitted_at, Clock::now()));
  samplers_.erase(seq.uid);
}

void Engine::loop() {
  for (;;) {
    bool stopping = false, abort_all = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        for (auto& s : incoming_) scheduler_.enqueue(std::move(s));
        incoming_.clear();
        if (stop_requested_ || !scheduler_.idle()) break;
        abort_all_ = false;  // nothing left to abort
        cv_.wait(lock);
      }
      stopping = stop_requested_;
      abort_all = abort_all_ || stopping;
    }
    // Cancellations (client gone, stop string matched, shutdown) leave before the step.
    scheduler_.for_each_sequence([&](Sequence& s) {
      if (abort_all || (s.channel && s.channel->sequence_cancelled(s.index))) s.abort_requested = true;
    });
    // A sequence its client stopped (a stop string matched) finishes as stop, any other as abort.
    for (auto& s : scheduler_.take_aborted())
      finish(*s, s->channel && s->channel->sequence_stopped(s->index) ? FinishReason::stop : FinishReason::abort);
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
      for (auto& s : scheduler_.release_all()) finish(*s, FinishReason::error, fmt::format("engine error: {}", e.what()));
    }
    // Gauges first, then the events: a client that sees its final event also sees its pages freed.
    publish_gauges();
    flush_outbox();
  }
}

void Engine::flush_outbox() {
  for (auto& [channel, ev] : outbox_) channel->push(std::move(ev));
  outbox_.clear();
}

void Engine::run_step(const StepPlan& plan) {
  const int page_size = capacity_.page_size;
  chunks_.clear();
  int64_t num_logits = 0;
  for (const auto& c : plan.chunks) {
    model::SeqChunk ch;
    ch.state_slot = c.seq->state_slot;
    ch.tokens = std::span<const int32_t>(c.seq->tokens.data() + c.start_pos, static_cast<size_t>(c.num_tokens));
    ch.start_pos = c.start_pos;
    int64_t end = c.start_pos + c.num_tokens;
    size_t pages = static_cast<size_t>((end + page_size - 1) / page_size);
    KILN_CHECK(pages <= c.seq->pages.size(), "sequence {} needs {} pages, holds {}", c.seq->uid, pages,
               c.seq->pages.size());
    ch.page_table = std::span<const int32_t>(c.seq->pages.data(), pages);
    ch.want_logits = c.want_logits;
    if (c.want_logits) ++num_logits;
    chunks_.push_back(ch);
  }
  // Every sequence greedy with no penalties and no logprobs: the runner picks the tokens (on the GPU, only the ids
  // come back instead of a vocabulary of logits per sequence). No penalties and no logprobs but some sequence samples:
  // the runner draws the tokens (forward_sample, model/sampling.h's definition) with each sequence's next uniform.
  // A sequence under a grammar constraint needs its logits on the host (the mask): the whole step takes that path.
  auto sampler_of = [&](const Sequence& seq) -> SequenceSampler* {
    auto it = samplers_.find(seq.uid);
    if (it == samplers_.end()) {
      auto s = std::make_unique<SequenceSampler>(seq.request.sampling, seq.seed);
      std::vector<int32_t> stop_ids = opts_.eos_token_ids;
      stop_ids.insert(stop_ids.end(), seq.request.stop_token_ids.begin(), seq.request.stop_token_ids.end());
      s->set_constraint(seq.request.constraint, std::move(stop_ids));
      it = samplers_.emplace(seq.uid, std::move(s)).first;
    }
    return it->second.get();
  };
  bool all_greedy = true, runner_samples = true;
  for (const auto& c : plan.chunks) {
    if (!c.want_logits) continue;
    const SamplingParams& sp = c.seq->request.sampling;
    bool constrained = false;
    if (c.seq->request.constraint) {
      try {
        constrained = sampler_of(*c.seq)->constrained_now();
      } catch (const std::exception&) {
        constrained = true;  // host path: the sampler's error is reported below
      }
    }
    const bool plain = sp.repetition_penalty == 1.0f && sp.presence_penalty == 0.0f && sp.frequency_penalty == 0.0f &&
                       sp.logit_bias.empty() && !c.seq->request.want_logprobs && !constrained;
    all_greedy = all_greedy && sp.temperature < 1e-6f && plain;
    runner_samples = runner_samples && plain;
  }
  runner_samples = runner_samples && !all_greedy;
  std::vector<model::RowSampling> row_sampling;
  if (runner_samples) {
    // The samplers exist before the step so that each non-greedy row takes its uniform from its own stream. A
    // sequence whose sampler cannot be made (bad parameters) gets a greedy row here and its error below.
    for (const auto& c : plan.chunks) {
      if (!c.want_logits) continue;
      model::RowSampling rs;  // greedy
      try {
        rs = sampler_of(*c.seq)->next_row_sampling();
      } catch (const std::exception&) {
      }
      row_sampling.push_back(rs);
    }
  }
  if (all_greedy || runner_samples) greedy_ids_.assign(static_cast<size_t>(num_logits), -1);
  else logits_.resize(static_cast<size_t>(num_logits * vocab_size_));
  try {
    for (const StateCopy& c : plan.restores) runner_->copy_state(c.src, c.dst);
    if (all_greedy) runner_->forward_argmax(chunks_, greedy_ids_);
    else if (runner_samples) runner_->forward_sample(chunks_, row_sampling, greedy_ids_);
    else runner_->forward(chunks_, logits_);
    for (const StateCopy& c : plan.saves) runner_->copy_state(c.src, c.dst);
  } catch (const std::exception& e) {
    // The step failed as a whole: end its sequences with the error, keep serving the others.
    KILN_LOG_ERROR("forward step failed ({} sequences): {}", plan.chunks.size(), e.what());
    for (const auto& c : plan.chunks) {
      auto seq = scheduler_.release(c.seq, /*cache=*/false);
      finish(*seq, FinishReason::error, fmt::format("model step failed: {}", e.what()));
    }
    return;
  }
  steps_.fetch_add(1);
  scheduler_.commit_step(plan);

  // Sampling: every row's sampler runs on its own logits and history, so the rows are sampled in parallel (the
  // host sampler costs milliseconds per row at a 248k vocabulary), then applied in order on this thread.
  struct Job {
    Sequence* seq = nullptr;
    bool completes_prompt = false;  // this step's chunk ends at the prompt's last token
    SequenceSampler* sampler = nullptr;
    std::span<float> logits;
    int32_t greedy_token = -1;
    SampleResult result;
    std::string error;
  };
  std::vector<Job> jobs;
  {
    int64_t row = 0;
    for (const auto& c : plan.chunks) {
      if (!c.want_logits) continue;
      Job j;
      j.seq = c.seq;
      j.completes_prompt = c.start_pos + c.num_tokens == c.seq->prompt_len;
      if (all_greedy || runner_samples) j.greedy_token = greedy_ids_[static_cast<size_t>(row)];
      else j.logits = std::span<float>(logits_.data() + row * vocab_size_, static_cast<size_t>(vocab_size_));
      ++row;
      try {
        j.sampler = sampler_of(*c.seq);
      } catch (const std::exception& e) {
        j.error = e.what();
      }
      jobs.push_back(std::move(j));
    }
  }
  auto run_job = [&](Job& j) {
    if (!j.error.empty()) return;
    try {
      const Sequence& seq = *j.seq;
      if (all_greedy || runner_samples) {
        if (j.greedy_token < 0) fail("sampling: no finite logit (all -inf or NaN)");
        j.result.token = j.greedy_token;
        j.sampler->observe(j.greedy_token);
      } else {
        const int top_n = seq.request.want_logprobs ? seq.request.top_logprobs : 0;
        j.result = j.sampler->sample(j.logits, seq.tokens, static_cast<size_t>(seq.prompt_len), top_n,
                                     seq.request.want_logprobs);
      }
      KILN_CHECK(j.result.token >= 0 && j.result.token < vocab_size_, "sampled token {} outside the vocabulary",
                 j.result.token);
    } catch (const std::exception& e) {
      j.error = e.what();
    }
  };
  // Threads only pay off with enough logits to scan (starting them costs tens of microseconds; a small vocabulary
  // samples in less).
  const bool big = static_cast<int64_t>(jobs.size()) * vocab_size_ >= (int64_t(1) << 17);
  const int threads =
      all_greedy || runner_samples || !big ? 1 : std::min<int>(opts_.sampling_threads, static_cast<int>(jobs.size()));
  if (threads <= 1) {
    for (Job& j : jobs) run_job(j);
  } else {
    std::atomic<size_t> next{0};
    auto worker = [&] {
      for (size_t i = next.fetch_add(1); i < jobs.size(); i = next.fetch_add(1)) run_job(jobs[i]);
    };
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(threads - 1));
    for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (std::thread& t : pool) t.join();
  }

  auto now = Clock::now();
  std::vector<Sequence*> done;
  for (Job& job : jobs) {
    Sequence& seq = *job.seq;
    if (job.completes_prompt) prompt_tokens_.fetch_add(static_cast<uint64_t>(seq.prompt_len));
    TokenEvent ev;
    ev.index = seq.index;
    if (!job.error.empty()) {
      KILN_LOG_ERROR("sampling failed for request {}: {}", seq.request.id, job.error);
      seq.abort_requested = true;  // released below
      TokenEvent err;
      err.index = seq.index;
      err.finished = true;
      err.finish_reason = FinishReason::error;
      err.error = fmt::format("sampling failed: {}", job.error);
      if (seq.channel) outbox_.push_back({seq.channel, std::move(err)});
      finished_[static_cast<int>(FinishReason::error)].fetch_add(1);
      samplers_.erase(seq.uid);
      done.push_back(&seq);
      continue;
    }
    ev.token = job.result.token;
    ev.logprob = job.result.logprob;
    if (seq.request.want_logprobs) ev.top = std::move(job.result.top);
    seq.tokens.push_back(ev.token);
    ++seq.num_generated;
    generation_tokens_.fetch_add(1);
    if (!seq.has_first_token) {
      seq.has_first_token = true;
      ttft_.observe(seconds_between(seq.submitted_at, now));
      queue_time_.observe(seconds_between(seq.submitted_at, seq.admitted_at));
      ev.queue_ms = seconds_between(seq.submitted_at, seq.admitted_at) * 1e3;
      ev.cached_tokens = seq.cached_tokens;
    } else {
      itl_.observe(seconds_between(seq.last_token_at, now));
    }
    seq.last_token_at = now;

    const auto& req = seq.request;
    bool is_eos = !req.ignore_eos && std::binary_search(opts_.eos_token_ids.begin(), opts_.eos_token_ids.end(), ev.token);
    bool is_stop = is_eos || std::find(req.stop_token_ids.begin(), req.stop_token_ids.end(), ev.token) !=
                                 req.stop_token_ids.end() ||
                   (job.sampler && job.sampler->constraint_finished());  // the grammar ended (even with ignore_eos)
    if (is_stop) {
      ev.finished = true;
      ev.finish_reason = FinishReason::stop;
      ev.is_stop_token = true;
    } else if (seq.num_generated >= req.max_tokens ||
               static_cast<int64_t>(seq.tokens.size()) >= opts_.context_length) {
      ev.finished = true;
      ev.finish_reason = FinishReason::length;
    }
    bool finished = ev.finished;
    FinishReason reason = ev.finish_reason;
    if (seq.channel) outbox_.push_back({seq.channel, std::move(ev)});
    if (finished) {
      finished_[static_cast<int>(reason)].fetch_add(1);
      e2e_.observe(seconds_between(seq.submitted_at, now));
      samplers_.erase(seq.uid);
      done.push_back(&seq);
    }
  }
  for (Sequence* s : done) scheduler_.release(s);
}

}  // namespace kiln::engine
