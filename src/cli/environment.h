// The environment variables kiln reads, all of them here: library code takes values and never reads the
// environment.
//   KILN_LOG      the log level when --log-level is not given (trace, debug, info, warn, error or off)
//   KILN_THREADS  CPU worker threads when a command's --threads is not given
//   OPENAI_API_KEY  the key of kiln smoke / kiln bench when --api-key is not given
//   NCCL_*        the NCCL settings kiln wants (backend::nccl_env_defaults): kiln sets each only where the user left
//                 it unset, and kiln serve's startup summary says which were kiln's and which the user's.
// The functions take the environment as a lookup so that tests can give them any.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/log.h"

namespace kiln::cli {

// name -> value, nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;
// The process's environment (getenv).
EnvLookup process_env();

// --log-level when given (nullopt: it names no level), else KILN_LOG when it names a level, else info.
std::optional<LogLevel> resolve_log_level(const std::string& flag, const EnvLookup& env);

// KILN_THREADS as a thread count: a positive number, else 0 (all cores).
int threads_from_env(const EnvLookup& env);

// --api-key when given, else OPENAI_API_KEY, else "" (no key).
std::string resolve_api_key(const std::string& flag, const EnvLookup& env);

// One NCCL setting of this launch: kiln's value (set_by_kiln) or the user's, kept.
struct EnvReport {
  std::string name, value;
  bool set_by_kiln = false;
  std::string why;  // kiln's reason for its value
  std::string str() const;  // "NCCL_NVLS_ENABLE=0 (set by kiln: ...)" / "NCCL_NVLS_ENABLE=1 (yours, kept)"
};
// kiln's NCCL defaults against the environment: kiln's value where unset, the user's where set.
std::vector<EnvReport> plan_nccl_env(const EnvLookup& env);
// Plans against the process's environment and sets kiln's values (never overwriting); the report for the summary.
std::vector<EnvReport> apply_nccl_env();

}  // namespace kiln::cli
