// --tp-size / --ep-size (aliases --tp / --ep; SGLang's names and meanings), shared by serve, generate and
// bench-engine: the model is split over tp ranks by format/shard_plan.h (kiln inspect --tp-size N prints the plan),
// ep of them expert-parallel groups. One process drives every rank.
#pragma once
#include <CLI/CLI.hpp>

#include "backend/cpu/cpu_backend.h"
#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/shard_plan.h"

namespace kiln::cli {

struct ParallelFlags {
  int tp_size = 1;
  int ep_size = 1;
};

inline void add_parallel_flags(CLI::App& app, ParallelFlags& f) {
  app.add_option("--tp-size,--tp", f.tp_size,
                 "Tensor-parallel ranks: attention / linear-attention heads, expert and MLP intermediate and vocabulary "
                 "split over them (--device cpu: threads of this process; see kiln inspect --tp-size N)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--ep-size,--ep", f.ep_size,
                 "Expert-parallel groups among the tensor-parallel ranks (divides --tp-size): each group holds "
                 "num_experts / ep whole experts")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
}

inline void apply_parallel_flags(const ParallelFlags& f, backend::LoadOptions& lo) {
  lo.tp_size = f.tp_size;
  lo.ep_size = f.ep_size;
}

// The shard plan of these sizes (kiln::Error naming the numbers when the model cannot take them), for commands that
// check their flags before opening a port or loading anything.
inline void check_parallel_flags(const ParallelFlags& f, const format::ModelConfig& config, const format::ModelDir& dir) {
  if (f.tp_size != 1 || f.ep_size != 1) format::plan_shards(config, format::load_quant_config(dir), f.tp_size, f.ep_size);
}

}  // namespace kiln::cli
