// The prefix cache's radix tree alone: matches stop at snapshots, refcounts and locks, eviction order (LRU, leaves
// without snapshots first), and no page or slot lost or handed back twice under random operations. The scheduler with
// the cache is in scheduler_test.cpp, the engine with it in engine_test.cpp.
#include "engine/prefix_cache.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

namespace kiln::engine {
namespace {

std::vector<int32_t> seq_tokens(std::initializer_list<int32_t> pages_first_token, int page) {
  std::vector<int32_t> t;
  for (int32_t f : pages_first_token)
    for (int i = 0; i < page; ++i) t.push_back(f + i);
  return t;
}

TEST(PrefixCache, MatchStopsAtTheDeepestSnapshot) {
  PrefixCache c(4, /*needs_state=*/true);
  std::vector<int32_t> freed_p, freed_s;
  auto t = seq_tokens({10, 20, 30}, 4);  // 3 pages
  c.insert(t, std::vector<int32_t>{7, 8, 9}, /*snapshot_slot=*/5, freed_p, freed_s);
  EXPECT_TRUE(freed_p.empty());
  EXPECT_TRUE(freed_s.empty());
  EXPECT_EQ(c.num_pages(), 3);
  EXPECT_EQ(c.num_snapshots(), 1);
  c.check_invariants();

  // The whole 3 pages, snapshot 5.
  auto m = c.match(t, 100);
  EXPECT_EQ(m.tokens, 12);
  EXPECT_EQ(m.snapshot_slot, 5);
  ASSERT_EQ(m.path.size(), 3u);
  EXPECT_EQ(m.path[0]->page, 7);
  EXPECT_EQ(m.path[2]->page, 9);
  // max_tokens cuts at 11: only 2 full pages, and no snapshot there: no match at all.
  m = c.match(t, 11);
  EXPECT_EQ(m.tokens, 0);
  EXPECT_EQ(m.snapshot_slot, -1);
  // Diverging in page 3: nothing (no snapshot at page 2).
  auto u = seq_tokens({10, 20, 99}, 4);
  EXPECT_EQ(c.match(u, 100).tokens, 0);
  // Without state, KV pages alone count.
  PrefixCache kv(4, /*needs_state=*/false);
  kv.insert(t, std::vector<int32_t>{1, 2, 3}, -1, freed_p, freed_s);
  EXPECT_EQ(kv.match(u, 100).tokens, 8);
  EXPECT_EQ(kv.match(t, 11).tokens, 8);
}

TEST(PrefixCache, InsertReturnsDuplicatesAndKeepsTheTreesOwn) {
  PrefixCache c(2, true);
  std::vector<int32_t> fp, fs;
  auto a = seq_tokens({1, 3, 5}, 2);
  c.insert(a, std::vector<int32_t>{10, 11, 12}, 0, fp, fs);
  // Same first two pages computed by another sequence into its own pages 20, 21, then a new page 22.
  auto b = seq_tokens({1, 3, 7}, 2);
  c.insert(b, std::vector<int32_t>{20, 21, 22}, 1, fp, fs);
  EXPECT_EQ(fp, (std::vector<int32_t>{20, 21}));
  EXPECT_TRUE(fs.empty());
  EXPECT_EQ(c.num_pages(), 4);
  fp.clear();
  // A sequence that matched a's pages hands them back with one more: only the new one is taken.
  auto m = c.match(a, 100);
  ASSERT_EQ(m.tokens, 6);
  c.lock(m.path);
  auto a2 = seq_tokens({1, 3, 5, 9}, 2);
  c.insert(a2, std::vector<int32_t>{10, 11, 12, 13}, 2, fp, fs);
  c.unlock(m.path);
  EXPECT_TRUE(fp.empty());
  EXPECT_EQ(c.num_pages(), 5);
  // The same snapshot position twice: the second slot comes back.
  c.insert(a2, std::vector<int32_t>{10, 11, 12, 13}, 3, fp, fs);
  EXPECT_EQ(fs, (std::vector<int32_t>{3}));
  c.check_invariants();
}

TEST(PrefixCache, LockedPagesAreNeverEvictedAndLruOrderHolds) {
  PrefixCache c(1, true);
  std::vector<int32_t> fp, fs;
  // Three branches from one root page: [1,2] [1,3] [1,4], snapshots at each leaf; inserted in that order.
  c.insert(std::vector<int32_t>{1, 2}, std::vector<int32_t>{100, 101}, 0, fp, fs);
  c.insert(std::vector<int32_t>{1, 3}, std::vector<int32_t>{100, 102}, 1, fp, fs);
  c.insert(std::vector<int32_t>{1, 4}, std::vector<int32_t>{100, 103}, 2, fp, fs);
  ASSERT_TRUE(fp.empty());
  // Use [1,2] again: now [1,3] is the least recently used; lock [1,4].
  ASSERT_EQ(c.match(std::vector<int32_t>{1, 2, 9}, 3).tokens, 2);
  auto held = c.match(std::vector<int32_t>{1, 4, 9}, 3);
  c.lock(held.path);
  EXPECT_EQ(c.evictable_pages(), 2);  // 101, 102 (100 and 103 are locked)
  EXPECT_EQ(c.evict_pages(1, fp, fs), 1);
  EXPECT_EQ(fp, (std::vector<int32_t>{102}));
  EXPECT_EQ(fs, (std::vector<int32_t>{1}));
  EXPECT_EQ(c.evict_pages(10, fp, fs), 1);  // only 101 is left to evict
  EXPECT_EQ(fp, (std::vector<int32_t>{102, 101}));
  EXPECT_EQ(c.num_pages(), 2);
  c.check_invariants();
  // A locked node's snapshot may go (the holder copied it at admission), its page not.
  EXPECT_EQ(c.evict_snapshots(5, fs), 1);
  EXPECT_EQ(fs, (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(c.evict_pages(10, fp, fs), 0);
  c.unlock(held.path);
  EXPECT_EQ(c.evict_pages(10, fp, fs), 2);
  EXPECT_EQ(c.num_pages(), 0);
  EXPECT_EQ(fp, (std::vector<int32_t>{102, 101, 103, 100}));
}

TEST(PrefixCache, LeavesWithoutSnapshotsGoFirst) {
  PrefixCache c(1, true);
  std::vector<int32_t> fp, fs;
  c.insert(std::vector<int32_t>{5}, std::vector<int32_t>{50}, 0, fp, fs);           // older, with a snapshot
  c.insert(std::vector<int32_t>{6, 7}, std::vector<int32_t>{60, 70}, -1, fp, fs);  // newer, none
  c.evict_pages(1, fp, fs);
  EXPECT_EQ(fp, (std::vector<int32_t>{70}));
  EXPECT_TRUE(fs.empty());
}

// Random inserts, matches, locks and evictions against a plain model of which pages and slots the tree holds:
// every page and slot handed in comes back exactly once, none is lost, none twice.
TEST(PrefixCache, RandomOperationsLeakNothing) {
  for (int seed = 0; seed < 20; ++seed) {
    std::mt19937 rng(seed);
    const int P = 1 + seed % 3;
    PrefixCache c(P, seed % 2 == 0);
    int32_t next_page = 0, next_slot = 0;
    std::multiset<int32_t> given_pages, given_slots, back_pages, back_slots;
    std::vector<std::vector<PrefixCache::Node*>> locks;
    for (int op = 0; op < 400; ++op) {
      const int kind = static_cast<int>(rng() % 10);
      std::vector<int32_t> fp, fs;
      if (kind < 5) {
        const int pages = 1 + static_cast<int>(rng() % 5);
        std::vector<int32_t> toks;
        for (int i = 0; i < pages * P; ++i) toks.push_back(static_cast<int32_t>(rng() % 3));  // many shared prefixes
        auto m = c.match(toks, static_cast<int64_t>(toks.size()));
        std::vector<int32_t> ids;
        for (auto* n : m.path) ids.push_back(n->page);
        while (static_cast<int>(ids.size()) < pages) {
          ids.push_back(next_page);
          given_pages.insert(next_page++);
        }
        int slot = -1;
        if (rng() % 2) {
          slot = next_slot++;
          given_slots.insert(slot);
        }
        c.insert(toks, ids, slot, fp, fs);
      } else if (kind < 7) {
        std::vector<int32_t> toks;
        for (int i = 0; i < 4 * P; ++i) toks.push_back(static_cast<int32_t>(rng() % 3));
        auto m = c.match(toks, static_cast<int64_t>(toks.size()));
        c.lock(m.path);
        locks.push_back(m.path);
      } else if (kind < 8 && !locks.empty()) {
        c.unlock(locks.back());
        locks.pop_back();
      } else if (kind < 9) {
        c.evict_pages(1 + rng() % 3, fp, fs);
      } else {
        c.evict_snapshots(1 + rng() % 2, fs);
      }
      back_pages.insert(fp.begin(), fp.end());
      back_slots.insert(fs.begin(), fs.end());
      c.check_invariants();
    }
    for (auto& l : locks) c.unlock(l);
    std::vector<int32_t> fp, fs;
    c.clear(fp, fs);
    back_pages.insert(fp.begin(), fp.end());
    back_slots.insert(fs.begin(), fs.end());
    EXPECT_EQ(back_pages, given_pages) << "seed " << seed;
    EXPECT_EQ(back_slots, given_slots) << "seed " << seed;
    EXPECT_EQ(c.num_pages(), 0);
    EXPECT_EQ(c.num_snapshots(), 0);
  }
}

}  // namespace
}  // namespace kiln::engine
