// CPU backend ops against independent maths: NVFP4 / FP8 / BF16 weight decoding (REFERENCE section 2 written
// out here, not taken from the code under test), the matmul on awkward shapes, the chunked delta rule, and the argmax
// into device ids (argmax_rows_into, CpuOps' and Ops' default) against a scan written here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_ops.h"
#include "core/dtype.h"
#include "model/forwarding_ops.h"

namespace kiln::backend {
namespace {

// E2M1: bit 3 sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
double e2m1_ref(int code) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (code & 8 ? -1 : 1) * mag[code & 7];
}
// E4M3 (OCP FN): bias 7, subnormals, S.1111.111 NaN.
double e4m3_ref(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 0xf, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return s ? -v : v;
}

TEST(CpuOps, Nvfp4DecodeMatchesFormulaOnEveryCodeAndScale) {
  // One row of K = 16 * 256: block b uses block scale byte b (every E4M3 value but NaN); within each block
  // the 16 elements take the 16 codes in a block-dependent order, so every (code, scale) pair appears.
  const int64_t blocks = 256, K = blocks * 16;
  std::vector<uint8_t> packed(K / 2), scales(blocks);
  std::vector<int> codes(K);
  for (int64_t b = 0; b < blocks; ++b) {
    scales[b] = static_cast<uint8_t>(b == 0x7f || b == 0xff ? 0x38 : b);
    for (int i = 0; i < 16; ++i) codes[b * 16 + i] = (i + b) & 15;
  }
  for (int64_t i = 0; i < K / 2; ++i)
    packed[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));  // element 2i low nibble
  for (float scale_2 : {1.0f, 0.000372f, 3.5f}) {
    LinearWeight w;
    w.format = WeightFormat::nvfp4;
    w.out_features = 1;
    w.in_features = K;
    w.weight = TensorView(packed.data(), DType::U8, Shape{1, K / 2});
    w.block_scale = TensorView(scales.data(), DType::F8_E4M3, Shape{1, blocks});
    w.scale = scale_2;
    std::vector<float> got(K);
    cpu::decode_weight_row(w, 0, 0, K, got.data());
    for (int64_t k = 0; k < K; ++k) {
      // (code * block scale) is exact; one fp32 rounding for * scale_2.
      const float want = static_cast<float>(e2m1_ref(codes[k]) * e4m3_ref(scales[k / 16])) * scale_2;
      ASSERT_EQ(got[k], want) << "k " << k << " code " << codes[k] << " scale byte " << int(scales[k / 16]);
    }
    // A window starting mid-row (block aligned).
    std::vector<float> part(64);
    cpu::decode_weight_row(w, 0, 512, 64, part.data());
    EXPECT_EQ(std::memcmp(part.data(), got.data() + 512, 64 * sizeof(float)), 0);
  }
}

TEST(CpuOps, Fp8AndBf16DecodeMatchFormula) {
  std::vector<uint8_t> f8(256);
  for (int i = 0; i < 256; ++i) f8[i] = static_cast<uint8_t>(i);
  LinearWeight w;
  w.format = WeightFormat::fp8_tensor;
  w.out_features = 1;
  w.in_features = 256;
  w.weight = TensorView(f8.data(), DType::F8_E4M3, Shape{1, 256});
  w.scale = 0.0123f;
  std::vector<float> got(256);
  cpu::decode_weight_row(w, 0, 0, 256, got.data());
  for (int i = 0; i < 256; ++i) {
    if (std::isnan(e4m3_ref(f8[i]))) continue;
    ASSERT_EQ(got[i], static_cast<float>(e4m3_ref(f8[i])) * 0.0123f) << i;
  }
  std::vector<uint16_t> bf(4);
  const float vals[4] = {1.0f, -2.5f, 3.140625f, 0.0f};
  for (int i = 0; i < 4; ++i) {
    uint32_t u;
    std::memcpy(&u, &vals[i], 4);
    bf[i] = static_cast<uint16_t>(u >> 16);
  }
  LinearWeight b;
  b.out_features = 1;
  b.in_features = 4;
  b.weight = TensorView(bf.data(), DType::BF16, Shape{1, 4});
  cpu::decode_weight_row(b, 0, 0, 4, got.data());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], vals[i]);
}

// out = x W^T in double from the decoded weights, vs the tiled kernel: shapes with row / token / column tails.
TEST(CpuOps, LinearMatchesNaiveOnAwkwardShapes) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1, 1);
  struct Case { int64_t T, N, K; WeightFormat fmt; };
  const Case cases[] = {{1, 7, 37, WeightFormat::dense}, {3, 5, 300, WeightFormat::dense},
                        {70, 9, 520, WeightFormat::dense}, {1, 6, 48, WeightFormat::nvfp4},
                        {67, 11, 528, WeightFormat::nvfp4}, {5, 13, 264, WeightFormat::fp8_tensor},
                        {130, 130, 96, WeightFormat::dense}};
  for (const Case& c : cases) {
    std::vector<float> x(c.T * c.K), out(c.T * c.N);
    for (auto& v : x) v = dist(rng);
    std::vector<uint16_t> bf;
    std::vector<uint8_t> bytes, scales;
    LinearWeight w;
    w.format = c.fmt;
    w.out_features = c.N;
    w.in_features = c.K;
    if (c.fmt == WeightFormat::dense) {
      bf.resize(c.N * c.K);
      for (auto& v : bf) v = f32_to_bf16(dist(rng));
      w.weight = TensorView(bf.data(), DType::BF16, Shape{c.N, c.K});
    } else if (c.fmt == WeightFormat::fp8_tensor) {
      bytes.resize(c.N * c.K);
      for (auto& v : bytes) v = static_cast<uint8_t>(rng() & 0x77);  // no NaNs
      w.weight = TensorView(bytes.data(), DType::F8_E4M3, Shape{c.N, c.K});
      w.scale = 0.01f;
    } else {
      bytes.resize(c.N * c.K / 2);
      scales.resize(c.N * c.K / 16);
      for (auto& v : bytes) v = static_cast<uint8_t>(rng());
      for (auto& v : scales) v = static_cast<uint8_t>(0x20 + rng() % 0x40);
      w.weight = TensorView(bytes.data(), DType::U8, Shape{c.N, c.K / 2});
      w.block_scale = TensorView(scales.data(), DType::F8_E4M3, Shape{c.N, c.K / 16});
      w.scale = 0.5f;
    }
    cpu::linear_f32(x.data(), c.T, w, out.data());
    std::vector<float> row(c.K);
    double worst = 0;
    for (int64_t n = 0; n < c.N; ++n) {
      cpu::decode_weight_row(w, n, 0, c.K, row.data());
      for (int64_t t = 0; t < c.T; ++t) {
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < c.K; ++k) {
          ref += static_cast<double>(x[t * c.K + k]) * row[k];
          mag += std::fabs(static_cast<double>(x[t * c.K + k]) * row[k]);
        }
        worst = std::max(worst, std::fabs(out[t * c.N + n] - ref) / (mag + 1e-30));
      }
    }
    EXPECT_LT(worst, 1e-6) << "T " << c.T << " N " << c.N << " K " << c.K;
  }
}

// The chunked delta rule (UT transform, chunks of 64) equals the recurrence on random inputs, including a
// continuation from a non-zero state and several sequences with different lengths in one call.
TEST(CpuOps, ChunkedDeltaRuleEqualsRecurrence) {
  auto ops = make_cpu_backend();
  const int64_t Hk = 2, Hv = 4, Dk = 8, Dv = 12;
  const std::vector<int32_t> lens = {150, 1, 64, 9};
  int64_t T = 0;
  for (int32_t l : lens) T += l;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  auto fill = [&](std::vector<float>& v, float scale, float shift) {
    for (auto& x : v) x = nd(rng) * scale + shift;
  };
  std::vector<float> q(T * Hk * Dk), k(T * Hk * Dk), v(T * Hv * Dv), g(T * Hv), beta(T * Hv);
  fill(q, 1, 0);
  fill(k, 1, 0);
  fill(v, 1, 0);
  fill(g, 0.05f, -0.1f);
  for (auto& x : g) x = std::min(x, 0.0f);
  for (auto& x : beta) x = 1.0f / (1.0f + std::exp(-nd(rng)));
  StepLayout step;
  step.num_seqs = static_cast<int>(lens.size());
  step.num_tokens = T;
  step.host_seq_token_begin = {0};
  for (size_t s = 0; s < lens.size(); ++s) {
    step.host_seq_token_begin.push_back(step.host_seq_token_begin.back() + lens[s]);
    step.host_seq_state_slot.push_back(static_cast<int32_t>(s));
  }
  const size_t state_n = lens.size() * Hv * Dk * Dv;
  std::vector<float> s0(state_n);
  fill(s0, 0.3f, 0);
  auto run = [&](DeltaRuleMode mode, std::vector<float>& state) {
    std::vector<float> out(T * Hv * Dv);
    ops->gated_delta_rule(TensorView(q.data(), DType::F32, Shape{T, Hk, Dk}),
                          TensorView(k.data(), DType::F32, Shape{T, Hk, Dk}),
                          TensorView(v.data(), DType::F32, Shape{T, Hv, Dv}),
                          TensorView(g.data(), DType::F32, Shape{T, Hv}), TensorView(beta.data(), DType::F32, Shape{T, Hv}),
                          TensorView(state.data(), DType::F32, Shape{static_cast<int64_t>(lens.size()), Hv, Dk, Dv}),
                          step, mode, TensorView(out.data(), DType::F32, Shape{T, Hv, Dv}));
    return out;
  };
  std::vector<float> st_r = s0, st_c = s0;
  const auto out_r = run(DeltaRuleMode::recurrent, st_r);
  const auto out_c = run(DeltaRuleMode::chunked, st_c);
  double d_out = 0, d_state = 0;
  for (size_t i = 0; i < out_r.size(); ++i) d_out = std::max(d_out, std::fabs(double(out_r[i]) - out_c[i]));
  for (size_t i = 0; i < state_n; ++i) d_state = std::max(d_state, std::fabs(double(st_r[i]) - st_c[i]));
  std::printf("[cpu_ops] chunked vs recurrent delta rule: out %.2e, state %.2e\n", d_out, d_state);
  EXPECT_LT(d_out, 1e-4);
  EXPECT_LT(d_state, 1e-4);
}


// M-RoPE against the rotation written out here: frequency i of token t turns the pair (i, i + half) of every head by
// pos[t][axis(i)] * theta^(-2i / rotary_dim); dims past rotary_dim stay. With three equal positions it is rope().
TEST(CpuOps, MRopeRotatesEachFrequencyByItsAxisPosition) {
  auto ops = make_cpu_backend();
  const int64_t T = 5, heads = 3, D = 24;
  const int rotary = 16, half = 8;
  const double theta = 10000.0;
  const model::MRopeAxes axes = model::MRopeAxes::from_sections({3, 3, 2}, true, half);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> x(T * heads * D);
  for (auto& v : x) v = dist(rng);
  std::vector<int32_t> pos3(T * 3);
  for (auto& p : pos3) p = static_cast<int32_t>(rng() % 50);
  std::vector<float> got = x;
  ops->mrope(TensorView(got.data(), DType::F32, Shape{T, heads, D}), TensorView(pos3.data(), DType::I32, Shape{T, 3}),
             rotary, theta, axes);
  // interleaved {3, 3, 2}: h at i % 3 == 1 below 9, w at i % 3 == 2 below 6, t elsewhere.
  const int axis_of[half] = {0, 1, 2, 0, 1, 2, 0, 1};
  double worst = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < D; ++d) {
        const float* v = x.data() + (t * heads + h) * D;
        double ref = v[d];
        if (d < rotary) {
          const int i = static_cast<int>(d % half);
          const double inv = 1.0 / std::pow(theta, 2.0 * i / rotary);
          const double a = pos3[t * 3 + axis_of[i]] * inv;
          ref = d < half ? v[i] * std::cos(a) - v[i + half] * std::sin(a)
                         : v[i + half] * std::cos(a) + v[i] * std::sin(a);
        }
        worst = std::max(worst, std::fabs(got[(t * heads + h) * D + d] - ref));
      }
  EXPECT_LT(worst, 1e-4);
  // Equal positions: bit for bit the plain rope.
  std::vector<int32_t> pos1(T), eq3(T * 3);
  for (int64_t t = 0; t < T; ++t) pos1[t] = eq3[t * 3] = eq3[t * 3 + 1] = eq3[t * 3 + 2] = static_cast<int32_t>(t * 7);
  std::vector<float> a = x, b = x;
  ops->rope(TensorView(a.data(), DType::F32, Shape{T, heads, D}), TensorView(pos1.data(), DType::I32, Shape{T}),
            rotary, theta);
  ops->mrope(TensorView(b.data(), DType::F32, Shape{T, heads, D}), TensorView(eq3.data(), DType::I32, Shape{T, 3}),
             rotary, theta, axes);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

TEST(CpuOps, ScatterRowsWritesOnlyTheGivenRows) {
  auto ops = make_cpu_backend();
  std::vector<float> dst(4 * 3, -1.0f), src = {1, 2, 3, 4, 5, 6};
  std::vector<int32_t> rows = {3, 1};
  ops->scatter_rows(TensorView(src.data(), DType::F32, Shape{2, 3}), TensorView(rows.data(), DType::I32, Shape{2}),
                    TensorView(dst.data(), DType::F32, Shape{4, 3}));
  EXPECT_EQ(dst, (std::vector<float>{-1, -1, -1, 4, 5, 6, -1, -1, -1, 1, 2, 3}));
}

// Ops::argmax_rows_into's default (argmax_rows, then an upload copied into the ids), reached through a wrapper that
// does not forward it.
class DefaultArgmaxInto final : public model::ForwardingOps {
 public:
  using ForwardingOps::ForwardingOps;
  void argmax_rows_into(const TensorView& logits, TensorView ids, int32_t id_offset) override {
    model::Ops::argmax_rows_into(logits, ids, id_offset);
  }
};

// The rule, written out: the largest non-NaN value, the lowest index among equals (+0 and -0 are equal), 0 when the
// row has no number.
int32_t argmax_ref(const float* row, int64_t n) {
  int32_t best = -1;
  for (int64_t v = 0; v < n; ++v) {
    if (row[v] != row[v]) continue;  // NaN
    if (best < 0 || row[v] > row[best]) best = static_cast<int32_t>(v);
  }
  return best < 0 ? 0 : best;
}

TEST(CpuOps, ArgmaxRowsIntoIsTheLowestBestIdPlusTheOffset) {
  auto cpu = make_cpu_backend();
  DefaultArgmaxInto composed(make_cpu_backend());
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(7);
  int rows_checked = 0;
  // Widths on both sides of the CUDA kernels' chunk (4096 values) and their per-thread stride (256).
  for (int64_t V : {1, 2, 3, 255, 257, 4095, 4097, 8193, 12000}) {
    const int64_t R = 6;
    std::vector<float> h(static_cast<size_t>(R * V));
    std::uniform_int_distribution<int> level(-4, 4);  // few distinct values: many ties
    for (float& x : h) x = 0.5f * static_cast<float>(level(rng));
    std::uniform_int_distribution<int64_t> pos(0, V - 1);
    float* r1 = h.data() + 1 * V;  // the maximum twice: the lower index wins
    const int64_t a = pos(rng), b = pos(rng);
    r1[a] = r1[b] = 9.0f;
    float* r2 = h.data() + 2 * V;  // NaN everywhere but one -inf
    for (int64_t v = 0; v < V; ++v) r2[v] = nan;
    r2[pos(rng)] = -inf;
    float* r3 = h.data() + 3 * V;  // all NaN: 0
    for (int64_t v = 0; v < V; ++v) r3[v] = nan;
    float* r4 = h.data() + 4 * V;  // zeros of both signs, -0 first: index 0
    for (int64_t v = 0; v < V; ++v) r4[v] = v % 2 ? 0.0f : -0.0f;
    float* r5 = h.data() + 5 * V;  // +inf at the end behind a NaN at the front
    r5[0] = nan;
    r5[V - 1] = inf;
    for (int32_t offset : {0, 1000}) {
      // The ids go to row 1 of a [3, R] block; rows 0 and 2 must stay as they were.
      for (model::Ops* ops : {static_cast<model::Ops*>(cpu.get()), static_cast<model::Ops*>(&composed)}) {
        ops->reset_scratch();
        const TensorView logits = ops->upload(h.data(), DType::F32, Shape{R, V});
        std::vector<int32_t> init(static_cast<size_t>(3 * R), -7);
        const TensorView block = ops->upload(init.data(), DType::I32, Shape{3, R});
        ops->argmax_rows_into(logits, block.row(1), offset);
        std::vector<int32_t> got(static_cast<size_t>(3 * R));
        ops->download(block, got.data());
        for (int64_t r = 0; r < R; ++r) {
          EXPECT_EQ(got[static_cast<size_t>(R + r)], offset + argmax_ref(h.data() + r * V, V))
              << ops->name() << " V " << V << " row " << r << " offset " << offset;
          EXPECT_EQ(got[static_cast<size_t>(r)], -7);
          EXPECT_EQ(got[static_cast<size_t>(2 * R + r)], -7);
          ++rows_checked;
        }
      }
    }
  }
  EXPECT_EQ(rows_checked, 9 * 2 * 2 * 6);
  // The reference scan itself on a fixed row: the first of two equal maxima, NaN skipped.
  const float fixed[] = {1.0f, 3.0f, nan, 3.0f, -inf};
  EXPECT_EQ(argmax_ref(fixed, 5), 1);
}

}  // namespace
}  // namespace kiln::backend
