// kiln bench-engine: the model runner alone (no scheduler, no HTTP): B sequences of random prompt tokens, one
// batched prefill, then O batched greedy decode steps. Prints prefill tok/s, the decode step latency (median,
// p10, p90) and decode tok/s. --spec-sweep K,... (speculative decoding with the model's MTP head): after the decode
// steps, the draft chain of K tokens (after a warm-up: on one GPU the chain replays as one CUDA graph), the verify pass
// of K + 1 tokens per sequence and the replay of the accepted tokens are timed at each K, and the tok/s they would give at the published acceptance lengths of Qwen3.5-397B
// (K = 1..5: 1.93, 2.73, 3.39, 3.97, 4.41 tokens per verify) is printed, labelled as a projection. Under
// --load-format dummy a config without an MTP head gets one (mtp_num_hidden_layers 1, as the real checkpoints have).
// --single-rank R (cuda, with --tp-size N): only rank R runs, its all-reduces replaced by device copies; before the
// model loads, the all-reduce of each batch's decode step (batch x hidden floats) is timed with N ranks sharing the GPU,
// and after each decode line the group's step is printed as a PROJECTION: this step + the step's all-reduces
// (model::all_reduces_per_pass) at that cost.
//
//   kiln bench-engine [--model-path DIR] [--device auto|cpu|cuda] [--batch B[,B...]] [--input-len I]
//                     [--output-len O] [--kv-dtype bf16|fp8|f32] [--prefill-chunk N] [--load-format auto|dummy]
//                     [--profile] [--disable-cuda-graph] [--host-sampling] [--spec-sweep K[,K...]] ...
//                     (--help lists all)
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "backend/device.h"
#include "cli/command.h"
#include "cli/gpu_flags.h"
#include "cli/parallel_flags.h"
#include "core/error.h"
#include "format/capacity.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/weight_map.h"
#include "model/family.h"
#include "model/runner.h"

namespace {

struct BenchEngineOptions {
  std::string model_path;
  std::string device = "auto";
  std::string batch = "1";
  int64_t input_len = 128;
  int64_t output_len = 32;
  std::string kv_dtype = "bf16";
  int64_t prefill_chunk = kiln::backend::kDefaultMaxPassTokens;  // --max-pass-tokens
  uint64_t seed = 1;
  int threads = 0;
  bool skip_self_check = false;
  kiln::cli::GpuFlags gpu;
  kiln::backend::ParallelOptions parallel;  // --single-rank included
  bool profile = false;
  bool host_sampling = false;
  float temperature = 0.0f;  // > 0: sample (temperature / top-k / top-p) instead of argmax, on the device
  int top_k = 0;
  float top_p = 1.0f;
  std::string spec_sweep;  // draft lengths to time (speculative decoding); empty: none
};

// Published acceptance lengths (tokens per verify, accepted + bonus) of Qwen3.5-397B NVFP4 with its MTP head on
// coding prompts, thinking on (InferenceX), K = 1..5.
constexpr double kPublishedAcceptLength[] = {1.93, 2.73, 3.39, 3.97, 4.41};

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

std::vector<int> parse_batches(const std::string& text, const char* flag = "--batch", const char* what = "a batch size",
                               long most = 4096) {
  std::vector<int> out;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t j = std::min(text.find(',', i), text.size());
    const std::string item = text.substr(i, j - i);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > most)
      kiln::fail("{}: '{}' is not {} from 1 to {} (give one or a comma-separated list)", flag, item, what, most);
    out.push_back(static_cast<int>(v));
    i = j + 1;
  }
  return out;
}

kiln::DType bench_kv_dtype(const std::string& flag) {
  if (flag == "bf16") return kiln::DType::BF16;
  if (flag == "fp8") return kiln::DType::F8_E4M3;
  if (flag == "f32") return kiln::DType::F32;
  kiln::fail("--kv-dtype must be bf16, fp8 or f32, got '{}'", flag);
}

// The load options of the bench: one state slot per sequence of the largest batch (K per sequence with --spec-sweep
// up to K: the runner keeps as many position checkpoints as state slots, and a verify of K drafts keeps K), a context
// of the prompt and the output, passes of --max-pass-tokens (no engine steps here).
kiln::backend::LoadOptions bench_load_options(const BenchEngineOptions& o, int max_batch, int max_draft) {
  using namespace kiln;
  backend::LoadOptions lo;
  lo.threads = o.threads;
  lo.state_slots = max_batch * std::max(max_draft, 1);
  lo.max_context = o.input_len + o.output_len + 8;  // + the verify positions of --spec-sweep (K + 1 <= 6)
  lo.mtp = !o.spec_sweep.empty();
  lo.prefill_chunk = backend::resolve_pass_tokens(o.prefill_chunk, 0);
  cli::apply_gpu_flags(o.gpu, lo);
  cli::check_node_zero(o.parallel, "bench-engine");
  lo.parallel = o.parallel;
  lo.kv_dtype = bench_kv_dtype(o.kv_dtype);
  return lo;
}

// One batch of B sequences over the loaded runner: the prompts, their pages, and one step of the chosen output mode.
struct BenchBatch {
  const BenchEngineOptions& o;
  kiln::model::ModelRunner& runner;
  int B;
  int64_t V, pages_per_seq;
  std::vector<std::vector<int32_t>> prompts, pages;
  std::vector<kiln::model::SeqChunk> chunks;
  std::vector<int32_t> next;
  std::vector<float> logits;
  std::vector<kiln::model::RowSampling> rows;
  std::mt19937_64 draw;

  BenchBatch(const BenchEngineOptions& opts, kiln::model::ModelRunner& r, int batch, int64_t pages_per_sequence)
      : o(opts), runner(r), B(batch), V(r.vocab_size()), pages_per_seq(pages_per_sequence), prompts(batch),
        pages(batch), chunks(batch), next(batch), rows(batch), draw(opts.seed + 17) {
    std::mt19937_64 rng(o.seed);
    for (int b = 0; b < B; ++b) {
      prompts[b].resize(o.input_len);
      for (auto& t : prompts[b]) t = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(V - 1))(rng);
      pages[b].resize(pages_per_seq);
      for (int64_t p = 0; p < pages_per_seq; ++p) pages[b][p] = static_cast<int32_t>(b * pages_per_seq + p);
      chunks[b].state_slot = b;
      chunks[b].page_table = pages[b];
    }
  }
  // One forward of the chunks: device sampling (--temperature), device argmax, or host argmax (--host-sampling).
  void step() {
    if (!o.host_sampling && o.temperature > 0.0f) {
      for (auto& r : rows) {
        r.temperature = o.temperature;
        r.top_k = o.top_k;
        r.top_p = o.top_p;
        r.u = std::uniform_real_distribution<double>(0.0, 1.0)(draw);
      }
      runner.forward_sample(chunks, rows, next);
      return;
    }
    if (!o.host_sampling) {
      runner.forward_argmax(chunks, next);
      return;
    }
    logits.resize(static_cast<size_t>(B) * V);
    runner.forward(chunks, logits);
    for (int b = 0; b < B; ++b) {
      const float* row = logits.data() + static_cast<size_t>(b) * V;
      next[b] = static_cast<int32_t>(std::max_element(row, row + V) - row);
    }
  }
  // Every sequence's prompt (its first `tokens`) from position 0.
  void prompt_inputs(int64_t tokens) {
    for (int b = 0; b < B; ++b) {
      chunks[b].tokens = std::span<const int32_t>(prompts[b]).first(tokens);
      chunks[b].start_pos = 0;
    }
  }
  // One token per sequence (the last step's) at `pos`.
  void decode_inputs(int64_t pos) {
    for (int b = 0; b < B; ++b) {
      chunks[b].tokens = std::span<const int32_t>(&next[b], 1);
      chunks[b].start_pos = pos;
    }
  }
};

// The bytes one decode step reads at batch 1, as `kiln inspect` counts them, over the measured step.
void print_bandwidth(const kiln::format::ModelDir& dir, const kiln::backend::LoadOptions& lo, double median_ms) {
  using namespace kiln;
  const format::ModelConfig config = format::load_model_config(dir);
  const format::QuantConfig quant = format::load_quant_config(dir);
  format::CapacityOptions co;
  co.kv_dtype = lo.kv_dtype;
  co.tp = lo.parallel.single_rank >= 0 ? lo.parallel.tp_size : 1;  // one rank alone reads its share (inspect: per GPU)
  co.ep = lo.parallel.single_rank >= 0 ? lo.parallel.ep_size : 1;
  const auto plan = format::plan_capacity(config, format::expected_tensors(config, quant), co);
  const double bytes = static_cast<double>(co.tp > 1 ? plan.decode_bytes_per_token_per_gpu : plan.decode_bytes_per_token);
  std::printf("  batch-1 bandwidth: %.4g GB read per token%s (kiln inspect) / %.3f ms = %.3g TB/s\n", bytes / 1e9,
              co.tp > 1 ? " per GPU" : "", median_ms, bytes / (median_ms * 1e-3) / 1e12);
}

// --single-rank on CUDA: the group's decode step projected from measured parts, this rank's step alone plus the
// group's all-reduces (model::all_reduces_per_pass) at their cost timed with tp ranks sharing this one GPU.
struct GroupProjection {
  int tp = 1, gpu = 0;
  int64_t hidden = 0, pass_tokens = 0;
  std::map<int, double> all_reduce_us;  // by batch B: microseconds per all-reduce of B x hidden floats
  int64_t all_reduces = 0;              // per decode pass, set once the model is loaded (the MTP head adds some)
  std::string unavailable;              // why there is none ("" when there is)
  bool wanted() const { return tp > 1; }
};

// Times the all-reduces of every batch's decode pass before the model loads: ranks sharing a GPU run the peer kernel
// reliably only in a process that has run little else on it (backend/cuda/comm_cuda.h).
GroupProjection time_group_all_reduces(const BenchEngineOptions& o, const kiln::format::ModelConfig& config,
                                       const std::vector<int>& batches, int64_t pass_tokens, bool on_gpu) {
  GroupProjection p;
  if (o.parallel.single_rank < 0 || o.parallel.tp_size < 2 || !on_gpu) return p;
  kiln::backend::validate_parallel(o.parallel);  // a wrong --single-rank fails before the timing, not after it
  p.tp = o.parallel.tp_size;
  p.gpu = o.parallel.base_gpu_id;
  p.hidden = config.hidden_size;
  p.pass_tokens = pass_tokens;
  std::vector<int> timed;
  std::vector<int64_t> floats;
  for (int B : batches)  // a batch whose decode step runs in several passes is not projected
    if (B <= pass_tokens && std::find(timed.begin(), timed.end(), B) == timed.end()) {
      timed.push_back(B);
      floats.push_back(static_cast<int64_t>(B) * p.hidden);
    }
  try {
    const std::vector<double> us = kiln::backend::time_all_reduce_on_one_gpu(p.tp, p.gpu, floats);
    for (size_t i = 0; i < timed.size(); ++i) p.all_reduce_us[timed[i]] = us[i];
  } catch (const kiln::Error& e) {
    p.unavailable = e.what();
  }
  return p;
}

// What the projection adds up, once, after the model's line.
void print_projection_basis(const GroupProjection& p, const kiln::format::ModelConfig& config, bool mtp_head,
                            int single_rank) {
  if (!p.unavailable.empty()) {
    std::printf("--single-rank %d: no group projection (timing the all-reduce failed: %s)\n", single_rank,
                p.unavailable.c_str());
    return;
  }
  std::printf("--single-rank %d of --tp-size %d: each batch's PROJECTION adds to this rank's decode step %lld all-reduces "
              "per step (1 for the embedding lookup + 2 per layer x %d layers%s) of batch x %lld floats, each at its "
              "cost timed with %d ranks sharing GPU %d: the peer kernel's own cost, every read in one GPU's memory, no "
              "NVLink or PCIe link crossed (the ranks' kernels also share this GPU's SMs and bandwidth, which weighs "
              "on large messages). A projection, not a measurement of the group: it leaves out the link's "
              "latency, ranks waiting for the slowest one and the host's token pick across ranks, and the rank's step "
              "already holds a device copy in each all-reduce's place.\n",
              single_rank, p.tp, static_cast<long long>(p.all_reduces), config.num_layers,
              mtp_head ? " + 3 for the MTP head" : "", static_cast<long long>(p.hidden), p.tp, p.gpu);
}

// The projected group step at batch B after its measured single-rank step (median_ms).
void print_projection(const GroupProjection& p, int B, double median_ms) {
  if (!p.wanted() || !p.unavailable.empty()) return;
  const auto it = p.all_reduce_us.find(B);
  if (it == p.all_reduce_us.end()) {
    std::printf("  PROJECTION tp %d: none at batch %d (its decode step runs in more than one pass of %lld tokens)\n",
                p.tp, B, static_cast<long long>(p.pass_tokens));
    return;
  }
  const double ar_ms = static_cast<double>(p.all_reduces) * it->second * 1e-3, total_ms = median_ms + ar_ms;
  std::printf("  PROJECTION tp %d group step: %.3f ms (single-rank step) + %lld x %.2f us (all-reduce of %lld floats, "
              "measured with %d ranks on one GPU, no link) = %.3f ms -> %.1f tok/s per sequence, %.1f tok/s for the "
              "batch\n",
              p.tp, median_ms, static_cast<long long>(p.all_reduces), it->second,
              static_cast<long long>(B * p.hidden), p.tp, total_ms, 1e3 / total_ms, B * 1e3 / total_ms);
}

// One more call of `run`, op by op (eager, ops queued behind a busy-wait so that they run back to back). False when
// the backend does not time ops.
bool profile_call(kiln::model::Runner& mr, int B, const char* what, const std::function<void()>& run) {
  if (!mr.ops().profile_begin()) {
    std::printf("  --profile: the %s backend does not time ops\n", mr.ops().name().c_str());
    return false;
  }
  mr.set_graphs_enabled(false);
  run();
  mr.set_graphs_enabled(true);
  std::vector<kiln::model::OpTime> times = mr.ops().profile_end();
  double total = 0;
  for (const auto& t : times)
    if (!t.nested) total += t.total_us;
  std::sort(times.begin(), times.end(), [](const auto& a, const auto& b) { return a.total_us > b.total_us; });
  std::printf("  per-op time of one %s (batch %d, eager, back to back): %.1f us in ops\n", what, B, total);
  std::printf("  %-44s %6s %10s %8s %6s\n", "op", "calls", "total us", "us/call", "share");
  // Ops first, then the stages timed inside them (rows starting with " . ", not added to the total).
  for (bool nested : {false, true})
    for (const auto& t : times)
      if (t.nested == nested)
        std::printf("  %-44s %6lld %10.1f %8.2f %5.1f%%\n", t.label.c_str(), static_cast<long long>(t.calls),
                    t.total_us, t.total_us / std::max<int64_t>(t.calls, 1), 100.0 * t.total_us / std::max(total, 1e-9));
  std::fflush(stdout);
  return true;
}
bool profile_step(kiln::model::Runner& mr, BenchBatch& batch, const char* what) {
  return profile_call(mr, batch.B, what, [&] { batch.step(); });
}

// --spec-sweep: speculative decoding's step costs at each K from the sequences' position `pos` (the passes write the
// same positions again and again; with dummy weights acceptance means nothing, so the tok/s is projected from the
// published acceptance lengths). plain_ms: the measured plain decode step (the head loaded: every pass runs it).
// graphs: CUDA graphs on (a single runner then replays the whole draft chain as one graph). profile (--profile, one
// runner): at the largest K, the verify pass the engine runs (position checkpoints, carried first draft, where the
// runner has them) and the draft chain, op by op, beside the decode step's profile.
void spec_sweep(const std::vector<int>& sweep, kiln::model::ModelRunner& runner, BenchBatch& batch, int64_t pos,
                double plain_ms, bool graphs, bool profile) {
  using namespace kiln;
  const int B = batch.B;
  auto median_ms = [&](const std::function<void()>& fn) {
    std::vector<double> ms;
    for (int rep = 0; rep < 6; ++rep) {
      const auto t = Clock::now();
      fn();
      ms.push_back(ms_since(t));
    }
    ms.erase(ms.begin());  // the first run of a shape (setup, scratch growth)
    return percentile(ms, 0.5);
  };
  // How the draft below runs: one runner chains the head on the device (each step's argmax feeds the next without a
  // host round trip) and, with graphs, replays the whole chain of a shape as one CUDA graph; tensor-parallel ranks meet
  // on the host every step (eager).
  const bool one_runner = dynamic_cast<model::Runner*>(&runner) != nullptr;
  const char* draft_how = !one_runner ? "eager, ranks meet per step"
                          : graphs    ? "one CUDA graph, ids on the device"
                                      : "eager, ids on the device";
  for (int K : sweep) {
    std::vector<model::DraftSeq> seqs(B);
    std::vector<std::vector<int32_t>> verify(B);
    std::vector<int32_t> drafted(static_cast<size_t>(B) * K), ids(static_cast<size_t>(B) * (K + 1));
    for (int b = 0; b < B; ++b) {
      seqs[b].state_slot = b;
      seqs[b].token = batch.next[b];
      seqs[b].pos = pos;
      seqs[b].page_table = batch.pages[b];
    }
    // Two calls before the timed ones: a shape's first chain runs eagerly, the second is captured; the timed calls
    // replay the graph (the chain writes the same KV entries each time).
    for (int warm = 0; warm < 2; ++warm) runner.draft(seqs, K, drafted, {});
    const double draft_ms = median_ms([&] { runner.draft(seqs, K, drafted, {}); });
    std::vector<model::SeqChunk> vchunks(B);
    for (int b = 0; b < B; ++b) {
      verify[b].assign(1, batch.next[b]);
      verify[b].insert(verify[b].end(), drafted.begin() + b * K, drafted.begin() + (b + 1) * K);
      vchunks[b] = batch.chunks[b];
      vchunks[b].tokens = verify[b];
      vchunks[b].start_pos = pos;
      vchunks[b].logits_tokens = K + 1;
    }
    const double verify_ms = median_ms([&] {
      for (int b = 0; b < B; ++b) runner.save_state(b);
      runner.forward_argmax(vchunks, ids);
    });
    // The replay after a rejected draft: the checkpoint back, then [pending, accepted drafts] again without logits
    // (at most K tokens: with all K accepted there is no replay).
    const double L = kPublishedAcceptLength[K - 1];
    const int64_t replay_tokens = std::clamp<int64_t>(static_cast<int64_t>(L + 0.5), 1, K);
    std::vector<model::SeqChunk> rchunks = vchunks;
    for (auto& c : rchunks) {
      c.tokens = c.tokens.first(static_cast<size_t>(replay_tokens));
      c.want_logits = false;
    }
    const double replay_ms = median_ms([&] {
      for (int b = 0; b < B; ++b) runner.restore_state(b);
      runner.forward(rchunks, {});
    });
    const double best = draft_ms + verify_ms, worst = best + replay_ms;
    // --profile: the draft chain of the largest K and its verify pass as the engine runs it, op by op (eager).
    auto* profiled = profile && K == *std::max_element(sweep.begin(), sweep.end())
                         ? dynamic_cast<model::Runner*>(&runner)
                         : nullptr;
    if (profiled) {
      const std::string chain = fmt::format("draft chain of K = {}", K);
      profile_call(*profiled, B, chain.c_str(), [&] { runner.draft(seqs, K, drafted, {}); });
      const bool ckpt = runner.position_checkpoints() >= B * K, carry = ckpt && runner.can_carry_drafts();
      std::vector<model::SeqChunk> pchunks = vchunks;
      for (auto& c : pchunks) c.checkpoint_positions = ckpt;
      std::vector<int32_t> next(ids.size());
      const std::string what = fmt::format("verify pass of K = {} ({} tokens a sequence{}{})", K, K + 1,
                                           ckpt ? ", position checkpoints" : "", carry ? ", carrying the next draft" : "");
      profile_call(*profiled, B, what.c_str(), [&] {
        if (carry) runner.forward_argmax_carry(pchunks, ids, next);
        else runner.forward_argmax(pchunks, ids);
      });
    }
    std::printf("  spec K=%d batch %d: draft %.3f ms (%s), verify (%d tokens/seq) %.3f ms, replay (%lld tokens/seq) "
                "%.3f ms | PROJECTION at the published accept length %.2f: %.1f-%.1f tok/s (replay every step .. "
                "never), %.2f-%.2fx the plain decode step (%.3f ms, MTP head loaded)\n",
                K, B, draft_ms, draft_how, K + 1, verify_ms, static_cast<long long>(replay_tokens), replay_ms, L,
                B * L / worst * 1e3, B * L / best * 1e3, plain_ms * L / worst, plain_ms * L / best, plain_ms);
    // What the engine runs when the runner keeps position checkpoints: the verify keeps the state after each
    // position (the recurrence; a CUDA graph per shape), and a row that rejected takes its accepted token's
    // checkpoint (keep_verified: a copy of the row's state) instead of the replay.
    if (runner.position_checkpoints() >= B * K) {
      for (auto& c : vchunks) c.checkpoint_positions = true;
      const double ckpt_verify_ms = median_ms([&] { runner.forward_argmax(vchunks, ids); });
      const double settle_ms = median_ms([&] {
        runner.forward_argmax(vchunks, ids);
        std::vector<kiln::model::ModelRunner::VerifiedRow> rows;
        for (int b = 0; b < B; ++b) rows.push_back({b, static_cast<int>(replay_tokens)});
        runner.keep_verified_rows(rows);
      }) - ckpt_verify_ms;
      const double best_c = draft_ms + ckpt_verify_ms, worst_c = best_c + std::max(settle_ms, 0.0);
      std::printf("  spec K=%d batch %d, position checkpoints: verify %.3f ms, settle (keep_verified) %.3f ms "
                  "| PROJECTION at accept length %.2f: %.1f-%.1f tok/s, %.2f-%.2fx the plain decode step\n",
                  K, B, ckpt_verify_ms, settle_ms, L, B * L / worst_c * 1e3, B * L / best_c * 1e3,
                  plain_ms * L / worst_c, plain_ms * L / best_c);
      // What the engine runs by default on one runner with greedy rows: the verify also runs the head's entry after
      // each row's token (forward_argmax_carry), so the next chain starts from a carried first draft and runs K - 1
      // steps (K = 1: none).
      if (runner.can_carry_drafts()) {
        std::vector<int32_t> next(ids.size());
        const double carry_verify_ms = median_ms([&] { runner.forward_argmax_carry(vchunks, ids, next); });
        std::vector<model::DraftSeq> cseqs = seqs;
        for (int b = 0; b < B; ++b) {
          cseqs[b].carried_row = 0;
          cseqs[b].first_draft = next[static_cast<size_t>(b) * (K + 1)];
        }
        for (int warm = 0; warm < 2; ++warm) runner.draft(cseqs, K, drafted, {});
        const double carried_draft_ms = median_ms([&] { runner.draft(cseqs, K, drafted, {}); });
        const double best_k = carried_draft_ms + carry_verify_ms, worst_k = best_k + std::max(settle_ms, 0.0);
        std::printf("  spec K=%d batch %d, carried first draft: draft (%d chain steps) %.3f ms, verify + carry %.3f ms "
                    "| PROJECTION at accept length %.2f: %.1f-%.1f tok/s, %.2f-%.2fx the plain decode step\n",
                    K, B, K - 1, carried_draft_ms, carry_verify_ms, L, B * L / worst_k * 1e3, B * L / best_k * 1e3,
                    plain_ms * L / worst_k, plain_ms * L / best_k);
        // The engine's default with K >= 2: the chain stays on the device and the verify reads it there (one host
        // round trip per cycle instead of two).
        if (K >= 2) {
          std::vector<model::SeqChunk> dchunks = vchunks;
          for (int b = 0; b < B; ++b) dchunks[b].device_draft_row = b;
          std::vector<int32_t> chain(static_cast<size_t>(B) * (K - 1));
          const double cycle_ms = median_ms([&] {
            runner.draft_deferred(cseqs, K);
            runner.forward_argmax_carry(dchunks, ids, next, chain);
          });
          const double worst_d = cycle_ms + std::max(settle_ms, 0.0);
          std::printf("  spec K=%d batch %d, carried + chain left on the device: draft + verify %.3f ms "
                      "| PROJECTION at accept length %.2f: %.1f-%.1f tok/s, %.2f-%.2fx the plain decode step\n",
                      K, B, cycle_ms, L, B * L / worst_d * 1e3, B * L / cycle_ms * 1e3, plain_ms * L / worst_d,
                      plain_ms * L / cycle_ms);
        }
      }
    }
  }
  std::fflush(stdout);
}

// Warm-up, the measured prefill and decode of one batch size, the numbers, and --profile's op times.
void bench_batch(const BenchEngineOptions& o, const kiln::format::ModelDir& dir, const kiln::backend::LoadOptions& lo,
                 kiln::model::ModelRunner& runner, int B, int64_t pages_per_seq, const std::vector<int>& sweep,
                 bool graphs, const GroupProjection& projection) {
  BenchBatch batch(o, runner, B, pages_per_seq);
  // Warm-up (kernel loading, scratch growth, library plans, graph capture): the prefill once, then a short prefill
  // and three decode steps; the measured prefill below starts the sequences over.
  batch.prompt_inputs(o.input_len);
  batch.step();
  const int64_t warm = std::min<int64_t>(o.input_len, 4);
  batch.prompt_inputs(warm);
  batch.step();
  for (int64_t s = 0; s < 3; ++s) {
    batch.decode_inputs(warm + s);
    batch.step();
  }
  // Prefill: every prompt in one forward call (the runner splits it into passes of --prefill-chunk tokens).
  batch.prompt_inputs(o.input_len);
  const auto prefill_start = Clock::now();
  batch.step();
  const double prefill_ms = ms_since(prefill_start);
  // Decode: one token per sequence per step, greedy.
  std::vector<double> step_ms;
  const auto decode_start = Clock::now();
  int64_t pos = o.input_len;
  for (int64_t s = 0; s < o.output_len; ++s, ++pos) {
    batch.decode_inputs(pos);
    const auto t = Clock::now();
    batch.step();
    step_ms.push_back(ms_since(t));
  }
  const double decode_ms = ms_since(decode_start);
  const double median = percentile(step_ms, 0.5);
  std::printf("batch %d: prefill %lld tokens in %.2f ms: %.1f tok/s | decode %lld steps, step median %.3f ms "
              "(p10 %.3f, p90 %.3f): %.1f tok/s at the median, %.1f tok/s overall\n",
              B, static_cast<long long>(B * o.input_len), prefill_ms,
              B * o.input_len / std::max(prefill_ms, 1e-9) * 1e3, static_cast<long long>(o.output_len), median,
              percentile(step_ms, 0.1), percentile(step_ms, 0.9), B / std::max(median, 1e-9) * 1e3,
              B * o.output_len / std::max(decode_ms, 1e-9) * 1e3);
  if (B == 1) print_bandwidth(dir, lo, median);
  print_projection(projection, B, median);
  std::fflush(stdout);
  if (!sweep.empty()) spec_sweep(sweep, runner, batch, pos, median, graphs, o.profile);
  auto* mr = dynamic_cast<kiln::model::Runner*>(&runner);
  if (!o.profile || !mr) return;
  // A decode step, and at batch 1 the prefill of the prompt again (from position 0: the sequence starts over).
  batch.decode_inputs(pos);
  if (!profile_step(*mr, batch, "decode step")) return;
  if (B == 1 && o.input_len > 1) {
    batch.prompt_inputs(std::min<int64_t>(o.input_len, o.prefill_chunk));
    profile_step(*mr, batch, "prefill pass");
  }
}

int run_bench_engine(const BenchEngineOptions& o) {
  using namespace kiln;
  const std::vector<int> batches = parse_batches(o.batch);
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  if (o.input_len < 1 || o.output_len < 1) fail("--input-len and --output-len must be at least 1");
  const std::vector<int> sweep =
      o.spec_sweep.empty() ? std::vector<int>{} : parse_batches(o.spec_sweep, "--spec-sweep", "a draft length", 5);
  format::ModelDir dir = format::ModelDir::open_or_embedded(o.model_path);
  const backend::LoadOptions lo =
      bench_load_options(o, max_batch, sweep.empty() ? 0 : *std::max_element(sweep.begin(), sweep.end()));
  // A dummy-weights config without the head gets one (a copy of its config files in a temporary folder).
  std::string head_dir;
  if (!sweep.empty() && !format::load_model_config(dir).has_mtp()) {
    if (lo.load_format != model::LoadFormat::dummy)
      fail("--spec-sweep: {} has no MTP head (config.json mtp_num_hidden_layers and mtp.* tensors)",
           dir.display_path());
    head_dir = (std::filesystem::temp_directory_path() / fmt::format("kiln-spec-sweep-{}", ::getpid())).string();
    std::filesystem::create_directories(head_dir);
    nlohmann::json cfg = nlohmann::json::parse(dir.read_text("config.json"));
    (cfg.contains("text_config") ? cfg["text_config"] : cfg)["mtp_num_hidden_layers"] = 1;
    std::ofstream(head_dir + "/config.json") << cfg.dump(2);
    if (dir.has("hf_quant_config.json"))
      std::ofstream(head_dir + "/hf_quant_config.json") << dir.read_text("hf_quant_config.json");
    dir = format::ModelDir::open(head_dir);
    std::printf("--spec-sweep: %s has no MTP head; dummy weights for one (mtp_num_hidden_layers 1)\n",
                o.model_path.c_str());
  }
  struct RemoveDir {
    std::string path;
    ~RemoveDir() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove_all(path, ec);
    }
  } remove_head_dir{head_dir};

  // CUDA graphs and device-side sampling exist on the GPU only; on the CPU backend the runner picks tokens itself.
  const bool on_gpu = backend::resolve_device(o.device).device == "cuda";
  const format::ModelConfig config = format::load_model_config(dir);
  GroupProjection projection = time_group_all_reduces(o, config, batches, lo.prefill_chunk, on_gpu);
  const auto load_start = Clock::now();
  auto runner = backend::load_model(dir, o.device, lo, !o.skip_self_check);
  const double load_ms = ms_since(load_start);
  const auto cap = runner->capacity();
  const int64_t pages_per_seq = (lo.max_context + cap.page_size - 1) / cap.page_size;
  if (pages_per_seq * max_batch > cap.kv_pages) fail("KV pool of {} pages cannot hold the batch", cap.kv_pages);
  if (!sweep.empty() && runner->mtp_layers() == 0)
    fail("--spec-sweep: the model loaded without its MTP head (see the log above)");
  std::printf("kiln bench-engine: %s | %s\n", dir.display_path().c_str(), runner->describe().c_str());
  const std::string where = on_gpu ? "on the device" : "in the CPU backend";
  const std::string sampling =
      o.host_sampling        ? std::string(on_gpu ? "host argmax over downloaded logits" : "host argmax over the logits")
      : o.temperature > 0.0f ? fmt::format("temperature {} top-k {} top-p {} {}", o.temperature, o.top_k, o.top_p, where)
                             : "argmax " + where;
  std::printf("input %lld, output %lld, kv %s, prefill chunk %lld, cuda graphs %s, sampling %s (load %.0f ms)\n",
              static_cast<long long>(o.input_len), static_cast<long long>(o.output_len), o.kv_dtype.c_str(),
              static_cast<long long>(o.prefill_chunk),
              !on_gpu ? "n/a (cpu)" : o.gpu.disable_cuda_graph ? "off" : "on", sampling.c_str(), load_ms);
  if (projection.wanted()) {
    const bool mtp_head = runner->mtp_layers() > 0;  // a decode pass then runs the head too
    projection.all_reduces = model::all_reduces_per_pass(config, projection.tp, mtp_head);
    print_projection_basis(projection, config, mtp_head, o.parallel.single_rank);
  }
  const bool graphs = on_gpu && !o.gpu.disable_cuda_graph;
  for (const int B : batches) bench_batch(o, dir, lo, *runner, B, pages_per_seq, sweep, graphs, projection);
  return 0;
}

kiln::cli::Registrar reg{"bench-engine", "Time the model runner alone: batched prefill and decode steps",
                         [](CLI::App& app) {
  auto o = std::make_shared<BenchEngineOptions>();
  app.add_option("--model-path", o->model_path, "Model folder (default: the embedded model)");
  app.add_option("--device", o->device, "auto, cpu or cuda")->capture_default_str();
  app.add_option("--batch", o->batch, "Sequences run together; a comma-separated list runs each in turn")
      ->capture_default_str();
  app.add_option("--input-len", o->input_len, "Prompt tokens per sequence (random ids)")->capture_default_str();
  app.add_option("--output-len", o->output_len, "Decode steps (greedy)")->capture_default_str();
  app.add_option("--kv-dtype", o->kv_dtype, "KV cache dtype: bf16, fp8 or f32")->capture_default_str();
  app.add_option("--max-pass-tokens,--prefill-chunk", o->prefill_chunk,
                 "Most tokens per forward pass (kiln serve's --max-pass-tokens; cuda: the memory plan reserves "
                 "activations for one)")
      ->capture_default_str();
  app.add_option("--seed", o->seed, "Prompt seed")->capture_default_str();
  app.add_option("--threads", o->threads, "CPU threads (default: KILN_THREADS or all cores)");
  app.add_flag("--skip-self-check", o->skip_self_check, "cuda: skip the startup self-check");
  kiln::cli::add_gpu_flags(app, o->gpu);
  kiln::cli::add_parallel_flags(app, o->parallel);
  app.add_option("--single-rank", o->parallel.single_rank,
                 "cuda, with --tp-size N: run only rank R of the N-rank plan on one GPU, its all-reduces replaced by a "
                 "device copy of the same size (one GPU's share of a model too large for one GPU; tokens are "
                 "meaningless); after each batch's decode line, a PROJECTION of the N-rank group's step: this step "
                 "plus the step's all-reduces at their cost timed first with N ranks on this one GPU (the kernel's "
                 "own cost, no link)")
      ->check(CLI::Range(0, 1023));
  app.add_flag("--profile", o->profile,
               "After each batch, time one decode step op by op, at batch 1 also one prefill pass (cuda)");
  app.add_option("--temperature", o->temperature,
                 "> 0: sample each token (with --top-k / --top-p) on the device instead of argmax")
      ->capture_default_str();
  app.add_option("--top-k", o->top_k, "With --temperature: keep the k most likely tokens (0: all)")->capture_default_str();
  app.add_option("--top-p", o->top_p, "With --temperature: nucleus mass")->capture_default_str();
  app.add_option("--spec-sweep", o->spec_sweep,
                 "Draft lengths K (1-5, comma-separated) at which to time speculative decoding's draft, verify and "
                 "replay passes with the model's MTP head, and print the tok/s projected at the published acceptance "
                 "lengths (loads the head; under --load-format dummy a config without one gets one)");
  app.add_flag("--host-sampling", o->host_sampling,
               "Download every step's logits and pick tokens on the host (default: argmax on the device)");
  return [o]() -> int { return run_bench_engine(*o); };
}};

}  // namespace
