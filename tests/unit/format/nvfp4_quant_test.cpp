// NVFP4 quantisation maths (format/nvfp4_quant.h): goldens from the independent Python reference
// (tools/tiny/nvfp4.py via tools/tiny/make_nvfp4_golden.py), rounding rules, packing, error bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/dtype.h"
#include "core/error.h"
#include "format/nvfp4_quant.h"

namespace {

using namespace kiln;
namespace nvfp4 = kiln::format::nvfp4;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

nlohmann::json load_golden() {
  std::ifstream f(std::string(KILN_SOURCE_DIR) + "/tests/fixtures/nvfp4_golden.json");
  EXPECT_TRUE(f.good()) << "missing nvfp4_golden.json (regenerate: python3 tools/tiny/make_nvfp4_golden.py)";
  std::stringstream ss;
  ss << f.rdbuf();
  return nlohmann::json::parse(ss.str());
}

TEST(Nvfp4, E2m1TiesGoToTheEvenCode) {
  // (value, code): midpoints between neighbours round to the code with an even index.
  const std::pair<float, uint8_t> cases[] = {
      {0.0f, 0}, {0.25f, 0}, {0.2500001f, 1}, {0.5f, 1}, {0.75f, 2}, {0.7499999f, 1}, {1.25f, 2}, {1.5f, 3},
      {1.75f, 4}, {2.5f, 4}, {3.0f, 5}, {3.5f, 6}, {5.0f, 6}, {5.0001f, 7}, {6.0f, 7}, {7.0f, 7}, {1e9f, 7},
      {-0.75f, 0xA}, {-5.0f, 0xE}, {-100.0f, 0xF}, {-0.0f, 0x8}, {-0.1f, 0x8},
  };
  for (auto [v, code] : cases) EXPECT_EQ(nvfp4::e2m1_code(v), code) << v;
}

TEST(Nvfp4, E2m1CodeAgreesWithCoreConversion) {
  // core/dtype's f32_to_e2m1 is a separate (frexp/nearbyint) implementation of the same rounding.
  for (int i = -8000; i <= 8000; ++i) {
    const float v = static_cast<float>(i) / 1024.0f;
    ASSERT_EQ(nvfp4::e2m1_code(v), f32_to_e2m1(v)) << v;
  }
  for (float mid : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f})
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 10.0f), -mid})
      ASSERT_EQ(nvfp4::e2m1_code(v), f32_to_e2m1(v)) << v;
}

TEST(Nvfp4, ScalarEncodingsMatchPythonReference) {
  auto g = load_golden();
  for (const auto& c : g["e4m3_cases_f32_bits_to_code"])
    EXPECT_EQ(f32_to_e4m3(from_bits(c[0].get<uint32_t>()), true), c[1].get<int>()) << from_bits(c[0].get<uint32_t>());
  for (const auto& c : g["e2m1_cases_f32_bits_to_code"])
    EXPECT_EQ(nvfp4::e2m1_code(from_bits(c[0].get<uint32_t>())), c[1].get<int>()) << from_bits(c[0].get<uint32_t>());
}

TEST(Nvfp4, MatricesMatchPythonReferenceByteForByte) {
  auto g = load_golden();
  ASSERT_GE(g["matrices"].size(), 2u);
  for (const auto& m : g["matrices"]) {
    SCOPED_TRACE(m["name"].get<std::string>());
    const int64_t n = m["n"], k = m["k"];
    std::vector<float> w;
    for (const auto& b : m["weight_bf16"]) w.push_back(bf16_to_f32(b.get<uint16_t>()));
    ASSERT_EQ(static_cast<int64_t>(w.size()), n * k);
    nvfp4::QuantizedLinear q = nvfp4::quantize(w, n, k);
    EXPECT_EQ(to_bits(q.weight_scale_2), m["weight_scale_2_f32_bits"].get<uint32_t>());
    EXPECT_EQ(q.scales, m["scales"].get<std::vector<uint8_t>>());
    EXPECT_EQ(q.packed, m["packed"].get<std::vector<uint8_t>>());
    std::vector<float> deq(static_cast<size_t>(n * k));
    nvfp4::dequantize(q.packed.data(), q.scales.data(), q.weight_scale_2, n, k, deq.data());
    const auto want = m["dequantized_f32_bits"].get<std::vector<uint32_t>>();
    for (size_t i = 0; i < deq.size(); ++i) ASSERT_EQ(to_bits(deq[i]), want[i]) << "element " << i;
  }
}

TEST(Nvfp4, ElementTwoIIsTheLowNibble) {
  // One row: amax 6 * 448 * 2^-12 in element 0 (code 7), -0.5 units in element 1 (code 0x9).
  std::vector<float> w(16, 0.0f);
  const float unit = 448.0f * std::ldexp(1.0f, -12);
  w[0] = 6 * unit;
  w[1] = -0.5f * unit;
  w[2] = 3 * unit;  // code 5
  w[3] = 1 * unit;  // code 2
  nvfp4::QuantizedLinear q = nvfp4::quantize(w, 1, 16);
  EXPECT_EQ(q.weight_scale_2, std::ldexp(1.0f, -12));
  ASSERT_EQ(q.scales.size(), 1u);
  EXPECT_EQ(q.scales[0], 0x7e);  // 448
  EXPECT_EQ(q.packed[0], 0x97);
  EXPECT_EQ(q.packed[1], 0x25);
}

TEST(Nvfp4, ZeroTensorStaysZero) {
  std::vector<float> w(64, 0.0f);
  nvfp4::QuantizedLinear q = nvfp4::quantize(w, 2, 32);
  EXPECT_EQ(q.weight_scale_2, 0.0f);
  for (auto s : q.scales) EXPECT_EQ(s, 0);
  for (auto p : q.packed) EXPECT_EQ(p, 0);
  std::vector<float> deq(64, 1.0f);
  nvfp4::dequantize(q.packed.data(), q.scales.data(), q.weight_scale_2, 2, 32, deq.data());
  for (float v : deq) EXPECT_EQ(v, 0.0f);
}

TEST(Nvfp4, RejectsBadInput) {
  std::vector<float> w(24, 0.5f);
  EXPECT_THROW(nvfp4::quantize(w, 1, 24), Error);  // K not a multiple of 16
  std::vector<float> bad(16, 0.5f);
  bad[3] = std::nanf("");
  EXPECT_THROW(nvfp4::quantize(bad, 1, 16), Error);
  bad[3] = INFINITY;
  EXPECT_THROW(nvfp4::quantize(bad, 1, 16), Error);
}

// Round-trip error bound. Let s = float(e4m3 block scale) * weight_scale_2 (the block's step unit) and
// t = |w| / s. Without saturation, round-to-nearest on the E2M1 grid errs by at most half the grid spacing
// around t: 0.25 for t <= 2, 0.5 for t <= 4, 1 for t <= 6, so |w - deq| <= h(t) * s. Saturation: the block
// scale is amax_b / 6 / weight_scale_2 rounded to E4M3; for a normal E4M3 value the rounding is within
// 2^-4 relative, so t <= 6 / (1 - 2^-4) = 6.4 and the clipped element errs by at most 0.4 * s < 1 * s.
// For a subnormal E4M3 scale (scale < 2^-6) the absolute rounding is 2^-10, so t <= 6 * scale_f /
// (scale_f - 2^-10); the bound there is max(h(t), t - 6) * s. The float32 arithmetic adds a few ulps.
TEST(Nvfp4, RoundTripErrorWithinDerivedBound) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t n = 8, k = 64;
    std::vector<float> w(static_cast<size_t>(n * k));
    std::normal_distribution<float> dist(0.0f, 0.02f);
    std::uniform_real_distribution<float> mag(-6.0f, 1.0f);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t b = 0; b < k / 16; ++b) {
        const float block_mag = std::pow(10.0f, mag(rng));  // blocks over 7 decades, incl. subnormal scales
        for (int64_t i = 0; i < 16; ++i) w[r * k + b * 16 + i] = bf16_to_f32(f32_to_bf16(dist(rng) * block_mag));
      }
    if (trial % 5 == 0) w[trial] = 3.0f;  // an outlier that sets amax
    nvfp4::QuantizedLinear q = nvfp4::quantize(w, n, k);
    std::vector<float> deq(w.size());
    nvfp4::dequantize(q.packed.data(), q.scales.data(), q.weight_scale_2, n, k, deq.data());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t b = 0; b < k / 16; ++b) {
        const uint8_t code = q.scales[r * (k / 16) + b];
        const float scale_dec = e4m3_to_f32(code);
        const float s = scale_dec * q.weight_scale_2;
        float bmax = 0;
        for (int64_t i = 0; i < 16; ++i) bmax = std::fmax(bmax, std::fabs(w[r * k + b * 16 + i]));
        const float scale_f = (bmax / 6.0f) / q.weight_scale_2;
        if (scale_f >= std::ldexp(1.0f, -6)) {
          EXPECT_LE(std::fabs(scale_dec - scale_f), scale_f * 0.0625f * 1.0001f) << "normal e4m3 rounding";
        } else {
          EXPECT_LE(std::fabs(scale_dec - scale_f), std::ldexp(1.0f, -10) * 1.0001f) << "subnormal e4m3 rounding";
        }
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t at = r * k + b * 16 + i;
          const float err = std::fabs(w[at] - deq[at]);
          if (s == 0.0f) {
            // The scale encodes to zero only when scale_f <= 2^-10, i.e. bmax <= 6 * 2^-10 * weight_scale_2.
            EXPECT_LE(std::fabs(w[at]), 6 * std::ldexp(1.0f, -10) * q.weight_scale_2 * 1.0001f);
            continue;
          }
          const float t = std::fabs(w[at]) / s;
          const float half_step = t <= 2 ? 0.25f : t <= 4 ? 0.5f : 1.0f;
          const float bound = std::fmax(half_step, t - 6.0f) * s;
          EXPECT_LE(err, bound * (1 + 1e-5f) + 1e-30f) << "w " << w[at] << " deq " << deq[at] << " t " << t;
          if (scale_f >= std::ldexp(1.0f, -6)) EXPECT_LE(t, 6.4f * 1.0001f);
        }
      }
  }
}

}  // namespace
