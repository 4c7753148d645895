// Tensor parallelism over several machines (model/tp_runner.h with a link; backend/comm_net.h), each "node" a
// thread of this test over real TCP on localhost: node 0 drives the steps, the others follow(). The logits equal
// the one-process group's of the same --tp-size bit for bit (the same rank-order sums) and TP 1's within the fp32
// tolerance; greedy identical; a follower that fails or never comes is an error on node 0, not a hang; the followers
// take node 0's sizes.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>

#include "core/error.h"
#include "net_util.h"
#include "model/tp_runner.h"
#include "reference_fixture.h"

namespace kiln::testing {
namespace {

using ::testing::HasSubstr;


backend::LoadOptions node_opts(int tp, int ep, int nnodes, int node, int port) {
  backend::LoadOptions o;
  o.kv_dtype = DType::F32;
  o.state_slots = 3;
  o.max_context = 256;
  o.parallel.tp_size = tp;
  o.parallel.ep_size = ep;
  o.parallel.nnodes = nnodes;
  o.parallel.node_rank = node;
  // One node meets no one: no address (backend::validate_parallel refuses a port of 0).
  if (nnodes > 1) o.parallel.dist_init_addr = fmt::format("127.0.0.1:{}", port);
  o.parallel.dist_timeout_s = 20;
  return o;
}

// The other nodes: load, then follow node 0 until it stops the group; the future says how it ended ("" = stopped).
std::vector<std::future<std::string>> start_followers(const std::string& dir, int tp, int ep, int nnodes, int port,
                                                      std::function<void(backend::LoadOptions&)> tweak = {}) {
  std::vector<std::future<std::string>> out;
  for (int k = 1; k < nnodes; ++k)
    out.push_back(std::async(std::launch::async, [=]() -> std::string {
      try {
        backend::LoadOptions o = node_opts(tp, ep, nnodes, k, port);
        if (tweak) tweak(o);
        auto r = backend::load_cpu_model(format::ModelDir::open(dir), o);
        dynamic_cast<model::TpRunner&>(*r).follow();
        return "";
      } catch (const std::exception& e) {
        return e.what();
      }
    }));
  return out;
}

std::vector<float> logits_of(TestRunner& r, int slot, std::span<const int32_t> toks, int64_t start) {
  std::vector<float> out(r.vocab());
  model::SeqChunk c = r.chunk(slot, toks, start);
  r.runner->forward({&c, 1}, out);
  return out;
}

struct Shape {
  int tp, ep, nnodes;
};

TEST(TpNodes, KilnTinyOverNodesEqualsOneProcess) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  const std::vector<int32_t> prompt = {2049, 872, 198, 3, 100, 57, 911, 2050, 198, 2049, 77, 198};
  backend::LoadOptions one_o = node_opts(1, 1, 1, 0, 0);
  TestRunner one(dir, one_o);
  for (Shape s : {Shape{2, 1, 2}, Shape{4, 2, 2}, Shape{4, 1, 4}}) {
    SCOPED_TRACE(fmt::format("tp {} ep {} nnodes {}", s.tp, s.ep, s.nnodes));
    backend::LoadOptions same = node_opts(s.tp, s.ep, 1, 0, 0);
    TestRunner local(dir, same);  // the one-process group of the same size
    const int port = free_port();
    auto followers = start_followers(dir, s.tp, s.ep, s.nnodes, port);
    {
      TestRunner node0(dir, node_opts(s.tp, s.ep, s.nnodes, 0, port));
      EXPECT_THAT(node0.runner->describe(), HasSubstr(fmt::format("{} nodes; ranks 0-{} on this node (node 0)",
                                                                  s.nnodes, s.tp / s.nnodes - 1)));
      std::vector<int32_t> seq = prompt, seq1 = prompt;
      double worst = 0;
      for (int step = 0; step < 10; ++step) {
        const int64_t start = step == 0 ? 0 : static_cast<int64_t>(seq.size()) - 1;
        const std::vector<float> n = logits_of(node0, 0, std::span(seq).subspan(start), start);
        const std::vector<float> l = logits_of(local, 0, std::span(seq).subspan(start), start);
        const std::vector<float> a = logits_of(one, 0, std::span(seq1).subspan(start), start);
        ASSERT_EQ(n, l) << "step " << step << ": the nodes' sums differ from the one-process group's";
        for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::fabs(n[i] - a[i])));
        seq.push_back(argmax(n.data(), node0.vocab()));
        seq1.push_back(argmax(a.data(), one.vocab()));
      }
      EXPECT_EQ(seq, seq1);
      EXPECT_LT(worst, 1e-3);
      // forward_argmax (the other nodes send their best (value, id) per row) on a two-sequence step after a state
      // copy driven on every node; the one-process group does the same.
      node0.runner->copy_state(0, 2);
      std::vector<int32_t> tail = {seq.back()};
      model::SeqChunk chunks[2] = {node0.chunk(1, prompt, 0), node0.chunk(2, tail, static_cast<int64_t>(seq.size()) - 1)};
      std::vector<int32_t> ids(2);
      node0.runner->forward_argmax(chunks, ids);
      local.runner->copy_state(0, 2);
      model::SeqChunk lc[2] = {local.chunk(1, prompt, 0), local.chunk(2, tail, static_cast<int64_t>(seq.size()) - 1)};
      std::vector<float> both(2 * local.vocab());
      local.runner->forward(lc, both);
      EXPECT_EQ(ids[0], argmax(both.data(), local.vocab()));
      EXPECT_EQ(ids[1], argmax(both.data() + local.vocab(), local.vocab()));
    }
    // Node 0 gone: every follower was stopped cleanly.
    for (auto& f : followers) EXPECT_EQ(f.get(), "");
  }
}

TEST(TpNodes, FollowerFailureIsAnErrorOnNodeZero) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  const std::vector<int32_t> prompt = {2049, 872, 198, 3, 100};
  const int port = free_port();
  auto followers = start_followers(dir, 2, 1, 2, port);
  TestRunner node0(dir, node_opts(2, 1, 2, 0, port));
  (void)logits_of(node0, 0, prompt, 0);
  // A step the follower rejects (a state slot it does not have): node 0's step fails naming it, then the group is
  // broken for good, with the reason.
  std::vector<float> out(node0.vocab());
  model::SeqChunk bad = node0.chunk(7, prompt, 0);
  try {
    node0.runner->forward({&bad, 1}, out);
    ADD_FAILURE() << "a bad slot ran";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("slot"));
  }
  try {
    (void)logits_of(node0, 0, prompt, 0);
    ADD_FAILURE() << "a broken group ran a step";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("failed earlier"));
    EXPECT_THAT(e.what(), HasSubstr("restart every node"));
  }
  EXPECT_THAT(followers[0].get(), HasSubstr("restart every node"));
}

TEST(TpNodes, FollowersTakeNodeZerosSizes) {
  // A follower launched with other sizes (here: state slots) runs with node 0's: node 0 decides the group's KV pages,
  // slots and context (a `kiln generate` on node 0 sizes it for its prompt), and the steps work.
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  const int port = free_port();
  auto followers = start_followers(dir, 2, 1, 2, port, [](backend::LoadOptions& o) {
    o.state_slots = 5;
    o.max_context = 128;
  });
  {
    TestRunner node0(dir, node_opts(2, 1, 2, 0, port));
    EXPECT_EQ(node0.runner->capacity().state_slots, 3);
    const std::vector<int32_t> prompt = {2049, 872, 198, 3, 100};
    model::SeqChunk c = node0.chunk(2, prompt, 0);  // the last of node 0's 3 slots
    std::vector<int32_t> id(1);
    node0.runner->forward_argmax({&c, 1}, id);
    EXPECT_GE(id[0], 0);
  }
  EXPECT_EQ(followers[0].get(), "");
}

TEST(TpNodes, MissingNodeTimesOut) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  backend::LoadOptions o = node_opts(2, 1, 2, 0, free_port());
  o.parallel.dist_timeout_s = 1;
  try {
    TestRunner node0(dir, o);
    ADD_FAILURE() << "node 0 started without node 1";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("node rank(s) 1 of 2 did not arrive within 1 s"));
  }
}

}  // namespace
}  // namespace kiln::testing
