// --tp-size / --ep-size (aliases --tp / --ep), --base-gpu-id / --gpu-id-step and --nnodes / --node-rank /
// --dist-init-addr (SGLang's names and meanings), shared by serve, generate and bench-engine: the model is split
// over tp ranks by format/shard_plan.h (kiln inspect --tp-size N prints the plan), ep of them expert-parallel
// groups. One process per machine drives all of that machine's ranks (tp / nnodes of them). The flags fill
// backend::ParallelOptions; backend::validate_parallel is their one check.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "backend/backend.h"
#include "backend/device.h"
#include "core/error.h"
#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/shard_plan.h"

namespace kiln::cli {

// An integer flag within [lo, hi], its default shown in --help.
inline void add_ranged_flag(CLI::App& app, const char* names, int& value, int lo, int hi, const std::string& help) {
  app.add_option(names, value, help)->check(CLI::Range(lo, hi))->capture_default_str();
}

// The flags set backend::ParallelOptions directly (one type: what the flags say is what the loader gets).
inline void add_parallel_flags(CLI::App& app, backend::ParallelOptions& p) {
  add_ranged_flag(app, "--tp-size,--tp", p.tp_size, 1, 1024,
                  "Tensor-parallel ranks: attention / linear-attention heads, expert and MLP intermediate and "
                  "vocabulary split over them (--device cpu: threads of this process; see kiln inspect --tp-size N)");
  add_ranged_flag(app, "--ep-size,--ep", p.ep_size, 1, 1024,
                  "Expert-parallel groups among the tensor-parallel ranks (divides --tp-size): each group holds "
                  "num_experts / ep whole experts");
  add_ranged_flag(app, "--base-gpu-id", p.base_gpu_id, 0, 1023, "cuda: the GPU of this machine's first rank");
  add_ranged_flag(app, "--gpu-id-step", p.gpu_id_step, 0, 1023,
                  "cuda: rank r of this machine runs on GPU base-gpu-id + r x step; 0 puts every rank on one GPU "
                  "(correctness runs)");
  add_ranged_flag(app, "--nnodes", p.nnodes, 1, 1024,
                  "Machines the tensor-parallel ranks span (--tp-size must be a multiple): each runs one kiln process "
                  "with tp-size / nnodes ranks; node 0 serves HTTP and drives the steps, the others run `kiln serve` "
                  "with the same flags and their --node-rank (docs/deploy.md)");
  add_ranged_flag(app, "--node-rank", p.node_rank, 0, 1023,
                  "This machine's index among the --nnodes (0: the one that serves HTTP)");
  app.add_option("--dist-init-addr", p.dist_init_addr,
                 "host:port of node 0 (IPv4 address or host name), the same on every node: node 0 listens there and "
                 "the others connect to it at startup (needed with --nnodes > 1)");
  add_ranged_flag(app, "--dist-timeout", p.dist_timeout_s, 1, 86400,
                  "Seconds a node waits at startup for the others (the rendezvous, then every node's weights loading)");
}

// Commands other than serve drive the group from node 0 only: the other nodes run `kiln serve` (they follow node
// 0's steps whatever command node 0 runs).
inline void check_node_zero(const backend::ParallelOptions& p, const char* command) {
  if (p.nnodes > 1 && p.node_rank != 0)
    fail("kiln {} --node-rank {}: only node 0 runs {}; start the other nodes with `kiln serve` and the same "
         "--model-path, --tp-size, --nnodes, --dist-init-addr and their --node-rank", command, p.node_rank, command);
}

// The sizes' own checks (backend::validate_parallel), then the shard plan of these sizes (kiln::Error naming the
// numbers when the model cannot take them), for commands that check their flags before opening a port or loading.
inline void check_parallel_flags(const backend::ParallelOptions& p, const format::ModelConfig& config,
                                 const format::ModelDir& dir) {
  backend::validate_parallel(p);
  if (p.tp_size != 1 || p.ep_size != 1) format::plan_shards(config, format::load_quant_config(dir), p.tp_size, p.ep_size);
}

}  // namespace kiln::cli
