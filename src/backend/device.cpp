#include "backend/device.h"

#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "model/runner.h"

#if KILN_HAVE_CUDA
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/self_check.h"
#endif

namespace kiln::backend {

DeviceChoice resolve_device(const std::string& requested) {
  if (requested != "auto" && requested != "cpu" && requested != "cuda")
    fail("unknown --device '{}' (use auto, cpu or cuda)", requested);
  if (requested == "cpu") return {"cpu", "--device cpu"};
#if KILN_HAVE_CUDA
  const cuda::CudaDeviceProbe probe = cuda::probe_cuda_device();
  if (probe.usable)
    return {"cuda", fmt::format("{} (device {}, compute capability {}.{})", probe.name, probe.index, probe.major,
                                probe.minor)};
  if (requested == "cuda") fail("--device cuda: {}", probe.reason);
  return {"cpu", probe.reason};
#else
  if (requested == "cuda") fail("--device cuda: this kiln binary was built without the CUDA backend (use --device cpu)");
  return {"cpu", "built without the CUDA backend"};
#endif
}

std::unique_ptr<model::Ops> make_ops(const std::string& device, bool self_check) {
  if (device == "cpu") return make_cpu_backend();
#if KILN_HAVE_CUDA
  if (device == "cuda") {
    auto ops = std::make_unique<cuda::CudaOps>();
    if (self_check) {
      auto reference = make_cpu_backend();
      cuda::self_check(*ops, *reference);
    } else {
      KILN_LOG_WARN("CUDA self-check skipped (--skip-self-check): results are not checked against the CPU backend");
    }
    return ops;
  }
#endif
  fail("no backend for device '{}'", device);
}

std::unique_ptr<model::ModelRunner> load_model(const format::ModelDir& dir, const std::string& device,
                                               const CpuLoadOptions& options, bool self_check) {
  const DeviceChoice choice = resolve_device(device);
  KILN_LOG_INFO("device: {} ({})", choice.device, choice.reason);
  if (choice.device == "cpu") return load_cpu_model(dir, options);
  if (options.threads > 0) ThreadPool::set_global_threads(options.threads);
  model::RunnerOptions ro;
  ro.kv_dtype = options.kv_dtype;
  ro.max_context = options.max_context;
  ro.kv_pages = options.kv_pages;
  ro.page_size = options.page_size;
  ro.state_slots = options.state_slots;
  ro.prefill_chunk = options.prefill_chunk;
  ro.prefill_delta_rule = options.prefill_delta_rule;
  auto runner = std::make_unique<model::Runner>(make_ops(choice.device, self_check), dir, ro);
  KILN_LOG_INFO("{}", runner->describe());
  return runner;
}

}  // namespace kiln::backend
