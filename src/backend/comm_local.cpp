#include "backend/comm_local.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>

#include "core/error.h"

namespace kiln::backend {

class LocalGroup {
 public:
  LocalGroup(int size, std::chrono::milliseconds timeout)
      : size_(size), timeout_(timeout), posted_(size, nullptr), arrived_(size, 0) {}

  int size() const { return size_; }

  // Blocks until every rank has arrived at this barrier; kiln::Error on time-out or abort.
  void barrier(int rank, const char* what) {
    std::unique_lock lock(mu_);
    if (aborted_)
      throw model::GroupAborted(
          fmt::format("tensor-parallel group aborted (another rank failed) before {} on rank {}", what, rank));
    const uint64_t gen = generation_;
    arrived_[rank] = 1;
    if (++count_ == size_) {
      count_ = 0;
      std::fill(arrived_.begin(), arrived_.end(), 0);
      ++generation_;
      cv_.notify_all();
      return;
    }
    auto done = [&] { return generation_ != gen || aborted_; };
    if (timeout_.count() > 0) {
      if (!cv_.wait_for(lock, timeout_, done)) {
        std::string missing;
        for (int r = 0; r < size_; ++r)
          if (!arrived_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        aborted_ = true;
        cv_.notify_all();
        fail("tensor-parallel {}: rank {} waited {} ms for rank(s) {} (a peer failed or hangs)", what, rank,
             timeout_.count(), missing);
      }
    } else {
      cv_.wait(lock, done);
    }
    if (generation_ == gen)
      throw model::GroupAborted(
          fmt::format("tensor-parallel group aborted (another rank failed) during {} on rank {}", what, rank));
  }

  void post(int rank, const void* p) { posted_[rank] = p; }  // before a barrier; read after it
  const void* posted(int rank) const { return posted_[rank]; }

  void set_timeout(std::chrono::milliseconds t) {
    std::lock_guard lock(mu_);
    timeout_ = t;
  }
  void abort() {
    std::lock_guard lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }
  void reset() {
    std::lock_guard lock(mu_);
    aborted_ = false;
    count_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), 0);
    ++generation_;
  }

 private:
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::chrono::milliseconds timeout_;
  std::vector<const void*> posted_;
  std::vector<char> arrived_;
  int count_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
};

namespace {

class LocalComm final : public model::Communicator {
 public:
  LocalComm(std::shared_ptr<LocalGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size(); }

  void all_reduce_sum(float* data, int64_t count, void*) override {
    const int n = g_->size();
    if (n == 1) return;
    g_->post(rank_, data);
    g_->barrier(rank_, "all_reduce");
    // This rank's element range, summed over all ranks in rank order, written back to every rank's buffer.
    const int64_t per = (count + n - 1) / n, b = std::min<int64_t>(count, rank_ * per),
                  e = std::min<int64_t>(count, b + per);
    if (e > b) {
      std::vector<float> sum(static_cast<const float*>(g_->posted(0)) + b, static_cast<const float*>(g_->posted(0)) + e);
      for (int r = 1; r < n; ++r) {
        const float* x = static_cast<const float*>(g_->posted(r));
        for (int64_t i = b; i < e; ++i) sum[i - b] += x[i];
      }
      for (int r = 0; r < n; ++r)
        std::memcpy(const_cast<float*>(static_cast<const float*>(g_->posted(r))) + b, sum.data(),
                    static_cast<size_t>(e - b) * sizeof(float));
    }
    g_->barrier(rank_, "all_reduce (write-back)");
  }

  void all_gather(const void* in, int64_t bytes, void* out, void*) override {
    const int n = g_->size();
    g_->post(rank_, in);
    g_->barrier(rank_, "all_gather");
    for (int r = 0; r < n; ++r)
      std::memcpy(static_cast<char*>(out) + static_cast<size_t>(r) * bytes, g_->posted(r), static_cast<size_t>(bytes));
    g_->barrier(rank_, "all_gather (copy-out)");
  }

  void barrier() override { g_->barrier(rank_, "barrier"); }
  void set_timeout(std::chrono::milliseconds t) override { g_->set_timeout(t); }
  void abort() override { g_->abort(); }
  void reset() override { g_->reset(); }

 private:
  std::shared_ptr<LocalGroup> g_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<model::Communicator>> make_local_group(int size, std::chrono::milliseconds timeout) {
  if (size < 1) fail("a tensor-parallel group needs at least 1 rank (got {})", size);
  auto g = std::make_shared<LocalGroup>(size, timeout);
  std::vector<std::unique_ptr<model::Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<LocalComm>(g, r));
  return out;
}

}  // namespace kiln::backend
