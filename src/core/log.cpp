#include "core/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

#include "core/json_string.h"

namespace kiln {
namespace {

std::atomic<int>& level_ref() {
  static std::atomic<int> level{static_cast<int>(LogLevel::info)};
  return level;
}

std::mutex& log_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

void set_log_level(LogLevel level) { level_ref().store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(level_ref().load(std::memory_order_relaxed)); }

bool parse_log_level(std::string_view s, LogLevel* out) {
  static constexpr std::pair<std::string_view, LogLevel> names[] = {
      {"trace", LogLevel::trace}, {"debug", LogLevel::debug}, {"info", LogLevel::info},
      {"warn", LogLevel::warn},   {"warning", LogLevel::warn}, {"error", LogLevel::error},
      {"off", LogLevel::off}};
  for (auto& [name, level] : names)
    if (s == name) {
      *out = level;
      return true;
    }
  return false;
}

std::atomic<int>& format_ref() {
  static std::atomic<int> format{static_cast<int>(LogFormat::text)};
  return format;
}

void set_log_format(LogFormat format) { format_ref().store(static_cast<int>(format)); }

bool parse_log_format(std::string_view s, LogFormat* out) {
  if (s == "text") *out = LogFormat::text;
  else if (s == "json") *out = LogFormat::json;
  else return false;
  return true;
}

namespace {

// "2026-12-01T10:08:00.662Z"
std::string iso8601_utc(int64_t time_ms) {
  const int64_t floor_s = time_ms >= 0 ? time_ms / 1000 : -((-time_ms + 999) / 1000);
  const std::time_t t = static_cast<std::time_t>(floor_s);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", ts, static_cast<int>(time_ms - floor_s * 1000));
}

}  // namespace

std::string format_log_line(LogFormat format, int64_t time_ms, LogLevel level, std::string_view msg) {
  static constexpr const char* tags[] = {"TRACE", "DEBUG", "INFO", "WARN", "ERROR", "OFF"};
  static constexpr const char* names[] = {"trace", "debug", "info", "warn", "error", "off"};
  const int l = static_cast<int>(level);
  if (format == LogFormat::json)
    return fmt::format("{{\"time\": \"{}\", \"level\": \"{}\", \"message\": {}}}", iso8601_utc(time_ms), names[l],
                       json_string(msg));
  return fmt::format("[{} {}] {}", iso8601_utc(time_ms), tags[l], msg);
}

void log_line(LogLevel level, std::string_view msg) {
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const std::string line =
      format_log_line(static_cast<LogFormat>(format_ref().load(std::memory_order_relaxed)), now_ms, level, msg);
  std::lock_guard lock(log_mutex());
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace kiln
