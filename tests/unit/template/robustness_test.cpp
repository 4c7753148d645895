// Robustness: templates mutated at random (seeded, deterministic) either render or fail with
// kiln::Error; nothing else escapes (std::out_of_range and the like would be bugs), and nothing
// crashes. A longer run of the same idea under ASan/UBSan is how the limits were checked.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <sstream>

#include "core/error.h"
#include "template/jinja/template.h"

namespace {

namespace jinja = kiln::tmpl::jinja;

TEST(JinjaRobustness, MutatedTemplatesFailCleanly) {
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/templates/";
  std::ifstream in(dir + "snippets.json");
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<std::string> corpus;
  for (const auto& s : nlohmann::ordered_json::parse(ss.str()))
    corpus.push_back(s["template"].get<std::string>());
  for (const char* name : {"Qwen3.5-4B.jinja", "Qwen3-Coder.jinja"}) {
    std::ifstream f(dir + name);
    std::stringstream t;
    t << f.rdbuf();
    corpus.push_back(t.str());
  }
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
