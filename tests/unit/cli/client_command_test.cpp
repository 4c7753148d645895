// What kiln smoke and kiln bench share (cli/client_command.h): the server address from their flags and the --json
// output file.
#include "cli/client_command.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <unistd.h>

#include "core/error.h"

namespace kiln::cli {
namespace {

EnvLookup env_with_key(const char* key) {
  return [key](const char* name) -> std::optional<std::string> {
    if (std::string(name) == "OPENAI_API_KEY" && key) return std::string(key);
    return std::nullopt;
  };
}

TEST(ClientServerAddress, TakesTheKeyFromTheFlagElseTheEnvironment) {
  const clients::ServerAddress from_env =
      client_server_address("http://127.0.0.1:8080", "", 12.5, env_with_key("sk-env"));
  EXPECT_EQ(from_env.base_url, "http://127.0.0.1:8080");
  EXPECT_EQ(from_env.api_key, "sk-env");
  EXPECT_EQ(client_server_address("http://127.0.0.1:8080", "sk-flag", 1, env_with_key("sk-env")).api_key, "sk-flag");
  EXPECT_EQ(client_server_address("http://127.0.0.1:8080", "", 1, env_with_key(nullptr)).api_key, "");
}

TEST(ClientServerAddress, ABadUrlIsAnError) {
  EXPECT_THROW(client_server_address("not a url", "", 1, env_with_key(nullptr)), Error);
}

TEST(ClientFlags, ReadsTheFiveFlagsAndKeepsTheDefaults) {
  ClientFlags flags{.timeout_s = 600};
  CLI::App app;
  add_client_flags(app, flags, "Also write the results to FILE");
  app.parse("--model m --api-key sk-flag", false);
  EXPECT_EQ(flags.url, "http://127.0.0.1:30000");
  EXPECT_EQ(flags.api_key, "sk-flag");
  EXPECT_EQ(flags.model, "m");
  EXPECT_EQ(flags.json_path, "");
  EXPECT_EQ(flags.timeout_s, 600);
  EXPECT_NE(app.help().find("Also write the results to FILE"), std::string::npos);

  ClientFlags set;
  CLI::App app2;
  add_client_flags(app2, set, "report");
  app2.parse("--url http://10.0.0.2:8000 --json out.json --timeout 7.5", false);
  EXPECT_EQ(set.url, "http://10.0.0.2:8000");
  EXPECT_EQ(set.json_path, "out.json");
  EXPECT_EQ(set.timeout_s, 7.5);
  const clients::ServerAddress address = client_server_address(set);
  EXPECT_EQ(address.base_url, "http://10.0.0.2:8000");
  EXPECT_EQ(address.timeout_s, 7.5);
}

TEST(JsonOutputFile, WritesTheJsonAndANewline) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("kiln_json_output_" + std::to_string(::getpid()) + ".json");
  {
    JsonOutputFile out(path.string(), "results");
    out.write(nlohmann::json{{"passed", true}, {"n", 3}});
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::filesystem::remove(path);
  EXPECT_EQ(text.str(), "{\n  \"n\": 3,\n  \"passed\": true\n}\n");
}

TEST(JsonOutputFile, AnUnwritablePathFailsBeforeTheRunNamingWhatAndWhere) {
  try {
    JsonOutputFile out("/nonexistent-dir/x.json", "report");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write the --json report to '/nonexistent-dir/x.json'"),
              std::string::npos)
        << e.what();
  }
}

TEST(JsonOutputFile, AnEmptyPathWritesNothing) {
  JsonOutputFile out("", "results");
  EXPECT_NO_THROW(out.write(nlohmann::json{{"a", 1}}));
}

}  // namespace
}  // namespace kiln::cli
