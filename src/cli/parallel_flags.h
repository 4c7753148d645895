// --tp-size / --ep-size (aliases --tp / --ep), --base-gpu-id / --gpu-id-step and --nnodes / --node-rank /
// --dist-init-addr (SGLang's names and meanings), shared by serve, generate and bench-engine: the model is split
// over tp ranks by format/shard_plan.h (kiln inspect --tp-size N prints the plan), ep of them expert-parallel
// groups. One process per machine drives all of that machine's ranks (tp / nnodes of them).
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "backend/device.h"
#include "backend/rendezvous.h"
#include "core/error.h"
#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/shard_plan.h"

namespace kiln::cli {

struct ParallelFlags {
  int tp_size = 1;
  int ep_size = 1;
  int base_gpu_id = 0;
  int gpu_id_step = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string dist_init_addr;
  int dist_timeout_s = 600;
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
  app.add_option("--base-gpu-id", f.base_gpu_id, "cuda: the GPU of this machine's first rank")
      ->check(CLI::Range(0, 1023))
      ->capture_default_str();
  app.add_option("--gpu-id-step", f.gpu_id_step,
                 "cuda: rank r of this machine runs on GPU base-gpu-id + r x step; 0 puts every rank on one GPU "
                 "(correctness runs)")
      ->check(CLI::Range(0, 1023))
      ->capture_default_str();
  app.add_option("--nnodes", f.nnodes,
                 "Machines the tensor-parallel ranks span (--tp-size must be a multiple): each runs one kiln process "
                 "with tp-size / nnodes ranks; node 0 serves HTTP and drives the steps, the others run `kiln serve` "
                 "with the same flags and their --node-rank (docs/deploy.md)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--node-rank", f.node_rank, "This machine's index among the --nnodes (0: the one that serves HTTP)")
      ->check(CLI::Range(0, 1023))
      ->capture_default_str();
  app.add_option("--dist-init-addr", f.dist_init_addr,
                 "host:port of node 0 (IPv4 address or host name), the same on every node: node 0 listens there and "
                 "the others connect to it at startup (needed with --nnodes > 1)");
  app.add_option("--dist-timeout", f.dist_timeout_s,
                 "Seconds a node waits at startup for the others (the rendezvous, then every node's weights loading)")
      ->check(CLI::Range(1, 86400))
      ->capture_default_str();
}

// Checks the flags on their own (no model, no device), naming the numbers; kiln::Error otherwise.
inline void validate_parallel_flags(const ParallelFlags& f) {
  if (f.tp_size < 1) fail("--tp-size must be at least 1, got {}", f.tp_size);
  if (f.ep_size < 1) fail("--ep-size must be at least 1, got {}", f.ep_size);
  if (f.tp_size % f.ep_size)
    fail("--ep-size {} must divide --tp-size {} (expert-parallel groups are made of tensor-parallel ranks)", f.ep_size,
         f.tp_size);
  if (f.base_gpu_id < 0) fail("--base-gpu-id must not be negative, got {}", f.base_gpu_id);
  if (f.gpu_id_step < 0) fail("--gpu-id-step must not be negative, got {}", f.gpu_id_step);
  if (f.nnodes < 1) fail("--nnodes must be at least 1, got {}", f.nnodes);
  if (f.node_rank < 0 || f.node_rank >= f.nnodes)
    fail("--node-rank {} is outside 0..{} (--nnodes {}): number the machines 0 to nnodes - 1", f.node_rank,
         f.nnodes - 1, f.nnodes);
  if (f.tp_size % f.nnodes)
    fail("--tp-size {} does not divide over --nnodes {}: every machine runs tp-size / nnodes ranks", f.tp_size,
         f.nnodes);
  if (f.nnodes > 1 && f.dist_init_addr.empty())
    fail("--nnodes {} needs --dist-init-addr host:port (node 0's address, the same on every node)", f.nnodes);
  if (!f.dist_init_addr.empty()) backend::parse_dist_init_addr(f.dist_init_addr);
}

// Commands other than serve drive the group from node 0 only: the other nodes run `kiln serve` (they follow node
// 0's steps whatever command node 0 runs).
inline void check_node_zero(const ParallelFlags& f, const char* command) {
  if (f.nnodes > 1 && f.node_rank != 0)
    fail("kiln {} --node-rank {}: only node 0 runs {}; start the other nodes with `kiln serve` and the same "
         "--model-path, --tp-size, --nnodes, --dist-init-addr and their --node-rank", command, f.node_rank, command);
}

// Validates the flags (kiln::Error before anything loads) and sets them into the load options.
inline void apply_parallel_flags(const ParallelFlags& f, backend::LoadOptions& lo, const std::string& device) {
  (void)device;
  validate_parallel_flags(f);
  lo.tp_size = f.tp_size;
  lo.ep_size = f.ep_size;
  lo.base_gpu_id = f.base_gpu_id;
  lo.gpu_id_step = f.gpu_id_step;
  lo.nnodes = f.nnodes;
  lo.node_rank = f.node_rank;
  lo.dist_init_addr = f.dist_init_addr;
  lo.dist_timeout_s = f.dist_timeout_s;
}

// The flags' own checks, then the shard plan of these sizes (kiln::Error naming the numbers when the model cannot
// take them), for commands that check their flags before opening a port or loading anything.
inline void check_parallel_flags(const ParallelFlags& f, const format::ModelConfig& config, const format::ModelDir& dir) {
  validate_parallel_flags(f);
  if (f.tp_size != 1 || f.ep_size != 1) format::plan_shards(config, format::load_quant_config(dir), f.tp_size, f.ep_size);
}

}  // namespace kiln::cli
