// The Template API (src/template/jinja/template.h) against the oracle: each snippet of
// tests/fixtures/templates/snippets.json (expressions, filters, tests, loops, macros, whitespace control, errors),
// one named case each, renders exactly as Python's jinja2 in Hugging Face's configuration renders it
// (tools/template_oracle.py --snippets, run here with python3); where jinja2 fails (at compile or render time) kiln
// must throw kiln::Error. The snippets run the lexer, parser, interpreter and builtins together. Then robustness:
// templates mutated at random (seeded, deterministic) either render or fail with kiln::Error; nothing else escapes
// (std::out_of_range and the like would be bugs), and nothing crashes. A longer run of the same idea under
// ASan/UBSan is how the limits were checked.
#include "template/jinja/template.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "oracle_util.h"

namespace {

namespace jinja = kiln::tmpl::jinja;
const std::string kFixtures = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/templates";

const nlohmann::ordered_json& snippets() {
  static const nlohmann::ordered_json s =
      nlohmann::ordered_json::parse(kiln::testing::read_text_file(kFixtures + "/snippets.json"));
  return s;
}

// jinja2's renders of every snippet (one run of the oracle for the whole suite).
const nlohmann::json& oracle() {
  static const nlohmann::json out = [] {
    const std::string text = kiln::testing::run_command("python3 '" + std::string(KILN_SOURCE_DIR) +
                                                        "/tools/template_oracle.py' --snippets '" + kFixtures +
                                                        "/snippets.json'");
    return text.empty() ? nlohmann::json() : nlohmann::json::parse(text);
  }();
  return out;
}

struct SnippetCase {
  std::string name;  // the GoogleTest name
  size_t index;      // into snippets.json
};

void PrintTo(const SnippetCase& c, std::ostream* os) { *os << c.name; }

std::vector<SnippetCase> snippet_cases() {
  std::vector<SnippetCase> cases;
  std::set<std::string> taken;
  for (size_t i = 0; i < snippets().size(); ++i)
    cases.push_back({kiln::testing::case_name(snippets()[i]["name"].get<std::string>(), taken), i});
  return cases;
}

class TemplateSnippet : public ::testing::TestWithParam<SnippetCase> {};

TEST_P(TemplateSnippet, MatchesJinja2) {
  ASSERT_FALSE(oracle().is_null())
      << "tools/template_oracle.py failed: python3 with jinja2 is required (scripts/setup.sh installs "
         "python3-jinja2)";
  ASSERT_EQ(oracle().size(), snippets().size());
  const auto& snip = snippets()[GetParam().index];
  const auto& want = oracle()[GetParam().index];
  std::unordered_map<std::string, jinja::Value> vars;
  for (const auto& [k, v] : snip["vars"].items()) vars[k] = jinja::Value::from_json(v);
  std::string got, error;
  try {
    got = jinja::Template(snip["template"].get<std::string>()).render(vars);
  } catch (const kiln::Error& e) {
    error = e.what();
  }
  if (want["ok"].get<bool>()) {
    ASSERT_TRUE(error.empty()) << "kiln failed (" << error << ") but jinja2 rendered "
                               << nlohmann::json(want["output"]).dump();
    EXPECT_EQ(got, want["output"].get<std::string>()) << "template: " << snip["template"].dump();
  } else {
    EXPECT_FALSE(error.empty()) << "jinja2 failed (" << want["error"].get<std::string>() << ") but kiln rendered "
                                << nlohmann::json(got).dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Snippets, TemplateSnippet, ::testing::ValuesIn(snippet_cases()),
                         [](const ::testing::TestParamInfo<SnippetCase>& info) { return info.param.name; });

TEST(JinjaRobustness, MutatedTemplatesFailCleanly) {
  std::vector<std::string> corpus;
  for (const auto& s : snippets()) corpus.push_back(s["template"].get<std::string>());
  for (const char* name : {"Qwen3.5-4B.jinja", "Qwen3-Coder.jinja"})
    corpus.push_back(kiln::testing::read_text_file(kFixtures + "/" + name));
  const std::vector<std::string> pieces = {"{%",        "%}",
                                           "{{",        "}}",
                                           "{#",        "#}",
                                           "-",         "+",
                                           "(",         ")",
                                           "[",         "]",
                                           "{",         "}",
                                           "|",         ".",
                                           ",",         ":",
                                           " if ",      " for ",
                                           " in ",      " endfor ",
                                           " endif ",   " else ",
                                           " macro ",   " endmacro ",
                                           " set ",     " not ",
                                           " is ",      "loop",
                                           "caller()",  "'x'",
                                           "1e999",     "99999999999999999999",
                                           "0x",        "none",
                                           "ns",        "namespace(a=1)",
                                           "range(3)",  "~",
                                           "**",        "//",
                                           "%",         "\n",
                                           "raw",       "endraw",
                                           "recursive", "loop(x)",
                                           "break",     "tojson",
                                           "items",     "[::-1]",
                                           "'%s' %",    "'{}'.format",
                                           "\\",        "'",
                                           "\xff",      "\xe2\x82"};
  auto vars_json = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null,
          "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2]}}}]}], "x": [1, {"k": "v"}],
          "tools": null, "add_generation_prompt": true})");
  std::unordered_map<std::string, jinja::Value> vars;
  for (const auto& [k, v] : vars_json.items()) vars[k] = jinja::Value::from_json(v);
  jinja::RenderLimits limits;
  limits.max_steps = 100'000;
  limits.max_output_bytes = 1 << 20;

  std::mt19937 rng(20240611);
  int rendered = 0, failed = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    std::string s = corpus[rng() % corpus.size()];
    for (int m = 1 + rng() % 5; m > 0; --m) {
      size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
      switch (rng() % 3) {
        case 0:
          s.insert(pos, pieces[rng() % pieces.size()]);
          break;
        case 1:
          if (!s.empty()) s.erase(rng() % s.size(), 1 + rng() % 8);
          break;
        default:
          if (!s.empty()) s[rng() % s.size()] = static_cast<char>(rng() % 256);
      }
    }
    try {
      jinja::Template(s).render(vars, limits);
      ++rendered;
    } catch (const kiln::Error&) {
      ++failed;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "non-kiln exception " << e.what() << " for template "
                    << nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
  }
  EXPECT_GT(rendered, 100);
  EXPECT_GT(failed, 100);
}

}  // namespace
