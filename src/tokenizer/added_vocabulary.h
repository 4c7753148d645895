// Added tokens (tokenizer.json "added_tokens"): strings matched in the text before pre-tokenisation
// and mapped straight to their ids, following HF tokenizers' AddedVocabulary:
//  - leftmost-longest matching; tokens with normalized=false are matched in the raw text, those with
//    normalized=true in the normalised text (against their normalised content);
//  - single_word: only a match with no word character (\w) right before and after it counts;
//  - lstrip / rstrip: the whitespace before / after the match is swallowed by the token;
//  - special tokens can be left unmatched (parse_special = false) and are skipped by decode on request.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::tok {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// One piece of the text after added-token matching: either an added token id or plain text.
struct AddedSplit {
  size_t begin;
  size_t end;
  int32_t id;  // -1 for plain text
};

// Leftmost-longest matcher over a set of added tokens (a byte trie).
class AddedTokenMatcher {
 public:
  // patterns[i] is matched as the bytes of patterns[i]; tokens[i] says how.
  void build(const std::vector<std::string>& patterns, const std::vector<const AddedToken*>& tokens);
  bool empty() const { return tokens_.empty(); }
  // Cuts text into plain and added-token pieces covering it. Special tokens are skipped when
  // !match_special (their match still consumes the text, as HF does).
  void split(std::string_view text, bool match_special, std::vector<AddedSplit>& out) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;  // (byte, node index), sorted by byte
    int32_t token = -1;                                 // index into tokens_ if a pattern ends here
  };
  int32_t child(int32_t node, uint8_t byte) const;
  std::vector<Node> nodes_;
  std::vector<const AddedToken*> tokens_;
  bool first_byte_[256] = {};
};

}  // namespace kiln::tok
