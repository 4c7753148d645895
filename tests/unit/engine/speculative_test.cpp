// Speculative decoding's acceptance rules (src/engine/speculative.*).
//  - Greedy: the emitted tokens are the target's greedy tokens (accepted prefix, then its own token).
//  - Rejection sampling keeps the target's distribution: a toy target (a Markov chain P over 5 tokens) and a different
//    drafter Q; 120000 sequences of 4 tokens generated with K = 2 drafts per verify (drafts sampled from Q, and a
//    greedy drafter) against the exact per-position marginals of P. Chi-square per position, 4 degrees of freedom,
//    significance 0.001 (critical value 18.467); fixed seeds. The same harness on a wrong rule (always accept the
//    drafts) must fail it: the test can tell.
#include <gtest/gtest.h>

#include <array>
#include <random>

#include "engine/speculative.h"

namespace kiln::engine {
namespace {

TEST(AcceptGreedy, AcceptsTheMatchingPrefixThenTheTargetsToken) {
  const std::vector<int32_t> d = {4, 7, 9};
  EXPECT_EQ(accept_greedy(d, std::vector<int32_t>{4, 7, 9, 2}), (std::vector<int32_t>{4, 7, 9, 2}));  // all + bonus
  EXPECT_EQ(accept_greedy(d, std::vector<int32_t>{4, 8, 9, 2}), (std::vector<int32_t>{4, 8}));         // stop at 2nd
  EXPECT_EQ(accept_greedy(d, std::vector<int32_t>{5, 7, 9, 2}), (std::vector<int32_t>{5}));            // none
  EXPECT_EQ(accept_greedy(std::vector<int32_t>{}, std::vector<int32_t>{3}), (std::vector<int32_t>{3}));
}

TEST(DrawIndex, FollowsTheWeights) {
  const std::vector<double> w = {0.0, 1.0, 0.0, 3.0};
  EXPECT_EQ(draw_index(w, 0.0), 1);
  EXPECT_EQ(draw_index(w, 0.2499), 1);
  EXPECT_EQ(draw_index(w, 0.25), 3);
  EXPECT_EQ(draw_index(w, 0.9999999), 3);
  EXPECT_EQ(draw_index(std::vector<double>{0.0, 0.0}, 0.5), -1);
}

constexpr int V = 5;
using Row = std::array<double, V>;
// Target and drafter: every row a distribution; Q is close to P on some rows, far on others (zeros where P is not).
const std::array<Row, V> P = {{{0.10, 0.40, 0.20, 0.20, 0.10},
                               {0.30, 0.05, 0.05, 0.50, 0.10},
                               {0.25, 0.25, 0.25, 0.15, 0.10},
                               {0.05, 0.05, 0.60, 0.10, 0.20},
                               {0.40, 0.10, 0.10, 0.10, 0.30}}};
const std::array<Row, V> Q = {{{0.10, 0.10, 0.60, 0.10, 0.10},
                               {0.30, 0.00, 0.00, 0.70, 0.00},
                               {0.20, 0.30, 0.20, 0.20, 0.10},
                               {0.50, 0.20, 0.10, 0.10, 0.10},
                               {0.00, 0.00, 0.00, 0.00, 1.00}}};
constexpr int kPositions = 4, kK = 2, kSamples = 120000;
constexpr double kChi2Critical = 18.467;  // chi-square, 4 degrees of freedom, p = 0.001

enum class Drafter { sampled, greedy };
enum class Rule { rejection_sampling, always_accept };

int sample(const Row& r, double u) {
  const std::vector<double> w(r.begin(), r.end());
  return draw_index(w, u);
}
int argmax(const Row& r) { return static_cast<int>(std::max_element(r.begin(), r.end()) - r.begin()); }

// counts[pos][token] over kSamples sequences of kPositions tokens after the start token 0.
std::array<std::array<int64_t, V>, kPositions> generate(Drafter drafter, Rule rule, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> U(0.0, 1.0);
  auto uniform = [&] { return U(rng); };
  std::array<std::array<int64_t, V>, kPositions> counts{};
  for (int n = 0; n < kSamples; ++n) {
    std::vector<int32_t> seq = {0};
    while (static_cast<int>(seq.size()) < kPositions + 1) {
      std::vector<int32_t> drafts;
      std::vector<float> q, p;
      int32_t prev = seq.back();
      for (int k = 0; k < kK; ++k) {
        const int32_t d = drafter == Drafter::greedy ? argmax(Q[prev]) : sample(Q[prev], uniform());
        for (int i = 0; i < V; ++i) q.push_back(static_cast<float>(Q[prev][i]));
        drafts.push_back(d);
        prev = d;
      }
      // The target's rows at the verify positions: after the pending token, then after each draft.
      for (int i = 0; i < V; ++i) p.push_back(static_cast<float>(P[seq.back()][i]));
      for (int k = 0; k < kK; ++k)
        for (int i = 0; i < V; ++i) p.push_back(static_cast<float>(P[drafts[k]][i]));
      std::vector<int32_t> out;
      if (rule == Rule::always_accept) {
        out = drafts;
        out.push_back(sample(P[drafts.back()], uniform()));
      } else {
        out = accept_sampled(drafts, p, drafter == Drafter::greedy ? std::span<const float>() : std::span<const float>(q),
                             V, uniform).tokens;
      }
      for (int32_t t : out) seq.push_back(t);  // tokens past the last position are dropped (max_tokens)
    }
    for (int pos = 0; pos < kPositions; ++pos) ++counts[pos][seq[pos + 1]];
  }
  return counts;
}

// The exact marginal of each position: m_1 = P[0], m_{k+1} = m_k P.
std::array<Row, kPositions> exact_marginals() {
  std::array<Row, kPositions> m{};
  m[0] = P[0];
  for (int k = 1; k < kPositions; ++k)
    for (int i = 0; i < V; ++i)
      for (int j = 0; j < V; ++j) m[k][j] += m[k - 1][i] * P[i][j];
  return m;
}

double worst_chi2(const std::array<std::array<int64_t, V>, kPositions>& counts) {
  const auto m = exact_marginals();
  double worst = 0;
  for (int pos = 0; pos < kPositions; ++pos) {
    double chi2 = 0;
    for (int t = 0; t < V; ++t) {
      const double e = m[pos][t] * kSamples;
      chi2 += (counts[pos][t] - e) * (counts[pos][t] - e) / e;
    }
    worst = std::max(worst, chi2);
  }
  return worst;
}

TEST(AcceptSampled, KeepsTheTargetDistributionWithASampledDrafter) {
  const double chi2 = worst_chi2(generate(Drafter::sampled, Rule::rejection_sampling, 1));
  std::printf("[speculative] sampled drafter: worst chi2 over %d positions %.2f (critical %.3f)\n", kPositions, chi2,
              kChi2Critical);
  EXPECT_LT(chi2, kChi2Critical);
}

TEST(AcceptSampled, KeepsTheTargetDistributionWithAGreedyDrafter) {
  const double chi2 = worst_chi2(generate(Drafter::greedy, Rule::rejection_sampling, 2));
  std::printf("[speculative] greedy drafter: worst chi2 %.2f (critical %.3f)\n", chi2, kChi2Critical);
  EXPECT_LT(chi2, kChi2Critical);
}

TEST(AcceptSampled, PlainSamplingPassesAndAWrongRuleFailsTheSameTest) {
  // Plain sampling from P (K = 0: every step is the "bonus" draw) passes; always accepting the drafts does not.
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> U(0.0, 1.0);
  std::array<std::array<int64_t, V>, kPositions> plain{};
  for (int n = 0; n < kSamples; ++n) {
    int32_t prev = 0;
    for (int pos = 0; pos < kPositions; ++pos) {
      std::vector<float> p(P[prev].begin(), P[prev].end());
      const std::vector<int32_t> none;
      prev = accept_sampled(none, p, {}, V, [&] { return U(rng); }).tokens[0];
      ++plain[pos][prev];
    }
  }
  EXPECT_LT(worst_chi2(plain), kChi2Critical);
  const double wrong = worst_chi2(generate(Drafter::sampled, Rule::always_accept, 4));
  std::printf("[speculative] always-accept rule: worst chi2 %.1f (must exceed %.3f)\n", wrong, kChi2Critical);
  EXPECT_GT(wrong, kChi2Critical);
}

TEST(AcceptSampled, AcceptsEveryDraftWhenTheDrafterIsTheTarget) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> U(0.0, 1.0);
  const std::vector<float> p = {0.2f, 0.8f, 0.5f, 0.5f, 1.0f, 0.0f};  // 3 rows of 2
  const std::vector<float> q = {0.2f, 0.8f, 0.5f, 0.5f};
  const std::vector<int32_t> d = {1, 0};
  for (int i = 0; i < 100; ++i) {
    const SampledAccept r = accept_sampled(d, p, q, 2, [&] { return U(rng); });
    ASSERT_EQ(r.accepted, 2);
    EXPECT_EQ(r.tokens, (std::vector<int32_t>{1, 0, 0}));  // bonus from the last row: token 0 has all the mass
  }
}

}  // namespace
}  // namespace kiln::engine
