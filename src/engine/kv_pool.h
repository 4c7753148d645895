// Host-side bookkeeping of the runner's KV page pool and recurrent-state slots: which ids are free.
// The memory itself belongs to the ModelRunner; the engine only hands ids out and takes them back.
#pragma once
#include <cstdint>
#include <vector>

namespace kiln::engine {

// A pool of integer ids [0, size): allocate n at once (all or nothing), free them back.
class IdPool {
 public:
  explicit IdPool(int64_t size = 0);
  int64_t size() const { return size_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_used() const { return size_ - num_free(); }
  // Appends n ids to `out`; false (nothing taken) when fewer than n are free.
  bool allocate(int64_t n, std::vector<int32_t>& out);
  // Returns ids to the pool. Freeing an id that is not in use is a bug (KILN_CHECK).
  void free(const std::vector<int32_t>& ids);

 private:
  int64_t size_ = 0;
  std::vector<int32_t> free_;  // lowest id at the back: allocation order is deterministic
  std::vector<bool> in_use_;   // [size]
};

}  // namespace kiln::engine
