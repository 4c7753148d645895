// CudaRuntime (runtime.h), and the launch state the launchers read (kernels.h): the profiler's stage hook.
#include "backend/cuda/runtime.h"

#include <algorithm>
#include <map>

#include "backend/cuda/kernels.h"
#include "core/error.h"
#include "core/log.h"

namespace kiln::cuda::ops {

namespace {
// Per thread: each tensor-parallel rank launches on its own thread and stream.
thread_local ProfileMarkFn g_mark_fn = nullptr;
thread_local bool g_pdl_now = false;  // inside a graph capture of a runtime with PDL on
thread_local bool g_prefetch_now = false;  // ... and with weight prefetch on
thread_local void* g_mark_ctx = nullptr;
}  // namespace

bool pdl_launches_now() { return g_pdl_now; }
void set_pdl_launches(bool on) { g_pdl_now = on; }
bool weight_prefetch_now() { return g_prefetch_now; }
void set_weight_prefetch(bool on) { g_prefetch_now = on; }

void set_profile_mark(ProfileMarkFn fn, void* ctx) {
  g_mark_fn = fn;
  g_mark_ctx = ctx;
}
void profile_mark(const char* label) {
  if (g_mark_fn) g_mark_fn(g_mark_ctx, label);
}

}  // namespace kiln::cuda::ops

namespace kiln::backend::cuda {
namespace {

namespace kops = ::kiln::cuda::ops;
using ::kiln::cuda::DeviceBuffer;

constexpr size_t kFirstScratchBytes = size_t{64} << 20;

}  // namespace

namespace {

// The probe of device i (its properties fetched); supported: the architectures kiln's kernels are built for.
CudaDeviceProbe probe_one(int i) {
  CudaDeviceProbe p;
  p.index = i;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
    cudaGetLastError();
    p.reason = fmt::format("CUDA device {} could not be queried", i);
    return p;
  }
  p.name = prop.name;
  p.major = prop.major;
  p.minor = prop.minor;
  p.multiprocessors = prop.multiProcessorCount;
  p.memory_bytes = prop.totalGlobalMem;
  const bool supported = (prop.major == 9 && prop.minor == 0) || prop.major == 12;
  if (!supported) {
    p.reason = fmt::format("compute capability {}.{} not supported ({}): kiln's CUDA kernels target sm_90a and sm_120a",
                           prop.major, prop.minor, prop.name);
    return p;
  }
  p.usable = true;
  int current = 0;
  const bool had_current = cudaGetDevice(&current) == cudaSuccess;
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) p.free_bytes = free_b;
  else cudaGetLastError();
  if (had_current && current != i) cudaSetDevice(current);
  return p;
}

// The number of CUDA devices, or 0 with the reason.
int device_count(std::string& reason) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaSuccess && n > 0) return n;
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice || err == cudaSuccess)
    reason = err == cudaErrorInsufficientDriver ? "no CUDA device (no NVIDIA driver, or one older than this "
                                                  "build's CUDA runtime)"
                                                : "no CUDA device";
  else
    reason = fmt::format("no CUDA device ({})", cudaGetErrorString(err));
  cudaGetLastError();  // clear the sticky error
  return 0;
}

}  // namespace

std::vector<CudaDeviceProbe> probe_cuda_devices() {
  std::string reason;
  const int n = device_count(reason);
  std::vector<CudaDeviceProbe> out;
  for (int i = 0; i < n; ++i) out.push_back(probe_one(i));
  return out;
}

CudaDeviceProbe probe_cuda_device(int index) {
  CudaDeviceProbe p;
  const int n = device_count(p.reason);
  if (n == 0) return p;
  if (index >= 0) {
    if (index >= n) {
      p.reason = fmt::format("CUDA device {} does not exist (this machine has {}: 0..{})", index, n, n - 1);
      return p;
    }
    return probe_one(index);
  }
  std::string found;
  for (int i = 0; i < n; ++i) {
    CudaDeviceProbe d = probe_one(i);
    if (d.usable) return d;
    if (found.empty()) found = d.reason;
  }
  p.reason = found.empty() ? std::string("no CUDA device could be queried") : found;
  return p;
}

CudaRuntime::CudaRuntime(int device) {
  device_ = probe_cuda_device(device);
  if (!device_.usable) fail("cannot use the CUDA backend: {}", device_.reason);
  KILN_CUDA_CHECK(cudaSetDevice(device_.index));
  KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CudaRuntime::~CudaRuntime() {
  if (stream_) cudaStreamSynchronize(stream_);
  destroy_graphs();
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (stream_) cudaStreamDestroy(stream_);
}

void CudaRuntime::synchronize() { KILN_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

// ---------------------------------------------------------------------------------------------------
// Memory

void* CudaRuntime::persistent(size_t bytes) {
  persistent_.emplace_back(align_up(std::max<size_t>(bytes, 1)));
  DeviceBuffer& b = persistent_.back();
  KILN_CUDA_CHECK(cudaMemsetAsync(b.data(), 0, b.size(), stream_));
  return b.data();
}

size_t CudaRuntime::persistent_bytes() const {
  size_t n = 0;
  for (const DeviceBuffer& b : persistent_) n += b.size();
  return n;
}

void* CudaRuntime::weight(size_t bytes) {
  weight_bytes_ += bytes;
  constexpr size_t kArenaMaxTensor = size_t(64) << 20, kArenaMaxChunk = size_t(256) << 20;
  bytes = align_up(std::max<size_t>(bytes, 1));
  if (bytes > kArenaMaxTensor) {
    weights_.emplace_back(bytes);
    return weights_.back().data();
  }
  if (!arena_ || arena_used_ + bytes > arena_size_) {
    // Chunks double from 16 MiB to 256 MiB: small models reserve little, large ones waste at most a tail.
    const size_t chunk = std::max(bytes, std::clamp<size_t>(2 * arena_size_, size_t(16) << 20, kArenaMaxChunk));
    weights_.emplace_back(chunk);
    arena_ = static_cast<char*>(weights_.back().data());
    arena_size_ = chunk;
    arena_used_ = 0;
  }
  void* p = arena_ + arena_used_;
  arena_used_ += bytes;
  return p;
}

void CudaRuntime::add_scratch_block(size_t bytes) {
  DeviceBuffer b;
  const cudaError_t e = DeviceBuffer::try_allocate(bytes, b);
  if (e != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    cudaGetLastError();
    const double G = 1024.0 * 1024.0 * 1024.0;
    fail("out of GPU memory for a pass's activations: {:.2f} GiB more were needed on GPU {} ({:.2f} GiB of scratch "
         "held, {:.2f} GiB free; the memory plan estimated {:.2f} GiB; {}). Lower --max-pass-tokens or "
         "--chunked-prefill-size (smaller passes), or --mem-fraction-static (more room outside the plan)",
         bytes / G, device_.index, scratch_bytes() / G, free_b / G, scratch_plan_ / G, cudaGetErrorString(e));
  }
  scratch_blocks_.push_back(std::move(b));
}

void* CudaRuntime::scratch(size_t bytes) {
  bytes = align_up(std::max<size_t>(bytes, 1));
  if (scratch_blocks_.empty() || scratch_used_ + bytes > scratch_blocks_.back().size()) {
    const size_t last = scratch_blocks_.empty() ? 0 : scratch_blocks_.back().size();
    // With a plan: the first block is the plan's estimate, later ones (the estimate was short) an eighth of it each,
    // so the blocks add up to little more than the need. Without: doubling.
    size_t want = std::max({bytes, kFirstScratchBytes, 2 * last});
    if (scratch_plan_ > 0)
      want = scratch_blocks_.empty() ? std::max(bytes, align_up(scratch_plan_))
                                     : std::max({bytes, kFirstScratchBytes, align_up(scratch_plan_ / 8)});
    add_scratch_block(want);
    scratch_used_ = 0;
    ++scratch_generation_;
  }
  void* p = static_cast<char*>(scratch_blocks_.back().data()) + scratch_used_;
  scratch_used_ += bytes;
  scratch_in_use_ += bytes;
  scratch_high_water_ = std::max(scratch_high_water_, scratch_in_use_);
  return p;
}

void CudaRuntime::scratch_mark(size_t& blocks, size_t& used, size_t& in_use) const {
  blocks = scratch_blocks_.size();
  used = scratch_used_;
  in_use = scratch_in_use_;
}

void CudaRuntime::scratch_release(size_t blocks, size_t used, size_t in_use) {
  // Kernels queued on the released memory run before any later kernel of this stream, so reuse needs no wait.
  // Blocks added since the mark hold only released memory: the newest is reused from its start.
  scratch_used_ = scratch_blocks_.size() == blocks ? used : 0;
  scratch_in_use_ = in_use;
}

void CudaRuntime::reset_scratch() {
  if (scratch_blocks_.size() > 1) {
    // Next step: one block big enough for the most the last step held at once. Queued kernels may still read the
    // old blocks: wait for them before freeing.
    synchronize();
    const size_t total = align_up(scratch_high_water_ + (size_t{1} << 20));
    scratch_blocks_.clear();
    add_scratch_block(std::max(total, kFirstScratchBytes));
    ++scratch_generation_;
  }
  scratch_used_ = 0;
  scratch_in_use_ = 0;
  scratch_high_water_ = 0;
}

size_t CudaRuntime::scratch_bytes() const {
  size_t n = 0;
  for (const DeviceBuffer& b : scratch_blocks_) n += b.size();
  return n;
}

void* CudaRuntime::reusable(DeviceBuffer& b, size_t bytes) {
  if (b.size() < bytes) {
    if (b.data()) KILN_CUDA_CHECK(cudaStreamSynchronize(stream_));
    b = DeviceBuffer(align_up(bytes + bytes / 4));
    ++scratch_generation_;
  }
  return b.data();
}

// ---------------------------------------------------------------------------------------------------
// Step graphs

bool CudaRuntime::graph_capture_begin() {
  if (profiling_) return false;
  // Relaxed: a scratch block allocated mid-capture (cudaMalloc) is allowed; it bumps the generation, so the graph
  // goes stale at the next consolidation instead of pointing at freed memory.
  KILN_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
  capturing_ = true;
  kops::set_pdl_launches(pdl_);
  kops::set_weight_prefetch(pdl_ && weight_prefetch_);
  return true;
}

int CudaRuntime::graph_capture_end() {
  if (!capturing_) return -1;
  capturing_ = false;
  kops::set_pdl_launches(false);
  kops::set_weight_prefetch(false);
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(stream_, &graph);
  if (err != cudaSuccess || !graph) {
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    KILN_LOG_WARN("CUDA graph capture failed ({}); running this step shape eagerly", cudaGetErrorString(err));
    return -1;
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ierr = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (ierr != cudaSuccess) {
    cudaGetLastError();
    KILN_LOG_WARN("CUDA graph instantiation failed ({}); running this step shape eagerly", cudaGetErrorString(ierr));
    return -1;
  }
  graphs_.push_back({exec, scratch_generation_});
  return static_cast<int>(graphs_.size()) - 1;
}

bool CudaRuntime::graph_launch(int handle) {
  if (handle < 0 || handle >= static_cast<int>(graphs_.size())) return false;
  GraphRec& g = graphs_[handle];
  if (!g.exec) return false;
  if (g.generation != scratch_generation_) {
    cudaGraphExecDestroy(g.exec);
    g.exec = nullptr;
    return false;
  }
  KILN_CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
  return true;
}

void CudaRuntime::graph_reset() {
  synchronize();
  destroy_graphs();
}

int CudaRuntime::graphs() const {
  int n = 0;
  for (const GraphRec& g : graphs_) n += g.exec != nullptr;
  return n;
}

void CudaRuntime::destroy_graphs() {
  for (GraphRec& g : graphs_)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
}

// ---------------------------------------------------------------------------------------------------
// Profiling

size_t CudaRuntime::record() {
  if (events_used_ == events_.size()) {
    cudaEvent_t e;
    KILN_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  KILN_CUDA_CHECK(cudaEventRecord(events_[events_used_], stream_));
  last_event_ = events_used_;
  return events_used_++;
}

bool CudaRuntime::profile_begin() {
  synchronize();
  profiling_ = true;
  marks_.clear();
  events_used_ = 0;
  // Stages inside a launcher (kops::profile_mark): nested rows, from the previous event to this one.
  kops::set_profile_mark(
      [](void* ctx, const char* label) {
        auto& rt = *static_cast<CudaRuntime*>(ctx);
        const size_t begin = rt.last_event_;
        rt.marks_.push_back({std::string("  . ") + label, begin, rt.record(), true});
      },
      this);
  // Hold the GPU while the host queues the step: the ops then run back to back, as in a graph, and each
  // op's events time its kernels rather than the launch gaps.
  kops::busy_wait(50000.0, stream_);
  return true;
}

std::vector<model::OpTime> CudaRuntime::profile_end() {
  synchronize();
  profiling_ = false;
  kops::set_profile_mark(nullptr, nullptr);
  std::vector<model::OpTime> out;
  std::map<std::string, size_t> index;
  for (const Mark& m : marks_) {
    float ms = 0.0f;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[m.begin], events_[m.end]));
    auto [it, inserted] = index.emplace(m.label, out.size());
    if (inserted) out.push_back({m.label, 0, 0.0, m.nested});
    out[it->second].calls += 1;
    out[it->second].total_us += ms * 1000.0;
  }
  marks_.clear();
  events_used_ = 0;
  return out;
}

}  // namespace kiln::backend::cuda
