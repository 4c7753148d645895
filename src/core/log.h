// Logging with levels to stderr. Level info until set_log_level() (the kiln binary sets it from --log-level or
// KILN_LOG: cli/environment.h; the library reads no environment). Thread-safe: one line per call. Every line carries
// a full ISO-8601 UTC timestamp with milliseconds; set_log_format() picks text
// ("[2026-12-01T10:08:00.662Z INFO] message") or JSON, one object per line
// ({"time": "2026-12-01T10:08:00.662Z", "level": "info", "message": "..."}).
#pragma once
#include <fmt/format.h>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln {

enum class LogLevel { trace = 0, debug, info, warn, error, off };

void set_log_level(LogLevel level);
LogLevel log_level();
bool parse_log_level(std::string_view s, LogLevel* out);
void log_line(LogLevel level, std::string_view msg);

enum class LogFormat { text, json };
void set_log_format(LogFormat format);
bool parse_log_format(std::string_view s, LogFormat* out);  // "text" or "json"
// One log line as written, without the newline (time_ms: milliseconds since the Unix epoch).
std::string format_log_line(LogFormat format, int64_t time_ms, LogLevel level, std::string_view msg);

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
