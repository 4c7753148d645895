// The engine loop with a fake model (DummyRunner, whose output hashes everything a sequence reads through its page
// table and state slot): batching never mixes sequences, capacity is freed, limits hold, failures stay contained; the
// runner's argmax / sampling paths match host sampling; grammar constraints; the prefix cache on and off give the
// same outputs; and the same on the real kiln-tiny model over the CPU backend. Speculative decoding (EngineSpeculative,
// TinySpeculative): greedy output equal to plain decoding's on hybrid models with an MTP head, whatever is accepted.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "engine/dummy_runner.h"
#include "engine/grammar/token_mask.h"
#include "fixture_util.h"
#include "format/model_dir.h"
#include "mtp_model.h"

namespace kiln::engine {
namespace {

using namespace std::chrono_literals;

// Per sequence of a submission: its tokens, how it ended, and the prompt tokens found in the prefix cache.
struct Outcome {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<FinishReason> reasons;
  std::vector<std::string> errors;
  std::vector<int64_t> cached;  // the first token event's cached_tokens (-1: no token)
};

Outcome collect(const std::shared_ptr<RequestChannel>& ch, std::chrono::milliseconds limit = 60s) {
  Outcome o;
  o.tokens.resize(ch->num_sequences());
  o.reasons.resize(ch->num_sequences(), FinishReason::none);
  o.errors.resize(ch->num_sequences());
  o.cached.resize(ch->num_sequences(), -1);
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!(ch->all_finished() && !ch->has_events())) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "timed out waiting for the engine";
      break;
    }
    std::vector<TokenEvent> evs;
    ch->wait(evs, 100ms);
    for (auto& e : evs) {
      if (e.token >= 0 && o.tokens[e.index].empty()) o.cached[e.index] = e.cached_tokens;
      if (e.token >= 0) o.tokens[e.index].push_back(e.token);
      if (e.finished) {
        o.reasons[e.index] = e.finish_reason;
        o.errors[e.index] = e.error;
      }
    }
  }
  return o;
}

// The one sequence of a submission.
struct Answer {
  std::vector<int32_t> tokens;
  FinishReason reason = FinishReason::none;
  std::string error;
  int64_t cached = -1;
};

Answer answer(const std::shared_ptr<RequestChannel>& ch) {
  Outcome o = collect(ch);
  return {o.tokens[0], o.reasons[0], o.errors[0], o.cached[0]};
}

GenerateRequest greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
  GenerateRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0.0f;
  return r;
}

std::vector<std::vector<int32_t>> test_prompts(int count, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> p(1 + rng() % 45);
    for (auto& t : p) t = static_cast<int32_t>(1 + rng() % (vocab - 1));
    out.push_back(p);
  }
  return out;
}

EngineOptions options(int max_running, int64_t chunk, int max_queued = 256) {
  EngineOptions o;
  o.max_running_requests = max_running;
  o.max_queued_requests = max_queued;
  o.chunked_prefill_size = chunk;
  o.eos_token_ids = {0};
  return o;
}

EngineOptions options_with_cache(int max_running, int64_t chunk, bool cache) {
  EngineOptions o = options(max_running, chunk);
  o.enable_prefix_cache = cache;
  return o;
}

TEST(Engine, GreedyOutputDoesNotDependOnTheBatch) {
  DummyRunner::Options ro;
  auto prompts = test_prompts(24, ro.vocab, 7);
  // Alone: one request at a time.
  std::vector<std::vector<int32_t>> alone;
  {
    Engine e(std::make_unique<DummyRunner>(ro), options(8, 16));
    e.start();
    for (const auto& p : prompts) alone.push_back(collect(e.submit({greedy(p, 24)}).channel).tokens[0]);
  }
  int stopped_early = 0;
  for (const auto& a : alone) {
    ASSERT_FALSE(a.empty());
    stopped_early += a.size() < 24;
  }
  EXPECT_GT(stopped_early, 0) << "some sequences should end on eos, to vary batch membership";
  // Together, with different batch limits and prefill chunk sizes: the same tokens.
  for (auto [max_running, chunk] : {std::pair{24, 7}, {5, 3}, {3, 0}, {16, 1}}) {
    auto runner = std::make_unique<DummyRunner>(ro);
    DummyRunner* raw = runner.get();
    Engine e(std::move(runner), options(max_running, chunk));
    e.start();
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (const auto& p : prompts) chans.push_back(e.submit({greedy(p, 24)}).channel);
    for (size_t i = 0; i < prompts.size(); ++i)
      EXPECT_EQ(collect(chans[i]).tokens[0], alone[i]) << "prompt " << i << " max_running " << max_running
                                                       << " chunk " << chunk;
    EXPECT_GT(raw->max_batch(), 1);
    EXPECT_LE(raw->max_batch(), max_running);
    auto m = e.metrics();
    EXPECT_EQ(m.kv_pages_used, 0);
    EXPECT_EQ(m.num_running, 0);
  }
}

// Non-greedy sequences of one step are sampled on several threads: each has its own seeded sampler and logits row,
// so the tokens do not depend on the thread count (or on the batch).
TEST(Engine, SampledOutputDoesNotDependOnSamplingThreads) {
  DummyRunner::Options ro;
  ro.vocab = 32000;  // steps of 5 or more rows x 32000 logits: enough for the engine to use its threads
  auto prompts = test_prompts(20, ro.vocab, 9);
  auto sampled = [](const std::vector<int32_t>& p, uint64_t seed) {
    GenerateRequest r;
    r.prompt = p;
    r.max_tokens = 12;
    r.sampling.temperature = 0.9f;
    r.sampling.top_p = 0.9f;
    r.sampling.top_k = seed % 2 ? 40 : 0;
    r.sampling.seed = seed;
    r.want_logprobs = seed % 3 == 0;
    r.top_logprobs = 2;
    return r;
  };
  std::vector<std::vector<std::vector<int32_t>>> runs;
  for (int threads : {1, 4}) {
    EngineOptions eo = options(20, 64);
    eo.sampling_threads = threads;
    Engine e(std::make_unique<DummyRunner>(ro), eo);
    e.start();
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (size_t i = 0; i < prompts.size(); ++i) chans.push_back(e.submit({sampled(prompts[i], 100 + i)}).channel);
    std::vector<std::vector<int32_t>> out;
    for (auto& ch : chans) out.push_back(collect(ch).tokens[0]);
    runs.push_back(out);
  }
  ASSERT_EQ(runs[0].size(), runs[1].size());
  for (size_t i = 0; i < runs[0].size(); ++i) {
    EXPECT_FALSE(runs[0][i].empty()) << i;
    EXPECT_EQ(runs[0][i], runs[1][i]) << "request " << i;
  }
}

TEST(Engine, StaggeredArrivalsMatchAlone) {
  DummyRunner::Options ro;
  ro.step_delay_us = 200;
  auto prompts = test_prompts(12, ro.vocab, 99);
  std::vector<std::vector<int32_t>> alone;
  {
    Engine e(std::make_unique<DummyRunner>(ro), options(4, 5));
    e.start();
    for (const auto& p : prompts) alone.push_back(collect(e.submit({greedy(p, 16)}).channel).tokens[0]);
  }
  Engine e(std::make_unique<DummyRunner>(ro), options(4, 5));
  e.start();
  std::vector<std::shared_ptr<RequestChannel>> chans;
  std::mt19937 rng(3);
  for (const auto& p : prompts) {
    chans.push_back(e.submit({greedy(p, 16)}).channel);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
  }
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(collect(chans[i]).tokens[0], alone[i]) << i;
}

TEST(Engine, StopsOnEosStopTokensAndLength) {
  DummyRunner::Options ro;
  ro.favourite_token = 5;  // greedy picks 5 once the sequence has 6 tokens
  ro.favourite_after = 6;
  EngineOptions eo = options(4, 8);
  eo.eos_token_ids = {5};
  Engine e(std::make_unique<DummyRunner>(ro), eo);
  e.start();
  // Prompt of 6: the first generated token is 5 = eos.
  auto o = collect(e.submit({greedy({1, 2, 3, 4, 6, 7}, 10)}).channel);
  EXPECT_EQ(o.tokens[0], std::vector<int32_t>{5});
  EXPECT_EQ(o.reasons[0], FinishReason::stop);
  // ignore_eos: runs to max_tokens.
  auto r = greedy({1, 2, 3, 4, 6, 7}, 4);
  r.ignore_eos = true;
  o = collect(e.submit({r}).channel);
  EXPECT_EQ(o.tokens[0].size(), 4u);
  EXPECT_EQ(o.reasons[0], FinishReason::length);
  // stop_token_ids other than eos.
  EngineOptions no_eos = options(4, 8);
  no_eos.eos_token_ids = {};
  Engine e2(std::make_unique<DummyRunner>(ro), no_eos);
  e2.start();
  r = greedy({1, 2, 3, 4, 6, 7}, 9);
  r.stop_token_ids = {5};
  o = collect(e2.submit({r}).channel);
  EXPECT_EQ(o.tokens[0], std::vector<int32_t>{5});
  EXPECT_EQ(o.reasons[0], FinishReason::stop);
}

TEST(Engine, RejectsWhatCanNeverFitWithNumbers) {
  DummyRunner::Options ro;
  ro.capacity.max_context = 100;
  ro.capacity.kv_pages = 30;  // 120 tokens
  Engine e(std::make_unique<DummyRunner>(ro), options(4, 8));
  e.start();
  auto r = e.submit({greedy(std::vector<int32_t>(90, 1), 20)});
  EXPECT_EQ(r.status, SubmitStatus::invalid);
  EXPECT_NE(r.message.find("90"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("100"), std::string::npos) << r.message;
  {
    // A pool smaller than the context caps the context (a warning at startup): one sequence always fits.
    DummyRunner::Options small = ro;
    small.capacity.kv_pages = 10;  // 40 tokens
    Engine e2(std::make_unique<DummyRunner>(small), options(4, 8));
    EXPECT_EQ(e2.context_length(), 40);
    e2.start();
    auto r2 = e2.submit({greedy(std::vector<int32_t>(30, 1), 20)});
    EXPECT_EQ(r2.status, SubmitStatus::invalid);
    EXPECT_NE(r2.message.find("40"), std::string::npos) << r2.message;
    r2 = e2.submit({greedy(std::vector<int32_t>(30, 1), 10)});
    EXPECT_EQ(r2.status, SubmitStatus::ok) << r2.message;
    EXPECT_EQ(collect(r2.channel).tokens[0].size(), 10u);
  }
  r = e.submit({greedy({}, 20)});
  EXPECT_EQ(r.status, SubmitStatus::invalid);
  r = e.submit({greedy({1, 1000}, 2)});
  EXPECT_EQ(r.status, SubmitStatus::invalid);
  EXPECT_NE(r.message.find("1000"), std::string::npos);
  // Still serving.
  auto ok = e.submit({greedy({1, 2}, 3)});
  ASSERT_EQ(ok.status, SubmitStatus::ok);
  EXPECT_FALSE(collect(ok.channel).tokens[0].empty());
  EXPECT_EQ(e.metrics().rejected_too_long, 3u);
}

TEST(Engine, QueueFullThenRoomAgain) {
  DummyRunner::Options ro;
  ro.step_delay_us = 2000;
  Engine e(std::make_unique<DummyRunner>(ro), options(1, 8, /*max_queued=*/2));
  e.start();
  auto slow = [&] {
    auto r = greedy({1, 2, 3}, 50);
    r.ignore_eos = true;
    return r;
  };
  auto a = e.submit({slow()});
  ASSERT_EQ(a.status, SubmitStatus::ok);
  std::this_thread::sleep_for(20ms);  // a is admitted
  auto b = e.submit({slow()});
  auto c = e.submit({slow()});
  ASSERT_EQ(b.status, SubmitStatus::ok);
  ASSERT_EQ(c.status, SubmitStatus::ok);
  auto d = e.submit({slow()});
  EXPECT_EQ(d.status, SubmitStatus::queue_full);
  EXPECT_NE(d.message.find("queue"), std::string::npos);
  // n = 2 does not fit either; all-or-nothing.
  auto pair = e.submit({slow(), slow()});
  EXPECT_EQ(pair.status, SubmitStatus::queue_full);
  EXPECT_EQ(e.metrics().num_waiting, 2);
  a.channel->cancel();
  b.channel->cancel();
  c.channel->cancel();
  collect(a.channel);
  collect(b.channel);
  collect(c.channel);
  auto again = e.submit({greedy({1}, 1)});
  EXPECT_EQ(again.status, SubmitStatus::ok);
  collect(again.channel);
}

TEST(Engine, NoQueueMeansRunOrRefuse) {
  DummyRunner::Options ro;
  ro.step_delay_us = 2000;
  Engine e(std::make_unique<DummyRunner>(ro), options(2, 8, /*max_queued=*/0));
  e.start();
  auto r = greedy({1, 2, 3}, 50);
  r.ignore_eos = true;
  auto a = e.submit({r});
  auto b = e.submit({r});
  EXPECT_EQ(a.status, SubmitStatus::ok);
  EXPECT_EQ(b.status, SubmitStatus::ok);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(e.submit({r}).status, SubmitStatus::queue_full);
  a.channel->cancel();
  b.channel->cancel();
  collect(a.channel);
  collect(b.channel);
  EXPECT_EQ(collect(e.submit({greedy({1}, 1)}).channel).tokens[0].size(), 1u);
}

TEST(Engine, CancelFreesCapacityAtTheNextStep) {
  DummyRunner::Options ro;
  ro.step_delay_us = 1000;
  Engine e(std::make_unique<DummyRunner>(ro), options(4, 8));
  e.start();
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (int i = 0; i < 6; ++i) {  // 4 run, 2 wait
    auto r = greedy({1, 2, 3, static_cast<int32_t>(i + 4)}, 100);
    r.ignore_eos = true;
    chans.push_back(e.submit({r}).channel);
  }
  for (int i = 0; i < 500 && (e.metrics().num_running < 4 || e.metrics().num_waiting < 2); ++i)
    std::this_thread::sleep_for(2ms);
  auto m = e.metrics();
  EXPECT_EQ(m.num_running, 4);
  EXPECT_EQ(m.num_waiting, 2);
  EXPECT_GT(m.kv_pages_used, 0);
  for (auto& c : chans) c->cancel();
  for (auto& c : chans) {
    auto o = collect(c);
    EXPECT_EQ(o.reasons[0], FinishReason::abort);
  }
  for (int i = 0; i < 100 && e.metrics().kv_pages_used != 0; ++i) std::this_thread::sleep_for(5ms);
  m = e.metrics();
  EXPECT_EQ(m.kv_pages_used, 0);
  EXPECT_EQ(m.state_slots_used, 0);
  EXPECT_EQ(m.num_running, 0);
  EXPECT_EQ(m.num_waiting, 0);
  EXPECT_EQ(m.finished_abort, 6u);
}

TEST(Engine, RunnerFailureEndsOnlyThatStepsSequences) {
  DummyRunner::Options ro;
  ro.fail_on_token = 63;
  Engine e(std::make_unique<DummyRunner>(ro), options(4, 8));
  e.start();
  auto bad = collect(e.submit({greedy({1, 63, 2}, 5)}).channel);
  EXPECT_EQ(bad.reasons[0], FinishReason::error);
  EXPECT_NE(bad.errors[0].find("injected failure"), std::string::npos);
  auto good = collect(e.submit({greedy({1, 2}, 5)}).channel);
  EXPECT_NE(good.reasons[0], FinishReason::error);
  EXPECT_EQ(e.metrics().kv_pages_used, 0);
}

// A sequence's sampler is made when the engine takes it: one that cannot be made (bad parameters) ends that sequence
// with the sampler's reason before it holds any page, and the engine goes on serving.
TEST(Engine, BadSamplingParametersEndOnlyThatSequence) {
  DummyRunner::Options ro;
  Engine e(std::make_unique<DummyRunner>(ro), options(4, 8));
  e.start();
  GenerateRequest bad = greedy({1, 2, 3}, 4);
  bad.sampling.top_p = 0.0f;
  Answer a = answer(e.submit({bad}).channel);
  EXPECT_EQ(a.reason, FinishReason::error);
  EXPECT_TRUE(a.tokens.empty());
  EXPECT_NE(a.error.find("top_p"), std::string::npos) << a.error;
  auto m = e.metrics();
  EXPECT_EQ(m.finished_error, 1u);
  EXPECT_EQ(m.kv_pages_used, 0);
  GenerateRequest good = greedy({1, 2, 3}, 4);
  good.ignore_eos = true;
  EXPECT_EQ(answer(e.submit({good}).channel).tokens.size(), 4u);
}

TEST(Engine, SeveralSequencesPerSubmission) {
  DummyRunner::Options ro;
  Engine e(std::make_unique<DummyRunner>(ro), options(8, 8));
  e.start();
  std::vector<GenerateRequest> reqs;
  for (int i = 0; i < 3; ++i) {
    GenerateRequest r = greedy({3, 4, 5}, 6);
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 100 + i;
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  auto first = collect(e.submit(reqs).channel);
  auto again = collect(e.submit(reqs).channel);
  EXPECT_EQ(first.tokens, again.tokens) << "same seeds, same samples";
  for (int i = 0; i < 3; ++i) EXPECT_EQ(first.tokens[i].size(), 6u);
  EXPECT_TRUE(first.tokens[0] != first.tokens[1] || first.tokens[1] != first.tokens[2]);
}

TEST(Engine, LogprobsAndMetrics) {
  DummyRunner::Options ro;
  Engine e(std::make_unique<DummyRunner>(ro), options(8, 8));
  e.start();
  auto r = greedy({1, 2, 3}, 4);
  r.ignore_eos = true;
  r.want_logprobs = true;
  r.top_logprobs = 3;
  auto sub = e.submit({r});
  std::vector<TokenEvent> evs;
  while (!sub.channel->all_finished() || sub.channel->has_events()) sub.channel->wait(evs, 100ms);
  int tokens = 0;
  for (const auto& ev : evs)
    if (ev.token >= 0) {
      ++tokens;
      ASSERT_EQ(ev.top.size(), 3u);
      EXPECT_EQ(ev.top[0].token, ev.token);  // greedy picks the top one
      EXPECT_LE(ev.logprob, 0.0f);
    }
  EXPECT_EQ(tokens, 4);
  auto m = e.metrics();
  EXPECT_EQ(m.generation_tokens_total, 4u);
  EXPECT_EQ(m.prompt_tokens_total, 3u);
  EXPECT_EQ(m.time_to_first_token_s.count, 1u);
  EXPECT_EQ(m.inter_token_latency_s.count, 3u);
  EXPECT_EQ(m.finished_length, 1u);
}

TEST(Engine, DrainFinishesInFlightThenRefuses) {
  DummyRunner::Options ro;
  ro.step_delay_us = 500;
  Engine e(std::make_unique<DummyRunner>(ro), options(4, 8));
  e.start();
  auto r = greedy({1, 2}, 20);
  r.ignore_eos = true;
  auto sub = e.submit({r});
  EXPECT_TRUE(e.drain(5s));
  auto o = collect(sub.channel);
  EXPECT_EQ(o.tokens[0].size(), 20u);
  EXPECT_EQ(e.submit({greedy({1}, 1)}).status, SubmitStatus::draining);
}

TEST(Engine, DrainTimeoutAbortsTheRest) {
  DummyRunner::Options ro;
  ro.step_delay_us = 2000;
  Engine e(std::make_unique<DummyRunner>(ro), options(4, 8));
  e.start();
  auto r = greedy({1, 2}, 400);
  r.ignore_eos = true;
  auto sub = e.submit({r});
  EXPECT_FALSE(e.drain(50ms));
  auto o = collect(sub.channel);
  EXPECT_EQ(o.reasons[0], FinishReason::abort);
  EXPECT_EQ(e.metrics().kv_pages_used, 0);
}

// A DummyRunner that counts how the engine asks for tokens.
class CountingRunner : public DummyRunner {
 public:
  using DummyRunner::DummyRunner;
  void forward_sample(std::span<const model::SeqChunk> chunks, std::span<const model::RowSampling> rows,
                      std::span<int32_t> tokens) override {
    ++sample_calls;
    ModelRunner::forward_sample(chunks, rows, tokens);  // forward() + model::sample_row_host
  }
  void forward_argmax(std::span<const model::SeqChunk> chunks, std::span<int32_t> tokens) override {
    ++argmax_calls;
    ModelRunner::forward_argmax(chunks, tokens);
  }
  std::atomic<int> sample_calls{0}, argmax_calls{0};
};

// Steps without penalties and logprobs let the runner draw the tokens (forward_sample, with each sequence's next
// uniform); asking for logprobs keeps the host sampler. Both give the same tokens for the same seeds, greedy
// sequences in the same steps included.
TEST(Engine, RunnerSamplingMatchesHostSampling) {
  DummyRunner::Options ro;
  ro.vocab = 1000;  // hashed logits in [0, 10) on a 0.01 grid: many ties
  auto prompts = test_prompts(16, ro.vocab, 11);
  auto request = [](const std::vector<int32_t>& p, size_t i, bool logprobs) {
    GenerateRequest r;
    r.prompt = p;
    r.max_tokens = 10;
    r.sampling.temperature = i % 5 == 4 ? 0.0f : 0.3f + 0.25f * static_cast<float>(i % 7);
    r.sampling.top_k = std::vector<int>{0, 1, 5, 50, 1000}[i % 5];
    r.sampling.top_p = std::vector<float>{1.0f, 0.9f, 0.5f, 0.01f}[i % 4];
    r.sampling.min_p = i % 3 == 0 ? 0.05f : 0.0f;
    r.sampling.seed = 500 + i;
    r.want_logprobs = logprobs;
    r.top_logprobs = logprobs ? 2 : 0;
    return r;
  };
  std::vector<std::vector<std::vector<int32_t>>> runs;
  for (bool logprobs : {false, true}) {
    auto runner = std::make_unique<CountingRunner>(ro);
    CountingRunner* raw = runner.get();
    Engine e(std::move(runner), options(16, 64));
    e.start();
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (size_t i = 0; i < prompts.size(); ++i) chans.push_back(e.submit({request(prompts[i], i, logprobs)}).channel);
    std::vector<std::vector<int32_t>> out;
    for (auto& ch : chans) {
      Outcome o = collect(ch);
      EXPECT_NE(o.reasons[0], FinishReason::error) << o.errors[0];
      out.push_back(o.tokens[0]);
    }
    runs.push_back(out);
    if (logprobs) EXPECT_EQ(raw->sample_calls.load(), 0);
    else EXPECT_GT(raw->sample_calls.load(), 0);
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_FALSE(runs[0][i].empty()) << i;
    EXPECT_EQ(runs[0][i], runs[1][i]) << "request " << i;
  }
}

// A row without a finite logit fails only its own sequence on the runner path, as on the host path.
TEST(Engine, RunnerSamplingReportsRowsWithoutFiniteLogits) {
  struct NoFiniteRunner : DummyRunner {
    using DummyRunner::DummyRunner;
    void forward_sample(std::span<const model::SeqChunk> chunks, std::span<const model::RowSampling> rows,
                        std::span<int32_t> tokens) override {
      ModelRunner::forward_sample(chunks, rows, tokens);
      for (size_t i = 0; i < rows.size(); ++i)
        if (rows[i].top_k == 3) tokens[i] = -1;  // as model::sample_row_host answers for an all -inf row
    }
  };
  DummyRunner::Options ro;
  Engine e(std::make_unique<NoFiniteRunner>(ro), options(4, 8));
  e.start();
  GenerateRequest bad = greedy({1, 2, 3}, 4), good = greedy({4, 5}, 4);
  bad.sampling.temperature = good.sampling.temperature = 1.0f;
  bad.sampling.top_k = 3;
  bad.ignore_eos = good.ignore_eos = true;
  auto b = e.submit({bad}).channel;
  auto g = e.submit({good}).channel;
  Outcome ob = collect(b), og = collect(g);
  EXPECT_EQ(ob.reasons[0], FinishReason::error);
  EXPECT_NE(ob.errors[0].find("no finite logit"), std::string::npos) << ob.errors[0];
  EXPECT_EQ(og.reasons[0], FinishReason::length);
  EXPECT_EQ(og.tokens[0].size(), 4u);
}

// ---- grammar constraints (64-token vocabulary): constrained sequences follow the grammar whether they sample
// greedily (the runner's argmax path is bypassed) or at temperature 1, end on eos exactly where the grammar is
// complete, and start only after their start token.

// Token i (1..63) is the byte 'A' + i - 1 ('A'..'~'); token 0 is eos (no bytes).
std::shared_ptr<const grammar::TokenTable> table() {
  std::vector<std::string> bytes(64);
  for (int i = 1; i < 64; ++i) bytes[static_cast<size_t>(i)] = std::string(1, static_cast<char>('A' + i - 1));
  return std::make_shared<grammar::TokenTable>(bytes);
}

// "[" then 1..3 of "AB" or "C", then "]".
std::shared_ptr<const grammar::Grammar> brackets() {
  auto g = std::make_shared<grammar::Grammar>();
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({g->literal("["),
                               g->repeat([&] { return g->alt({g->literal("AB"), g->literal("C")}); }, 1, 3),
                               g->literal("]")}));
  g->set_root(root);
  return g;
}

std::string text_of(const std::vector<int32_t>& toks, bool* ended_on_eos) {
  std::string s;
  *ended_on_eos = !toks.empty() && toks.back() == 0;
  for (int32_t t : toks)
    if (t > 0) s += static_cast<char>('A' + t - 1);
  return s;
}

bool valid(const std::string& s) {
  if (s.size() < 3 || s.front() != '[' || s.back() != ']') return false;
  std::string body = s.substr(1, s.size() - 2);
  int items = 0;
  for (size_t i = 0; i < body.size(); ++items) {
    if (body.compare(i, 2, "AB") == 0) i += 2;
    else if (body[i] == 'C') i += 1;
    else return false;
  }
  return items >= 1 && items <= 3;
}

// The brackets grammar over the 64-token table.
std::shared_ptr<grammar::Constraint> brackets_constraint() {
  auto c = std::make_shared<grammar::Constraint>();
  c->grammar = brackets();
  c->tokens = table();
  return c;
}

// The engine's default options with token 0 as eos.
EngineOptions eos_zero_options() {
  EngineOptions eo;
  eo.eos_token_ids = {0};
  return eo;
}

std::vector<int32_t> run_one(Engine& e, GenerateRequest r) {
  Answer a = answer(e.submit({r}).channel);
  EXPECT_NE(a.reason, FinishReason::error) << a.error;
  return a.tokens;
}

TEST(EngineConstraint, GreedyAndSampledRowsFollowTheGrammarAndEndOnEos) {
  Engine e(std::make_unique<DummyRunner>(DummyRunner::Options{}), eos_zero_options());
  e.start();
  auto c = brackets_constraint();
  for (float temperature : {0.0f, 1.0f}) {
    for (int i = 0; i < 12; ++i) {
      GenerateRequest r;
      r.prompt = {static_cast<int32_t>(1 + i), 7, 9};
      r.max_tokens = 40;
      r.sampling.temperature = temperature;
      r.sampling.seed = static_cast<uint64_t>(i);
      r.constraint = c;
      bool eos = false;
      std::string s = text_of(run_one(e, r), &eos);
      EXPECT_TRUE(valid(s)) << s << " (temperature " << temperature << ")";
      EXPECT_TRUE(eos) << s;
    }
  }
}

TEST(EngineConstraint, StartsAfterItsStartToken) {
  DummyRunner::Options ro;
  ro.favourite_token = 5;  // the fake model prefers token 5 after a few tokens: it is the "</think>" here
  ro.favourite_after = 6;
  Engine e(std::make_unique<DummyRunner>(ro), eos_zero_options());
  e.start();
  auto c = brackets_constraint();
  c->start_after_token = 5;
  GenerateRequest r;
  r.prompt = {3, 4};
  r.max_tokens = 60;
  r.sampling.temperature = 0.0f;
  r.constraint = c;
  std::vector<int32_t> toks = run_one(e, r);
  auto it = std::find(toks.begin(), toks.end(), 5);
  ASSERT_NE(it, toks.end());
  bool eos = false;
  std::string after = text_of(std::vector<int32_t>(it + 1, toks.end()), &eos);
  EXPECT_TRUE(valid(after)) << after;
  EXPECT_TRUE(eos);
}

// Requests in one batch that share one compiled grammar (the server's GrammarCache) each follow it on their own.
TEST(EngineConstraint, RequestsSharingACompiledGrammar) {
  Engine e(std::make_unique<DummyRunner>(DummyRunner::Options{}), eos_zero_options());
  e.start();
  auto c = brackets_constraint();
  grammar::GrammarCache cache;
  c->compiled = cache.get(c->grammar, c->tokens);
  std::vector<std::shared_ptr<RequestChannel>> channels;
  for (int i = 0; i < 8; ++i) {
    GenerateRequest r;
    r.prompt = {static_cast<int32_t>(2 + i), 9};
    r.max_tokens = 40;
    r.sampling.temperature = 1.0f;
    r.sampling.seed = static_cast<uint64_t>(100 + i);
    r.constraint = c;
    channels.push_back(e.submit({r}).channel);
  }
  for (auto& ch : channels) {
    bool eos = false;
    std::string s = text_of(answer(ch).tokens, &eos);
    EXPECT_TRUE(valid(s)) << s;
    EXPECT_TRUE(eos) << s;
  }
  EXPECT_GT(c->compiled->mask_hits(), 0u);
}

// ---- the prefix cache over the DummyRunner: a wrong page, a wrong snapshot or another request's slot changes the
// output.

DummyRunner::Options dummy(int64_t pages, int slots) {
  DummyRunner::Options d;
  d.vocab = 50;
  d.capacity.page_size = 4;
  d.capacity.kv_pages = pages;
  d.capacity.state_slots = slots;
  d.capacity.max_context = 512;
  return d;
}

// Multi-turn conversations: turn t sends the whole history (prompts and answers so far) plus new tokens.
struct Conversation {
  std::vector<int32_t> history;
  std::vector<std::vector<int32_t>> answers;
};

std::vector<int32_t> new_message(std::mt19937& rng, int len) {
  std::vector<int32_t> m(static_cast<size_t>(len));
  for (auto& t : m) t = static_cast<int32_t>(1 + rng() % 49);
  return m;
}

// Runs `convs` conversations of `turns` turns; all conversations' turn t are submitted together.
std::vector<Conversation> run_conversations(Engine& e, int convs, int turns, int seed, std::vector<int64_t>* cached) {
  std::mt19937 rng(seed);
  std::vector<Conversation> cs(static_cast<size_t>(convs));
  // Conversations share a system prompt per group of 3, so they share and then diverge.
  std::vector<std::vector<int32_t>> systems;
  for (int g = 0; g < (convs + 2) / 3; ++g) systems.push_back(new_message(rng, 9 + g));
  for (int i = 0; i < convs; ++i) cs[i].history = systems[i / 3];
  for (int t = 0; t < turns; ++t) {
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (auto& c : cs) {
      auto m = new_message(rng, 3 + static_cast<int>(rng() % 7));
      c.history.insert(c.history.end(), m.begin(), m.end());
      auto r = e.submit({greedy(c.history, 6 + static_cast<int>(rng() % 6))});
      EXPECT_EQ(r.status, SubmitStatus::ok) << r.message;
      chans.push_back(r.channel);
    }
    for (size_t i = 0; i < cs.size(); ++i) {
      Answer o = answer(chans[i]);
      cs[i].answers.push_back(o.tokens);
      if (cached) cached->push_back(o.cached);
      // The next turn's history holds the visible answer (an eos token is not part of it).
      for (int32_t tok : o.tokens)
        if (tok != 0) cs[i].history.push_back(tok);
    }
  }
  return cs;
}

void expect_idle_and_clean(Engine& e) {
  auto m = e.metrics();
  EXPECT_EQ(m.num_running, 0);
  EXPECT_EQ(m.kv_pages_used, 0);
  EXPECT_EQ(m.state_slots_used, 0);
}

TEST(EngineCache, OnAndOffGiveTheSameOutputsSequentialAndConcurrent) {
  for (int running : {1, 6}) {
    Engine off(std::make_unique<DummyRunner>(dummy(400, 6)), options_with_cache(running, 16, false));
    off.start();
    auto ref = run_conversations(off, 6, 5, 11, nullptr);
    Engine on(std::make_unique<DummyRunner>(dummy(400, 18)), options_with_cache(running, 16, true));
    on.start();
    std::vector<int64_t> cached;
    auto got = run_conversations(on, 6, 5, 11, &cached);
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(got[i].answers, ref[i].answers) << "conversation " << i;
    auto m = on.metrics();
    EXPECT_GT(m.prefix_cache_hit_tokens_total, 0u);
    // From turn 2 on, a turn reuses its conversation's previous turn up to a page boundary: always when run one at a
    // time; concurrently, the 6 running sequences hold 12 of the 18 slots and older snapshots may be evicted.
    int hits = 0;
    for (size_t k = 6; k < cached.size(); ++k) hits += cached[k] > 0;
    const int later = static_cast<int>(cached.size()) - 6;
    if (running == 1) EXPECT_EQ(hits, later);
    else EXPECT_GE(hits * 4, later * 3);
    expect_idle_and_clean(on);
    expect_idle_and_clean(off);
    EXPECT_EQ(off.metrics().prefix_cache_hit_tokens_total, 0u);
  }
}

// Snapshots written inside a prompt's chunk (the runner's chunk_snapshots) instead of cutting the prompt at its
// snapshotted page boundaries: the same outputs and the same cache hits turn after turn, in fewer engine steps (the
// DummyRunner's state hash at the snapshot must be the one a cut chunk would have left, or the next turn's output
// changes).
TEST(EngineCache, SnapshotsInsideChunksEqualCutChunksInFewerSteps) {
  for (int running : {1, 6}) {
    std::vector<std::vector<Conversation>> runs;
    std::vector<std::vector<int64_t>> cached(2);
    std::vector<uint64_t> steps;
    for (const bool inside : {false, true}) {
      EngineOptions o = options_with_cache(running, 16, true);
      o.chunk_snapshots = inside;
      Engine e(std::make_unique<DummyRunner>(dummy(400, 18)), o);
      e.start();
      runs.push_back(run_conversations(e, 6, 5, 23, &cached[inside ? 1 : 0]));
      steps.push_back(e.metrics().steps_total);
      expect_idle_and_clean(e);
    }
    for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_EQ(runs[1][i].answers, runs[0][i].answers) << "conversation " << i;
    if (running == 1) EXPECT_EQ(cached[1], cached[0]);  // concurrently, batching shifts which snapshot is evicted
    int hits = 0;
    for (size_t k = 6; k < cached[1].size(); ++k) hits += cached[1][k] > 0;
    EXPECT_GE(hits * 4, (static_cast<int>(cached[1].size()) - 6) * 3);
    // One request at a time the steps are deterministic (concurrently, batching depends on arrival timing).
    if (running == 1) EXPECT_LT(steps[1], steps[0]);
  }
}

// The case that got 0 hits on the GPU: a client that re-sends the previous turn as text, re-tokenized. The next
// prompt then leaves the previous one's ids within its last page (its last token merges with the answer's first
// characters, or a chat template renders the generation-prompt tail otherwise for a past turn) and the answer
// comes back as other ids. Emulated here on ids: turn t+1 = turn t's prompt with its last 1..3 ids changed + an
// answer of other ids + a new message. Each turn must reuse the previous prompt up to the page boundary a page or
// more before its end (page 4: at least prompt - 7 tokens), and the outputs equal those without the cache.
TEST(EngineCache, ReTokenizedHistoryStillReusesThePreviousPrompt) {
  constexpr int kConvs = 4, kTurns = 5, kPage = 4;
  auto run = [&](bool cache, std::vector<std::vector<int64_t>>* cached, std::vector<std::vector<int64_t>>* need) {
    // 3 slots per running request (as kiln serve gives them) + 2 per conversation for the cached snapshots of its
    // previous turn: this test is about re-tokenized prompts matching, not about capacity. With 3 per request only
    // it failed 8 of 80 runs on a loaded machine; the likely order (one turn finishing before the others are
    // admitted) makes the others' snapshot saves evict that conversation's fresh snapshots before the stale ones
    // their own turns were restored from (LRU by last use), and its next turn misses.
    Engine e(std::make_unique<DummyRunner>(dummy(800, 5 * kConvs)), options_with_cache(kConvs, 16, cache));
    e.start();
    std::mt19937 rng(41);
    std::vector<std::vector<int32_t>> prompt(kConvs);
    std::vector<std::vector<std::vector<int32_t>>> answers(kConvs);
    for (int t = 0; t < kTurns; ++t) {
      std::vector<std::shared_ptr<RequestChannel>> chans;
      std::vector<int64_t> reusable(kConvs, 0);
      for (int c = 0; c < kConvs; ++c) {
        auto& p = prompt[static_cast<size_t>(c)];
        if (t > 0) {
          const size_t changed = 1 + rng() % 3;  // the re-tokenized edge
          const int64_t prev = static_cast<int64_t>(p.size());
          reusable[c] = prev / kPage * kPage - kPage;  // the prompt's second-to-last page boundary
          for (size_t k = p.size() - changed; k < p.size(); ++k) p[k] = static_cast<int32_t>(1 + (p[k] + 7) % 49);
          auto answer = new_message(rng, 8);  // the answer, re-tokenized into other ids
          p.insert(p.end(), answer.begin(), answer.end());
        }
        auto m = new_message(rng, 9 + static_cast<int>(rng() % 9));
        p.insert(p.end(), m.begin(), m.end());
        auto r = e.submit({greedy(p, 6)});
        EXPECT_EQ(r.status, SubmitStatus::ok) << r.message;
        chans.push_back(r.channel);
      }
      std::vector<int64_t> got(kConvs);
      for (int c = 0; c < kConvs; ++c) {
        Answer o = answer(chans[static_cast<size_t>(c)]);
        answers[static_cast<size_t>(c)].push_back(o.tokens);
        got[c] = o.cached;
      }
      if (cached) cached->push_back(got);
      if (need) need->push_back(reusable);
    }
    expect_idle_and_clean(e);
    return answers;
  };
  auto ref = run(false, nullptr, nullptr);
  std::vector<std::vector<int64_t>> cached, need;
  auto got = run(true, &cached, &need);
  EXPECT_EQ(got, ref);
  for (int t = 1; t < kTurns; ++t)
    for (int c = 0; c < kConvs; ++c)
      EXPECT_GE(cached[t][c], need[t][c]) << "turn " << t + 1 << ", conversation " << c;
}

TEST(EngineCache, PreemptionAndEvictionInTheMiddleChangeNothing) {
  Engine off(std::make_unique<DummyRunner>(dummy(400, 8)), options_with_cache(8, 8, false));
  off.start();
  auto ref = run_conversations(off, 8, 4, 23, nullptr);
  // A pool of 40 pages (160 tokens) for 8 conversations of up to ~120 tokens: the cache is evicted and running
  // sequences preempted all along. Whether a preemption happens depends on how many of a turn's requests the engine
  // thread sees at once (the test thread submits them one by one), so a run without one is repeated, up to 8 runs on
  // fresh engines; every run's answers must equal the reference.
  for (int attempt = 0; attempt < 8; ++attempt) {
    Engine on(std::make_unique<DummyRunner>(dummy(40, 12)), options_with_cache(8, 8, true));
    on.start();
    auto got = run_conversations(on, 8, 4, 23, nullptr);
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(got[i].answers, ref[i].answers) << "conversation " << i;
    expect_idle_and_clean(on);
    auto m = on.metrics();
    if (m.preemptions_total == 0 && attempt + 1 < 8) continue;
    EXPECT_GT(m.preemptions_total, 0u) << "no preemption in 8 runs";
    EXPECT_GT(m.prefix_cache_evicted_pages_total, 0u);
    EXPECT_GT(m.prefix_cache_evicted_snapshots_total, 0u);
    break;
  }
}

// Many concurrent requests that share prefixes (the same few stems) and diverge at every page position: each
// must read only its own state. Alone (no cache, one at a time) is the reference.
TEST(EngineCache, ManyConcurrentRequestsSharingPrefixesNeverReadAnothersState) {
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> stems;
  for (int i = 0; i < 3; ++i) stems.push_back(new_message(rng, 37));
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 64; ++i) {
    const auto& stem = stems[static_cast<size_t>(i) % stems.size()];
    const size_t cut = 1 + rng() % stem.size();  // diverge anywhere: inside a page, at a boundary
    std::vector<int32_t> p(stem.begin(), stem.begin() + static_cast<std::ptrdiff_t>(cut));
    auto tail = new_message(rng, static_cast<int>(rng() % 9));
    p.insert(p.end(), tail.begin(), tail.end());
    prompts.push_back(p);
  }
  std::vector<std::vector<int32_t>> alone;
  {
    Engine e(std::make_unique<DummyRunner>(dummy(400, 4)), options_with_cache(1, 0, false));
    e.start();
    for (const auto& p : prompts) alone.push_back(answer(e.submit({greedy(p, 10)}).channel).tokens);
  }
  for (int round = 0; round < 3; ++round) {
    // Round 0 fills the cache; rounds 1, 2 hit it while all 64 run together (and round 2 with a small pool).
    Engine e(std::make_unique<DummyRunner>(dummy(round == 2 ? 60 : 800, 96)), options_with_cache(32, 24, true));
    e.start();
    for (int pass = 0; pass < 2; ++pass) {
      std::vector<std::shared_ptr<RequestChannel>> chans;
      for (const auto& p : prompts) chans.push_back(e.submit({greedy(p, 10)}).channel);
      for (size_t i = 0; i < prompts.size(); ++i)
        EXPECT_EQ(answer(chans[i]).tokens, alone[i]) << "prompt " << i << " round " << round << " pass " << pass;
    }
    EXPECT_GT(e.metrics().prefix_cache_hit_tokens_total, 0u);
    expect_idle_and_clean(e);
  }
}

TEST(EngineCache, ThirtyTwoConcurrentRequestsInATinyPoolAllFinishAsAlone) {
  std::mt19937 rng(9);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 32; ++i) prompts.push_back(new_message(rng, 5 + static_cast<int>(rng() % 20)));
  std::vector<std::vector<int32_t>> alone;
  {
    Engine e(std::make_unique<DummyRunner>(dummy(400, 4)), options_with_cache(1, 0, false));
    e.start();
    for (const auto& p : prompts) alone.push_back(answer(e.submit({greedy(p, 24)}).channel).tokens);
  }
  for (bool cache : {false, true}) {
    // 16 pages = 64 tokens: room for about two of them at once.
    Engine e(std::make_unique<DummyRunner>(dummy(16, 96)), options_with_cache(32, 16, cache));
    e.start();
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (const auto& p : prompts) {
      auto r = e.submit({greedy(p, 24)});
      ASSERT_EQ(r.status, SubmitStatus::ok) << r.message;
      chans.push_back(r.channel);
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      Answer o = answer(chans[i]);
      EXPECT_NE(o.reason, FinishReason::error);
      EXPECT_EQ(o.tokens, alone[i]) << "prompt " << i << " cache " << cache;
    }
    EXPECT_GT(e.metrics().preemptions_total, 0u);
    expect_idle_and_clean(e);
  }
}

// ---- the prefix cache and preemption on the real model: kiln-tiny (models/kiln-tiny) on the CPU backend. Greedy
// outputs with the cache on equal those with it off, over multi-turn conversations run one at a time and
// concurrently, with preemption and eviction in the middle (a small KV pool); nothing leaks.

const std::string kTiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";

std::unique_ptr<model::ModelRunner> tiny(int64_t kv_pages, int slots) {
  backend::LoadOptions lo;
  lo.max_context = 1024;
  lo.kv_pages = kv_pages;
  lo.state_slots = slots;
  lo.prefill_chunk = 64;
  return backend::load_cpu_model(format::ModelDir::open(kTiny), lo);
}

EngineOptions tiny_options(int running, bool cache) {
  EngineOptions o;
  o.max_running_requests = running;
  o.chunked_prefill_size = 48;
  o.eos_token_ids = {2050};
  o.enable_prefix_cache = cache;
  return o;
}

// `convs` conversations of `turns` turns over token ids (no template needed: the cache sees ids); conversations
// share a system prefix in pairs; turn t of every conversation is submitted at once.
std::vector<std::vector<std::vector<int32_t>>> converse(Engine& e, int convs, int turns, int64_t* hit_turns) {
  std::mt19937 rng(3);
  auto words = [&](int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = static_cast<int32_t>(300 + rng() % 1500);
    return v;
  };
  std::vector<std::vector<int32_t>> history(static_cast<size_t>(convs));
  std::vector<std::vector<int32_t>> systems;
  for (int i = 0; i < (convs + 1) / 2; ++i) systems.push_back(words(40));
  for (int i = 0; i < convs; ++i) history[i] = systems[i / 2];
  std::vector<std::vector<std::vector<int32_t>>> out(static_cast<size_t>(convs));
  for (int t = 0; t < turns; ++t) {
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (auto& h : history) {
      auto m = words(12 + static_cast<int>(rng() % 10));
      h.insert(h.end(), m.begin(), m.end());
      GenerateRequest r;
      r.prompt = h;
      r.max_tokens = 12;
      r.ignore_eos = true;
      r.sampling.temperature = 0.0f;
      auto s = e.submit({r});
      EXPECT_EQ(s.status, SubmitStatus::ok) << s.message;
      chans.push_back(s.channel);
    }
    for (int i = 0; i < convs; ++i) {
      Answer a = answer(chans[static_cast<size_t>(i)]);
      EXPECT_NE(a.reason, FinishReason::error) << a.error;
      if (t > 0 && a.cached > 0 && hit_turns) ++*hit_turns;
      out[static_cast<size_t>(i)].push_back(a.tokens);
      history[static_cast<size_t>(i)].insert(history[static_cast<size_t>(i)].end(), a.tokens.begin(), a.tokens.end());
    }
  }
  return out;
}

TEST(TinyPrefixCache, GreedyOutputsWithTheCacheEqualThoseWithout) {
  const int convs = 4, turns = 4;
  std::vector<std::vector<std::vector<int32_t>>> ref;
  {
    Engine off(tiny(400, 4), tiny_options(1, false));
    off.start();
    ref = converse(off, convs, turns, nullptr);
  }
  struct Case {
    int running;
    int64_t pages;
    const char* what;
  } cases[] = {{1, 400, "one at a time"}, {4, 400, "concurrent"}, {4, 24, "concurrent, 384-token pool"}};
  for (const Case& c : cases) {
    // Slots: each running sequence's own and its two pending snapshots (the prompt's second-to-last page boundary,
    // the latest), two cached snapshots per conversation (the same two of its last turn) and a spare.
    Engine on(tiny(c.pages, 3 * c.running + 2 * convs + 1), tiny_options(c.running, true));
    on.start();
    int64_t hits = 0;
    auto got = converse(on, convs, turns, &hits);
    for (int i = 0; i < convs; ++i) EXPECT_EQ(got[i], ref[i]) << c.what << ", conversation " << i;
    auto m = on.metrics();
    EXPECT_GT(m.prefix_cache_hit_tokens_total, 0u) << c.what;
    if (c.running == 1) EXPECT_EQ(hits, convs * (turns - 1)) << c.what;
    if (c.pages < 100) EXPECT_GT(m.preemptions_total + m.prefix_cache_evicted_pages_total, 0u) << c.what;
    EXPECT_EQ(m.kv_pages_used, 0) << c.what;
    EXPECT_EQ(m.state_slots_used, 0) << c.what;
    std::printf("[tiny cache] %s: %llu of %llu prompt tokens cached, %llu preemptions, %llu pages evicted\n", c.what,
                static_cast<unsigned long long>(m.prefix_cache_hit_tokens_total),
                static_cast<unsigned long long>(m.prefix_cache_query_tokens_total),
                static_cast<unsigned long long>(m.preemptions_total),
                static_cast<unsigned long long>(m.prefix_cache_evicted_pages_total));
  }
}


// ---- speculative decoding (engine.cpp's speculative step) on a real hybrid model: a tiny Qwen3.5-MoE (DeltaNet and
// full-attention layers) with a random MTP head (tests/support/mtp_model) over the CPU backend. Greedy output must be
// token for token the output without speculation, whatever is drafted and accepted. A random head is rarely right, so
// a scripted drafter (ScriptedDrafts below) also proposes the reference continuation with a chosen number of correct
// tokens: full accepts, partial accepts and immediate rejects all happen, and a draft-less step follows an
// accepted one (the stale-state bug of peers).

class SpecModel {
 public:
  SpecModel() {
    base_ = tmp_.path() + "/base";
    dir_ = tmp_.path() + "/mtp";
    std::filesystem::create_directories(base_);
    kiln::test::write_fixture_model(base_, kiln::test::Family::qwen3_5_moe, kiln::test::Layout::bf16);
    kiln::test::write_model_with_mtp(base_, dir_, 28);
  }
  std::unique_ptr<model::ModelRunner> load(bool mtp, int64_t kv_pages = 0, int slots = 8, int tp = 1) const {
    backend::LoadOptions lo;
    lo.parallel.tp_size = tp;
    lo.kv_dtype = DType::F32;
    lo.max_context = 256;
    lo.kv_pages = kv_pages;
    lo.state_slots = slots;
    lo.prefill_chunk = 64;
    lo.mtp = mtp;
    return backend::load_cpu_model(format::ModelDir::open(dir_), lo);
  }

 private:
  kiln::test::TempDir tmp_;
  std::string base_, dir_;
};

const SpecModel& spec_model() {
  static SpecModel m;
  return m;
}

// Wraps a runner; draft() proposes the reference continuation of the sequence (found by the tokens the runner has
// seen on its slot) with only the first `correct(pos, steps)` drafts right and the rest off by one id. Records the
// accepted-then-draft-less pattern it saw.
class ScriptedDrafts : public model::ModelRunner {
 public:
  ScriptedDrafts(std::unique_ptr<model::ModelRunner> inner, std::vector<std::vector<int32_t>> references,
                 std::function<int(int64_t pos, int steps)> correct)
      : inner_(std::move(inner)), refs_(std::move(references)), correct_(std::move(correct)) {}

  model::RunnerCapacity capacity() const override { return inner_->capacity(); }
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  void forward(std::span<const model::SeqChunk> chunks, std::span<float> logits) override {
    see(chunks);
    inner_->forward(chunks, logits);
  }
  void forward_argmax(std::span<const model::SeqChunk> chunks, std::span<int32_t> tokens) override {
    see(chunks);
    inner_->forward_argmax(chunks, tokens);
  }
  void forward_sample(std::span<const model::SeqChunk> chunks, std::span<const model::RowSampling> rows,
                      std::span<int32_t> tokens) override {
    see(chunks);
    inner_->forward_sample(chunks, rows, tokens);
  }
  bool can_copy_state() const override { return inner_->can_copy_state(); }
  void copy_state(int src, int dst) override {
    seen_[dst] = seen_[src];
    inner_->copy_state(src, dst);
  }
  bool has_recurrent_state() const override { return inner_->has_recurrent_state(); }
  int mtp_layers() const override { return inner_->mtp_layers(); }
  void save_state(int slot) override { inner_->save_state(slot); }
  void restore_state(int slot) override { inner_->restore_state(slot); }
  // The inner runner's position checkpoints, unless hidden (the engine then checkpoints, restores and replays).
  int position_checkpoints() const override { return replay_ ? 0 : inner_->position_checkpoints(); }
  void keep_verified(int slot, int tokens) override { inner_->keep_verified(slot, tokens); }
  void hide_checkpoints() { replay_ = true; }
  std::string describe() const override { return "scripted drafts over " + inner_->describe(); }

  void draft(std::span<const model::DraftSeq> seqs, int steps, std::span<int32_t> tokens,
             std::span<float> logits) override {
    inner_->draft(seqs, steps, tokens, logits);  // the head's own KV entries, as in a real step
    const int32_t V = static_cast<int32_t>(vocab_size());
    for (size_t s = 0; s < seqs.size(); ++s) {
      std::vector<int32_t> prefix(seen_[seqs[s].state_slot].begin(),
                                  seen_[seqs[s].state_slot].begin() + seqs[s].pos);
      prefix.push_back(seqs[s].token);
      const std::vector<int32_t>* ref = nullptr;
      for (const auto& r : refs_)
        if (r.size() > prefix.size() && std::equal(prefix.begin(), prefix.end(), r.begin())) ref = &r;
      const int good = correct_(seqs[s].pos, steps);
      for (int k = 0; k < steps; ++k) {
        const size_t at = static_cast<size_t>(seqs[s].pos) + 1 + static_cast<size_t>(k);
        const int32_t right = ref && at < ref->size() ? (*ref)[at] : 1;
        tokens[s * steps + k] = k < good ? right : (right + 1) % V;
      }
    }
  }

 private:
  void see(std::span<const model::SeqChunk> chunks) {
    for (const auto& c : chunks) {
      auto& h = seen_[c.state_slot];
      if (c.start_pos == 0) h.clear();
      h.resize(static_cast<size_t>(c.start_pos));
      h.insert(h.end(), c.tokens.begin(), c.tokens.end());
    }
  }
  std::unique_ptr<model::ModelRunner> inner_;
  std::vector<std::vector<int32_t>> refs_;
  std::function<int(int64_t, int)> correct_;
  std::map<int, std::vector<int32_t>> seen_;
  bool replay_ = false;
};

// A ScriptedDrafts that settles rejected drafts by the replay (position checkpoints hidden) when `replay`.
std::unique_ptr<model::ModelRunner> scripted(std::unique_ptr<model::ModelRunner> inner,
                                             std::vector<std::vector<int32_t>> refs,
                                             std::function<int(int64_t, int)> correct, bool replay) {
  auto d = std::make_unique<ScriptedDrafts>(std::move(inner), std::move(refs), std::move(correct));
  if (replay) d->hide_checkpoints();
  return d;
}

EngineOptions spec_options(int running, int k) {
  EngineOptions o;
  o.max_running_requests = running;
  o.chunked_prefill_size = 64;
  o.eos_token_ids = {95};
  o.enable_prefix_cache = false;
  o.speculative_num_steps = k;
  if (k > 0) o.draft_length_for_step = [k](int) { return k; };
  return o;
}

std::vector<std::vector<int32_t>> spec_prompts() {
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> p(static_cast<size_t>(3 + rng() % 20));
    for (auto& t : p) t = static_cast<int32_t>(rng() % 95);
    out.push_back(p);
  }
  return out;
}

// Every prompt submitted at once (a batch of several); each sequence's tokens.
// start_after_submit: the engine is not started yet; every request is queued first, so the first step sees them all
// (a test that needs them to run together, e.g. to force preemptions, does not depend on thread timing).
std::vector<std::vector<int32_t>> run_all(Engine& e, const std::vector<std::vector<int32_t>>& prompts,
                                          int64_t max_tokens, bool ignore_eos = true, bool start_after_submit = false) {
  std::vector<std::shared_ptr<RequestChannel>> chans;
  for (const auto& p : prompts) {
    GenerateRequest r = greedy(p, max_tokens);
    r.ignore_eos = ignore_eos;
    auto s = e.submit({r});
    EXPECT_EQ(s.status, SubmitStatus::ok) << s.message;
    chans.push_back(s.channel);
  }
  if (start_after_submit) e.start();
  std::vector<std::vector<int32_t>> out;
  for (auto& ch : chans) {
    Answer a = answer(ch);
    EXPECT_NE(a.reason, FinishReason::error) << a.error;
    out.push_back(a.tokens);
  }
  return out;
}

// The reference: no speculation (the head not even loaded).
std::vector<std::vector<int32_t>> reference_outputs(const std::vector<std::vector<int32_t>>& prompts, int64_t n) {
  Engine e(spec_model().load(false), spec_options(8, 0));
  e.start();
  return run_all(e, prompts, n);
}

std::vector<std::vector<int32_t>> full_sequences(const std::vector<std::vector<int32_t>>& prompts,
                                                 const std::vector<std::vector<int32_t>>& outputs) {
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    out.push_back(prompts[i]);
    out.back().insert(out.back().end(), outputs[i].begin(), outputs[i].end());
  }
  return out;
}

TEST(EngineSpeculative, RandomHeadGreedyOutputEqualsPlainDecoding) {
  const auto prompts = spec_prompts();
  const auto ref = reference_outputs(prompts, 24);
  for (int k = 1; k <= 4; ++k) {
    Engine e(spec_model().load(true), spec_options(8, k));
    e.start();
    EXPECT_EQ(run_all(e, prompts, 24), ref) << "K = " << k;
    const auto m = e.metrics();
    EXPECT_GT(m.spec_draft_tokens_total, 0u) << "K = " << k;
    EXPECT_EQ(m.kv_pages_used, 0);
    EXPECT_EQ(m.state_slots_used, 0);
  }
}

// A grammar with speculation (greedy): the verify runs through the sampler position by position, each masked by the
// state the tokens before it reached; a token that completes the grammar ends the row. Output equal to plain
// constrained decoding, valid, ended on eos; drafts accepted (scripted ones follow the reference) and rejected (the
// random head's, often outside the grammar). The brackets grammar over the spec model's 96 ids: ids 1..63 are the
// bytes 'A'..'~', the others (eos 95 among them) have none.
TEST(EngineSpeculative, GrammarConstrainedGreedyOutputEqualsPlainDecoding) {
  std::vector<std::string> bytes(96);
  for (int i = 1; i < 64; ++i) bytes[static_cast<size_t>(i)] = std::string(1, static_cast<char>('A' + i - 1));
  auto c = std::make_shared<grammar::Constraint>();
  c->grammar = brackets();
  c->tokens = std::make_shared<grammar::TokenTable>(bytes);
  const auto prompts = spec_prompts();
  auto run = [&](Engine& e) {
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (const auto& p : prompts) {
      GenerateRequest r = greedy(p, 30);
      r.constraint = c;
      chans.push_back(e.submit({r}).channel);
    }
    std::vector<std::vector<int32_t>> out;
    for (auto& ch : chans) {
      Answer a = answer(ch);
      EXPECT_EQ(a.reason, FinishReason::stop) << a.error;
      out.push_back(a.tokens);
    }
    return out;
  };
  Engine plain(spec_model().load(false), spec_options(8, 0));
  plain.start();
  const auto ref = run(plain);
  for (const auto& toks : ref) {
    bool eos = false;
    std::string s;
    for (int32_t t : toks)
      if (t >= 1 && t < 64) s += static_cast<char>('A' + t - 1);
    EXPECT_TRUE(valid(s)) << s;
    EXPECT_EQ(toks.back(), 95);
    (void)eos;
  }
  const auto refs = full_sequences(prompts, ref);
  for (bool scripted : {false, true}) {
    std::unique_ptr<model::ModelRunner> runner = spec_model().load(true);
    if (scripted)
      runner = std::make_unique<ScriptedDrafts>(std::move(runner), refs,
                                                [](int64_t pos, int steps) { return (pos * 3 + 2) % (steps + 1); });
    Engine e(std::move(runner), spec_options(8, 3));
    e.start();
    EXPECT_EQ(run(e), ref) << (scripted ? "scripted drafts" : "random head");
    const auto m = e.metrics();
    EXPECT_GT(m.spec_draft_tokens_total, 0u);
    if (scripted) EXPECT_GT(m.spec_accepted_tokens_total, 0u);
  }
}

// Tensor parallelism (model::TpRunner, ranks as threads): the ranks draft together (each offers its best over its
// vocabulary slice, all take the same winner), save and restore their shares of the state; greedy output equals the
// same TP size without speculation, with the random head and with scripted drafts (partial accepts and rejects).
TEST(EngineSpeculative, TensorParallelGreedyOutputEqualsPlainDecoding) {
  const auto prompts = spec_prompts();
  for (int tp : {2, 4}) {
    Engine plain(spec_model().load(false, 0, 8, tp), spec_options(8, 0));
    plain.start();
    const auto ref = run_all(plain, prompts, 20);
    const auto refs = full_sequences(prompts, ref);
    for (bool scripted : {false, true}) {
      std::unique_ptr<model::ModelRunner> runner = spec_model().load(true, 0, 8, tp);
      if (scripted)
        runner = std::make_unique<ScriptedDrafts>(std::move(runner), refs,
                                                  [](int64_t pos, int steps) { return (pos * 5 + 1) % (steps + 1); });
      Engine e(std::move(runner), spec_options(8, 3));
      e.start();
      EXPECT_EQ(run_all(e, prompts, 20), ref) << "tp " << tp << (scripted ? " scripted" : " random head");
      const auto m = e.metrics();
      EXPECT_GT(m.spec_draft_tokens_total, 0u) << "tp " << tp;
      if (scripted) EXPECT_GT(m.spec_accepted_tokens_total, 0u) << "tp " << tp;
    }
  }
}

TEST(EngineSpeculative, ScriptedDraftsGreedyOutputEqualsPlainDecoding) {
  const auto prompts = spec_prompts();
  const auto ref = reference_outputs(prompts, 30);
  const auto refs = full_sequences(prompts, ref);
  for (int k = 1; k <= 4; ++k) for (bool replay : {false, true}) {
    // Correct drafts: 0 .. K by position, so full, partial and no accepts all happen. Rejected drafts settled by
    // position checkpoints, and by the replay. 32 state slots: the runner keeps one position checkpoint per slot, and
    // 6 rows of K = 4 drafts need 24 (with fewer the engine shortens the rows' drafts: other tests run that).
    auto runner = scripted(spec_model().load(true, 0, 32), refs,
                           [](int64_t pos, int steps) { return static_cast<int>((pos * 7 + 3) % (steps + 1)); }, replay);
    Engine e(std::move(runner), spec_options(8, k));
    e.start();
    EXPECT_EQ(run_all(e, prompts, 30), ref) << "K = " << k << (replay ? ", replay" : ", position checkpoints");
    const auto m = e.metrics();
    EXPECT_GT(m.spec_accepted_tokens_total, 0u);
    EXPECT_LT(m.spec_accepted_tokens_total, m.spec_draft_tokens_total);
    // Some verifies accepted everything (accept length K + 1), some nothing (1).
    const auto& h = m.spec_accept_length;
    EXPECT_GT(h.cumulative_counts[0], 0u) << "K = " << k;  // le 1
    EXPECT_GT(h.count - h.cumulative_counts[static_cast<size_t>(k) - 1], 0u) << "K = " << k;  // > K
    EXPECT_EQ(m.generation_tokens_total, 30u * prompts.size());
  }
}

// vLLM PR 52942's bug: a step that accepted drafts followed by a draft-less step must see the state after the
// accepted tokens. Steps alternate K drafts and none; the drafts are all right (accepted) or all but the last.
TEST(EngineSpeculative, DraftlessStepAfterAcceptedDraftsSeesTheRightState) {
  const auto prompts = spec_prompts();
  const auto ref = reference_outputs(prompts, 30);
  const auto refs = full_sequences(prompts, ref);
  for (bool all_right : {true, false}) {
    for (int k : {1, 3}) for (bool replay : {false, true}) {
      auto runner = scripted(
          spec_model().load(true), refs, [all_right](int64_t, int steps) { return all_right ? steps : steps - 1; },
          replay);
      EngineOptions o = spec_options(8, k);
      auto step = std::make_shared<int>(0);
      o.draft_length_for_step = [k, step](int) { return (*step)++ % 2 == 0 ? k : 0; };
      Engine e(std::move(runner), o);
      e.start();
      EXPECT_EQ(run_all(e, prompts, 30), ref) << "K = " << k << (all_right ? ", all right" : ", last wrong");
      const auto m = e.metrics();
      if (all_right || k > 1) EXPECT_GT(m.spec_accepted_tokens_total, 0u);
      if (all_right) EXPECT_EQ(m.spec_accepted_tokens_total, m.spec_draft_tokens_total);
    }
  }
  // One sequence alone, all drafts right: accepted-draft steps and draft-less steps strictly alternate.
  auto runner = std::make_unique<ScriptedDrafts>(spec_model().load(true), refs, [](int64_t, int steps) { return steps; });
  EngineOptions o = spec_options(1, 2);
  auto step = std::make_shared<int>(0);
  o.draft_length_for_step = [step](int) { return (*step)++ % 2 == 0 ? 2 : 0; };
  Engine e(std::move(runner), o);
  e.start();
  EXPECT_EQ(run_all(e, {prompts[0]}, 30)[0], ref[0]);
}

TEST(EngineSpeculative, MaxTokensStopTokensAndEosHold) {
  const auto prompts = spec_prompts();
  const auto ref = reference_outputs(prompts, 30);
  const auto refs = full_sequences(prompts, ref);
  auto make = [&] {
    auto runner = std::make_unique<ScriptedDrafts>(spec_model().load(true), refs, [](int64_t, int s) { return s; });
    auto e = std::make_unique<Engine>(std::move(runner), spec_options(8, 4));
    e->start();
    return e;
  };
  // max_tokens inside a fully accepted verify: exactly that many tokens.
  for (int64_t n : {1, 2, 3, 5, 7}) {
    auto e = make();
    GenerateRequest r = greedy(prompts[0], n);
    r.ignore_eos = true;
    Answer a = answer(e->submit({r}).channel);
    EXPECT_EQ(a.reason, FinishReason::length);
    EXPECT_EQ(a.tokens, std::vector<int32_t>(ref[0].begin(), ref[0].begin() + n)) << "max_tokens " << n;
  }
  // A stop token in the middle of accepted drafts: the output ends at it, nothing after.
  for (size_t at : {size_t(2), size_t(6), size_t(11)}) {
    auto e = make();
    GenerateRequest r = greedy(prompts[1], 30);
    r.ignore_eos = true;
    r.stop_token_ids = {ref[1][at]};
    const size_t first = static_cast<size_t>(std::find(ref[1].begin(), ref[1].end(), ref[1][at]) - ref[1].begin());
    Answer a = answer(e->submit({r}).channel);
    EXPECT_EQ(a.reason, FinishReason::stop);
    EXPECT_EQ(a.tokens, std::vector<int32_t>(ref[1].begin(), ref[1].begin() + first + 1)) << "stop at " << at;
  }
  // The model's eos (ids 95) as in plain decoding, and pages freed.
  auto e = make();
  const auto plain_eos = [&] {
    Engine p(spec_model().load(false), spec_options(8, 0));
    p.start();
    return run_all(p, prompts, 30, /*ignore_eos=*/false);
  }();
  EXPECT_EQ(run_all(*e, prompts, 30, false), plain_eos);
  EXPECT_EQ(e->metrics().kv_pages_used, 0);
}

// min_tokens with drafts (engine.cpp's can_speculate: a sequence short of its min_tokens decodes plainly, its eos and
// stop ids masked): a stop id that the drafts propose (all right: the reference's own tokens) cannot end the output
// before min_tokens, and the output is plain decoding's with the same min_tokens.
TEST(EngineSpeculative, MinTokensHoldsAgainstDraftedStopIds) {
  const auto prompts = spec_prompts();
  const auto ref = reference_outputs(prompts, 30);
  const auto refs = full_sequences(prompts, ref);
  constexpr int64_t kMinTokens = 12;
  auto outputs = [&](Engine& e) {
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (size_t i = 0; i < prompts.size(); ++i) {
      GenerateRequest r = greedy(prompts[i], 30);
      r.ignore_eos = true;
      r.stop_token_ids = {ref[i][2]};  // without min_tokens the output ends by its third token
      r.min_tokens = kMinTokens;
      auto s = e.submit({r});
      EXPECT_EQ(s.status, SubmitStatus::ok) << s.message;
      chans.push_back(s.channel);
    }
    std::vector<Answer> out;
    for (auto& ch : chans) out.push_back(answer(ch));
    return out;
  };
  Engine plain(spec_model().load(false), spec_options(8, 0));
  plain.start();
  const std::vector<Answer> want = outputs(plain);
  auto runner = std::make_unique<ScriptedDrafts>(spec_model().load(true), refs, [](int64_t, int s) { return s; });
  Engine spec(std::move(runner), spec_options(8, 4));
  spec.start();
  const std::vector<Answer> got = outputs(spec);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_NE(want[i].reason, FinishReason::error) << want[i].error;
    EXPECT_GE(static_cast<int64_t>(want[i].tokens.size()), kMinTokens) << "prompt " << i;
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "prompt " << i;
    EXPECT_EQ(got[i].reason, want[i].reason) << "prompt " << i;
  }
  EXPECT_GT(spec.metrics().spec_draft_tokens_total, 0u);  // drafts once min_tokens are reached
  EXPECT_EQ(spec.metrics().kv_pages_used, 0);
}

TEST(EngineSpeculative, SeveralChoicesLogprobsAndSampling) {
  const auto prompts = spec_prompts();
  const auto ref = reference_outputs(prompts, 20);
  const auto refs = full_sequences(prompts, ref);
  auto scripted = [&] {
    return std::make_unique<ScriptedDrafts>(spec_model().load(true), refs,
                                            [](int64_t pos, int s) { return static_cast<int>(pos % (s + 1)); });
  };
  // n = 3 greedy choices of one request: all the reference.
  {
    Engine e(scripted(), spec_options(8, 3));
    e.start();
    GenerateRequest r = greedy(prompts[2], 20);
    r.ignore_eos = true;
    Outcome o = collect(e.submit({r, r, r}).channel);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(o.tokens[i], ref[2]) << "choice " << i;
  }
  // Greedy with logprobs: the target's logprobs (those of plain decoding) at every accepted position.
  auto logprobs_of = [&](std::unique_ptr<model::ModelRunner> runner, int k) {
    Engine e(std::move(runner), spec_options(8, k));
    e.start();
    GenerateRequest r = greedy(prompts[3], 20);
    r.ignore_eos = true;
    r.want_logprobs = true;
    r.top_logprobs = 2;
    auto ch = e.submit({r}).channel;
    std::vector<TokenEvent> all;
    while (!(ch->all_finished() && !ch->has_events())) {
      std::vector<TokenEvent> evs;
      ch->wait(evs, 100ms);
      for (auto& ev : evs)
        if (ev.token >= 0) all.push_back(ev);
    }
    return all;
  };
  const auto plain = logprobs_of(spec_model().load(false), 0);
  const auto spec = logprobs_of(scripted(), 3);
  ASSERT_EQ(plain.size(), spec.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(plain[i].token, spec[i].token);
    EXPECT_NEAR(plain[i].logprob, spec[i].logprob, 1e-4) << i;
    ASSERT_EQ(plain[i].top.size(), 2u);
    ASSERT_EQ(spec[i].top.size(), 2u);
    EXPECT_EQ(plain[i].top[1].token, spec[i].top[1].token);
  }
  // Sampling with a seed: reproducible with speculation on (the sequence's own stream decides acceptance).
  auto sampled = [&] {
    Engine e(scripted(), spec_options(8, 3));
    e.start();
    GenerateRequest r;
    r.prompt = prompts[4];
    r.max_tokens = 20;
    r.ignore_eos = true;
    r.sampling.temperature = 0.8f;
    r.sampling.top_k = 20;
    r.sampling.seed = 5;
    Outcome o = collect(e.submit({r, r}).channel);
    EXPECT_GT(e.metrics().spec_draft_tokens_total, 0u);
    return o.tokens;
  };
  const auto a = sampled(), b = sampled();
  EXPECT_EQ(a, b);
  EXPECT_EQ(a[0].size(), 20u);
}

TEST(EngineSpeculative, PreemptionAndThePrefixCacheChangeNothing) {
  const auto prompts = spec_prompts();
  const auto ref = reference_outputs(prompts, 40);
  const auto refs = full_sequences(prompts, ref);
  // A pool of 12 pages (192 tokens) for six sequences of up to 63 tokens: some are preempted and recomputed.
  {
    auto runner = std::make_unique<ScriptedDrafts>(spec_model().load(true, 12, 8), refs,
                                                   [](int64_t pos, int s) { return static_cast<int>(pos % (s + 1)); });
    Engine e(std::move(runner), spec_options(6, 3));
    EXPECT_EQ(run_all(e, prompts, 40, true, /*start_after_submit=*/true), ref);
    const auto m = e.metrics();
    EXPECT_GT(m.preemptions_total, 0u);
    EXPECT_GT(m.spec_accepted_tokens_total, 0u);
    EXPECT_EQ(m.kv_pages_used, 0);
  }
  // The prefix cache on: prompts of two pages and more, each twice (the second time from a cached prefix).
  std::vector<std::vector<int32_t>> longer;
  for (const auto& p : prompts) {
    longer.push_back(p);
    while (longer.back().size() < 40) longer.back().insert(longer.back().end(), p.begin(), p.end());
  }
  const auto longer_ref = reference_outputs(longer, 40);
  for (int k : {0, 3}) {
    auto runner = std::make_unique<ScriptedDrafts>(spec_model().load(k > 0, 0, 32), full_sequences(longer, longer_ref),
                                                   [](int64_t pos, int s) { return static_cast<int>(pos % (s + 1)); });
    EngineOptions o = spec_options(4, k);
    o.enable_prefix_cache = true;
    Engine e(std::move(runner), o);
    e.start();
    EXPECT_EQ(run_all(e, longer, 40), longer_ref) << "K = " << k;
    EXPECT_EQ(run_all(e, longer, 40), longer_ref) << "K = " << k;
    EXPECT_GT(e.metrics().prefix_cache_hit_tokens_total, 0u) << "K = " << k;
  }
}

TEST(EngineSpeculative, AdaptiveChoiceKeepsTheOutputAndRefusesAModelWithoutAHead) {
  const auto prompts = spec_prompts();
  const auto ref = reference_outputs(prompts, 24);
  EngineOptions o = spec_options(8, 3);
  o.draft_length_for_step = nullptr;  // the measured costs decide
  Engine e(spec_model().load(true), o);
  e.start();
  EXPECT_EQ(run_all(e, prompts, 24), ref);
  // Fixed draft length (--speculative-fixed-steps): every verify drafts K = 3, except where a row's max_tokens leaves
  // room for fewer (row_draft_length): its last two verifies at most, 3 drafts short in all; the same output. One
  // sequence at a time, so that the step's position checkpoints (a budget shared by its rows) never run short.
  EngineOptions fixed = spec_options(1, 3);
  fixed.draft_length_for_step = nullptr;
  fixed.speculative_adaptive = false;
  Engine f(spec_model().load(true), fixed);
  f.start();
  EXPECT_EQ(run_all(f, prompts, 24), ref);
  const auto m = f.metrics();
  const uint64_t verifies = m.spec_accept_length.count;
  ASSERT_GT(verifies, 0u);
  EXPECT_LE(m.spec_draft_tokens_total, 3 * verifies);
  EXPECT_GE(m.spec_draft_tokens_total + 3 * prompts.size(), 3 * verifies);
  // Every step with a decoding sequence chose K = 3 (/metrics' kiln:spec_step_draft_length): all in the bucket le=3,
  // none below it. One sequence at a time: a step per verify, plus at most one per sequence whose max_tokens left
  // room for no draft.
  const auto& k = m.spec_step_draft_length;
  ASSERT_EQ(k.upper_bounds.size(), 9u);
  EXPECT_GE(k.count, verifies);
  EXPECT_LE(k.count, verifies + prompts.size());
  EXPECT_EQ(k.cumulative_counts[2], 0u);       // le=2
  EXPECT_EQ(k.cumulative_counts[3], k.count);  // le=3
  EXPECT_DOUBLE_EQ(k.sum, 3.0 * static_cast<double>(k.count));
  // The adaptive engine's steps: each chose some K in 0 .. 3, its drafted rows' verifies among them.
  const auto ma = e.metrics();
  EXPECT_GT(ma.spec_step_draft_length.count, 0u);
  EXPECT_EQ(ma.spec_step_draft_length.cumulative_counts[3], ma.spec_step_draft_length.count);
  EXPECT_GE(ma.spec_step_draft_length.count - ma.spec_step_draft_length.cumulative_counts[0],
            ma.spec_accept_length.count / 8);  // a step verifies at most 8 sequences
  try {
    Engine bad(spec_model().load(false), spec_options(8, 3));
    FAIL() << "an engine without an MTP head accepted speculative decoding";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("MTP head"), std::string::npos) << err.what();
  }
}


// kiln-tiny (trained main model, NVFP4 experts) with its trained BF16 MTP head ('mtp*' left unquantised, as the real
// checkpoints have it): greedy outputs with speculation, the head's own drafts and scripted ones (so that drafts of
// every accept length happen), equal plain decoding's for concurrent requests with chunked prefill.
TEST(TinySpeculative, GreedyOutputsEqualPlainDecoding) {
  const std::string dir = kTiny;
  auto load = [&](bool mtp) {
    backend::LoadOptions lo;
    lo.max_context = 512;
    lo.state_slots = 4;
    lo.prefill_chunk = 64;
    lo.mtp = mtp;
    return backend::load_cpu_model(format::ModelDir::open(dir), lo);
  };
  ASSERT_EQ(load(true)->mtp_layers(), 1) << "kiln-tiny ships an MTP head";
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> p(static_cast<size_t>(20 + rng() % 40));
    for (auto& t : p) t = static_cast<int32_t>(300 + rng() % 1500);
    prompts.push_back(p);
  }
  EngineOptions o = tiny_options(4, false);
  std::vector<std::vector<int32_t>> ref;
  {
    Engine plain(load(false), o);
    plain.start();
    ref = run_all(plain, prompts, 24);
  }
  o.speculative_num_steps = 3;
  o.draft_length_for_step = [](int) { return 3; };
  // The trained head's own drafts, with the first draft of each step carried from the step before (the default) and
  // without: the same drafts (so the same acceptances), only where the head's first entry ran.
  // Carrying with the chain left on the device for the verify (the default), and without that, must agree too.
  EngineMetricsSnapshot with_carry, without, not_deferred;
  for (const int variant : {0, 1, 2}) {  // 0: carry + defer, 1: no carry, 2: carry without defer
    o.speculative_carry = variant != 1;
    o.speculative_defer_chain = variant != 2;
    Engine own(load(true), o);
    // Every request queued before the loop starts: the same steps in both runs (batching then depends on no timing).
    EXPECT_EQ(run_all(own, prompts, 24, true, /*start_after_submit=*/true), ref) << "variant " << variant;
    (variant == 0 ? with_carry : variant == 1 ? without : not_deferred) = own.metrics();
  }
  o.speculative_carry = o.speculative_defer_chain = true;
  EXPECT_EQ(not_deferred.spec_draft_tokens_total, with_carry.spec_draft_tokens_total);
  EXPECT_EQ(not_deferred.spec_accepted_tokens_total, with_carry.spec_accepted_tokens_total);
  EXPECT_GT(with_carry.spec_draft_tokens_total, 0u);
  EXPECT_GT(with_carry.spec_carried_drafts_total, 0u);
  EXPECT_EQ(without.spec_carried_drafts_total, 0u);
  EXPECT_EQ(with_carry.spec_draft_tokens_total, without.spec_draft_tokens_total);
  EXPECT_EQ(with_carry.spec_accepted_tokens_total, without.spec_accepted_tokens_total);
  EXPECT_GT(with_carry.spec_accepted_tokens_total, 0u);
  Engine spec(std::make_unique<ScriptedDrafts>(load(true), full_sequences(prompts, ref),
                                               [](int64_t pos, int s) { return static_cast<int>(pos % (s + 1)); }),
              o);
  spec.start();
  EXPECT_EQ(run_all(spec, prompts, 24), ref);
  const auto m = spec.metrics();
  EXPECT_GT(m.spec_accepted_tokens_total, 0u);
  std::printf("[tiny spec] %llu of %llu drafts accepted, mean accept length %.2f\n",
              static_cast<unsigned long long>(m.spec_accepted_tokens_total),
              static_cast<unsigned long long>(m.spec_draft_tokens_total),
              m.spec_accept_length.sum / std::max<uint64_t>(m.spec_accept_length.count, 1));
}

}  // namespace
}  // namespace kiln::engine
