// M-RoPE positions of a prompt with images (Qwen2-VL / Qwen3-VL / Qwen3.5): transformers' get_rope_index for one
// sequence, from where the image placeholder runs are instead of scanning the token ids.
//
// Text tokens get three equal positions, counting on from the previous token. An image's placeholder run of
// t x h x w merged patches (grid_thw / (1, merge, merge)) starts at base = the next text position and gives patch
// (i, j, k), in that order (time outer, then rows, then columns), the positions (base + i, base + j, base + k); the
// text after it continues at base + max(t, h, w). Every token after the prompt sits at its index + delta on all three
// axes, delta = (the prompt's largest position + 1) - prompt length (<= 0).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace kiln::model {

// One image's placeholder run in the prompt: `offset` is the index of its first placeholder token; t, h, w are the
// MERGED grid (the LLM grid: grid_thw with h and w divided by the spatial merge size), t x h x w placeholders.
struct ImagePlacement {
  int64_t offset = 0;
  int64_t t = 1, h = 1, w = 1;
  int64_t tokens() const { return t * h * w; }
};

struct MRopePositions {
  std::vector<int32_t> pos;  // [prompt length * 3] (t, h, w) per token
  int32_t delta = 0;         // rope position of index i >= prompt length: i + delta
};

// Fails (kiln::Error) when runs overlap, are out of order or leave the prompt.
MRopePositions mrope_positions(int64_t prompt_length, std::span<const ImagePlacement> images);

}  // namespace kiln::model
