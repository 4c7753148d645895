// The tensor-parallel all-reduce's latency at decode-step message sizes (a benchmark, not a test).
//   bench_allreduce [--ranks N] [--gpus 0,1,...] [--transport peer|nccl|auto] [--floats 4096,32768,...] [--iters K]
// N ranks (default 2), rank r on GPU gpus[r % len] (default: all on GPU 0), one thread and stream each. Each size:
// K all-reduces captured in one CUDA graph per rank (as the decode step runs them), replayed after a warm-up;
// prints microseconds per all-reduce, the median over 5 replays. Ranks sharing a GPU use the GPU-waiting kernel
// here too (the transport of distinct GPUs), so one GPU measures the kernel's own cost, without any link.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/comm_cuda.h"
#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace {

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  for (const char* p = s; *p;) {
    v.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
    else if (*p) break;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kiln;
  int ranks = 2, iters = 100;
  std::vector<int64_t> gpus = {0};
  // A decode step's all-reduce carries batch x hidden floats: 397B hidden 4096 at batch 1 / 8 / 32 / 64, then 8 MiB.
  std::vector<int64_t> sizes = {4096, 4096 * 8, 4096 * 32, 4096 * 64, 2 << 20};
  std::string transport = "peer";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--ranks") ranks = std::atoi(argv[i + 1]);
    else if (a == "--gpus") gpus = parse_list(argv[i + 1]);
    else if (a == "--floats") sizes = parse_list(argv[i + 1]);
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--transport") transport = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  try {
    backend::cuda::CudaGroupOptions o;
    for (int r = 0; r < ranks; ++r) o.devices.push_back(static_cast<int>(gpus[r % gpus.size()]));
    o.spin_on_shared_gpu = true;
    o.transport = transport == "nccl"   ? backend::cuda::CudaGroupOptions::Transport::nccl
                  : transport == "auto" ? backend::cuda::CudaGroupOptions::Transport::automatic
                                        : backend::cuda::CudaGroupOptions::Transport::peer;
    o.timeout = std::chrono::seconds(60);
    std::printf("all-reduce, %d ranks on GPUs", ranks);
    for (int d : o.devices) std::printf(" %d", d);
    std::printf(", %s: %s\n", transport.c_str(), backend::cuda::describe_cuda_group(o).c_str());
    auto comms = backend::cuda::make_cuda_group(o);
    // One buffer per rank for every size (cudaFree synchronises the device: on a shared GPU it could wait for a
    // peer's kernel that waits for this rank).
    const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
    std::vector<float*> buffers(ranks, nullptr);
    for (int64_t n : sizes) {
      std::vector<double> us(ranks);
      std::vector<std::string> err(ranks);
      std::vector<std::thread> th;
      for (int r = 0; r < ranks; ++r)
        th.emplace_back([&, r] {
          try {
            KILN_CUDA_CHECK(cudaSetDevice(o.devices[r]));
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
          } catch (const std::exception& e) {
            err[r] = e.what();
            comms[r]->abort();
          }
        });
      for (auto& t : th) t.join();
      for (int r = 0; r < ranks; ++r)
        if (!err[r].empty()) {
          std::fprintf(stderr, "rank %d: %s\n", r, err[r].c_str());
          return 1;
        }
      std::printf("floats %9lld (%8.1f KiB): %7.2f us per all-reduce (rank 0; slowest rank %7.2f)\n",
                  static_cast<long long>(n), n * 4 / 1024.0, us[0], *std::max_element(us.begin(), us.end()));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allreduce: %s\n", e.what());
    return 1;
  }
  return 0;
}
