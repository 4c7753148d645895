// The device random fill (fill.cu) against model::fill_random_host, byte for byte. Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "model/ops.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

TEST(CudaOps, RandomFillIsTheHostsBytes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  struct Case {
    DType dtype;
    model::RandomFill fill;
  };
  std::vector<Case> cases;
  model::RandomFill f;
  f.kind = model::RandomFill::Kind::bytes;
  f.seed = 11;
  cases.push_back({DType::U8, f});
  f.byte_lo = 0x28;
  f.byte_hi = 0x48;
  f.random_sign = true;
  cases.push_back({DType::F8_E4M3, f});
  f = model::RandomFill();
  f.lo = -0.0383f;
  f.hi = 0.0383f;
  f.seed = 12;
  for (DType d : {DType::F32, DType::BF16, DType::F16}) cases.push_back({d, f});
  for (const Case& c : cases) {
    const int64_t n = 1000003;
    const TensorView dev = gpu.place_random(c.dtype, Shape{n}, c.fill);
    std::vector<uint8_t> got(n * dtype_size(c.dtype)), want(got.size());
    gpu.download(dev, got.data());
    model::fill_random_host(c.dtype, n, c.fill, want.data());
    EXPECT_EQ(got, want) << dtype_name(c.dtype);
  }
}

}  // namespace
}  // namespace kiln::backend::cuda
