#include "cli/environment.h"

#include <cstdlib>

#include <fmt/format.h>

#include "backend/device.h"

namespace kiln::cli {

EnvLookup process_env() {
  return [](const char* name) -> std::optional<std::string> {
    if (const char* v = std::getenv(name)) return std::string(v);
    return std::nullopt;
  };
}

std::optional<LogLevel> resolve_log_level(const std::string& flag, const EnvLookup& env) {
  LogLevel level = LogLevel::info;
  if (!flag.empty()) {
    if (!parse_log_level(flag, &level)) return std::nullopt;
    return level;
  }
  if (const auto v = env("KILN_LOG")) parse_log_level(*v, &level);  // an unknown name keeps info
  return level;
}

int threads_from_env(const EnvLookup& env) {
  const auto v = env("KILN_THREADS");
  if (!v) return 0;
  const int n = std::atoi(v->c_str());
  return n > 0 ? n : 0;
}

std::string resolve_api_key(const std::string& flag, const EnvLookup& env) {
  if (!flag.empty()) return flag;
  return env("OPENAI_API_KEY").value_or("");
}

std::string EnvReport::str() const {
  return set_by_kiln ? fmt::format("{}={} (set by kiln: {})", name, value, why)
                     : fmt::format("{}={} (yours, kept)", name, value);
}

std::vector<EnvReport> plan_nccl_env(const EnvLookup& env) {
  std::vector<EnvReport> out;
  for (const backend::EnvDefault& d : backend::nccl_env_defaults()) {
    const auto user = env(d.name);
    out.push_back({d.name, user ? *user : d.value, !user, d.why});
  }
  return out;
}

std::vector<EnvReport> apply_nccl_env() {
  std::vector<EnvReport> plan = plan_nccl_env(process_env());
  for (const EnvReport& r : plan)
    if (r.set_by_kiln) setenv(r.name.c_str(), r.value.c_str(), /*overwrite=*/0);
  return plan;
}

}  // namespace kiln::cli
