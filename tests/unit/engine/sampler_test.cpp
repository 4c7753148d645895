// SequenceSampler against hand-computed expectations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <vector>

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

// The full-vocabulary definition of steps 2-4 (sampler.h), written out plainly: temperature, top-k as a -inf mask,
// top-p over a full sort, min-p, one draw walking ascending ids. The sampler works on a candidate list with a
// partially sorted prefix; it must pick the same token with the same logprob, draw for draw.
struct ReferenceSampler {
  SamplingParams p;
  Xoshiro256 rng;
  ReferenceSampler(const SamplingParams& params, uint64_t seed) : p(params), rng(seed) {}
  std::pair<int32_t, float> sample(std::vector<float> l) {
    const int64_t V = static_cast<int64_t>(l.size());
    const float neg_inf = -INFINITY;
    if (p.temperature >= 1e-6f && p.temperature != 1.0f)
      for (float& x : l) x *= 1.0f / p.temperature;
    double mx = -INFINITY;
    for (float x : l) mx = std::max(mx, static_cast<double>(x));
    double z = 0;
    for (float x : l) z += std::exp(static_cast<double>(x) - mx);
    const double log_z = mx + std::log(z);
    const std::vector<float> scaled = l;
    auto lp = [&](int32_t t) { return static_cast<float>(static_cast<double>(scaled[t]) - log_z); };
    if (p.temperature < 1e-6f) {
      int32_t best = 0;
      for (int64_t t = 1; t < V; ++t)
        if (l[t] > l[best]) best = static_cast<int32_t>(t);
      return {best, lp(best)};
    }
    if (p.top_k > 0 && p.top_k < V) {
      std::vector<float> tmp = l;
      std::nth_element(tmp.begin(), tmp.begin() + (p.top_k - 1), tmp.end(), std::greater<>());
      for (float& x : l)
        if (x < tmp[p.top_k - 1]) x = neg_inf;
    }
    std::vector<double> pr;
    auto softmax = [&] {
      double m = -INFINITY;
      for (float x : l) m = std::max(m, static_cast<double>(x));
      pr.assign(V, 0.0);
      double s = 0;
      for (int64_t t = 0; t < V; ++t)
        if (l[t] != neg_inf) s += (pr[t] = std::exp(static_cast<double>(l[t]) - m));
      for (double& x : pr) x /= s;
    };
    if (p.top_p < 1.0f) {
      softmax();
      std::vector<int32_t> order(V);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return pr[a] > pr[b] || (pr[a] == pr[b] && a < b); });
      double cum = 0;
      for (int64_t i = 0; i < V; ++i) {
        if (cum >= p.top_p && i > 0) l[order[i]] = neg_inf;
        cum += pr[order[i]];
      }
    }
    if (p.min_p > 0.0f) {
      softmax();
      const double pmax = *std::max_element(pr.begin(), pr.end());
      for (int64_t t = 0; t < V; ++t)
        if (pr[t] < p.min_p * pmax) l[t] = neg_inf;
    }
    softmax();
    const double u = rng.uniform();
    double cum = 0;
    int32_t chosen = -1, last = -1;
    for (int64_t t = 0; t < V; ++t) {
      if (pr[t] <= 0) continue;
      last = static_cast<int32_t>(t);
      cum += pr[t];
      if (u < cum) {
        chosen = static_cast<int32_t>(t);
        break;
      }
    }
    if (chosen < 0) chosen = last;
    return {chosen, lp(chosen)};
  }
};

TEST(Sampler, SameDrawsAsTheFullVocabularyDefinition) {
  std::mt19937 gen(11);
  int cases = 0;
  for (int64_t V : {2, 7, 300, 5000, 70000}) {
    for (int trial = 0; trial < 24; ++trial) {
      SamplingParams p;
      p.temperature = std::vector<float>{0.0f, 0.3f, 0.7f, 1.0f, 1.6f}[gen() % 5];
      p.top_k = std::vector<int>{0, 0, 1, 5, 20, 1000}[gen() % 6];
      p.top_p = std::vector<float>{1.0f, 0.95f, 0.8f, 0.3f, 0.999f}[gen() % 5];
      p.min_p = std::vector<float>{0.0f, 0.0f, 0.05f, 0.3f}[gen() % 4];
      const float spread = std::vector<float>{0.5f, 3.0f, 12.0f}[gen() % 3];
      std::normal_distribution<float> nd(0.0f, spread);
      std::vector<float> base(static_cast<size_t>(V));
      for (float& x : base) x = nd(gen);
      // ties and masked tokens
      for (int i = 0; i < std::min<int64_t>(V / 3, 40); ++i) base[gen() % V] = base[gen() % V];
      if (V > 10) base[gen() % V] = -INFINITY;
      const uint64_t seed = gen();
      SequenceSampler s(p, seed);
      ReferenceSampler ref(p, seed);
      for (int draw = 0; draw < 4; ++draw) {
        std::vector<float> l = base;
        const SampleResult r = s.sample(l, {}, 0, 0);
        const auto [want_token, want_lp] = ref.sample(base);
        ASSERT_EQ(r.token, want_token) << "V " << V << " T " << p.temperature << " k " << p.top_k << " p " << p.top_p
                                       << " min_p " << p.min_p << " draw " << draw;
        ASSERT_EQ(r.logprob, want_lp);
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 5 * 24 * 4);
}

TEST(Sampler, LogprobSkippedOnRequestSameToken) {
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.9f;
  std::vector<float> base(1000);
  for (int i = 0; i < 1000; ++i) base[i] = std::sin(i * 0.37f) * 4.0f;
  SequenceSampler a(p, 99), b(p, 99);
  for (int i = 0; i < 20; ++i) {
    std::vector<float> la = base, lb = base;
    const SampleResult ra = a.sample(la, {}, 0, 0, true);
    const SampleResult rb = b.sample(lb, {}, 0, 0, false);
    EXPECT_EQ(ra.token, rb.token);
    EXPECT_LT(ra.logprob, 0.0f);
    EXPECT_EQ(rb.logprob, 0.0f);
  }
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
