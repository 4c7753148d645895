// core/log: level names and the process-wide level (set by the kiln binary from --log-level / KILN_LOG in
// cli/environment; the library itself reads no environment); line formats (src/core/log.cpp): text and JSON, both
// with a full ISO-8601 UTC timestamp to the millisecond. The epoch milliseconds below come from Python's
// calendar.timegm of the stated UTC times.
#include "core/log.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

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

constexpr int64_t k2025_12_01_10_08_00_662 = 1764583680662;
constexpr int64_t k1999_12_31_23_59_59_005 = 946684799005;

TEST(Log, TextLineHasAnIsoUtcTimestamp) {
  EXPECT_EQ(format_log_line(LogFormat::text, k2025_12_01_10_08_00_662, LogLevel::info, "listening"),
            "[2025-12-01T10:08:00.662Z INFO] listening");
  EXPECT_EQ(format_log_line(LogFormat::text, k1999_12_31_23_59_59_005, LogLevel::warn, "x"),
            "[1999-12-31T23:59:59.005Z WARN] x");
}

TEST(Log, JsonLineIsOneObject) {
  const std::string msg = "request rejected error=\"'temperature' must be\"\n\ttab \x01 \\ end";
  const std::string line = format_log_line(LogFormat::json, k2025_12_01_10_08_00_662, LogLevel::error, msg);
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  nlohmann::json j = nlohmann::json::parse(line);
  EXPECT_EQ(j["time"], "2025-12-01T10:08:00.662Z");
  EXPECT_EQ(j["level"], "error");
  EXPECT_EQ(j["message"], msg);  // every character survives the escaping
  EXPECT_EQ(j.size(), 3u);
}

TEST(Log, ParseLogFormat) {
  LogFormat f = LogFormat::text;
  EXPECT_TRUE(parse_log_format("json", &f));
  EXPECT_EQ(f, LogFormat::json);
  EXPECT_TRUE(parse_log_format("text", &f));
  EXPECT_EQ(f, LogFormat::text);
  EXPECT_FALSE(parse_log_format("xml", &f));
}

}  // namespace
}  // namespace kiln
