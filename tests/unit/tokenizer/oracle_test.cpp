// Differential test against HF tokenizers' JS implementation (@huggingface/tokenizers): the node
// script tests/js/tokenize_oracle.mjs encodes the corpus in tests/fixtures/tokenizer/corpus plus
// seeded random strings with Qwen3's tokenizer.json; kiln must produce the same ids, decode them
// to the NFC form of the input, and decode random id sequences to the same text.
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "test_support.h"
#include "tokenizer/normalizer.h"

namespace kiln::tok {
namespace {

using nlohmann::json;
using testing::qwen3;

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

TEST(TokenizerOracle, MatchesHfTokenizersJs) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  std::string out = std::string(KILN_BINARY_DIR) + "/tokenizer_oracle.jsonl";
  std::string command = "cd '" + testing::source_path("tests/js") + "' && node tokenize_oracle.mjs '" +
                        testing::qwen3_tokenizer_dir() + "' '" +
                        testing::source_path("tests/fixtures/tokenizer/corpus") + "' '" + out +
                        "' --random 3000 --seed 12345";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;

  std::ifstream in(out);
  std::string line;
  size_t n_encode = 0, n_decode = 0, n_bytes = 0, n_failures = 0;
  const size_t kMaxReported = 10;
  while (std::getline(in, line)) {
    json j = json::parse(line);
    if (j["kind"] == "encode") {
      ++n_encode;
      std::string text = j["text"];
      n_bytes += text.size();
      auto expected = j["ids"].get<std::vector<int32_t>>();
      auto ids = qwen3().encode(text);
      std::string decoded = qwen3().decode(ids);
      // Added tokens split the text before NFC (as in HF), so the round trip is NFC only without them.
      bool has_added = std::any_of(ids.begin(), ids.end(), [](int32_t id) { return id >= 151643; });
      bool ok = ids == expected && decoded == j["decoded"].get<std::string>() &&
                nfc(text) == j["nfc"].get<std::string>() &&
                (has_added || decoded == j["nfc"].get<std::string>());
      if (!ok && ++n_failures <= kMaxReported) {
        ADD_FAILURE() << "sample " << j["source"] << " " << json(text).dump()
                      << "\n kiln:   " << ids_text(ids) << "\n oracle: " << ids_text(expected)
                      << "\n kiln decode:   " << json(decoded).dump()
                      << "\n oracle decode: " << j["decoded"].dump()
                      << "\n oracle nfc:    " << j["nfc"].dump()
                      << "\n kiln nfc:      " << json(nfc(text)).dump();
      }
    } else {
      ++n_decode;
      auto ids = j["ids"].get<std::vector<int32_t>>();
      std::string text = qwen3().decode(ids), text_skip = qwen3().decode(ids, /*skip_special=*/true);
      // Streaming: the concatenated pieces equal the whole decode.
      StreamDecoder stream(qwen3(), /*skip_special=*/false);
      std::string streamed;
      for (int32_t id : ids) streamed += stream.push(id);
      streamed += stream.flush();
      bool ok = text == j["text"].get<std::string>() &&
                text_skip == j["text_skip_special"].get<std::string>() && streamed == text;
      if (!ok && ++n_failures <= kMaxReported) {
        ADD_FAILURE() << "decode of " << ids_text(ids) << "\n kiln:   " << json(text).dump() << " / "
                      << json(text_skip).dump() << " / streamed " << json(streamed).dump()
                      << "\n oracle: " << j["text"].dump() << " / " << j["text_skip_special"].dump();
      }
    }
  }
  EXPECT_EQ(n_failures, 0u);
  EXPECT_GT(n_encode, 3000u);
  EXPECT_GT(n_decode, 500u);
  std::printf("[ oracle   ] %zu encode samples (%zu bytes), %zu decode cases, %zu failures\n", n_encode,
              n_bytes, n_decode, n_failures);
}

}  // namespace
}  // namespace kiln::tok
