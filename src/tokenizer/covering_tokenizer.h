// A byte-level BPE tokenizer whose ids cover a whole model vocabulary, for random-weight checkpoints.
//
// A checkpoint with random weights samples any id in [0, vocab_size): its tokenizer must decode every one
// of them, or a benchmark through the server fails on ids it cannot turn into text. This builds one in the
// Qwen2/Qwen3.5 layout (the same pre-tokenizer, normalizer and decoder as `base_tokenizer_json`):
//   ids [0, 256)                 the 256 byte-level symbols
//   ids [256, first_added)       merges of an earlier token with one byte symbol, in creation order
//                                (two-symbol tokens first, then three-symbol ones, ...): valid BPE merges
//   ids [first_added, +n)        the base tokenizer's added tokens, in their order (special flags kept)
//   ids after them, < vocab_size non-special added tokens "<|fill_N|>" (the padded embedding rows)
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::tok {

struct CoveringTokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
  int64_t first_added_id = 0;  // id of the first of the base tokenizer's added tokens
  int64_t num_merged = 0;      // merged (multi-symbol) vocabulary entries
  int64_t num_fill = 0;        // "<|fill_N|>" tokens after the added ones
};

// `first_added_id` < 0 puts the added tokens right before the fill so that the vocabulary ends exactly at
// vocab_size with no fill. kiln::Error when the numbers do not fit (vocab_size too small for 256 bytes +
// the added tokens, or first_added_id out of range).
CoveringTokenizerFiles make_covering_tokenizer(int64_t vocab_size, int64_t first_added_id,
                                               std::string_view base_tokenizer_json,
                                               std::string_view base_tokenizer_config_json);

}  // namespace kiln::tok
