// Speculative decoding's acceptance rules (src/engine/speculative.*).
//  - Greedy: the emitted tokens are the target's greedy tokens (accepted prefix, then its own token).
//  - Rejection sampling keeps the target's distribution: a toy target (a Markov chain P over 5 tokens) and a different
//    drafter Q; 120000 sequences of 4 tokens generated with K = 2 drafts per verify (drafts sampled from Q, and a
//    greedy drafter) against the exact per-position marginals of P. Chi-square per position, 4 degrees of freedom,
//    significance 0.001 (critical value 18.467); fixed seeds. The same harness on a wrong rule (always accept the
//    drafts) must fail it: the test can tell.
//  - DraftLengthChooser on synthetic step costs: the accept length from per-position acceptance, the most drafts
//    while passes are memory-bound, none once they are compute-bound, a choice that never grows with the batch, and
//    exploration of the other lengths.
#include <gtest/gtest.h>

#include <array>
#include <functional>
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


// ---- DraftLengthChooser ----

// Feeds the chooser every power-of-two bucket of a cost function (ms per pass of n tokens), a draft cost per chain
// step of b sequences, and `verifies` verifies at acceptance alpha per position (deterministic: the accepted count
// of each follows alpha exactly in proportion). Each bucket is observed three times: a bucket's first observation is
// a warm-up the chooser drops, and it counts from two more.
void feed(DraftLengthChooser& c, const std::function<double(double)>& pass_ms,
          const std::function<double(double)>& draft_ms, double alpha, int max_k) {
  for (int64_t i = 0; i < 3 * 13; ++i) {
    const int64_t n = int64_t(1) << (i % 13);  // 1 .. 4096, three times
    c.observe_decode(static_cast<int>(n), pass_ms(static_cast<double>(n)) / 1e3);
    c.observe_multi(n, pass_ms(static_cast<double>(n)) / 1e3);
    c.observe_draft(static_cast<int>(n), 2, 2 * draft_ms(static_cast<double>(n)) / 1e3);
  }
  // 1000 verifies of max_k drafts whose accepted counts follow P(accepted >= j) = alpha^j.
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < 1000; ++i) {
    int a = 0;
    while (a < max_k && u(rng) < alpha) ++a;
    c.observe_accepts(max_k, a);
  }
}

TEST(DraftLengthChooser, AcceptLengthFromPerPositionAcceptance) {
  DraftLengthChooser c(4, 0);
  feed(c, [](double) { return 1.0; }, [](double) { return 0.0; }, 0.7, 4);
  for (int j = 1; j <= 4; ++j) EXPECT_NEAR(c.acceptance(j), 0.7, 0.06) << j;
  // L(K) = 1 + a + a^2 + ... + a^K with the measured a_j.
  double expect = 1, all = 1;
  for (int k = 1; k <= 4; ++k) {
    all *= c.acceptance(k);
    expect += all;
    EXPECT_NEAR(c.expected_accept_length(k), expect, 1e-12);
  }
  EXPECT_NEAR(c.expected_accept_length(3), 1 + 0.7 + 0.49 + 0.343, 0.15);
  EXPECT_EQ(c.expected_accept_length(0), 1.0);
}

// A batch bucket with nothing timed: a plain step first, then (plain steps timed, no draft chain) a full-length draft;
// only then does the cost model choose. Launch-bound passes (every pass 1 ms whatever its size, a draft step 1 ms)
// with poor acceptance then stay plain.
TEST(DraftLengthChooser, MeasuresAPlainStepAndAFullDraftBeforeChoosing) {
  DraftLengthChooser c(3, 0);
  EXPECT_EQ(c.choose(1), 0);
  c.observe_decode(1, 9e-3);  // the first plain step: a warm-up (lazy setup), dropped
  EXPECT_EQ(c.choose(1), 0);  // still no plain step timed
  c.observe_decode(1, 5e-3);  // one slow step (a CUDA graph captured) does not stand for the bucket alone
  EXPECT_EQ(c.choose(1), 0);
  c.observe_decode(1, 1e-3);
  EXPECT_EQ(c.choose(1), 3);
  EXPECT_NEAR(c.expected_step_seconds(1, 0), 1e-3, 1e-12);  // the smaller of the two
  EXPECT_EQ(c.choose(64), 0);  // another bucket: its own measurements
  for (int i = 0; i < 3; ++i) {
    c.observe_multi(4, 1e-3);
    c.observe_draft(1, 3, 3e-3);
  }
  for (int i = 0; i < 50; ++i) c.observe_accepts(3, i % 5 == 0 ? 1 : 0);  // alpha_1 = 0.2
  EXPECT_EQ(c.choose(1), 0);
  DraftLengthChooser off(0);
  EXPECT_EQ(off.choose(1), 0);
}

TEST(DraftLengthChooser, MemoryBoundDraftsComputeBoundDoesNot) {
  // Memory-bound: a pass costs 10 ms whatever its size; drafting 0.4 ms a step.
  DraftLengthChooser flat(4, 0);
  feed(flat, [](double) { return 10.0; }, [](double) { return 0.4; }, 0.75, 4);
  EXPECT_EQ(flat.choose(1), 4);
  EXPECT_EQ(flat.choose(8), 4);
  // Compute-bound: a pass costs 0.1 ms per token; K drafts multiply the work by K + 1 for L(K) < K + 1 tokens.
  DraftLengthChooser linear(4, 0);
  feed(linear, [](double n) { return 0.1 * n; }, [](double b) { return 0.02 * b; }, 0.75, 4);
  for (int b : {1, 8, 64, 256}) EXPECT_EQ(linear.choose(b), 0) << b;
}

// A step that also runs prompt tokens: without drafts the decode rows ride the prompts' pass, with drafts the verify
// takes a pass of its own. Launch-bound passes (1 ms up to 64 tokens) and middling acceptance: a plain step drafts,
// a step with a short prompt does not (the extra pass costs more than the drafts return), one with a long prompt
// (a ~200 ms pass) does again.
TEST(DraftLengthChooser, StepsWithPromptsDraftOnlyWhereTheExtraPassPays) {
  DraftLengthChooser c(3, 0);
  feed(c, [](double n) { return n <= 64 ? 1.0 : 1.0 + 0.05 * (n - 64); }, [](double) { return 0.1; }, 0.6, 3);
  EXPECT_GT(c.choose(1), 0);
  EXPECT_EQ(c.choose(1, 20), 0);
  EXPECT_EQ(c.choose(4, 20), 0);
  EXPECT_GT(c.choose(1, 4096), 0);
  // The cost model behind it: the prompts' pass alone at K = 0, that pass plus the verify and the chain above it.
  EXPECT_NEAR(c.expected_step_seconds(1, 0, 20), 1e-3, 1e-9);
  EXPECT_GT(c.expected_step_seconds(1, 1, 20), 2e-3);
}

TEST(DraftLengthChooser, DraftsFewerAsTheBatchGrows) {
  // A fixed cost plus a per-token one (weights read once per pass, compute per token): speculation pays at small
  // batches, not at large ones, and the choice never grows with the batch.
  DraftLengthChooser c(4, 0);
  auto pass = [](double n) { return 8.0 + 0.05 * n; };
  feed(c, pass, [](double b) { return 0.3 + 0.005 * b; }, 0.8, 4);
  EXPECT_GE(c.choose(1), 3);
  EXPECT_EQ(c.choose(1024), 0);
  int last = 4;
  for (int b = 1; b <= 1024; b *= 2) {
    const int k = c.choose(b);
    EXPECT_LE(k, last) << "batch " << b;
    last = k;
    // The choice is the best of the model's own estimates.
    for (int other = 0; other <= 4; ++other)
      EXPECT_GE(c.expected_tokens_per_second(b, k), c.expected_tokens_per_second(b, other) * (1 - 1e-9));
  }
  // At batch 1 the estimate matches the costs fed: K = 0 is one pass of one token.
  EXPECT_NEAR(c.expected_step_seconds(1, 0), pass(1) / 1e3, 1e-6);
}

// Serving-like noise: launch-bound passes (0.6 ms + 4 us a token; plain steps 0.5 ms; a draft step 0.1 ms), batches of
// 5..8, half the steps with a short prompt (not timed), acceptance 0.95, every timing jittered by ~10% and one in
// five three times too slow (a CUDA graph captured for a new shape, host stalls). K = 3 is best throughout; a moving
// average once let a slow step or two make it look worse and kept it unmeasured (kiln-tiny at concurrency 8 drafted
// ~2.2 tokens a step against the fixed K = 3's 3.0, and served 17% fewer tokens).
TEST(DraftLengthChooser, SlowStepsDoNotMoveTheChoice) {
  DraftLengthChooser c(3);
  c.set_replays(false);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0, 1);
  std::lognormal_distribution<double> noise(0, 0.1);
  auto jitter = [&](double s) { return s * noise(rng) * (u(rng) < 0.2 ? 3.0 : 1.0); };
  int plain = 0, best = 0;
  for (int step = 0; step < 3000; ++step) {
    const int b = 5 + static_cast<int>(u(rng) * 4);
    const bool prompt = u(rng) < 0.5;
    const int k = c.choose(b, prompt ? 20 : 0);
    if (step >= 300 && !prompt) {
      ++plain;
      best += k == 3;
    }
    if (prompt) {
      EXPECT_EQ(k, 3) << step;  // a short prompt's pass (~0.7 ms) is long against the drafts' ~1 ms for 3.8 tokens
      continue;
    }
    if (k == 0) {
      c.observe_decode(b, jitter(0.5e-3 + 5e-6 * b));
      continue;
    }
    c.observe_multi(int64_t(b) * (k + 1), jitter(0.6e-3 + 4e-6 * b * (k + 1)));
    c.observe_draft(b, k, jitter(k * (0.1e-3 + 1e-6 * b)));
    for (int i = 0; i < b; ++i) {
      int a = 0;
      while (a < k && u(rng) < 0.95) ++a;
      c.observe_accepts(k, a);
    }
  }
  // Every other plain step's choice is an exploration (1 in 64 per batch bucket, a few more while a bucket is young).
  EXPECT_GE(best, plain * 95 / 100) << best << " of " << plain;
}

// A cost that genuinely changes (longer contexts, another tenant on the GPU) is followed within a window.
TEST(DraftLengthChooser, EstimatesFollowALastingChange) {
  DraftLengthChooser c(3, 0);
  for (int i = 0; i < 20; ++i) c.observe_decode(4, 1e-3);
  EXPECT_NEAR(c.expected_step_seconds(4, 0), 1e-3, 1e-12);
  for (int i = 0; i < DraftLengthChooser::kWindow; ++i) c.observe_decode(4, 2e-3);
  EXPECT_NEAR(c.expected_step_seconds(4, 0), 2e-3, 1e-12);
  for (int i = 0; i < 3; ++i) c.observe_decode(4, 1.5e-3);  // faster again: the lower quartile moves at once
  EXPECT_NEAR(c.expected_step_seconds(4, 0), 1.5e-3, 1e-12);
}

// A verify pass longer than any measured (a batch bigger than before) is guessed at the largest measured pass's cost
// in a plain step, so that the length is tried and measured; a step with prompts (never timed) guesses it in
// proportion to its tokens.
TEST(DraftLengthChooser, TriesAVerifyPassLongerThanAnyMeasured) {
  DraftLengthChooser c(3, 0);
  c.set_replays(false);
  for (int i = 0; i < 3; ++i) {
    c.observe_decode(4, 0.5e-3);
    c.observe_decode(8, 0.5e-3);
    c.observe_draft(4, 3, 0.3e-3);
    c.observe_draft(8, 3, 0.3e-3);
    c.observe_multi(16, 0.7e-3);  // batch 4, K = 3: measured; batch 8's 32-token verify never was
  }
  for (int i = 0; i < 100; ++i) c.observe_accepts(3, 3);
  EXPECT_NEAR(c.expected_step_seconds(8, 3), 0.7e-3 + 0.3e-3, 1e-9);
  EXPECT_EQ(c.choose(8), 3);
  EXPECT_NEAR(c.expected_step_seconds(8, 3, 64) - c.expected_step_seconds(8, 0, 64), 0.7e-3 * 32 / 16 + 0.3e-3, 1e-9);
}

// With the first draft carried from the step before, K drafts cost K - 1 chain steps: the same measured costs price
// every K one chain step lower, and where a chain step is dear against the verify pass that tips the choice (here
// K = 1, with no chain at all, against none). A K = 1 engine that carries never times a chain, and needs none timed.
TEST(DraftLengthChooser, ACarriedFirstDraftCostsNoChainStep) {
  for (const bool carried : {false, true}) {
    DraftLengthChooser c(3, 0);
    c.set_replays(false);
    c.set_carried_first(carried);
    for (int i = 0; i < 3; ++i) {
      c.observe_decode(1, 1.0e-3);
      c.observe_draft(1, 1, 1.0e-3);  // a chain step as dear as a plain step
      for (int n = 2; n <= 4; ++n) c.observe_multi(n, 1.0e-3);
    }
    for (int i = 0; i < 100; ++i) c.observe_accepts(3, 1);  // alpha_1 high, later drafts rejected
    for (int k = 1; k <= 3; ++k)
      EXPECT_NEAR(c.expected_step_seconds(1, k), 1.0e-3 + (carried ? k - 1 : k) * 1.0e-3, 1e-9) << "K " << k;
    EXPECT_EQ(c.choose(1), carried ? 1 : 0) << "carried " << carried;
  }
  // K <= 1 with carrying: no chain is ever timed, so the choice goes by the passes alone (without carrying it drafts
  // until a chain is timed).
  for (const double verify : {1.2e-3, 3.0e-3}) {
    DraftLengthChooser one(1, 0);
    one.set_replays(false);
    one.set_carried_first(true);
    for (int i = 0; i < 3; ++i) {
      one.observe_decode(1, 1.0e-3);
      one.observe_multi(2, verify);
    }
    for (int i = 0; i < 100; ++i) one.observe_accepts(1, 1);
    EXPECT_EQ(one.choose(1), verify < 2e-3 ? 1 : 0) << "verify " << verify;
  }
}

TEST(DraftLengthChooser, ExploresTheOtherLengthsInTurn) {
  DraftLengthChooser c(3, 4);
  feed(c, [](double) { return 10.0; }, [](double) { return 0.1; }, 0.9, 3);
  std::vector<int> picks;
  for (int i = 0; i < 16; ++i) picks.push_back(c.choose(1));
  // Best is 3; every 4th choice is 0, 1, 2 in turn.
  std::vector<int> explored;
  for (int i = 0; i < 16; ++i)
    if ((i + 1) % 4 == 0) explored.push_back(picks[i]);
    else EXPECT_EQ(picks[i], 3) << i;
  EXPECT_EQ(explored, (std::vector<int>{1, 2, 0, 1}));
  // The default period (64): a young bucket also explores at its 4th, 8th, 16th and 32nd choice, K = 0 first.
  DraftLengthChooser young(3);
  feed(young, [](double) { return 10.0; }, [](double) { return 0.1; }, 0.9, 3);
  std::vector<int> early;
  for (int i = 1; i <= 64; ++i) {
    const int k = young.choose(1);
    if (i == 4 || i == 8 || i == 16 || i == 32 || i == 64) early.push_back(k);
    else EXPECT_EQ(k, 3) << i;
  }
  EXPECT_EQ(early, (std::vector<int>{0, 1, 2, 0, 1}));
}

}  // namespace
}  // namespace kiln::engine
