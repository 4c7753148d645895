// NVFP4 W4A16 linear (GEMV and GEMM paths) against the CPU reference on random data.
// Tolerance: ||out - ref|| / ||ref|| < 6e-3. The weights are exact in bf16 and accumulate in fp32,
// so the error is the final bf16 rounding of the output (~1.5e-3 rms).
#include <gtest/gtest.h>

#include "backend/cuda/kernels.h"
#include "cuda_test_util.h"

namespace kiln::cuda {
namespace {

using namespace test;

struct HostNvfp4 {
  int n = 0, k = 0;
  std::vector<uint8_t> codes, scales;
  float global_scale = 1.0f;
};

HostNvfp4 random_nvfp4(int n, int k) {
  HostNvfp4 w;
  w.n = n;
  w.k = k;
  w.codes = random_bytes(size_t(n) * k / 2);
  w.scales = random_e4m3_scales(size_t(n) * k / 16);
  w.global_scale = random_f32(1, 0.002f, 0.02f)[0];
  return w;
}

struct LinearCase {
  int n, k, m;
  int ldx_pad;
  Nvfp4Path path;
};

double run_linear(const HostNvfp4& hw, int m, int ldx_pad, Nvfp4Path path) {
  const int n = hw.n, k = hw.k, ldx = k + ldx_pad;
  const auto x = random_bf16(size_t(m) * ldx);
  DeviceBuffer d_codes = upload(hw.codes), d_scales = upload(hw.scales), d_x = upload(x);
  DeviceBuffer d_out = poisoned(size_t(m) * n * 2);
  Nvfp4Weight w{d_codes.as<uint8_t>(), d_scales.as<uint8_t>(), hw.global_scale};
  nvfp4_linear(w, n, k, d_x.as<uint16_t>(), ldx, m, d_out.as<uint16_t>(), n, nullptr, path);
  const auto out = bf16_to_float(download<uint16_t>(d_out, size_t(m) * n));
  const auto wd = ref::nvfp4_dequant(hw.codes.data(), hw.scales.data(), hw.global_scale, n, k);
  const auto expect = ref::linear(x.data(), ldx, wd.data(), m, n, k);
  return rel_err(out, expect);
}

class CudaNvfp4Linear : public ::testing::TestWithParam<LinearCase> {};

TEST_P(CudaNvfp4Linear, MatchesReference) {
  KILN_REQUIRE_GPU();
  const LinearCase c = GetParam();
  const double err = run_linear(random_nvfp4(c.n, c.k), c.m, c.ldx_pad, c.path);
  KILN_EXPECT_ERR(err, 6e-3, "nvfp4 linear n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
                                 " m=" + std::to_string(c.m) + " " + nvfp4_path_name(c.path));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaNvfp4Linear,
                         ::testing::Values(LinearCase{16, 128, 1, 0, Nvfp4Path::kGemv},
                                           LinearCase{64, 256, 3, 8, Nvfp4Path::kGemv},
                                           LinearCase{256, 2048, 8, 0, Nvfp4Path::kGemv},
                                           LinearCase{1024, 2048, 1, 0, Nvfp4Path::kGemv},
                                           LinearCase{2048, 512, 5, 0, Nvfp4Path::kGemv},
                                           LinearCase{128, 1024, 17, 0, Nvfp4Path::kGemv},
                                           LinearCase{48, 384, 12, 16, Nvfp4Path::kGemv},
                                           LinearCase{128, 128, 1, 0, Nvfp4Path::kGemm},
                                           LinearCase{256, 512, 130, 8, Nvfp4Path::kGemm},
                                           LinearCase{384, 1024, 300, 0, Nvfp4Path::kGemm},
                                           LinearCase{128, 2048, 64, 0, Nvfp4Path::kGemm},
                                           LinearCase{256, 256, 40, 0, Nvfp4Path::kAuto}));

// Every finite E4M3 scale (subnormals included) and every E2M1 code, through both paths.
TEST(CudaNvfp4, AllScalesAndCodes) {
  KILN_REQUIRE_GPU();
  for (Nvfp4Path path : {Nvfp4Path::kGemv, Nvfp4Path::kGemm}) {
    HostNvfp4 w = random_nvfp4(128, 1024);
    for (size_t i = 0; i < w.scales.size(); ++i) w.scales[i] = static_cast<uint8_t>(1 + i % 126);  // 0x01..0x7e
    for (size_t i = 0; i < w.codes.size(); ++i) w.codes[i] = static_cast<uint8_t>(i * 37 + i / 256);
    const double err = run_linear(w, 4, 0, path);
    KILN_EXPECT_ERR(err, 6e-3, std::string("nvfp4 all scales/codes ") + nvfp4_path_name(path));
  }
}

TEST(CudaNvfp4, RejectsUnsupportedShapes) {
  KILN_REQUIRE_GPU();
  Nvfp4Weight w;
  EXPECT_THROW(nvfp4_linear(w, 16, 100, nullptr, 100, 1, nullptr, 16, nullptr, Nvfp4Path::kGemv), Error);
  EXPECT_THROW(nvfp4_linear(w, 100, 128, nullptr, 128, 200, nullptr, 100, nullptr, Nvfp4Path::kGemm), Error);
}

}  // namespace
}  // namespace kiln::cuda
