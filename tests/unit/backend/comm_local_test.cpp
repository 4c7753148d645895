// The in-process communicator: sums equal to the rank-order sum computed here element by element (bitwise, on every
// rank, every round), gathers in rank order, and no hang: a missing rank times out naming it, abort() releases
// waiting ranks, reset() makes the group usable again.
#include "backend/comm_local.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "core/error.h"

namespace kiln::backend {
namespace {

using namespace std::chrono_literals;

// Runs body(rank) on one thread per rank; returns each rank's error message ("" when none).
std::vector<std::string> on_ranks(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

TEST(CommLocal, AllReduceIsTheRankOrderSumOnEveryRank) {
  for (int n : {1, 2, 3, 4, 8}) {
    auto comms = make_local_group(n, 10s);
    for (int64_t count : {int64_t{1}, int64_t{5}, int64_t{1000}, int64_t{4097}}) {
      for (int round = 0; round < 3; ++round) {
        std::vector<std::vector<float>> data(n, std::vector<float>(count));
        std::mt19937 rng(static_cast<unsigned>(n * 1000 + count + round));
        std::uniform_real_distribution<float> u(-1e3f, 1e3f);
        for (auto& d : data)
          for (auto& x : d) x = u(rng);
        std::vector<float> want(count);
        for (int64_t i = 0; i < count; ++i) {
          float s = data[0][i];
          for (int r = 1; r < n; ++r) s += data[r][i];
          want[i] = s;
        }
        const auto errors = on_ranks(n, [&](int r) { comms[r]->all_reduce_sum(data[r].data(), count); });
        for (int r = 0; r < n; ++r) {
          EXPECT_EQ(errors[r], "");
          EXPECT_EQ(std::memcmp(data[r].data(), want.data(), count * sizeof(float)), 0)
              << "n " << n << " count " << count << " rank " << r;
        }
      }
    }
  }
}

TEST(CommLocal, ManyCollectivesInARow) {
  // Back-to-back collectives (as a forward pass makes them): generations must not mix.
  const int n = 4;
  auto comms = make_local_group(n, 10s);
  std::vector<std::vector<float>> results(n);
  on_ranks(n, [&](int r) {
    float acc = 0;
    for (int i = 0; i < 500; ++i) {
      float x[3] = {float(r + 1), float(i), 1.0f};
      comms[r]->all_reduce_sum(x, 3);
      acc += x[0] + x[1] + x[2];
      if (i % 50 == 0) comms[r]->barrier();
    }
    results[r] = {acc};
  });
  // Per round: (1 + 2 + 3 + 4) + 4 i + 4.
  float want = 0;
  for (int i = 0; i < 500; ++i) want += 10.0f + 4.0f * i + 4.0f;
  for (int r = 0; r < n; ++r) EXPECT_EQ(results[r][0], want);
}

TEST(CommLocal, AllGatherInRankOrder) {
  const int n = 3;
  auto comms = make_local_group(n, 10s);
  std::vector<std::vector<int32_t>> out(n, std::vector<int32_t>(n * 2));
  on_ranks(n, [&](int r) {
    const int32_t mine[2] = {10 * r, 10 * r + 1};
    comms[r]->all_gather(mine, sizeof(mine), out[r].data());
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(out[r], (std::vector<int32_t>{0, 1, 10, 11, 20, 21}));
}

TEST(CommLocal, MissingRankTimesOutNamingIt) {
  auto comms = make_local_group(3, 200ms);
  // Rank 2 never joins.
  const auto errors = on_ranks(2, [&](int r) { comms[r]->barrier(); });
  EXPECT_THAT(errors[0] + errors[1], ::testing::HasSubstr("rank(s) 2"));
  EXPECT_THAT(errors[0] + errors[1], ::testing::HasSubstr("200 ms"));
  // The group is aborted now: a later collective fails at once, until reset.
  float x = 1;
  EXPECT_THROW(comms[0]->all_reduce_sum(&x, 1), Error);
  for (auto& c : comms) c->reset();
  comms[0]->set_timeout(10s);
  std::vector<float> v(3, 1.0f);
  const auto ok = on_ranks(3, [&](int r) { comms[r]->all_reduce_sum(&v[r], 1); });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ok[r], "");
    EXPECT_EQ(v[r], 3.0f);
  }
}

TEST(CommLocal, AbortReleasesWaitingRanks) {
  auto comms = make_local_group(2);  // no time-out: only abort() can release rank 0
  std::string error;
  std::thread waiter([&] {
    try {
      comms[0]->barrier();
    } catch (const model::GroupAborted& e) {  // by type: the reason is another rank's error
      error = e.what();
    }
  });
  std::this_thread::sleep_for(50ms);
  comms[1]->abort();
  waiter.join();
  EXPECT_THAT(error, ::testing::HasSubstr("aborted"));
  // A later collective fails at once with the same type, until reset.
  float x = 1;
  EXPECT_THROW(comms[0]->all_reduce_sum(&x, 1), model::GroupAborted);
}

TEST(CommLocal, BadSize) { EXPECT_THROW(make_local_group(0), Error); }

}  // namespace
}  // namespace kiln::backend
