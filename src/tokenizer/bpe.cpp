#include "tokenizer/bpe.h"

#include <xxhash.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <queue>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace kiln::tok {
namespace {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves; the other 68 bytes (controls,
// space, DEL, NBSP, soft hyphen) map in order to U+0100 onwards.
struct ByteLevelAlphabet {
  char32_t byte_to_char[256];
  int16_t char_to_byte[512];
  ByteLevelAlphabet() {
    std::fill(std::begin(char_to_byte), std::end(char_to_byte), int16_t{-1});
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_char[b] = printable ? char32_t(b) : char32_t(256 + next++);
      char_to_byte[byte_to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet table;
  return table;
}

}  // namespace

bool byte_level_to_bytes(std::string_view token, std::string& out) {
  out.clear();
  const auto& table = alphabet();
  for (size_t i = 0; i < token.size();) {
    size_t n = utf8::valid_sequence_length(token, i);
    if (n == 0) return false;
    size_t len;
    char32_t cp = utf8::decode(token, i, len);
    if (cp >= 512 || table.char_to_byte[cp] < 0) return false;
    out.push_back(static_cast<char>(table.char_to_byte[cp]));
    i += len;
  }
  return true;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) utf8::append(out, alphabet().byte_to_char[b]);
  return out;
}

void BpeModel::MergeTable::build(const std::vector<std::pair<uint64_t, Merge>>& entries) {
  size_t capacity = 16;
  while (capacity < entries.size() * 2) capacity *= 2;
  keys.assign(capacity, 0);
  values.assign(capacity, Merge{0, 0});
  mask = capacity - 1;
  for (const auto& [pair, merge] : entries) {
    uint64_t key = pair + 1;
    uint64_t slot = hash(key) & mask;
    while (keys[slot] != 0 && keys[slot] != key) slot = (slot + 1) & mask;
    keys[slot] = key;  // a repeated merge keeps the last rank, as HF's merge map does
    values[slot] = merge;
  }
}

BpeModel::BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, const BpeOptions& options)
    : fuse_unk_(options.fuse_unk), ignore_merges_(options.ignore_merges) {
  std::unordered_map<std::string_view, int32_t> by_token;  // byte-level string -> id
  by_token.reserve(vocab.size());
  bytes_to_id_.reserve(vocab.size());
  std::string bytes;
  for (const auto& [token, id] : vocab) {
    by_token.emplace(token, id);
    if (!byte_level_to_bytes(token, bytes))
      fail(
          "tokenizer.json: vocabulary token {:?} (id {}) is not in the byte-level alphabet; only byte-level "
          "BPE tokenizers are supported",
          token, id);
    bytes_to_id_.emplace(bytes, id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    byte_ids_[b] = it == bytes_to_id_.end() ? -1 : it->second;
    all_bytes_ = all_bytes_ && byte_ids_[b] >= 0;
    byte_fallback_ids_[b] = -1;
    if (options.byte_fallback) {
      auto fb = by_token.find(fmt::format("<0x{:02X}>", b));
      if (fb != by_token.end()) byte_fallback_ids_[b] = fb->second;
    }
  }
  if (!options.unk_token.empty()) {
    auto it = by_token.find(options.unk_token);
    if (it == by_token.end())
      fail("tokenizer.json: the BPE unk_token {:?} is not in the vocabulary", options.unk_token);
    unk_id_ = it->second;
  }

  std::vector<std::pair<uint64_t, Merge>> entries;
  entries.reserve(merges.size());
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    auto l = by_token.find(left);
    auto r = by_token.find(right);
    if (l == by_token.end() || r == by_token.end())
      fail("tokenizer.json: merge {} ({:?} {:?}) uses a token missing from the vocabulary", rank, left,
           right);
    joined = left + right;
    auto m = by_token.find(joined);
    if (m == by_token.end())
      fail("tokenizer.json: merge {} ({:?} {:?}) produces {:?}, which is missing from the vocabulary", rank,
           left, right, joined);
    uint64_t pair =
        (static_cast<uint64_t>(static_cast<uint32_t>(l->second)) << 32) | static_cast<uint32_t>(r->second);
    entries.push_back({pair, Merge{static_cast<int32_t>(rank), m->second}});
  }
  merges_.build(entries);
}

int32_t BpeModel::bytes_to_id(std::string_view bytes) const {
  auto it = bytes_to_id_.find(std::string(bytes));
  return it == bytes_to_id_.end() ? -1 : it->second;
}

void BpeModel::merge_quadratic(std::string_view word, std::vector<int32_t>& out) const {
  // symbols[i] and the rank of the pair (symbols[i], symbols[i + 1]) in ranks[i].
  constexpr size_t kStack = 128;
  int32_t symbols_stack[kStack], ranks_stack[kStack], merged_stack[kStack];
  std::vector<int32_t> heap_storage;
  int32_t *symbols = symbols_stack, *ranks = ranks_stack, *merged = merged_stack;
  size_t n = word.size();
  if (n > kStack) {
    heap_storage.resize(3 * n);
    symbols = heap_storage.data();
    ranks = symbols + n;
    merged = ranks + n;
  }
  for (size_t i = 0; i < n; ++i) symbols[i] = byte_ids_[static_cast<uint8_t>(word[i])];
  auto rank_pair = [&](size_t i) {
    const Merge* m = merges_.find(symbols[i], symbols[i + 1]);
    ranks[i] = m ? m->rank : INT32_MAX;
    merged[i] = m ? m->merged_id : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) rank_pair(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == INT32_MAX) break;
    symbols[best] = merged[best];
    for (size_t i = best + 1; i + 1 < n; ++i) {
      symbols[i] = symbols[i + 1];
      ranks[i] = ranks[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    if (best + 1 < n)
      rank_pair(best);
    else
      ranks[best] = INT32_MAX;
    if (best > 0) rank_pair(best - 1);
  }
  out.insert(out.end(), symbols, symbols + n);
}

void BpeModel::merge_with_heap(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;  // -1 at the ends
    bool alive;
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;  // index of the left symbol
    int32_t merged_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const int32_t n = static_cast<int32_t>(word.size());
  std::vector<Symbol> symbols(n);
  for (int32_t i = 0; i < n; ++i)
    symbols[i] = {byte_ids_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1, true};
  std::vector<Candidate> storage;
  storage.reserve(n);
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue(
      std::greater<Candidate>{}, std::move(storage));
  auto push_pair = [&](int32_t left) {
    int32_t right = symbols[left].next;
    if (right < 0) return;
    if (const Merge* m = merges_.find(symbols[left].id, symbols[right].id))
      queue.push({m->rank, left, m->merged_id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);
  while (!queue.empty()) {
    Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    // Stale if either side changed since the candidate was queued.
    const Merge* m = merges_.find(left.id, symbols[left.next].id);
    if (m == nullptr || m->merged_id != top.merged_id) continue;
    Symbol& right = symbols[left.next];
    left.id = top.merged_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  for (int32_t i = 0; i >= 0 && i < n; i = symbols[i].next) out.push_back(symbols[i].id);
}

BpeModel::WordCache::WordCache() : slots_(kSlots, Slot{}) {}

bool BpeModel::WordCache::find(std::string_view word, uint64_t hash, std::vector<int32_t>& out) const {
  for (size_t i = hash & (kSlots - 1);; i = (i + 1) & (kSlots - 1)) {
    const Slot& slot = slots_[i];
    if (slot.hash == 0) return false;
    if (slot.hash == hash && slot.word_bytes == word.size() &&
        std::memcmp(slot.word, word.data(), word.size()) == 0) {
      out.insert(out.end(), slot.ids, slot.ids + slot.n_ids);
      return true;
    }
  }
}

void BpeModel::WordCache::insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t n_ids) {
  if (word.size() > kMaxWordBytes || n_ids > kMaxIds) return;
  if (n_used_ >= kSlots / 2) {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    n_used_ = 0;
  }
  size_t i = hash & (kSlots - 1);
  for (; slots_[i].hash != 0; i = (i + 1) & (kSlots - 1)) {
    if (slots_[i].hash == hash && slots_[i].word_bytes == word.size() &&
        std::memcmp(slots_[i].word, word.data(), word.size()) == 0)
      return;  // another thread inserted it meanwhile
  }
  Slot& slot = slots_[i];
  slot.hash = hash;
  slot.word_bytes = static_cast<uint32_t>(word.size());
  slot.n_ids = static_cast<uint32_t>(n_ids);
  std::memcpy(slot.word, word.data(), word.size());
  std::copy(ids, ids + n_ids, slot.ids);
  ++n_used_;
}

void BpeModel::merge_symbols(std::vector<int32_t>& symbols) const {
  while (symbols.size() > 1) {
    size_t best = 0;
    const Merge* best_merge = nullptr;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const Merge* m = merges_.find(symbols[i], symbols[i + 1]);
      if (m && (!best_merge || m->rank < best_merge->rank)) {
        best = i;
        best_merge = m;
      }
    }
    if (!best_merge) break;
    symbols[best] = best_merge->merged_id;
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
}

void BpeModel::encode_with_missing_bytes(std::string_view word, std::vector<int32_t>& out) const {
  // The word's symbols as the JS tokenizers build them: one per byte that has a token; one that has none stays a
  // symbol of its own (-1 - byte: no merge involves a negative id), and after merging becomes its byte-fallback
  // token, else unk, else nothing.
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  for (unsigned char b : word) symbols.push_back(byte_ids_[b] >= 0 ? byte_ids_[b] : -1 - static_cast<int32_t>(b));
  merge_symbols(symbols);
  for (int32_t sym : symbols) {
    if (sym >= 0) {
      out.push_back(sym);
      continue;
    }
    const auto b = static_cast<unsigned char>(-1 - sym);
    if (byte_fallback_ids_[b] >= 0) out.push_back(byte_fallback_ids_[b]);
    else if (unk_id_ >= 0) out.push_back(unk_id_);
  }
}

void BpeModel::fuse_unk_run(std::vector<int32_t>& ids, size_t begin) const {
  if (!fuse_unk_ || unk_id_ < 0 || ids.size() <= begin + 1) return;
  size_t w = begin + 1;
  for (size_t r = begin + 1; r < ids.size(); ++r)
    if (!(ids[r] == unk_id_ && ids[w - 1] == unk_id_)) ids[w++] = ids[r];
  ids.resize(w);
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (!all_bytes_) {
    if (ignore_merges_) {
      auto it = bytes_to_id_.find(std::string(word));
      if (it != bytes_to_id_.end()) {
        out.push_back(it->second);
        return;
      }
    }
    for (unsigned char b : word)
      if (byte_ids_[b] < 0) return encode_with_missing_bytes(word, out);
  }
  if (word.size() == 1) {
    out.push_back(byte_ids_[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (ignore_merges_) {
    auto it = bytes_to_id_.find(std::string(word));
    if (it != bytes_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() > WordCache::kMaxWordBytes) {
    // Long words are rare and seldom repeat: not cached. The quadratic loop wins while short.
    if (word.size() <= kQuadraticMaxBytes) {
      merge_quadratic(word, out);
    } else {
      merge_with_heap(word, out);
    }
    return;
  }
  uint64_t hash = XXH3_64bits(word.data(), word.size()) | 1;  // never 0 (the empty-slot mark)
  {
    std::lock_guard lock(cache_mutex_);
    if (cache_.find(word, hash, out)) return;
  }
  size_t first = out.size();
  merge_quadratic(word, out);
  std::lock_guard lock(cache_mutex_);
  cache_.insert(word, hash, out.data() + first, out.size() - first);
}

}  // namespace kiln::tok
