// Which backend runs the model: `--device auto|cpu|cuda`, resolved once at startup.
//   auto: cuda when this build has the CUDA backend and a supported GPU is present (compute capability 9.0 or
//         12.x), else cpu; cpu: the CPU oracle; cuda: the CUDA backend, or a kiln::Error naming what was found.
// A cuda backend passes a numerical self-check against the CPU backend before it is used (op_check.h);
// `self_check = false` (--skip-self-check) bypasses it.
//
// Also here, pure and host-only (tested without a GPU): the one check of the parallel sizes (validate_parallel), the
// placement of this node's ranks on the GPUs it found (place_ranks), and the NCCL settings kiln defaults. Last, the
// one-GPU all-reduce timing of `kiln bench-engine --single-rank`'s projection (time_all_reduce_on_one_gpu).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "format/model_dir.h"
#include "model/model_runner.h"
#include "model/ops.h"

namespace kiln::backend {

struct DeviceChoice {
  std::string device;  // "cpu" or "cuda"
  std::string reason;  // why, for the startup log ("NVIDIA H200 (compute capability 9.0)", "no CUDA device", ...)
  double gpu_bytes = 0;  // cuda: the GPU's memory
};

// Resolves "auto" / "cpu" / "cuda"; throws kiln::Error for an unknown name or an unusable explicit cuda.
DeviceChoice resolve_device(const std::string& requested);

// How much of the prompts one step and one forward pass take: --chunked-prefill-size and --max-pass-tokens,
// resolved by this one function for kiln serve, inspect (serve's plan), generate and bench-engine.
//   step_tokens: the engine's per-step token budget, decodes + prompt chunks (engine/scheduler.h); 0: none
//     (whole prompts in one step). It bounds how long a step's decodes wait for the prompts beside them.
//   pass_tokens: the most tokens one forward pass runs (a larger step runs as several passes, back to back): the
//     runner's prefill_chunk. The memory plan reserves activation scratch for a pass of this many tokens. auto: the
//     step budget (one step, one pass: passes of >= model::kLayerScratchReleaseMinTokens tokens hold about one layer's
//     activations, and larger passes give the experts fuller tiles), kAutoPassTokensNoBudget without one.
//   step_tokens_while_decoding: the budget of steps that carry decodes where smaller than step_tokens (0: the same):
//     --chunked-prefill-size-while-decoding. auto: kAutoStepTokensWhileDecoding on CUDA where the step budget is
//     larger, so the ITL of running streams stays bounded while long prompts arrive; a prompt that arrives while
//     nothing decodes still gets one large step.
struct PrefillSizes {
  int64_t step_tokens = 0;
  int64_t pass_tokens = 0;
  int64_t step_tokens_while_decoding = 0;
  std::string reason;  // how they were chosen, for the startup summary
};
constexpr int64_t kAutoStepTokensWhileDecoding = 2048;
constexpr int64_t kDefaultMaxPassTokens = 512;  // kiln generate and bench-engine (no engine steps)
constexpr int64_t kAutoPassTokensNoBudget = 8192;
// The per-step budget --chunked-prefill-size auto gives: 8192 on a GPU of 80 GB (decimal) or more, 2048 on a smaller
// GPU, 512 on the CPU (small steps keep the CPU backend's tests and streams responsive).
int64_t default_chunked_prefill_size(const std::string& device, double gpu_bytes);
// chunked_prefill_size: "auto" or a number of tokens (<= 0: no per-step budget). max_pass_tokens: "auto" or a number
// of tokens, at least 1; the pass is never larger than a positive step budget. device: "cpu" or "cuda" (gpu_bytes
// its memory). Throws kiln::Error for a value that is neither.
// while_decoding: "auto" or a number of tokens (<= 0: the step budget).
PrefillSizes resolve_prefill_sizes(const std::string& chunked_prefill_size, const std::string& max_pass_tokens,
                                   const std::string& device, double gpu_bytes,
                                   const std::string& while_decoding = "auto");
// The pass size alone (what resolve_prefill_sizes gives as pass_tokens): max_pass_tokens (at least 1), at most a
// positive step_tokens. kiln generate and bench-engine, which run the runner without engine steps, pass 0.
int64_t resolve_pass_tokens(int64_t max_pass_tokens, int64_t step_tokens);


// --dtype (SGLang's flag): the precision activations enter the tensor cores with, for a resolved device ("cpu" or
// "cuda"). Returns "float32" or "bfloat16"; throws kiln::Error for a value the device cannot run. SGLang's aliases
// half (float16) and float (float32) are accepted.
//   cuda: float32 = fp32 activations split into 3 bf16 parts at every tensor-core input (the CPU oracle's accuracy);
//         bfloat16 = fp32 activations rounded once to bf16 there (a third of the MMA work); fp32 accumulation and
//         fp32 storage of activations either way. float16 is refused (not built). auto: kCudaAutoDtype.
//   cpu:  fp32 throughout: auto and float32 give "float32", bfloat16 / float16 are refused with a message naming the
//         CPU backend.
// The one place "auto" is decided.
std::string resolve_dtype(const std::string& device, const std::string& requested);
// What --dtype auto runs on CUDA: bfloat16, measured on the H200 (docs/perf/dtype-h200.md): 1.43x prefill, 1.2x
// decode at batch 16-64, and on every committed BF16 fixture closer to the fp32 reference than transformers itself
// in bfloat16 (the budget). float32 stays the oracle path (--dtype float32).
inline constexpr const char* kCudaAutoDtype = "bfloat16";

// --mamba-ssm-dtype (SGLang's flag): the element type of the DeltaNet recurrent state slots, "float32" or "bfloat16",
// for a resolved device and a resolved --dtype. auto: float32. bfloat16 (cuda, opt-in) halves the bytes the delta rule
// streams per step and the plan reserves per slot (the maths stays fp32), but measured on an H100 it was 2% faster at
// batch 1 and 5% slower at batch 64, and two random-weight fixtures drift to 0.24 logits rel-L2 from the CPU
// (docs/perf/decode-latency.md), so it is not the default. The CPU backend always keeps fp32 state (bfloat16 is
// refused there).
std::string resolve_mamba_ssm_dtype(const std::string& device, const std::string& dtype, const std::string& requested);

// The kernels a device runs (--dtype, --attention-backend, --moe-runner-backend, --fp4-gemm-backend; SGLang's flag
// names, kiln's own kernels). "auto" resolves per device and GPU architecture (to the fast paths); a choice the device
// cannot run is a kiln::Error that says which choices it can. The cuda choices become the CudaOptions of the backend.
struct KernelChoice {
  // resolve_dtype's answer: "float32" (cpu: always) or "bfloat16"
  std::string dtype;
  // resolve_mamba_ssm_dtype's answer: the recurrent state's "float32" (cpu: always) or "bfloat16"
  std::string mamba_ssm_dtype;
  // cpu: "cpu"; cuda: "kiln-paged" (prefill-shaped steps on the tensor-core flash kernel, decode on the split-KV
  // kernel) or "kiln-paged-fp32" (the split-KV kernel on CUDA cores for every step)
  std::string attention;
  // cpu: "cpu"; cuda: "kiln-fused-decode" (kiln-grouped plus decode steps in two fused kernels; by name only),
  // "kiln-grouped" (NVFP4 experts on tensor cores: the mma kernels, and under bfloat16 for steps of
  // >= cuda::kMoePrefillWgmmaMinTokens tokens on sm_90 the wgmma grouped GEMMs, on other GPUs for steps of
  // >= cuda::kMoePrefillBlasMinTokens tokens dequantised to bf16 + cuBLAS grouped GEMMs), "kiln-mma" (the mma kernels
  // at every step), "kiln-wgmma" (the wgmma grouped GEMMs at every step; bfloat16, sm_90), "kiln-blas" (the
  // dequantised path at every step outside graph capture; bfloat16, sm_90+) or "kiln-grouped-fp32" (fp32 CUDA-core
  // kernels)
  std::string moe_runner;
  // cpu: "cpu"; cuda: "kiln-w4a16" (NVFP4 linears of many rows on tensor cores, FP4 decoded to bf16 in registers; no
  // FP4 tensor cores on sm_90) or "kiln-fp32" (the fp32 gemm)
  std::string fp4_gemm;
  std::string str() const;
};
// compute_major: the GPU's compute capability major (0 for the CPU).
KernelChoice resolve_kernels(const std::string& device, int compute_major, const LoadOptions& options);

// The device memory plan of a CUDA load, made from config.json before any weight is placed. With tp > 1 it is the
// plan of one rank's GPU (every rank allocates the same: the busiest rank's weights, the rank's KV heads per token,
// its recurrent / conv state per slot, its activations), so the KV pages and state slots match over the ranks.
struct MemoryPlan {
  int tp = 1, ep = 1;     // the split planned for (options.tp_size / ep_size)
  int ranks_per_gpu = 1;  // ranks sharing one GPU (--gpu-id-step 0: all of a node's ranks); each gets 1 / this of it
  double gpu_bytes = 0, free_bytes = 0, fraction = 0.9, budget_bytes = 0;
  double weight_bytes = 0, state_bytes = 0, activation_bytes = 0, kv_bytes = 0;
  // Part of activation_bytes: the bf16 buffer of the NVFP4 experts dequantised for large steps (cuda_options.h,
  // kMoePrefillWeightScratchBytes at most; 0 when the model and flags never take that path).
  double moe_dequant_bytes = 0;
  // The vision tower (LoadOptions::vision, a checkpoint with one): its weights and the activations of encoding the
  // largest image (LoadOptions::vision_max_patches), held on every rank's plan (rank 0 loads it).
  double vision_bytes = 0;
  int64_t kv_pages = 0, kv_tokens = 0;  // kv_tokens: SGLang's max_total_num_tokens
  int state_slots = 0;                  // recurrent-state slots
  int max_running = 0;                  // state_slots / slots_per_request: the default --max-running-requests
  int64_t context = 0;                  // longest sequence: the model's (or --context-length), capped to the KV cache
  std::string str() const;
};
// Plans weights + state slots + activations (estimate for a prefill pass of options.prefill_chunk tokens) + KV
// pages within gpu_bytes x fraction (divided among the ranks sharing the GPU), per rank for options.tp_size > 1
// (the shard plan's figures, format/capacity.h); kiln::Error (with the numbers and what to change) when it does not fit.
// State slots: options.state_slots when set, else enough for min(256, the running requests whose slots fit in a
// quarter of what weights and activations leave) x slots_per_request. KV pages: options.kv_pages when set
// (checked), else all the rest. A context longer than the KV cache holds is capped to it with a warning.
// compute_major: the GPU's (0: unknown). On sm_90 (9) the NVFP4 experts of large passes run as wgmma GEMMs where
// their shapes allow, so the dequantised path's weight buffer is left out of auto's plan there.
MemoryPlan plan_device_memory(const format::ModelDir& dir, const LoadOptions& options, double gpu_bytes,
                              double free_bytes, int compute_major = 0);

// The Ops of a resolved device ("cpu" or "cuda"); a cuda Ops runs the kernels `options` choose (resolve_kernels)
// and is checked against the CPU backend (op_check.h) unless self_check is false.
std::unique_ptr<model::Ops> make_ops(const std::string& device, bool self_check = true,
                                     const LoadOptions& options = {});

// The parallel sizes on their own (no model, no device), the one place they are checked: tp, ep >= 1, ep divides tp,
// GPU ids not negative, 0 <= node_rank < nnodes, tp divides over nnodes, --dist-init-addr host:port with nnodes > 1,
// single_rank inside a tp > 1 plan of one machine. kiln::Error naming the flags and the numbers otherwise.
void validate_parallel(const ParallelOptions& p);

// One GPU of this machine as the loader sees it (CUDA-free: the CUDA probe fills it, tests fake it).
struct GpuInfo {
  bool usable = true;
  std::string reason;  // why not usable
  std::string name;    // "NVIDIA H200"
  int major = 0;       // compute capability major
  double memory_bytes = 0, free_bytes = 0;
};
// Where this node's ranks run: rank r (of this node) on devices[r] = base_gpu_id + r * gpu_id_step.
struct RankPlacement {
  std::vector<int> devices;   // [local ranks] the CUDA device of each rank of this node
  int ranks_on_first_gpu = 1;  // ranks sharing devices[0] (--gpu-id-step 0: all of them); they meet on the host
  double free_bytes = 0;      // the least free memory of the GPUs used
  int first_rank = 0;         // global rank of devices[0]'s rank: node_rank x local ranks
  std::string gpu_list() const;  // "0,1,2,3"
};
// Places the ranks of `p` (validated) on `gpus` (every GPU of this machine, by CUDA index). kiln::Error when a rank
// lands on a GPU that does not exist (more ranks than GPUs: the fix is --gpu-id-step 0 or a smaller --tp-size), is not
// usable, or differs in kind or memory from the first rank's.
RankPlacement place_ranks(const ParallelOptions& p, const std::vector<GpuInfo>& gpus);

// An environment setting of NCCL's that kiln wants and why. kiln sets it only where the user left it unset
// (cli/environment.h reads the user's and reports both kinds in the startup summary).
struct EnvDefault {
  const char* name;
  const char* value;
  const char* why;
};
const std::vector<EnvDefault>& nccl_env_defaults();

// Loads `dir` on the requested device (auto / cpu / cuda) with `options` (threads apply to the CPU backend only;
// options.parallel is checked by validate_parallel first). Logs the resolved choice and the backend's description.
std::unique_ptr<model::ModelRunner> load_model(const format::ModelDir& dir, const std::string& device,
                                               const LoadOptions& options, bool self_check = true);

// kiln bench-engine --single-rank: microseconds per all-reduce (rank 0's median) of each size in `floats` (F32 values)
// over a group of `ranks` ranks all on CUDA device `gpu`, as cuda::time_all_reduce measures it (`iters` all-reduces per
// CUDA graph). The ranks run the GPU-waiting peer kernel of distinct GPUs with every peer read in the one GPU's memory:
// the kernel's own cost, no link between GPUs crossed. Call it before the process runs anything else on the GPU
// (cuda/comm_cuda.h, spin_on_shared_gpu). kiln::Error without the CUDA backend or when a rank fails.
std::vector<double> time_all_reduce_on_one_gpu(int ranks, int gpu, const std::vector<int64_t>& floats, int iters = 100);

}  // namespace kiln::backend
