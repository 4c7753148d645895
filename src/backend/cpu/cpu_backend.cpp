#include "backend/cpu/cpu_backend.h"

#include "backend/cpu/cpu_ops.h"
#include "core/log.h"
#include "core/thread_pool.h"

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
  auto runner = std::make_unique<model::Runner>(make_cpu_backend(), dir, runner_options(options));
  KILN_LOG_INFO("{}", runner->describe());
  return runner;
}

}  // namespace kiln::backend
