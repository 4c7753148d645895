// Chat templates against the oracle: every template in tests/fixtures/templates/templates.json renders
// every conversation of conversations.json byte-identically to Python's jinja2 configured as Hugging
// Face configures it (tools/template_oracle.py, run here with python3). A conversation the oracle
// refuses (raise_exception, TypeError, ...) must make kiln throw kiln::Error too; for
// raise_exception the message must be the template's.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.h"
#include "template/chat_template.h"

namespace {

const std::string kFixtures = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/templates";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string run_oracle() {
  std::string cmd = "python3 '" + std::string(KILN_SOURCE_DIR) + "/tools/template_oracle.py' --manifest '" +
                    kFixtures + "/templates.json' --conversations '" + kFixtures + "/conversations.json'";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return {};
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  int status = pclose(pipe);
  if (status != 0) return {};
  return out;
}

// First differing byte, with some context, for readable failures.
std::string describe_difference(const std::string& expected, const std::string& actual) {
  size_t i = 0;
  while (i < expected.size() && i < actual.size() && expected[i] == actual[i]) ++i;
  size_t from = i > 60 ? i - 60 : 0;
  return "first difference at byte " + std::to_string(i) + "\n  expected: ..." +
         nlohmann::json(expected.substr(from, 120)).dump() + "\n  actual:   ..." +
         nlohmann::json(actual.substr(from, 120)).dump();
}

TEST(TemplateOracle, AllTemplatesAllConversationsMatchJinja2) {
  std::string oracle_text = run_oracle();
  ASSERT_FALSE(oracle_text.empty())
      << "tools/template_oracle.py failed: python3 with jinja2 is required (scripts/setup.sh installs "
         "python3-jinja2)";
  auto oracle = nlohmann::json::parse(oracle_text);
  auto manifest = nlohmann::ordered_json::parse(read_file(kFixtures + "/templates.json"));
  auto conversations = nlohmann::ordered_json::parse(read_file(kFixtures + "/conversations.json"));

  int compared = 0, raised = 0;
  for (const auto& entry : manifest) {
    std::string file = entry["file"].get<std::string>();
    kiln::tmpl::ChatTemplate tmpl(read_file(kFixtures + "/" + file), entry.value("bos_token", ""),
                                  entry.value("eos_token", ""));
    const auto& rows = oracle.at(file);
    ASSERT_EQ(rows.size(), conversations.size());
    for (size_t i = 0; i < conversations.size(); ++i) {
      const auto& conv = conversations[i];
      const auto& want = rows[i];
      std::string label = file + " / " + conv["name"].get<std::string>();
      ++compared;
      if (want["ok"].get<bool>()) {
        try {
          std::string got = tmpl.render(conv["request"]);
          std::string expected = want["prompt"].get<std::string>();
          EXPECT_EQ(got, expected) << label << ": " << describe_difference(expected, got);
        } catch (const std::exception& e) {
          ADD_FAILURE() << label << ": kiln threw but jinja2 rendered: " << e.what();
        }
      } else {
        ++raised;
        std::string error = want["error"].get<std::string>();
        try {
          std::string got = tmpl.render(conv["request"]);
          ADD_FAILURE() << label << ": jinja2 raised (" << error << ") but kiln rendered "
                        << nlohmann::json(got.substr(0, 200)).dump();
        } catch (const kiln::Error& e) {
          const std::string prefix = "TemplateError: ";
          if (error.rfind(prefix, 0) == 0)
            EXPECT_EQ(std::string(e.what()), error.substr(prefix.size())) << label;
        }
      }
    }
  }
  std::printf("compared %d conversation x template renders with jinja2 (%d raise in both)\n", compared,
              raised);
  EXPECT_GE(compared, 150);
}

}  // namespace
