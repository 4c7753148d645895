#include "backend/cuda/reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/dtype.h"

namespace kiln::cuda::ref {

float bf16(uint16_t bits) { return bf16_to_f32(bits); }
uint16_t to_bf16(double v) { return f32_to_bf16(static_cast<float>(v)); }
float round_bf16(double v) { return bf16(to_bf16(v)); }

static double silu(double x) { return x / (1.0 + std::exp(-x)); }
static double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

std::vector<float> nvfp4_dequant(const uint8_t* codes, const uint8_t* scales, float global_scale, int n, int k) {
  std::vector<float> w(size_t(n) * k);
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k; ++c) {
      const uint8_t byte = codes[size_t(r) * (k / 2) + c / 2];
      const uint8_t code = (c % 2 == 0) ? (byte & 0xf) : (byte >> 4);
      const float s = e4m3_to_f32(scales[size_t(r) * (k / 16) + c / 16]);
      w[size_t(r) * k + c] = e2m1_to_f32(code) * s * global_scale;
    }
  return w;
}

std::vector<double> linear(const uint16_t* x, int64_t ldx, const float* w, int m, int n, int k) {
  std::vector<double> out(size_t(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int c = 0; c < k; ++c) acc += double(bf16(x[i * ldx + c])) * w[size_t(j) * k + c];
      out[size_t(i) * n + j] = acc;
    }
  return out;
}

void moe_route(const float* logits, int T, int E, int k, bool renormalize, int* ids, float* weights) {
  std::vector<double> p(E);
  std::vector<int> order(E);
  for (int t = 0; t < T; ++t) {
    const float* row = logits + size_t(t) * E;
    const double mx = *std::max_element(row, row + E);
    double sum = 0.0;
    for (int e = 0; e < E; ++e) sum += p[e] = std::exp(double(row[e]) - mx);
    for (int e = 0; e < E; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    double picked = 0.0;
    for (int j = 0; j < k; ++j) picked += p[order[j]];
    for (int j = 0; j < k; ++j) {
      ids[t * k + j] = order[j];
      weights[t * k + j] = static_cast<float>(renormalize ? p[order[j]] / picked : p[order[j]]);
    }
  }
}

std::vector<uint16_t> expert_ffn(const uint16_t* x, const float* wg, const float* wu, const float* wd, int H,
                                 int I) {
  const std::vector<double> g = linear(x, H, wg, 1, I, H);
  const std::vector<double> u = linear(x, H, wu, 1, I, H);
  std::vector<uint16_t> act(I);
  for (int i = 0; i < I; ++i) act[i] = to_bf16(silu(g[i]) * u[i]);
  const std::vector<double> y = linear(act.data(), I, wd, 1, H, I);
  std::vector<uint16_t> out(H);
  for (int h = 0; h < H; ++h) out[h] = to_bf16(y[h]);
  return out;
}

void rmsnorm(const uint16_t* x, const uint16_t* w, int H, float eps, bool zero_centred, float* out) {
  double ss = 0.0;
  for (int i = 0; i < H; ++i) ss += double(bf16(x[i])) * bf16(x[i]);
  const double inv = 1.0 / std::sqrt(ss / H + eps);
  for (int i = 0; i < H; ++i) {
    const double wf = bf16(w[i]);
    out[i] = round_bf16(bf16(x[i]) * inv * (zero_centred ? 1.0 + wf : wf));
  }
}

void norm_rope(const uint16_t* x, const uint16_t* w, float eps, int pos, float theta, int rotary_dim, bool apply_norm,
               float* out) {
  constexpr int kD = 256;
  double v[kD];
  double ss = 0.0;
  for (int i = 0; i < kD; ++i) ss += double(bf16(x[i])) * bf16(x[i]);
  const double inv = 1.0 / std::sqrt(ss / kD + eps);
  for (int i = 0; i < kD; ++i) v[i] = apply_norm ? bf16(x[i]) * inv * (1.0 + bf16(w[i])) : bf16(x[i]);
  if (apply_norm) {
    const int half = rotary_dim / 2;
    double r[kD];
    std::copy(v, v + kD, r);
    for (int i = 0; i < half; ++i) {
      const float inv_freq = static_cast<float>(1.0 / std::pow(double(theta), double(2 * i) / rotary_dim));
      const double angle = static_cast<float>(float(pos) * inv_freq);  // the model forms it in fp32
      const double c = std::cos(angle), s = std::sin(angle);
      r[i] = v[i] * c - v[i + half] * s;
      r[i + half] = v[i + half] * c + v[i] * s;
    }
    std::copy(r, r + kD, v);
  }
  for (int i = 0; i < kD; ++i) out[i] = static_cast<float>(v[i]);
}

void attention_row(const float* q, const std::vector<const float*>& keys, const std::vector<const float*>& values,
                   const float* gate, float* out) {
  constexpr int kD = 256;
  const size_t n = keys.size();
  std::vector<double> s(n);
  double mx = -1e300;
  for (size_t j = 0; j < n; ++j) {
    double d = 0.0;
    for (int i = 0; i < kD; ++i) d += double(q[i]) * keys[j][i];
    s[j] = d / 16.0;
    mx = std::max(mx, s[j]);
  }
  double sum = 0.0;
  for (size_t j = 0; j < n; ++j) sum += s[j] = std::exp(s[j] - mx);
  for (int i = 0; i < kD; ++i) {
    double acc = 0.0;
    for (size_t j = 0; j < n; ++j) acc += s[j] * values[j][i];
    out[i] = static_cast<float>(acc / sum * sigmoid(gate[i]));
  }
}

void conv1d_channel(const float* x, int T, const float w[4], float window[3], float* out) {
  for (int t = 0; t < T; ++t) {
    const double y = double(w[0]) * window[0] + double(w[1]) * window[1] + double(w[2]) * window[2] +
                     double(w[3]) * x[t];
    window[0] = window[1];
    window[1] = window[2];
    window[2] = x[t];
    out[t] = round_bf16(silu(y));
  }
}

void gdn_step(const float* q, const float* k, const float* v, const float* z, float a, float b, float A_log,
              float dt_bias, const float* norm_w, float eps, int dk, int dv, double* S, float* out) {
  double sq = 0.0, sk = 0.0;
  for (int i = 0; i < dk; ++i) {
    sq += double(q[i]) * q[i];
    sk += double(k[i]) * k[i];
  }
  const double iq = 1.0 / std::sqrt(sq + 1e-6) / std::sqrt(double(dk)), ik = 1.0 / std::sqrt(sk + 1e-6);
  const double x = double(a) + dt_bias;
  const double softplus = x > 20.0 ? x : std::log1p(std::exp(x));
  const double decay = std::exp(-std::exp(double(A_log)) * softplus);
  const double beta = sigmoid(b);
  std::vector<double> o(dv);
  for (int c = 0; c < dv; ++c) {
    double* col = S + size_t(c) * dk;
    double kv = 0.0;
    for (int i = 0; i < dk; ++i) {
      col[i] *= decay;
      kv += col[i] * k[i] * ik;
    }
    const double delta = (v[c] - kv) * beta;
    double acc = 0.0;
    for (int i = 0; i < dk; ++i) {
      col[i] += k[i] * ik * delta;
      acc += col[i] * q[i] * iq;
    }
    o[c] = acc;
  }
  double ss = 0.0;
  for (int c = 0; c < dv; ++c) ss += o[c] * o[c];
  const double inv = 1.0 / std::sqrt(ss / dv + eps);
  for (int c = 0; c < dv; ++c) out[c] = static_cast<float>(norm_w[c] * o[c] * inv * silu(z[c]));
}

}  // namespace kiln::cuda::ref
