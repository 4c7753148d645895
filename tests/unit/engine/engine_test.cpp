// The engine loop with a fake model: batching never mixes sequences, capacity is freed, limits hold,
// failures stay contained.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>

#include "engine/dummy_runner.h"

namespace kiln::engine {
namespace {

using namespace std::chrono_literals;

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<FinishReason> reasons;
  std::vector<std::string> errors;
};

Outcome collect(const std::shared_ptr<RequestChannel>& ch, std::chrono::milliseconds limit = 20s) {
  Outcome o;
  o.tokens.resize(ch->num_sequences());
  o.reasons.resize(ch->num_sequences(), FinishReason::none);
  o.errors.resize(ch->num_sequences());
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!(ch->all_finished() && !ch->has_events())) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "timed out waiting for the engine";
      break;
    }
    std::vector<TokenEvent> evs;
    ch->wait(evs, 100ms);
    for (auto& e : evs) {
      if (e.token >= 0) o.tokens[e.index].push_back(e.token);
      if (e.finished) {
        o.reasons[e.index] = e.finish_reason;
        o.errors[e.index] = e.error;
      }
    }
  }
  return o;
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
  ro.max_context = 100;
  ro.kv_pages = 10;  // 40 tokens
  Engine e(std::make_unique<DummyRunner>(ro), options(4, 8));
  e.start();
  auto r = e.submit({greedy(std::vector<int32_t>(90, 1), 20)});
  EXPECT_EQ(r.status, SubmitStatus::invalid);
  EXPECT_NE(r.message.find("90"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("100"), std::string::npos) << r.message;
  r = e.submit({greedy(std::vector<int32_t>(30, 1), 20)});  // fits the context, not the pool
  EXPECT_EQ(r.status, SubmitStatus::invalid);
  EXPECT_NE(r.message.find("KV"), std::string::npos) << r.message;
  r = e.submit({greedy({}, 20)});
  EXPECT_EQ(r.status, SubmitStatus::invalid);
  r = e.submit({greedy({1, 1000}, 2)});
  EXPECT_EQ(r.status, SubmitStatus::invalid);
  EXPECT_NE(r.message.find("1000"), std::string::npos);
  // Still serving.
  auto ok = e.submit({greedy({1, 2}, 3)});
  ASSERT_EQ(ok.status, SubmitStatus::ok);
  EXPECT_FALSE(collect(ok.channel).tokens[0].empty());
  EXPECT_EQ(e.metrics().rejected_too_long, 4u);
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

}  // namespace
}  // namespace kiln::engine
