// ThreadPool: every index visited exactly once for many sizes/grains/pool sizes; sums; exceptions
// propagate to the caller and leave the pool usable.
#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

namespace kiln {
namespace {

TEST(ThreadPool, VisitsEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {1, 2, 7, 64, 1000, 100003}) {
      for (int64_t grain : {0, 1, 5, 1000, 1000000}) {
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int64_t> calls{0};
        pool.parallel_for(n, [&](int64_t b, int64_t e) {
          ASSERT_LE(0, b);
          ASSERT_LT(b, e);
          ASSERT_LE(e, n);
          calls++;
          for (int64_t i = b; i < e; ++i) hits[i]++;
        }, grain);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " grain " << grain << " i " << i;
        if (grain >= n) EXPECT_EQ(calls.load(), 1);
      }
    }
  }
}

TEST(ThreadPool, ParallelSumMatchesSerial) {
  ThreadPool pool(4);
  std::vector<int64_t> v(1 << 20);
  std::iota(v.begin(), v.end(), -1000);
  const int64_t serial = std::accumulate(v.begin(), v.end(), int64_t{0});
  for (int rep = 0; rep < 50; ++rep) {
    std::atomic<int64_t> total{0};
    pool.parallel_for(static_cast<int64_t>(v.size()), [&](int64_t b, int64_t e) {
      int64_t s = 0;
      for (int64_t i = b; i < e; ++i) s += v[i];
      total += s;
    }, 1 + rep * 997);
    ASSERT_EQ(total.load(), serial);
  }
}

TEST(ThreadPool, UsesSeveralThreads) {
  ThreadPool pool(4);
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::atomic<int> arrived{0};
  pool.parallel_for(4, [&](int64_t, int64_t) {
    {
      std::lock_guard lock(mu);
      ids.insert(std::this_thread::get_id());
    }
    // Hold each chunk until all four have started (bounded wait, so a serial pool still finishes).
    arrived++;
    for (int spin = 0; spin < 2000 && arrived.load() < 4; ++spin) std::this_thread::sleep_for(std::chrono::microseconds(100));
  });
  EXPECT_GT(ids.size(), 1u);
}

TEST(ThreadPool, ZeroOrNegativeSizeDoesNothing) {
  ThreadPool pool(2);
  int calls = 0;
  pool.parallel_for(0, [&](int64_t, int64_t) { calls++; });
  pool.parallel_for(-5, [&](int64_t, int64_t) { calls++; });
  EXPECT_EQ(calls, 0);
}

TEST(ThreadPool, ExceptionsPropagateAndPoolStaysUsable) {
  for (int threads : {1, 4}) {
    ThreadPool pool(threads);
    for (int rep = 0; rep < 20; ++rep) {
      std::atomic<int64_t> done{0};
      EXPECT_THROW(pool.parallel_for(1000, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          if (i == 517) throw std::runtime_error("bad index 517");
          done++;
        }
      }, 10), std::runtime_error);
      try {
        pool.parallel_for(100, [&](int64_t b, int64_t) {
          if (b == 0) throw std::invalid_argument("first chunk");
        }, 10);
        FAIL() << "no exception";
      } catch (const std::invalid_argument& e) {
        EXPECT_STREQ(e.what(), "first chunk");
      }
      std::atomic<int64_t> sum{0};
      pool.parallel_for(1000, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) sum += i;
      });
      ASSERT_EQ(sum.load(), 999 * 1000 / 2);
    }
  }
}

TEST(ThreadPool, ConcurrentCallersAreSerialised) {
  ThreadPool pool(3);
  std::vector<std::thread> callers;
  std::atomic<int64_t> total{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int rep = 0; rep < 50; ++rep)
        pool.parallel_for(100, [&](int64_t b, int64_t e) { total += e - b; }, 7);
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 50 * 100);
}

TEST(ThreadPool, GlobalPoolWorks) {
  std::atomic<int64_t> n{0};
  ThreadPool::global().parallel_for(12345, [&](int64_t b, int64_t e) { n += e - b; }, 100);
  EXPECT_EQ(n.load(), 12345);
  EXPECT_GE(ThreadPool::global().size(), 1);
}

}  // namespace
}  // namespace kiln
