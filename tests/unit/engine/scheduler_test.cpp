// Scheduler policy: admission, capacity accounting, chunked prefill, cancellation.
#include "engine/scheduler.h"

#include <gtest/gtest.h>

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

std::unique_ptr<Sequence> make_seq(uint64_t uid, int64_t prompt_len, int64_t max_tokens) {
  auto s = std::make_unique<Sequence>();
  s->uid = uid;
  s->tokens.resize(static_cast<size_t>(prompt_len));
  std::iota(s->tokens.begin(), s->tokens.end(), 1);
  s->prompt_len = prompt_len;
  s->request.max_tokens = max_tokens;
  return s;
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

TEST(Scheduler, PagesCoverPromptPlusMaxTokensCappedAtContext) {
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
  for (int step = 0; step < 4; ++step) {
    StepPlan q = s.plan_step();
    // Every step: seq 1's decode token first, then at most 8 prompt tokens of seq 2.
    ASSERT_GE(q.chunks.size(), 1u);
    EXPECT_EQ(q.chunks[0].seq->uid, 1u);
    EXPECT_EQ(q.num_decodes, 1);
    EXPECT_LE(q.num_prefill_tokens, 8);
    s.commit_step(q);
    fake_sample(q);
  }
  // 30 prompt tokens = 8 + 8 + 8 + 6: seq 2 decodes from now on.
  StepPlan q = s.plan_step();
  EXPECT_EQ(q.num_decodes, 2);
  EXPECT_EQ(q.num_prefill_tokens, 0);
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

TEST(Scheduler, WaitsForPagesAndAdmitsInOrder) {
  SchedulerOptions o = small_options();
  o.kv_pages = 10;  // 40 tokens
  Scheduler s(o);
  s.enqueue(make_seq(1, 10, 14));  // 6 pages
  s.enqueue(make_seq(2, 10, 10));  // 5 pages: does not fit beside seq 1
  s.enqueue(make_seq(3, 2, 2));    // 1 page: would fit, but may not overtake seq 2
  StepPlan p = s.plan_step();
  EXPECT_EQ(s.num_running(), 1);
  EXPECT_EQ(s.kv_pages_used(), 6);
  EXPECT_EQ(s.num_waiting(), 2);
  Sequence* first = p.chunks[0].seq;
  s.commit_step(p);
  fake_sample(p);
  s.release(first);
  EXPECT_EQ(s.kv_pages_used(), 0);
  s.plan_step();
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.kv_pages_used(), 6);
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
  Scheduler s(small_options());
  for (uint64_t i = 1; i <= 4; ++i) s.enqueue(make_seq(i, 6, 6));  // 3 pages each
  StepPlan p = s.plan_step();
  std::vector<int> seen_pages(16, 0), seen_slots(4, 0);
  s.for_each_sequence([&](Sequence& q) {
    EXPECT_EQ(q.pages.size(), 3u);
    for (int32_t pg : q.pages) ++seen_pages.at(pg);
    ++seen_slots.at(q.state_slot);
  });
  for (int c : seen_pages) EXPECT_LE(c, 1);
  for (int c : seen_slots) EXPECT_EQ(c, 1);
  EXPECT_EQ(s.kv_pages_used(), 12);
}

TEST(Scheduler, AbortFreesEverything) {
  Scheduler s(small_options());
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
  EXPECT_EQ(s.kv_pages_used(), 3);
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

TEST(IdPool, AllOrNothingAndDoubleFreeIsABug) {
  IdPool pool(3);
  std::vector<int32_t> a;
  EXPECT_FALSE(pool.allocate(4, a));
  EXPECT_TRUE(a.empty());
  EXPECT_TRUE(pool.allocate(2, a));
  EXPECT_EQ(pool.num_free(), 1);
  pool.free(a);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_THROW(pool.free(a), std::exception);
}

}  // namespace
}  // namespace kiln::engine
