// The CUDA communicators (comm_cuda.h) and tensor parallelism on CUDA over them, on one GPU (NCCL refuses two
// ranks on one GPU; the peer transport does not):
//  - the peer all-reduce (comm_cuda.h) against the rank-order sum done on the host, bit for bit, for the GPU-waiting
//    kernel (eager and replayed from CUDA graphs) and for the host-coordinated form of ranks sharing a GPU;
//  - whole models split over ranks on one GPU (backend::load_model with --gpu-id-step 0: the host-coordinated
//    transport, eager steps) against the same model on one rank: greedy tokens identical, logits close, on every
//    transformers fixture the split fits and on kiln-tiny, with --ep-size on the MoE models. (The GPU-waiting
//    kernel cannot run a whole model on one shared GPU: the runner's allocations mid-step wait for the GPU's
//    running kernels, which would be peers waiting for the allocating rank. It is checked at the collective level.)
// Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "reference_fixture.h"
#include "backend/cuda/comm_cuda.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/device.h"
#include "core/error.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/shard_plan.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

// ---------------------------------------------------------------------------------------------------
// The collective

// Every rank r holds x_r (seeded by r and the call); after the all-reduce each must hold ((x_0 + x_1) + x_2) ...
// computed here in float, bit for bit.
void check_all_reduce(int n, bool spin, bool graphs, const std::vector<int64_t>& sizes) {
  CudaGroupOptions o;
  o.devices.assign(n, probe_cuda_device().index);
  o.spin_on_shared_gpu = spin;
  o.transport = CudaGroupOptions::Transport::peer;
  o.timeout = std::chrono::seconds(60);
  auto comms = make_cuda_group(o);
  ASSERT_EQ(static_cast<int>(comms.size()), n);
  EXPECT_EQ(comms[0]->capturable(), spin);
  auto input = [](int r, int call, int64_t i) {
    return static_cast<float>(std::sin(0.37 * static_cast<double>(i) + r * 1.3 + call * 0.11) * (1 + r));
  };
  std::vector<std::string> failures(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        KILN_CUDA_CHECK(cudaSetDevice(o.devices[r]));
        cudaStream_t s;
        KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        int call = 0;
        // One buffer for every size: cudaMalloc / cudaFree wait for the device's running kernels, and on a shared
        // GPU those may be a peer's all-reduce waiting for this rank (the hazard the host-coordinated form avoids).
        float* d = nullptr;
        KILN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d), static_cast<size_t>(
                                                                     *std::max_element(sizes.begin(), sizes.end())) *
                                                                     4));
        // Every rank allocated before any launches: a device allocation waits for the GPU's running kernels, and
        // on a shared GPU those may be peers waiting for this rank.
        comms[r]->barrier();
        for (int64_t count : sizes) {
          std::vector<float> host(count), got(count), want(count);
          cudaGraphExec_t exec = nullptr;
          if (graphs) {
            cudaGraph_t g;
            KILN_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
            comms[r]->all_reduce_sum(d, count, s);
            KILN_CUDA_CHECK(cudaStreamEndCapture(s, &g));
            KILN_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
            cudaGraphDestroy(g);
          }
          // Instantiating (and destroying) a graph may allocate or free device memory, which waits for the GPU's
          // running kernels: nobody launches until every rank is past it.
          comms[r]->barrier();
          for (int rep = 0; rep < 3; ++rep, ++call) {
            for (int64_t i = 0; i < count; ++i) host[i] = input(r, call, i);
            KILN_CUDA_CHECK(cudaMemcpyAsync(d, host.data(), count * 4, cudaMemcpyHostToDevice, s));
            if (exec) KILN_CUDA_CHECK(cudaGraphLaunch(exec, s));
            else comms[r]->all_reduce_sum(d, count, s);
            KILN_CUDA_CHECK(cudaMemcpyAsync(got.data(), d, count * 4, cudaMemcpyDeviceToHost, s));
            KILN_CUDA_CHECK(cudaStreamSynchronize(s));
            for (int64_t i = 0; i < count; ++i) {
              float sum = input(0, call, i);
              for (int p = 1; p < n; ++p) sum += input(p, call, i);
              want[i] = sum;
            }
            if (std::memcmp(got.data(), want.data(), count * 4) != 0) {
              int64_t bad = 0;
              while (bad < count && got[bad] == want[bad]) ++bad;
              failures[r] = fmt::format("{} floats, call {}: element {} is {} (want {})", count, call, bad, got[bad],
                                        want[bad]);
              break;
            }
          }
          comms[r]->barrier();
          if (exec) cudaGraphExecDestroy(exec);
          if (!failures[r].empty()) break;
        }
        comms[r]->barrier();  // every rank done with its kernels before any frees
        cudaFree(d);
        cudaStreamDestroy(s);
      } catch (const std::exception& e) {
        failures[r] = e.what();
        comms[r]->abort();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(failures[r], "") << "rank " << r << " of " << n;
}

// Sizes: one float, a decode step's hidden row, odd lengths, and one beyond the 4M-float exchange half (pieces).
const std::vector<int64_t> kSizes = {1, 7, 2048, 4096 * 3 + 5, 65536, (int64_t(4) << 20) + 4099};

// The GPU-waiting kernel on ranks that share one GPU (spin_on_shared_gpu) runs in a child process of its own (this
// binary, filtered to the CudaTensorParallelGpuWaiting suite, started by GpuWaitingKernelInAFreshProcess below):
// in the same process after the rest of test_cuda it has timed out (the ranks' kernels did not all run at once,
// probably queued behind one another: comm_cuda.h), and its trap leaves the process's CUDA context unusable for
// every later test. In a fresh process, as in tools/gpu/tp_h200.sh, it passes; distinct GPUs are not affected.
bool in_gpu_waiting_child() {
  const char* v = std::getenv("KILN_TP_GPU_WAITING_CHILD");
  return v && std::string(v) == "1";
}

TEST(CudaTensorParallelGpuWaiting, PeerAllReduceOnTheGpuIsTheRankOrderSum) {
  if (!in_gpu_waiting_child()) GTEST_SKIP() << "runs in a child process (CudaTensorParallel.GpuWaitingKernelInAFreshProcess)";
  KILN_REQUIRE_CUDA_DEVICE();
  for (int n : {2, 3, 4}) check_all_reduce(n, /*spin=*/true, /*graphs=*/false, kSizes);
}

TEST(CudaTensorParallelGpuWaiting, PeerAllReduceReplayedFromGraphsIsTheRankOrderSum) {
  if (!in_gpu_waiting_child()) GTEST_SKIP() << "runs in a child process (CudaTensorParallel.GpuWaitingKernelInAFreshProcess)";
  KILN_REQUIRE_CUDA_DEVICE();
  for (int n : {2, 4}) check_all_reduce(n, /*spin=*/true, /*graphs=*/true, {1, 4096, 4096 * 64, 1 << 20});
}

TEST(CudaTensorParallel, GpuWaitingKernelInAFreshProcess) {
  KILN_REQUIRE_CUDA_DEVICE();
  if (in_gpu_waiting_child()) GTEST_SKIP() << "the child itself";
  std::error_code ec;
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  ASSERT_FALSE(ec) << "cannot find this test binary: " << ec.message();
  const std::string cmd = "KILN_TP_GPU_WAITING_CHILD=1 '" + exe +
                          "' --gtest_filter='CudaTensorParallelGpuWaiting.*' --gtest_brief=1 2>&1";
  std::string output;
  FILE* child = popen(cmd.c_str(), "r");
  ASSERT_NE(child, nullptr);
  char buf[4096];
  while (size_t got = std::fread(buf, 1, sizeof buf, child)) output.append(buf, got);
  const int status = pclose(child);
  std::printf("%s", output.c_str());
  EXPECT_EQ(status, 0) << "the child process failed:\n" << output;
  EXPECT_EQ(output.find("SKIPPED"), std::string::npos) << output;
}

TEST(CudaTensorParallel, HostCoordinatedAllReduceOfRanksSharingAGpuIsTheRankOrderSum) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (int n : {2, 3}) check_all_reduce(n, /*spin=*/false, /*graphs=*/false, kSizes);
}

TEST(CudaTensorParallel, NcclIsRefusedForRanksSharingAGpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaGroupOptions o;
  o.devices = {probe_cuda_device().index, probe_cuda_device().index};
  o.transport = CudaGroupOptions::Transport::nccl;
  try {
    make_cuda_group(o);
    ADD_FAILURE() << "an NCCL group of two ranks on one GPU was made";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("share a GPU"), std::string::npos) << e.what();
  }
  std::string why;
  const bool have = nccl_available(&why);
  std::printf("[ nccl     ] %s: %s\n", have ? "available" : "not available", why.c_str());
}

TEST(CudaTensorParallel, MoreRanksThanGpusIsAClearError) {
  KILN_REQUIRE_CUDA_DEVICE();
  LoadOptions lo;
  lo.parallel.tp_size = 2;
  lo.parallel.gpu_id_step = 64;  // rank 1 on GPU 64
  try {
    load_model(format::ModelDir::open(std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny"), "cuda", lo);
    ADD_FAILURE() << "loaded with a rank on a GPU that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPU 64"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------------
// Whole models

struct Gen {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
};

// Prefill + `steps` greedy decode steps of one prompt in slot 0, through the ModelRunner interface.
Gen generate(model::ModelRunner& m, const std::vector<int32_t>& prompt, int steps) {
  const model::RunnerCapacity cap = m.capacity();
  const int64_t V = m.vocab_size();
  std::vector<int32_t> pages(cap.kv_pages / cap.state_slots);
  for (size_t p = 0; p < pages.size(); ++p) pages[p] = static_cast<int32_t>(p);
  Gen g;
  std::vector<float> out(V);
  model::SeqChunk ch;
  ch.state_slot = 0;
  ch.page_table = pages;
  ch.tokens = prompt;
  ch.start_pos = 0;
  int64_t pos = static_cast<int64_t>(prompt.size());
  int32_t last = 0;
  for (int s = 0; s <= steps; ++s) {
    if (s > 0) {
      ch.tokens = std::span<const int32_t>(&last, 1);
      ch.start_pos = pos++;
    }
    m.forward(std::span<const model::SeqChunk>(&ch, 1), out);
    last = testing::argmax(out.data(), V);
    g.tokens.push_back(last);
    g.logits.push_back(out);
  }
  return g;
}

struct Case {
  std::string name, dir;
  std::vector<std::vector<int32_t>> prompts;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const std::string& name : testing::Fixture::all_names()) {
    const testing::Fixture fx = testing::Fixture::load(name);
    Case c{fx.name, fx.model_dir, {}};
    for (const auto& p : fx.prompts) c.prompts.push_back(p.tokens);
    out.push_back(c);
  }
  Case tiny{"kiln-tiny", std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny", {}};
  std::mt19937 rng(11);
  for (int len : {5, 40}) {
    std::vector<int32_t> p(len);
    for (auto& t : p) t = std::uniform_int_distribution<int32_t>(0, 2047)(rng);
    tiny.prompts.push_back(p);
  }
  out.push_back(tiny);
  return out;
}

LoadOptions small_options() {
  LoadOptions lo;
  lo.gpu.dtype = "float32";       // the split against one rank, exactly: not the default bf16 rounding at the tensor cores
  lo.kv_dtype = DType::BF16;  // the GPU memory plan's KV types: bf16 or fp8
  lo.state_slots = 2;
  lo.max_context = 256;
  lo.kv_pages = 2 * 256 / 16;
  return lo;
}

bool plannable(const std::string& dir, int tp, int ep) {
  try {
    const format::ModelDir d = format::ModelDir::open(dir);
    format::plan_shards(format::load_model_config(d), format::load_quant_config(d), tp, ep);
    return true;
  } catch (const Error&) {
    return false;
  }
}

constexpr int kSteps = 12;
// Both runs keep a BF16 KV cache; they differ only in the order of the partial sums (rank slices, then the
// all-reduce), which moves fp32 logits by ~1e-5 and, through a rounding of K/V to bf16, rarely more.
constexpr double kTol = 5e-3;

// One split against one rank: greedy identical, logits within `tol`.
void expect_same_as_one_rank(const Case& c, model::ModelRunner& one, model::ModelRunner& split, const std::string& how,
                             double tol) {
  double worst = 0;
  int same = 0;
  for (size_t p = 0; p < c.prompts.size(); ++p) {
    const Gen a = generate(one, c.prompts[p], kSteps), b = generate(split, c.prompts[p], kSteps);
    EXPECT_EQ(a.tokens, b.tokens) << c.name << " " << how << " prompt " << p << ": greedy tokens differ";
    same += a.tokens == b.tokens;
    for (int s = 0; s <= kSteps && (s == 0 || a.tokens[s - 1] == b.tokens[s - 1]); ++s)
      for (size_t i = 0; i < a.logits[s].size(); ++i)
        worst = std::max(worst, std::fabs(static_cast<double>(a.logits[s][i]) - b.logits[s][i]));
  }
  EXPECT_LE(worst, tol) << c.name << " " << how;
  std::printf("[ tp       ] %-22s %-34s vs 1 rank: greedy identical %d/%zu, max|dlogit| %.2e\n", c.name.c_str(),
              how.c_str(), same, c.prompts.size(), worst);
}

TEST(CudaTensorParallel, RanksSharingOneGpuGiveTheOneRankGreedyOutput) {
  KILN_REQUIRE_CUDA_DEVICE();
  int checked = 0;
  for (const Case& c : cases()) {
    const format::ModelDir dir = format::ModelDir::open(c.dir);
    auto one = load_model(dir, "cuda", small_options(), /*self_check=*/false);
    for (auto [tp, ep] : std::vector<std::pair<int, int>>{{2, 1}, {4, 1}, {2, 2}, {4, 4}}) {
      if (!plannable(c.dir, tp, ep)) continue;
      LoadOptions lo = small_options();
      lo.parallel.tp_size = tp;
      lo.parallel.ep_size = ep;
      lo.parallel.gpu_id_step = 0;
      auto split = load_model(dir, "cuda", lo, /*self_check=*/false);
      expect_same_as_one_rank(c, *one, *split, fmt::format("tp {} ep {} (host-coordinated)", tp, ep), kTol);
      ++checked;
    }
  }
  EXPECT_GE(checked, 10);
}

}  // namespace
}  // namespace kiln::backend::cuda
