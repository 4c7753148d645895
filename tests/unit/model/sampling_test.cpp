// model::sample_row_host (the definition Ops::sample_rows follows on every backend) against hand-computed cases, and
// against SequenceSampler: with the uniform taken by SequenceSampler::next_row_sampling(), the host function picks
// the token SequenceSampler::sample would have picked, draw after draw of one seeded stream.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "engine/sampler.h"
#include "model/sampling.h"

namespace kiln::engine {
namespace {

using model::RowSampling;
using model::sample_row_host;

constexpr float kInf = std::numeric_limits<float>::infinity();

RowSampling row(float temperature, int top_k, float top_p, float min_p, double u) {
  return {temperature, top_k, top_p, min_p, u};
}

TEST(SampleRowHost, GreedyAndRowsWithoutAFiniteLogit) {
  const std::vector<float> l = {1, 3, 3, -kInf, 2};
  EXPECT_EQ(sample_row_host(l.data(), 5, row(0.0f, 0, 1, 0, 0.9)), 1);  // lowest id of the tie
  const std::vector<float> all_neg_inf = {-kInf, -kInf};
  EXPECT_EQ(sample_row_host(all_neg_inf.data(), 2, row(0.0f, 0, 1, 0, 0)), -1);
  EXPECT_EQ(sample_row_host(all_neg_inf.data(), 2, row(1.0f, 0, 1, 0, 0.5)), -1);
  const std::vector<float> pos_inf = {0, kInf};
  EXPECT_EQ(sample_row_host(pos_inf.data(), 2, row(0.7f, 0, 1, 0, 0.5)), -1);
  // 1e38 / 1e-5 overflows to +inf: no finite logit after scaling.
  const std::vector<float> big = {0, 1e38f};
  EXPECT_EQ(sample_row_host(big.data(), 2, row(1e-5f, 0, 1, 0, 0.5)), -1);
  EXPECT_EQ(sample_row_host(big.data(), 2, row(0.0f, 0, 1, 0, 0.5)), 1);
}

TEST(SampleRowHost, DrawWalksAscendingIds) {
  // p = 1/4 each: u in [0, .25) -> 0, [.25, .5) -> 1, ...
  const std::vector<float> l = {0, 0, 0, 0};
  EXPECT_EQ(sample_row_host(l.data(), 4, row(1, 0, 1, 0, 0.0)), 0);
  EXPECT_EQ(sample_row_host(l.data(), 4, row(1, 0, 1, 0, 0.2499)), 0);
  EXPECT_EQ(sample_row_host(l.data(), 4, row(1, 0, 1, 0, 0.25)), 1);
  EXPECT_EQ(sample_row_host(l.data(), 4, row(1, 0, 1, 0, 0.99)), 3);
  // -inf tokens are never candidates.
  const std::vector<float> m = {-kInf, 0, -kInf, 0};
  EXPECT_EQ(sample_row_host(m.data(), 4, row(1, 0, 1, 0, 0.1)), 1);
  EXPECT_EQ(sample_row_host(m.data(), 4, row(1, 0, 1, 0, 0.9)), 3);
}

TEST(SampleRowHost, TopKKeepsTiesWithTheKth) {
  const std::vector<float> l = {5, 1, 5, 5, 0};
  // top_k 1: the k-th largest is 5; all three 5s stay (1/3 each).
  EXPECT_EQ(sample_row_host(l.data(), 5, row(1, 1, 1, 0, 0.1)), 0);
  EXPECT_EQ(sample_row_host(l.data(), 5, row(1, 1, 1, 0, 0.5)), 2);
  EXPECT_EQ(sample_row_host(l.data(), 5, row(1, 1, 1, 0, 0.9)), 3);
}

TEST(SampleRowHost, TopPKeepsTheCrossingTokenAndLowerIdsOfATie) {
  // p = 1/4 each; top_p 0.5: sorted by p (ties by ascending id), the prefix reaching 0.5 is ids 0 and 1.
  const std::vector<float> l = {0, 0, 0, 0};
  EXPECT_EQ(sample_row_host(l.data(), 4, row(1, 0, 0.5f, 0, 0.49)), 0);
  EXPECT_EQ(sample_row_host(l.data(), 4, row(1, 0, 0.5f, 0, 0.51)), 1);
  EXPECT_EQ(sample_row_host(l.data(), 4, row(1, 0, 0.5f, 0, 0.99)), 1);
  // top_p 0.6: the crossing (third) token is kept: ids 0, 1, 2.
  EXPECT_EQ(sample_row_host(l.data(), 4, row(1, 0, 0.6f, 0, 0.99)), 2);
  // Ties at the cut after a larger token: p ~ {0.1, 0.3, 0.3, 0.3}; top_p 0.5 keeps id 1 and the crossing id 2.
  const float a = std::log(1.0f), b = std::log(3.0f);
  const std::vector<float> t = {a, b, b, b};
  EXPECT_EQ(sample_row_host(t.data(), 4, row(1, 0, 0.5f, 0, 0.4)), 1);
  EXPECT_EQ(sample_row_host(t.data(), 4, row(1, 0, 0.5f, 0, 0.6)), 2);
  EXPECT_EQ(sample_row_host(t.data(), 4, row(1, 0, 0.5f, 0, 0.999)), 2);
  // A tiny top_p keeps the largest token only.
  const std::vector<float> s = {0, 2, 1};
  EXPECT_EQ(sample_row_host(s.data(), 3, row(1, 0, 0.01f, 0, 0.999)), 1);
}

TEST(SampleRowHost, MinPDropsTokensBelowAFractionOfTheLargest) {
  // p proportional to {1, 0.5, 0.04}: min_p 0.05 drops the last (0.04 < 0.05 x 1).
  const std::vector<float> l = {0, std::log(0.5f), std::log(0.04f)};
  EXPECT_EQ(sample_row_host(l.data(), 3, row(1, 0, 1, 0.05f, 0.999)), 1);
  EXPECT_EQ(sample_row_host(l.data(), 3, row(1, 0, 1, 0.0f, 0.999)), 2);
}

// Random rows of several kinds (continuous values, heavy ties, -inf entries, one dominant token).
std::vector<float> random_row(std::mt19937_64& rng, int64_t V, int kind) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::uniform_int_distribution<int> level(0, 7);
  std::vector<float> l(static_cast<size_t>(V));
  for (auto& x : l) {
    switch (kind) {
      case 0: x = normal(rng); break;
      case 1: x = static_cast<float>(level(rng)) * 0.5f; break;  // 8 distinct values
      case 2: x = rng() % 4 == 0 ? -kInf : normal(rng); break;
      default: x = normal(rng) * 0.2f; break;
    }
  }
  if (kind == 2) l[static_cast<size_t>(rng() % static_cast<uint64_t>(V))] = 1.0f;  // at least one finite value
  if (kind == 3) l[static_cast<size_t>(rng() % static_cast<uint64_t>(V))] = 12.0f;
  return l;
}

// SequenceSampler::sample and sample_row_host with next_row_sampling's uniform: the same tokens, the streams in step.
TEST(SampleRowHost, MatchesSequenceSampler) {
  std::mt19937_64 rng(2024);
  const std::vector<int64_t> vocabs = {1, 7, 1000, 50000};
  const std::vector<float> temps = {0.0f, 0.3f, 0.7f, 1.0f, 1.3f, 2.0f};
  const std::vector<float> top_ps = {1.0f, 0.9f, 0.5f, 0.01f};
  const std::vector<float> min_ps = {0.0f, 0.05f};
  int rows = 0, sampled = 0;
  for (int it = 0; it < 2000; ++it) {
    const int64_t V = vocabs[static_cast<size_t>(it % 4 == 3 && it % 16 != 3 ? 2 : it % 4)];  // fewer 50k rows
    SamplingParams p;
    p.temperature = temps[rng() % temps.size()];
    const int64_t ks[] = {0, 1, 5, 50, V};
    p.top_k = static_cast<int>(ks[rng() % 5]);
    p.top_p = top_ps[rng() % top_ps.size()];
    p.min_p = min_ps[rng() % min_ps.size()];
    const std::vector<float> logits = random_row(rng, V, static_cast<int>(rng() % 4));
    const uint64_t seed = rng();
    SequenceSampler host(p, seed), device(p, seed);
    for (int draw = 0; draw < 3; ++draw) {
      std::vector<float> l = logits;
      const bool logprobs = draw == 1;  // the token does not depend on what is reported
      const int32_t want = host.sample(l, {}, 0, logprobs ? 2 : 0, logprobs).token;
      const model::RowSampling rs = device.next_row_sampling();
      EXPECT_EQ(rs.temperature, p.temperature);
      const int32_t got = sample_row_host(logits.data(), V, rs);
      ASSERT_EQ(got, want) << "row " << it << " draw " << draw << " V " << V << " T " << p.temperature << " top_k "
                           << p.top_k << " top_p " << p.top_p << " min_p " << p.min_p << " u " << rs.u;
      ++rows;
      sampled += p.temperature >= 1e-6f;
    }
  }
  EXPECT_EQ(rows, 6000);
  EXPECT_GT(sampled, 4000);
}

}  // namespace
}  // namespace kiln::engine
