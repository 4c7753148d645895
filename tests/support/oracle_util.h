// Helpers of the oracle tests (goldens from outside tools: jinja2, transformers, HF tokenizers): reading fixture
// files, running an oracle script, and turning a case's label into a GoogleTest name so that one case can be named
// and filtered (--gtest_filter='*/Qwen3_5_4B_jinja__tool_call*').
#pragma once
#include <cctype>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

namespace kiln::testing {

// The whole file ("" when it cannot be read).
inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The command's standard output; "" when it cannot run or exits non-zero.
inline std::string run_command(const std::string& cmd) {
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return {};
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  return pclose(pipe) == 0 ? out : std::string();
}

// A GoogleTest parameter name from a label: letters and digits kept, every other run of characters one '_'
// ("Qwen3.5-4B.jinja / tool call" -> "Qwen3_5_4B_jinja_tool_call"); `taken` makes it unique (a "_2" suffix).
inline std::string case_name(const std::string& label, std::set<std::string>& taken) {
  std::string out;
  for (unsigned char c : label) {
    if (std::isalnum(c))
      out += static_cast<char>(c);
    else if (!out.empty() && out.back() != '_')
      out += '_';
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  if (out.empty()) out = "case";
  std::string name = out;
  for (int i = 2; taken.count(name); ++i) name = out + "_" + std::to_string(i);
  taken.insert(name);
  return name;
}

}  // namespace kiln::testing
