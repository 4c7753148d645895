// Which backend runs the model: `--device auto|cpu|cuda`, resolved once at startup.
//   auto: cuda when this build has the CUDA backend and a supported GPU is present (compute capability 9.0 or
//         12.x), else cpu; cpu: the CPU oracle; cuda: the CUDA backend, or a kiln::Error naming what was found.
// A cuda backend passes a numerical self-check against the CPU backend before it is used (cuda/self_check.h);
// `self_check = false` (--skip-self-check) bypasses it.
#pragma once
#include <memory>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "format/model_dir.h"
#include "model/model_runner.h"
#include "model/ops.h"

namespace kiln::backend {

struct DeviceChoice {
  std::string device;  // "cpu" or "cuda"
  std::string reason;  // why, for the startup log ("NVIDIA H200 (compute capability 9.0)", "no CUDA device", ...)
};

// Resolves "auto" / "cpu" / "cuda"; throws kiln::Error for an unknown name or an unusable explicit cuda.
DeviceChoice resolve_device(const std::string& requested);

// The Ops of a resolved device ("cpu" or "cuda"); a cuda Ops is self-checked unless self_check is false.
std::unique_ptr<model::Ops> make_ops(const std::string& device, bool self_check = true);

// Loads `dir` on the requested device (auto / cpu / cuda) with the runner options of CpuLoadOptions (threads
// apply to the CPU backend only). Logs the resolved choice and the backend's description.
std::unique_ptr<model::ModelRunner> load_model(const format::ModelDir& dir, const std::string& device,
                                               const CpuLoadOptions& options, bool self_check = true);

}  // namespace kiln::backend
