// The flags that choose how a model is loaded on the GPU, shared by `kiln serve` and `kiln bench-engine`
// (SGLang's names where the concept is the same); --dtype also by `kiln generate` (add_dtype_flag).
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "backend/backend.h"
#include "backend/device.h"
#include "model/model.h"

namespace kiln::cli {

// The GPU part of the load options as flags, plus the three that are spelled otherwise on the command line.
struct GpuFlags {
  backend::GpuLoadOptions gpu;   // --dtype, --mem-fraction-static, the kernel choices, --disable-custom-all-reduce
  std::string load_format = "auto";  // parsed by model::parse_load_format
  bool disable_cuda_graph = false;   // gpu.cuda_graphs = !this
  bool disable_cuda_graph_verify = false;  // gpu.cuda_graph_verify = !this
  bool disable_pdl = false;                // !gpu.pdl
  bool disable_fused_decode_ops = false;   // !gpu.fused_decode_ops
  bool disable_persistent_moe = false;     // gpu.persistent_moe = false
  bool enable_persistent_moe = false;      // gpu.persistent_moe = true
  bool disable_persistent_deltanet = false;  // gpu.persistent_deltanet = false
  bool enable_persistent_deltanet = false;   // gpu.persistent_deltanet = true
  bool enable_persistent_prefetch = false;   // gpu.persistent_prefetch = true
  bool disable_delta_rule_tensor_cores = false;  // !gpu.delta_rule_tensor_cores
  bool disable_delta_rule_split = false;         // !gpu.delta_rule_split
  bool enable_weight_prefetch = false;     // gpu.weight_prefetch
};

// --dtype: checked against the device when the model loads (backend::resolve_dtype), the same for every command.
inline void add_dtype_flag(CLI::App& app, std::string& dtype) {
  app.add_option("--dtype", dtype,
                 std::string("precision of activations at the tensor cores: auto (cuda: ") + backend::kCudaAutoDtype +
                     " for now), bfloat16 (cuda: rounded once to bf16 at each tensor-core input, a third of the MMA "
                     "work), float32 (cuda: split into 3 bf16 parts, the CPU oracle's accuracy; SGLang's alias "
                     "float). Activations are stored and accumulated in fp32 either way; the CPU backend always runs "
                     "fp32 (auto or float32)")
      ->check(CLI::IsMember({"auto", "bfloat16", "float32", "float"}))
      ->capture_default_str();
}

inline void add_gpu_flags(CLI::App& app, GpuFlags& f) {
  add_dtype_flag(app, f.gpu.dtype);
  app.add_option("--mamba-ssm-dtype", f.gpu.mamba_ssm_dtype,
                 "cuda: element type of the DeltaNet recurrent state: auto (float32), float32, or bfloat16 (opt-in: "
                 "half the state memory; updated in fp32, rounded to nearest even on store; measured no faster); the "
                 "CPU backend always keeps fp32")
      ->check(CLI::IsMember({"auto", "bfloat16", "float32"}))
      ->capture_default_str();
  app.add_option("--load-format", f.load_format,
                 "auto (the checkpoint's safetensors) or dummy (random weights from config.json: benchmarks only)")
      ->capture_default_str();
  app.add_option("--mem-fraction-static", f.gpu.mem_fraction_static,
                 "cuda: share of GPU memory for weights, KV cache, state and activations (default 0.90)");
  app.add_option("--attention-backend", f.gpu.attention_backend,
                 "cuda: auto = kiln-paged (prefill on the tensor-core flash kernel, decode split over keys), or "
                 "kiln-paged-fp32 (every step on the split-over-keys kernel, CUDA cores)")
      ->capture_default_str();
  app.add_option("--moe-runner-backend", f.gpu.moe_runner_backend,
                 "cuda: auto = kiln-grouped (NVFP4 experts on tensor cores, routing and combine as separate kernels; "
                 "with bfloat16, passes of >= 1024 tokens on sm_90 run the experts as wgmma grouped GEMMs with FP4 "
                 "decoded in registers, and on other GPUs passes of >= 4096 tokens run them dequantised to bf16 as "
                 "cuBLAS grouped GEMMs), or kiln-mma (the mma.sync expert kernels at every size), or kiln-wgmma (the "
                 "wgmma grouped GEMMs at every size; bfloat16, sm_90), or kiln-blas (the dequantised cuBLAS path at "
                 "every step outside CUDA graphs; bfloat16, sm_90+), or kiln-grouped-fp32 (fp32 CUDA-core kernels), "
                 "or kiln-fused-decode (steps of <= 8 tokens: routing + NVFP4 experts in two fused CUDA-core kernels, "
                 "larger steps as kiln-grouped; experimental: slower than kiln-grouped at batch 1 on an H100)")
      ->capture_default_str();
  app.add_option("--fp4-gemm-backend", f.gpu.fp4_gemm_backend,
                 "cuda: auto = kiln-w4a16 (NVFP4 linears of many rows on tensor cores, FP4 decoded in registers; "
                 "Hopper has no FP4 tensor cores), or kiln-fp32 (the fp32 gemm)")
      ->capture_default_str();
  app.add_flag("--disable-cuda-graph", f.disable_cuda_graph, "cuda: run decode steps eagerly (no CUDA graphs)");
  app.add_flag("--disable-cuda-graph-verify", f.disable_cuda_graph_verify,
               "cuda: run speculative decoding's verify passes eagerly (default: captured as CUDA graphs like decode "
               "steps; docs/perf/speculative.md)");
  // The default since it was measured (docs/perf/speculative.md); still accepted, hidden from --help.
  bool* verify_off = &f.disable_cuda_graph_verify;
  app.add_flag_callback("--cuda-graph-verify", [verify_off] { *verify_off = false; })->group("");
  app.add_flag("--disable-pdl", f.disable_pdl,
               "cuda: launch the kernels of captured steps in plain stream order (default on sm_90+: programmatic "
               "dependent launch, each kernel's start overlapping the previous one's tail; decode batch 1 about 5% "
               "faster on an H100; docs/perf/decode-latency.md)");
  // Was the experimental opt-in before PDL became the default; still accepted, hidden from --help.
  bool* pdl_off = &f.disable_pdl;
  app.add_flag_callback("--enable-pdl", [pdl_off] { *pdl_off = false; })->group("");
  app.add_flag("--disable-fused-decode-ops", f.disable_fused_decode_ops,
               "cuda: run the attention q/k norm + rotary prologue, the gated down / output projections and the "
               "DeltaNet output norm as separate kernels (default: fused, one launch each; the same arithmetic)");
  app.add_flag("--enable-persistent-moe", f.enable_persistent_moe,
               "cuda, experimental: run the MoE block of one-token steps (decode at batch 1, draft steps) as one "
               "persistent kernel on sm_90 where each rank has its own GPU: the residual norm, router, shared expert, "
               "routing, NVFP4 experts and combine as phases of one grid separated by grid-wide barriers. Correct on "
               "an H100 but not yet faster (docs/perf/decode-latency.md)");
  app.add_flag("--disable-persistent-moe", f.disable_persistent_moe,
               "cuda: run the MoE block as its separate kernels (the default for now)");
  app.add_flag("--enable-persistent-deltanet", f.enable_persistent_deltanet,
               "cuda, experimental: run the Gated DeltaNet mixer of decode steps at batch 1 as one persistent kernel on "
               "sm_90 where each rank has its own GPU: input norm, projections, conv, gates, delta rule, output norm "
               "and output projection as phases of one grid (2% faster on an H100; docs/perf/decode-latency.md)");
  app.add_flag("--disable-persistent-deltanet", f.disable_persistent_deltanet,
               "cuda: run the DeltaNet mixer of decode steps as its separate kernels (the default for now)");
  app.add_flag("--enable-persistent-prefetch", f.enable_persistent_prefetch,
               "cuda, experimental: the persistent kernels ask L2 for the weights each warp reads next (the next "
               "projection row, the next phase's rows while the current one runs)");
  app.add_option("--moe-wgmma-tile-rows", f.gpu.moe_wgmma_tile_rows,
                 "cuda, sm_90: row-tile height of the wgmma expert GEMMs of large passes: 0 (default) picks by the rows "
                 "per expert (128 from 128 on average, else 64), 64 or 128 pins one (A/B timing); 256: experimental, "
                 "not yet run on a GPU (each decoded weight serves twice the rows; no producer form, no down walk)")
      ->check(CLI::IsMember({0, 64, 128, 256}));
  app.add_option("--moe-wgmma-down-walk", f.gpu.moe_wgmma_down_walk,
                 "cuda, sm_90, experimental (not yet run on a GPU): each block of the wgmma down GEMM of large passes "
                 "walks this many 128-feature blocks, keeping its row tile's activations in shared memory (where they "
                 "fit: expert intermediate <= 512 at 64-row tiles, <= 640 at 128); 0 (default): one feature block each")
      ->check(CLI::IsMember({0, 2, 4, 8}));
  app.add_flag("--enable-wgmma-narrow-tiles", f.gpu.moe_wgmma_narrow,
               "cuda, sm_90, experimental (not yet run on a GPU): the wgmma expert GEMMs multiply each row tile as "
               "wide as its rows rounded up to 32 (m64n32 / n64 / n96 / n128), not the whole tile height, so the "
               "partial last tile of each expert costs fewer MMAs");
  app.add_flag("--enable-wide-moe-grouping", f.gpu.moe_group_wide,
               "cuda, sm_90, experimental (not yet run on a GPU): the wgmma path groups a large pass's (token, "
               "expert) pairs by expert over many blocks (count, scan, place) instead of one block");
  app.add_flag("--enable-wgmma-producer", f.gpu.moe_wgmma_producer,
               "cuda, sm_90, experimental (not yet run on a GPU): the wgmma expert GEMMs with a producer warp streaming "
               "their shared-memory stages and mbarriers instead of a block barrier per k block");
  app.add_flag("--disable-delta-rule-tensor-cores", f.disable_delta_rule_tensor_cores,
               "cuda: run the chunked gated delta rule's matrix products (prefill) on the fp32 CUDA cores (default: "
               "tensor cores, tf32 mma; inputs in 2 tf32 parts under --dtype float32, rounded once to tf32 under "
               "bfloat16)");
  app.add_flag("--disable-delta-rule-split", f.disable_delta_rule_split,
               "cuda: run the chunked gated delta rule (prefill) as the single kernel that walks each sequence's chunks "
               "(default: two kernels, a per-chunk preparation parallel over chunks and heads, then the scan over "
               "chunks, with a workspace of ~41 KiB per token at the 35B-A3B's heads; needs the tensor cores)");
  app.add_flag("--enable-weight-prefetch", f.enable_weight_prefetch,
               "cuda, experimental: with programmatic dependent launch, each block of the decode gemv kernels first "
               "asks L2 to prefetch its weight rows, so they stream while the previous kernel finishes (measured no "
               "faster on an H100, so off; docs/perf/decode-latency.md)");
  app.add_flag("--disable-custom-all-reduce", f.gpu.disable_custom_all_reduce,
               "cuda, --tp-size > 1: all-reduce through NCCL only (default: the one-shot peer-memory all-reduce for "
               "messages up to 8 MiB, NCCL above)");
}

inline void apply_gpu_flags(const GpuFlags& f, backend::LoadOptions& lo) {
  lo.load_format = model::parse_load_format(f.load_format);
  lo.gpu = f.gpu;
  lo.gpu.cuda_graphs = !f.disable_cuda_graph;
  lo.gpu.cuda_graph_verify = !f.disable_cuda_graph_verify;
  lo.gpu.pdl = !f.disable_pdl;
  lo.gpu.fused_decode_ops = !f.disable_fused_decode_ops;
  lo.gpu.persistent_moe = f.enable_persistent_moe && !f.disable_persistent_moe;
  lo.gpu.persistent_deltanet = f.enable_persistent_deltanet && !f.disable_persistent_deltanet;
  lo.gpu.persistent_prefetch = f.enable_persistent_prefetch;
  lo.gpu.delta_rule_tensor_cores = !f.disable_delta_rule_tensor_cores;
  lo.gpu.delta_rule_split = !f.disable_delta_rule_split;
  lo.gpu.weight_prefetch = f.enable_weight_prefetch;
}

}  // namespace kiln::cli
