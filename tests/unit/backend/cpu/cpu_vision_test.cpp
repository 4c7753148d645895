// The CPU backend's vision-encoder ops (cpu_vision.cpp) against maths written out here in double precision: LayerNorm
// with bias, GELU (erf and tanh forms), rotary embedding from cos / sin tables, bidirectional attention within
// segments, weighted row gathers; and the model::Ops defaults that name the op and the backend.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "core/error.h"

namespace kiln::backend {
namespace {

using ::testing::HasSubstr;

std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// BF16 bits of values with at most 8 significant bits (exact), and those values.
std::vector<uint16_t> bf16_of_exact(const std::vector<double>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    uint32_t u = 0;
    std::memcpy(&u, &f, 4);
    EXPECT_EQ(u & 0xffffu, 0u) << v[i] << " is not a bf16 value";
    out[i] = static_cast<uint16_t>(u >> 16);
  }
  return out;
}
std::vector<double> eight_bit_values(size_t n, uint32_t seed, double scale, double offset) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> k(-127, 127);
  std::vector<double> v(n);
  for (auto& x : v) x = offset + scale * k(rng) / 128.0;  // scale, offset powers of two: 8 significant bits
  return v;
}

TensorView view(std::vector<float>& v, Shape s) { return TensorView(v.data(), DType::F32, s); }

TEST(CpuVisionOps, LayerNormWithBiasMatchesDefinition) {
  const int64_t R = 5, D = 37;
  std::vector<float> x = random_floats(R * D, 1, -3.0f, 5.0f);  // mean far from 0
  const std::vector<double> w = eight_bit_values(D, 2, 1.0, 1.0), b = eight_bit_values(D, 3, 0.25, 0.0);
  std::vector<uint16_t> wb = bf16_of_exact(w);
  std::vector<float> bias(b.begin(), b.end());
  std::vector<float> out(R * D);
  cpu::CpuOps ops;
  ops.layer_norm(view(x, Shape{R, D}), TensorView(wb.data(), DType::BF16, Shape{D}), view(bias, Shape{D}), 1e-6f,
                 view(out, Shape{R, D}));
  for (int64_t r = 0; r < R; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < D; ++i) mean += x[r * D + i];
    mean /= D;
    for (int64_t i = 0; i < D; ++i) var += (x[r * D + i] - mean) * (x[r * D + i] - mean);
    var /= D;  // biased, as torch.nn.LayerNorm
    for (int64_t i = 0; i < D; ++i) {
      const double want = (x[r * D + i] - mean) / std::sqrt(var + 1e-6) * w[i] + b[i];
      ASSERT_NEAR(out[r * D + i], want, 2e-6 * (1 + std::fabs(want))) << r << " " << i;
    }
  }
  // In place.
  std::vector<float> in_place = x;
  ops.layer_norm(view(in_place, Shape{R, D}), TensorView(wb.data(), DType::BF16, Shape{D}), view(bias, Shape{D}),
                 1e-6f, view(in_place, Shape{R, D}));
  EXPECT_EQ(in_place, out);
}

TEST(CpuVisionOps, GeluErfAndTanhMatchTheirFormulas) {
  std::vector<float> x;
  for (int i = -800; i <= 800; ++i) x.push_back(i / 80.0f);  // [-10, 10]
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> erf_out(n), tanh_out(n);
  cpu::CpuOps ops;
  ops.gelu(view(x, Shape{n}), model::GeluKind::erf, view(erf_out, Shape{n}));
  ops.gelu(view(x, Shape{n}), model::GeluKind::tanh, view(tanh_out, Shape{n}));
  const double pi = 3.14159265358979323846;
  double max_gap = 0;  // the two forms differ (by up to ~5e-4 near |x| = 2): the test must tell them apart
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    const double e = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    const double t = 0.5 * v * (1 + std::tanh(std::sqrt(2 / pi) * (v + 0.044715 * v * v * v)));
    ASSERT_NEAR(erf_out[i], e, 1e-6 * (1 + std::fabs(e))) << v;
    ASSERT_NEAR(tanh_out[i], t, 1e-6 * (1 + std::fabs(t))) << v;
    max_gap = std::max(max_gap, std::fabs(e - t));
  }
  EXPECT_GT(max_gap, 1e-4);
  // In place.
  std::vector<float> y = x;
  ops.gelu(view(y, Shape{n}), model::GeluKind::tanh, view(y, Shape{n}));
  EXPECT_EQ(y, tanh_out);
}

TEST(CpuVisionOps, RopeCosSinRotatesHalfPairsWithPerTokenTables) {
  const int64_t T = 3, H = 2, D = 8, half = D / 2;
  std::vector<float> x = random_floats(T * H * D, 4);
  const std::vector<float> x0 = x;
  const std::vector<float> angles = random_floats(T * half, 5, -6.0f, 6.0f);
  std::vector<float> cs(T * half), sn(T * half);
  for (int64_t i = 0; i < T * half; ++i) {
    cs[i] = std::cos(angles[i]);
    sn[i] = std::sin(angles[i]);
  }
  cpu::CpuOps ops;
  ops.rope_cos_sin(view(x, Shape{T, H, D}), view(cs, Shape{T, half}), view(sn, Shape{T, half}));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        // the pair (i, i + D/2) turned by the token's angle i
        const double a = x0[(t * H + h) * D + i], z = x0[(t * H + h) * D + i + half], th = angles[t * half + i];
        EXPECT_NEAR(x[(t * H + h) * D + i], a * std::cos(th) - z * std::sin(th), 1e-6);
        EXPECT_NEAR(x[(t * H + h) * D + i + half], z * std::cos(th) + a * std::sin(th), 1e-6);
      }
}

TEST(CpuVisionOps, AttentionSegmentsIsBidirectionalWithinEachSegmentOnly) {
  const int64_t T = 9, H = 2, D = 4;
  std::vector<float> q = random_floats(T * H * D, 6, -2, 2), k = random_floats(T * H * D, 7, -2, 2),
                     v = random_floats(T * H * D, 8);
  std::vector<int32_t> cu = {0, 3, 3, 8, 9};  // segments of 3, 0, 5 and 1 tokens
  std::vector<float> out(T * H * D);
  const float scale = 0.5f;
  cpu::CpuOps ops;
  ops.attention_segments(view(q, Shape{T, H, D}), view(k, Shape{T, H, D}), view(v, Shape{T, H, D}),
                         TensorView(cu.data(), DType::I32, Shape{5}), 5, scale, view(out, Shape{T, H, D}));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t)
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> p;
        double mx = -1e300, sum = 0;
        for (int64_t j = cu[s]; j < cu[s + 1]; ++j) {  // every token of the segment, before and after t
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += double(q[(t * H + h) * D + d]) * k[(j * H + h) * D + d];
          p.push_back(dot * scale);
          mx = std::max(mx, p.back());
        }
        for (auto& e : p) sum += (e = std::exp(e - mx));
        for (int64_t d = 0; d < D; ++d) {
          double want = 0;
          for (int64_t j = cu[s]; j < cu[s + 1]; ++j) want += p[j - cu[s]] / sum * v[(j * H + h) * D + d];
          EXPECT_NEAR(out[(t * H + h) * D + d], want, 2e-6) << "token " << t << " head " << h;
        }
      }
  // A one-token segment returns its own value.
  for (int64_t d = 0; d < H * D; ++d) EXPECT_FLOAT_EQ(out[8 * H * D + d], v[8 * H * D + d]);
}

TEST(CpuVisionOps, WeightedEmbeddingSumsWeightedRows) {
  const int64_t V = 6, Hd = 5, T = 4, J = 3;
  const std::vector<double> table = eight_bit_values(V * Hd, 9, 1.0, 0.0);
  std::vector<uint16_t> tb = bf16_of_exact(table);
  std::vector<int32_t> ids = {0, 5, 5, 1, 2, 3, 4, 4, 4, 5, 0, 2};
  std::vector<float> w = random_floats(T * J, 10, 0.0f, 1.0f);
  std::vector<float> out(T * Hd, 99.0f);
  cpu::CpuOps ops;
  ops.weighted_embedding(TensorView(tb.data(), DType::BF16, Shape{V, Hd}), TensorView(ids.data(), DType::I32, Shape{T, J}),
                         view(w, Shape{T, J}), view(out, Shape{T, Hd}));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < Hd; ++c) {
      double want = 0;
      for (int64_t j = 0; j < J; ++j) want += w[t * J + j] * table[ids[t * J + j] * Hd + c];
      EXPECT_NEAR(out[t * Hd + c], want, 1e-6) << t << " " << c;
    }
  ids[4] = 6;  // outside the table
  EXPECT_THROW(ops.weighted_embedding(TensorView(tb.data(), DType::BF16, Shape{V, Hd}),
                                      TensorView(ids.data(), DType::I32, Shape{T, J}), view(w, Shape{T, J}),
                                      view(out, Shape{T, Hd})),
               InternalError);
}

TEST(CpuVisionOps, OpsDefaultsNameTheOpAndTheBackend) {
  // The base class's bodies (what a backend without the vision ops runs) throw a clear kiln::Error.
  cpu::CpuOps cpu;
  model::Ops& ops = cpu;
  std::vector<float> x(8);
  std::vector<int32_t> cu = {0, 1};
  const TensorView t = view(x, Shape{1, 1, 8});
  auto error_of = [](auto&& call) -> std::string {
    try {
      call();
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
  EXPECT_THAT(error_of([&] { ops.Ops::layer_norm(t, t, t, 1e-6f, t); }),
              HasSubstr("layer_norm is not implemented on the cpu backend"));
  EXPECT_THAT(error_of([&] { ops.Ops::gelu(t, model::GeluKind::erf, t); }),
              HasSubstr("gelu is not implemented on the cpu backend"));
  EXPECT_THAT(error_of([&] { ops.Ops::rope_cos_sin(t, t, t); }),
              HasSubstr("rope_cos_sin is not implemented on the cpu backend"));
  EXPECT_THAT(error_of([&] {
                ops.Ops::attention_segments(t, t, t, TensorView(cu.data(), DType::I32, Shape{2}), 1, 1.0f, t);
              }),
              HasSubstr("attention_segments is not implemented on the cpu backend"));
  EXPECT_THAT(error_of([&] { ops.Ops::weighted_embedding(t, t, t, t); }),
              HasSubstr("weighted_embedding is not implemented on the cpu backend"));
}

}  // namespace
}  // namespace kiln::backend
