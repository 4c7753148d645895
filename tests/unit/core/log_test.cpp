// core/log: level names and the process-wide level (set by the kiln binary from --log-level / KILN_LOG in
// cli/environment; the library itself reads no environment).
#include "core/log.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

TEST(ParseLogLevel, NamesAndTheWarningAlias) {
  const std::pair<const char*, LogLevel> names[] = {{"trace", LogLevel::trace}, {"debug", LogLevel::debug},
                                                    {"info", LogLevel::info},   {"warn", LogLevel::warn},
                                                    {"warning", LogLevel::warn}, {"error", LogLevel::error},
                                                    {"off", LogLevel::off}};
  for (const auto& [name, level] : names) {
    LogLevel got = LogLevel::off;
    EXPECT_TRUE(parse_log_level(name, &got)) << name;
    EXPECT_EQ(got, level) << name;
  }
  LogLevel unchanged = LogLevel::debug;
  for (const char* bad : {"", "INFO", "verbose", "warn "}) {
    EXPECT_FALSE(parse_log_level(bad, &unchanged)) << bad;
    EXPECT_EQ(unchanged, LogLevel::debug) << bad;
  }
}

TEST(LogLevel, SetIsWhatIsRead) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::error);
  EXPECT_EQ(log_level(), LogLevel::error);
  set_log_level(LogLevel::trace);
  EXPECT_EQ(log_level(), LogLevel::trace);
  set_log_level(saved);
}

}  // namespace
}  // namespace kiln
