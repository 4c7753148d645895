// Prometheus text exposition of the engine and HTTP counters (GET /metrics).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "engine/metrics.h"

namespace kiln::server {

struct HttpCounts {
  std::map<std::pair<std::string, int>, uint64_t> requests;  // (endpoint, status) -> count
};

std::string render_metrics(const engine::EngineMetricsSnapshot& m, const HttpCounts& http,
                           const std::string& model_name);

}  // namespace kiln::server
