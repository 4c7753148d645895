#include "engine/image_inputs.h"

#include <algorithm>

#include "core/error.h"
#include "model/mrope.h"

namespace kiln::engine {

namespace {
// A 31-bit mix of (image hash, token index within the image): the prefix cache's id for that token, negative.
int32_t image_token_key(uint64_t hash, int64_t k) {
  uint64_t z = hash + static_cast<uint64_t>(k + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return -1 - static_cast<int32_t>(z & 0x7ffffffeull);
}
}  // namespace

void prepare_images(Sequence& seq, model::ModelRunner& runner) {
  std::vector<ImageInput>& images = seq.request.images;
  if (images.empty()) return;
  const int merge = runner.vision_merge_size();
  if (merge <= 0)
    fail("this model has no vision encoder loaded, so the request's {} image(s) cannot be read (a text-only "
         "checkpoint, or image inputs turned off with --limit-mm-per-prompt image=0)",
         images.size());
  const int64_t L = seq.prompt_len;
  std::vector<model::ImagePlacement> placements;
  for (size_t i = 0; i < images.size(); ++i) {
    const ImageInput& im = images[i];
    if (im.grid_t < 1 || im.grid_h < 1 || im.grid_w < 1 || im.grid_h % merge || im.grid_w % merge)
      fail("image {}: a grid of {} x {} x {} patches (height and width must be multiples of {})", i, im.grid_t,
           im.grid_h, im.grid_w, merge);
    placements.push_back({im.offset, im.grid_t, im.grid_h / merge, im.grid_w / merge});
  }
  const model::MRopePositions pos = model::mrope_positions(L, placements);  // checks order and bounds
  seq.mrope_pos = pos.pos;
  seq.rope_delta = pos.delta;
  seq.image_token_index.clear();
  seq.image_token_key.clear();
  seq.image_embeds.clear();
  for (size_t i = 0; i < images.size(); ++i) {
    ImageInput& im = images[i];
    std::vector<float> e = runner.encode_image(im.pixel_values, im.grid_t, im.grid_h, im.grid_w);
    const int64_t n = placements[i].tokens();
    if (n == 0 || e.size() % static_cast<size_t>(n) != 0)
      fail("image {}: the vision encoder returned {} values for {} tokens", i, e.size(), n);
    seq.image_embeds.insert(seq.image_embeds.end(), e.begin(), e.end());
    for (int64_t k = 0; k < n; ++k) {
      seq.image_token_index.push_back(static_cast<int32_t>(im.offset + k));
      seq.image_token_key.push_back(image_token_key(im.hash, k));
    }
    im.pixel_values = {};  // encoded: the sequence keeps the embeddings
  }
}

std::array<int32_t, 3> rope_position(const Sequence& seq, int64_t i) {
  if (i < static_cast<int64_t>(seq.mrope_pos.size() / 3))
    return {seq.mrope_pos[3 * i], seq.mrope_pos[3 * i + 1], seq.mrope_pos[3 * i + 2]};
  const int32_t p = static_cast<int32_t>(i + seq.rope_delta);
  return {p, p, p};
}

void attach_image_inputs(Sequence& seq, model::SeqChunk& ch) {
  if (!seq.has_images()) return;
  const int64_t start = ch.start_pos, n = static_cast<int64_t>(ch.tokens.size());
  seq.step_mrope_pos.resize(static_cast<size_t>(3 * n));
  for (int64_t t = 0; t < n; ++t) {
    const auto p = rope_position(seq, start + t);
    for (int a = 0; a < 3; ++a) seq.step_mrope_pos[static_cast<size_t>(3 * t + a)] = p[a];
  }
  ch.mrope_pos = seq.step_mrope_pos;
  if (start >= 1) ch.mrope_prev = rope_position(seq, start - 1);
  // The image tokens inside the chunk: a contiguous range of image_token_index (ascending).
  const auto& idx = seq.image_token_index;
  const auto lo = std::lower_bound(idx.begin(), idx.end(), static_cast<int32_t>(start));
  const auto hi = std::lower_bound(idx.begin(), idx.end(), static_cast<int32_t>(start + n));
  seq.step_embed_offsets.clear();
  for (auto it = lo; it != hi; ++it) seq.step_embed_offsets.push_back(static_cast<int32_t>(*it - start));
  ch.embed_offsets = seq.step_embed_offsets;
  if (lo == hi) {
    ch.embeds = {};
    return;
  }
  const size_t H = seq.image_embeds.size() / idx.size();
  ch.embeds = std::span<const float>(seq.image_embeds.data() + static_cast<size_t>(lo - idx.begin()) * H,
                                     static_cast<size_t>(hi - lo) * H);
}

std::span<const int32_t> cache_key(const Sequence& seq, std::vector<int32_t>& scratch) {
  if (!seq.has_images()) return seq.tokens;
  scratch = seq.tokens;
  for (size_t i = 0; i < seq.image_token_index.size(); ++i)
    if (seq.image_token_index[i] < static_cast<int32_t>(scratch.size()))
      scratch[static_cast<size_t>(seq.image_token_index[i])] = seq.image_token_key[i];
  return scratch;
}

}  // namespace kiln::engine
