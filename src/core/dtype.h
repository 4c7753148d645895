// Element types and exact conversions between them.
//  - bf16, f16: IEEE-style, round-to-nearest-even from f32, NaN kept NaN, overflow to inf.
//  - f8 e4m3 (OCP "E4M3FN": bias 7, no inf, S.1111.111 is NaN, max 448) and f8 e5m2 (OCP: bias 15,
//    IEEE-like inf/NaN, max 57344). From f32: round-to-nearest-even; overflow saturates to +-max
//    (the OCP "saturating" mode, what quantisers use) or, with saturate=false, gives NaN (e4m3) /
//    inf (e5m2) as the OCP non-saturating mode.
//  - e2m1 (FP4, NVFP4 element): 4 bits, bit 3 sign, bits 0-2 index {0,0.5,1,1.5,2,3,4,6};
//    from f32 round-to-nearest-even, saturating at 6.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace kiln {

enum class DType : uint8_t {
  BOOL, U8, I8, U16, I16, U32, I32, U64, I64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2, F8_E8M0,
};

// Bytes per element.
size_t dtype_size(DType t);
// The safetensors spelling ("BF16", "F8_E4M3", ...).
const char* dtype_name(DType t);
// Parses a safetensors dtype string; false if unknown.
bool parse_dtype(std::string_view s, DType* out);
bool dtype_is_float(DType t);

// ---- bf16 ----
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// ---- f16 ----
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// ---- f8 ----
namespace detail {
// Exact decode of a small float (sign | ebits exponent | mbits mantissa), evaluated at compile time.
constexpr float pow2(int e) {
  float v = 1.0f;
  for (; e > 0; --e) v *= 2.0f;
  for (; e < 0; ++e) v *= 0.5f;
  return v;
}
constexpr float decode_f8(unsigned bits, int ebits, int mbits, int bias, bool has_inf) {
  const unsigned sign = bits >> (ebits + mbits);
  const unsigned ef = (bits >> mbits) & ((1u << ebits) - 1);
  const unsigned mf = bits & ((1u << mbits) - 1);
  float v;
  if (has_inf && ef == (1u << ebits) - 1) {
    v = mf ? __builtin_nanf("") : __builtin_inff();
  } else if (!has_inf && ef == (1u << ebits) - 1 && mf == (1u << mbits) - 1) {
    v = __builtin_nanf("");  // e4m3fn: S.1111.111 is NaN
  } else if (ef == 0) {
    v = static_cast<float>(mf) * pow2(1 - bias - mbits);
  } else {
    v = static_cast<float>((1u << mbits) + mf) * pow2(static_cast<int>(ef) - bias - mbits);
  }
  return sign ? -v : v;
}
struct F8Table {
  float v[256];
};
constexpr F8Table make_f8_table(int ebits, int mbits, int bias, bool has_inf) {
  F8Table t{};
  for (unsigned i = 0; i < 256; ++i) t.v[i] = decode_f8(i, ebits, mbits, bias, has_inf);
  return t;
}
inline constexpr F8Table kE4M3 = make_f8_table(4, 3, 7, false);
inline constexpr F8Table kE5M2 = make_f8_table(5, 2, 15, true);
}  // namespace detail

inline float e4m3_to_f32(uint8_t v) { return detail::kE4M3.v[v]; }
inline float e5m2_to_f32(uint8_t v) { return detail::kE5M2.v[v]; }
uint8_t f32_to_e4m3(float f, bool saturate = true);
uint8_t f32_to_e5m2(float f, bool saturate = true);
inline float e8m0_to_f32(uint8_t v) {  // OCP MX scale: 2^(v-127), 0xff is NaN
  if (v == 0xff) return __builtin_nanf("");
  uint32_t u = v == 0 ? 0x00400000u : static_cast<uint32_t>(v) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- e2m1 (FP4) ----
inline constexpr float kE2M1ToF32[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
inline float e2m1_to_f32(uint8_t code) { return kE2M1ToF32[code & 0xf]; }
uint8_t f32_to_e2m1(float f);

// Converts one element stored as `t` at `p` to f32 (float and integer types).
float load_as_f32(DType t, const void* p);

}  // namespace kiln
