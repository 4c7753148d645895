// Benchmark maths against values computed by hand (and, for percentiles, numpy.percentile's
// documented linear method: rank = p/100 * (n-1)).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "clients/bench.h"
#include "clients/metrics.h"
#include "core/error.h"

namespace kiln::clients {
namespace {

TEST(Percentile, LinearInterpolationBetweenClosestRanks) {
  // numpy.percentile([1, 2, 3, 4], q): q=50 -> 2.5, q=90 -> 3.7, q=99 -> 3.97, q=0 -> 1, q=100 -> 4.
  std::vector<double> v = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(percentile(v, 50), 2.5);
  EXPECT_NEAR(percentile(v, 90), 3.7, 1e-12);
  EXPECT_NEAR(percentile(v, 99), 3.97, 1e-12);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 4);
  // Odd count: the median is the middle value. [10, 20, 30, 40, 50] p90: rank 3.6 -> 40 + 0.6 * 10 = 46.
  std::vector<double> w = {50, 10, 40, 30, 20};
  EXPECT_DOUBLE_EQ(percentile(w, 50), 30);
  EXPECT_NEAR(percentile(w, 90), 46, 1e-12);
  EXPECT_NEAR(percentile(w, 99), 49.6, 1e-12);
  EXPECT_DOUBLE_EQ(percentile({7}, 99), 7);
  EXPECT_TRUE(std::isnan(percentile({}, 50)));
}

TEST(Describe, MeanMedianTails) {
  Distribution d = describe({1, 2, 3, 4, 100});
  EXPECT_EQ(d.count, 5u);
  EXPECT_DOUBLE_EQ(d.mean, 22);
  EXPECT_DOUBLE_EQ(d.median, 3);
  EXPECT_NEAR(d.p90, 4 + 0.6 * 96, 1e-9);  // rank 3.6
  EXPECT_DOUBLE_EQ(d.min, 1);
  EXPECT_DOUBLE_EQ(d.max, 100);
  EXPECT_TRUE(std::isnan(describe({}).mean));
}

TEST(Tpot, ExcludesTheFirstToken) {
  // 0.5 s to the first token, 2.5 s in all, 5 tokens: 4 gaps over 2 s = 0.5 s per token.
  EXPECT_DOUBLE_EQ(*time_per_output_token_s(2.5, 0.5, 5), 0.5);
  EXPECT_FALSE(time_per_output_token_s(1.0, 1.0, 1).has_value());
  EXPECT_FALSE(time_per_output_token_s(1.0, 1.0, 0).has_value());
}

TEST(Itl, GapsBetweenChunks) {
  auto gaps = inter_token_latencies_s({0.1, 0.15, 0.35});
  ASSERT_EQ(gaps.size(), 2u);
  EXPECT_NEAR(gaps[0], 0.05, 1e-12);
  EXPECT_NEAR(gaps[1], 0.20, 1e-12);
  EXPECT_TRUE(inter_token_latencies_s({0.3}).empty());
}

TEST(BenchMetrics, HandComputedRun) {
  // Request A: TTFT 100 ms, chunks at 0.1, 0.2, 0.4 s, E2E 0.4 s, 3 tokens: TPOT (0.4-0.1)/2 = 150 ms.
  // Request B: TTFT 200 ms, chunks at 0.2, 0.3 s, E2E 0.3 s, 2 tokens: TPOT 100 ms.
  // Request C: failed. Duration 0.5 s.
  RequestRecord a{.ok = true, .ttft_s = 0.1, .e2e_s = 0.4, .token_times_s = {0.1, 0.2, 0.4}, .input_tokens = 10,
                  .output_tokens = 3, .output_tokens_from_usage = true};
  RequestRecord b{.ok = true, .ttft_s = 0.2, .e2e_s = 0.3, .token_times_s = {0.2, 0.3}, .input_tokens = 10,
                  .output_tokens = 2, .output_tokens_from_usage = false};
  RequestRecord c{.ok = false, .error = "HTTP 500: boom"};
  BenchMetrics m = compute_bench_metrics({a, b, c}, 0.5);
  EXPECT_EQ(m.completed, 2u);
  EXPECT_EQ(m.failed, 1u);
  EXPECT_EQ(m.failure_reasons.at("HTTP 500: boom"), 1u);
  EXPECT_EQ(m.total_input_tokens, 20);
  EXPECT_EQ(m.total_output_tokens, 5);
  EXPECT_DOUBLE_EQ(m.request_throughput, 4.0);  // 2 / 0.5
  EXPECT_DOUBLE_EQ(m.output_throughput, 10.0);  // 5 / 0.5
  EXPECT_DOUBLE_EQ(m.total_throughput, 50.0);   // 25 / 0.5
  EXPECT_NEAR(m.ttft_ms.mean, 150, 1e-9);
  EXPECT_NEAR(m.tpot_ms.mean, 125, 1e-9);    // (150 + 100) / 2
  EXPECT_NEAR(m.tpot_ms.median, 125, 1e-9);
  EXPECT_EQ(m.itl_ms.count, 3u);             // 100, 200 (A) and 100 ms (B), pooled
  EXPECT_NEAR(m.itl_ms.mean, 400.0 / 3, 1e-9);
  EXPECT_NEAR(m.itl_ms.median, 100, 1e-9);
  EXPECT_NEAR(m.e2e_ms.mean, 350, 1e-9);
  EXPECT_NEAR(m.per_user_tok_s_mean_tpot, 8.0, 1e-9);  // 1000 / 125 ms
  EXPECT_EQ(m.output_tokens_from_usage, 1u);
}

TEST(BenchMetrics, AllFailedGivesNoNumbers) {
  BenchMetrics m = compute_bench_metrics({RequestRecord{.error = "x"}, RequestRecord{.error = "x"}}, 1.0);
  EXPECT_EQ(m.completed, 0u);
  EXPECT_EQ(m.failure_reasons.at("x"), 2u);
  EXPECT_TRUE(std::isnan(m.ttft_ms.mean));
  EXPECT_EQ(m.output_throughput, 0);
}

TEST(BenchOptionsParsing, ConcurrencyListAndRate) {
  EXPECT_EQ(parse_concurrency_list("1,4, 16"), (std::vector<size_t>{1, 4, 16}));
  EXPECT_EQ(parse_concurrency_list("inf"), std::vector<size_t>{0});
  EXPECT_THROW(parse_concurrency_list("1,,4"), Error);
  EXPECT_THROW(parse_concurrency_list("0"), Error);
  EXPECT_THROW(parse_concurrency_list("4x"), Error);
  EXPECT_TRUE(std::isinf(parse_request_rate("inf")));
  EXPECT_DOUBLE_EQ(parse_request_rate("2.5"), 2.5);
  EXPECT_THROW(parse_request_rate("-1"), Error);
  EXPECT_THROW(parse_request_rate("fast"), Error);
}

TEST(PoissonArrivals, MeanGapIsOneOverRate) {
  std::mt19937_64 rng(3);
  auto times = poisson_arrival_times(20001, 50.0, rng);
  EXPECT_EQ(times[0], 0.0);
  for (size_t i = 1; i < times.size(); ++i) ASSERT_GE(times[i], times[i - 1]);
  EXPECT_NEAR(times.back() / 20000, 1.0 / 50, 0.001);  // mean gap 20 ms within 5%
  auto unlimited = poisson_arrival_times(5, std::numeric_limits<double>::infinity(), rng);
  EXPECT_EQ(unlimited, std::vector<double>(5, 0.0));
}

TEST(PromptsPerLevel, DefaultScalesWithConcurrency) {
  BenchOptions options;
  EXPECT_EQ(prompts_for_level(options, 1), 16u);
  EXPECT_EQ(prompts_for_level(options, 8), 32u);
  EXPECT_EQ(prompts_for_level(options, 0), 64u);
  options.num_prompts = 5;
  EXPECT_EQ(prompts_for_level(options, 8), 5u);
}

TEST(PromptsPerLevel, MixedLoadMakesEveryNthPromptLong) {
  BenchOptions options;
  options.input_len = 512;
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(bench_prompt_len(options, i), 512u);  // off by default
  options.long_input_len = 8192;
  options.long_every = 4;
  std::vector<size_t> lens;
  for (size_t i = 0; i < 8; ++i) lens.push_back(bench_prompt_len(options, i));
  EXPECT_EQ(lens, (std::vector<size_t>{512, 512, 512, 8192, 512, 512, 512, 8192}));
}

}  // namespace
}  // namespace kiln::clients
