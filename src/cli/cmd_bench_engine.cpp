// kiln bench-engine: the model runner alone (no scheduler, no HTTP): B sequences of random prompt tokens, one
// batched prefill, then O batched greedy decode steps. Prints prefill tok/s, the decode step latency (median,
// p10, p90) and decode tok/s.
//
//   kiln bench-engine [--model-path DIR] [--device auto|cpu|cuda] [--batch B] [--input-len I] [--output-len O]
//                     [--kv-dtype bf16|fp8|f32] [--prefill-chunk N] [--seed S] [--threads N] [--skip-self-check]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/device.h"
#include "cli/command.h"
#include "core/error.h"
#include "format/model_dir.h"
#include "model/runner.h"

namespace {

struct BenchEngineOptions {
  std::string model_path;
  std::string device = "auto";
  int batch = 1;
  int64_t input_len = 128;
  int64_t output_len = 32;
  std::string kv_dtype = "bf16";
  int64_t prefill_chunk = 512;
  uint64_t seed = 1;
  int threads = 0;
  bool skip_self_check = false;
};

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

int run_bench_engine(const BenchEngineOptions& o) {
  using namespace kiln;
  if (o.batch < 1) fail("--batch must be at least 1, got {}", o.batch);
  if (o.input_len < 1 || o.output_len < 1) fail("--input-len and --output-len must be at least 1");
  format::ModelDir dir;
  if (!o.model_path.empty()) {
    dir = format::ModelDir::open(o.model_path);
  } else if (format::ModelDir::has_embedded()) {
    dir = format::ModelDir::embedded();
  } else {
    fail("no --model-path given and this kiln binary has no embedded model: pass --model-path DIR");
  }
  backend::CpuLoadOptions lo;
  lo.threads = o.threads;
  lo.state_slots = o.batch;
  lo.max_context = o.input_len + o.output_len + 1;
  lo.prefill_chunk = o.prefill_chunk;
  if (o.kv_dtype == "bf16") lo.kv_dtype = DType::BF16;
  else if (o.kv_dtype == "fp8") lo.kv_dtype = DType::F8_E4M3;
  else if (o.kv_dtype == "f32") lo.kv_dtype = DType::F32;
  else fail("--kv-dtype must be bf16, fp8 or f32, got '{}'", o.kv_dtype);

  const auto load_start = Clock::now();
  auto runner = backend::load_model(dir, o.device, lo, !o.skip_self_check);
  const double load_ms = ms_since(load_start);
  const int64_t V = runner->vocab_size();
  const auto cap = runner->capacity();
  const int64_t pages_per_seq = (lo.max_context + cap.page_size - 1) / cap.page_size;
  if (pages_per_seq * o.batch > cap.kv_pages) fail("KV pool of {} pages cannot hold the batch", cap.kv_pages);

  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<int32_t>> prompts(o.batch), pages(o.batch);
  for (int b = 0; b < o.batch; ++b) {
    prompts[b].resize(o.input_len);
    for (auto& t : prompts[b]) t = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(V - 1))(rng);
    pages[b].resize(pages_per_seq);
    for (int64_t p = 0; p < pages_per_seq; ++p) pages[b][p] = static_cast<int32_t>(b * pages_per_seq + p);
  }
  std::vector<float> logits(static_cast<size_t>(o.batch) * V);
  std::vector<model::SeqChunk> chunks(o.batch);
  std::vector<int32_t> next(o.batch);
  auto argmax_all = [&] {
    for (int b = 0; b < o.batch; ++b) {
      const float* row = logits.data() + static_cast<size_t>(b) * V;
      next[b] = static_cast<int32_t>(std::max_element(row, row + V) - row);
    }
  };

  // Warm-up (kernel loading, scratch growth): a short prefill and two decode steps on every slot.
  for (int b = 0; b < o.batch; ++b) {
    chunks[b].state_slot = b;
    chunks[b].tokens = std::span<const int32_t>(prompts[b]).first(std::min<int64_t>(o.input_len, 4));
    chunks[b].start_pos = 0;
    chunks[b].page_table = pages[b];
  }
  runner->forward(chunks, logits);
  for (int s = 0; s < 2; ++s) {
    argmax_all();
    for (int b = 0; b < o.batch; ++b) {
      chunks[b].start_pos += static_cast<int64_t>(chunks[b].tokens.size());
      chunks[b].tokens = std::span<const int32_t>(&next[b], 1);
    }
    runner->forward(chunks, logits);
  }

  // Prefill: every prompt in one forward call (the runner splits it into passes of --prefill-chunk tokens).
  for (int b = 0; b < o.batch; ++b) {
    chunks[b].tokens = prompts[b];
    chunks[b].start_pos = 0;
  }
  const auto prefill_start = Clock::now();
  runner->forward(chunks, logits);
  const double prefill_ms = ms_since(prefill_start);

  // Decode: one token per sequence per step, greedy.
  std::vector<double> step_ms;
  const auto decode_start = Clock::now();
  int64_t pos = o.input_len;
  for (int64_t s = 0; s < o.output_len; ++s, ++pos) {
    argmax_all();
    for (int b = 0; b < o.batch; ++b) {
      chunks[b].tokens = std::span<const int32_t>(&next[b], 1);
      chunks[b].start_pos = pos;
    }
    const auto t = Clock::now();
    runner->forward(chunks, logits);
    step_ms.push_back(ms_since(t));
  }
  const double decode_ms = ms_since(decode_start);

  const double median = percentile(step_ms, 0.5);
  std::printf("kiln bench-engine: %s | %s\n", dir.display_path().c_str(), runner->describe().c_str());
  std::printf("batch %d, input %lld, output %lld, kv %s, prefill chunk %lld (load %.0f ms)\n", o.batch,
              static_cast<long long>(o.input_len), static_cast<long long>(o.output_len), o.kv_dtype.c_str(),
              static_cast<long long>(o.prefill_chunk), load_ms);
  std::printf("prefill: %lld tokens in %.2f ms: %.1f tok/s\n", static_cast<long long>(o.batch * o.input_len),
              prefill_ms, o.batch * o.input_len / std::max(prefill_ms, 1e-9) * 1e3);
  std::printf("decode:  %lld steps, step latency median %.3f ms (p10 %.3f, p90 %.3f): %.1f tok/s at the median, "
              "%.1f tok/s overall (%d sequences)\n",
              static_cast<long long>(o.output_len), median, percentile(step_ms, 0.1), percentile(step_ms, 0.9),
              o.batch / std::max(median, 1e-9) * 1e3, o.batch * o.output_len / std::max(decode_ms, 1e-9) * 1e3,
              o.batch);
  return 0;
}

kiln::cli::Registrar reg{"bench-engine", "Time the model runner alone: batched prefill and decode steps",
                         [](CLI::App& app) {
  auto o = std::make_shared<BenchEngineOptions>();
  app.add_option("--model-path", o->model_path, "Model folder (default: the embedded model)");
  app.add_option("--device", o->device, "auto, cpu or cuda")->capture_default_str();
  app.add_option("--batch", o->batch, "Sequences run together")->capture_default_str();
  app.add_option("--input-len", o->input_len, "Prompt tokens per sequence (random ids)")->capture_default_str();
  app.add_option("--output-len", o->output_len, "Decode steps (greedy)")->capture_default_str();
  app.add_option("--kv-dtype", o->kv_dtype, "KV cache dtype: bf16, fp8 or f32")->capture_default_str();
  app.add_option("--prefill-chunk", o->prefill_chunk, "Most tokens per forward pass")->capture_default_str();
  app.add_option("--seed", o->seed, "Prompt seed")->capture_default_str();
  app.add_option("--threads", o->threads, "CPU threads (default: KILN_THREADS or all cores)");
  app.add_flag("--skip-self-check", o->skip_self_check, "cuda: skip the startup self-check");
  return [o]() -> int { return run_bench_engine(*o); };
}};

}  // namespace
