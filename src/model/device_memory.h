// The device memory one rank of a loaded model holds (per-GPU figures for the startup summary, /get_server_info
// and /metrics).
#pragma once
#include <cstdint>
#include <string>

namespace kiln::model {

struct DeviceMemory {
  int rank = 0;          // tensor-parallel rank on this node
  int device = -1;       // device index (CUDA ordinal)
  std::string name;      // e.g. "NVIDIA H200"
  int64_t weight_bytes = 0;   // placed weights
  int64_t kv_bytes = 0;       // KV page pool
  int64_t state_bytes = 0;    // recurrent / conv state slots
  int64_t scratch_bytes = 0;  // the per-step scratch arena
  int64_t total_bytes = 0;    // the device's memory
};

}  // namespace kiln::model
