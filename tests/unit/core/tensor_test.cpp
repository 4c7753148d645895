// Shape, TensorView and Buffer.
#include "core/tensor.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace kiln {
namespace {

TEST(Shape, Basics) {
  Shape s{2, 3, 4};
  EXPECT_EQ(s.ndim, 3);
  EXPECT_EQ(s.numel(), 24);
  EXPECT_EQ(s[0], 2);
  EXPECT_EQ(s[-1], 4);
  EXPECT_EQ(s[-3], 2);
  EXPECT_EQ(s.str(), "[2, 3, 4]");
  EXPECT_EQ(s.vec(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(Shape::from({2, 3, 4}), s);
  EXPECT_NE((Shape{2, 3}), s);
  EXPECT_NE((Shape{2, 3, 5}), s);
  s[1] = 5;
  EXPECT_EQ(s.numel(), 40);
  Shape scalar;
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_EQ(scalar.numel(), 1);  // a scalar holds one element
  EXPECT_EQ(scalar.str(), "[]");
  EXPECT_EQ((Shape{0, 5}).numel(), 0);
  EXPECT_THROW(Shape::from(std::vector<int64_t>(9, 1)), InternalError);
  EXPECT_THROW((Shape{1, 1, 1, 1, 1, 1, 1, 1, 1}), InternalError);
}

TEST(TensorView, ContiguousStridesAndRows) {
  std::vector<uint16_t> data(2 * 3 * 4);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint16_t>(i);
  TensorView v(data.data(), DType::BF16, Shape{2, 3, 4});
  EXPECT_EQ(v.ndim(), 3);
  EXPECT_EQ(v.dim(1), 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.nbytes(), 48u);
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.strides[1], 4);
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_TRUE(v.is_contiguous());
  TensorView r = v.row(1);  // [3, 4] starting at element 12
  EXPECT_EQ(r.shape, (Shape{3, 4}));
  EXPECT_EQ(r.ptr<uint16_t>()[0], 12);
  EXPECT_EQ(r.strides[0], 4);
  EXPECT_TRUE(r.is_contiguous());
  TensorView rr = r.row(2);  // [4] starting at element 12 + 8
  EXPECT_EQ(rr.ptr<uint16_t>()[3], 23);
  EXPECT_EQ(rr.shape, (Shape{4}));

  // A transposed view is not contiguous; size-1 dims never break contiguity.
  TensorView t = v;
  std::swap(t.shape.dims[1], t.shape.dims[2]);
  std::swap(t.strides[1], t.strides[2]);
  EXPECT_FALSE(t.is_contiguous());
  TensorView ones(data.data(), DType::BF16, Shape{1, 24, 1});
  ones.strides[0] = 999;
  ones.strides[2] = 7;
  EXPECT_TRUE(ones.is_contiguous());
}

TEST(Buffer, AlignedOwningAndMovable) {
  Buffer b(100);
  EXPECT_EQ(b.size(), 100u);
  ASSERT_NE(b.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 64, 0u);
  b.as<uint8_t>()[99] = 7;
  Buffer c(std::move(b));
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.size(), 0u);
  EXPECT_EQ(c.as<uint8_t>()[99], 7);
  Buffer d;
  d = std::move(c);
  EXPECT_EQ(d.as<uint8_t>()[99], 7);
  EXPECT_EQ(c.data(), nullptr);
  Buffer empty(0);
  EXPECT_EQ(empty.data(), nullptr);
}

}  // namespace
}  // namespace kiln
