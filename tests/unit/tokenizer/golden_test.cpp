// Qwen2/Qwen3 vocabulary goldens from llama.cpp (tests/fixtures/tokenizer/qwen2.inp/.out, copied from
// the shared test data), run with Qwen3's real tokenizer.json.
#include <atomic>
#include <sstream>
#include <thread>

#include "test_support.h"

namespace kiln::tok {
namespace {

using testing::qwen3;

// .inp: each string is followed by "\n__ggml_vocab_test__\n". .out: one line of ids per string.
std::vector<std::string> read_inputs(const std::string& text) {
  const std::string separator = "\n__ggml_vocab_test__\n";
  std::vector<std::string> strings;
  size_t pos = 0;
  for (size_t next; (next = text.find(separator, pos)) != std::string::npos; pos = next + separator.size())
    strings.push_back(text.substr(pos, next - pos));
  return strings;
}

TEST(TokenizerGolden, Qwen2VocabGoldensFromLlamaCpp) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  auto inputs = read_inputs(testing::read_file(testing::source_path("tests/fixtures/tokenizer/qwen2.inp")));
  std::istringstream expected_lines(
      testing::read_file(testing::source_path("tests/fixtures/tokenizer/qwen2.out")));
  ASSERT_EQ(inputs.size(), 46u);
  std::string line;
  size_t i = 0;
  for (; std::getline(expected_lines, line); ++i) {
    ASSERT_LT(i, inputs.size());
    std::istringstream ids_in(line);
    std::vector<int32_t> expected;
    for (int32_t id; ids_in >> id;) expected.push_back(id);
    // The goldens are encoded without special tokens; none of the strings contains one.
    EXPECT_EQ(qwen3().encode(inputs[i]), expected) << "string " << i << ": " << inputs[i];
    EXPECT_EQ(qwen3().decode(expected), inputs[i]) << "string " << i;
  }
  EXPECT_EQ(i, inputs.size());
}

TEST(TokenizerGolden, Qwen3Metadata) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  const Tokenizer& t = qwen3();
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(t.token_to_id("<think>"), 151667);
  EXPECT_EQ(t.token_to_id("Hello"), 9707);
  EXPECT_EQ(t.token_to_id("\xC4\xA0world"), 1879);  // "Ġworld": vocabulary strings are byte-level
  EXPECT_EQ(t.token_to_id("no such token"), -1);
  EXPECT_EQ(t.id_to_token(9707), "Hello");
  EXPECT_EQ(t.id_to_token(151645), "<|im_end|>");
  EXPECT_EQ(t.id_to_token(-1), "");
  EXPECT_EQ(t.id_to_token(151669), "");
  EXPECT_TRUE(t.is_special(151645));
  EXPECT_TRUE(t.is_special(151643));
  EXPECT_FALSE(t.is_special(151667));  // <think> is an added token but not special in Qwen3
  EXPECT_FALSE(t.is_special(9707));
  EXPECT_EQ(t.eos_token(), std::optional<std::string>("<|im_end|>"));
  EXPECT_EQ(t.bos_token(), std::nullopt);
}

TEST(TokenizerGolden, Qwen3SpecialTokens) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  const Tokenizer& t = qwen3();
  EXPECT_EQ(t.encode(""), std::vector<int32_t>{});
  EXPECT_EQ(t.encode("Hello world"), (std::vector<int32_t>{9707, 1879}));
  std::vector<int32_t> chat = t.encode("<|im_start|>user\nHi<|im_end|>");
  ASSERT_GE(chat.size(), 3u);
  EXPECT_EQ(chat.front(), 151644);
  EXPECT_EQ(chat.back(), 151645);
  // Without parse_special the markers are plain text; non-special added tokens still match.
  std::vector<int32_t> plain = t.encode("<|im_end|><think>", /*parse_special=*/false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 151645), 0);
  EXPECT_EQ(plain.back(), 151667);
  EXPECT_EQ(t.decode(plain), "<|im_end|><think>");
  EXPECT_EQ(t.decode(chat, /*skip_special=*/true), "user\nHi");
  EXPECT_EQ(t.decode(chat), "<|im_start|>user\nHi<|im_end|>");
  // Ids past the vocabulary (padded embedding rows) are skipped, as HF does.
  std::vector<int32_t> with_padding{9707, 151900, 1879};
  EXPECT_EQ(t.decode(with_padding), "Hello world");
}

TEST(TokenizerGolden, RejectsInvalidUtf8) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  EXPECT_THROW(qwen3().encode("ok \xFF bad"), kiln::Error);
  EXPECT_THROW(qwen3().encode("\xED\xA0\x80"), kiln::Error);  // a surrogate
}

TEST(TokenizerGolden, ConcurrentEncodesAgree) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  // The word cache is shared: encodes from several threads must give the single-thread result.
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i)
    texts.push_back("word" + std::to_string(i * 7919) + " caf\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD " +
                    std::string(i % 9, ' ') + "end");
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) expected.push_back(qwen3().encode(t));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round)
        for (size_t i = (t * 37) % texts.size(), n = 0; n < texts.size(); ++n, i = (i + 1) % texts.size())
          if (qwen3().encode(texts[i]) != expected[i]) ++mismatches;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace kiln::tok
