// The Tokenizer (src/tokenizer/tokenizer.*). First on small hand-made tokenizers: BPE merge order, added-token
// options (HF semantics), pre-tokenizer behaviours, streaming decode, lossy UTF-8, NFC, and errors for unsupported
// pieces. Then Qwen3's real tokenizer.json against outside goldens, one named case each: llama.cpp's vocabulary
// goldens and HF tokenizers' JS implementation (these run the BPE, pre-tokenizer, normalizer and added vocabulary
// together, through Tokenizer).
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <unistd.h>

#include "core/error.h"
#include "oracle_util.h"
#include "qwen3_tokenizer.h"
#include "tokenizer/bpe.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace kiln::tok {
namespace {

using nlohmann::json;
using testing::qwen3;

// GPT-2's bytes_to_unicode, written out again here so the tests do not rely on the code under test.
std::string byte_level(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    unsigned cp = b;
    if (!printable) {
      unsigned n = 0;
      for (unsigned x = 0; x < b; ++x)
        if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE))) ++n;
      cp = 256 + n;
    }
    utf8::append(out, cp);
  }
  return out;
}

// A byte-level BPE whose ids 0..255 are the bytes themselves, plus a few merges.
json tiny_tokenizer_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level(std::string(1, static_cast<char>(b)))] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {{"l", "l"},    {"h", "e"}, {"he", "ll"},
                                                                   {"hell", "o"}, {" ", "w"}, {"o", "r"},
                                                                   {" w", "or"},  {"l", "d"}, {" wor", "ld"}};
  json merge_list = json::array();
  int next_id = 256;
  for (const auto& [a, b] : merges) {
    merge_list.push_back(byte_level(a) + " " + byte_level(b));
    vocab[byte_level(a + b)] =
        next_id++;  // ll=256 he=257 hell=258 hello=259 " w"=260 or=261 " wor"=262 ld=263 " world"=264
  }
  json added = json::array();
  added.push_back({{"id", 300}, {"content", "<s>"}, {"special", true}, {"normalized", false}});
  added.push_back({{"id", 301},
                   {"content", "[MASK]"},
                   {"special", true},
                   {"normalized", false},
                   {"lstrip", true},
                   {"rstrip", true}});
  added.push_back(
      {{"id", 302}, {"content", "<w>"}, {"special", false}, {"normalized", false}, {"single_word", true}});
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}, {"ignore_merges", false}}},
  };
}

std::unique_ptr<Tokenizer> tiny(const json& j = tiny_tokenizer_json()) {
  return Tokenizer::from_json(j.dump(), R"({"bos_token": {"content": "<s>"}, "eos_token": null})");
}

using Ids = std::vector<int32_t>;

TEST(TokenizerBpe, MergesByRankThenLeftmost) {
  auto t = tiny();
  EXPECT_EQ(t->encode("hello world"), (Ids{259, 264}));
  EXPECT_EQ(t->encode("lld"), (Ids{256, 'd'}));  // (l,l) ranks before (l,d)
  EXPECT_EQ(t->encode("lll"), (Ids{256, 'l'}));  // equal ranks: leftmost first
  EXPECT_EQ(t->encode("hellod"), (Ids{259, 'd'}));
  EXPECT_EQ(t->decode(Ids{259, 264}), "hello world");
  EXPECT_EQ(t->vocab_size(), 303);
  EXPECT_EQ(t->bos_token(), std::optional<std::string>("<s>"));
  EXPECT_EQ(t->eos_token(), std::nullopt);
}

TEST(TokenizerBpe, MergesAsPairsAndIgnoreMerges) {
  json j = tiny_tokenizer_json();
  json pairs = json::array();
  for (const auto& m : j["model"]["merges"]) {
    std::string s = m;
    pairs.push_back({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  j["model"]["merges"] = pairs;
  EXPECT_EQ(tiny(j)->encode("hello world"), (Ids{259, 264}));
  // ignore_merges: a word found whole in the vocabulary is one token even if merges would not reach it.
  j["model"]["vocab"][byte_level("xyz")] = 280;
  EXPECT_EQ(tiny(j)->encode("xyz"), (Ids{'x', 'y', 'z'}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(tiny(j)->encode("xyz"), (Ids{280}));
}

TEST(TokenizerBpe, QuadraticAndHeapMergeLoopsAgree) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  json j = json::parse(testing::read_file(testing::qwen3_tokenizer_dir() + "/tokenizer.json"));
  std::vector<std::pair<std::string, int32_t>> vocab;
  for (const auto& [token, id] : j["model"]["vocab"].items()) vocab.emplace_back(token, id.get<int32_t>());
  std::vector<std::pair<std::string, std::string>> merges;
  for (const auto& m : j["model"]["merges"]) merges.emplace_back(m[0], m[1]);
  BpeModel model(vocab, merges, BpeOptions{});
  std::mt19937 rng(7);
  const std::vector<std::string> pieces = {"the", "ing", " ", "é",    "中文", "😀",
                                           "ab",  "\n",  "0", "tion", "ll",   "  "};
  for (int trial = 0; trial < 3000; ++trial) {
    std::string word;
    int n = 1 + rng() % 60;
    for (int i = 0; i < n; ++i) {
      if (rng() % 4 == 0) {
        word.push_back(static_cast<char>(rng() % 256));
      } else {
        word += pieces[rng() % pieces.size()];
      }
    }
    Ids a, b;
    model.merge_quadratic(word, a);
    model.merge_with_heap(word, b);
    ASSERT_EQ(a, b) << "word " << json(byte_level(word)).dump();
  }
}

TEST(TokenizerAddedTokens, SpecialTokensAndParseSpecial) {
  auto t = tiny();
  EXPECT_EQ(t->encode("a<s>b"), (Ids{'a', 300, 'b'}));
  EXPECT_EQ(t->encode("a<s>b", /*parse_special=*/false), (Ids{'a', '<', 's', '>', 'b'}));
  EXPECT_EQ(t->decode(Ids{'a', 300, 'b'}), "a<s>b");
  EXPECT_EQ(t->decode(Ids{'a', 300, 'b'}, /*skip_special=*/true), "ab");
  EXPECT_TRUE(t->is_special(300));
  EXPECT_FALSE(t->is_special(302));
  EXPECT_EQ(t->token_to_id("<s>"), 300);
  EXPECT_EQ(t->id_to_token(301), "[MASK]");
}

TEST(TokenizerAddedTokens, LstripAndRstripSwallowWhitespace) {
  auto t = tiny();
  // HF: lstrip / rstrip make the token take the (Unicode) whitespace around it.
  EXPECT_EQ(t->encode("x  [MASK]  y"), (Ids{'x', 301, 'y'}));
  EXPECT_EQ(t->encode("x\t[MASK]\xE2\x80\x80y"), (Ids{'x', 301, 'y'}));  // tab and U+2000
  EXPECT_EQ(t->encode("[MASK] [MASK]"), (Ids{301, 301}));
  EXPECT_EQ(t->decode(Ids{'x', 301, 'y'}), "x[MASK]y");
}

TEST(TokenizerAddedTokens, SingleWordNeedsNoWordCharactersAround) {
  auto t = tiny();
  EXPECT_EQ(t->encode("a <w> b"), (Ids{'a', ' ', 302, ' ', 'b'}));
  EXPECT_EQ(t->encode("<w>"), (Ids{302}));
  EXPECT_EQ(t->encode("a<w>b"), (Ids{'a', '<', 'w', '>', 'b'}));
  // Punctuation is not a word character, a combining mark is (HF's \w).
  EXPECT_EQ(t->encode(",<w>-"), (Ids{',', 302, '-'}));
  Ids mark = t->encode("\xCC\x81<w>");  // U+0301 before it
  EXPECT_EQ(std::find(mark.begin(), mark.end(), 302), mark.end());
}

TEST(TokenizerAddedTokens, NormalizedTokensMatchTheNormalizedText) {
  json j = tiny_tokenizer_json();
  // normalized = true: matched after NFC, against the NFC form of the content.
  j["added_tokens"].push_back(
      {{"id", 303}, {"content", "cafe\xCC\x81"}, {"special", false}, {"normalized", true}});
  j["added_tokens"].push_back({{"id", 304}, {"content", "<n>"}, {"special", true}, {"normalized", true}});
  auto t = tiny(j);
  EXPECT_EQ(t->encode("caf\xC3\xA9"), (Ids{303}));         // precomposed
  EXPECT_EQ(t->encode("cafe\xCC\x81!"), (Ids{303, '!'}));  // decomposed
  EXPECT_EQ(t->encode("a<n>"), (Ids{'a', 304}));
  EXPECT_EQ(t->encode("a<n>", /*parse_special=*/false), (Ids{'a', '<', 'n', '>'}));
}

TEST(TokenizerErrors, UnsupportedPiecesAreNamed) {
  auto expect_error = [](json j, const std::string& needle) {
    try {
      Tokenizer::from_json(j.dump(), "");
      ADD_FAILURE() << "no error; expected one naming " << needle;
    } catch (const kiln::InternalError& e) {
      ADD_FAILURE() << "internal error instead of a user error: " << e.what();
    } catch (const kiln::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  json j = tiny_tokenizer_json();
  j["model"]["type"] = "Unigram";
  expect_error(j, "Unigram");
  j = tiny_tokenizer_json();
  j["model"]["type"] = "WordPiece";
  expect_error(j, "WordPiece");
  j = tiny_tokenizer_json();
  j["normalizer"] = {{"type", "Lowercase"}};
  expect_error(j, "Lowercase");
  j = tiny_tokenizer_json();
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Whitespace"}}}}};
  expect_error(j, "Whitespace");
  j = tiny_tokenizer_json();
  j["decoder"] = {{"type", "WordPiece"}};
  expect_error(j, "WordPiece");
  j = tiny_tokenizer_json();
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}};
  expect_error(j, "<s>");
  j = tiny_tokenizer_json();
  j["model"]["merges"].push_back(byte_level("q") + " " + byte_level("zz"));
  expect_error(j, "zz");
  j = tiny_tokenizer_json();
  j["pre_tokenizer"] = nullptr;
  expect_error(j, "pre_tokenizer");
  expect_error(json::array(), "model");
  EXPECT_THROW(Tokenizer::from_json("{not json", ""), kiln::Error);
  EXPECT_THROW(Tokenizer::load_dir("/nonexistent-folder"), kiln::Error);
}

TEST(TokenizerPreTokenizer, SplitBehaviorsMatchHfDocs) {
  // The example of HF's SplitDelimiterBehavior documentation: "the-final--countdown" split on "-".
  auto run = [](SplitBehavior behavior, bool invert = false) {
    SplitPreTokenizer split("-", /*is_regex=*/false, behavior, invert);
    std::vector<std::string> pieces;
    auto sink = [&](std::string_view p) { pieces.emplace_back(p); };
    split.split("the-final--countdown", PieceSink(sink));
    return pieces;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(run(SplitBehavior::kRemoved), (V{"the", "final", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::kIsolated), (V{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::kMergedWithPrevious), (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::kMergedWithNext), (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(run(SplitBehavior::kContiguous), (V{"the", "-", "final", "--", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::kRemoved, /*invert=*/true), (V{"-", "-", "-"}));
}

TEST(TokenizerPreTokenizer, WhitespaceIsUnicodeWhiteSpace) {
  // \s follows Oniguruma (Unicode White_Space): U+3000 and U+0085 are spaces, U+180E is not.
  Regex spaces(R"(\s+)");
  auto matches = [&](std::string_view text) {
    int n = 0;
    spaces.for_each_match(text, [&](size_t, size_t) { ++n; });
    return n;
  };
  EXPECT_EQ(matches("a\xE3\x80\x80"
                    "b"),
            1);
  EXPECT_EQ(matches("a\xC2\x85"
                    "b"),
            1);
  EXPECT_EQ(matches("a\xE1\xA0\x8E"
                    "b"),
            0);
  EXPECT_EQ(translate_regex_for_pcre2(R"([^\s\p{L}])"),
            R"([^\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\p{L}])");
  EXPECT_EQ(translate_regex_for_pcre2(R"(\\s[\]\s])"),
            R"(\\s[\]\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}])");
  EXPECT_THROW(Regex("(unclosed"), kiln::Error);
}

TEST(TokenizerPreTokenizer, Qwen35PatternKeepsMarksWithLetters) {
  // Qwen3.5's pattern adds \p{M} to the letter runs (REFERENCE.md section 4); Qwen3's does not.
  const char* qwen35 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const char* qwen3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  auto pieces = [](const char* pattern, std::string_view text) {
    SplitPreTokenizer split(pattern, /*is_regex=*/true, SplitBehavior::kIsolated, false);
    std::vector<std::string> out;
    auto sink = [&](std::string_view p) { out.emplace_back(p); };
    split.split(text, PieceSink(sink));
    return out;
  };
  using V = std::vector<std::string>;
  const std::string text = "cafe\xCC\x81s 12 it'S\n\n  x";  // e + U+0301
  EXPECT_EQ(pieces(qwen35, text), (V{"cafe\xCC\x81s", " ", "1", "2", " it", "'S", "\n\n", " ", " x"}));
  EXPECT_EQ(pieces(qwen3, text), (V{"cafe", "\xCC\x81s", " ", "1", "2", " it", "'S", "\n\n", " ", " x"}));
}

TEST(TokenizerStream, CharactersSpanningTokensComeOutWhole) {
  auto t = tiny();
  StreamDecoder stream(*t, /*skip_special=*/false);
  // U+1F600 as four byte tokens.
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.push(0x9F), "");
  EXPECT_EQ(stream.push(0x98), "");
  EXPECT_EQ(stream.push(0x80), "\xF0\x9F\x98\x80");
  EXPECT_EQ(stream.push(259), "hello");
  EXPECT_EQ(stream.push(0xC3), "");
  EXPECT_EQ(stream.push(0xA9), "\xC3\xA9");
  EXPECT_EQ(stream.flush(), "");
}

TEST(TokenizerStream, InvalidBytesBecomeReplacementCharacters) {
  auto t = tiny();
  const std::string kReplacement = "\xEF\xBF\xBD";
  StreamDecoder stream(*t, /*skip_special=*/true);
  EXPECT_EQ(stream.push(0xFF), kReplacement);  // never valid: out at once
  EXPECT_EQ(stream.push(0xF0), "");
  EXPECT_EQ(stream.push(0x9F), "");
  EXPECT_EQ(stream.push('a'), kReplacement + "a");  // F0 9F cut short: one U+FFFD
  EXPECT_EQ(stream.push(300), "");                  // special, skipped
  EXPECT_EQ(stream.push(0xE2), "");
  EXPECT_EQ(stream.flush(), kReplacement);  // incomplete at the end
  EXPECT_EQ(stream.flush(), "");

  // Whole-sequence decode gives the same text as the stream.
  Ids ids{0xFF, 0xF0, 0x9F, 'a', 300, 0xE2};
  EXPECT_EQ(t->decode(ids, /*skip_special=*/true), kReplacement + kReplacement + "a" + kReplacement);
}

TEST(TokenizerUtf8, LossyDecodingReplacesMaximalSubparts) {
  auto lossy = [](std::string_view s) {
    std::string out;
    utf8::append_lossy(s, out);
    return out;
  };
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(lossy("abc"), "abc");
  EXPECT_EQ(lossy("\xC0\x80"), r + r);                  // overlong lead byte
  EXPECT_EQ(lossy("\xED\xA0\x80"), r + r + r);          // surrogate: ED then two lone continuations
  EXPECT_EQ(lossy("\xE2\x82x"), r + "x");               // truncated 3-byte sequence
  EXPECT_EQ(lossy("\xF4\x90\x80\x80"), r + r + r + r);  // past U+10FFFF
  EXPECT_EQ(lossy("\xF0\x9F\x98"), r);
  EXPECT_TRUE(utf8::is_valid("\xF0\x9F\x98\x80"));
  EXPECT_FALSE(utf8::is_valid("\xF0\x9F\x98"));
}

TEST(TokenizerNfc, MatchesPythonUnicodedata) {
  // tests/fixtures/tokenizer/nfc_cases.jsonl: [input, NFC(input)] from Python's unicodedata
  // (tools/unicode/gen_nfc_cases.py).
  std::ifstream in(testing::source_path("tests/fixtures/tokenizer/nfc_cases.jsonl"));
  ASSERT_TRUE(in) << "missing nfc_cases.jsonl";
  std::string line;
  size_t n = 0, failures = 0;
  while (std::getline(in, line)) {
    json j = json::parse(line);
    std::string input = j[0], expected = j[1];
    ++n;
    if (nfc(input) != expected && ++failures <= 10)
      ADD_FAILURE() << "NFC of " << json(input).dump(-1, ' ', true) << " is "
                    << json(nfc(input)).dump(-1, ' ', true) << ", expected "
                    << json(expected).dump(-1, ' ', true);
  }
  EXPECT_GT(n, 4000u);
  EXPECT_EQ(failures, 0u);
  EXPECT_EQ(nfc("plain ascii stays"), "plain ascii stays");
}

// ---- Qwen3's real tokenizer.json against outside goldens

// llama.cpp's Qwen2 vocabulary goldens (tests/fixtures/tokenizer/qwen2.inp / .out, from its shared test data): .inp
// holds each string followed by "\n__ggml_vocab_test__\n", .out one line of ids per string. One case per string.
struct LlamaGolden {
  std::string name;  // the GoogleTest name
  std::string text;
  std::vector<int32_t> ids;
};
void PrintTo(const LlamaGolden& g, std::ostream* os) { *os << g.name; }

std::vector<LlamaGolden> llama_goldens() {
  const std::string inp = testing::read_file(testing::source_path("tests/fixtures/tokenizer/qwen2.inp"));
  std::istringstream out(testing::read_file(testing::source_path("tests/fixtures/tokenizer/qwen2.out")));
  const std::string separator = "\n__ggml_vocab_test__\n";
  std::vector<LlamaGolden> goldens;
  std::set<std::string> taken;
  size_t pos = 0;
  for (size_t next; (next = inp.find(separator, pos)) != std::string::npos; pos = next + separator.size()) {
    LlamaGolden g;
    g.text = inp.substr(pos, next - pos);
    std::string line;
    std::getline(out, line);
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) g.ids.push_back(id);
    g.name = kiln::testing::case_name(fmt::format("string{:02d} {}", goldens.size(), g.text.substr(0, 24)), taken);
    goldens.push_back(std::move(g));
  }
  return goldens;
}

TEST(TokenizerLlamaGoldens, AllStringsHaveIds) {
  const auto goldens = llama_goldens();
  ASSERT_EQ(goldens.size(), 46u);
  std::string rest;
  std::istringstream out(testing::read_file(testing::source_path("tests/fixtures/tokenizer/qwen2.out")));
  for (size_t i = 0; i < goldens.size(); ++i) std::getline(out, rest);
  EXPECT_FALSE(std::getline(out, rest)) << "qwen2.out has more lines than qwen2.inp has strings";
}

class TokenizerLlamaGolden : public ::testing::TestWithParam<LlamaGolden> {};

TEST_P(TokenizerLlamaGolden, EncodesAndDecodes) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  const LlamaGolden& g = GetParam();
  // The goldens are encoded without special tokens; none of the strings contains one.
  EXPECT_EQ(qwen3().encode(g.text), g.ids) << g.text;
  EXPECT_EQ(qwen3().decode(g.ids), g.text);
}

INSTANTIATE_TEST_SUITE_P(Qwen2VocabFromLlamaCpp, TokenizerLlamaGolden, ::testing::ValuesIn(llama_goldens()),
                         [](const ::testing::TestParamInfo<LlamaGolden>& info) { return info.param.name; });

TEST(TokenizerQwen3, Qwen3Metadata) {
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

TEST(TokenizerQwen3, Qwen3SpecialTokens) {
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

TEST(TokenizerQwen3, RejectsInvalidUtf8) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  EXPECT_THROW(qwen3().encode("ok \xFF bad"), kiln::Error);
  EXPECT_THROW(qwen3().encode("\xED\xA0\x80"), kiln::Error);  // a surrogate
}

TEST(TokenizerQwen3, ConcurrentEncodesAgree) {
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

// HF tokenizers' JS implementation (@huggingface/tokenizers) as the oracle: tests/js/tokenize_oracle.mjs encodes the
// corpus of tests/fixtures/tokenizer/corpus plus seeded random strings with Qwen3's tokenizer.json, and decodes random
// id sequences; kiln must produce the same ids, decode them to the NFC form of the input, and decode the id sequences
// to the same text. One case per corpus file, plus the long text of all files, the random strings and the decodes.

std::string ids_text(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

// The oracle's lines (one run of node for the whole suite); empty when node or the tokenizer is missing.
const std::vector<json>& hf_oracle() {
  static const std::vector<json> lines = [] {
    std::vector<json> out;
    if (!testing::have_qwen3_tokenizer() || std::system("node --version > /dev/null 2>&1") != 0) return out;
    // One file per process: ctest runs each case in its own process, in parallel, and a shared file would be read
    // by one while another rewrites it.
    const std::string file = std::string(KILN_BINARY_DIR) + "/tokenizer_oracle." + std::to_string(::getpid()) + ".jsonl";
    const std::string command = "cd '" + testing::source_path("tests/js") + "' && node tokenize_oracle.mjs '" +
                                testing::qwen3_tokenizer_dir() + "' '" +
                                testing::source_path("tests/fixtures/tokenizer/corpus") + "' '" + file +
                                "' --random 3000 --seed 12345";
    if (std::system(command.c_str()) != 0) return out;
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
    std::filesystem::remove(file);
    return out;
  }();
  return lines;
}

// A group of oracle lines: encodes whose source starts with `prefix`, or (prefix "decode") the decode cases.
struct HfOracleGroup {
  std::string name;
  std::string prefix;
};
void PrintTo(const HfOracleGroup& g, std::ostream* os) { *os << g.name; }

std::vector<HfOracleGroup> hf_oracle_groups() {
  std::vector<HfOracleGroup> groups;
  std::set<std::string> taken;
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(testing::source_path("tests/fixtures/tokenizer/corpus")))
    if (e.path().extension() == ".txt") files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) groups.push_back({kiln::testing::case_name("encode " + f, taken), f});
  groups.push_back({"encode_long_all_files", "long("});
  groups.push_back({"encode_random_strings", "random#"});
  groups.push_back({"decode_random_ids", "decode"});
  return groups;
}

class TokenizerHfOracle : public ::testing::TestWithParam<HfOracleGroup> {};

TEST_P(TokenizerHfOracle, MatchesHfTokenizersJs) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  ASSERT_FALSE(hf_oracle().empty()) << "tests/js/tokenize_oracle.mjs failed (run scripts/setup.sh)";
  const std::string& prefix = GetParam().prefix;
  const bool decodes = prefix == "decode";
  size_t cases = 0, failures = 0;
  const size_t kMaxReported = 10;
  for (const json& j : hf_oracle()) {
    if (decodes != (j["kind"] != "encode")) continue;
    if (!decodes && j["source"].get<std::string>().rfind(prefix, 0) != 0) continue;
    ++cases;
    if (!decodes) {
      std::string text = j["text"];
      auto expected = j["ids"].get<std::vector<int32_t>>();
      auto ids = qwen3().encode(text);
      std::string decoded = qwen3().decode(ids);
      // Added tokens split the text before NFC (as in HF), so the round trip is NFC only without them.
      bool has_added = std::any_of(ids.begin(), ids.end(), [](int32_t id) { return id >= 151643; });
      bool ok = ids == expected && decoded == j["decoded"].get<std::string>() &&
                nfc(text) == j["nfc"].get<std::string>() &&
                (has_added || decoded == j["nfc"].get<std::string>());
      if (!ok && ++failures <= kMaxReported)
        ADD_FAILURE() << "sample " << j["source"] << " " << json(text).dump() << "\n kiln:   " << ids_text(ids)
                      << "\n oracle: " << ids_text(expected) << "\n kiln decode:   " << json(decoded).dump()
                      << "\n oracle decode: " << j["decoded"].dump() << "\n oracle nfc:    " << j["nfc"].dump()
                      << "\n kiln nfc:      " << json(nfc(text)).dump();
    } else {
      auto ids = j["ids"].get<std::vector<int32_t>>();
      std::string text = qwen3().decode(ids), text_skip = qwen3().decode(ids, /*skip_special=*/true);
      // Streaming: the concatenated pieces equal the whole decode.
      StreamDecoder stream(qwen3(), /*skip_special=*/false);
      std::string streamed;
      for (int32_t id : ids) streamed += stream.push(id);
      streamed += stream.flush();
      bool ok = text == j["text"].get<std::string>() && text_skip == j["text_skip_special"].get<std::string>() &&
                streamed == text;
      if (!ok && ++failures <= kMaxReported)
        ADD_FAILURE() << "decode of " << ids_text(ids) << "\n kiln:   " << json(text).dump() << " / "
                      << json(text_skip).dump() << " / streamed " << json(streamed).dump()
                      << "\n oracle: " << j["text"].dump() << " / " << j["text_skip_special"].dump();
    }
  }
  EXPECT_EQ(failures, 0u);
  EXPECT_GT(cases, 0u) << "the oracle gave no case for " << prefix;
  if (prefix == "random#") EXPECT_EQ(cases, 3000u);
  if (decodes) EXPECT_GT(cases, 500u);
}

INSTANTIATE_TEST_SUITE_P(Qwen3, TokenizerHfOracle, ::testing::ValuesIn(hf_oracle_groups()),
                         [](const ::testing::TestParamInfo<HfOracleGroup>& info) { return info.param.name; });

}  // namespace
}  // namespace kiln::tok
