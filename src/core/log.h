// Logging with levels to stderr. Level info until set_log_level() (the kiln binary sets it from --log-level or
// KILN_LOG: cli/environment.h; the library reads no environment). Thread-safe: one line per call.
#pragma once
#include <fmt/format.h>
#include <string_view>

namespace kiln {

enum class LogLevel { trace = 0, debug, info, warn, error, off };

void set_log_level(LogLevel level);
LogLevel log_level();
bool parse_log_level(std::string_view s, LogLevel* out);
void log_line(LogLevel level, std::string_view msg);

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> f, Args&&... args) {
  if (level < log_level()) return;
  log_line(level, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace kiln

#define KILN_LOG_DEBUG(...) ::kiln::log(::kiln::LogLevel::debug, __VA_ARGS__)
#define KILN_LOG_INFO(...) ::kiln::log(::kiln::LogLevel::info, __VA_ARGS__)
#define KILN_LOG_WARN(...) ::kiln::log(::kiln::LogLevel::warn, __VA_ARGS__)
#define KILN_LOG_ERROR(...) ::kiln::log(::kiln::LogLevel::error, __VA_ARGS__)
