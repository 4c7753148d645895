// The tensor-parallel all-reduce's latency at decode-step message sizes (a benchmark, not a test).
//   bench_allreduce [--ranks N] [--gpus 0,1,...] [--transport peer|nccl|auto] [--floats 4096,32768,...] [--iters K]
// N ranks (default 2), rank r on GPU gpus[r % len] (default: all on GPU 0), one thread and stream each. Each size:
// K all-reduces captured in one CUDA graph per rank (as the decode step runs them), replayed after a warm-up;
// prints microseconds per all-reduce, the median over 5 replays. Ranks sharing a GPU use the GPU-waiting kernel
// here too (the transport of distinct GPUs), so one GPU measures the kernel's own cost, without any link.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/comm_cuda.h"
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
    // The measuring is backend::cuda::time_all_reduce (kiln bench-engine --single-rank uses it too).
    for (const auto& t : backend::cuda::time_all_reduce(o, sizes, iters))
      std::printf("floats %9lld (%8.1f KiB): %7.2f us per all-reduce (rank 0; slowest rank %7.2f)\n",
                  static_cast<long long>(t.floats), t.floats * 4 / 1024.0, t.rank0_us, t.slowest_us);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_allreduce: %s\n", e.what());
    return 1;
  }
  return 0;
}
