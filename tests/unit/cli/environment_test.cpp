// The environment reads of the kiln binary (cli/environment.h), over fake environments.
#include "cli/environment.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "backend/device.h"

namespace kiln::cli {
namespace {

EnvLookup fake(std::map<std::string, std::string> vars) {
  return [vars](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(ResolveLogLevel, FlagThenKilnLogThenInfo) {
  EXPECT_EQ(resolve_log_level("", fake({})), LogLevel::info);
  EXPECT_EQ(resolve_log_level("", fake({{"KILN_LOG", "warn"}})), LogLevel::warn);
  EXPECT_EQ(resolve_log_level("debug", fake({{"KILN_LOG", "warn"}})), LogLevel::debug);  // the flag wins
  EXPECT_EQ(resolve_log_level("", fake({{"KILN_LOG", "loud"}})), LogLevel::info);      // an unknown name: info
  EXPECT_EQ(resolve_log_level("loud", fake({})), std::nullopt);                        // the flag's: an error
}

TEST(ThreadsFromEnv, PositiveCountsOnly) {
  EXPECT_EQ(threads_from_env(fake({})), 0);
  EXPECT_EQ(threads_from_env(fake({{"KILN_THREADS", "6"}})), 6);
  EXPECT_EQ(threads_from_env(fake({{"KILN_THREADS", "0"}})), 0);
  EXPECT_EQ(threads_from_env(fake({{"KILN_THREADS", "-2"}})), 0);
  EXPECT_EQ(threads_from_env(fake({{"KILN_THREADS", "many"}})), 0);
}

TEST(ResolveApiKey, FlagThenOpenaiApiKey) {
  EXPECT_EQ(resolve_api_key("", fake({})), "");
  EXPECT_EQ(resolve_api_key("", fake({{"OPENAI_API_KEY", "sk-env"}})), "sk-env");
  EXPECT_EQ(resolve_api_key("sk-flag", fake({{"OPENAI_API_KEY", "sk-env"}})), "sk-flag");
}

// kiln's NCCL settings go in only where the user has none; the user's are kept and reported as theirs.
TEST(PlanNcclEnv, OursWhereUnsetTheUsersKept) {
  const auto ours = plan_nccl_env(fake({}));
  ASSERT_EQ(ours.size(), backend::nccl_env_defaults().size());
  EXPECT_EQ(ours[0].name, "NCCL_NVLS_ENABLE");
  EXPECT_EQ(ours[0].value, "0");
  EXPECT_TRUE(ours[0].set_by_kiln);
  EXPECT_NE(ours[0].str().find("NCCL_NVLS_ENABLE=0 (set by kiln: "), std::string::npos) << ours[0].str();
  const auto theirs = plan_nccl_env(fake({{"NCCL_NVLS_ENABLE", "1"}}));
  EXPECT_EQ(theirs[0].value, "1");
  EXPECT_FALSE(theirs[0].set_by_kiln);
  EXPECT_EQ(theirs[0].str(), "NCCL_NVLS_ENABLE=1 (yours, kept)");
}

}  // namespace
}  // namespace kiln::cli
