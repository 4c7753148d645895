// Per-step token masks from a grammar: which vocabulary tokens may come next.
//
// TokenTable holds every token's byte string and a byte trie over them, built once per tokenizer (the server
// makes it from the tokenizer: server/structured_output.h). The
// trie is stored in preorder with each node's subtree end, so a mask is one linear pass that runs the
// automaton one byte per trie node and skips a whole subtree as soon as its prefix is dead. Automaton
// transitions are memoised and masks are cached per automaton state (inside a JSON string the state
// repeats token after token), so a repeated state costs a lookup.
//
// Where the work is shared:
//   - CompiledGrammar: one grammar over one table, its memoised automaton and mask caches, behind one lock; every
//     matcher of the grammar uses it (the n choices of a request; requests with the same grammar through
//     GrammarCache), so a state's mask is computed once while the grammar is cached, not once per sequence.
//   - TokenTable's view masks: the context-independent part of a mask (the tokens that fit without leaving the
//     innermost call frame, e.g. a JSON string's content) is keyed by the structure the frame can reach
//     (Automaton::view_key), so every grammar over the table that builds its strings the same way shares it.
//   - Counted strings (minLength / maxLength: Grammar::counted_call): a bounded string position shares the unbounded
//     string's view mask; the tokens whose characters exceed what is left are removed by their per-token character
//     count (recorded by the view walk), and only the tokens that close the string are walked from the real state.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

// A bit per vocabulary id.
struct TokenBitmask {
  std::vector<uint64_t> words;
  void resize(int64_t n) { words.assign(static_cast<size_t>((n + 63) / 64), 0); }
  void set(int32_t i) { words[static_cast<size_t>(i) >> 6] |= uint64_t(1) << (i & 63); }
  void reset(int32_t i) { words[static_cast<size_t>(i) >> 6] &= ~(uint64_t(1) << (i & 63)); }
  bool test(int32_t i) const {
    size_t w = static_cast<size_t>(i) >> 6;
    return w < words.size() && ((words[w] >> (i & 63)) & 1);
  }
  int64_t count() const;
};

// The context-independent part of the masks of one opaque view (Automaton::opaque_view).
struct ViewMask {
  TokenBitmask mask;           // tokens that fit without leaving the innermost frames (and with one count each)
  std::vector<int32_t> exits;  // trie nodes whose prefix leaves them, or counts differently on two paths
  // The tokens of mask by the units (characters) each counts in the frame, ascending; count_begin[k]: the first index
  // with a count >= k (k = 0 .. largest + 1). Empty when no token counts anything.
  std::vector<int32_t> by_count;
  std::vector<int32_t> count_begin;
};

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

  // View masks shared by every grammar over this table, keyed by Automaton::view_key (thread-safe; bounded: the
  // whole set is dropped when it is full).
  std::shared_ptr<const ViewMask> shared_view_mask(const std::string& key) const;
  void store_shared_view_mask(const std::string& key, std::shared_ptr<const ViewMask> mask) const;
  void clear_shared_view_masks() const;  // benchmarks: measure the first walk again
  size_t num_shared_view_masks() const;

 private:
  std::vector<std::string> bytes_;
  std::vector<TrieNode> trie_;
  std::vector<int32_t> tokens_;
  int max_depth_ = 0;
  mutable std::mutex shared_mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const ViewMask>> shared_;
};

class CompiledGrammar;

// What a request carries: the grammar, the tokenizer's table, and where the constraint starts.
struct Constraint {
  std::shared_ptr<const Grammar> grammar;
  std::shared_ptr<const TokenTable> tokens;
  // The grammar's shared automaton and mask caches (GrammarCache); null: each sequence compiles its own.
  std::shared_ptr<CompiledGrammar> compiled;
  // >= 0: the sequence is free until it generates this token (the end of the reasoning, "</think>"); the
  // token itself is not part of the constrained text. -1: constrained from the first token.
  int32_t start_after_token = -1;
};

// One grammar over one token table: the memoised automaton, the masks per state (without stop tokens) and the view
// masks, shared by every matcher of the grammar. Thread-safe: one lock around the automaton and the caches (a mask
// is computed under it; later callers of the same state get the cached one).
class CompiledGrammar {
 public:
  CompiledGrammar(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenTable> tokens);

  const std::shared_ptr<const TokenTable>& tokens() const { return tokens_; }
  int32_t initial_state();
  int32_t step_bytes(int32_t state, std::string_view bytes);  // Automaton::kDead when a byte does not fit
  bool accepting(int32_t state);
  // The tokens allowed from state, stop tokens aside (cached: at most kMaskCacheEntries, least recently used
  // dropped). hit: whether it came from the cache.
  std::shared_ptr<const TokenBitmask> mask(int32_t state, bool* hit = nullptr);
  void clear_mask_caches();  // benchmarks: this grammar's masks and view masks (not the table's)
  size_t num_states();
  size_t mask_hits();
  size_t mask_misses();

  static constexpr size_t kMaskCacheEntries = 256;  // vocab / 8 bytes each (31 KB at 248k ids)
  static constexpr size_t kViewCacheEntries = 64;

 private:
  void compute(int32_t state, TokenBitmask& out);
  std::shared_ptr<const ViewMask> view_mask(int32_t view);
  // The trie walk over nodes [begin, end) (one node's subtree, or the whole trie) from state, the automaton state
  // before node `begin`'s byte; sets the allowed tokens in out (sized). With `view`: a prefix that returns into the
  // opaque bottom, or whose byte counts on some paths and not on others, is not followed (its trie node goes to
  // view->exits), and each allowed token's count goes to counts (count, token).
  void walk(int32_t state, int32_t begin, int32_t end, TokenBitmask& out, ViewMask* view,
            std::vector<std::pair<int32_t, int32_t>>* counts);

  std::mutex mu_;
  Automaton automaton_;
  std::shared_ptr<const TokenTable> tokens_;
  struct CachedMask {
    std::shared_ptr<const TokenBitmask> mask;
    std::list<int32_t>::iterator lru;
  };
  std::unordered_map<int32_t, CachedMask> masks_;
  std::list<int32_t> lru_;  // most recent first
  std::unordered_map<int32_t, std::shared_ptr<const ViewMask>> views_;
  // Per view state: for each of its view mask's exits, the view state before the exit's byte and the units its
  // prefix counted (this automaton's ids: a shared ViewMask holds only trie nodes).
  struct ExitParent {
    int32_t view_state, units;
  };
  std::unordered_map<int32_t, std::vector<ExitParent>> exit_parents_;
  const std::vector<ExitParent>& exit_parents(int32_t view, const ViewMask& v);
  std::vector<int32_t> walk_;   // automaton state per trie depth
  std::vector<int32_t> units_;  // units counted per trie depth (view walks)
  size_t hits_ = 0, misses_ = 0;
};

// One sequence's progress through a grammar. Not thread-safe (each sequence has its own); matchers over one
// CompiledGrammar may run on different threads.
class Matcher {
 public:
  // stop_ids: the tokens that end the sequence (eos); allowed exactly when the grammar accepts.
  Matcher(std::shared_ptr<CompiledGrammar> compiled, std::vector<int32_t> stop_ids);
  // With a CompiledGrammar of its own.
  Matcher(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenTable> tokens,
          std::vector<int32_t> stop_ids);

  // The tokens allowed next (cached per automaton state).
  const TokenBitmask& mask();
  // Sets the logits of disallowed tokens to -inf. logits may be longer than the table (padded rows: masked).
  // Returns the number of allowed tokens.
  int64_t apply(std::span<float> logits);
  // Advances over a token; false (state unchanged) when the token is not allowed.
  bool accept(int32_t token);
  bool accepting() const { return compiled_->accepting(state_); }
  bool finished() const { return finished_; }  // a stop token was accepted
  // Accepts text (bytes) directly; false when it does not fit. For tests and forced prefixes.
  bool accept_bytes(std::string_view bytes);
  // Benchmarks: empties the shared grammar's caches too (not the table's view masks).
  void clear_mask_cache() {
    compiled_->clear_mask_caches();
    current_.reset();
  }
  size_t num_automaton_states() const { return compiled_->num_states(); }
  size_t cache_hits() const { return cache_hits_; }
  size_t cache_misses() const { return cache_misses_; }
  const std::shared_ptr<CompiledGrammar>& compiled() const { return compiled_; }

 private:
  std::shared_ptr<CompiledGrammar> compiled_;
  std::shared_ptr<const TokenTable> tokens_;
  std::vector<int32_t> stop_ids_;
  int32_t state_;
  bool finished_ = false;
  std::shared_ptr<const TokenBitmask> current_;  // the mask of current_state_, stop tokens included
  int32_t current_state_ = -1;
  size_t cache_hits_ = 0, cache_misses_ = 0;
};

// Compiled grammars shared across requests: an equal grammar (Grammar::structure_key) over the same table gets the
// same CompiledGrammar. Thread-safe. At most `capacity` grammars (least recently used dropped); a grammar whose
// automaton has grown past max_states is replaced by a fresh one for later requests (running ones keep theirs).
class GrammarCache {
 public:
  // Defaults: at most 16 grammars of at most 8k automaton states each (~1.3 KB per state once stepped: ~11 MB, and
  // up to CompiledGrammar::kMaskCacheEntries masks of vocab / 8 bytes: 8 MB at a 248k vocabulary, per grammar). The
  // 98-token answer of bench_grammar's 8-property schema makes about 1,100 states.
  explicit GrammarCache(size_t capacity = 16, size_t max_states = size_t(1) << 13)
      : capacity_(capacity), max_states_(max_states) {}
  std::shared_ptr<CompiledGrammar> get(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenTable> tokens);
  size_t size();
  size_t hits();

 private:
  struct Entry {
    std::shared_ptr<CompiledGrammar> compiled;
    std::list<std::string>::iterator lru;
  };
  std::mutex mu_;
  size_t capacity_, max_states_;
  std::unordered_map<std::string, Entry> entries_;
  std::list<std::string> lru_;  // most recent first
  size_t hits_ = 0;
};

}  // namespace kiln::grammar
