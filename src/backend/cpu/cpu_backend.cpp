#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "backend/comm_local.h"
#include "backend/comm_net.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/device.h"
#include "core/error.h"
#include "core/log.h"
#include "format/model_config.h"
#include "core/thread_pool.h"
#include "model/tp_runner.h"

namespace kiln::backend {

model::RunnerOptions runner_options(const LoadOptions& options) {
  model::RunnerOptions ro;
  ro.kv_dtype = options.kv_dtype;
  ro.max_context = options.max_context;
  ro.kv_pages = options.kv_pages;
  ro.page_size = options.page_size;
  ro.state_slots = options.state_slots;
  ro.prefill_chunk = options.prefill_chunk;
  ro.prefill_delta_rule = options.prefill_delta_rule;
  ro.load_format = options.load_format;
  ro.mtp = options.mtp;
  ro.vision = options.vision;
  if (!options.gpu.cuda_graphs) ro.graph_max_batch = 0;
  ro.graph_verify_passes = options.gpu.cuda_graph_verify;
  return ro;
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<cpu::CpuOps>(); }

NodeJoin join_nodes(const format::ModelDir& dir, const LoadOptions& o, const std::string& device,
                    model::RunnerOptions& ro, const std::vector<uint8_t>& payload) {
  const format::ModelConfig config = format::load_model_config(dir);
  const ParallelOptions& p = o.parallel;
  RendezvousOptions rv;
  rv.addr = p.dist_init_addr;
  rv.node_rank = p.node_rank;
  rv.timeout = std::chrono::seconds(std::max(p.dist_timeout_s, 1));
  RendezvousHeader h;
  h.nnodes = p.nnodes;
  h.tp_size = p.tp_size;
  h.fingerprint = fmt::format("{}; --ep-size {}, device {}, dtype {}, kv {}", rendezvous_fingerprint(config), p.ep_size,
                              device, o.gpu.dtype, dtype_name(o.kv_dtype));
  KILN_LOG_INFO("node {} of {}: meeting the other nodes at {} (tp {}: ranks {}-{} here)", p.node_rank, p.nnodes,
                p.dist_init_addr, p.tp_size, p.node_rank * p.local_ranks(), (p.node_rank + 1) * p.local_ranks() - 1);
  // Node 0's blob: its sizes (5 x int64), then the payload.
  std::vector<uint8_t> blob;
  if (p.node_rank == 0) {
    for (int64_t v : {ro.kv_pages, int64_t(ro.state_slots), ro.max_context, int64_t(ro.page_size), ro.prefill_chunk}) {
      const auto* b = reinterpret_cast<const uint8_t*>(&v);
      blob.insert(blob.end(), b, b + sizeof(v));
    }
    blob.insert(blob.end(), payload.begin(), payload.end());
  }
  RendezvousLink joined = rendezvous_link(rv, h, blob);
  constexpr size_t kSizes = 5 * sizeof(int64_t);
  if (joined.blob.size() < kSizes) fail("rendezvous: node 0 sent {} bytes, at least {} expected", joined.blob.size(), kSizes);
  int64_t v[5];
  std::memcpy(v, joined.blob.data(), kSizes);
  if (p.node_rank != 0) {
    ro.kv_pages = v[0];
    ro.state_slots = static_cast<int>(v[1]);
    ro.max_context = v[2];
    ro.page_size = static_cast<int>(v[3]);
    ro.prefill_chunk = v[4];
    KILN_LOG_INFO("node {}: node 0's sizes: {} KV pages of {} tokens, {} state slots, context {}, passes of {} tokens",
                  p.node_rank, v[0], v[3], v[1], v[2], v[4]);
  }
  return {joined.link, std::vector<uint8_t>(joined.blob.begin() + kSizes, joined.blob.end())};
}

std::unique_ptr<model::ModelRunner> load_cpu_model(const format::ModelDir& dir, const LoadOptions& options) {
  validate_parallel(options.parallel);
  if (options.threads > 0) ThreadPool::set_global_threads(options.threads);
  if (options.parallel.nnodes > 1) {
    // Several machines: this node's tp / nnodes ranks as threads, joined to the other nodes' over TCP
    // (backend/comm_net.h); node 0 drives the steps (model/tp_runner.h).
    model::RunnerOptions ro = runner_options(options);
    NodeJoin joined = join_nodes(dir, options, "cpu", ro, {});
    model::TpOptions tp;
    tp.tp = options.parallel.tp_size;
    tp.ep = options.parallel.ep_size;
    tp.link = joined.link;
    tp.startup_timeout = std::chrono::seconds(std::max(options.parallel.dist_timeout_s, 1));
    auto runner = std::make_unique<model::TpRunner>(
        dir, ro, tp, [](int) -> std::unique_ptr<model::Ops> { return make_cpu_backend(); },
        make_net_group(options.parallel.tp_size, joined.link, tp.startup_timeout));
    KILN_LOG_INFO("{}", runner->describe());
    return runner;
  }
  if (options.parallel.tp_size != 1 || options.parallel.ep_size != 1) {
    // N ranks as threads of this process, each an ordinary runner over its own CpuOps and slices; the ranks share
    // the worker pool (one parallel loop at a time), so TP on the CPU checks the sharding, it does not speed it up.
    model::TpOptions tp;
    tp.tp = options.parallel.tp_size;
    tp.ep = options.parallel.ep_size;
    auto runner = std::make_unique<model::TpRunner>(
        dir, runner_options(options), tp, [](int) -> std::unique_ptr<model::Ops> { return make_cpu_backend(); },
        make_local_group(std::max(options.parallel.tp_size, 1)));
    KILN_LOG_INFO("{}", runner->describe());
    return runner;
  }
  auto runner = std::make_unique<model::Runner>(make_cpu_backend(), dir, runner_options(options));
  KILN_LOG_INFO("{}", runner->describe());
  return runner;
}

}  // namespace kiln::backend
