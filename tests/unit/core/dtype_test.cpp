// Exhaustive tests of the element-type conversions in core/dtype.h. Expected values are computed here
// from the format definitions (IEEE 754 binary16 / bfloat16, OCP 8-bit FP E4M3FN / E5M2, OCP MX E2M1,
// E8M0) with std::ldexp, independently of the code under test.
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace kiln {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
bool same_float(float a, float b) {  // bitwise, so +0 != -0; NaN == NaN
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return bits_of(a) == bits_of(b);
}

// A binary floating-point format with `ebits` exponent and `mbits` mantissa bits.
struct Format {
  const char* name;
  int ebits, mbits, bias;
  enum Special { ieee, e4m3fn, none } special;  // ieee: top exponent is inf/NaN; e4m3fn: only S.1111.111 is NaN
};
constexpr Format kBF16{"bf16", 8, 7, 127, Format::ieee};
constexpr Format kF16{"f16", 5, 10, 15, Format::ieee};
constexpr Format kE4M3{"e4m3", 4, 3, 7, Format::e4m3fn};
constexpr Format kE5M2{"e5m2", 5, 2, 15, Format::ieee};
constexpr Format kE2M1{"e2m1", 2, 1, 1, Format::none};

// The value of `code` in format `f`, from the definition.
double reference_value(const Format& f, uint32_t code) {
  const uint32_t sign = (code >> (f.ebits + f.mbits)) & 1;
  const uint32_t e = (code >> f.mbits) & ((1u << f.ebits) - 1);
  const uint32_t m = code & ((1u << f.mbits) - 1);
  const uint32_t emax_field = (1u << f.ebits) - 1;
  double v;
  if (f.special == Format::ieee && e == emax_field) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (f.special == Format::e4m3fn && e == emax_field && m == (1u << f.mbits) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - f.bias - f.mbits);  // subnormal: 0.m x 2^(1-bias)
  } else {
    v = std::ldexp(static_cast<double>((1u << f.mbits) | m), static_cast<int>(e) - f.bias - f.mbits);  // 1.m x 2^(e-bias)
  }
  return sign ? -v : v;
}

// Non-negative finite codes sorted by value (their codes are consecutive integers from 0).
std::vector<uint32_t> finite_positive_codes(const Format& f) {
  std::vector<uint32_t> codes;
  const uint32_t n = 1u << (f.ebits + f.mbits);
  for (uint32_t c = 0; c < n; ++c) {
    double v = reference_value(f, c);
    if (std::isfinite(v)) codes.push_back(c);
  }
  for (size_t i = 1; i < codes.size(); ++i) {
    EXPECT_EQ(codes[i], codes[i - 1] + 1);
    EXPECT_LT(reference_value(f, codes[i - 1]), reference_value(f, codes[i]));
  }
  return codes;
}

// ---- decode: every code ----

TEST(DType, Bf16DecodeAllCodes) {
  for (uint32_t c = 0; c < 65536; ++c)
    ASSERT_TRUE(same_float(bf16_to_f32(static_cast<uint16_t>(c)), static_cast<float>(reference_value(kBF16, c))))
        << std::hex << c;
}

TEST(DType, F16DecodeAllCodes) {
  for (uint32_t c = 0; c < 65536; ++c)
    ASSERT_TRUE(same_float(f16_to_f32(static_cast<uint16_t>(c)), static_cast<float>(reference_value(kF16, c))))
        << std::hex << c;
}

TEST(DType, E4M3DecodeAllCodes) {
  for (uint32_t c = 0; c < 256; ++c)
    EXPECT_TRUE(same_float(e4m3_to_f32(static_cast<uint8_t>(c)), static_cast<float>(reference_value(kE4M3, c))))
        << std::hex << c;
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
  EXPECT_EQ(e4m3_to_f32(0x78), 256.0f);  // S.1111.000 is a number in E4M3FN, not inf
}

TEST(DType, E5M2DecodeAllCodes) {
  for (uint32_t c = 0; c < 256; ++c)
    EXPECT_TRUE(same_float(e5m2_to_f32(static_cast<uint8_t>(c)), static_cast<float>(reference_value(kE5M2, c))))
        << std::hex << c;
  EXPECT_EQ(e5m2_to_f32(0x7b), 57344.0f);
  EXPECT_EQ(e5m2_to_f32(0x7c), kInf);
  EXPECT_EQ(e5m2_to_f32(0xfc), -kInf);
  EXPECT_EQ(e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
}

TEST(DType, E2M1DecodeAllCodes) {
  const float table[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};  // REFERENCE §2
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_TRUE(same_float(e2m1_to_f32(static_cast<uint8_t>(c)), static_cast<float>(reference_value(kE2M1, c)))) << c;
    EXPECT_EQ(std::fabs(e2m1_to_f32(static_cast<uint8_t>(c))), table[c & 7]);
    EXPECT_EQ(std::signbit(e2m1_to_f32(static_cast<uint8_t>(c))), c >= 8);
  }
  EXPECT_EQ(e2m1_to_f32(0x17), 6.0f);  // only the low nibble counts
}

TEST(DType, E8M0DecodeAllCodes) {
  for (uint32_t c = 0; c < 255; ++c) EXPECT_EQ(e8m0_to_f32(static_cast<uint8_t>(c)), std::ldexp(1.0f, int(c) - 127)) << c;
  EXPECT_TRUE(std::isnan(e8m0_to_f32(0xff)));
}

// ---- encode: round trip of every code, then every rounding midpoint ----

// Encoders under test, with the overflow behaviour each one documents.
struct Codec {
  Format f;
  uint32_t (*encode)(float);
  float (*decode)(uint32_t);
  uint32_t nan_code_mask;  // code bits that must be set for NaN results (checked via decode)
  // The code `x` overflowing (beyond the largest finite, after rounding) must give, by sign.
  uint32_t overflow_pos, overflow_neg;
};

uint32_t enc_bf16(float f) { return f32_to_bf16(f); }
uint32_t enc_f16(float f) { return f32_to_f16(f); }
uint32_t enc_e4m3_sat(float f) { return f32_to_e4m3(f, true); }
uint32_t enc_e4m3_nosat(float f) { return f32_to_e4m3(f, false); }
uint32_t enc_e5m2_sat(float f) { return f32_to_e5m2(f, true); }
uint32_t enc_e5m2_nosat(float f) { return f32_to_e5m2(f, false); }
uint32_t enc_e2m1(float f) { return f32_to_e2m1(f); }
float dec_bf16(uint32_t c) { return bf16_to_f32(static_cast<uint16_t>(c)); }
float dec_f16(uint32_t c) { return f16_to_f32(static_cast<uint16_t>(c)); }
float dec_e4m3(uint32_t c) { return e4m3_to_f32(static_cast<uint8_t>(c)); }
float dec_e5m2(uint32_t c) { return e5m2_to_f32(static_cast<uint8_t>(c)); }
float dec_e2m1(uint32_t c) { return e2m1_to_f32(static_cast<uint8_t>(c)); }

// Header comment: bf16/f16 overflow to inf; e4m3/e5m2 saturate to +-max (or NaN / inf when not
// saturating); e2m1 saturates at 6.
const Codec kCodecs[] = {
    {kBF16, enc_bf16, dec_bf16, 0, 0x7f80, 0xff80},
    {kF16, enc_f16, dec_f16, 0, 0x7c00, 0xfc00},
    {kE4M3, enc_e4m3_sat, dec_e4m3, 0, 0x7e, 0xfe},
    {kE4M3, enc_e4m3_nosat, dec_e4m3, 0, 0x7f, 0xff},
    {kE5M2, enc_e5m2_sat, dec_e5m2, 0, 0x7b, 0xfb},
    {kE5M2, enc_e5m2_nosat, dec_e5m2, 0, 0x7c, 0xfc},
    {kE2M1, enc_e2m1, dec_e2m1, 0, 0x7, 0xf},
};

std::string codec_name(const Codec& c, size_t i) { return std::string(c.f.name) + " #" + std::to_string(i); }

TEST(DType, EncodeRoundTripsEveryCode) {
  for (size_t k = 0; k < std::size(kCodecs); ++k) {
    const Codec& c = kCodecs[k];
    SCOPED_TRACE(codec_name(c, k));
    const uint32_t n = 1u << (1 + c.f.ebits + c.f.mbits);
    for (uint32_t code = 0; code < n; ++code) {
      const double v = reference_value(c.f, code);
      const uint32_t back = c.encode(static_cast<float>(v));
      if (std::isnan(v)) {
        ASSERT_TRUE(std::isnan(c.decode(back))) << std::hex << code << " -> " << back;  // NaN stays NaN
      } else if (std::isinf(v)) {
        ASSERT_EQ(back, v > 0 ? c.overflow_pos : c.overflow_neg);  // inf is kept, or saturates to max
      } else {
        ASSERT_EQ(back, code) << std::hex << "value " << v;
      }
    }
  }
}

// RNE: exactly between two neighbours goes to the even code; one f32 ulp either side goes to the nearer.
TEST(DType, EncodeRoundsToNearestEvenAtEveryMidpoint) {
  for (size_t k = 0; k < std::size(kCodecs); ++k) {
    const Codec& c = kCodecs[k];
    SCOPED_TRACE(codec_name(c, k));
    const auto codes = finite_positive_codes(c.f);
    const uint32_t sign_bit = 1u << (c.f.ebits + c.f.mbits);
    for (size_t i = 0; i + 1 < codes.size(); ++i) {
      const double lo = reference_value(c.f, codes[i]), hi = reference_value(c.f, codes[i + 1]);
      const double mid_d = (lo + hi) / 2;
      const float mid = static_cast<float>(mid_d);
      ASSERT_EQ(static_cast<double>(mid), mid_d) << "midpoint not exact in f32";
      const uint32_t even = codes[i] % 2 == 0 ? codes[i] : codes[i + 1];
      for (int s = 0; s < 2; ++s) {
        const float sg = s ? -1.0f : 1.0f;
        const uint32_t sb = s ? sign_bit : 0;
        ASSERT_EQ(c.encode(sg * mid), even | sb) << "midpoint " << sg * mid;
        ASSERT_EQ(c.encode(sg * std::nextafter(mid, 0.0f)), codes[i] | sb) << "below " << sg * mid;
        ASSERT_EQ(c.encode(sg * std::nextafter(mid, kInf)), codes[i + 1] | sb) << "above " << sg * mid;
      }
    }
  }
}

// Beyond the largest finite value: half an ulp of the format above max is the rounding boundary.
TEST(DType, OverflowAndSaturation) {
  for (size_t k = 0; k < std::size(kCodecs); ++k) {
    const Codec& c = kCodecs[k];
    SCOPED_TRACE(codec_name(c, k));
    const auto codes = finite_positive_codes(c.f);
    const uint32_t max_code = codes.back();
    const double max = reference_value(c.f, max_code);
    const double ulp = max - reference_value(c.f, codes[codes.size() - 2]);
    // Exactly max + ulp/2: ties to even. The would-be next code (max_code + 1) is even when max_code is odd.
    const float boundary = static_cast<float>(max + ulp / 2);
    const bool tie_goes_up = max_code % 2 == 1;
    EXPECT_EQ(c.encode(std::nextafter(boundary, 0.0f)), max_code);
    EXPECT_EQ(c.encode(boundary), tie_goes_up ? c.overflow_pos : max_code);
    EXPECT_EQ(c.encode(std::nextafter(boundary, kInf)), c.overflow_pos);
    EXPECT_EQ(c.encode(-std::nextafter(boundary, kInf)), c.overflow_neg);
    EXPECT_EQ(c.encode(std::numeric_limits<float>::max()), c.overflow_pos);
    EXPECT_EQ(c.encode(-std::numeric_limits<float>::max()), c.overflow_neg);
    if (c.f.special != Format::none) {
      // inf: ieee formats keep it (bf16, f16, e5m2 non-saturating) or saturate; e4m3 has no inf.
      EXPECT_EQ(c.encode(kInf), c.overflow_pos);
      EXPECT_EQ(c.encode(-kInf), c.overflow_neg);
    }
  }
  // The documented results, spelled out.
  EXPECT_EQ(f32_to_e4m3(464.0f), 0x7e);  // tie between 448 (even) and 480 (not representable)
  EXPECT_EQ(f32_to_e4m3(1e6f), 0x7e);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(f32_to_e4m3(1e6f, false))));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(f32_to_e4m3(kInf, false))));
  EXPECT_EQ(f32_to_e4m3(kInf), 0x7e);
  EXPECT_EQ(f32_to_e5m2(1e6f), 0x7b);
  EXPECT_EQ(f32_to_e5m2(1e6f, false), 0x7c);
  EXPECT_EQ(f32_to_e5m2(61440.0f, false), 0x7c);  // tie between 57344 (odd code) and 65536 (inf, even)
  EXPECT_EQ(f32_to_e5m2(61440.0f, true), 0x7b);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(65519.996f), 0x7bff);
  EXPECT_EQ(f32_to_e2m1(7.0f), 0x7);
  EXPECT_EQ(f32_to_e2m1(-100.0f), 0xf);
  EXPECT_EQ(f32_to_e2m1(kInf), 0x7);
}

TEST(DType, NaNStaysNaN) {
  const float nans[] = {kNaN, -kNaN, std::numeric_limits<float>::signaling_NaN()};
  for (float n : nans) {
    EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(n))));
    EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(n))));
    EXPECT_TRUE(std::isnan(e4m3_to_f32(f32_to_e4m3(n))));
    EXPECT_TRUE(std::isnan(e4m3_to_f32(f32_to_e4m3(n, false))));
    EXPECT_TRUE(std::isnan(e5m2_to_f32(f32_to_e5m2(n))));
  }
  // Every f32 NaN payload (high bits) survives bf16 as NaN, including ones whose top 7 mantissa bits are 0.
  for (uint32_t payload : {1u, 0x3fu, 0xffffu, 0x10000u, 0x400000u, 0x7fffffu}) {
    uint32_t u = 0x7f800000u | payload;
    float f;
    std::memcpy(&f, &u, 4);
    EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f)))) << std::hex << payload;
  }
}

TEST(DType, SignedZeroAndTinyValues) {
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e5m2(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e2m1(-0.0f), 0x8);
  // Below half the smallest subnormal: rounds to (signed) zero.
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -11)), 0x00);
  EXPECT_EQ(f32_to_e4m3(-std::ldexp(1.0f, -11)), 0x80);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);
  EXPECT_EQ(f32_to_e2m1(0.25f), 0x0);
  EXPECT_EQ(f32_to_e2m1(0.2500001f), 0x1);
  // f32 subnormals into bf16 (same exponent range).
  EXPECT_EQ(f32_to_bf16(std::ldexp(1.0f, -133)), 0x0001);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
}

// bf16 <- f32 for a sweep of random f32 bit patterns against a reference RNE written on integers.
TEST(DType, Bf16EncodeMatchesIntegerReferenceOnRandomInputs) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 200000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t u = static_cast<uint32_t>(state >> 32);
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f)) continue;
    const uint32_t lower = u & 0xffff, upper = u >> 16;
    uint32_t expect = upper;
    if (lower > 0x8000 || (lower == 0x8000 && (upper & 1))) ++expect;  // RNE; carries into exponent (-> inf) fine
    ASSERT_EQ(f32_to_bf16(f), static_cast<uint16_t>(expect)) << std::hex << u;
  }
}

TEST(DType, NamesSizesAndLoad) {
  struct Row {
    DType t;
    const char* name;
    size_t size;
  };
  const Row rows[] = {{DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},       {DType::I8, "I8", 1},
                      {DType::U16, "U16", 2},   {DType::I16, "I16", 2},     {DType::U32, "U32", 4},
                      {DType::I32, "I32", 4},   {DType::U64, "U64", 8},     {DType::I64, "I64", 8},
                      {DType::F16, "F16", 2},   {DType::BF16, "BF16", 2},   {DType::F32, "F32", 4},
                      {DType::F64, "F64", 8},   {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
                      {DType::F8_E8M0, "F8_E8M0", 1}};
  for (const auto& r : rows) {
    EXPECT_STREQ(dtype_name(r.t), r.name);
    EXPECT_EQ(dtype_size(r.t), r.size);
    DType parsed;
    ASSERT_TRUE(parse_dtype(r.name, &parsed));
    EXPECT_EQ(parsed, r.t);
  }
  DType unused;
  EXPECT_FALSE(parse_dtype("F4", &unused));
  EXPECT_FALSE(parse_dtype("bf16", &unused));  // safetensors spelling is upper case
  EXPECT_TRUE(dtype_is_float(DType::BF16));
  EXPECT_FALSE(dtype_is_float(DType::I32));

  const int16_t i16 = -1234;
  const uint16_t bf = 0x3fc0;  // 1.5
  const double f64 = -2.25;
  const int64_t i64 = -7;
  const uint8_t e4 = 0x7e;
  EXPECT_EQ(load_as_f32(DType::I16, &i16), -1234.0f);
  EXPECT_EQ(load_as_f32(DType::BF16, &bf), 1.5f);
  EXPECT_EQ(load_as_f32(DType::F64, &f64), -2.25f);
  EXPECT_EQ(load_as_f32(DType::I64, &i64), -7.0f);
  EXPECT_EQ(load_as_f32(DType::F8_E4M3, &e4), 448.0f);
}

}  // namespace
}  // namespace kiln
