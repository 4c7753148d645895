// Interpreter features against the oracle: each snippet of tests/fixtures/templates/snippets.json
// (expressions, filters, tests, loops, macros, whitespace control, errors) renders exactly as Python's
// jinja2 in Hugging Face's configuration renders it (tools/template_oracle.py --snippets, run here
// with python3). Where jinja2 fails (at compile or render time) kiln must throw kiln::Error.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.h"
#include "template/jinja/template.h"

namespace {

namespace jinja = kiln::tmpl::jinja;
const std::string kFixtures = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/templates";

std::string run_command(const std::string& cmd) {
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return {};
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  return pclose(pipe) == 0 ? out : std::string();
}

TEST(TemplateSnippets, MatchJinja2) {
  std::string oracle_text =
      run_command("python3 '" + std::string(KILN_SOURCE_DIR) + "/tools/template_oracle.py' --snippets '" +
                  kFixtures + "/snippets.json'");
  ASSERT_FALSE(oracle_text.empty())
      << "tools/template_oracle.py failed: python3 with jinja2 is required (scripts/setup.sh installs "
         "python3-jinja2)";
  auto oracle = nlohmann::json::parse(oracle_text);
  std::ifstream in(kFixtures + "/snippets.json");
  std::stringstream ss;
  ss << in.rdbuf();
  auto snippets = nlohmann::ordered_json::parse(ss.str());
  ASSERT_EQ(oracle.size(), snippets.size());
  int ok = 0, raised = 0;
  for (size_t i = 0; i < snippets.size(); ++i) {
    const auto& snip = snippets[i];
    const auto& want = oracle[i];
    std::string name = snip["name"].get<std::string>();
    std::unordered_map<std::string, jinja::Value> vars;
    for (const auto& [k, v] : snip["vars"].items()) vars[k] = jinja::Value::from_json(v);
    std::string got;
    std::string error;
    try {
      jinja::Template t(snip["template"].get<std::string>());
      got = t.render(vars);
    } catch (const kiln::Error& e) {
      error = e.what();
    }
    if (want["ok"].get<bool>()) {
      ++ok;
      EXPECT_TRUE(error.empty()) << name << ": kiln failed (" << error << ") but jinja2 rendered "
                                 << nlohmann::json(want["output"]).dump();
      if (error.empty())
        EXPECT_EQ(got, want["output"].get<std::string>())
            << name << "\n  template: " << snip["template"].dump();
    } else {
      ++raised;
      EXPECT_FALSE(error.empty()) << name << ": jinja2 failed (" << want["error"].get<std::string>()
                                  << ") but kiln rendered " << nlohmann::json(got).dump();
    }
  }
  std::printf("compared %d snippets with jinja2 (%d render, %d fail in both)\n", ok + raised, ok, raised);
}

}  // namespace
