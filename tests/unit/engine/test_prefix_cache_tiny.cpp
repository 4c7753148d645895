// The prefix cache and preemption on the real model: kiln-tiny (models/kiln-tiny) on the CPU backend. Greedy
// outputs with the cache on equal those with it off, over multi-turn conversations run one at a time and
// concurrently, with preemption and eviction in the middle (a small KV pool); nothing leaks.
#include <gtest/gtest.h>

#include <random>

#include "backend/cpu/cpu_backend.h"
#include "engine/engine.h"
#include "format/model_dir.h"

namespace kiln::engine {
namespace {

const std::string kTiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";

std::unique_ptr<model::ModelRunner> tiny(int64_t kv_pages, int slots) {
  backend::CpuLoadOptions lo;
  lo.max_context = 1024;
  lo.kv_pages = kv_pages;
  lo.state_slots = slots;
  lo.prefill_chunk = 64;
  return backend::load_cpu_model(format::ModelDir::open(kTiny), lo);
}

EngineOptions opts(int running, bool cache) {
  EngineOptions o;
  o.max_running_requests = running;
  o.chunked_prefill_size = 48;
  o.eos_token_ids = {2050};
  o.enable_prefix_cache = cache;
  return o;
}

struct Answer {
  std::vector<int32_t> tokens;
  int64_t cached = 0;
};

Answer collect(const std::shared_ptr<RequestChannel>& ch) {
  Answer a;
  bool first = true;
  for (;;) {
    std::vector<TokenEvent> evs;
    ch->wait(evs, std::chrono::milliseconds(100));
    for (auto& e : evs) {
      if (e.token >= 0) {
        if (first) a.cached = e.cached_tokens;
        first = false;
        a.tokens.push_back(e.token);
      }
      if (e.finished) {
        EXPECT_NE(e.finish_reason, FinishReason::error) << e.error;
        return a;
      }
    }
  }
}

// `convs` conversations of `turns` turns over token ids (no template needed: the cache sees ids); conversations
// share a system prefix in pairs; turn t of every conversation is submitted at once.
std::vector<std::vector<std::vector<int32_t>>> converse(Engine& e, int convs, int turns, int64_t* hit_turns) {
  std::mt19937 rng(3);
  auto words = [&](int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = static_cast<int32_t>(300 + rng() % 1500);
    return v;
  };
  std::vector<std::vector<int32_t>> history(static_cast<size_t>(convs));
  std::vector<std::vector<int32_t>> systems;
  for (int i = 0; i < (convs + 1) / 2; ++i) systems.push_back(words(40));
  for (int i = 0; i < convs; ++i) history[i] = systems[i / 2];
  std::vector<std::vector<std::vector<int32_t>>> out(static_cast<size_t>(convs));
  for (int t = 0; t < turns; ++t) {
    std::vector<std::shared_ptr<RequestChannel>> chans;
    for (auto& h : history) {
      auto m = words(12 + static_cast<int>(rng() % 10));
      h.insert(h.end(), m.begin(), m.end());
      GenerateRequest r;
      r.prompt = h;
      r.max_tokens = 12;
      r.ignore_eos = true;
      r.sampling.temperature = 0.0f;
      auto s = e.submit({r});
      EXPECT_EQ(s.status, SubmitStatus::ok) << s.message;
      chans.push_back(s.channel);
    }
    for (int i = 0; i < convs; ++i) {
      Answer a = collect(chans[static_cast<size_t>(i)]);
      if (t > 0 && a.cached > 0 && hit_turns) ++*hit_turns;
      out[static_cast<size_t>(i)].push_back(a.tokens);
      history[static_cast<size_t>(i)].insert(history[static_cast<size_t>(i)].end(), a.tokens.begin(), a.tokens.end());
    }
  }
  return out;
}

TEST(TinyPrefixCache, GreedyOutputsWithTheCacheEqualThoseWithout) {
  const int convs = 4, turns = 4;
  std::vector<std::vector<std::vector<int32_t>>> ref;
  {
    Engine off(tiny(400, 4), opts(1, false));
    off.start();
    ref = converse(off, convs, turns, nullptr);
  }
  struct Case {
    int running;
    int64_t pages;
    const char* what;
  } cases[] = {{1, 400, "one at a time"}, {4, 400, "concurrent"}, {4, 24, "concurrent, 384-token pool"}};
  for (const Case& c : cases) {
    // Slots: each running sequence's own and its two pending snapshots (the prompt's second-to-last page boundary,
    // the latest), two cached snapshots per conversation (the same two of its last turn) and a spare.
    Engine on(tiny(c.pages, 3 * c.running + 2 * convs + 1), opts(c.running, true));
    on.start();
    int64_t hits = 0;
    auto got = converse(on, convs, turns, &hits);
    for (int i = 0; i < convs; ++i) EXPECT_EQ(got[i], ref[i]) << c.what << ", conversation " << i;
    auto m = on.metrics();
    EXPECT_GT(m.prefix_cache_hit_tokens_total, 0u) << c.what;
    if (c.running == 1) EXPECT_EQ(hits, convs * (turns - 1)) << c.what;
    if (c.pages < 100) EXPECT_GT(m.preemptions_total + m.prefix_cache_evicted_pages_total, 0u) << c.what;
    EXPECT_EQ(m.kv_pages_used, 0) << c.what;
    EXPECT_EQ(m.state_slots_used, 0) << c.what;
    std::printf("[tiny cache] %s: %llu of %llu prompt tokens cached, %llu preemptions, %llu pages evicted\n", c.what,
                static_cast<unsigned long long>(m.prefix_cache_hit_tokens_total),
                static_cast<unsigned long long>(m.prefix_cache_query_tokens_total),
                static_cast<unsigned long long>(m.preemptions_total),
                static_cast<unsigned long long>(m.prefix_cache_evicted_pages_total));
  }
}

}  // namespace
}  // namespace kiln::engine
