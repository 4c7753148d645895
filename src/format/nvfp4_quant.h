// NVFP4 weight quantisation in the NVIDIA ModelOpt checkpoint layout (REFERENCE §2).
//
// For one linear W [N out, K in] (K a multiple of 16), every step in float32:
//   weight_scale_2 = amax(|W|) / (6 * 448)
//   weight_scale   = e4m3(round-to-nearest-even, saturating)((amax of 16 consecutive inputs / 6) / weight_scale_2)
//   code           = e2m1(round-to-nearest-even, saturating)(W / (float(weight_scale) * weight_scale_2))
//   weight byte    = code[2i] | code[2i + 1] << 4           (element 2i in the low nibble)
//   dequantised    = e2m1(code) * (float(weight_scale) * weight_scale_2)
// A block whose scale encodes to 0 (or a tensor of zeros) stores zero codes. Tools/tiny/nvfp4.py holds an
// independent Python implementation of the same rules; tests compare the two byte for byte.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace kiln::format::nvfp4 {

inline constexpr int64_t kGroupSize = 16;
inline constexpr float kE2M1Max = 6.0f;
inline constexpr float kE4M3Max = 448.0f;

// E2M1 code of x: bit 3 sign, bits 0-2 index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}; nearest value, ties to
// the even code (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4), |x| > 6 saturates.
uint8_t e2m1_code(float x);

// amax / (6 * 448), the per-tensor scale (weight_scale_2, and input_scale from an activation amax).
float global_scale(float amax);

// max |w| over `w` (float32 values). kiln::Error if a value is NaN or infinite (`what` names the tensor).
float abs_max(std::span<const float> w, const char* what);

// Quantises rows [row_begin, row_end) of W [n, k] (row-major float32) with the given weight_scale_2.
// packed: [n, k/2] bytes, scales: [n, k/16] e4m3 codes (only the given rows are written).
void quantize_rows(std::span<const float> w, int64_t n, int64_t k, float weight_scale_2, int64_t row_begin,
                   int64_t row_end, uint8_t* packed, uint8_t* scales);

struct QuantizedLinear {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> packed;  // [n, k/2]
  std::vector<uint8_t> scales;  // [n, k/16] F8_E4M3 codes
  float weight_scale_2 = 0.0f;
};

// Whole-matrix quantisation (rows in parallel on the global thread pool).
QuantizedLinear quantize(std::span<const float> w, int64_t n, int64_t k);

// out [n, k] = dequantised weights.
void dequantize(const uint8_t* packed, const uint8_t* scales, float weight_scale_2, int64_t n, int64_t k,
                float* out);

}  // namespace kiln::format::nvfp4
