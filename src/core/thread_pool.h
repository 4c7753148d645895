// A fixed pool of worker threads for data-parallel loops. parallel_for splits [0, n) into contiguous
// ranges, runs them on the workers and the calling thread, and returns when all are done.
// Exceptions thrown by the body are rethrown on the calling thread (the first one wins).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kiln {

class ThreadPool {
 public:
  // threads == 0: one per hardware thread. The caller counts as one worker.
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // body(begin, end) over chunks of at least `grain` items.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& body, int64_t grain = 1);

  // The process-wide pool, made at first use: set_global_threads' count (the kiln binary passes --threads or
  // KILN_THREADS: cli/environment.h), else all cores. A count set after the pool started has no effect.
  static ThreadPool& global();
  static void set_global_threads(int threads);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t n_ = 0, chunk_ = 0, num_chunks_ = 0;
  int64_t next_chunk_ = 0, done_chunks_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex run_mu_;  // one parallel_for at a time
};

}  // namespace kiln
