#include "format/nvfp4_quant.h"

#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::format::nvfp4 {

uint8_t e2m1_code(float x) {
  const uint8_t sign = std::signbit(x) ? 0x8 : 0;
  const float a = std::fabs(x);
  // Thresholds are the midpoints between neighbouring magnitudes; `<=` where the lower code is even
  // (ties go down to it), `<` where the upper code is even (ties go up).
  uint8_t m;
  if (a <= 0.25f) m = 0;
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;
  else m = 7;  // saturate (also NaN, which callers reject beforehand)
  return sign | m;
}

float global_scale(float amax) { return amax / (kE2M1Max * kE4M3Max); }

float abs_max(std::span<const float> w, const char* what) {
  float amax = 0.0f;
  for (float v : w) {
    if (!std::isfinite(v)) fail("{}: weight is {} (not finite): the checkpoint is damaged", what, v);
    amax = std::fmax(amax, std::fabs(v));
  }
  return amax;
}

void quantize_rows(std::span<const float> w, int64_t n, int64_t k, float weight_scale_2, int64_t row_begin,
                   int64_t row_end, uint8_t* packed, uint8_t* scales) {
  KILN_CHECK(k % kGroupSize == 0 && static_cast<int64_t>(w.size()) == n * k, "bad shape [{}, {}]", n, k);
  const int64_t blocks = k / kGroupSize;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* row = w.data() + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* blk = row + b * kGroupSize;
      float bmax = 0.0f;
      for (int64_t i = 0; i < kGroupSize; ++i) bmax = std::fmax(bmax, std::fabs(blk[i]));
      uint8_t scale_code = 0;
      if (weight_scale_2 > 0.0f) scale_code = f32_to_e4m3((bmax / kE2M1Max) / weight_scale_2, /*saturate=*/true);
      scales[r * blocks + b] = scale_code;
      const float eff = e4m3_to_f32(scale_code) * weight_scale_2;
      uint8_t* out = packed + r * (k / 2) + b * (kGroupSize / 2);
      for (int64_t i = 0; i < kGroupSize; i += 2) {
        uint8_t lo = 0, hi = 0;
        if (eff > 0.0f) {
          lo = e2m1_code(blk[i] / eff);
          hi = e2m1_code(blk[i + 1] / eff);
        }
        out[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

QuantizedLinear quantize(std::span<const float> w, int64_t n, int64_t k) {
  if (k % kGroupSize != 0) fail("NVFP4 needs the input size to be a multiple of {}, got {}", kGroupSize, k);
  QuantizedLinear q;
  q.n = n;
  q.k = k;
  q.weight_scale_2 = global_scale(abs_max(w, "nvfp4 quantize"));
  q.packed.assign(static_cast<size_t>(n * k / 2), 0);
  q.scales.assign(static_cast<size_t>(n * k / kGroupSize), 0);
  ThreadPool::global().parallel_for(
      n, [&](int64_t b, int64_t e) { quantize_rows(w, n, k, q.weight_scale_2, b, e, q.packed.data(), q.scales.data()); },
      16);
  return q;
}

void dequantize(const uint8_t* packed, const uint8_t* scales, float weight_scale_2, int64_t n, int64_t k,
                float* out) {
  const int64_t blocks = k / kGroupSize;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float eff = e4m3_to_f32(scales[r * blocks + b]) * weight_scale_2;
      for (int64_t i = 0; i < kGroupSize; ++i) {
        const int64_t col = b * kGroupSize + i;
        const uint8_t byte = packed[r * (k / 2) + col / 2];
        const uint8_t code = (col % 2 == 0) ? (byte & 0xf) : (byte >> 4);
        out[r * k + col] = e2m1_to_f32(code) * eff;
      }
    }
  }
}

}  // namespace kiln::format::nvfp4
