// The CPU matmul: out = x W^T with W read as stored. Work is split over blocks of 4 output rows (row-parallel
// GEMV for decode; for prefill each decoded 4 x 256 weight tile is reused across up to 64 tokens). The
// inner loops use 8-wide GCC vector types; the whole row-block kernel is compiled for baseline x86-64 and
// for x86-64-v3 (AVX2 + FMA), and the loader picks one at run time (target_clones).
#include <algorithm>
#include <cstring>

#include "backend/cpu/cpu_ops.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::backend::cpu {
namespace {

using model::WeightFormat;

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));
typedef int32_t v8i32 __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));

// E2M1 magnitude+sign codes (0..15 in u32 lanes) -> fp32 values, by building the float bits: magnitude code
// (e, m) = (c >> 1 & 3, c & 1) is (1 + m/2) * 2^(e-1) for e > 0 and m/2 for e == 0. Uniform shifts only.
__attribute__((always_inline)) inline void e2m1_values(const v8u32& c, v8f& out) {
  const v8u32 e = (c >> 1) & 3u, m = c & 1u;
  const v8i32 normal = (v8i32)(((e + 126u) << 23) | (m << 22));
  const v8i32 sub = (v8i32)(m * (126u << 23));  // 0.5 or 0
  const v8i32 is_normal = (v8i32)(e != 0u);       // -1 / 0 lanes
  const v8i32 bits = (normal & is_normal) | (sub & ~is_normal) | (v8i32)((c & 8u) << 28);
  std::memcpy(&out, &bits, sizeof(out));
}

// 8 packed bytes = 16 codes (element 2i in the low nibble of byte i) -> lo = elements 0..7, hi = 8..15.
__attribute__((always_inline)) inline void e2m1x16(const uint8_t* bytes, v8f& lo, v8f& hi) {
  v8u8 b;
  std::memcpy(&b, bytes, 8);
  const v8u32 x = __builtin_convertvector(b, v8u32);
  v8f even, odd;
  e2m1_values(x & 15u, even);
  e2m1_values(x >> 4, odd);
  lo = __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11);
  hi = __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15);
}

constexpr int kRowBlock = 4;     // output rows per task unit
constexpr int kColChunk = 256;   // K columns decoded at a time (multiple of 16: NVFP4 blocks)
constexpr int kTokenBlock = 64;  // tokens sharing one decoded tile

__attribute__((always_inline)) inline void load8(v8f& v, const float* p) { std::memcpy(&v, p, sizeof(v)); }
__attribute__((always_inline)) inline float hsum(const v8f& v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

const float* f16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) t[i] = f16_to_f32(static_cast<uint16_t>(i));
    return t;
  }();
  return table.data();
}

__attribute__((always_inline)) inline void decode_row_inline(const LinearWeight& w, int64_t row, int64_t k0,
                                                             int64_t n, float* dst) {
  const int64_t K = w.in_features;
  switch (w.format) {
    case WeightFormat::dense: {
      switch (w.weight.dtype) {
        case DType::BF16: {
          const uint16_t* src = static_cast<const uint16_t*>(w.weight.data) + row * K + k0;
          int64_t i = 0;
          for (; i + 8 <= n; i += 8) {  // bf16 -> f32 is a 16-bit shift: 8 at a time
            v8u16 h;
            std::memcpy(&h, src + i, sizeof(h));
            const v8u32 u = __builtin_convertvector(h, v8u32) << 16;
            std::memcpy(dst + i, &u, sizeof(u));
          }
          for (; i < n; ++i) {
            const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
            std::memcpy(dst + i, &u, 4);
          }
          return;
        }
        case DType::F32:
          std::memcpy(dst, static_cast<const float*>(w.weight.data) + row * K + k0, n * sizeof(float));
          return;
        case DType::F16: {
          const float* table = f16_table();
          const uint16_t* src = static_cast<const uint16_t*>(w.weight.data) + row * K + k0;
          for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
          return;
        }
        default: KILN_CHECK(false, "dense weight dtype {}", dtype_name(w.weight.dtype));
      }
      return;
    }
    case WeightFormat::fp8_tensor: {
      const uint8_t* src = static_cast<const uint8_t*>(w.weight.data) + row * K + k0;
      const float s = w.scale;
      for (int64_t i = 0; i < n; ++i) dst[i] = detail::kE4M3.v[src[i]] * s;
      return;
    }
    case WeightFormat::nvfp4: {
      // (e2m1(code) * block_scale) is exact in fp32; one rounding for * scale_2, as the dequantiser does.
      const uint8_t* packed = static_cast<const uint8_t*>(w.weight.data) + row * (K / 2) + k0 / 2;
      const uint8_t* scales = static_cast<const uint8_t*>(w.block_scale.data) + row * (K / 16) + k0 / 16;
      const float s2 = w.scale;
      for (int64_t b = 0; b < n / 16; ++b) {
        const float bs = detail::kE4M3.v[scales[b]];
        const uint8_t* p = packed + b * 8;
        float* d = dst + b * 16;
        v8f lo, hi;
        e2m1x16(p, lo, hi);
        lo = (lo * bs) * s2;
        hi = (hi * bs) * s2;
        std::memcpy(d, &lo, sizeof(lo));
        std::memcpy(d + 8, &hi, sizeof(hi));
      }
      return;
    }
  }
}

// acc[t][r] += dot(w_r, x_t) over kc columns, for nr <= 4 rows and tb tokens (x rows K apart).
__attribute__((always_inline)) inline void dot_tile(const float (*wbuf)[kColChunk], int nr, const float* x,
                                                    int64_t K, int tb, int64_t kc, float (*acc)[kRowBlock]) {
  const int64_t kv = kc & ~int64_t{7};
  int t = 0;
  if (nr == kRowBlock) {
    for (; t + 2 <= tb; t += 2) {
      const float* x0 = x + t * K;
      const float* x1 = x0 + K;
      v8f a00 = {}, a01 = {}, a02 = {}, a03 = {}, a10 = {}, a11 = {}, a12 = {}, a13 = {};
      for (int64_t i = 0; i < kv; i += 8) {
        v8f xa, xb, w0, w1, w2, w3;
        load8(xa, x0 + i);
        load8(xb, x1 + i);
        load8(w0, wbuf[0] + i);
        load8(w1, wbuf[1] + i);
        load8(w2, wbuf[2] + i);
        load8(w3, wbuf[3] + i);
        a00 += w0 * xa; a01 += w1 * xa; a02 += w2 * xa; a03 += w3 * xa;
        a10 += w0 * xb; a11 += w1 * xb; a12 += w2 * xb; a13 += w3 * xb;
      }
      float s[2][4] = {{hsum(a00), hsum(a01), hsum(a02), hsum(a03)}, {hsum(a10), hsum(a11), hsum(a12), hsum(a13)}};
      for (int64_t i = kv; i < kc; ++i)
        for (int r = 0; r < 4; ++r) {
          s[0][r] += wbuf[r][i] * x0[i];
          s[1][r] += wbuf[r][i] * x1[i];
        }
      for (int r = 0; r < 4; ++r) {
        acc[t][r] += s[0][r];
        acc[t + 1][r] += s[1][r];
      }
    }
  }
  for (; t < tb; ++t) {
    const float* x0 = x + t * K;
    if (nr == kRowBlock) {  // one token, four rows: x loaded once per 4 FMAs
      v8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t i = 0; i < kv; i += 8) {
        v8f xa, w0, w1, w2, w3;
        load8(xa, x0 + i);
        load8(w0, wbuf[0] + i);
        load8(w1, wbuf[1] + i);
        load8(w2, wbuf[2] + i);
        load8(w3, wbuf[3] + i);
        a0 += w0 * xa; a1 += w1 * xa; a2 += w2 * xa; a3 += w3 * xa;
      }
      float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
      for (int64_t i = kv; i < kc; ++i)
        for (int r = 0; r < 4; ++r) s[r] += wbuf[r][i] * x0[i];
      for (int r = 0; r < 4; ++r) acc[t][r] += s[r];
      continue;
    }
    for (int r = 0; r < nr; ++r) {
      v8f a = {};
      for (int64_t i = 0; i < kv; i += 8) {
        v8f xa, w0;
        load8(xa, x0 + i);
        load8(w0, wbuf[r] + i);
        a += w0 * xa;
      }
      float s = hsum(a);
      for (int64_t i = kv; i < kc; ++i) s += wbuf[r][i] * x0[i];
      acc[t][r] += s;
    }
  }
}

__attribute__((target_clones("arch=x86-64-v3", "default")))
void linear_row_blocks(const float* x, int64_t T, const LinearWeight* wp, float* out, int64_t rb_begin,
                       int64_t rb_end) {
  const LinearWeight& w = *wp;
  const int64_t N = w.out_features, K = w.in_features;
  alignas(64) float wbuf[kRowBlock][kColChunk];
  alignas(64) float acc[kTokenBlock][kRowBlock];
  for (int64_t rb = rb_begin; rb < rb_end; ++rb) {
    const int64_t r0 = rb * kRowBlock;
    const int nr = static_cast<int>(std::min<int64_t>(kRowBlock, N - r0));
    for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock) {
      const int tb = static_cast<int>(std::min<int64_t>(kTokenBlock, T - t0));
      std::memset(acc, 0, sizeof(acc));
      for (int64_t k0 = 0; k0 < K; k0 += kColChunk) {
        const int64_t kc = std::min<int64_t>(kColChunk, K - k0);
        for (int r = 0; r < nr; ++r) decode_row_inline(w, r0 + r, k0, kc, wbuf[r]);
        dot_tile(wbuf, nr, x + t0 * K + k0, K, tb, kc, acc);
      }
      for (int t = 0; t < tb; ++t)
        for (int r = 0; r < nr; ++r) {
          float v = acc[t][r];
          if (w.bias.data) v += load_f32(w.bias, r0 + r);
          out[(t0 + t) * N + r0 + r] = v;
        }
    }
  }
}


}  // namespace

const char* linear_kernel_name() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? "x86-64-v3 (AVX2+FMA)"
                                                                         : "baseline x86-64 (SSE2)";
}

void decode_weight_row(const LinearWeight& w, int64_t row, int64_t k0, int64_t n, float* dst) {
  decode_row_inline(w, row, k0, n, dst);
}

void linear_f32(const float* x, int64_t T, const LinearWeight& w, float* out) {
  const int64_t N = w.out_features, K = w.in_features;
  if (w.format == WeightFormat::nvfp4) KILN_CHECK(K % 16 == 0, "NVFP4 K {}", K);
  const int64_t row_blocks = (N + kRowBlock - 1) / kRowBlock;
  const int64_t work = N * K * std::max<int64_t>(T, 1);
  if (work < (int64_t{1} << 16)) {
    linear_row_blocks(x, T, &w, out, 0, row_blocks);
    return;
  }
  // Aim for >= ~64K multiply-adds per task.
  const int64_t per_block = kRowBlock * K * std::max<int64_t>(T, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_block);
  ThreadPool::global().parallel_for(
      row_blocks, [&](int64_t b, int64_t e) { linear_row_blocks(x, T, &w, out, b, e); }, grain);
}

}  // namespace kiln::backend::cpu
