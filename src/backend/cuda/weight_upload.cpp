#include "backend/cuda/weight_upload.h"

#include <algorithm>
#include <cstring>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"

namespace kiln::backend::cuda {

// ---------------------------------------------------------------------------------------------------
// StagingPlanner

StagingPlanner::StagingPlanner(size_t buffer_bytes, size_t max_gap)
    : buffer_bytes_(std::max<size_t>(buffer_bytes, 1)), max_gap_(max_gap) {}

void StagingPlanner::add(uint8_t* dst, const uint8_t* src, size_t bytes, uint64_t placement,
                         std::vector<StagingBatch>& closed) {
  auto close = [&] {
    if (open_.used) closed.push_back(std::move(open_));
    open_ = StagingBatch{};
  };
  while (bytes > 0) {
    if (open_.used >= buffer_bytes_) close();
    size_t offset = 0, n = 0;
    bool joined = false;
    if (!open_.copies.empty() && max_gap_ != kNoJoin) {
      StagingBatch::DeviceCopy& last = open_.copies.back();
      uint8_t* end = last.dst + last.bytes;
      if (dst >= end && static_cast<size_t>(dst - end) <= max_gap_ &&
          last.offset + static_cast<size_t>(dst - last.dst) < buffer_bytes_) {
        offset = last.offset + static_cast<size_t>(dst - last.dst);
        n = std::min(bytes, buffer_bytes_ - offset);
        last.bytes = static_cast<size_t>(dst + n - last.dst);
        joined = true;
      }
    }
    if (!joined) {
      offset = (open_.used + 15) / 16 * 16;  // 16-byte aligned pieces (faster host copies)
      if (offset >= buffer_bytes_) {
        close();
        offset = 0;
      }
      n = std::min(bytes, buffer_bytes_ - offset);
      open_.copies.push_back({dst, offset, n});
    }
    if (open_.pieces.empty()) open_.first_placement = placement;
    open_.last_placement = placement;
    open_.pieces.push_back({src, dst, offset, n});
    open_.used = offset + n;
    open_.payload += n;
    dst += n;
    src += n;
    bytes -= n;
  }
  if (open_.used >= buffer_bytes_) close();
}

std::optional<StagingBatch> StagingPlanner::flush() {
  if (!open_.used) return std::nullopt;
  StagingBatch b = std::move(open_);
  open_ = StagingBatch{};
  return b;
}

// ---------------------------------------------------------------------------------------------------
// WeightUploader

WeightUploader::WeightUploader(int device, const UploadOptions& options)
    // No joined device copies: two weight allocations of the runtime may be separate cudaMalloc blocks that happen
    // to lie back to back, and one copy across both is an invalid argument (seen on the H200 with 24 MiB tensors).
    : device_(device), options_(options), planner_(options.buffer_bytes, StagingPlanner::kNoJoin) {
  if (options_.threads <= 0)
    options_.threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 2, 2, 8);
  options_.buffers_per_thread = std::max(options_.buffers_per_thread, 1);
  KILN_CUDA_CHECK(cudaSetDevice(device_));
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

WeightUploader::~WeightUploader() {
  try {
    finish();
  } catch (...) {  // a destructor must not throw; finish() is where callers see errors
  }
  if (stream_) cudaStreamDestroy(stream_);
}

void WeightUploader::enqueue(void* dst, const void* src, size_t bytes) {
  if (!bytes) return;
  std::lock_guard lock(mu_);
  const uint64_t placement = stats_.placements++;
  stats_.bytes += bytes;
  closed_scratch_.clear();
  planner_.add(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes, placement, closed_scratch_);
  if (closed_scratch_.empty()) return;
  for (StagingBatch& b : closed_scratch_) ready_.push_back(std::move(b));
  closed_scratch_.clear();
  if (workers_.empty()) start_workers_locked();
  work_cv_.notify_all();
}

void WeightUploader::start_workers_locked() {
  closing_ = false;
  stats_.threads = options_.threads;
  for (int i = 0; i < options_.threads; ++i) workers_.emplace_back([this] { worker(); });
}

void WeightUploader::record_error(const StagingBatch& b, const std::string& what) {
  std::lock_guard lock(mu_);
  if (!error_.empty()) return;
  error_ = b.first_placement == b.last_placement
               ? fmt::format("copying weight #{} to GPU {}: {}", b.first_placement, device_, what)
               : fmt::format("copying weights #{}..#{} to GPU {}: {}", b.first_placement, b.last_placement, device_,
                             what);
}

void WeightUploader::run_batch(const StagingBatch& b, uint8_t* staging, cudaEvent_t done) {
  if (staging) {
    KILN_CUDA_CHECK(cudaEventSynchronize(done));  // the buffer's previous copy has left it
    for (const StagingBatch::Piece& p : b.pieces) std::memcpy(staging + p.offset, p.src, p.bytes);
    for (const StagingBatch::DeviceCopy& c : b.copies)
      KILN_CUDA_CHECK(cudaMemcpyAsync(c.dst, staging + c.offset, c.bytes, cudaMemcpyHostToDevice, stream_));
    KILN_CUDA_CHECK(cudaEventRecord(done, stream_));
  } else {
    // Pageable source: each call returns once the driver has staged the bytes.
    for (const StagingBatch::Piece& p : b.pieces)
      KILN_CUDA_CHECK(cudaMemcpyAsync(p.dst, p.src, p.bytes, cudaMemcpyHostToDevice, stream_));
  }
  weight_progress().add(b.payload);
  std::lock_guard lock(mu_);
  ++stats_.batches;
  stats_.device_copies += staging ? b.copies.size() : b.pieces.size();
}

void WeightUploader::worker() {
  std::vector<uint8_t*> buffers;
  std::vector<cudaEvent_t> events;
  bool set = cudaSetDevice(device_) == cudaSuccess;
  if (set && options_.pinned) {
    for (int i = 0; i < options_.buffers_per_thread; ++i) {
      void* p = nullptr;
      cudaEvent_t e = nullptr;
      if (cudaHostAlloc(&p, options_.buffer_bytes, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        break;
      }
      if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        cudaGetLastError();
        cudaFreeHost(p);
        break;
      }
      buffers.push_back(static_cast<uint8_t*>(p));
      events.push_back(e);
    }
    if (buffers.empty()) {
      std::lock_guard lock(mu_);
      if (!stats_.pinned_failed)
        KILN_LOG_WARN("cannot allocate {} MiB of pinned host memory for weight staging: copying weights from pageable "
                      "memory (slower)", options_.buffer_bytes >> 20);
      stats_.pinned_failed = true;
    }
  }
  size_t next = 0;
  for (;;) {
    StagingBatch b;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [&] { return closing_ || !ready_.empty(); });
      if (ready_.empty()) break;
      b = std::move(ready_.front());
      ready_.pop_front();
      if (!error_.empty()) continue;  // after a failure the rest is dropped
    }
    try {
      if (!set) KILN_CUDA_CHECK(cudaSetDevice(device_));
      set = true;
      const size_t k = next++ % std::max<size_t>(buffers.size(), 1);
      run_batch(b, buffers.empty() ? nullptr : buffers[k], buffers.empty() ? nullptr : events[k]);
    } catch (const std::exception& e) {
      record_error(b, e.what());
    }
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    cudaEventSynchronize(events[i]);
    cudaEventDestroy(events[i]);
    cudaFreeHost(buffers[i]);
  }
}

void WeightUploader::finish() {
  std::optional<StagingBatch> last;
  {
    std::lock_guard lock(mu_);
    last = planner_.flush();
    if (last && !workers_.empty()) {
      ready_.push_back(std::move(*last));
      last.reset();
    }
    closing_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  {
    std::lock_guard lock(mu_);
    workers_.clear();
    closing_ = false;
  }
  // No worker ran (less than one buffer queued): the few bytes go from here, pageable.
  if (last && error_.empty()) {
    try {
      KILN_CUDA_CHECK(cudaSetDevice(device_));
      run_batch(*last, nullptr, nullptr);
    } catch (const std::exception& e) {
      record_error(*last, e.what());
    }
  }
  const cudaError_t err = cudaStreamSynchronize(stream_);
  std::string error;
  {
    std::lock_guard lock(mu_);
    if (err != cudaSuccess && error_.empty())
      error_ = fmt::format("copying weights to GPU {}: {} ({})", device_, cudaGetErrorName(err),
                           cudaGetErrorString(err));
    error = std::move(error_);
    error_.clear();
  }
  if (!error.empty()) fail("{}", error);
}

WeightUploader::Stats WeightUploader::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace kiln::backend::cuda
