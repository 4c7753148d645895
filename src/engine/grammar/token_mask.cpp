#include "engine/grammar/token_mask.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
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

std::shared_ptr<const ViewMask> TokenTable::shared_view_mask(const std::string& key) const {
  std::lock_guard<std::mutex> lock(shared_mu_);
  auto it = shared_.find(key);
  return it == shared_.end() ? nullptr : it->second;
}

void TokenTable::store_shared_view_mask(const std::string& key, std::shared_ptr<const ViewMask> mask) const {
  std::lock_guard<std::mutex> lock(shared_mu_);
  if (shared_.size() >= 64 && !shared_.count(key)) shared_.clear();  // bounded memory (each ~vocab/8 bytes and more)
  shared_[key] = std::move(mask);
}

void TokenTable::clear_shared_view_masks() const {
  std::lock_guard<std::mutex> lock(shared_mu_);
  shared_.clear();
}

size_t TokenTable::num_shared_view_masks() const {
  std::lock_guard<std::mutex> lock(shared_mu_);
  return shared_.size();
}

// ---------------------------------------------------------------------------------------------------

namespace {

// The bytes before a trie node's own: the first bytes of the first token in its subtree (preorder, sorted).
std::string_view exit_prefix(const TokenTable& t, const TokenTable::TrieNode& node) {
  const std::string& first = t.bytes(t.trie_tokens()[static_cast<size_t>(node.tokens_begin)]);
  return std::string_view(first).substr(0, node.depth - 1u);
}

}  // namespace

CompiledGrammar::CompiledGrammar(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenTable> tokens)
    : automaton_(std::move(grammar)), tokens_(std::move(tokens)) {
  KILN_CHECK(tokens_, "a compiled grammar without a token table");
  walk_.resize(static_cast<size_t>(tokens_->max_depth()) + 1);
  units_.resize(static_cast<size_t>(tokens_->max_depth()) + 1);
}

int32_t CompiledGrammar::initial_state() {
  std::lock_guard<std::mutex> lock(mu_);
  return automaton_.initial_state();
}

int32_t CompiledGrammar::step_bytes(int32_t state, std::string_view bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  return automaton_.step_bytes(state, bytes);
}

bool CompiledGrammar::accepting(int32_t state) {
  std::lock_guard<std::mutex> lock(mu_);
  return automaton_.accepting(state);
}

size_t CompiledGrammar::num_states() {
  std::lock_guard<std::mutex> lock(mu_);
  return automaton_.num_states();
}

size_t CompiledGrammar::mask_hits() {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

size_t CompiledGrammar::mask_misses() {
  std::lock_guard<std::mutex> lock(mu_);
  return misses_;
}

void CompiledGrammar::clear_mask_caches() {
  std::lock_guard<std::mutex> lock(mu_);
  masks_.clear();
  lru_.clear();
  views_.clear();
  exit_parents_.clear();
}

std::shared_ptr<const TokenBitmask> CompiledGrammar::mask(int32_t state, bool* hit) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = masks_.find(state);
  if (it != masks_.end()) {
    ++hits_;
    if (hit) *hit = true;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return it->second.mask;
  }
  ++misses_;
  if (hit) *hit = false;
  auto m = std::make_shared<TokenBitmask>();
  compute(state, *m);
  if (masks_.size() >= kMaskCacheEntries) {
    masks_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(state);
  masks_.emplace(state, CachedMask{m, lru_.begin()});
  return m;
}

void CompiledGrammar::walk(int32_t state, int32_t begin, int32_t end, TokenBitmask& out, ViewMask* view,
                           std::vector<std::pair<int32_t, int32_t>>* counts) {
  const auto& trie = tokens_->trie();
  const auto& toks = tokens_->trie_tokens();
  const TokenTable::TrieNode* nodes = trie.data();
  const int32_t* tok = toks.data();
  uint64_t* words = out.words.data();
  int32_t* at = walk_.data();
  int32_t* units = units_.data();
  at[nodes[begin].depth - 1u] = state;
  units[nodes[begin].depth - 1u] = 0;
  for (int32_t i = begin; i < end;) {
    const TokenTable::TrieNode& node = nodes[i];
    const Automaton::Step st = automaton_.step_counted(at[node.depth - 1u], node.byte);
    if (st.next == Automaton::kDead) {
      i = node.subtree_end;
      continue;
    }
    if (view && (st.delta == Automaton::kMixedCount || automaton_.popped_context(st.next))) {
      // This prefix returns into the unknown context, or its configurations disagree on the units counted: the
      // subtree is walked again from the real state.
      view->exits.push_back(i);
      i = node.subtree_end;
      continue;
    }
    at[node.depth] = st.next;
    if (counts) {
      const int32_t u = units[node.depth - 1u] + (st.delta == Automaton::kCount ? 1 : 0);
      units[node.depth] = u;
      for (int32_t t = node.tokens_begin; t < node.tokens_end; ++t) counts->push_back({u, tok[t]});
    }
    for (int32_t t = node.tokens_begin; t < node.tokens_end; ++t)
      words[static_cast<uint32_t>(tok[t]) >> 6] |= uint64_t(1) << (tok[t] & 63);
    ++i;
  }
}

std::shared_ptr<const ViewMask> CompiledGrammar::view_mask(int32_t view) {
  auto it = views_.find(view);
  if (it != views_.end()) return it->second;
  if (views_.size() >= kViewCacheEntries) {
    views_.clear();
    exit_parents_.clear();
  }
  // The same frame structure in another grammar over this table (every JSON string) has the same view mask.
  // (At most 256 nodes: a JSON string frame reaches about 80; a view that reaches a whole schema is cheap to walk.)
  const std::string key = automaton_.view_key(view, 256);
  std::shared_ptr<const ViewMask> shared = key.empty() ? nullptr : tokens_->shared_view_mask(key);
  if (!shared) {
    auto part = std::make_shared<ViewMask>();
    part->mask.resize(tokens_->vocab_size());
    std::vector<std::pair<int32_t, int32_t>> counts;
    const int32_t n = static_cast<int32_t>(tokens_->trie().size());
    if (n > 0) walk(view, 0, n, part->mask, part.get(), &counts);
    int32_t largest = 0;
    for (const auto& c : counts) largest = std::max(largest, c.first);
    if (largest > 0) {
      // Counting sort by units: count_begin[k] = first index with units >= k.
      part->count_begin.assign(static_cast<size_t>(largest) + 2, 0);
      for (const auto& c : counts) ++part->count_begin[static_cast<size_t>(c.first) + 1];
      for (size_t k = 1; k < part->count_begin.size(); ++k) part->count_begin[k] += part->count_begin[k - 1];
      part->by_count.resize(counts.size());
      std::vector<int32_t> fill(part->count_begin.begin(), part->count_begin.end() - 1);
      for (const auto& c : counts) part->by_count[static_cast<size_t>(fill[static_cast<size_t>(c.first)]++)] = c.second;
    }
    shared = part;
    if (!key.empty()) tokens_->store_shared_view_mask(key, shared);
  }
  views_.emplace(view, shared);
  return shared;
}

void CompiledGrammar::compute(int32_t state, TokenBitmask& out) {
  const int32_t view = automaton_.opaque_view(state);
  const int32_t n = static_cast<int32_t>(tokens_->trie().size());
  const Automaton::CountedFrame frame = automaton_.counted_frame(state);
  if (view == state || (frame.counted && !frame.uniform)) {
    // No call frame to share, or counted frames the view cannot tell apart: the whole trie from the real state.
    out.resize(tokens_->vocab_size());
    if (n > 0) walk(state, 0, n, out, nullptr, nullptr);
    return;
  }
  // Context-independent part, shared by every state with the same innermost frames (e.g. each string value of a
  // schema, bounded or not), then the subtrees whose prefix leaves the frame, walked from the real state (early
  // rejection: after a closing quote only a few bytes fit).
  const std::shared_ptr<const ViewMask> part = view_mask(view);
  const ViewMask& v = *part;
  if (frame.counted && frame.remaining >= 0 && !v.by_count.empty()) {
    // A bounded frame with `remaining` units left: the tokens that count more do not fit. Copy-and-clear or set from
    // empty, whichever touches fewer tokens.
    const size_t r = static_cast<size_t>(frame.remaining);
    const size_t keep = r + 1 < v.count_begin.size() ? static_cast<size_t>(v.count_begin[r + 1]) : v.by_count.size();
    if (v.by_count.size() - keep <= keep) {
      out = v.mask;
      for (size_t k = keep; k < v.by_count.size(); ++k) out.reset(v.by_count[k]);
    } else {
      out.resize(tokens_->vocab_size());
      for (size_t k = 0; k < keep; ++k) out.set(v.by_count[k]);
    }
  } else {
    out = v.mask;
  }
  const auto& trie = tokens_->trie();
  if (frame.frame >= 0) {
    // One real frame: each exit's parent is its view parent rebased onto that frame (a memoised lookup), not a
    // re-walk of the exit's prefix.
    const std::vector<ExitParent>& parents = exit_parents(view, v);
    for (size_t k = 0; k < v.exits.size(); ++k) {
      const TokenTable::TrieNode& node = trie[static_cast<size_t>(v.exits[k])];
      const int32_t parent = automaton_.rebase(state, parents[k].view_state, parents[k].units);
      if (parent != Automaton::kDead) walk(parent, v.exits[k], node.subtree_end, out, nullptr, nullptr);
    }
    return;
  }
  for (int32_t i : v.exits) {
    const TokenTable::TrieNode& node = trie[static_cast<size_t>(i)];
    const int32_t parent = automaton_.step_bytes(state, exit_prefix(*tokens_, node));
    if (parent == Automaton::kDead) continue;
    walk(parent, i, node.subtree_end, out, nullptr, nullptr);
  }
}

const std::vector<CompiledGrammar::ExitParent>& CompiledGrammar::exit_parents(int32_t view, const ViewMask& v) {
  auto it = exit_parents_.find(view);
  if (it != exit_parents_.end()) return it->second;
  std::vector<ExitParent> parents;
  parents.reserve(v.exits.size());
  const auto& trie = tokens_->trie();
  for (int32_t i : v.exits) {
    int32_t s = view, units = 0;
    for (char ch : exit_prefix(*tokens_, trie[static_cast<size_t>(i)])) {
      const Automaton::Step st = automaton_.step_counted(s, static_cast<uint8_t>(ch));
      KILN_CHECK(st.next != Automaton::kDead && st.delta != Automaton::kMixedCount, "grammar: a view exit's prefix changed");
      units += st.delta == Automaton::kCount ? 1 : 0;
      s = st.next;
    }
    parents.push_back({s, units});
  }
  return exit_parents_.emplace(view, std::move(parents)).first->second;
}

// ---------------------------------------------------------------------------------------------------

Matcher::Matcher(std::shared_ptr<CompiledGrammar> compiled, std::vector<int32_t> stop_ids)
    : compiled_(std::move(compiled)), stop_ids_(std::move(stop_ids)) {
  KILN_CHECK(compiled_, "a matcher without a compiled grammar");
  tokens_ = compiled_->tokens();
  state_ = compiled_->initial_state();
}

Matcher::Matcher(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenTable> tokens,
                 std::vector<int32_t> stop_ids)
    : Matcher(std::make_shared<CompiledGrammar>(std::move(grammar), std::move(tokens)), std::move(stop_ids)) {}

const TokenBitmask& Matcher::mask() {
  if (current_ && current_state_ == state_) {
    ++cache_hits_;
    return *current_;
  }
  bool hit = false;
  std::shared_ptr<const TokenBitmask> m = compiled_->mask(state_, &hit);
  ++(hit ? cache_hits_ : cache_misses_);
  bool stops = false;
  for (int32_t id : stop_ids_) stops |= id >= 0 && id < tokens_->vocab_size();
  if (stops && compiled_->accepting(state_)) {
    auto with_stops = std::make_shared<TokenBitmask>(*m);
    for (int32_t id : stop_ids_)
      if (id >= 0 && id < tokens_->vocab_size()) with_stops->set(id);
    m = std::move(with_stops);
  }
  current_ = std::move(m);
  current_state_ = state_;
  return *current_;
}
namespace {

// -inf over p[0, n): memcpy from a block of -inf (std::fill of a float is a scalar loop at -O2 with GCC 12, about 6x
// slower over a 248k row).
void fill_ninf(float* p, size_t n) {
  static const auto block = [] {
    std::array<float, 2048> b;
    b.fill(-std::numeric_limits<float>::infinity());
    return b;
  }();
  for (; n >= block.size(); n -= block.size(), p += block.size()) std::memcpy(p, block.data(), sizeof(block));
  std::memcpy(p, block.data(), n * sizeof(float));
}

}  // namespace

int64_t Matcher::apply(std::span<float> logits) {
  const TokenBitmask& m = mask();
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t allowed = 0;
  const size_t n = logits.size();
  const size_t full_words = std::min(n / 64, m.words.size());
  float* out = logits.data();
  // Runs of words with nothing allowed are filled in one go (one contiguous store stream: structural states allow a
  // few hundred tokens of 248k); words with some allowed clear their disallowed bits one by one.
  size_t w = 0;
  while (w < full_words) {
    if (m.words[w] == 0) {
      size_t e = w + 1;
      while (e < full_words && m.words[e] == 0) ++e;
      fill_ninf(out + w * 64, (e - w) * 64);
      w = e;
      continue;
    }
    const uint64_t bits = m.words[w];
    allowed += std::popcount(bits);
    uint64_t off = ~bits;
    while (off) {
      out[w * 64 + static_cast<size_t>(std::countr_zero(off))] = ninf;
      off &= off - 1;
    }
    ++w;
  }
  for (size_t i = full_words * 64; i < n; ++i) {  // the tail: a partial word, and rows past the table (masked)
    if (m.test(static_cast<int32_t>(i))) ++allowed;
    else out[i] = ninf;
  }
  return allowed;
}

bool Matcher::accept(int32_t token) {
  if (finished_ || token < 0) return false;
  if (std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end() && compiled_->accepting(state_)) {
    finished_ = true;
    return true;
  }
  if (token >= tokens_->vocab_size()) return false;
  const std::string& b = tokens_->bytes(token);
  if (b.empty()) return false;
  int32_t s = compiled_->step_bytes(state_, b);
  if (s == Automaton::kDead) return false;
  state_ = s;
  return true;
}

bool Matcher::accept_bytes(std::string_view bytes) {
  int32_t s = compiled_->step_bytes(state_, bytes);
  if (s == Automaton::kDead) return false;
  state_ = s;
  return true;
}

// ---------------------------------------------------------------------------------------------------

std::shared_ptr<CompiledGrammar> GrammarCache::get(std::shared_ptr<const Grammar> grammar,
                                                   std::shared_ptr<const TokenTable> tokens) {
  KILN_CHECK(grammar && tokens, "GrammarCache::get without a grammar or a token table");
  const TokenTable* table = tokens.get();
  std::string key(reinterpret_cast<const char*>(&table), sizeof(table));
  key += grammar->structure_key();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    if (it->second.compiled->num_states() <= max_states_) {
      ++hits_;
      return it->second.compiled;
    }
    it->second.compiled = std::make_shared<CompiledGrammar>(std::move(grammar), std::move(tokens));  // grown too big
    return it->second.compiled;
  }
  if (entries_.size() >= capacity_ && !lru_.empty()) {
    entries_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(key);
  auto compiled = std::make_shared<CompiledGrammar>(std::move(grammar), std::move(tokens));
  entries_.emplace(std::move(key), Entry{compiled, lru_.begin()});
  return compiled;
}

size_t GrammarCache::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

size_t GrammarCache::hits() {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

}  // namespace kiln::grammar
