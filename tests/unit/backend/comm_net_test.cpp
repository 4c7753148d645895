// The host communicator over several nodes (backend/comm_net.h), each node a thread with its local ranks as
// threads, over real TCP on localhost: all_reduce equals the one-process group's (comm_local.h) bit for bit,
// all_gather puts every rank's bytes in rank order on every rank, and a local rank that never arrives is a time-out
// error on every node, not a hang.
#include "backend/comm_net.h"


#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>
#include <random>
#include <thread>

#include "backend/comm_local.h"
#include "backend/rendezvous.h"
#include "core/error.h"
#include "net_util.h"

namespace kiln::backend {
namespace {

using namespace std::chrono_literals;
using ::testing::AllOf;
using ::testing::HasSubstr;

using kiln::testing::free_port;

// The links of `nnodes` nodes (index = node), made by the real rendezvous.
std::vector<std::shared_ptr<model::NodeLink>> links(int nnodes, int tp) {
  const std::string addr = fmt::format("127.0.0.1:{}", free_port());
  std::vector<std::future<RendezvousLink>> f;
  for (int k = 0; k < nnodes; ++k)
    f.push_back(std::async(std::launch::async, [=] {
      RendezvousOptions o;
      o.addr = addr;
      o.node_rank = k;
      o.timeout = 10s;
      return rendezvous_link(o, RendezvousHeader{nnodes, tp, "test"}, {1, 2, 3});
    }));
  std::vector<std::shared_ptr<model::NodeLink>> out;
  for (auto& x : f) {
    RendezvousLink l = x.get();
    EXPECT_EQ(l.blob, (std::vector<uint8_t>{1, 2, 3}));
    out.push_back(l.link);
  }
  return out;
}

// Runs fn(comm) for every rank of every node at once (global rank order of comms), rethrowing nothing: errors by rank.
std::vector<std::string> run_ranks(std::vector<std::unique_ptr<model::Communicator>>& comms,
                                   const std::function<void(model::Communicator&)>& fn) {
  std::vector<std::string> err(comms.size());
  std::vector<std::thread> t;
  for (size_t r = 0; r < comms.size(); ++r)
    t.emplace_back([&, r] {
      try {
        fn(*comms[r]);
      } catch (const std::exception& e) {
        err[r] = e.what();
      }
    });
  for (auto& x : t) x.join();
  return err;
}

TEST(CommNet, AllReduceAndGatherMatchTheOneProcessGroup) {
  constexpr int kTp = 6, kNodes = 3;
  auto l = links(kNodes, kTp);
  std::vector<std::unique_ptr<model::Communicator>> net;
  for (int k = 0; k < kNodes; ++k)
    for (auto& c : make_net_group(kTp, l[k], 10s)) net.push_back(std::move(c));
  auto local = make_local_group(kTp);
  for (int r = 0; r < kTp; ++r) {
    EXPECT_EQ(net[r]->rank(), r);
    EXPECT_EQ(net[r]->size(), kTp);
  }
  // Inputs whose sum depends on the order of additions.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1e4f, 1e4f);
  constexpr int64_t kCount = 1000;
  std::vector<std::vector<float>> a(kTp), b(kTp);
  for (int r = 0; r < kTp; ++r) {
    a[r].resize(kCount);
    for (auto& x : a[r]) x = u(rng) * (r % 2 ? 1e-3f : 1.0f);
    b[r] = a[r];
  }
  auto e1 = run_ranks(net, [&](model::Communicator& c) {
    c.all_reduce_sum(a[c.rank()].data(), kCount);
    c.barrier();
    c.all_reduce_sum(a[c.rank()].data(), 0);  // empty: still a meeting
  });
  auto e2 = run_ranks(local, [&](model::Communicator& c) { c.all_reduce_sum(b[c.rank()].data(), kCount); });
  for (int r = 0; r < kTp; ++r) {
    EXPECT_EQ(e1[r], "");
    EXPECT_EQ(e2[r], "");
    EXPECT_EQ(a[r], b[0]) << "rank " << r;
  }
  // all_gather: 5 bytes per rank, every rank gets all in rank order.
  std::vector<std::vector<uint8_t>> out(kTp, std::vector<uint8_t>(5 * kTp));
  auto e3 = run_ranks(net, [&](model::Communicator& c) {
    std::vector<uint8_t> in(5, static_cast<uint8_t>(10 + c.rank()));
    c.all_gather(in.data(), 5, out[c.rank()].data());
  });
  for (int r = 0; r < kTp; ++r) {
    EXPECT_EQ(e3[r], "");
    for (int j = 0; j < 5 * kTp; ++j) EXPECT_EQ(out[r][j], 10 + j / 5) << "rank " << r << " byte " << j;
  }
}

TEST(CommNet, MissingRankTimesOutOnEveryNode) {
  constexpr int kTp = 4, kNodes = 2;
  auto l = links(kNodes, kTp);
  std::vector<std::unique_ptr<model::Communicator>> net;
  for (int k = 0; k < kNodes; ++k)
    for (auto& c : make_net_group(kTp, l[k], 1s)) net.push_back(std::move(c));
  std::vector<float> x(8, 1.0f);
  // Rank 3 (node 1) never joins: node 1's rank 2 times out naming it; node 0's ranks see the group break.
  auto err = run_ranks(net, [&](model::Communicator& c) {
    if (c.rank() == 3) return;
    std::vector<float> mine = x;
    c.all_reduce_sum(mine.data(), static_cast<int64_t>(mine.size()));
  });
  EXPECT_THAT(err[2], HasSubstr("waited 1000 ms for rank(s) 3"));
  for (int r : {0, 1, 2}) EXPECT_THAT(err[r], HasSubstr("restart every node")) << "rank " << r;
  // Broken for good.
  auto again = run_ranks(net, [&](model::Communicator& c) { c.barrier(); });
  for (int r = 0; r < kTp; ++r) EXPECT_THAT(again[r], HasSubstr("restart every node")) << "rank " << r;
}

// abort() (another rank failed) releases the node's waiting ranks with model::GroupAborted, so a caller can tell it
// from the failing rank's own error by type; later collectives fail the same way (a broken multi-node group stays
// broken).
TEST(CommNet, AbortReleasesWaitingRanksWithGroupAborted) {
  auto l = links(2, 4);
  auto node0 = make_net_group(4, l[0], 0ms);  // no time-out: only abort() releases rank 1
  std::string caught;
  std::thread waiter([&] {
    try {
      node0[1]->barrier();
    } catch (const model::GroupAborted& e) {
      caught = std::string("aborted: ") + e.what();
    } catch (const std::exception& e) {
      caught = std::string("other: ") + e.what();
    }
  });
  std::this_thread::sleep_for(50ms);
  node0[0]->abort();
  waiter.join();
  EXPECT_THAT(caught, AllOf(HasSubstr("aborted: "), HasSubstr("another rank failed")));
  EXPECT_THROW(node0[0]->barrier(), model::GroupAborted);
  EXPECT_TRUE(l[0]->closed());
}

}  // namespace
}  // namespace kiln::backend
