#include "model/mrope.h"

#include <algorithm>

#include "core/error.h"

namespace kiln::model {

MRopePositions mrope_positions(int64_t prompt_length, std::span<const ImagePlacement> images) {
  MRopePositions r;
  r.pos.reserve(static_cast<size_t>(prompt_length) * 3);
  int64_t cur = 0;   // next token index to place
  int64_t next = 0;  // the next text position
  auto text_until = [&](int64_t end) {
    for (; cur < end; ++cur, ++next)
      for (int a = 0; a < 3; ++a) r.pos.push_back(static_cast<int32_t>(next));
  };
  for (const ImagePlacement& im : images) {
    if (im.t < 1 || im.h < 1 || im.w < 1)
      fail("image placement: grid {} x {} x {} (each at least 1)", im.t, im.h, im.w);
    if (im.offset < cur || im.offset + im.tokens() > prompt_length)
      fail("image placement: tokens [{}, {}) overlap the previous image or leave the prompt of {} tokens", im.offset,
           im.offset + im.tokens(), prompt_length);
    text_until(im.offset);
    const int64_t base = next;
    for (int64_t i = 0; i < im.t; ++i)
      for (int64_t j = 0; j < im.h; ++j)
        for (int64_t k = 0; k < im.w; ++k) {
          r.pos.push_back(static_cast<int32_t>(base + i));
          r.pos.push_back(static_cast<int32_t>(base + j));
          r.pos.push_back(static_cast<int32_t>(base + k));
        }
    cur += im.tokens();
    next = base + std::max({im.t, im.h, im.w});
  }
  text_until(prompt_length);
  r.delta = static_cast<int32_t>(next - prompt_length);
  return r;
}

}  // namespace kiln::model
