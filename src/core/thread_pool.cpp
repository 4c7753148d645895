#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>

namespace kiln {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 0; i < threads - 1; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int) {
  uint64_t seen = 0;
  std::unique_lock lock(mu_);
  for (;;) {
    cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (next_chunk_ < num_chunks_) {
      int64_t c = next_chunk_++;
      lock.unlock();
      try {
        int64_t b = c * chunk_, e = std::min(n_, b + chunk_);
        (*body_)(b, e);
      } catch (...) {
        std::lock_guard g(mu_);
        if (!error_) error_ = std::current_exception();
      }
      lock.lock();
      if (++done_chunks_ == num_chunks_) cv_done_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& body, int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = std::max<int64_t>(1, (n + grain - 1) / grain);
  const int64_t chunks = std::min<int64_t>(max_chunks, static_cast<int64_t>(size()) * 4);
  if (workers_.empty() || chunks <= 1) {
    body(0, n);
    return;
  }
  std::lock_guard run(run_mu_);
  std::unique_lock lock(mu_);
  body_ = &body;
  n_ = n;
  chunk_ = (n + chunks - 1) / chunks;
  num_chunks_ = (n + chunk_ - 1) / chunk_;
  next_chunk_ = 0;
  done_chunks_ = 0;
  error_ = nullptr;
  ++generation_;
  cv_work_.notify_all();
  while (next_chunk_ < num_chunks_) {
    int64_t c = next_chunk_++;
    lock.unlock();
    try {
      int64_t b = c * chunk_, e = std::min(n_, b + chunk_);
      body(b, e);
    } catch (...) {
      std::lock_guard g(mu_);
      if (!error_) error_ = std::current_exception();
    }
    lock.lock();
    ++done_chunks_;
  }
  cv_done_.wait(lock, [&] { return done_chunks_ == num_chunks_; });
  body_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

namespace {
std::atomic<int> g_threads{0};
}

void ThreadPool::set_global_threads(int threads) { g_threads = threads; }

ThreadPool& ThreadPool::global() {
  static std::unique_ptr<ThreadPool> pool = [] {
    return std::make_unique<ThreadPool>(g_threads.load());
  }();
  return *pool;
}

}  // namespace kiln
