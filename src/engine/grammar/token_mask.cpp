#include "engine/grammar/token_mask.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace kiln::grammar {

TokenTable::TokenTable(std::vector<std::string> bytes) : bytes_(std::move(bytes)) {
  std::vector<int32_t> order;
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (!bytes_[i].empty()) order.push_back(static_cast<int32_t>(i));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const std::string &x = bytes_[static_cast<size_t>(a)], &y = bytes_[static_cast<size_t>(b)];
    return x != y ? x < y : a < b;
  });
  // Preorder trie from the sorted strings: `path` holds the node index at each depth of the last string.
  std::vector<int32_t> path;
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& s = bytes_[static_cast<size_t>(id)];
    KILN_CHECK(s.size() < 65535, "token {} is {} bytes long", id, s.size());
    size_t common = 0;
    if (prev)
      while (common < prev->size() && common < s.size() && (*prev)[common] == s[common]) ++common;
    while (path.size() > common) {
      trie_[static_cast<size_t>(path.back())].subtree_end = static_cast<int32_t>(trie_.size());
      path.pop_back();
    }
    for (size_t d = common; d < s.size(); ++d) {
      TrieNode n{static_cast<uint8_t>(s[d]), static_cast<uint16_t>(d + 1), -1, 0, 0};
      n.tokens_begin = n.tokens_end = static_cast<int32_t>(tokens_.size());
      path.push_back(static_cast<int32_t>(trie_.size()));
      trie_.push_back(n);
    }
    TrieNode& last = trie_[static_cast<size_t>(path.back())];
    if (last.tokens_end != static_cast<int32_t>(tokens_.size()))
      last.tokens_begin = static_cast<int32_t>(tokens_.size());  // first token of this node
    tokens_.push_back(id);
    last.tokens_end = static_cast<int32_t>(tokens_.size());
    max_depth_ = std::max(max_depth_, static_cast<int>(s.size()));
    prev = &s;
  }
  while (!path.empty()) {
    trie_[static_cast<size_t>(path.back())].subtree_end = static_cast<int32_t>(trie_.size());
    path.pop_back();
  }
}

int64_t TokenBitmask::count() const {
  int64_t c = 0;
  for (uint64_t w : words) c += std::popcount(w);
  return c;
}

Matcher::Matcher(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenTable> tokens,
                 std::vector<int32_t> stop_ids)
    : automaton_(std::move(grammar)), tokens_(std::move(tokens)), stop_ids_(std::move(stop_ids)) {
  state_ = automaton_.initial_state();
  walk_.resize(static_cast<size_t>(tokens_->max_depth()) + 1);
}

void Matcher::walk(int32_t state, int32_t begin, int32_t end, TokenBitmask& out, std::vector<int32_t>* exits) {
  const auto& trie = tokens_->trie();
  const auto& toks = tokens_->trie_tokens();
  const TokenTable::TrieNode* nodes = trie.data();
  const int32_t* tok = toks.data();
  uint64_t* words = out.words.data();
  int32_t* at = walk_.data();
  at[nodes[begin].depth - 1u] = state;
  for (int32_t i = begin; i < end;) {
    const TokenTable::TrieNode& node = nodes[i];
    const int32_t s = automaton_.step(at[node.depth - 1u], node.byte);
    if (s == Automaton::kDead) {
      i = node.subtree_end;
      continue;
    }
    if (exits && automaton_.popped_context(s)) {
      // This prefix returns into the unknown context: the subtree is walked again from the real state.
      exits->push_back(i);
      i = node.subtree_end;
      continue;
    }
    at[node.depth] = s;
    for (int32_t t = node.tokens_begin; t < node.tokens_end; ++t)
      words[static_cast<uint32_t>(tok[t]) >> 6] |= uint64_t(1) << (tok[t] & 63);
    ++i;
  }
}

void Matcher::compute(int32_t state, TokenBitmask& out) {
  const int32_t view = automaton_.opaque_view(state);
  const int32_t n = static_cast<int32_t>(tokens_->trie().size());
  if (view == state) {
    out.resize(tokens_->vocab_size());
    if (n > 0) walk(state, 0, n, out, nullptr);
  } else {
    // Context-independent part, shared by every state with the same innermost frames (e.g. each string value of
    // a schema), then the subtrees whose prefix leaves the frame, walked from the real state (early rejection:
    // after a closing quote only a few bytes fit).
    auto it = independent_.find(view);
    if (it == independent_.end()) {
      if (independent_.size() >= 64) independent_.clear();
      Independent part;
      part.mask.resize(tokens_->vocab_size());
      if (n > 0) walk(view, 0, n, part.mask, &part.exits);
      it = independent_.emplace(view, std::move(part)).first;
    }
    out = it->second.mask;
    const auto& trie = tokens_->trie();
    for (int32_t i : it->second.exits) {
      const TokenTable::TrieNode& node = trie[static_cast<size_t>(i)];
      // The prefix of this node: the first bytes of the first token in its subtree (preorder, sorted).
      const std::string& first = tokens_->bytes(tokens_->trie_tokens()[static_cast<size_t>(node.tokens_begin)]);
      const int32_t parent = automaton_.step_bytes(state, std::string_view(first).substr(0, node.depth - 1u));
      if (parent == Automaton::kDead) continue;
      walk(parent, i, node.subtree_end, out, nullptr);
    }
  }
  if (automaton_.accepting(state))
    for (int32_t id : stop_ids_)
      if (id >= 0 && id < tokens_->vocab_size()) out.set(id);
}

const TokenBitmask& Matcher::mask() {
  if (current_ && current_state_ == state_) {
    ++cache_hits_;
    return *current_;
  }
  auto it = cache_.find(state_);
  if (it != cache_.end()) {
    ++cache_hits_;
  } else {
    ++cache_misses_;
    if (cache_.size() >= 64) cache_.clear();  // bounded memory: masks are vocab/8 bytes each
    auto m = std::make_shared<TokenBitmask>();
    compute(state_, *m);
    it = cache_.emplace(state_, std::move(m)).first;
  }
  current_ = it->second;
  current_state_ = state_;
  return *current_;
}

int64_t Matcher::apply(std::span<float> logits) {
  const TokenBitmask& m = mask();
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t allowed = 0;
  const size_t n = logits.size();
  float* out = logits.data();
  for (size_t w = 0, base = 0; base < n; ++w, base += 64) {
    uint64_t bits = w < m.words.size() ? m.words[w] : 0;
    const size_t len = std::min<size_t>(64, n - base);
    if (len < 64) bits &= (uint64_t(1) << len) - 1;
    allowed += std::popcount(bits);
    if (bits == 0) {
      std::fill(out + base, out + base + len, ninf);
      continue;
    }
    uint64_t off = ~bits;
    if (len < 64) off &= (uint64_t(1) << len) - 1;
    while (off) {
      out[base + static_cast<size_t>(std::countr_zero(off))] = ninf;
      off &= off - 1;
    }
  }
  return allowed;
}

bool Matcher::accept(int32_t token) {
  if (finished_ || token < 0) return false;
  if (std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end() && automaton_.accepting(state_)) {
    finished_ = true;
    return true;
  }
  if (token >= tokens_->vocab_size()) return false;
  const std::string& b = tokens_->bytes(token);
  if (b.empty()) return false;
  int32_t s = automaton_.step_bytes(state_, b);
  if (s == Automaton::kDead) return false;
  state_ = s;
  return true;
}

bool Matcher::accept_bytes(std::string_view bytes) {
  int32_t s = automaton_.step_bytes(state_, bytes);
  if (s == Automaton::kDead) return false;
  state_ = s;
  return true;
}

}  // namespace kiln::grammar
