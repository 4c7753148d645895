// Prometheus text exposition of the engine and HTTP counters (GET /metrics).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/metrics.h"
#include "model/device_memory.h"

namespace kiln::server {

struct HttpCounts {
  std::map<std::pair<std::string, int>, uint64_t> requests;  // (endpoint, status) -> count
};

// devices: each GPU rank's memory (gauges labelled gpu / rank; none on the CPU backend).
std::string render_metrics(const engine::EngineMetricsSnapshot& m, const HttpCounts& http,
                           const std::string& model_name, const std::vector<model::DeviceMemory>& devices = {});

}  // namespace kiln::server
