// SequenceSampler against hand-computed expectations.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/error.h"
#include "engine/sampler.h"

namespace kiln::engine {
namespace {

SamplingParams greedy_params() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

double logsumexp(std::initializer_list<double> xs) {
  double s = 0;
  for (double x : xs) s += std::exp(x);
  return std::log(s);
}

TEST(Xoshiro256, KnownStream) {
  // splitmix64-seeded xoshiro256** with seed 42, from an independent (Python big-int) implementation.
  Xoshiro256 r(42);
  EXPECT_EQ(r.next(), 0x15780b2e0c2ec716ull);
  EXPECT_EQ(r.next(), 0x6104d9866d113a7eull);
  EXPECT_EQ(r.next(), 0xae17533239e499a1ull);
  Xoshiro256 u(7);
  for (int i = 0; i < 1000; ++i) {
    const double x = u.uniform();
    ASSERT_GE(x, 0.0);
    ASSERT_LT(x, 1.0);
  }
}

TEST(Sampler, GreedyTakesLowestIdOnTies) {
  SequenceSampler s(greedy_params(), 1);
  std::vector<float> logits = {1, 3, 3, 2};
  const SampleResult r = s.sample(logits, {}, 0, 0);
  EXPECT_EQ(r.token, 1);
  EXPECT_NEAR(r.logprob, 3 - logsumexp({1, 3, 3, 2}), 1e-6);
}

TEST(Sampler, TopLogprobsHighestFirstTiesByLowerId) {
  SequenceSampler s(greedy_params(), 1);
  std::vector<float> logits = {0, 5, 5, 1};
  const SampleResult r = s.sample(logits, {}, 0, 3);
  ASSERT_EQ(r.top.size(), 3u);
  EXPECT_EQ(r.top[0].token, 1);
  EXPECT_EQ(r.top[1].token, 2);
  EXPECT_EQ(r.top[2].token, 3);
  EXPECT_NEAR(r.top[2].logprob, 1 - logsumexp({0, 5, 5, 1}), 1e-6);
}

std::map<int32_t, int> histogram(SamplingParams p, std::vector<float> logits, int draws, uint64_t seed = 5) {
  SequenceSampler s(p, seed);
  std::map<int32_t, int> h;
  for (int i = 0; i < draws; ++i) {
    std::vector<float> l = logits;
    ++h[s.sample(l, {}, 0, 0).token];
  }
  return h;
}

TEST(Sampler, TopKKeepsKLargestAndTies) {
  SamplingParams p;
  p.top_k = 2;
  auto h = histogram(p, {0, 1, 2, 3, 4}, 4000);
  EXPECT_EQ(h.size(), 2u);
  const double expect3 = std::exp(3.0) / (std::exp(3.0) + std::exp(4.0));  // 0.2689
  EXPECT_NEAR(h[3] / 4000.0, expect3, 0.03);
  p.top_k = 1;
  auto ties = histogram(p, {5, 5, 5, 1}, 600);
  EXPECT_EQ(ties.size(), 3u);  // all tokens tied with the k-th largest survive
  EXPECT_EQ(ties.count(3), 0u);
}

TEST(Sampler, TopPKeepsSmallestPrefixReachingP) {
  SamplingParams p;
  p.top_p = 0.75f;  // probs 0.5, 0.3, 0.15, 0.05: mass before token 2 is 0.8 >= 0.75 -> {0, 1}
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  auto h = histogram(p, logits, 4000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_NEAR(h[0] / 4000.0, 0.5 / 0.8, 0.03);
  p.top_p = 0.4f;  // the first token alone already crosses p
  EXPECT_EQ(histogram(p, logits, 200).size(), 1u);
}

TEST(Sampler, MinPDropsTokensBelowFractionOfMax) {
  SamplingParams p;
  p.min_p = 0.2f;  // threshold 0.2 * 0.5 = 0.1: drops token 3 (0.05)
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  auto h = histogram(p, logits, 4000);
  EXPECT_EQ(h.size(), 3u);
  EXPECT_EQ(h.count(3), 0u);
  EXPECT_NEAR(h[2] / 4000.0, 0.15 / 0.95, 0.03);
}

TEST(Sampler, RepetitionPenaltyOverPromptAndGenerated) {
  SamplingParams p = greedy_params();
  p.repetition_penalty = 2.0f;
  SequenceSampler s(p, 1);
  std::vector<float> logits = {2, -2, 1.5f};
  const std::vector<int32_t> history = {0, 1};  // prompt only
  EXPECT_EQ(s.sample(logits, history, 2, 0).token, 2);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);   // 2 / 2
  EXPECT_FLOAT_EQ(logits[1], -4.0f);  // -2 * 2
  EXPECT_FLOAT_EQ(logits[2], 1.5f);
}

TEST(Sampler, FrequencyAndPresenceOverGeneratedOnly) {
  SamplingParams p = greedy_params();
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  SequenceSampler s(p, 1);
  std::vector<float> logits = {1, 1, 1};
  const std::vector<int32_t> history = {2, 0, 0, 1};  // prompt [2], generated [0, 0, 1]
  EXPECT_EQ(s.sample(logits, history, 1, 0).token, 2);
  EXPECT_FLOAT_EQ(logits[0], -0.25f);  // 1 - 2 * 0.5 - 0.25
  EXPECT_FLOAT_EQ(logits[1], 0.25f);   // 1 - 0.5 - 0.25
  EXPECT_FLOAT_EQ(logits[2], 1.0f);    // prompt tokens are not penalised
}

TEST(Sampler, LogprobIsTemperatureScaledBeforeFilters) {
  SamplingParams p;
  p.temperature = 0.5f;
  p.top_k = 1;
  SequenceSampler s(p, 3);
  std::vector<float> logits = {1, 2};
  const SampleResult r = s.sample(logits, {}, 0, 0);
  EXPECT_EQ(r.token, 1);
  EXPECT_NEAR(r.logprob, 4 - logsumexp({2, 4}), 1e-6);
}

TEST(Sampler, SameSeedSameOutputs) {
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<float> base(50);
  for (int i = 0; i < 50; ++i) base[i] = std::sin(i * 0.7f);
  auto run = [&](uint64_t seed) {
    SequenceSampler s(p, seed);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) {
      std::vector<float> l = base;
      out.push_back(s.sample(l, out, 0, 0).token);
    }
    return out;
  };
  EXPECT_EQ(run(1234), run(1234));
  EXPECT_NE(run(1234), run(1235));
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_THROW(SequenceSampler(p, 1), Error);
  p = {};
  p.temperature = -1.0f;
  EXPECT_THROW(SequenceSampler(p, 1), Error);
  p = {};
  SequenceSampler s(p, 1);
  std::vector<float> all_inf(4, -INFINITY);
  EXPECT_THROW(s.sample(all_inf, {}, 0, 0), Error);
}

}  // namespace
}  // namespace kiln::engine
