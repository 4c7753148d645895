// The CPU backend's one way of spreading rows over the thread pool.
#pragma once
#include <algorithm>
#include <cstdint>

#include "core/thread_pool.h"

namespace kiln::backend::cpu {

// Runs body(begin, end) over [0, n), in parallel when there is enough work (`cost` per item, in rough multiply-adds)
// to pay for waking the pool.
template <typename F>
void for_range(int64_t n, int64_t cost, F&& body) {
  if (n <= 0) return;
  if (n * std::max<int64_t>(cost, 1) < (int64_t{1} << 15)) {
    body(int64_t{0}, n);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cost, 1));
  ThreadPool::global().parallel_for(n, [&](int64_t b, int64_t e) { body(b, e); }, grain);
}

}  // namespace kiln::backend::cpu
