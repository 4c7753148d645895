// The CUDA backend's runtime, below CudaOps: the device it runs on, its stream, device memory (persistent tensors,
// the weight arena, the per-step scratch arena), CUDA graphs of decode steps, and the op profiler. It knows nothing
// of the ops; CudaOps (cuda_ops.h) validates views, picks kernels and launches them on this stream.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "model/ops.h"

namespace kiln::backend::cuda {

// The GPU kiln would run on. kiln's kernels are built for sm_90a (Hopper) and sm_120a (Blackwell workstation).
struct CudaDeviceProbe {
  bool usable = false;
  int index = -1;             // CUDA device index (the first supported one)
  std::string name;           // e.g. "NVIDIA H200"
  int major = 0, minor = 0;   // compute capability
  int multiprocessors = 0;
  size_t memory_bytes = 0;
  size_t free_bytes = 0;      // free when probed (other processes may hold some)
  std::string reason;         // why not usable: "no CUDA device ...", "compute capability 8.0 not supported ..."
};
// Never throws: a machine without a driver or GPU gives usable = false and a reason. index < 0: the first supported
// device; else that CUDA device (usable = false with the reason when it does not exist or is not supported).
CudaDeviceProbe probe_cuda_device(int index = -1);
// Every CUDA device of this machine (usable or not, each with its reason); empty without a driver or GPU.
std::vector<CudaDeviceProbe> probe_cuda_devices();

class CudaRuntime {
 public:
  // Runs on CUDA device `device` (< 0: probe_cuda_device()'s first supported one) and makes it the calling thread's
  // current device; throws kiln::Error with the probe's reason when it cannot be used.
  explicit CudaRuntime(int device);
  ~CudaRuntime();
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  const CudaDeviceProbe& device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // Waits for all queued work (and reports any CUDA error it raised).
  void synchronize();

  // ---- memory. Every size is rounded up to kAlign bytes.
  static constexpr size_t kAlign = 256;
  static size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
  // Zeroed device memory that lives as long as the runtime (KV pools, state slots).
  void* persistent(size_t bytes);
  size_t persistent_bytes() const;
  // Memory for a placed weight. Weights up to 64 MiB are placed back to back in arena chunks, in placement order
  // (the binder's: a layer's q / k / v, in_proj qkv / z / b / a, shared-expert gate / up follow each other), so that
  // CudaOps::linear_multi can run adjacent dense weights as one GEMM. bytes is added to weight_bytes().
  void* weight(size_t bytes);
  size_t weight_bytes() const { return weight_bytes_; }
  // Per-step scratch: valid until reset_scratch(). Blocks are only ever added or replaced (a new generation), so a
  // graph captured in the current generation still points at live scratch memory.
  void* scratch(size_t bytes);
  void reset_scratch();
  // model::Ops::scratch_mark / scratch_release: {blocks, used in the last block, bytes in use}.
  void scratch_mark(size_t& blocks, size_t& used, size_t& in_use) const;
  void scratch_release(size_t blocks, size_t used, size_t in_use);
  size_t scratch_peak_bytes() const { return scratch_high_water_; }
  size_t scratch_bytes() const;
  // The memory plan's activation estimate (bytes; 0: none): the first scratch block is that size, and the blocks grow
  // by an eighth of it instead of doubling (doubling overshot the plan by up to 2x and ran out of memory on a 4k pass).
  void set_scratch_plan(size_t bytes) { scratch_plan_ = bytes; }
  // Programmatic dependent launch for the kernels of the graphs this runtime captures (launch.cuh); sm_90+ only.
  void set_pdl(bool on) { pdl_ = on && device_.major >= 9; }
  bool pdl() const { return pdl_; }
  // Captured PDL launches of the bandwidth gemv prefetch their weights into L2 before waiting (linear.cu).
  void set_weight_prefetch(bool on) { weight_prefetch_ = on; }
  // A buffer reused across steps (one stream: calls never overlap), grown to at least `bytes`; growing starts a new
  // scratch generation, since a captured graph may point at the old buffer.
  void* reusable(::kiln::cuda::DeviceBuffer& buf, size_t bytes);

  // ---- CUDA graphs of whole steps (model::Ops's graph_* calls). Off while profiling.
  bool graph_capture_begin();
  int graph_capture_end();
  bool graph_launch(int handle);
  void graph_reset();
  int graphs() const;  // captured graphs alive

  // ---- profiler: an event before and after every op (OpScope), labelled; stages inside a launcher of several
  // kernels (ops::profile_mark) become nested rows.
  bool profiling() const { return profiling_; }
  bool profile_begin();
  std::vector<model::OpTime> profile_end();
  // Times one op while profiling (label made only then).
  class OpScope {
   public:
    template <typename F>
    OpScope(CudaRuntime& rt, F&& make_label) {
      if (!rt.profiling_) return;
      rt_ = &rt;
      label_ = make_label();
      begin_ = rt.record();
    }
    ~OpScope() {
      if (rt_) rt_->marks_.push_back({std::move(label_), begin_, rt_->record(), false});
    }
    OpScope(const OpScope&) = delete;
    OpScope& operator=(const OpScope&) = delete;

   private:
    CudaRuntime* rt_ = nullptr;
    std::string label_;
    size_t begin_ = 0;
  };

 private:
  size_t record();
  void destroy_graphs();

  CudaDeviceProbe device_;
  cudaStream_t stream_ = nullptr;

  std::vector<::kiln::cuda::DeviceBuffer> persistent_;
  std::vector<::kiln::cuda::DeviceBuffer> weights_;  // arena chunks and large tensors
  size_t weight_bytes_ = 0;
  char* arena_ = nullptr;
  size_t arena_size_ = 0, arena_used_ = 0;
  // A scratch block of `bytes`; kiln::Error that says what to change when the GPU has no room for it.
  void add_scratch_block(size_t bytes);
  std::vector<::kiln::cuda::DeviceBuffer> scratch_blocks_;
  size_t scratch_plan_ = 0;
  size_t scratch_used_ = 0;        // bytes used in the last block
  size_t scratch_in_use_ = 0;      // bytes of live scratch (all blocks)
  size_t scratch_high_water_ = 0;  // the most scratch_in_use_ since the last reset
  uint64_t scratch_generation_ = 0;

  bool capturing_ = false;
  bool pdl_ = false;
  bool weight_prefetch_ = false;
  struct GraphRec {
    cudaGraphExec_t exec = nullptr;
    uint64_t generation = 0;
  };
  std::vector<GraphRec> graphs_;

  bool profiling_ = false;
  std::vector<cudaEvent_t> events_;
  size_t events_used_ = 0;
  size_t last_event_ = 0;  // the latest record(): where a launcher's next stage mark starts
  struct Mark {
    std::string label;
    size_t begin, end;
    bool nested = false;  // a stage inside an op (ops::profile_mark)
  };
  std::vector<Mark> marks_;
};

}  // namespace kiln::backend::cuda
