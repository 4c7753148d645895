// Image inputs in the engine: a prompt's images encoded once when the engine takes the sequence, then each step's
// chunks given their M-RoPE positions and image embeddings, and the prefix cache keyed by image content.
//
// Encoding runs on the engine thread (it owns the model) through ModelRunner::encode_image; the embeddings stay with
// the sequence (a preempted sequence prefills its image tokens again from them). A text-only sequence is untouched:
// its chunks carry no M-RoPE positions, so its steps are exactly those of a text server.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/scheduler.h"
#include "model/model_runner.h"

namespace kiln::engine {

// Validates seq.request.images against the prompt and the runner (placeholder runs in order, inside the prompt, grids
// that merge), encodes every image, fills seq's image fields and frees the pixel values. kiln::Error when the model
// has no vision encoder or an image is malformed.
void prepare_images(Sequence& seq, model::ModelRunner& runner);

// The rope position (t, h, w) of token index i of a sequence with images (i >= prompt length: i + rope_delta).
std::array<int32_t, 3> rope_position(const Sequence& seq, int64_t i);

// Fills a chunk of seq's tokens [ch.start_pos, ch.start_pos + ch.tokens.size()) with its M-RoPE positions (in
// seq.step_mrope_pos) and the embeddings of the image tokens among them. Nothing for a text-only sequence.
void attach_image_inputs(Sequence& seq, model::SeqChunk& ch);

// The ids the prefix cache keys seq's tokens by: seq.tokens, with image tokens replaced by their content keys
// (scratch holds the copy when there are images).
std::span<const int32_t> cache_key(const Sequence& seq, std::vector<int32_t>& scratch);

}  // namespace kiln::engine
