#include "backend/device.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "backend/cuda/cuda_options.h"  // plain C++: the plan sizes the CUDA backend's expert scratch
#include "backend/cuda/deltanet_chunked_tiles.h"  // plain C++: and the delta rule's split-form workspace
#include "backend/op_check.h"
#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "format/capacity.h"
#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/shard_plan.h"
#include "format/weight_map.h"
#include "model/runner.h"
#include "model/tp_runner.h"

#if KILN_HAVE_CUDA
#include "backend/cuda/comm_cuda.h"
#include "backend/cuda/cuda_ops.h"
#endif

namespace kiln::backend {

DeviceChoice resolve_device(const std::string& requested) {
  if (requested != "auto" && requested != "cpu" && requested != "cuda")
    fail("unknown --device '{}' (use auto, cpu or cuda)", requested);
  if (requested == "cpu") return {"cpu", "--device cpu"};
#if KILN_HAVE_CUDA
  const cuda::CudaDeviceProbe probe = cuda::probe_cuda_device();
  if (probe.usable)
    return {"cuda",
            fmt::format("{} (device {}, compute capability {}.{})", probe.name, probe.index, probe.major, probe.minor),
            static_cast<double>(probe.memory_bytes)};
  if (requested == "cuda") fail("--device cuda: {}", probe.reason);
  return {"cpu", probe.reason};
#else
  if (requested == "cuda") fail("--device cuda: this kiln binary was built without the CUDA backend (use --device cpu)");
  return {"cpu", "built without the CUDA backend"};
#endif
}

int64_t default_chunked_prefill_size(const std::string& device, double gpu_bytes) {
  if (device != "cuda") return 512;
  return gpu_bytes >= 80e9 ? 8192 : 2048;
}

int64_t resolve_pass_tokens(int64_t max_pass_tokens, int64_t step_tokens) {
  if (max_pass_tokens < 1) fail("--max-pass-tokens must be at least 1 (got {})", max_pass_tokens);
  return step_tokens > 0 ? std::min(max_pass_tokens, step_tokens) : max_pass_tokens;
}

namespace {
// A whole number of tokens, or kiln::Error naming the flag.
int64_t parse_tokens(const std::string& text, const char* flag) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) fail("{} '{}' is neither auto nor a number of tokens", flag, text);
  return v;
}
}  // namespace

PrefillSizes resolve_prefill_sizes(const std::string& chunked_prefill_size, const std::string& max_pass_tokens,
                                   const std::string& device, double gpu_bytes, const std::string& while_decoding) {
  PrefillSizes p;
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  if (chunked_prefill_size == "auto") {
    p.step_tokens = default_chunked_prefill_size(device, gpu_bytes);
    p.reason = device != "cuda" ? std::string("auto: the CPU backend")
                                : fmt::format("auto: a GPU of {:.1f} GiB, {} 80 GB", gpu_bytes / GiB,
                                              gpu_bytes >= 80e9 ? "at least" : "under");
  } else {
    const int64_t v = parse_tokens(chunked_prefill_size, "--chunked-prefill-size");
    p.step_tokens = std::max<int64_t>(v, 0);
    p.reason = v > 0 ? std::string("set by --chunked-prefill-size")
                     : fmt::format("--chunked-prefill-size {}: no per-step budget, whole prompts in one step", v);
  }
  if (max_pass_tokens == "auto") {
    p.pass_tokens = p.step_tokens > 0 ? p.step_tokens : kAutoPassTokensNoBudget;
    p.reason += "; passes: auto, one per step";
  } else {
    p.pass_tokens = resolve_pass_tokens(parse_tokens(max_pass_tokens, "--max-pass-tokens"), p.step_tokens);
  }
  if (while_decoding == "auto") {
    if (device == "cuda" && p.step_tokens > kAutoStepTokensWhileDecoding) {
      p.step_tokens_while_decoding = kAutoStepTokensWhileDecoding;
      p.reason += fmt::format("; steps with decodes: {} tokens at most (auto)", kAutoStepTokensWhileDecoding);
    }
  } else {
    const int64_t v = parse_tokens(while_decoding, "--chunked-prefill-size-while-decoding");
    if (v > 0 && (p.step_tokens <= 0 || v < p.step_tokens)) {
      p.step_tokens_while_decoding = v;
      p.reason += fmt::format("; steps with decodes: {} tokens at most (--chunked-prefill-size-while-decoding)", v);
    }
  }
  return p;
}

std::string resolve_dtype(const std::string& device, const std::string& asked) {
  // SGLang's aliases: half = float16, float = float32.
  const std::string requested = asked == "half" ? "float16" : asked == "float" ? "float32" : asked;
  if (requested != "auto" && requested != "bfloat16" && requested != "float16" && requested != "float32")
    fail("unknown --dtype '{}' (use auto, bfloat16, float16 or float32)", asked);
  if (device == "cpu") {
    if (requested == "auto" || requested == "float32") return "float32";
    fail("--dtype {}: the CPU backend always runs fp32 (use --dtype auto or float32 with --device cpu, or a CUDA "
         "device for bfloat16)", asked);
  }
  if (requested == "float16")
    fail("--dtype {} is not supported by the CUDA backend yet; use bfloat16 or float32", requested);
  return requested == "auto" ? std::string(kCudaAutoDtype) : requested;
}

std::string resolve_mamba_ssm_dtype(const std::string& device, const std::string& dtype, const std::string& asked) {
  if (asked != "auto" && asked != "bfloat16" && asked != "float32")
    fail("unknown --mamba-ssm-dtype '{}' (use auto, bfloat16 or float32)", asked);
  if (device == "cpu" && asked == "bfloat16")
    fail("--mamba-ssm-dtype bfloat16: the CPU backend keeps the recurrent state in fp32 (use auto or float32)");
  if (asked != "auto") return asked;
  (void)dtype;
  return "float32";  // bfloat16 is opt-in: docs/perf/decode-latency.md (slower at batch 64, a looser whole-model match)
}

std::string KernelChoice::str() const {
  return fmt::format("dtype {}, mamba-ssm-dtype {}, attention {}, moe-runner {}, fp4-gemm {}", dtype, mamba_ssm_dtype,
                     attention, moe_runner, fp4_gemm);
}

KernelChoice resolve_kernels(const std::string& device, int compute_major, const LoadOptions& o) {
  KernelChoice k;
  auto pick = [&](const std::string& flag, const std::string& asked, std::initializer_list<const char*> allowed,
                  const char* fallback) {
    if (asked == "auto") return std::string(fallback);
    for (const char* a : allowed)
      if (asked == a) return asked;
    std::string list = "auto";
    for (const char* a : allowed) list += std::string(", ") + a;
    fail("{} '{}' is not available on {} (choices here: {}). kiln runs its own kernels; SGLang backend names such "
         "as flashinfer, fa3, triton or cutlass are not part of it", flag, asked,
         device == "cpu" ? std::string("the CPU backend") : fmt::format("this GPU (sm_{}x)", compute_major), list);
  };
  k.dtype = resolve_dtype(device, o.gpu.dtype);
  k.mamba_ssm_dtype = resolve_mamba_ssm_dtype(device, k.dtype, o.gpu.mamba_ssm_dtype);
  if (device == "cpu") {
    k.attention = pick("--attention-backend", o.gpu.attention_backend, {"cpu"}, "cpu");
    k.moe_runner = pick("--moe-runner-backend", o.gpu.moe_runner_backend, {"cpu"}, "cpu");
    k.fp4_gemm = pick("--fp4-gemm-backend", o.gpu.fp4_gemm_backend, {"cpu"}, "cpu");
    return k;
  }
  k.attention = pick("--attention-backend", o.gpu.attention_backend, {"kiln-paged", "kiln-paged-fp32"}, "kiln-paged");
  // auto: the grouped path. The fused decode kernels measured slower at batch 1 on an H100 (docs/perf/decode-latency.md),
  // so they are reachable by name only.
  // kiln-grouped (auto) and kiln-mma: the mma kernels; kiln-blas: the NVFP4 experts of every non-captured step
  // dequantised to bf16 + cuBLAS grouped GEMMs (opt-in until measured on a GPU; A/B runs).
  k.moe_runner = pick("--moe-runner-backend", o.gpu.moe_runner_backend,
                      {"kiln-fused-decode", "kiln-grouped", "kiln-mma", "kiln-blas", "kiln-wgmma", "kiln-grouped-fp32"},
                      "kiln-grouped");
  if (k.moe_runner == "kiln-blas" && (k.dtype != "bfloat16" || compute_major < 9))
    fail("--moe-runner-backend kiln-blas runs the NVFP4 experts as bf16 GEMMs: it needs --dtype bfloat16 (or auto) and "
         "an sm_90 or newer GPU (here: --dtype {}, sm_{}x); use kiln-grouped or kiln-mma",
         k.dtype, compute_major);
  if (k.moe_runner == "kiln-wgmma" && (k.dtype != "bfloat16" || compute_major != 9))
    fail("--moe-runner-backend kiln-wgmma runs the NVFP4 experts on Hopper's warpgroup MMA with bf16 inputs: it needs "
         "--dtype bfloat16 (or auto) and an sm_90 GPU (here: --dtype {}, sm_{}x); use kiln-grouped or kiln-mma",
         k.dtype, compute_major);
  if (o.gpu.fp4_gemm_backend == "native-fp4")
    fail("--fp4-gemm-backend native-fp4 needs FP4 tensor cores (sm_100 / sm_120) and is not implemented in kiln yet; "
         "{}use kiln-w4a16 (FP4 decoded to BF16 in registers), kiln-fp32 or auto",
         compute_major == 9 ? "this GPU (sm_90, Hopper) has none: " : "");
  k.fp4_gemm = pick("--fp4-gemm-backend", o.gpu.fp4_gemm_backend, {"kiln-w4a16", "kiln-fp32"}, "kiln-w4a16");
  return k;
}

#if KILN_HAVE_CUDA
namespace {
// Whether this process runs several ranks of its group on one GPU (--gpu-id-step 0: correctness checks), whose kernels
// may then run side by side on its multiprocessors.
bool ranks_share_a_gpu(const ParallelOptions& p) {
  return p.single_rank < 0 && p.gpu_id_step == 0 && p.tp_size / std::max(p.nnodes, 1) > 1;
}
// The CudaOptions of a resolved cuda kernel choice.
cuda::CudaOptions cuda_options(const KernelChoice& k, const LoadOptions& o, int device = -1, int compute_major = 0) {
  cuda::CudaOptions c;
  c.device = device;
  c.prefill_attention_tensor_cores = k.attention == "kiln-paged";
  c.moe_tensor_cores = k.moe_runner == "kiln-grouped" || k.moe_runner == "kiln-fused-decode" ||
                       k.moe_runner == "kiln-mma" || k.moe_runner == "kiln-blas" || k.moe_runner == "kiln-wgmma";
  c.moe_decode_fused = k.moe_runner == "kiln-fused-decode";
  // The NVFP4 experts of large steps under auto (kiln-grouped, kiln-fused-decode): on sm_90 the wgmma grouped GEMMs
  // from kMoePrefillWgmmaMinTokens tokens, elsewhere dequantised + cuBLAS from kMoePrefillBlasMinTokens
  // (docs/perf/prefill.md); kiln-mma / kiln-blas / kiln-wgmma pin one path at every size (A/B timing).
  c.moe_prefill = k.moe_runner == "kiln-blas"    ? cuda::MoePrefill::blas
                  : k.moe_runner == "kiln-mma"   ? cuda::MoePrefill::mma
                  : k.moe_runner == "kiln-wgmma" ? cuda::MoePrefill::wgmma
                                                 : cuda::MoePrefill::by_step;
  c.fp4_linear_tensor_cores = k.fp4_gemm == "kiln-w4a16";
  c.dtype = k.dtype == "bfloat16" ? cuda::CudaOptions::ActivationDtype::bfloat16
                                  : cuda::CudaOptions::ActivationDtype::float32;
  c.scratch_plan_bytes = static_cast<size_t>(std::max(o.gpu.scratch_plan_bytes, 0.0));
  c.recurrent_state_bf16 = k.mamba_ssm_dtype == "bfloat16";
  c.pdl = o.gpu.pdl;
  c.fused_decode_ops = o.gpu.fused_decode_ops;
  c.moe_block_persistent = o.gpu.persistent_moe && compute_major == 9 && !ranks_share_a_gpu(o.parallel);
  c.deltanet_block_persistent = o.gpu.persistent_deltanet && compute_major == 9 && !ranks_share_a_gpu(o.parallel);
  c.persistent_prefetch = o.gpu.persistent_prefetch;
  c.moe_wgmma_tile_rows = o.gpu.moe_wgmma_tile_rows;
  c.moe_wgmma_producer = o.gpu.moe_wgmma_producer;
  c.moe_wgmma_down_walk = o.gpu.moe_wgmma_down_walk;
  c.moe_wgmma_narrow = o.gpu.moe_wgmma_narrow;
  c.moe_group_wide = o.gpu.moe_group_wide;
  c.delta_rule_tensor_cores = o.gpu.delta_rule_tensor_cores;
  c.delta_rule_split = o.gpu.delta_rule_split;
  c.weight_prefetch = o.gpu.weight_prefetch;
  return c;
}
}  // namespace
#endif

std::string MemoryPlan::str() const {
  const double G = 1024.0 * 1024.0 * 1024.0;
  std::string who;
  if (tp > 1)
    who = fmt::format(" per GPU of tp {}{}", tp, ep > 1 ? fmt::format(" (ep {})", ep) : "");
  if (ranks_per_gpu > 1) who = fmt::format(" per rank of tp {} ({} ranks share each GPU)", tp, ranks_per_gpu);
  return fmt::format(
      "memory plan{}: {:.1f} GiB x mem-fraction-static {:.2f}{} = {:.1f} GiB: weights {:.2f} GiB, KV cache {:.2f} GiB "
      "({} pages = {} tokens, max_total_num_tokens), state slots {:.2f} GiB ({} slots, {} running requests), "
      "activations {:.2f} GiB (estimate{}){}; context {} tokens{}",
      who, gpu_bytes / G, fraction, ranks_per_gpu > 1 ? fmt::format(" / {} ranks", ranks_per_gpu) : "",
      budget_bytes / G, weight_bytes / G, kv_bytes / G, kv_pages, kv_tokens, state_bytes / G,
      state_slots, max_running, activation_bytes / G,
      moe_dequant_bytes > 0 ? fmt::format(", of which {:.2f} GiB dequantised experts", moe_dequant_bytes / G) : "",
      vision_bytes > 0 ? fmt::format(", vision tower {:.2f} GiB (weights + one largest image)", vision_bytes / G) : "",
      context, free_bytes > 0 ? fmt::format("; {:.1f} GiB free at start", free_bytes / G) : "");
}

MemoryPlan plan_device_memory(const format::ModelDir& dir, const LoadOptions& o, double gpu_bytes,
                              double free_bytes, int compute_major) {
  const double G = 1024.0 * 1024.0 * 1024.0;
  format::ModelConfig config = format::load_model_config(dir);
  const format::QuantConfig quant = format::load_quant_config(dir);
  const auto tensors = format::expected_tensors(config, quant);
  MemoryPlan p;
  validate_parallel(o.parallel);
  p.tp = o.parallel.tp_size;
  p.ep = o.parallel.ep_size;
  p.ranks_per_gpu = o.parallel.gpu_id_step == 0 ? p.tp / o.parallel.nnodes : 1;
  format::CapacityOptions co;
  co.kv_dtype = o.kv_dtype;
  co.tp = p.tp;
  co.ep = p.ep;
  co.recurrent_state_bytes =
      resolve_mamba_ssm_dtype("cuda", resolve_dtype("cuda", o.gpu.dtype), o.gpu.mamba_ssm_dtype) == "bfloat16" ? 2 : 4;
  // Per rank (capacity.h's per-GPU figures come from the shard plan the loader slices by; at tp 1 they are the
  // whole model's): the busiest rank's weights, the rank's KV heads and linear-attention heads.
  const format::CapacityPlan cap = format::plan_capacity(config, tensors, co);
  const format::ShardPlan shards = format::plan_shards(config, tensors, p.tp, p.ep);
  const format::RankShard& rank0 = shards.ranks.front();  // heads and intermediate are the same on every rank
  const double vocab_rows = p.tp > 1 ? static_cast<double>(rank0.vocab.count) : static_cast<double>(config.vocab_size);
  const format::ModelConfig full = config;
  config = format::rank_config(full, rank0);
  p.gpu_bytes = gpu_bytes;
  p.free_bytes = free_bytes;
  p.fraction = o.gpu.mem_fraction_static > 0 ? o.gpu.mem_fraction_static : 0.90;
  if (p.fraction > 0.98) fail("--mem-fraction-static {} is too high (at most 0.98)", p.fraction);
  p.budget_bytes = gpu_bytes * p.fraction / p.ranks_per_gpu;
  p.weight_bytes = static_cast<double>(cap.weight_bytes_per_gpu);
  const int per = std::max(o.slots_per_request, 1);
  const double state_per_seq = static_cast<double>(cap.state_bytes_per_sequence_per_gpu);
  // Scratch of one pass: per token and layer the hidden-sized buffers, the projections' outputs and the experts' rows
  // (and their bf16 split for the tensor-core kernels), plus the logits of every running sequence (a rank's
  // vocabulary rows). Head counts and intermediate sizes are the rank's. A pass of fewer than
  // model::kLayerScratchReleaseMinTokens tokens (decode, verify) holds every layer's buffers until the step ends; a
  // larger one frees each layer's when the layer is done (model/runner.h), so it holds about one layer's (counted
  // twice: the residual stream, the MTP head's layer and the final norm's rows are beside it).
  const double H = static_cast<double>(config.hidden_size);
  const double C = 2.0 * config.linear_num_key_heads * config.linear_key_head_dim +
                   static_cast<double>(config.linear_num_value_heads) * config.linear_value_head_dim;
  const double Q = 2.0 * config.num_attention_heads * config.head_dim;
  const double ffn = config.is_moe()
                         ? config.experts_per_tok * (static_cast<double>(config.moe_intermediate_size) + H) +
                               config.num_experts + 3.0 * config.shared_expert_intermediate_size +
                               1.5 * (H + config.experts_per_tok * static_cast<double>(config.moe_intermediate_size))
                         : 3.0 * static_cast<double>(config.intermediate_size);
  // The chunked delta rule's split form takes its workspace from the scratch arena while a linear-attention layer's
  // delta rule runs (cuda/deltanet_chunked_tiles.h SplitWorkspace: W, U, P and the cumulative decays per token and value
  // head; the 64 padding rows per sequence are within the fixed 0.5 GiB below): 41 KiB per token at the 35B-A3B.
  const double delta_split =
      o.gpu.delta_rule_split && o.gpu.delta_rule_tensor_cores && config.linear_num_value_heads > 0
          ? 4.0 * config.linear_num_value_heads *
                (::kiln::cuda::ops::delta_chunked::chunk_key_tile(config.linear_key_head_dim) +
                 (config.linear_value_head_dim + 31) / 32 * 32.0 + ::kiln::cuda::ops::delta_chunked::kChunk + 1.0)
          : 0.0;
  const double per_token_layer = 4.0 * (8.0 * H + 3.0 * std::max(C, Q) + ffn) + delta_split;
  auto pass_bytes = [&](double tokens) {
    return tokens < static_cast<double>(model::kLayerScratchReleaseMinTokens)
               ? tokens * per_token_layer * config.num_layers
               : tokens * per_token_layer * std::min(2.0, static_cast<double>(config.num_layers));
  };
  // The NVFP4 routed experts of large steps dequantised to bf16 (cuda/moe_prefill_blas.h): one buffer of up to
  // kMoePrefillWeightScratchBytes, reused by every layer and step, outside the scratch arena (its per-pass buffers
  // come from the ffn term above). Counted whenever an NVFP4 MoE model runs with bf16 inputs and a runner that takes
  // that path: kiln-blas at any pass size, auto / kiln-grouped / kiln-fused-decode when passes reach
  // kMoePrefillBlasMinTokens tokens, except on sm_90 where the wgmma GEMMs serve the rank's experts (H and the rank's
  // slice of the expert intermediate multiples of 128: moe_prefill_wgmma_supported) and take those passes instead.
  const std::string& runner = o.gpu.moe_runner_backend;
  const bool nvfp4 = quant.quant_algo == "NVFP4" || quant.quant_algo == "MIXED_PRECISION";
  const bool wgmma_serves = compute_major == 9 && static_cast<int64_t>(H) % 128 == 0 &&
                            rank0.expert_inter.count > 0 && rank0.expert_inter.count % 128 == 0;
  const bool dequant_path =
      runner == "kiln-blas" || ((runner == "auto" || runner == "kiln-grouped" || runner == "kiln-fused-decode") &&
                                o.prefill_chunk >= cuda::kMoePrefillBlasMinTokens && !wgmma_serves);
  if (config.is_moe() && nvfp4 && resolve_dtype("cuda", o.gpu.dtype) == "bfloat16" && dequant_path) {
    const double expert = 3.0 * 2.0 * static_cast<double>(config.moe_intermediate_size) * H;
    p.moe_dequant_bytes = std::min(static_cast<double>(cuda::kMoePrefillWeightScratchBytes),
                                   expert * std::max(config.num_experts, 1));
  }
  if (o.vision && full.has_vision) {
    // Weights as stored (BF16 in the releases); per patch of the largest image the forward's fp32 buffers (x, y, the
    // normed rows, q / k / v / attention output, qkv, the MLP's rows: 10 h + I floats), with a quarter for the plan's
    // tables and the linears' own scratch.
    double params = 0;
    for (const format::ExpectedTensor& t : format::expected_vision_tensors(full, "model.visual."))
      params += static_cast<double>(t.shape.numel());
    const format::VisionConfig& v = full.vision;
    const double per_patch = 4.0 * (10.0 * static_cast<double>(v.hidden_size) + static_cast<double>(v.intermediate_size));
    const double patches = static_cast<double>(std::max<int64_t>(o.vision_max_patches, 0));
    // The biased linears on cuBLASLt (blocks of at most 8192 rows): x in 3 bf16 parts and 3 fp32 partial outputs of
    // the widest linear (float32; bfloat16 needs less).
    const double widest = std::max<double>(v.intermediate_size, 3.0 * v.hidden_size);
    const double linears = std::min(patches, 8192.0) * (6.0 * std::max<double>(v.intermediate_size, v.hidden_size) +
                                                         12.0 * widest);
    p.vision_bytes = 2.0 * params + 1.25 * per_patch * patches + linears;
  }
  auto activations = [&](int running) {
    // The largest pass, and the largest one below the release threshold (a decode step of many sequences).
    const double tokens = static_cast<double>(std::max<int64_t>(o.prefill_chunk, running));
    const double held = std::max(pass_bytes(tokens),
                                 pass_bytes(std::min(tokens, model::kLayerScratchReleaseMinTokens - 1.0)));
    return held + 4.0 * running * vocab_rows + 0.5 * G + p.moe_dequant_bytes + p.vision_bytes;
  };
  int slots = o.state_slots;
  if (slots <= 0) {
    constexpr int kMaxRunning = 256;
    const double left0 = p.budget_bytes - p.weight_bytes - activations(kMaxRunning);
    int running = kMaxRunning;
    if (state_per_seq > 0)
      running = static_cast<int>(std::clamp(std::floor(std::max(left0, 0.0) / 4.0 / (state_per_seq * per)), 1.0,
                                            static_cast<double>(kMaxRunning)));
    slots = running * per;
  }
  p.state_slots = slots;
  p.max_running = std::max(1, slots / per);
  p.state_bytes = state_per_seq * slots;
  p.activation_bytes = activations(p.max_running);
  const double kv_per_page = static_cast<double>(cap.kv_bytes_per_token_per_gpu) * o.page_size;
  const double left = p.budget_bytes - p.weight_bytes - p.state_bytes - p.activation_bytes;
  p.context = o.max_context > 0 ? std::min<int64_t>(o.max_context, config.max_position_embeddings)
                                : config.max_position_embeddings;
  const int64_t pages_per_seq = (p.context + o.page_size - 1) / o.page_size;
  const int64_t fit = kv_per_page > 0 ? static_cast<int64_t>(std::max(left, 0.0) / kv_per_page)
                                      : static_cast<int64_t>(slots) * pages_per_seq;
  auto too_big = [&](const std::string& what) {
    fail("out of GPU memory (planned before loading){}: {}. The budget is {:.1f} GiB ({:.1f} GiB x "
         "--mem-fraction-static {:.2f}{}): weights {:.2f} GiB + state for {} slots {:.2f} GiB + activations "
         "{:.2f} GiB. Raise --mem-fraction-static, lower --max-running-requests / --max-pass-tokens / "
         "--max-total-tokens, or use more GPUs (--tp-size) or GPUs with more memory",
         p.tp > 1 ? fmt::format(" on each GPU of tp {}", p.tp) : "", what, p.budget_bytes / G, gpu_bytes / G,
         p.fraction, p.ranks_per_gpu > 1 ? fmt::format(" / {} ranks sharing it", p.ranks_per_gpu) : "",
         p.weight_bytes / G, slots, p.state_bytes / G, p.activation_bytes / G);
  };
  if (left <= 0) too_big(fmt::format("nothing is left for the KV cache ({:.2f} GiB short)", -left / G));
  if (o.kv_pages > 0 && o.kv_pages > fit)
    too_big(fmt::format("--max-total-tokens asks for {} tokens, {} fit", o.kv_pages * o.page_size, fit * o.page_size));
  p.kv_pages = o.kv_pages > 0 ? o.kv_pages : fit;
  if (p.kv_pages < 1) too_big("the KV cache has room for no page");
  p.kv_tokens = p.kv_pages * o.page_size;
  p.kv_bytes = static_cast<double>(p.kv_pages) * kv_per_page;
  if (cap.kv_bytes_per_token_per_gpu > 0 && p.kv_pages < pages_per_seq) {
    KILN_LOG_WARN("the KV cache holds {} tokens ({:.2f} GiB), fewer than one sequence of the context length {}: the "
                  "context is capped at {} tokens (more memory: --mem-fraction-static, fewer --max-running-requests)",
                  p.kv_tokens, p.kv_bytes / G, p.context, p.kv_tokens);
    p.context = p.kv_tokens;
  }
  if (free_bytes > 0 && p.weight_bytes + p.kv_bytes + p.state_bytes + p.activation_bytes > free_bytes)
    KILN_LOG_WARN("the memory plan ({:.1f} GiB) exceeds the GPU memory free now ({:.1f} GiB): another process holds "
                  "some; loading may fail", (p.weight_bytes + p.kv_bytes + p.state_bytes + p.activation_bytes) / G,
                  free_bytes / G);
  return p;
}

namespace {
std::unique_ptr<model::Ops> make_ops_on(const std::string& device, bool self_check, const LoadOptions& options,
                                        int gpu) {
  if (device == "cpu") return make_cpu_backend();
#if KILN_HAVE_CUDA
  if (device == "cuda") {
    const KernelChoice kernels = resolve_kernels("cuda", cuda::probe_cuda_device(gpu).major, options);
    auto ops = std::make_unique<cuda::CudaOps>(
        cuda_options(kernels, options, gpu, cuda::probe_cuda_device(gpu).major));
    if (self_check) {
      auto reference = make_cpu_backend();
      // bfloat16: the tensor-core ops are held to the budgets of bf16-rounded inputs (op_check.h), the rest to 1e-5.
      startup_op_check(*ops, *reference, kernels.dtype == "bfloat16");
    } else {
      KILN_LOG_WARN("CUDA self-check skipped (--skip-self-check): results are not checked against the CPU backend");
    }
    return ops;
  }
#else
  (void)self_check;
  (void)options;
  (void)gpu;
#endif
  fail("no backend for device '{}'", device);
}
}  // namespace

std::unique_ptr<model::Ops> make_ops(const std::string& device, bool self_check, const LoadOptions& options) {
  return make_ops_on(device, self_check, options, -1);
}

void validate_parallel(const ParallelOptions& p) {
  if (p.tp_size < 1) fail("--tp-size must be at least 1, got {}", p.tp_size);
  if (p.ep_size < 1) fail("--ep-size must be at least 1, got {}", p.ep_size);
  if (p.tp_size % p.ep_size)
    fail("--ep-size {} must divide --tp-size {} (expert-parallel groups are made of tensor-parallel ranks)", p.ep_size,
         p.tp_size);
  if (p.base_gpu_id < 0) fail("--base-gpu-id must not be negative, got {}", p.base_gpu_id);
  if (p.gpu_id_step < 0) fail("--gpu-id-step must not be negative, got {}", p.gpu_id_step);
  if (p.nnodes < 1) fail("--nnodes must be at least 1, got {}", p.nnodes);
  if (p.node_rank < 0 || p.node_rank >= p.nnodes)
    fail("--node-rank {} is outside 0..{} (--nnodes {}): number the machines 0 to nnodes - 1", p.node_rank,
         p.nnodes - 1, p.nnodes);
  if (p.tp_size % p.nnodes)
    fail("--tp-size {} does not divide over --nnodes {}: every machine runs tp-size / nnodes ranks", p.tp_size,
         p.nnodes);
  if (p.nnodes > 1 && p.dist_init_addr.empty())
    fail("--nnodes {} needs --dist-init-addr host:port (node 0's address, the same on every node)", p.nnodes);
  if (!p.dist_init_addr.empty()) parse_dist_init_addr(p.dist_init_addr);
  if (p.single_rank >= 0 && (p.single_rank >= p.tp_size || !p.is_group()))
    fail("--single-rank {} needs --tp-size greater than it (got --tp-size {})", p.single_rank, p.tp_size);
  if (p.single_rank >= 0 && p.nnodes > 1) fail("--single-rank runs one GPU of one machine: drop --nnodes");
}

std::string RankPlacement::gpu_list() const {
  std::string s;
  for (size_t i = 0; i < devices.size(); ++i) s += fmt::format("{}{}", i ? "," : "", devices[i]);
  return s;
}

RankPlacement place_ranks(const ParallelOptions& p, const std::vector<GpuInfo>& gpus) {
  RankPlacement out;
  const int local = p.local_ranks();
  std::map<int, int> ranks_on;
  for (int r = 0; r < local; ++r) {
    const int d = p.base_gpu_id + r * p.gpu_id_step;
    if (d < 0 || d >= static_cast<int>(gpus.size()))
      fail("--tp-size {} puts rank {} on GPU {} (--base-gpu-id {} --gpu-id-step {}), but this machine has {} GPU(s){}: "
           "lower --tp-size, or --gpu-id-step 0 to run every rank on one GPU (for correctness checks)",
           p.tp_size, r, d, p.base_gpu_id, p.gpu_id_step, gpus.size(),
           gpus.empty() ? "" : fmt::format(" (0..{})", gpus.size() - 1));
    out.devices.push_back(d);
    const GpuInfo& g = gpus[d];
    if (!g.usable) fail("rank {} on GPU {}: {}", r, d, g.reason);
    const GpuInfo& g0 = gpus[out.devices[0]];
    if (g.name != g0.name || g.memory_bytes != g0.memory_bytes)
      fail("tensor parallel needs GPUs of one kind: GPU {} is {} ({:.1f} GiB), GPU {} is {} ({:.1f} GiB); choose "
           "matching GPUs with --base-gpu-id / --gpu-id-step (or CUDA_VISIBLE_DEVICES)",
           out.devices[0], g0.name, g0.memory_bytes / 1073741824.0, d, g.name, g.memory_bytes / 1073741824.0);
    ++ranks_on[d];
  }
  out.ranks_on_first_gpu = ranks_on[out.devices[0]];
  out.free_bytes = gpus[out.devices[0]].free_bytes;
  for (int d : out.devices) out.free_bytes = std::min(out.free_bytes, gpus[d].free_bytes);
  out.first_rank = p.node_rank * local;
  return out;
}

const std::vector<EnvDefault>& nccl_env_defaults() {
  static const std::vector<EnvDefault> defaults = {
      {"NCCL_NVLS_ENABLE", "0",
       "NVLink multicast off: the GPU machines kiln runs on require it, and kiln's all-reduces are latency-bound decode "
       "messages"}};
  return defaults;
}

#if KILN_HAVE_CUDA
namespace {

std::vector<GpuInfo> probe_gpus() {
  std::vector<GpuInfo> out;
  for (const cuda::CudaDeviceProbe& g : cuda::probe_cuda_devices())
    out.push_back({g.usable, g.reason, g.name, g.major, static_cast<double>(g.memory_bytes),
                   static_cast<double>(g.free_bytes)});
  return out;
}

// What every kind of CUDA load shares once the ranks are placed and the memory planned.
struct CudaLoad {
  const format::ModelDir& dir;
  bool self_check;
  LoadOptions planned;  // the options, with the plan's scratch size
  model::RunnerOptions ro;
  RankPlacement placed;
  std::unique_ptr<model::Ops> ops(int rank) const {
    return make_ops_on("cuda", self_check, planned, placed.devices[rank]);
  }
};

// bench-engine --single-rank: one rank of the plan alone; its all-reduces are a copy of the same size.
std::unique_ptr<model::ModelRunner> load_single_rank(CudaLoad& l) {
  const ParallelOptions& par = l.planned.parallel;
  const format::ShardPlan shards = format::plan_shards(format::load_model_config(l.dir),
                                                       format::load_quant_config(l.dir), par.tp_size, par.ep_size);
  l.ro.shard = shards.ranks[par.single_rank];
  l.ro.lone_rank = true;
  auto ops = l.ops(0);
  auto comm = cuda::make_copy_communicator(par.single_rank, par.tp_size);
  ops->set_communicator(comm.get());
  KILN_LOG_WARN("--single-rank {}: only rank {} of --tp-size {} runs; its all-reduces are device copies of the same "
                "size (a benchmark of one GPU's share; output is meaningless)",
                par.single_rank, par.single_rank, par.tp_size);
  auto runner = std::make_unique<model::Runner>(std::move(ops), l.dir, l.ro);
  runner->keep_alive(std::move(comm));
  KILN_LOG_INFO("{}", runner->describe());
  return runner;
}

// This node's ranks as one TpRunner over a CUDA group (peer memory / NCCL; NCCL across machines).
std::unique_ptr<model::ModelRunner> load_cuda_group(CudaLoad& l) {
  const ParallelOptions& par = l.planned.parallel;
  cuda::CudaGroupOptions go;
  go.devices = l.placed.devices;
  if (l.planned.gpu.disable_custom_all_reduce) go.transport = cuda::CudaGroupOptions::Transport::nccl;
  std::string group_desc = par.nnodes > 1 ? fmt::format("all-reduce: NCCL over {} nodes ({} ranks here)", par.nnodes,
                                                        par.local_ranks())
                                          : cuda::describe_cuda_group(go);
  if (l.placed.ranks_on_first_gpu > 1 && l.planned.gpu.cuda_graphs)
    group_desc += "; CUDA graphs off (ranks sharing a GPU meet on the host)";
  KILN_LOG_INFO("tensor parallel {} on GPUs {}: {}", par.tp_size, l.placed.gpu_list(), group_desc);
  l.ro.summary += "; " + group_desc;
  model::TpOptions tp;
  tp.tp = par.tp_size;
  tp.ep = par.ep_size;
  if (par.nnodes > 1) {
    // Several machines: node 0 makes the NCCL id, the rendezvous hands it to every node and keeps the connections as
    // the link node 0 drives the steps over; NCCL joins the ranks of all nodes (model/tp_runner.h).
    const NodeJoin joined = join_nodes(l.dir, l.planned, "cuda", l.ro,
                                       par.node_rank == 0 ? cuda::nccl_unique_id() : std::vector<uint8_t>{});
    go.world_size = par.tp_size;
    go.first_rank = l.placed.first_rank;
    go.nccl_id = joined.payload;
    tp.link = joined.link;
    tp.startup_timeout = std::chrono::seconds(std::max(par.dist_timeout_s, 1));
    go.timeout = tp.startup_timeout;
  }
  auto runner = std::make_unique<model::TpRunner>(
      l.dir, l.ro, tp, [&](int r) -> std::unique_ptr<model::Ops> { return l.ops(r); }, cuda::make_cuda_group(go));
  KILN_LOG_INFO("{}", runner->describe());
  return runner;
}

// Places the ranks (all checked before anything is allocated), plans the memory, then loads one runner, one rank of
// a plan, or this node's group.
std::unique_ptr<model::ModelRunner> load_cuda_model(const format::ModelDir& dir, const LoadOptions& options,
                                                    bool self_check) {
  const std::vector<GpuInfo> gpus = probe_gpus();
  const RankPlacement placed = place_ranks(options.parallel, gpus);
  const GpuInfo& first = gpus[placed.devices[0]];
  const KernelChoice kernels = resolve_kernels("cuda", first.major, options);
  KILN_LOG_INFO("kernels: {}", kernels.str());
  // Ranks sharing a GPU (--gpu-id-step 0) split it: the plan gives each its part.
  const MemoryPlan plan = plan_device_memory(dir, options, first.memory_bytes, placed.free_bytes, first.major);
  KILN_LOG_INFO("{}", plan.str());
  CudaLoad l{dir, self_check, options, runner_options(options), placed};
  // Every rank's scratch arena starts at the plan's activation estimate (less the fixed 0.5 GiB it adds for the
  // runtime's own buffers and the dequantised experts' buffer, both outside the arena), so a large pass does not grow
  // it by doubling past the plan.
  l.planned.gpu.scratch_plan_bytes =
      std::max(plan.activation_bytes - 0.5 * 1024.0 * 1024.0 * 1024.0 - plan.moe_dequant_bytes, 0.0);
  l.ro.kv_pages = plan.kv_pages;
  l.ro.state_slots = plan.state_slots;
  l.ro.max_context = plan.context;
  const bool graphs = options.gpu.cuda_graphs && placed.ranks_on_first_gpu == 1;
  l.ro.summary = fmt::format("kernels: {}; {}; CUDA graphs for decode {}{}{}{}{}{}", kernels.str(), plan.str(),
                             graphs ? "on" : "off", graphs && options.gpu.cuda_graph_verify ? " (and verify passes)" : "",
                             graphs && options.gpu.pdl && first.major >= 9
                                 ? std::string(", kernels chained by programmatic dependent launch [--disable-pdl]") +
                                       (options.gpu.weight_prefetch
                                            ? ", gemv weights prefetched into L2 before the wait "
                                              "[--enable-weight-prefetch, experimental]"
                                            : "")
                                 : std::string(),
                             options.gpu.fused_decode_ops ? "; fused decode ops [--disable-fused-decode-ops]"
                                                          : "; fused decode ops off",
                             options.gpu.persistent_moe && first.major == 9 && placed.ranks_on_first_gpu == 1
                                 ? "; MoE block of one-token steps in one persistent kernel [--enable-persistent-moe]"
                                 : "",
                             options.gpu.persistent_deltanet && first.major == 9 && placed.ranks_on_first_gpu == 1
                                 ? "; DeltaNet mixer of batch-1 decode steps in one persistent kernel "
                                   "[--enable-persistent-deltanet]"
                                 : "");
  if (options.parallel.single_rank >= 0) return load_single_rank(l);
  if (options.parallel.is_group()) return load_cuda_group(l);
  auto runner = std::make_unique<model::Runner>(l.ops(0), dir, l.ro);
  KILN_LOG_INFO("{}", runner->describe());
  return runner;
}

}  // namespace
#endif

std::unique_ptr<model::ModelRunner> load_model(const format::ModelDir& dir, const std::string& device,
                                               const LoadOptions& options, bool self_check) {
  validate_parallel(options.parallel);
  const DeviceChoice choice = resolve_device(device);
  KILN_LOG_INFO("device: {} ({})", choice.device, choice.reason);
  if (choice.device == "cpu") {
    KILN_LOG_INFO("kernels: {}", resolve_kernels("cpu", 0, options).str());
    return load_cpu_model(dir, options);
  }
  if (options.threads > 0) ThreadPool::set_global_threads(options.threads);
#if KILN_HAVE_CUDA
  return load_cuda_model(dir, options, self_check);
#else
  (void)self_check;
  fail("--device cuda: this kiln binary was built without the CUDA backend");
#endif
}

std::vector<double> time_all_reduce_on_one_gpu(int ranks, int gpu, const std::vector<int64_t>& floats, int iters) {
#if KILN_HAVE_CUDA
  cuda::CudaGroupOptions o;
  o.devices.assign(static_cast<size_t>(std::max(ranks, 1)), gpu);
  o.transport = cuda::CudaGroupOptions::Transport::peer;
  o.spin_on_shared_gpu = true;
  o.timeout = std::chrono::seconds(60);
  std::vector<double> us;
  for (const cuda::AllReduceTiming& t : cuda::time_all_reduce(o, floats, iters)) us.push_back(t.rank0_us);
  return us;
#else
  (void)ranks, (void)gpu, (void)floats, (void)iters;
  fail("timing an all-reduce needs the CUDA backend: this kiln binary was built without it");
#endif
}

}  // namespace kiln::backend
