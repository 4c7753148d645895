// Scheduler policy: admission, capacity accounting, chunked prefill, cancellation; with the prefix cache, shared
// pages, snapshot restores and saves, and the cache evicted before anything is preempted.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

#include <functional>
#include <numeric>

namespace kiln::engine {
namespace {

SchedulerOptions small_options() {
  SchedulerOptions o;
  o.max_running_requests = 4;
  o.max_queued_requests = 8;
  o.chunked_prefill_size = 8;
  o.context_length = 64;
  o.kv_pages = 16;
  o.page_size = 4;
  o.state_slots = 4;
  return o;
}

std::unique_ptr<Sequence> make_seq(uint64_t uid, std::vector<int32_t> prompt, int64_t max_tokens) {
  auto s = std::make_unique<Sequence>();
  s->uid = uid;
  s->tokens = std::move(prompt);
  s->prompt_len = static_cast<int64_t>(s->tokens.size());
  s->request.max_tokens = max_tokens;
  return s;
}

// A sequence whose prompt is 1, 2, ..., prompt_len.
std::unique_ptr<Sequence> make_seq(uint64_t uid, int64_t prompt_len, int64_t max_tokens) {
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
  std::iota(prompt.begin(), prompt.end(), 1);
  return make_seq(uid, std::move(prompt), max_tokens);
}

// Plays the engine: after a step, every chunk with logits gets a sampled token appended.
void fake_sample(const StepPlan& plan) {
  for (auto& c : plan.chunks)
    if (c.want_logits) {
      c.seq->tokens.push_back(7);
      ++c.seq->num_generated;
    }
}

TEST(Scheduler, ChecksFitWithNumbers) {
  Scheduler s(small_options());
  EXPECT_EQ(s.check_fits(10, 10), "");
  EXPECT_NE(s.check_fits(0, 10), "");
  EXPECT_NE(s.check_fits(10, 0), "");
  std::string too_long = s.check_fits(60, 10);  // 70 > 64
  EXPECT_NE(too_long.find("60"), std::string::npos) << too_long;
  EXPECT_NE(too_long.find("64"), std::string::npos) << too_long;
  EXPECT_NE(s.check_fits(64, 1).find("context length"), std::string::npos);
  EXPECT_EQ(s.check_fits(63, 1), "");
  // Fits the context, not the pool: 16 pages x 4 tokens = 64 tokens; a 48-token pool cannot hold 60.
  SchedulerOptions o = small_options();
  o.kv_pages = 12;
  Scheduler small_pool(o);
  std::string no_pages = small_pool.check_fits(30, 30);
  EXPECT_NE(no_pages.find("15 KV pages"), std::string::npos) << no_pages;
  EXPECT_NE(no_pages.find("12 pages"), std::string::npos) << no_pages;
}

TEST(Scheduler, PagesAtItsLongestCappedAtContext) {
  Scheduler s(small_options());
  EXPECT_EQ(s.pages_for(1, 1), 1);
  EXPECT_EQ(s.pages_for(3, 1), 1);
  EXPECT_EQ(s.pages_for(4, 1), 2);
  EXPECT_EQ(s.pages_for(10, 1000), 16);  // capped at context 64 / 4
}

TEST(Scheduler, ChunkedPrefillThenDecode) {
  Scheduler s(small_options());
  s.enqueue(make_seq(1, 20, 5));
  // 20-token prompt, budget 8: chunks of 8, 8, 4; only the last wants logits.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int step = 0; step < 3; ++step) {
    StepPlan p = s.plan_step();
    ASSERT_EQ(p.chunks.size(), 1u);
    spans.push_back({p.chunks[0].start_pos, p.chunks[0].num_tokens});
    EXPECT_EQ(p.chunks[0].want_logits, step == 2);
    EXPECT_EQ(p.num_decodes, 0);
    s.commit_step(p);
    fake_sample(p);
  }
  EXPECT_EQ(spans, (std::vector<std::pair<int64_t, int64_t>>{{0, 8}, {8, 8}, {16, 4}}));
  StepPlan d = s.plan_step();
  ASSERT_EQ(d.chunks.size(), 1u);
  EXPECT_EQ(d.num_decodes, 1);
  EXPECT_EQ(d.chunks[0].start_pos, 20);
  EXPECT_EQ(d.chunks[0].num_tokens, 1);
  EXPECT_TRUE(d.chunks[0].want_logits);
}

TEST(Scheduler, DecodesKeepFlowingWhileALongPromptPrefills) {
  Scheduler s(small_options());
  s.enqueue(make_seq(1, 4, 20));
  StepPlan p = s.plan_step();
  s.commit_step(p);
  fake_sample(p);  // seq 1 now decodes
  s.enqueue(make_seq(2, 30, 5));
  std::vector<int64_t> prefill;
  for (int step = 0; step < 5; ++step) {
    StepPlan q = s.plan_step();
    // Every step: seq 1's decode token first, then what is left of the budget of 8 for seq 2's prompt.
    ASSERT_GE(q.chunks.size(), 1u);
    EXPECT_EQ(q.chunks[0].seq->uid, 1u);
    EXPECT_EQ(q.num_decodes, 1);
    EXPECT_LE(q.num_decodes + q.num_prefill_tokens, 8);
    prefill.push_back(q.num_prefill_tokens);
    s.commit_step(q);
    fake_sample(q);
  }
  // 30 prompt tokens = 7 + 7 + 7 + 7 + 2: seq 2 decodes from now on.
  EXPECT_EQ(prefill, (std::vector<int64_t>{7, 7, 7, 7, 2}));
  StepPlan q = s.plan_step();
  EXPECT_EQ(q.num_decodes, 2);
  EXPECT_EQ(q.num_prefill_tokens, 0);
}

// Steps until `len` prompt tokens have been prefilled (a prompt just enqueued; at most 64 steps), each checked by
// `check(plan, step)` before it is committed and sampled. Returns the number of steps.
int prefill_prompt(Scheduler& s, int64_t len, const std::function<void(const StepPlan&, int)>& check) {
  int64_t prefilled = 0;
  int steps = 0;
  while (prefilled < len) {
    if (steps == 64) {
      ADD_FAILURE() << "the prompt never finished";
      break;
    }
    StepPlan q = s.plan_step();
    check(q, steps);
    EXPECT_GT(q.num_prefill_tokens, 0) << "step " << steps;
    prefilled += q.num_prefill_tokens;
    s.commit_step(q);
    fake_sample(q);
    ++steps;
  }
  EXPECT_EQ(prefilled, len);
  return steps;
}

// The step budget counts decodes: 16 sequences decoding and a 20k-token prompt arriving. Every step carries all
// 16 decodes (first), the prompt goes in chunks of what they leave of the budget, and no step exceeds it. With the
// prefix cache on the chunks also stop at the prompt's snapshot boundaries; the bounds are the same.
void sixteen_decodes_and_a_long_prompt(bool prefix_cache) {
  SchedulerOptions o;
  o.max_running_requests = 32;
  o.max_queued_requests = 32;
  o.chunked_prefill_size = 8192;
  o.context_length = 32768;
  o.page_size = 16;
  o.kv_pages = 4096;  // 65,536 tokens: room for everything, no preemption
  o.state_slots = 96;
  o.prefix_cache = prefix_cache;
  Scheduler s(o);
  // Prompts of 1..16 tokens: none crosses a page boundary, so all 16 go in one step with the cache on too.
  for (uint64_t i = 1; i <= 16; ++i) s.enqueue(make_seq(i, static_cast<int64_t>(i), 1000));
  StepPlan first = s.plan_step();
  ASSERT_EQ(first.num_prefill_tokens, 136);
  s.commit_step(first);
  fake_sample(first);
  ASSERT_EQ(s.num_running(), 16);
  constexpr int64_t kLong = 20000;
  s.enqueue(make_seq(100, kLong, 8));
  const int steps = prefill_prompt(s, kLong, [&](const StepPlan& q, int step) {
    EXPECT_EQ(q.num_decodes, 16) << "step " << step;
    for (int i = 0; i < 16; ++i) {
      EXPECT_EQ(q.chunks[static_cast<size_t>(i)].num_tokens, 1);
      EXPECT_NE(q.chunks[static_cast<size_t>(i)].seq->uid, 100u);
    }
    EXPECT_LE(q.num_decodes + q.num_prefill_tokens, o.chunked_prefill_size) << "step " << step;
    int64_t tokens = 0;
    for (const auto& c : q.chunks) tokens += c.num_tokens;
    EXPECT_EQ(tokens, q.num_decodes + q.num_prefill_tokens);
  });
  // 20,000 tokens in chunks of at most 8,192 - 16 = 8,176: 8,176 + 8,176 + 3,648. With the cache the third stops
  // at the prompt's second-to-last page boundary (19,968) and the last 32 tokens take a fourth step.
  EXPECT_EQ(steps, prefix_cache ? 4 : 3);
  StepPlan after = s.plan_step();
  EXPECT_EQ(after.num_decodes, 17);
  EXPECT_EQ(after.num_prefill_tokens, 0);
}

TEST(Scheduler, StepBudgetCountsDecodesWithALongPromptArriving) { sixteen_decodes_and_a_long_prompt(false); }
TEST(Scheduler, StepBudgetCountsDecodesWithThePrefixCacheOn) { sixteen_decodes_and_a_long_prompt(true); }

// --chunked-prefill-size-while-decoding: a long prompt that arrives while nothing decodes gets the whole budget per
// step; one that arrives beside 16 decoding streams gets the smaller budget of steps with decodes, so each of those
// steps (what the streams wait for between tokens) carries at most 2,048 tokens.
TEST(Scheduler, StepsWithDecodesTakeTheSmallerBudget) {
  SchedulerOptions o;
  o.max_running_requests = 32;
  o.max_queued_requests = 32;
  o.chunked_prefill_size = 8192;
  o.step_budget_while_decoding = 2048;
  o.context_length = 32768;
  o.page_size = 16;
  o.kv_pages = 8192;
  o.state_slots = 64;
  Scheduler s(o);
  constexpr int64_t kLong = 20000;
  // Alone: 8,192 + 8,192 + 3,616 (no step has a decode until the prompt's last chunk has run).
  s.enqueue(make_seq(1, kLong, 4));
  std::vector<int64_t> alone;
  for (int step = 0; step < 3; ++step) {
    StepPlan q = s.plan_step();
    EXPECT_EQ(q.num_decodes, 0);
    alone.push_back(q.num_prefill_tokens);
    s.commit_step(q);
    fake_sample(q);
  }
  EXPECT_EQ(alone, (std::vector<int64_t>{8192, 8192, 3616}));
  // 16 short prompts join (one step), then decode beside sequence 1; a second long prompt arrives.
  for (uint64_t i = 10; i < 26; ++i) s.enqueue(make_seq(i, 8, 1000));
  StepPlan p = s.plan_step();
  ASSERT_EQ(p.num_decodes, 1);  // sequence 1
  s.commit_step(p);
  fake_sample(p);
  s.enqueue(make_seq(2, kLong, 4));
  const int steps = prefill_prompt(s, kLong, [](const StepPlan& q, int step) {
    EXPECT_GE(q.num_decodes, 16) << "step " << step;
    EXPECT_LE(q.num_decodes + q.num_prefill_tokens, 2048) << "step " << step;
  });
  EXPECT_GE(steps, 10);  // 20,000 tokens at most 2,048 - 17 a step
}

// Decodes that fill the whole budget still leave one page per step to the prompts (no starvation).
TEST(Scheduler, FullBatchOfDecodesStillPrefillsAPagePerStep) {
  SchedulerOptions o = small_options();
  o.max_running_requests = 12;
  o.max_queued_requests = 12;
  o.kv_pages = 64;
  o.state_slots = 12;
  o.chunked_prefill_size = 8;
  Scheduler s(o);
  for (uint64_t i = 1; i <= 10; ++i) s.enqueue(make_seq(i, 1, 40));
  StepPlan p = s.plan_step();  // ten 1-token prompts: 8 in the first step, 2 in the next
  s.commit_step(p);
  fake_sample(p);
  p = s.plan_step();
  s.commit_step(p);
  fake_sample(p);
  ASSERT_EQ(p.num_decodes, 8);
  s.enqueue(make_seq(50, 10, 2));
  std::vector<int64_t> prefill;
  for (int step = 0; step < 3; ++step) {
    StepPlan q = s.plan_step();
    EXPECT_EQ(q.num_decodes, 10);  // more than the budget: all of them all the same
    prefill.push_back(q.num_prefill_tokens);
    s.commit_step(q);
    fake_sample(q);
  }
  EXPECT_EQ(prefill, (std::vector<int64_t>{4, 4, 2}));  // a page (4 tokens) per step
}

TEST(Scheduler, PrefillBudgetSharedOldestFirst) {
  Scheduler s(small_options());
  s.enqueue(make_seq(1, 5, 1));
  s.enqueue(make_seq(2, 5, 1));
  s.enqueue(make_seq(3, 5, 1));
  StepPlan p = s.plan_step();
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(p.chunks[0].seq->uid, 1u);
  EXPECT_EQ(p.chunks[0].num_tokens, 5);
  EXPECT_TRUE(p.chunks[0].want_logits);
  EXPECT_EQ(p.chunks[1].seq->uid, 2u);
  EXPECT_EQ(p.chunks[1].num_tokens, 3);
  EXPECT_FALSE(p.chunks[1].want_logits);
  EXPECT_EQ(p.num_prefill_tokens, 8);
}

TEST(Scheduler, MaxRunningAndQueueBound) {
  SchedulerOptions o = small_options();
  o.max_running_requests = 2;
  o.max_queued_requests = 3;
  Scheduler s(o);
  EXPECT_TRUE(s.queue_has_room(3));
  EXPECT_FALSE(s.queue_has_room(4));
  for (uint64_t i = 1; i <= 3; ++i) s.enqueue(make_seq(i, 2, 2));
  EXPECT_FALSE(s.queue_has_room(1));
  StepPlan p = s.plan_step();
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.num_waiting(), 1);
  EXPECT_TRUE(s.queue_has_room(2));
  s.commit_step(p);
  fake_sample(p);
  s.release(p.chunks[0].seq);
  s.plan_step();
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.num_waiting(), 0);
}

TEST(Scheduler, PagesAreAllocatedAsSequencesGrow) {
  SchedulerOptions o = small_options();
  Scheduler s(o);
  s.enqueue(make_seq(1, 6, 14));  // needs 5 pages at its longest, holds 2 after its prompt
  StepPlan p = s.plan_step();
  EXPECT_EQ(s.kv_pages_used(), 2);
  Sequence* q = p.chunks[0].seq;
  s.commit_step(p);
  fake_sample(p);  // 7 tokens, 6 cached
  std::vector<int64_t> pages_at;
  for (int i = 0; i < 6; ++i) {
    StepPlan d = s.plan_step();  // decodes positions 6..11
    pages_at.push_back(static_cast<int64_t>(q->pages.size()));
    s.commit_step(d);
    fake_sample(d);
  }
  // Position 6, 7 fit page 1; 8..11 need page 2.
  EXPECT_EQ(pages_at, (std::vector<int64_t>{2, 2, 3, 3, 3, 3}));
  s.release(q);
  EXPECT_EQ(s.kv_pages_used(), 0);
}

TEST(Scheduler, AdmitsInOrderWhilePagesLast) {
  SchedulerOptions o = small_options();
  o.kv_pages = 4;
  Scheduler s(o);
  s.enqueue(make_seq(1, 10, 2));   // its first chunk (8 tokens): 2 pages
  s.enqueue(make_seq(2, 10, 2));   // 2 more + 1 of headroom for seq 1: does not fit beside it
  s.enqueue(make_seq(3, 2, 2));    // 1 page: would fit, but may not overtake seq 2
  StepPlan p = s.plan_step();
  EXPECT_EQ(s.num_running(), 1);
  EXPECT_EQ(s.kv_pages_used(), 2);  // a chunk of 8 prompt tokens: 2 pages so far
  EXPECT_EQ(s.num_waiting(), 2);
  Sequence* first = p.chunks[0].seq;
  s.commit_step(p);
  s.release(first);
  EXPECT_EQ(s.kv_pages_used(), 0);
  s.plan_step();
  EXPECT_EQ(s.num_running(), 2);  // seq 2 and seq 3
}

TEST(Scheduler, PreemptsTheNewestAndRecomputesItsTokens) {
  SchedulerOptions o = small_options();
  o.kv_pages = 5;  // 20 tokens
  o.chunked_prefill_size = 16;
  Scheduler s(o);
  s.enqueue(make_seq(1, 6, 9));
  s.enqueue(make_seq(2, 6, 9));
  StepPlan p = s.plan_step();  // both prompts: 2 pages each (+ 1 of headroom), 1 page left
  ASSERT_EQ(p.chunks.size(), 2u);
  Sequence* a = p.chunks[0].seq;
  Sequence* b = p.chunks[1].seq;
  s.commit_step(p);
  fake_sample(p);
  for (int i = 0; i < 2; ++i) {  // positions 6, 7: no page needed
    StepPlan d = s.plan_step();
    EXPECT_EQ(d.num_decodes, 2);
    s.commit_step(d);
    fake_sample(d);
  }
  // Position 8 needs a third page for each: seq 1 takes the last one, seq 2 (the newest) is preempted.
  StepPlan d = s.plan_step();
  ASSERT_EQ(d.chunks.size(), 1u);
  EXPECT_EQ(d.chunks[0].seq, a);
  EXPECT_EQ(s.counters().preemptions, 1u);
  EXPECT_EQ(s.num_running(), 1);
  EXPECT_EQ(s.num_waiting(), 1);
  EXPECT_EQ(b->pages.size(), 0u);
  EXPECT_EQ(b->state_slot, -1);
  EXPECT_EQ(b->num_cached, 0);
  EXPECT_EQ(b->num_generated, 3);  // what it generated stays
  EXPECT_EQ(b->tokens.size(), 9u);
  EXPECT_EQ(b->prefill_target, 9);  // recompute all 9 tokens, then go on from the logits of the last
  s.commit_step(d);
  fake_sample(d);
  while (a->num_generated < 9) {
    StepPlan e = s.plan_step();
    for (auto& c : e.chunks) EXPECT_EQ(c.seq, a) << "seq 2 waits while seq 1 holds the pool";
    s.commit_step(e);
    fake_sample(e);
  }
  s.release(a);
  StepPlan r = s.plan_step();
  ASSERT_EQ(r.chunks.size(), 1u);
  EXPECT_EQ(r.chunks[0].seq, b);
  EXPECT_EQ(r.chunks[0].start_pos, 0);
  EXPECT_EQ(r.chunks[0].num_tokens, 9);
  EXPECT_TRUE(r.chunks[0].want_logits);
  s.commit_step(r);
  fake_sample(r);
  EXPECT_EQ(b->num_generated, 4);
  EXPECT_FALSE(b->prefilling());
  s.release(b);
  EXPECT_EQ(s.kv_pages_used(), 0);
  EXPECT_EQ(s.state_slots_used(), 0);
}

TEST(Scheduler, PrefillingSequencesThatFillThePoolDoNotDeadlock) {
  SchedulerOptions o = small_options();
  o.kv_pages = 8;  // 32 tokens
  o.chunked_prefill_size = 8;
  Scheduler s(o);
  s.enqueue(make_seq(1, 28, 2));
  StepPlan p = s.plan_step();  // seq 1: 8 tokens
  s.commit_step(p);
  s.enqueue(make_seq(2, 28, 2));
  int steps = 0;
  std::vector<Sequence*> done;
  while (!s.idle() && steps < 200) {
    StepPlan q = s.plan_step();
    ASSERT_FALSE(q.empty()) << "step " << steps;
    s.commit_step(q);
    fake_sample(q);
    for (auto& c : q.chunks)
      if (c.want_logits && c.seq->num_generated >= 2) done.push_back(c.seq);
    for (Sequence* d : done) s.release(d);
    done.clear();
    ++steps;
  }
  EXPECT_TRUE(s.idle());
  EXPECT_EQ(s.kv_pages_used(), 0);
}

TEST(Scheduler, StateSlotsLimitAdmission) {
  SchedulerOptions o = small_options();
  o.state_slots = 1;
  Scheduler s(o);
  s.enqueue(make_seq(1, 2, 2));
  s.enqueue(make_seq(2, 2, 2));
  StepPlan p = s.plan_step();
  EXPECT_EQ(s.num_running(), 1);
  EXPECT_EQ(s.state_slots_used(), 1);
  EXPECT_EQ(p.chunks[0].seq->state_slot, 0);
}

TEST(Scheduler, DistinctPagesAndSlots) {
  SchedulerOptions o = small_options();
  o.chunked_prefill_size = 0;
  Scheduler s(o);
  for (uint64_t i = 1; i <= 4; ++i) s.enqueue(make_seq(i, 6, 6));  // 2 pages each for the prompt
  StepPlan p = s.plan_step();
  std::vector<int> seen_pages(16, 0), seen_slots(4, 0);
  s.for_each_sequence([&](Sequence& q) {
    EXPECT_EQ(q.pages.size(), 2u);
    for (int32_t pg : q.pages) ++seen_pages.at(pg);
    ++seen_slots.at(q.state_slot);
  });
  for (int c : seen_pages) EXPECT_LE(c, 1);
  for (int c : seen_slots) EXPECT_EQ(c, 1);
  EXPECT_EQ(s.kv_pages_used(), 8);
}

TEST(Scheduler, AbortFreesEverything) {
  SchedulerOptions o = small_options();
  o.chunked_prefill_size = 0;
  Scheduler s(o);
  s.enqueue(make_seq(1, 6, 6));
  s.enqueue(make_seq(2, 6, 6));
  s.enqueue(make_seq(3, 6, 6));
  s.plan_step();
  EXPECT_GT(s.kv_pages_used(), 0);
  s.for_each_sequence([](Sequence& q) { q.abort_requested = q.uid != 2; });
  auto aborted = s.take_aborted();
  EXPECT_EQ(aborted.size(), 2u);
  for (auto& a : aborted) {
    EXPECT_TRUE(a->pages.empty());
    EXPECT_EQ(a->state_slot, -1);
  }
  EXPECT_EQ(s.num_running(), 1);
  EXPECT_EQ(s.kv_pages_used(), 2);
  EXPECT_EQ(s.state_slots_used(), 1);
  auto rest = s.release_all();
  EXPECT_EQ(rest.size(), 1u);
  EXPECT_EQ(s.kv_pages_used(), 0);
  EXPECT_EQ(s.state_slots_used(), 0);
  EXPECT_TRUE(s.idle());
}

TEST(Scheduler, AbortWhileWaiting) {
  SchedulerOptions o = small_options();
  o.max_running_requests = 1;
  Scheduler s(o);
  s.enqueue(make_seq(1, 2, 2));
  s.enqueue(make_seq(2, 2, 2));
  s.plan_step();
  s.for_each_sequence([](Sequence& q) { q.abort_requested = q.uid == 2; });
  auto aborted = s.take_aborted();
  ASSERT_EQ(aborted.size(), 1u);
  EXPECT_EQ(aborted[0]->uid, 2u);
  EXPECT_EQ(s.num_waiting(), 0);
  EXPECT_EQ(s.num_running(), 1);
}

TEST(Scheduler, WholePromptWhenChunkingOff) {
  SchedulerOptions o = small_options();
  o.chunked_prefill_size = 0;
  Scheduler s(o);
  s.enqueue(make_seq(1, 50, 5));
  StepPlan p = s.plan_step();
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].num_tokens, 50);
  EXPECT_TRUE(p.chunks[0].want_logits);
}

// ---- the scheduler with the prefix cache

SchedulerOptions cache_options() {
  SchedulerOptions o = small_options();
  o.max_queued_requests = 64;
  o.chunked_prefill_size = 64;
  o.context_length = 128;
  o.kv_pages = 64;
  o.state_slots = 12;
  o.prefix_cache = true;
  return o;
}

// Runs one sequence to the end (tokens appended: 7), returns the plans' restores and saves seen.
void run_to_end(Scheduler& s, std::vector<StateCopy>* restores, std::vector<StateCopy>* saves) {
  while (!s.idle()) {
    StepPlan p = s.plan_step();
    if (restores) restores->insert(restores->end(), p.restores.begin(), p.restores.end());
    if (saves) saves->insert(saves->end(), p.saves.begin(), p.saves.end());
    s.commit_step(p);
    fake_sample(p);
    std::vector<Sequence*> done;
    for (auto& c : p.chunks)
      if (c.want_logits && c.seq->num_generated >= c.seq->request.max_tokens) done.push_back(c.seq);
    for (Sequence* d : done) s.release(d);
  }
}

TEST(SchedulerCache, SecondTurnSharesPagesAndRestoresTheSnapshot) {
  Scheduler s(cache_options());
  std::vector<int32_t> prompt(10);
  std::iota(prompt.begin(), prompt.end(), 1);
  s.enqueue(make_seq(1, prompt, 3));
  // The 10-token prompt's chunks stop at its second-to-last page boundary (4) and at its last (8) so that the
  // state there is saved, then the last 2 tokens give the logits.
  StepPlan p = s.plan_step();
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].num_tokens, 4);
  EXPECT_FALSE(p.chunks[0].want_logits);
  ASSERT_EQ(p.saves.size(), 1u);
  Sequence* q = p.chunks[0].seq;
  const std::vector<int32_t> first_pages(q->pages.begin(), q->pages.begin() + 1);
  s.commit_step(p);
  p = s.plan_step();
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].start_pos, 4);
  EXPECT_EQ(p.chunks[0].num_tokens, 4);
  EXPECT_FALSE(p.chunks[0].want_logits);
  ASSERT_EQ(p.saves.size(), 1u);
  s.commit_step(p);
  p = s.plan_step();
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].num_tokens, 2);
  EXPECT_TRUE(p.chunks[0].want_logits);
  EXPECT_TRUE(p.saves.empty());
  s.commit_step(p);
  q->tokens.push_back(7);
  ++q->num_generated;
  std::vector<StateCopy> saves;
  // 10 + 3 tokens: 12 cached at the end; the snapshot at 12 replaces the one at 8, the one at 4 (a page or more
  // before the prompt's end) stays.
  run_to_end(s, nullptr, &saves);
  ASSERT_EQ(saves.size(), 1u);
  EXPECT_EQ(s.kv_pages_used(), 0);
  EXPECT_EQ(s.state_slots_used(), 0);
  EXPECT_EQ(s.prefix_cache()->num_pages(), 3);
  EXPECT_EQ(s.prefix_cache()->num_snapshots(), 2);

  // Turn 2: the history (13 tokens) + 5 new ones.
  std::vector<int32_t> turn2 = prompt;
  turn2.insert(turn2.end(), {7, 7, 7, 50, 51, 52, 53, 54});
  s.enqueue(make_seq(2, turn2, 2));
  StepPlan t = s.plan_step();
  ASSERT_EQ(t.chunks.size(), 1u);
  Sequence* r = t.chunks[0].seq;
  EXPECT_EQ(r->cached_tokens, 12);
  EXPECT_EQ(t.chunks[0].start_pos, 12);
  ASSERT_EQ(t.restores.size(), 1u);
  EXPECT_EQ(t.restores[0].dst, r->state_slot);
  EXPECT_NE(t.restores[0].src, r->state_slot);
  EXPECT_EQ(std::vector<int32_t>(r->pages.begin(), r->pages.begin() + 1), first_pages);  // shared, not copied
  EXPECT_EQ(s.kv_pages_used(), 4);  // 3 shared + 1 own for positions 12..15 (the 18-token prompt stops at 16)
  s.commit_step(t);
  run_to_end(s, nullptr, nullptr);
  EXPECT_EQ(s.counters().cache_hit_tokens, 12u);
  EXPECT_EQ(s.kv_pages_used(), 0);
  EXPECT_EQ(s.state_slots_used(), 0);
}

// With a runner that writes snapshots inside a chunk, the same prompt runs in one step: the snapshots at its
// second-to-last (4) and last (8) page boundaries ride in the chunk (no state copies after the step), and the cache
// ends up as with the cut chunks above: turn 2 restores the snapshot at 12.
TEST(SchedulerCache, ChunkSnapshotsSaveThePromptsBoundariesInOneStep) {
  SchedulerOptions o = cache_options();
  o.chunk_snapshots = true;
  Scheduler s(o);
  std::vector<int32_t> prompt(10);
  std::iota(prompt.begin(), prompt.end(), 1);
  s.enqueue(make_seq(1, prompt, 3));
  StepPlan p = s.plan_step();
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].start_pos, 0);
  EXPECT_EQ(p.chunks[0].num_tokens, 10);
  EXPECT_TRUE(p.chunks[0].want_logits);
  EXPECT_TRUE(p.saves.empty());
  Sequence* q = p.chunks[0].seq;
  ASSERT_EQ(p.chunks[0].snapshots.size(), 2u);
  EXPECT_EQ(p.chunks[0].snapshots[0].tokens, 4);
  EXPECT_EQ(p.chunks[0].snapshots[1].tokens, 8);
  const int a = p.chunks[0].snapshots[0].slot, b = p.chunks[0].snapshots[1].slot;
  EXPECT_GE(a, 0);
  EXPECT_GE(b, 0);
  EXPECT_NE(a, b);
  EXPECT_NE(a, q->state_slot);
  EXPECT_NE(b, q->state_slot);
  EXPECT_EQ(s.state_slots_used(), 3);  // its own + the two snapshots
  s.commit_step(p);
  q->tokens.push_back(7);
  ++q->num_generated;
  std::vector<StateCopy> saves;
  run_to_end(s, nullptr, &saves);
  ASSERT_EQ(saves.size(), 1u);  // the decode's boundary at 12 (a copy after its step), replacing the one at 8
  EXPECT_EQ(saves[0].dst, b);
  EXPECT_EQ(s.prefix_cache()->num_pages(), 3);
  EXPECT_EQ(s.prefix_cache()->num_snapshots(), 2);

  std::vector<int32_t> turn2 = prompt;
  turn2.insert(turn2.end(), {7, 7, 7, 50, 51, 52, 53, 54});
  s.enqueue(make_seq(2, turn2, 2));
  StepPlan t = s.plan_step();
  ASSERT_EQ(t.chunks.size(), 1u);
  Sequence* r = t.chunks[0].seq;
  EXPECT_EQ(r->cached_tokens, 12);
  ASSERT_EQ(t.restores.size(), 1u);
  EXPECT_EQ(t.restores[0].src, b);
  // 18 tokens: the second-to-last boundary (12) is where it starts; the last (16) rides in its one chunk.
  EXPECT_EQ(t.chunks[0].num_tokens, 6);
  ASSERT_EQ(t.chunks[0].snapshots.size(), 1u);
  EXPECT_EQ(t.chunks[0].snapshots[0].tokens, 4);
  EXPECT_TRUE(t.chunks[0].want_logits);
  s.commit_step(t);
  fake_sample(t);
  run_to_end(s, nullptr, nullptr);
  EXPECT_EQ(s.counters().cache_hit_tokens, 12u);
  EXPECT_EQ(s.kv_pages_used(), 0);
  EXPECT_EQ(s.state_slots_used(), 0);
}

TEST(SchedulerCache, MemoryPressureEvictsTheCacheBeforePreempting) {
  SchedulerOptions o = cache_options();
  o.kv_pages = 8;  // 32 tokens
  Scheduler s(o);
  std::vector<int32_t> a(16, 3), b(16, 4);
  s.enqueue(make_seq(1, a, 1));
  run_to_end(s, nullptr, nullptr);
  EXPECT_EQ(s.prefix_cache()->num_pages(), 4);  // the 16-token prompt, snapshot at 16
  s.enqueue(make_seq(2, b, 12));  // 16 + 12 = 28 tokens: 7 pages, needs the cache's
  run_to_end(s, nullptr, nullptr);
  EXPECT_EQ(s.counters().preemptions, 0u);
  EXPECT_GT(s.prefix_cache()->counters().evicted_pages, 0u);
  EXPECT_EQ(s.kv_pages_used(), 0);
  EXPECT_EQ(s.kv_pages_free() + s.prefix_cache()->num_pages(), 8);
}


// Speculative decoding: a decode takes pages for its verify positions from free pages only (never preempting), counts
// 1 + lookahead tokens in the step's budget, and commit_accepted moves its computed count past the accepted drafts.
TEST(Scheduler, DecodeLookaheadTakesFreePagesAndAcceptedTokensCount) {
  SchedulerOptions o = small_options();
  o.decode_lookahead = 3;
  o.kv_pages = 8;
  o.chunked_prefill_size = 16;
  Scheduler s(o);
  s.enqueue(make_seq(1, 4, 20));  // one page of prompt
  StepPlan p = s.plan_step();
  ASSERT_EQ(p.chunks.size(), 1u);
  s.commit_step(p);
  fake_sample(p);
  Sequence* seq = p.chunks[0].seq;
  // Decode at position 4: positions 4 .. 7 (the token and 3 drafts) fit in page 2.
  p = s.plan_step();
  ASSERT_EQ(p.num_decodes, 1);
  EXPECT_EQ(seq->pages.size(), 2u);
  s.commit_step(p);
  s.commit_accepted(seq, 2);                          // before the engine appends the tokens, as it does
  seq->tokens.insert(seq->tokens.end(), {8, 9, 10});  // 2 accepted drafts + the target's token
  EXPECT_EQ(seq->num_cached, 7);
  EXPECT_EQ(seq->num_cached + 1, static_cast<int64_t>(seq->tokens.size()));
  // Decode at position 7: its verify reaches position 10, page 3.
  p = s.plan_step();
  EXPECT_EQ(seq->pages.size(), 3u);
  s.commit_step(p);
  fake_sample(p);
  // A second sequence's prompt: the budget left is 16 - 1 x (1 + 3) = 12 tokens.
  s.enqueue(make_seq(2, 20, 4));
  p = s.plan_step();
  EXPECT_EQ(p.num_decodes, 1);
  EXPECT_EQ(p.num_prefill_tokens, 12);

  // No free page: a decode runs with the page for its token alone, and nobody is preempted for the lookahead.
  SchedulerOptions tight = small_options();
  tight.decode_lookahead = 3;
  tight.kv_pages = 2;
  Scheduler t(tight);
  t.enqueue(make_seq(1, 7, 4));  // positions 0 .. 6 and the decode at 7: two pages, none to spare
  p = t.plan_step();
  t.commit_step(p);
  fake_sample(p);
  p = t.plan_step();
  ASSERT_EQ(p.num_decodes, 1);
  EXPECT_EQ(p.chunks[0].seq->pages.size(), 2u);
  EXPECT_EQ(t.kv_pages_free(), 0);
  EXPECT_EQ(t.counters().preemptions, 0u);
}

}  // namespace
}  // namespace kiln::engine
