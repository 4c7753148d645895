// The CUDA tensor-parallel group (comm_cuda.h): the peer transport over allreduce.cu, NCCL through dlopen, and the
// host barrier both share (backend/comm_local.h's group, for barrier / time-out / abort).
#include "backend/cuda/comm_cuda.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "backend/comm_local.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/device.h"
#include "core/error.h"
#include "core/log.h"

namespace kiln::backend::cuda {
namespace {

namespace kops = ::kiln::cuda::ops;

// Floats per half of a rank's exchange buffer: a larger all-reduce runs in pieces of this size.
constexpr int64_t kPeerCapacity = int64_t(4) << 20;

// Sets the calling thread's current device for a scope.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&saved_) != cudaSuccess) {
      cudaGetLastError();
      saved_ = -1;
    }
    KILN_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() {
    if (saved_ >= 0) cudaSetDevice(saved_);
  }

 private:
  int saved_ = -1;
};

// ---------------------------------------------------------------------------------------------------
// NCCL, loaded at run time: kiln runs without it (one GPU, or ranks on the peer transport).

struct Nccl {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  std::string error;  // why it is not usable (empty: usable)
  int version = 0;

  static const Nccl& get() {
    static const Nccl n = load();
    return n;
  }

 private:
  static Nccl load() {
    Nccl n;
    void* h = nullptr;
    for (const char* name : {"libnccl.so.2", "libnccl.so"})
      if ((h = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
    if (!h) {
      n.error = fmt::format("libnccl.so.2 not found ({}); install NCCL (e.g. the libnccl2 package or the CUDA "
                            "toolkit's) or keep every rank on the peer transport",
                            dlerror());
      return n;
    }
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn) {
        ok = false;
        n.error = fmt::format("libnccl.so.2 lacks {} (too old an NCCL: 2.18 or newer is needed)", name);
      }
    };
    sym(n.get_version, "ncclGetVersion");
    sym(n.get_unique_id, "ncclGetUniqueId");
    sym(n.init_rank_config, "ncclCommInitRankConfig");
    sym(n.get_async_error, "ncclCommGetAsyncError");
    sym(n.abort, "ncclCommAbort");
    sym(n.destroy, "ncclCommDestroy");
    sym(n.all_reduce, "ncclAllReduce");
    sym(n.all_gather, "ncclAllGather");
    sym(n.group_start, "ncclGroupStart");
    sym(n.group_end, "ncclGroupEnd");
    sym(n.error_string, "ncclGetErrorString");
    if (ok && n.get_version(&n.version) != ncclSuccess) n.error = "ncclGetVersion failed";
    return n;
  }
};

std::string nccl_version_str(int v) { return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100); }

void nccl_check(const Nccl& n, ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress)
    fail("NCCL {} failed: {} (set NCCL_DEBUG=WARN for NCCL's own account)", what, n.error_string(r));
}

// Waits until a non-blocking communicator's last call has been enqueued (or its init finished).
void nccl_wait(const Nccl& n, ncclComm_t comm, const char* what,
               std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max()) {
  for (;;) {
    ncclResult_t st = ncclSuccess;
    nccl_check(n, n.get_async_error(comm, &st), what);
    if (st == ncclSuccess) return;
    if (st != ncclInProgress) fail("NCCL {} failed: {}", what, n.error_string(st));
    if (std::chrono::steady_clock::now() > deadline) {
      n.abort(comm);
      fail("NCCL {} did not finish in time (a GPU or peer hangs; NCCL_DEBUG=INFO shows where)", what);
    }
    std::this_thread::yield();
  }
}

// ---------------------------------------------------------------------------------------------------
// The group's shared state.

struct PeerState {
  int n = 0;
  bool spin = true;  // the GPU-waiting kernel; false: host-coordinated (ranks share a GPU)
  std::vector<int> devices;
  kops::PeerAllReduceArgs args;  // rank field set per communicator
  std::vector<void*> allocations;  // device memory to free (exchange, flags, counters), with its device
  std::vector<int> allocation_devices;
  uint32_t* abort_word = nullptr;  // mapped host memory

  ~PeerState() {
    for (size_t i = 0; i < allocations.size(); ++i) {
      cudaSetDevice(allocation_devices[i]);
      cudaFree(allocations[i]);
    }
    if (abort_word) cudaFreeHost(abort_word);
  }
  void* alloc(int device, size_t bytes) {
    DeviceScope on(device);
    void* p = nullptr;
    KILN_CUDA_CHECK(cudaMalloc(&p, bytes));
    allocations.push_back(p);
    allocation_devices.push_back(device);
    KILN_CUDA_CHECK(cudaMemset(p, 0, bytes));
    return p;
  }
};

struct NcclState {
  std::vector<ncclComm_t> comms;
  std::vector<int> devices;
  ~NcclState() {
    const Nccl& n = Nccl::get();
    for (size_t r = 0; r < comms.size(); ++r)
      if (comms[r]) {
        cudaSetDevice(devices[r]);
        n.destroy(comms[r]);
      }
  }
};

class CudaComm final : public model::Communicator {
 public:
  CudaComm(int rank, int size, std::shared_ptr<PeerState> peer, std::shared_ptr<NcclState> nccl,
           int64_t peer_max_bytes, std::unique_ptr<model::Communicator> host)
      : rank_(rank), size_(size), peer_(std::move(peer)), nccl_(std::move(nccl)), peer_max_bytes_(peer_max_bytes),
        host_(std::move(host)) {
    if (peer_) {
      args_ = peer_->args;
      args_.rank = rank;
    }
  }
  ~CudaComm() override {
    for (cudaEvent_t e : {ready_, done_})
      if (e) cudaEventDestroy(e);
  }

  // Several machines: this process's ranks are a part of a larger NCCL group (rank_ / size_ stay the local index
  // and count: the peer state, the gather table and nccl_->comms are this process's).
  void set_global(int rank, int size) {
    global_rank_ = rank;
    global_size_ = size;
  }
  int rank() const override { return global_rank_ >= 0 ? global_rank_ : rank_; }
  int size() const override { return global_size_ > 0 ? global_size_ : size_; }

  void all_reduce_sum(float* data, int64_t count, void* stream) override {
    if (size() == 1 || count == 0) return;
    auto s = static_cast<cudaStream_t>(stream);
    const bool use_peer = peer_ && (!nccl_ || count * 4 <= peer_max_bytes_);
    if (use_peer && peer_->spin) {
      for (int64_t off = 0; off < count; off += kPeerCapacity)
        kops::peer_all_reduce(args_, data + off, std::min(kPeerCapacity, count - off), s);
    } else if (use_peer) {
      for (int64_t off = 0; off < count; off += kPeerCapacity)
        hosted_all_reduce(data + off, std::min(kPeerCapacity, count - off), s);
    } else {
      const Nccl& n = Nccl::get();
      nccl_check(n, n.all_reduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclSum, nccl_->comms[rank_], s),
                 "all-reduce");
      nccl_wait(n, nccl_->comms[rank_], "all-reduce");
    }
    if (!stream) KILN_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }

  // out[r * bytes, (r + 1) * bytes) = rank r's in. NCCL when the group has it; else every rank copies from its
  // peers' buffers after a host barrier (not graph-capturable: the forward never gathers inside a graph).
  void all_gather(const void* in, int64_t bytes, void* out, void* stream) override {
    auto s = static_cast<cudaStream_t>(stream);
    if (nccl_) {
      const Nccl& n = Nccl::get();
      nccl_check(n, n.all_gather(in, out, static_cast<size_t>(bytes), ncclUint8, nccl_->comms[rank_], s), "all-gather");
      nccl_wait(n, nccl_->comms[rank_], "all-gather");
    } else {
      post_and_meet(in, s);
      for (int r = 0; r < size_; ++r) {
        const Post& p = *gather_table()[r];
        if (r != rank_) KILN_CUDA_CHECK(cudaStreamWaitEvent(s, p.ready, 0));
        KILN_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out) + r * bytes, p.in, static_cast<size_t>(bytes),
                                        cudaMemcpyDefault, s));
      }
      // Nobody's input may change before every peer has copied it.
      wait_until_all_have_read(s);
      host_->barrier();
    }
    if (!stream) KILN_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }

  void barrier() override { host_->barrier(); }
  bool capturable() const override { return !peer_ || peer_->spin; }
  void set_timeout(std::chrono::milliseconds t) override {
    host_->set_timeout(t);
    if (peer_) args_.timeout_ns = static_cast<uint64_t>(t.count()) * 1000000ull;
  }
  void abort() override {
    host_->abort();
    if (peer_) *reinterpret_cast<volatile uint32_t*>(peer_->abort_word) = 1;
  }
  void reset() override {
    host_->reset();
    if (peer_) *reinterpret_cast<volatile uint32_t*>(peer_->abort_word) = 0;
  }

  // Ranks on one GPU: every rank's data ready (events) -> host barrier -> each rank sums all ranks' data in rank
  // order into its exchange buffer -> host barrier (every rank has read every input) -> copy back.
  void hosted_all_reduce(float* data, int64_t n, cudaStream_t s) {
    post_and_meet(data, s);
    kops::PeerInputs in;
    in.nranks = size_;
    for (int r = 0; r < size_; ++r) {
      const Post& p = *gather_table()[r];
      if (r != rank_) KILN_CUDA_CHECK(cudaStreamWaitEvent(s, p.ready, 0));
      in.in[r] = static_cast<const float*>(p.in);
    }
    float* sum = args_.exchange[rank_];
    kops::sum_rank_buffers(in, n, sum, s);
    wait_until_all_have_read(s);
    KILN_CUDA_CHECK(cudaMemcpyAsync(data, sum, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, s));
    // No third barrier: the posted pointers are read before the second one, and a rank re-records its events only
    // after every peer has passed it (and enqueued its waits on them).
  }

  // Posts this rank's buffer with an event marking it ready on `s`, then meets every rank on the host: after it,
  // gather_table()[r] holds rank r's post.
  void post_and_meet(const void* in, cudaStream_t s) {
    if (!ready_) {
      KILN_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      KILN_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    }
    KILN_CUDA_CHECK(cudaEventRecord(ready_, s));
    post_.in = in;
    post_.ready = ready_;
    post_.done = done_;
    gather_table()[rank_] = &post_;
    host_->barrier();
  }
  // After this rank's reads of its peers' posted buffers (enqueued on `s`): marks them done, meets every rank, and
  // makes `s` wait until every peer has finished reading this rank's buffer.
  void wait_until_all_have_read(cudaStream_t s) {
    KILN_CUDA_CHECK(cudaEventRecord(done_, s));
    host_->barrier();
    for (int r = 0; r < size_; ++r)
      if (r != rank_) KILN_CUDA_CHECK(cudaStreamWaitEvent(s, gather_table()[r]->done, 0));
  }

  // Shared by the group's communicators: each rank's posted all-gather input.
  struct Post {
    const void* in = nullptr;
    cudaEvent_t ready = nullptr, done = nullptr;
  };
  std::vector<Post*>& gather_table() { return *table_; }
  void set_gather_table(std::shared_ptr<std::vector<Post*>> t) { table_ = std::move(t); }
  void set_counter(uint32_t* counter) { args_.counter = counter; }

 private:
  int rank_, size_;
  int global_rank_ = -1, global_size_ = 0;
  std::shared_ptr<PeerState> peer_;
  std::shared_ptr<NcclState> nccl_;
  int64_t peer_max_bytes_;
  std::unique_ptr<model::Communicator> host_;
  kops::PeerAllReduceArgs args_;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  Post post_;
  std::shared_ptr<std::vector<Post*>> table_;
};

// Which transports a group of these options gets (and why not the others).
struct Plan {
  bool peer = false, nccl = false;
  std::string why_not_peer, why_not_nccl;
};

Plan plan_group(const CudaGroupOptions& o) {
  Plan p;
  const std::vector<int>& d = o.devices;
  const std::set<int> distinct(d.begin(), d.end());
  const bool shared_gpu = distinct.size() < d.size();
  // Peer: every pair of distinct devices must map each other's memory.
  p.peer = static_cast<int>(d.size()) <= kops::kPeerMaxRanks;
  if (!p.peer) p.why_not_peer = fmt::format("more than {} ranks", kops::kPeerMaxRanks);
  for (int a : distinct)
    for (int b : distinct) {
      if (a == b || !p.peer) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess) {
        cudaGetLastError();
        can = 0;
      }
      if (!can) {
        p.peer = false;
        p.why_not_peer = fmt::format("GPU {} cannot access GPU {}'s memory (no peer access)", a, b);
      }
    }
  std::string reason;
  p.nccl = !shared_gpu && nccl_available(&reason);
  if (shared_gpu) p.why_not_nccl = "ranks share a GPU (NCCL needs one GPU per rank)";
  else if (!p.nccl) p.why_not_nccl = reason;
  if (o.transport == CudaGroupOptions::Transport::peer) p.nccl = false;
  if (o.transport == CudaGroupOptions::Transport::nccl) p.peer = false;
  return p;
}

std::string device_list(const std::vector<int>& d) {
  std::string s;
  for (size_t i = 0; i < d.size(); ++i) s += fmt::format("{}{}", i ? "," : "", d[i]);
  return s;
}

}  // namespace

bool nccl_available(std::string* reason) {
  const Nccl& n = Nccl::get();
  if (reason) *reason = n.error.empty() ? "NCCL " + nccl_version_str(n.version) : n.error;
  return n.error.empty();
}

std::string describe_cuda_group(const CudaGroupOptions& o) {
  if (o.devices.size() <= 1) return "one rank (no collectives)";
  const Plan p = plan_group(o);
  std::string v;
  nccl_available(&v);
  if (p.peer && p.nccl)
    return fmt::format("all-reduce: one-shot over peer memory up to {} KiB, {} above", o.peer_max_bytes >> 10, v);
  if (p.peer) return fmt::format("all-reduce: one-shot over peer memory (NCCL not used: {})", p.why_not_nccl);
  if (p.nccl) return fmt::format("all-reduce: {} (peer transport not used: {})", v, p.why_not_peer);
  return "no transport";
}

std::vector<uint8_t> nccl_unique_id() {
  const Nccl& lib = Nccl::get();
  if (!lib.error.empty()) fail("tensor parallel over several machines needs NCCL: {}", lib.error);
  ncclUniqueId id;
  nccl_check(lib, lib.get_unique_id(&id), "unique id");
  const auto* b = reinterpret_cast<const uint8_t*>(&id);
  return std::vector<uint8_t>(b, b + sizeof(id));
}

std::vector<std::unique_ptr<model::Communicator>> make_cuda_group(const CudaGroupOptions& o) {
  const int n = static_cast<int>(o.devices.size());
  if (n < 1) fail("a tensor-parallel group needs at least 1 rank");
  const bool several = o.world_size > 0;  // this process's ranks are part of a group over several machines
  if (several) {
    if (o.first_rank < 0 || o.first_rank + n > o.world_size)
      fail("tensor parallel: ranks {}..{} are outside the group of {}", o.first_rank, o.first_rank + n - 1,
           o.world_size);
    if (o.nccl_id.size() != sizeof(ncclUniqueId))
      fail("tensor parallel over several machines: NCCL id of {} bytes from node 0, {} expected (different NCCL "
           "versions on the nodes?)", o.nccl_id.size(), sizeof(ncclUniqueId));
    if (std::set<int>(o.devices.begin(), o.devices.end()).size() != o.devices.size())
      fail("tensor parallel over several machines runs on NCCL, which needs one GPU per rank: --gpu-id-step 0 (ranks "
           "sharing a GPU) works on one machine only");
    std::string why;
    if (!nccl_available(&why)) fail("tensor parallel over several machines needs NCCL: {}", why);
  }
  Plan plan = n > 1 ? plan_group(o) : Plan{};
  if (several) {
    // Across machines every collective is NCCL's (the peer transport joins GPUs of one machine only).
    plan.peer = false;
    plan.nccl = true;
  }
  if (n > 1 && !plan.peer && !plan.nccl)
    fail("tensor parallel over GPUs {}: no transport joins them: {}; {}", device_list(o.devices),
         plan.why_not_peer.empty() ? "peer transport not chosen" : plan.why_not_peer,
         plan.why_not_nccl.empty() ? "NCCL not chosen (drop --disable-custom-all-reduce)" : plan.why_not_nccl);

  std::shared_ptr<PeerState> peer;
  if (n > 1 && plan.peer) {
    peer = std::make_shared<PeerState>();
    peer->n = n;
    peer->spin = o.spin_on_shared_gpu || std::set<int>(o.devices.begin(), o.devices.end()).size() == o.devices.size();
    peer->devices = o.devices;
    // Peer access between the distinct devices (both directions).
    const std::set<int> distinct(o.devices.begin(), o.devices.end());
    for (int a : distinct) {
      DeviceScope on(a);
      for (int b : distinct) {
        if (a == b) continue;
        const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
        else KILN_CUDA_CHECK(err);
      }
    }
    kops::PeerAllReduceArgs& a = peer->args;
    a.nranks = n;
    a.capacity = kPeerCapacity;
    for (int r = 0; r < n; ++r) {
      a.exchange[r] = static_cast<float*>(peer->alloc(o.devices[r], static_cast<size_t>(2 * kPeerCapacity) * 4));
      a.flags[r] = static_cast<uint32_t*>(peer->alloc(o.devices[r], kops::kPeerBlocks * kops::kPeerMaxRanks * 4));
    }
    {
      DeviceScope on(o.devices[0]);
      KILN_CUDA_CHECK(cudaHostAlloc(&peer->abort_word, 4, cudaHostAllocMapped | cudaHostAllocPortable));
      *peer->abort_word = 0;
    }
    a.abort = peer->abort_word;  // unified addressing: the host pointer is the device pointer
    a.timeout_ns = static_cast<uint64_t>(o.timeout.count()) * 1000000ull;
    for (int d : o.devices) {  // the kernels' code on every device now, not at a first launch (lazy loading)
      DeviceScope on(d);
      kops::preload_all_reduce_kernels();
    }
  }

  std::shared_ptr<NcclState> nccl;
  if ((n > 1 || several) && plan.nccl) {
    const Nccl& lib = Nccl::get();
    // kiln's NCCL settings (backend/device.h: NVLink multicast off), each only where the user left it unset; the
    // startup summary says which were kiln's and which the user's (cli/environment.h).
    for (const EnvDefault& e : nccl_env_defaults()) setenv(e.name, e.value, /*overwrite=*/0);
    ncclUniqueId id;
    if (several) std::memcpy(&id, o.nccl_id.data(), sizeof(id));  // node 0's, from the rendezvous
    else nccl_check(lib, lib.get_unique_id(&id), "unique id");
    const int world = several ? o.world_size : n, base = several ? o.first_rank : 0;
    nccl = std::make_shared<NcclState>();
    nccl->comms.assign(n, nullptr);
    nccl->devices = o.devices;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init polled below, with a deadline
    nccl_check(lib, lib.group_start(), "group start");
    for (int r = 0; r < n; ++r) {
      DeviceScope on(o.devices[r]);
      nccl_check(lib, lib.init_rank_config(&nccl->comms[r], world, id, base + r, &config), "communicator init");
    }
    nccl_check(lib, lib.group_end(), "communicator init");
    const auto deadline = std::chrono::steady_clock::now() + o.timeout;
    for (int r = 0; r < n; ++r) nccl_wait(lib, nccl->comms[r], "communicator init", deadline);
  }

  auto host = make_local_group(n, o.timeout);
  auto table = std::make_shared<std::vector<CudaComm::Post*>>(n, nullptr);
  std::vector<std::unique_ptr<model::Communicator>> out;
  for (int r = 0; r < n; ++r) {
    auto c = std::make_unique<CudaComm>(r, n, peer, nccl, o.peer_max_bytes, std::move(host[r]));
    if (several) c->set_global(o.first_rank + r, o.world_size);
    c->set_gather_table(table);
    if (peer) {
      DeviceScope on(o.devices[r]);
      void* counter = peer->alloc(o.devices[r], kops::kPeerBlocks * 4);
      c->set_counter(static_cast<uint32_t*>(counter));
    }
    out.push_back(std::move(c));
  }
  return out;
}

namespace {

// A rank timed alone: its all-reduces become one device copy of the same size (into a buffer of its own).
class CopyComm final : public model::Communicator {
 public:
  CopyComm(int rank, int size) : rank_(rank), size_(size) {}
  ~CopyComm() override {
    if (buf_) cudaFree(buf_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(float* data, int64_t count, void* stream) override {
    const size_t bytes = static_cast<size_t>(count) * 4;
    if (bytes > cap_) {
      if (buf_) {
        KILN_CUDA_CHECK(cudaDeviceSynchronize());
        cudaFree(buf_);
      }
      cap_ = std::max(bytes, size_t(64) << 20);
      KILN_CUDA_CHECK(cudaMalloc(&buf_, cap_));
    }
    KILN_CUDA_CHECK(cudaMemcpyAsync(buf_, data, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  }
  void all_gather(const void* in, int64_t bytes, void* out, void* stream) override {
    for (int r = 0; r < size_; ++r)
      KILN_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out) + r * bytes, in, static_cast<size_t>(bytes),
                                      cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
  }
  void barrier() override {}
  void set_timeout(std::chrono::milliseconds) override {}
  void abort() override {}
  void reset() override {}

 private:
  int rank_, size_;
  void* buf_ = nullptr;
  size_t cap_ = 0;
};

}  // namespace

std::unique_ptr<model::Communicator> make_copy_communicator(int rank, int size) {
  return std::make_unique<CopyComm>(rank, size);
}

std::vector<AllReduceTiming> time_all_reduce(const CudaGroupOptions& options, const std::vector<int64_t>& floats,
                                             int iters) {
  if (floats.empty()) return {};
  if (iters < 1) fail("time_all_reduce: {} all-reduces per graph", iters);
  const int ranks = static_cast<int>(options.devices.size());
  auto comms = make_cuda_group(options);
  // One buffer per rank for every size, freed once every rank is done (cudaFree synchronises the device: on a shared
  // GPU it could wait for a peer's kernel that waits for this rank).
  const int64_t largest = *std::max_element(floats.begin(), floats.end());
  std::vector<float*> buffers(ranks, nullptr);
  auto free_buffers = [&] {
    for (int r = 0; r < ranks; ++r)
      if (buffers[r]) {
        DeviceScope on(options.devices[r]);
        cudaFree(buffers[r]);
        buffers[r] = nullptr;
      }
  };
  std::vector<AllReduceTiming> out;
  for (int64_t n : floats) {
    std::vector<double> us(ranks);
    std::vector<std::string> err(ranks);
    std::atomic<int> first_failed{-1};
    std::vector<std::thread> th;
    for (int r = 0; r < ranks; ++r)
      th.emplace_back([&, r] {
        try {
          KILN_CUDA_CHECK(cudaSetDevice(options.devices[r]));
          cudaStream_t s;
          KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
          float*& d = buffers[r];
          if (!d) KILN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d), static_cast<size_t>(largest) * 4));
          // Nobody launches before every rank has allocated (an allocation waits for the GPU's running kernels).
          comms[r]->barrier();
          KILN_CUDA_CHECK(cudaMemsetAsync(d, 0, static_cast<size_t>(n) * 4, s));
          cudaGraph_t g;
          cudaGraphExec_t exec;
          KILN_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
          for (int i = 0; i < iters; ++i) comms[r]->all_reduce_sum(d, n, s);
          KILN_CUDA_CHECK(cudaStreamEndCapture(s, &g));
          KILN_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
          KILN_CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up
          KILN_CUDA_CHECK(cudaStreamSynchronize(s));
          std::vector<double> t;
          for (int rep = 0; rep < 5; ++rep) {
            comms[r]->barrier();
            const auto t0 = std::chrono::steady_clock::now();
            KILN_CUDA_CHECK(cudaGraphLaunch(exec, s));
            KILN_CUDA_CHECK(cudaStreamSynchronize(s));
            t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
                        iters);
          }
          std::sort(t.begin(), t.end());
          us[r] = t[2];
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(g);
          cudaStreamDestroy(s);
        } catch (const model::GroupAborted& e) {  // another rank's error stopped this one
          err[r] = e.what();
        } catch (const std::exception& e) {
          err[r] = e.what();
          int none = -1;
          first_failed.compare_exchange_strong(none, r);
          comms[r]->abort();
        }
      });
    for (auto& t : th) t.join();
    for (int r = 0; r < ranks; ++r)
      if (!err[r].empty()) {
        const int why = first_failed.load() >= 0 ? first_failed.load() : r;
        free_buffers();
        fail("all-reduce timing of {} floats, rank {} of {}: {}", n, why, ranks, err[why]);
      }
    out.push_back({n, us[0], *std::max_element(us.begin(), us.end())});
  }
  free_buffers();
  return out;
}

}  // namespace kiln::backend::cuda
