#include "backend/comm_net.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "model/tp_wire.h"

namespace kiln::backend {

namespace {

using model::wire::Message;
using Op = model::wire::CollectiveOp;

class NetGroup {
 public:
  NetGroup(int tp, std::shared_ptr<model::NodeLink> link, std::chrono::milliseconds timeout)
      : tp_(tp), nnodes_(link->nnodes()), node_(link->node_rank()), local_(tp / link->nnodes()), link_(std::move(link)),
        timeout_(timeout), in_(local_, nullptr), out_(local_, nullptr), arrived_(local_, 0) {}

  int tp() const { return tp_; }
  int first() const { return node_ * local_; }

  // Rank `r` (local) joins a collective: `in` / `out` are its buffers (the same for an all-reduce), `n` floats
  // (all-reduce) or bytes (all-gather).
  void collective(int r, Op op, const void* in, void* out, int64_t n, const char* what) {
    std::unique_lock lock(mu_);
    if (!broken_.empty()) fail_broken(fmt::format("{} on rank {}", what, first() + r));
    if (count_ == 0) {
      op_ = op;
      n_ = n;
    } else if (op_ != op || n_ != n) {
      fail("tensor-parallel {} on rank {}: the node's ranks are out of step (another rank is in a different "
           "collective)", what, first() + r);
    }
    const uint64_t gen = generation_;
    in_[r] = in;
    out_[r] = out;
    arrived_[r] = 1;
    if (++count_ == local_) {
      // The last local rank to arrive talks to the other nodes; the others wait for it.
      lock.unlock();
      std::string error;
      try {
        exchange(op, n);
      } catch (const std::exception& e) {
        error = e.what();
      }
      lock.lock();
      count_ = 0;
      std::fill(arrived_.begin(), arrived_.end(), 0);
      ++generation_;
      if (!error.empty()) break_group(fmt::format("the exchange with the other nodes failed: {}", error));
      cv_.notify_all();
      if (!error.empty()) fail_broken(fmt::format("tensor-parallel {} on rank {}", what, first() + r));
      return;
    }
    auto done = [&] { return generation_ != gen || !broken_.empty(); };
    if (timeout_.count() > 0) {
      if (!cv_.wait_for(lock, timeout_, done)) {
        std::string missing;
        for (int i = 0; i < local_; ++i)
          if (!arrived_[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(first() + i);
        break_group(fmt::format("rank {} waited {} ms for rank(s) {} of this node in {} (a rank failed or hangs)",
                                first() + r, timeout_.count(), missing, what));
        cv_.notify_all();
        fail_broken(fmt::format("tensor-parallel {}", what));
      }
    } else {
      cv_.wait(lock, done);
    }
    // Woken by the end of this collective (its exchange may have failed: broken_ then says why) or by a break.
    if (!broken_.empty()) fail_broken(fmt::format("tensor-parallel {} on rank {}", what, first() + r));
  }

  void set_timeout(std::chrono::milliseconds t) {
    std::lock_guard lock(mu_);
    timeout_ = t;
  }
  void abort() {
    std::lock_guard lock(mu_);
    if (broken_.empty()) aborted_ = true;
    break_group("group aborted (another rank failed)");
    cv_.notify_all();
  }

 private:
  // Under mu_ (or with every rank stopped): the group cannot be used again; the link's close makes the other nodes'
  // waits fail as well.
  void break_group(const std::string& why) {
    if (broken_.empty())
      broken_ = fmt::format("{}; a multi-node group cannot recover: restart every node", why);
    link_->close();
  }

  // Under mu_: the collective fails with why the group broke; GroupAborted when abort() broke it (another rank's
  // error is the reason), kiln::Error otherwise.
  [[noreturn]] void fail_broken(const std::string& where) const {
    const std::string msg = fmt::format("{}: {}", where, broken_);
    if (aborted_) throw model::GroupAborted(msg);
    throw Error(msg);
  }

  // The messages carry op and n (model/tp_wire.h), so two nodes in different collectives are caught.
  void exchange(Op op, int64_t n) {
    const size_t part = op == Op::all_reduce ? static_cast<size_t>(n) * sizeof(float) : static_cast<size_t>(n);
    if (node_ != 0) {
      // Up: this node's ranks' inputs in rank order; down: the result.
      std::vector<std::span<const uint8_t>> mine;
      for (int i = 0; i < local_; ++i) mine.emplace_back(static_cast<const uint8_t*>(in_[i]), in_[i] ? part : 0);
      const std::vector<uint8_t> up = model::wire::encode_collective(op, n, mine);
      link_->send(0, Message::collective_up, up.data(), up.size());
      const std::vector<uint8_t> down = link_->receive(0, Message::collective_down, timeout_);
      const model::wire::CollectiveView result = model::wire::decode_collective(down, "collective result from node 0");
      const size_t want = op == Op::all_reduce ? part : part * tp_;
      if (result.op != op || result.count != n || result.parts.size() != 1 || result.parts[0].size() != want)
        fail("node 0 answered a collective with another one ({} parts): the nodes are out of step",
             result.parts.size());
      for (int i = 0; i < local_; ++i)
        if (want) std::memcpy(out_[i], result.parts[0].data(), want);
      return;
    }
    // Node 0: every other node's inputs, then the result to all.
    std::vector<std::vector<uint8_t>> ups(static_cast<size_t>(nnodes_));
    std::vector<model::wire::CollectiveView> views(static_cast<size_t>(nnodes_));
    for (int k = 1; k < nnodes_; ++k) {
      ups[k] = link_->receive(k, Message::collective_up, timeout_);
      views[k] = model::wire::decode_collective(ups[k], fmt::format("collective inputs from node {}", k));
      const model::wire::CollectiveView& v = views[k];
      bool same = v.op == op && v.count == n && static_cast<int>(v.parts.size()) == local_;
      for (const auto& p : v.parts) same = same && p.size() == part;
      if (!same) fail("node {} is in another collective than node 0: the nodes are out of step", k);
    }
    auto input = [&](int g) -> const uint8_t* {
      const int k = g / local_, i = g % local_;
      return k == 0 ? static_cast<const uint8_t*>(in_[i]) : views[k].parts[i].data();
    };
    std::vector<uint8_t> result;
    if (op == Op::all_reduce) {
      std::vector<float> sum(static_cast<size_t>(n));
      if (n) std::memcpy(sum.data(), input(0), part);
      for (int g = 1; g < tp_; ++g) {
        const float* x = reinterpret_cast<const float*>(input(g));
        for (int64_t j = 0; j < n; ++j) sum[static_cast<size_t>(j)] += x[j];
      }
      result.resize(part);
      if (n) std::memcpy(result.data(), sum.data(), part);
    } else {
      result.resize(part * tp_);
      for (int g = 0; g < tp_; ++g)
        if (part) std::memcpy(result.data() + part * g, input(g), part);
    }
    const std::span<const uint8_t> whole(result);
    const std::vector<uint8_t> down = model::wire::encode_collective(op, n, std::span(&whole, 1));
    for (int k = 1; k < nnodes_; ++k) link_->send(k, Message::collective_down, down.data(), down.size());
    for (int i = 0; i < local_; ++i)
      if (!result.empty()) std::memcpy(out_[i], result.data(), result.size());
  }

  const int tp_, nnodes_, node_, local_;
  std::shared_ptr<model::NodeLink> link_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::chrono::milliseconds timeout_;
  std::vector<const void*> in_;
  std::vector<void*> out_;
  std::vector<char> arrived_;
  int count_ = 0;
  Op op_ = Op::all_reduce;
  int64_t n_ = 0;
  uint64_t generation_ = 0;
  std::string broken_;
  bool aborted_ = false;  // broken_ by abort(): another rank's failure
};

class NetComm final : public model::Communicator {
 public:
  NetComm(std::shared_ptr<NetGroup> g, int local) : g_(std::move(g)), local_(local) {}
  int rank() const override { return g_->first() + local_; }
  int size() const override { return g_->tp(); }
  void all_reduce_sum(float* data, int64_t count, void*) override {
    g_->collective(local_, Op::all_reduce, data, data, count, "all_reduce");
  }
  void all_gather(const void* in, int64_t bytes, void* out, void*) override {
    g_->collective(local_, Op::all_gather, in, out, bytes, "all_gather");
  }
  void barrier() override { g_->collective(local_, Op::all_reduce, nullptr, nullptr, 0, "barrier"); }
  void set_timeout(std::chrono::milliseconds t) override { g_->set_timeout(t); }
  void abort() override { g_->abort(); }
  void reset() override {}  // a broken multi-node group stays broken (see comm_net.h)

 private:
  std::shared_ptr<NetGroup> g_;
  int local_;
};

}  // namespace

std::vector<std::unique_ptr<model::Communicator>> make_net_group(int tp, std::shared_ptr<model::NodeLink> link,
                                                                 std::chrono::milliseconds timeout) {
  if (!link) fail("make_net_group: no link");
  const int n = link->nnodes();
  if (tp < 1 || n < 1 || tp % n)
    fail("--tp-size {} does not divide over --nnodes {}: every machine runs tp-size / nnodes ranks", tp, n);
  auto g = std::make_shared<NetGroup>(tp, std::move(link), timeout);
  std::vector<std::unique_ptr<model::Communicator>> out;
  for (int i = 0; i < tp / n; ++i) out.push_back(std::make_unique<NetComm>(g, i));
  return out;
}

}  // namespace kiln::backend
