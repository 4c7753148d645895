// The flags that choose how a model is loaded on the GPU, shared by `kiln serve` and `kiln bench-engine`
// (SGLang's names where the concept is the same).
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "model/model.h"

namespace kiln::cli {

struct GpuFlags {
  std::string load_format = "auto";
  double mem_fraction_static = 0;
  std::string attention_backend = "auto", moe_runner_backend = "auto", fp4_gemm_backend = "auto";
  bool disable_cuda_graph = false;
};

inline void add_gpu_flags(CLI::App& app, GpuFlags& f) {
  app.add_option("--load-format", f.load_format,
                 "auto (the checkpoint's safetensors) or dummy (random weights from config.json: benchmarks only)")
      ->capture_default_str();
  app.add_option("--mem-fraction-static", f.mem_fraction_static,
                 "cuda: share of GPU memory for weights, KV cache, state and activations (default 0.90)");
  app.add_option("--attention-backend", f.attention_backend, "auto, or kiln-paged (cuda)")->capture_default_str();
  app.add_option("--moe-runner-backend", f.moe_runner_backend, "auto, or kiln-grouped (cuda)")->capture_default_str();
  app.add_option("--fp4-gemm-backend", f.fp4_gemm_backend,
                 "auto, or kiln-w4a16 (cuda: FP4 decoded in registers; Hopper has no FP4 tensor cores)")
      ->capture_default_str();
  app.add_flag("--disable-cuda-graph", f.disable_cuda_graph, "cuda: run decode steps eagerly (no CUDA graphs)");
}

inline void apply_gpu_flags(const GpuFlags& f, backend::LoadOptions& lo) {
  lo.load_format = model::parse_load_format(f.load_format);
  lo.mem_fraction_static = f.mem_fraction_static;
  lo.attention_backend = f.attention_backend;
  lo.moe_runner_backend = f.moe_runner_backend;
  lo.fp4_gemm_backend = f.fp4_gemm_backend;
  lo.cuda_graphs = !f.disable_cuda_graph;
}

}  // namespace kiln::cli
