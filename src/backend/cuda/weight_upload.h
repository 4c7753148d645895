// Asynchronous weight upload for the CUDA backend: CudaOps::place_weight reserves device memory and queues the copy
// here; finish() waits for every queued copy. Copies go through pinned staging buffers: worker threads copy the
// host bytes (mmapped checkpoint pages, where the page faults and reads happen) into a buffer, then queue a
// cudaMemcpyAsync from it on a copy stream of their own and recycle the buffer once its event has passed. Small
// tensors share a buffer; tensors larger than a buffer go in pieces. Bytes copied are added to weight_progress().
#pragma once
#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace kiln::backend::cuda {

// One staging buffer's worth of copies, planned on the host (no CUDA here, testable anywhere).
struct StagingBatch {
  struct Piece {  // host bytes -> staging buffer [offset, offset + bytes); dst: where they end up
    const uint8_t* src = nullptr;
    uint8_t* dst = nullptr;
    size_t offset = 0, bytes = 0;
  };
  struct DeviceCopy {  // staging buffer [offset, offset + bytes) -> dst: one cudaMemcpyAsync
    uint8_t* dst = nullptr;
    size_t offset = 0, bytes = 0;
  };
  std::vector<Piece> pieces;
  std::vector<DeviceCopy> copies;
  size_t used = 0;      // staging bytes used (gaps included)
  size_t payload = 0;   // host bytes copied (sum of pieces)
  uint64_t first_placement = 0, last_placement = 0;  // the placements (CudaOps's count) it holds pieces of
};

// Cuts a stream of copies (in placement order) into StagingBatches of at most buffer_bytes: a copy larger than the
// space left is split, and a copy whose destination starts within max_gap bytes after the previous one's end joins
// its device copy (the gap is the padding of the previous allocation: the runtime's weight allocations are
// 256-byte aligned with sizes rounded up to 256, so a gap under 256 bytes belongs to no other tensor).
class StagingPlanner {
 public:
  static constexpr size_t kNoJoin = ~size_t{0};  // max_gap: every copy its own device copy
  explicit StagingPlanner(size_t buffer_bytes, size_t max_gap = 255);
  // Plans dst[0, bytes) <- src[0, bytes); batches it fills are appended to `closed`.
  void add(uint8_t* dst, const uint8_t* src, size_t bytes, uint64_t placement, std::vector<StagingBatch>& closed);
  // The batch being filled, if it holds anything (and starts a new one).
  std::optional<StagingBatch> flush();
  size_t buffer_bytes() const { return buffer_bytes_; }

 private:
  size_t buffer_bytes_, max_gap_;
  StagingBatch open_;
};

struct UploadOptions {
  int threads = 0;                       // host copy threads; 0: half the cores, 2 to 8
  size_t buffer_bytes = size_t(32) << 20;  // per staging buffer
  int buffers_per_thread = 2;            // one filled while the other's copy runs
  bool pinned = true;                    // false: copy from pageable memory (what a failed cudaHostAlloc falls to)
};

class WeightUploader {
 public:
  // device: the CUDA device index the destinations live on.
  explicit WeightUploader(int device, const UploadOptions& options = {});
  ~WeightUploader();  // waits for queued copies (errors are dropped: call finish() to see them)
  WeightUploader(const WeightUploader&) = delete;
  WeightUploader& operator=(const WeightUploader&) = delete;

  // Queues dst[0, bytes) <- src[0, bytes). src must stay valid and unchanged until finish() returns; dst is a
  // weight allocation of the runtime (see StagingPlanner). Worker threads start once a full buffer is queued;
  // until then (a few small tensors) nothing runs.
  void enqueue(void* dst, const void* src, size_t bytes);
  // Runs or waits for every queued copy, stops the threads and frees the staging buffers. Throws kiln::Error
  // naming the first failed placement (its number and size) and the CUDA error.
  void finish();

  struct Stats {
    uint64_t placements = 0, bytes = 0, batches = 0, device_copies = 0;
    int threads = 0;          // worker threads of the last load (0: it ran on the caller's thread)
    bool pinned_failed = false;  // cudaHostAlloc failed: pageable copies
  };
  Stats stats() const;

 private:
  void start_workers_locked();
  void worker();
  // Copies one batch through `staging` (null: straight from the pageable source).
  void run_batch(const StagingBatch& b, uint8_t* staging, cudaEvent_t done);
  void record_error(const StagingBatch& b, const std::string& what);

  int device_;
  UploadOptions options_;
  cudaStream_t stream_ = nullptr;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  StagingPlanner planner_;
  std::deque<StagingBatch> ready_;
  std::vector<std::thread> workers_;
  bool closing_ = false;
  std::string error_;  // the first failure
  Stats stats_;
  std::vector<StagingBatch> closed_scratch_;
};

}  // namespace kiln::backend::cuda
