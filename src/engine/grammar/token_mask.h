// Per-step token masks from a grammar: which vocabulary tokens may come next.
//
// TokenTable holds every token's byte string and a byte trie over them, built once per tokenizer (the server
// makes it from the tokenizer: server/structured_output.h). The
// trie is stored in preorder with each node's subtree end, so a mask is one linear pass that runs the
// automaton one byte per trie node and skips a whole subtree as soon as its prefix is dead. Automaton
// transitions are memoised and masks are cached per automaton state (inside a JSON string the state
// repeats token after token), so a repeated state costs a copy of the mask.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

class TokenTable {
 public:
  // bytes[i]: token i's byte string; an empty string is a token no grammar allows (special tokens,
  // padding ids past the tokenizer).
  explicit TokenTable(std::vector<std::string> bytes);

  struct TrieNode {
    uint8_t byte;
    uint16_t depth;        // 1 for a token's first byte
    int32_t subtree_end;   // index after this node's last descendant
    int32_t tokens_begin;  // tokens whose last byte is this node: tokens_[tokens_begin, tokens_end)
    int32_t tokens_end;
  };

  int64_t vocab_size() const { return static_cast<int64_t>(bytes_.size()); }
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
  const std::vector<TrieNode>& trie() const { return trie_; }
  const std::vector<int32_t>& trie_tokens() const { return tokens_; }
  int max_depth() const { return max_depth_; }

 private:
  std::vector<std::string> bytes_;
  std::vector<TrieNode> trie_;
  std::vector<int32_t> tokens_;
  int max_depth_ = 0;
};

// What a request carries: the grammar, the tokenizer's table, and where the constraint starts.
struct Constraint {
  std::shared_ptr<const Grammar> grammar;
  std::shared_ptr<const TokenTable> tokens;
  // >= 0: the sequence is free until it generates this token (the end of the reasoning, "</think>"); the
  // token itself is not part of the constrained text. -1: constrained from the first token.
  int32_t start_after_token = -1;
};

// A bit per vocabulary id.
struct TokenBitmask {
  std::vector<uint64_t> words;
  void resize(int64_t n) { words.assign(static_cast<size_t>((n + 63) / 64), 0); }
  void set(int32_t i) { words[static_cast<size_t>(i) >> 6] |= uint64_t(1) << (i & 63); }
  bool test(int32_t i) const {
    size_t w = static_cast<size_t>(i) >> 6;
    return w < words.size() && ((words[w] >> (i & 63)) & 1);
  }
  int64_t count() const;
};

// One sequence's progress through a grammar. Not thread-safe (each sequence has its own).
class Matcher {
 public:
  // stop_ids: the tokens that end the sequence (eos); allowed exactly when the grammar accepts.
  Matcher(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenTable> tokens,
          std::vector<int32_t> stop_ids);

  // The tokens allowed next (cached per automaton state).
  const TokenBitmask& mask();
  // Sets the logits of disallowed tokens to -inf. logits may be longer than the table (padded rows: masked).
  // Returns the number of allowed tokens.
  int64_t apply(std::span<float> logits);
  // Advances over a token; false (state unchanged) when the token is not allowed.
  bool accept(int32_t token);
  bool accepting() const { return automaton_.accepting(state_); }
  bool finished() const { return finished_; }  // a stop token was accepted
  // Accepts text (bytes) directly; false when it does not fit. For tests and forced prefixes.
  bool accept_bytes(std::string_view bytes);
  void clear_mask_cache() {
    cache_.clear();
    independent_.clear();
    current_.reset();
  }
  size_t num_automaton_states() const { return automaton_.num_states(); }
  size_t cache_hits() const { return cache_hits_; }
  size_t cache_misses() const { return cache_misses_; }

 private:
  void compute(int32_t state, TokenBitmask& out);
  // The trie walk over nodes [begin, end) (one node's subtree, or the whole trie) from state, the automaton state
  // before node `begin`'s byte; sets the allowed tokens in out (sized). With `exits`, a prefix that returns into
  // an opaque bottom is not followed: its trie node is listed there instead.
  void walk(int32_t state, int32_t begin, int32_t end, TokenBitmask& out, std::vector<int32_t>* exits);

  struct Independent {
    TokenBitmask mask;                // tokens that fit without leaving the innermost frames
    std::vector<int32_t> exits;       // trie nodes whose prefix leaves them (walked again with the full stack)
  };
  std::unordered_map<int32_t, Independent> independent_;

  Automaton automaton_;
  std::shared_ptr<const TokenTable> tokens_;
  std::vector<int32_t> stop_ids_;
  int32_t state_;
  bool finished_ = false;
  std::unordered_map<int32_t, std::shared_ptr<TokenBitmask>> cache_;
  std::shared_ptr<TokenBitmask> current_;
  int32_t current_state_ = -1;
  std::vector<int32_t> walk_;  // automaton state per trie depth
  size_t cache_hits_ = 0, cache_misses_ = 0;
};

}  // namespace kiln::grammar
