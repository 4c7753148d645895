#include "backend/cpu/cpu_backend.h"

#include <algorithm>

#include "backend/comm_local.h"
#include "backend/cpu/cpu_ops.h"
#include "core/log.h"
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
  if (!options.cuda_graphs) ro.graph_max_batch = 0;
  return ro;
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<cpu::CpuOps>(); }

std::unique_ptr<model::ModelRunner> load_cpu_model(const format::ModelDir& dir, const CpuLoadOptions& options) {
  if (options.threads > 0) ThreadPool::set_global_threads(options.threads);
  if (options.tp_size != 1 || options.ep_size != 1) {
    // N ranks as threads of this process, each an ordinary runner over its own CpuOps and slices; the ranks share
    // the worker pool (one parallel loop at a time), so TP on the CPU checks the sharding, it does not speed it up.
    model::TpOptions tp;
    tp.tp = options.tp_size;
    tp.ep = options.ep_size;
    auto runner = std::make_unique<model::TpRunner>(
        dir, runner_options(options), tp, [](int) -> std::unique_ptr<model::Ops> { return make_cpu_backend(); },
        make_local_group(std::max(options.tp_size, 1)));
    KILN_LOG_INFO("{}", runner->describe());
    return runner;
  }
  auto runner = std::make_unique<model::Runner>(make_cpu_backend(), dir, runner_options(options));
  KILN_LOG_INFO("{}", runner->describe());
  return runner;
}

}  // namespace kiln::backend
