// Byte-level BPE model: a vocabulary of byte strings and ranked merges.
//
// Words (pre-tokens) are raw UTF-8 bytes; the byte-level alphabet of tokenizer.json (GPT-2's
// bytes_to_unicode) is undone when the vocabulary is loaded, so no per-word mapping is needed.
// Merging applies the lowest-ranked adjacent pair first (leftmost on ties), as HF tokenizers does.
//
// A vocabulary may lack some of the 256 byte symbols. A byte without a token then becomes what HF
// tokenizers makes of it: its byte_fallback token "<0xXX>" when byte_fallback is on and the vocabulary
// has it, else the unk_token, else nothing. Either way the byte stays a symbol of its own while merging (no
// merge crosses it) and a dropped one is removed afterwards, as the JS tokenizers (the oracle) do. With fuse_unk,
// consecutive unk tokens of one pre-tokenized section (across words) become one: fuse_unk_run().
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kiln::tok {

// Maps a byte-level token string (each char stands for one byte) to raw bytes; false if a char is
// outside the byte-level alphabet (out is then unspecified).
bool byte_level_to_bytes(std::string_view token, std::string& out);
// Maps raw bytes to the byte-level alphabet.
std::string bytes_to_byte_level(std::string_view bytes);

// The BPE model's options of tokenizer.json besides vocab and merges.
struct BpeOptions {
  bool ignore_merges = false;
  std::string unk_token;  // empty: none
  bool fuse_unk = false;
  bool byte_fallback = false;
};

class BpeModel {
 public:
  // vocab: byte-level token string -> id. merges: pairs of byte-level token strings, in rank order.
  BpeModel(const std::vector<std::pair<std::string, int32_t>>& vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, const BpeOptions& options);

  // Appends the ids of one word (raw bytes, non-empty).
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  // The two merge loops, exposed so tests can check they agree: quadratic for short words,
  // heap + linked list for long ones.
  void merge_quadratic(std::string_view word, std::vector<int32_t>& out) const;
  void merge_with_heap(std::string_view word, std::vector<int32_t>& out) const;

  // The token of one byte; -1 when the vocabulary has none.
  int32_t byte_id(uint8_t b) const { return byte_ids_[b]; }
  // Whether every byte has its token (else encode_word takes the slower path for words that need one).
  bool has_all_bytes() const { return all_bytes_; }
  // fuse_unk: collapses each run of consecutive unk ids in ids[begin, end) into one (a no-op without fuse_unk).
  void fuse_unk_run(std::vector<int32_t>& ids, size_t begin) const;
  // Id of a token given as raw bytes; -1 if absent.
  int32_t bytes_to_id(std::string_view bytes) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  // Open-addressing hash table (pair of ids -> merge), built once; lookups are the hot path.
  struct MergeTable {
    std::vector<uint64_t> keys;  // (left << 32 | right) + 1; 0 = empty slot
    std::vector<Merge> values;
    uint64_t mask = 0;
    void build(const std::vector<std::pair<uint64_t, Merge>>& entries);
    const Merge* find(int32_t left, int32_t right) const {
      uint64_t key =
          ((static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right)) + 1;
      for (uint64_t slot = hash(key) & mask;; slot = (slot + 1) & mask) {
        if (keys[slot] == key) return &values[slot];
        if (keys[slot] == 0) return nullptr;
      }
    }
    static uint64_t hash(uint64_t k) {
      k ^= k >> 33;
      k *= 0xff51afd7ed558ccdull;
      k ^= k >> 33;
      return k;
    }
  };

  // Words with a byte that has no token: the symbols HF starts from, merged by the quadratic loop.
  void encode_with_missing_bytes(std::string_view word, std::vector<int32_t>& out) const;
  void merge_symbols(std::vector<int32_t>& symbols) const;

  static constexpr size_t kQuadraticMaxBytes = 64;
  MergeTable merges_;
  std::unordered_map<std::string, int32_t> bytes_to_id_;  // raw bytes -> id
  int32_t byte_ids_[256];
  int32_t byte_fallback_ids_[256];  // "<0xXX>" tokens, -1 when absent or byte_fallback is off
  int32_t unk_id_ = -1;
  bool fuse_unk_ = false;
  bool all_bytes_ = true;
  bool ignore_merges_;

  // Cache of encoded words (most text repeats a small set of words): open addressing with each entry
  // (word bytes and ids inline) in one 64-byte cache line, so a lookup touches one line. Short words
  // only; bounded: emptied when half full.
  class WordCache {
   public:
    static constexpr size_t kMaxWordBytes = 24;
    static constexpr size_t kMaxIds = 6;
    WordCache();
    // Appends the cached ids of word to out; false if absent.
    bool find(std::string_view word, uint64_t hash, std::vector<int32_t>& out) const;
    void insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t n_ids);

   private:
    struct alignas(64) Slot {
      uint64_t hash;  // 0: empty
      uint32_t word_bytes;
      uint32_t n_ids;
      char word[kMaxWordBytes];
      int32_t ids[kMaxIds];
    };
    static_assert(sizeof(Slot) == 64);
    static constexpr size_t kSlots = size_t{1} << 16;
    std::vector<Slot> slots_;
    size_t n_used_ = 0;
  };
  mutable std::mutex cache_mutex_;
  mutable WordCache cache_;
};

}  // namespace kiln::tok
