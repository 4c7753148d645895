#include "core/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

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

void log_line(LogLevel level, std::string_view msg) {
  static constexpr const char* tags[] = {"TRACE", "DEBUG", "INFO", "WARN", "ERROR", "OFF"};
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  localtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof ts, "%H:%M:%S", &tm);
  std::lock_guard lock(log_mutex());
  std::fprintf(stderr, "[%s.%03d %s] %.*s\n", ts, ms, tags[static_cast<int>(level)], static_cast<int>(msg.size()), msg.data());
  std::fflush(stderr);
}

}  // namespace kiln
