// M-RoPE positions and frequency axes against transformers' definitions worked by hand (Qwen2-VL's get_rope_index
// docstring example, Qwen3-VL's apply_interleaved_mrope slices), not against the code under test.
#include "model/mrope.h"

#include <gtest/gtest.h>

#include "core/error.h"
#include "model/ops.h"

namespace kiln::model {
namespace {

std::vector<int32_t> axis(const MRopePositions& p, int a) {
  std::vector<int32_t> out;
  for (size_t i = a; i < p.pos.size(); i += 3) out.push_back(p.pos[i]);
  return out;
}

TEST(MRopePositions, TextOnlyIsTheIndexOnEveryAxis) {
  const MRopePositions p = mrope_positions(4, {});
  for (int a = 0; a < 3; ++a) EXPECT_EQ(axis(p, a), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(p.delta, 0);
}

TEST(MRopePositions, TransformersDocstringExample) {
  // Qwen2-VL's get_rope_index docstring: 12 vision tokens of a 3 x 2 x 2 grid, then 5 text tokens:
  // temporal 0 0 0 0 1 1 1 1 2 2 2 2, height 0 0 1 1 0 0 1 1 0 0 1 1, width 0 1 0 1 ..., text 3 4 5 6 7.
  const ImagePlacement im{0, 3, 2, 2};
  const MRopePositions p = mrope_positions(17, std::span<const ImagePlacement>(&im, 1));
  EXPECT_EQ(axis(p, 0), (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(axis(p, 1), (std::vector<int32_t>{0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 3, 4, 5, 6, 7}));
  EXPECT_EQ(axis(p, 2), (std::vector<int32_t>{0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 3, 4, 5, 6, 7}));
  EXPECT_EQ(p.delta, 8 - 17);  // the largest position is 7: the next token (index 17) sits at 8
}

TEST(MRopePositions, TextImageTextImage) {
  // "a b" | image 1 x 2 x 3 (6 tokens) at 2 | "c" | image 1 x 1 x 1 at 9 | "d"
  // text 0, 1; image base 2: t 2.., h 2 2 2 3 3 3, w 2 3 4 2 3 4; next text at 2 + 3 = 5: "c" 5;
  // image 2 base 6: (6, 6, 6); next text 7: "d" 7. Length 11, largest 7: delta = 8 - 11.
  const ImagePlacement ims[] = {{2, 1, 2, 3}, {9, 1, 1, 1}};
  const MRopePositions p = mrope_positions(11, ims);
  EXPECT_EQ(axis(p, 0), (std::vector<int32_t>{0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 7}));
  EXPECT_EQ(axis(p, 1), (std::vector<int32_t>{0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 7}));
  EXPECT_EQ(axis(p, 2), (std::vector<int32_t>{0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(p.delta, -3);
}

TEST(MRopePositions, BadPlacementsFail) {
  const ImagePlacement past_end{3, 1, 2, 2};
  EXPECT_THROW(mrope_positions(5, std::span<const ImagePlacement>(&past_end, 1)), Error);
  const ImagePlacement overlap[] = {{0, 1, 1, 2}, {1, 1, 1, 1}};
  EXPECT_THROW(mrope_positions(5, overlap), Error);
  const ImagePlacement empty{0, 1, 0, 2};
  EXPECT_THROW(mrope_positions(5, std::span<const ImagePlacement>(&empty, 1)), Error);
}

TEST(MRopeAxes, InterleavedQwen35Sections) {
  // apply_interleaved_mrope with mrope_section [11, 11, 10]: H takes slice(1, 33, 3), W slice(2, 30, 3), T the rest.
  const MRopeAxes a = MRopeAxes::from_sections({11, 11, 10}, true, 32);
  for (int i = 0; i < 32; ++i) {
    const int want = (i % 3 == 1 && i < 33) ? 1 : (i % 3 == 2 && i < 30) ? 2 : 0;
    EXPECT_EQ(a.axis(i), want) << "frequency " << i;
  }
  EXPECT_EQ(a.axis(30), 0);
  EXPECT_EQ(a.axis(31), 1);
}

TEST(MRopeAxes, ChunkedSectionsAndErrors) {
  const MRopeAxes a = MRopeAxes::from_sections({2, 1, 1}, false, 4);
  EXPECT_EQ(a.axis(0), 0);
  EXPECT_EQ(a.axis(1), 0);
  EXPECT_EQ(a.axis(2), 1);
  EXPECT_EQ(a.axis(3), 2);
  EXPECT_THROW(MRopeAxes::from_sections({11, 11, 11}, true, 32), Error);
  EXPECT_THROW(MRopeAxes::from_sections({16, 16}, true, 32), Error);
}

}  // namespace
}  // namespace kiln::model
