// A byte-level BPE whose vocabulary lacks some of the 256 byte symbols loads, and encodes as HF tokenizers
// does (the JS implementation, @huggingface/tokenizers, is the oracle): Qwen3's tokenizer.json with the
// tokens of a few bytes (and the merges using them) removed, without unk_token, with one, and with
// fuse_unk. The texts are the tokenizer corpus plus seeded random strings, which contain those bytes. What is tested is
// the BPE model's byte fallback and unknown-token handling (src/tokenizer/bpe.*), through the whole Tokenizer.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "qwen3_tokenizer.h"
#include "tokenizer/bpe.h"

namespace kiln::tok {
namespace {

using nlohmann::json;

// Writes a variant of Qwen3's tokenizer folder to `dir`: the byte tokens of `bytes` removed.
void write_variant(const std::string& dir, const std::set<unsigned char>& bytes, bool unk, bool fuse_unk) {
  json tj = json::parse(testing::read_file(testing::qwen3_tokenizer_dir() + "/tokenizer.json"));
  json& model = tj["model"];
  std::set<std::string> removed;
  for (unsigned char b : bytes) removed.insert(bytes_to_byte_level(std::string(1, static_cast<char>(b))));
  for (const auto& t : removed) model["vocab"].erase(t);
  json merges = json::array();
  for (const auto& m : model["merges"]) {
    std::string left, right;
    if (m.is_string()) {
      std::string s = m.get<std::string>();
      left = s.substr(0, s.find(' '));
      right = s.substr(s.find(' ') + 1);
    } else {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    }
    if (!removed.count(left) && !removed.count(right)) merges.push_back(m);
  }
  model["merges"] = merges;
  if (unk) {
    int64_t next_id = 0;
    for (const auto& t : tj["added_tokens"]) next_id = std::max<int64_t>(next_id, t["id"].get<int64_t>() + 1);
    model["vocab"]["<unk>"] = next_id;
    model["unk_token"] = "<unk>";
    model["fuse_unk"] = fuse_unk;
  }
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << tj.dump();
  std::filesystem::copy_file(testing::qwen3_tokenizer_dir() + "/tokenizer_config.json", dir + "/tokenizer_config.json",
                             std::filesystem::copy_options::overwrite_existing);
}

void check_against_oracle(const std::string& name, bool unk, bool fuse_unk) {
  const std::set<unsigned char> bytes = {0x00, 0x0A, 0x41, 0xC3};
  std::string dir = std::string(KILN_BINARY_DIR) + "/partial_vocab_" + name;
  write_variant(dir, bytes, unk, fuse_unk);
  auto tokenizer = Tokenizer::load_dir(dir);  // refused before: "no token for byte 0x00"
  std::string out = dir + "/oracle.jsonl";
  std::string command = "cd '" + testing::source_path("tests/js") + "' && node tokenize_oracle.mjs '" + dir + "' '" +
                        testing::source_path("tests/fixtures/tokenizer/corpus") + "' '" + out +
                        "' --random 600 --seed 4242 --no-decode";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::ifstream in(out);
  std::string line;
  size_t n = 0, failures = 0, with_missing = 0;
  while (std::getline(in, line)) {
    json j = json::parse(line);
    if (j["kind"] != "encode") continue;
    ++n;
    std::string text = j["text"];
    if (std::any_of(text.begin(), text.end(), [&](char c) { return bytes.count(static_cast<unsigned char>(c)); }))
      ++with_missing;
    auto expected = j["ids"].get<std::vector<int32_t>>();
    auto ids = tokenizer->encode(text);
    if (ids != expected && ++failures <= 5) {
      std::string a, b;
      for (int32_t id : ids) a += std::to_string(id) + " ";
      for (int32_t id : expected) b += std::to_string(id) + " ";
      ADD_FAILURE() << name << ": " << json(text).dump() << "\n kiln:   " << a << "\n oracle: " << b;
    }
  }
  EXPECT_EQ(failures, 0u) << name;
  EXPECT_GT(n, 600u);
  EXPECT_GT(with_missing, 100u) << "too few samples need a missing byte";
}

TEST(PartialByteVocab, MatchesHfTokenizersJs) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  // With unk_token: each missing byte becomes <unk>; no merge crosses it.
  check_against_oracle("unk", true, false);
}

TEST(PartialByteVocab, FuseUnkMatchesHfTokenizersJs) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  // fuse_unk: consecutive <unk> of one section become one, also across pre-tokenized words ("\n\n" then "A").
  check_against_oracle("fuse_unk", true, true);
}

TEST(PartialByteVocab, NoUnkMatchesHfTokenizersJs) {
  KILN_REQUIRE_QWEN3_TOKENIZER();
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed";
  // No unk_token: a missing byte is dropped, after merging (its neighbours do not merge across it).
  check_against_oracle("no_unk", false, false);
}

TEST(PartialByteVocab, UnknownUnkTokenIsAClearError) {
  // A tiny byte-level vocabulary without byte 'b', naming an unk_token it does not have.
  std::vector<std::pair<std::string, int32_t>> vocab = {{"a", 0}, {"c", 1}};
  BpeOptions o;
  o.unk_token = "<unk>";
  try {
    BpeModel m(vocab, {}, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unk_token"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln::tok
