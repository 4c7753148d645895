#include "core/dtype.h"

#include <cmath>
#include <limits>

#include "core/error.h"

namespace kiln {
namespace {

struct DTypeInfo {
  DType type;
  const char* name;
  size_t size;
  bool is_float;
};

constexpr DTypeInfo kInfo[] = {
    {DType::BOOL, "BOOL", 1, false},     {DType::U8, "U8", 1, false},       {DType::I8, "I8", 1, false},
    {DType::U16, "U16", 2, false},       {DType::I16, "I16", 2, false},     {DType::U32, "U32", 4, false},
    {DType::I32, "I32", 4, false},       {DType::U64, "U64", 8, false},     {DType::I64, "I64", 8, false},
    {DType::F16, "F16", 2, true},        {DType::BF16, "BF16", 2, true},    {DType::F32, "F32", 4, true},
    {DType::F64, "F64", 8, true},        {DType::F8_E4M3, "F8_E4M3", 1, true},
    {DType::F8_E5M2, "F8_E5M2", 1, true}, {DType::F8_E8M0, "F8_E8M0", 1, true},
};

const DTypeInfo& info(DType t) {
  for (auto& i : kInfo)
    if (i.type == t) return i;
  KILN_CHECK(false, "unknown dtype {}", static_cast<int>(t));
}

// Generic IEEE-like small float encoder with round-to-nearest-even. `mbits` mantissa bits, `bias`,
// `max_finite` the largest finite magnitude. Returns the unsigned magnitude bits, or -1 on overflow
// (the caller decides between saturation, inf and NaN). The arithmetic is exact in double.
int encode_magnitude(double a, int mbits, int bias, double max_finite) {
  if (a == 0.0) return 0;
  const int emin = 1 - bias;
  const double one_m = std::ldexp(1.0, mbits);
  int bits;
  if (a < std::ldexp(1.0, emin)) {
    // Subnormal grid: spacing 2^(emin - mbits). k == 2^mbits lands on the smallest normal, whose
    // encoding is exactly k as well.
    double k = std::nearbyint(a / std::ldexp(1.0, emin - mbits));
    bits = static_cast<int>(k);
  } else {
    int e;
    std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
    e -= 1;             // a in [2^e, 2^(e+1))
    double q = std::nearbyint(a / std::ldexp(1.0, e - mbits));  // in [2^m, 2^(m+1)]
    if (q >= 2 * one_m) {
      q = one_m;
      e += 1;
    }
    bits = ((e + bias) << mbits) | static_cast<int>(q - one_m);
  }
  // Value of the rounded result, to compare with the largest finite value.
  const int ef = bits >> mbits, mf = bits & ((1 << mbits) - 1);
  double v = ef == 0 ? std::ldexp(static_cast<double>(mf), emin - mbits)
                     : std::ldexp(1.0 + mf / one_m, ef - bias);
  if (v > max_finite) return -1;
  return bits;
}

// A small float format as encode_small writes it: the magnitude grid (encode_magnitude's mbits, bias, max_finite), the
// sign bit, and the codes (without sign) for NaN, for +-inf and for a magnitude past max_finite.
struct SmallFloatCodes {
  int mbits, bias;
  double max_finite;
  uint32_t sign_bit, nan, inf, overflow;
};
uint32_t encode_small(float f, const SmallFloatCodes& c) {
  const uint32_t sign = std::signbit(f) ? c.sign_bit : 0u;
  if (std::isnan(f)) return sign | c.nan;
  if (std::isinf(f)) return sign | c.inf;
  const int m = encode_magnitude(std::fabs(static_cast<double>(f)), c.mbits, c.bias, c.max_finite);
  return sign | (m < 0 ? c.overflow : static_cast<uint32_t>(m));
}

float decode_small(uint32_t bits, int ebits, int mbits, int bias, bool has_inf) {
  const uint32_t sign = bits >> (ebits + mbits);
  const uint32_t ef = (bits >> mbits) & ((1u << ebits) - 1);
  const uint32_t mf = bits & ((1u << mbits) - 1);
  double v;
  if (has_inf && ef == (1u << ebits) - 1) {
    v = mf ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (ef == 0) {
    v = std::ldexp(static_cast<double>(mf), 1 - bias - mbits);
  } else {
    v = std::ldexp(1.0 + mf / std::ldexp(1.0, mbits), static_cast<int>(ef) - bias);
  }
  return static_cast<float>(sign ? -v : v);
}

}  // namespace

size_t dtype_size(DType t) { return info(t).size; }
const char* dtype_name(DType t) { return info(t).name; }
bool dtype_is_float(DType t) { return info(t).is_float; }

bool parse_dtype(std::string_view s, DType* out) {
  for (auto& i : kInfo)
    if (s == i.name) {
      *out = i.type;
      return true;
    }
  return false;
}

float f16_to_f32(uint16_t h) { return decode_small(h, 5, 10, 15, true); }

uint16_t f32_to_f16(float f) {
  // IEEE: overflow rounds to inf.
  return static_cast<uint16_t>(encode_small(f, {10, 15, 65504.0, 0x8000u, 0x7e00u, 0x7c00u, 0x7c00u}));
}

uint8_t f32_to_e4m3(float f, bool saturate) {
  // No inf in e4m3fn: inf and overflow saturate to 448 or become NaN.
  const uint32_t big = saturate ? 0x7eu : 0x7fu;
  return static_cast<uint8_t>(encode_small(f, {3, 7, 448.0, 0x80u, 0x7fu, big, big}));
}

uint8_t f32_to_e5m2(float f, bool saturate) {
  const uint32_t big = saturate ? 0x7bu : 0x7cu;
  return static_cast<uint8_t>(encode_small(f, {2, 15, 57344.0, 0x80u, 0x7eu, big, big}));
}

uint8_t f32_to_e2m1(float f) {
  // No NaN or inf in e2m1: saturate.
  return static_cast<uint8_t>(encode_small(f, {1, 1, 6.0, 0x8u, 0x7u, 0x7u, 0x7u}));
}

float load_as_f32(DType t, const void* p) {
  switch (t) {
    case DType::BOOL:
    case DType::U8: return *static_cast<const uint8_t*>(p);
    case DType::I8: return *static_cast<const int8_t*>(p);
    case DType::U16: { uint16_t v; std::memcpy(&v, p, 2); return v; }
    case DType::I16: { int16_t v; std::memcpy(&v, p, 2); return v; }
    case DType::U32: { uint32_t v; std::memcpy(&v, p, 4); return static_cast<float>(v); }
    case DType::I32: { int32_t v; std::memcpy(&v, p, 4); return static_cast<float>(v); }
    case DType::U64: { uint64_t v; std::memcpy(&v, p, 8); return static_cast<float>(v); }
    case DType::I64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<float>(v); }
    case DType::F16: { uint16_t v; std::memcpy(&v, p, 2); return f16_to_f32(v); }
    case DType::BF16: { uint16_t v; std::memcpy(&v, p, 2); return bf16_to_f32(v); }
    case DType::F32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::F64: { double v; std::memcpy(&v, p, 8); return static_cast<float>(v); }
    case DType::F8_E4M3: return e4m3_to_f32(*static_cast<const uint8_t*>(p));
    case DType::F8_E5M2: return e5m2_to_f32(*static_cast<const uint8_t*>(p));
    case DType::F8_E8M0: return e8m0_to_f32(*static_cast<const uint8_t*>(p));
  }
  KILN_CHECK(false, "unhandled dtype");
}

}  // namespace kiln
