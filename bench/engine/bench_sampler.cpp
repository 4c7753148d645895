// SequenceSampler::sample at the Qwen3.5 vocabulary (248,320 logits, standard-normal like a model's spread), per
// parameter set: the host cost of one sampled token per sequence (the engine samples every non-greedy sequence of
// a step on its one thread). Run: bench_sampler [--benchmark_filter=...].
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "engine/sampler.h"

namespace {

using kiln::engine::SamplingParams;
using kiln::engine::SequenceSampler;

constexpr int64_t kVocab = 248320;

std::vector<float> make_logits() {
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 3.0f);
  std::vector<float> l(kVocab);
  for (float& x : l) x = n(rng);
  return l;
}

void run(benchmark::State& state, SamplingParams p, int top_logprobs, bool want_logprob) {
  const std::vector<float> base = make_logits();
  std::vector<float> l(base.size());
  SequenceSampler s(p, 7);
  for (auto _ : state) {
    state.PauseTiming();
    l = base;
    state.ResumeTiming();
    benchmark::DoNotOptimize(s.sample(l, {}, 0, top_logprobs, want_logprob));
  }
}

void BM_Greedy(benchmark::State& st) {
  SamplingParams p;
  p.temperature = 0.0f;
  run(st, p, 0, false);
}
void BM_Qwen_T06_P095_K20(benchmark::State& st) {
  SamplingParams p;
  p.temperature = 0.6f;
  p.top_p = 0.95f;
  p.top_k = 20;
  run(st, p, 0, false);
}
void BM_T1_P09(benchmark::State& st) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  run(st, p, 0, false);
}
void BM_T07(benchmark::State& st) {
  SamplingParams p;
  p.temperature = 0.7f;
  run(st, p, 0, false);
}
void BM_T07_MinP005(benchmark::State& st) {
  SamplingParams p;
  p.temperature = 0.7f;
  p.min_p = 0.05f;
  run(st, p, 0, false);
}
void BM_T1_P09_Logprobs5(benchmark::State& st) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  run(st, p, 5, true);
}

BENCHMARK(BM_Greedy)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Qwen_T06_P095_K20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_T1_P09)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_T07)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_T07_MinP005)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_T1_P09_Logprobs5)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
