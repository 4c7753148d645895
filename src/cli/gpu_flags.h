// The flags that choose how a model is loaded on the GPU, shared by `kiln serve` and `kiln bench-engine`
// (SGLang's names where the concept is the same); --dtype also by `kiln generate` (add_dtype_flag).
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "backend/device.h"
#include "model/model.h"

namespace kiln::cli {

struct GpuFlags {
  std::string load_format = "auto";
  std::string dtype = "auto";
  double mem_fraction_static = 0;
  std::string attention_backend = "auto", moe_runner_backend = "auto", fp4_gemm_backend = "auto";
  bool disable_cuda_graph = false;
  bool disable_custom_all_reduce = false;
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
  add_dtype_flag(app, f.dtype);
  app.add_option("--load-format", f.load_format,
                 "auto (the checkpoint's safetensors) or dummy (random weights from config.json: benchmarks only)")
      ->capture_default_str();
  app.add_option("--mem-fraction-static", f.mem_fraction_static,
                 "cuda: share of GPU memory for weights, KV cache, state and activations (default 0.90)");
  app.add_option("--attention-backend", f.attention_backend,
                 "cuda: auto = kiln-paged (prefill on the tensor-core flash kernel, decode split over keys), or "
                 "kiln-paged-fp32 (every step on the split-over-keys kernel, CUDA cores)")
      ->capture_default_str();
  app.add_option("--moe-runner-backend", f.moe_runner_backend,
                 "cuda: auto = kiln-fused-decode on sm_90 (steps of <= 8 tokens: routing + NVFP4 experts in two "
                 "fused kernels; larger steps as kiln-grouped), kiln-grouped elsewhere; kiln-grouped (NVFP4 experts "
                 "on tensor cores, routing and combine as separate kernels), or kiln-grouped-fp32 (fp32 CUDA-core "
                 "kernels)")
      ->capture_default_str();
  app.add_option("--fp4-gemm-backend", f.fp4_gemm_backend,
                 "cuda: auto = kiln-w4a16 (NVFP4 linears of many rows on tensor cores, FP4 decoded in registers; "
                 "Hopper has no FP4 tensor cores), or kiln-fp32 (the fp32 gemm)")
      ->capture_default_str();
  app.add_flag("--disable-cuda-graph", f.disable_cuda_graph, "cuda: run decode steps eagerly (no CUDA graphs)");
  // Removed (it was documented, so passing it fails with the reason instead of an unknown-option error or a silent
  // no-op); hidden from --help.
  app.add_flag_callback("--enable-pdl", [] {
        throw CLI::ValidationError("--enable-pdl",
                                   "removed: programmatic dependent launch gave wrong tokens intermittently in "
                                   "serving, so kernels always launch in plain stream order; drop the flag");
      })->group("");
  app.add_flag("--disable-custom-all-reduce", f.disable_custom_all_reduce,
               "cuda, --tp-size > 1: all-reduce through NCCL only (default: the one-shot peer-memory all-reduce for "
               "messages up to 8 MiB, NCCL above)");
}

inline void apply_gpu_flags(const GpuFlags& f, backend::LoadOptions& lo) {
  lo.load_format = model::parse_load_format(f.load_format);
  lo.dtype = f.dtype;
  lo.mem_fraction_static = f.mem_fraction_static;
  lo.attention_backend = f.attention_backend;
  lo.moe_runner_backend = f.moe_runner_backend;
  lo.fp4_gemm_backend = f.fp4_gemm_backend;
  lo.cuda_graphs = !f.disable_cuda_graph;
  lo.disable_custom_all_reduce = f.disable_custom_all_reduce;
}

}  // namespace kiln::cli
