#include "engine/kv_pool.h"

#include "core/error.h"

namespace kiln::engine {

IdPool::IdPool(int64_t size) : size_(size), in_use_(static_cast<size_t>(size), false) {
  KILN_CHECK(size >= 0 && size <= INT32_MAX, "pool size {}", size);
  free_.reserve(static_cast<size_t>(size));
  for (int64_t i = size - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
}

bool IdPool::allocate(int64_t n, std::vector<int32_t>& out) {
  if (n < 0 || n > num_free()) return false;
  for (int64_t i = 0; i < n; ++i) {
    int32_t id = free_.back();
    free_.pop_back();
    in_use_[id] = true;
    out.push_back(id);
  }
  return true;
}

void IdPool::free(const std::vector<int32_t>& ids) {
  for (int32_t id : ids) {
    KILN_CHECK(id >= 0 && id < size_ && in_use_[id], "freeing id {} that is not in use", id);
    in_use_[id] = false;
    free_.push_back(id);
  }
}

}  // namespace kiln::engine
