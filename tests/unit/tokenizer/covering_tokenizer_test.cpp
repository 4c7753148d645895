// The covering tokenizer of random-weight checkpoints: every id of the vocabulary decodes to text, its
// merges are valid BPE (each regular token encodes to itself: the merge ranks rebuild it), and the added
// tokens keep their content and special flags at the ids asked for. HF tokenizers' view of the same file is
// checked in tests/integration/dummy_checkpoint.sh.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "tokenizer/covering_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace kiln::tok {
namespace {

std::string read(const std::string& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}
const std::string kTiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";

TEST(CoveringTokenizer, EveryIdDecodesAndRegularTokensRoundTrip) {
  const std::string base = read(kTiny + "/tokenizer.json");
  const std::string base_cfg = read(kTiny + "/tokenizer_config.json");
  const int64_t V = 40000, first_added = 39000;  // two-symbol letter tokens start past id 8,000
  const CoveringTokenizerFiles f = make_covering_tokenizer(V, first_added, base, base_cfg);
  EXPECT_EQ(f.first_added_id, first_added);
  const int64_t n_added = static_cast<int64_t>(nlohmann::json::parse(base)["added_tokens"].size());
  EXPECT_EQ(f.num_fill, V - first_added - n_added);
  EXPECT_EQ(f.num_merged, first_added - 256);
  auto t = Tokenizer::from_json(f.tokenizer_json, f.tokenizer_config_json);
  ASSERT_EQ(t->vocab_size(), V);
  for (int32_t id = 0; id < V; ++id) {
    const int32_t one[] = {id};
    ASSERT_FALSE(t->decode(one).empty()) << id;
  }
  EXPECT_EQ(t->token_to_id("<|im_end|>"), first_added + 2);  // kiln-tiny's order: endoftext, im_start, im_end
  EXPECT_TRUE(t->is_special(first_added + 2));
  EXPECT_FALSE(t->is_special(V - 1));
  // Printable regular tokens made of letters encode back to their own id (the pre-tokenizer keeps a run of
  // letters whole, and the merges rebuild it).
  int checked = 0;
  for (int32_t id = 256; id < first_added; ++id) {
    const int32_t one[] = {id};
    const std::string text = t->decode(one);
    bool letters = !text.empty();
    for (char c : text) letters = letters && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'));
    if (!letters) continue;
    const std::vector<int32_t> ids = t->encode(text);
    ASSERT_EQ(ids.size(), 1u) << text;
    EXPECT_EQ(ids[0], id) << text;
    ++checked;
  }
  EXPECT_GT(checked, 1000);
}

TEST(CoveringTokenizer, AddedTokensAtTheEndWhenNoIdIsGiven) {
  const std::string base = read(kTiny + "/tokenizer.json");
  const CoveringTokenizerFiles f = make_covering_tokenizer(3000, -1, base, "");
  EXPECT_EQ(f.num_fill, 0);
  auto t = Tokenizer::from_json(f.tokenizer_json, f.tokenizer_config_json);
  EXPECT_EQ(t->vocab_size(), 3000);
}

TEST(CoveringTokenizer, NumbersThatDoNotFitAreAnError) {
  const std::string base = read(kTiny + "/tokenizer.json");
  EXPECT_THROW(make_covering_tokenizer(200, -1, base, ""), Error);       // not even the 256 bytes
  EXPECT_THROW(make_covering_tokenizer(3000, 2990, base, ""), Error);    // added tokens past the end
  EXPECT_THROW(make_covering_tokenizer(3000, -1, "{not json", ""), Error);
}

}  // namespace
}  // namespace kiln::tok
