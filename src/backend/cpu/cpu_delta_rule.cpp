// CPU Gated DeltaNet pieces: the causal depthwise conv with state, the decay / beta gates, and the gated delta
// rule itself (token-by-token recurrence, and the chunked UT-transform form transformers uses for prefill).
// Both follow modeling_qwen3_5.py's torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::backend::cpu {
namespace {

constexpr int kChunk = 64;
constexpr float kL2Eps = 1e-6f;

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// x * rsqrt(sum x^2 + eps), in place.
void l2_normalise(float* x, int64_t n) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss) + kL2Eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

struct HeadInputs {
  const float* q;  // [T, Hk, Dk]
  const float* k;
  const float* v;  // [T, Hv, Dv]
  const float* g;  // [T, Hv]
  const float* beta;
  int64_t Hk, Hv, Dk, Dv;
  int64_t ldq, ldk, ldv;  // row (token) strides of q, k, v in elements
};

// One sequence, one value head, tokens [t0, t0 + n): recurrence. S [Dk, Dv] updated in place. checkpoint(t), when
// given, is where the state after token t is copied (null: nowhere): the step's position checkpoints.
void recurrent_head(const HeadInputs& in, int64_t h, int64_t t0, int64_t n, float* S, float* out /*[T, Hv, Dv]*/,
                    const std::function<float*(int64_t t)>& checkpoint) {
  const int64_t Dk = in.Dk, Dv = in.Dv, kh = h / (in.Hv / in.Hk);
  std::vector<float> q(Dk), k(Dk), kv_mem(Dv), delta(Dv);
  const float q_scale = std::sqrt(static_cast<float>(Dk));
  for (int64_t t = t0; t < t0 + n; ++t) {
    std::memcpy(q.data(), in.q + t * in.ldq + kh * Dk, Dk * sizeof(float));
    std::memcpy(k.data(), in.k + t * in.ldk + kh * Dk, Dk * sizeof(float));
    l2_normalise(q.data(), Dk);
    l2_normalise(k.data(), Dk);
    for (int64_t i = 0; i < Dk; ++i) q[i] /= q_scale;  // query / sqrt(Dk)
    const float decay = std::exp(in.g[t * in.Hv + h]);
    const float beta = in.beta[t * in.Hv + h];
    const float* v = in.v + t * in.ldv + h * Dv;
    for (int64_t i = 0; i < Dk * Dv; ++i) S[i] *= decay;
    std::fill(kv_mem.begin(), kv_mem.end(), 0.0f);
    for (int64_t i = 0; i < Dk; ++i)
      for (int64_t j = 0; j < Dv; ++j) kv_mem[j] += S[i * Dv + j] * k[i];
    for (int64_t j = 0; j < Dv; ++j) delta[j] = (v[j] - kv_mem[j]) * beta;
    for (int64_t i = 0; i < Dk; ++i)
      for (int64_t j = 0; j < Dv; ++j) S[i * Dv + j] += k[i] * delta[j];
    float* o = out + (t * in.Hv + h) * Dv;
    std::fill(o, o + Dv, 0.0f);
    for (int64_t i = 0; i < Dk; ++i)
      for (int64_t j = 0; j < Dv; ++j) o[j] += S[i * Dv + j] * q[i];
    if (float* dst = checkpoint ? checkpoint(t) : nullptr) std::copy(S, S + Dk * Dv, dst);
  }
}

// One sequence, one value head, tokens [t0, t0 + n): chunks of 64 with the UT transform.
void chunked_head(const HeadInputs& in, int64_t h, int64_t t0, int64_t n, float* S, float* out) {
  const int64_t Dk = in.Dk, Dv = in.Dv, kh = h / (in.Hv / in.Hk);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));  // query * Dk^-0.5
  std::vector<float> q(kChunk * Dk), k(kChunk * Dk), kb(kChunk * Dk), vb(kChunk * Dv), cs(kChunk);
  std::vector<float> A(kChunk * kChunk), U(kChunk * Dv), W(kChunk * Dk), vnew(kChunk * Dv), row(Dv);
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min<int64_t>(kChunk, n - c0);
    float cum = 0;
    for (int64_t i = 0; i < m; ++i) {
      const int64_t t = t0 + c0 + i;
      std::memcpy(&q[i * Dk], in.q + t * in.ldq + kh * Dk, Dk * sizeof(float));
      std::memcpy(&k[i * Dk], in.k + t * in.ldk + kh * Dk, Dk * sizeof(float));
      l2_normalise(&q[i * Dk], Dk);
      l2_normalise(&k[i * Dk], Dk);
      const float beta = in.beta[t * in.Hv + h];
      for (int64_t d = 0; d < Dk; ++d) {
        q[i * Dk + d] *= q_scale;
        kb[i * Dk + d] = k[i * Dk + d] * beta;
      }
      const float* v = in.v + t * in.ldv + h * Dv;
      for (int64_t d = 0; d < Dv; ++d) vb[i * Dv + d] = v[d] * beta;
      cum += in.g[t * in.Hv + h];
      cs[i] = cum;  // cumulative log-decay inside the chunk
    }
    // A[i][j] = (k_beta_i . k_j) exp(cs_i - cs_j), j < i (the strictly lower part of the UT system).
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < i; ++j) {
        float dot = 0;
        for (int64_t d = 0; d < Dk; ++d) dot += kb[i * Dk + d] * k[j * Dk + d];
        A[i * kChunk + j] = dot * std::exp(cs[i] - cs[j]);
      }
    // (I + A) U = v_beta and (I + A) W = k_beta exp(cs), by forward substitution.
    for (int64_t i = 0; i < m; ++i) {
      const float e = std::exp(cs[i]);
      for (int64_t d = 0; d < Dv; ++d) U[i * Dv + d] = vb[i * Dv + d];
      for (int64_t d = 0; d < Dk; ++d) W[i * Dk + d] = kb[i * Dk + d] * e;
      for (int64_t j = 0; j < i; ++j) {
        const float a = A[i * kChunk + j];
        for (int64_t d = 0; d < Dv; ++d) U[i * Dv + d] -= a * U[j * Dv + d];
        for (int64_t d = 0; d < Dk; ++d) W[i * Dk + d] -= a * W[j * Dk + d];
      }
    }
    // v_new = U - W S;  out = (q exp(cs)) S + sum_{j<=i} (q_i . k_j) exp(cs_i - cs_j) v_new_j.
    for (int64_t i = 0; i < m; ++i) {
      std::fill(row.begin(), row.end(), 0.0f);
      for (int64_t d = 0; d < Dk; ++d) {
        const float w = W[i * Dk + d];
        for (int64_t j = 0; j < Dv; ++j) row[j] += w * S[d * Dv + j];
      }
      for (int64_t j = 0; j < Dv; ++j) vnew[i * Dv + j] = U[i * Dv + j] - row[j];
    }
    for (int64_t i = 0; i < m; ++i) {
      const int64_t t = t0 + c0 + i;
      float* o = out + (t * in.Hv + h) * Dv;
      const float e = std::exp(cs[i]);
      std::fill(row.begin(), row.end(), 0.0f);
      for (int64_t d = 0; d < Dk; ++d) {
        const float qd = q[i * Dk + d] * e;
        for (int64_t j = 0; j < Dv; ++j) row[j] += qd * S[d * Dv + j];
      }
      for (int64_t j = 0; j <= i; ++j) {
        float dot = 0;
        for (int64_t d = 0; d < Dk; ++d) dot += q[i * Dk + d] * k[j * Dk + d];
        const float a = dot * std::exp(cs[i] - cs[j]);
        for (int64_t x = 0; x < Dv; ++x) row[x] += a * vnew[j * Dv + x];
      }
      std::copy(row.begin(), row.end(), o);
    }
    // S = S exp(cs_last) + sum_i (k_i exp(cs_last - cs_i)) (outer) v_new_i
    const float last = cs[m - 1], chunk_decay = std::exp(last);
    for (int64_t i = 0; i < Dk * Dv; ++i) S[i] *= chunk_decay;
    for (int64_t i = 0; i < m; ++i) {
      const float e = std::exp(last - cs[i]);
      for (int64_t d = 0; d < Dk; ++d) {
        const float kd = k[i * Dk + d] * e;
        for (int64_t j = 0; j < Dv; ++j) S[d * Dv + j] += kd * vnew[i * Dv + j];
      }
    }
  }
}

}  // namespace

void CpuOps::causal_conv1d_silu(const TensorView& x, const TensorView& weight, TensorView conv_state,
                                const StepLayout& step, TensorView out) {
  const int64_t C = x.dim(1), Kc = weight.dim(1), keep = Kc - 1;
  KILN_CHECK(weight.dim(0) == C && conv_state.dim(1) == C && conv_state.dim(2) == keep, "conv1d: x {} w {} state {}",
             x.shape.str(), weight.shape.str(), conv_state.shape.str());
  const float* px = static_cast<const float*>(x.data);
  float* po = static_cast<float*>(out.data);
  float* ps = static_cast<float*>(conv_state.data);
  const bool ckpt = !step.host_token_checkpoint_slot.empty();
  auto body = [&](int64_t c_begin, int64_t c_end) {
    std::vector<float> w(Kc), window;
    for (int64_t c = c_begin; c < c_end; ++c) {
      for (int64_t j = 0; j < Kc; ++j) w[j] = load_f32(weight, c * Kc + j);
      for (int s = 0; s < step.num_seqs; ++s) {
        const int64_t b = step.host_seq_token_begin[s], e = step.host_seq_token_begin[s + 1], n = e - b;
        float* state = ps + (static_cast<int64_t>(step.host_seq_state_slot[s]) * C + c) * keep;
        // window = previous Kc-1 inputs (oldest first) followed by this step's inputs
        window.assign(state, state + keep);
        for (int64_t t = b; t < e; ++t) window.push_back(px[t * C + c]);
        for (int64_t i = 0; i < n; ++i) {
          float acc = 0;
          for (int64_t j = 0; j < Kc; ++j) acc += w[j] * window[i + j];
          po[(b + i) * C + c] = silu(acc);
          // A position checkpoint: the state after token b + i (its last Kc - 1 inputs) into another slot.
          const int32_t cs = ckpt ? step.host_token_checkpoint_slot[b + i] : -1;
          if (cs >= 0) std::copy(window.begin() + i + 1, window.begin() + i + 1 + keep, ps + (cs * C + c) * keep);
        }
        std::copy(window.end() - keep, window.end(), state);
      }
    }
  };
  if (C * step.num_tokens * Kc < (int64_t{1} << 15))
    body(0, C);
  else
    ThreadPool::global().parallel_for(C, body, 16);
}

void CpuOps::delta_rule_gates(const TensorView& a, const TensorView& b, const TensorView& A_log,
                              const TensorView& dt_bias, TensorView g, TensorView beta) {
  const int64_t T = a.dim(0), Hv = a.dim(1);
  const float* pa = static_cast<const float*>(a.data);
  const float* pb = static_cast<const float*>(b.data);
  float* pg = static_cast<float*>(g.data);
  float* pbeta = static_cast<float*>(beta.data);
  std::vector<float> neg_a(Hv), bias(Hv);
  for (int64_t h = 0; h < Hv; ++h) {
    neg_a[h] = -std::exp(load_f32(A_log, h));
    bias[h] = load_f32(dt_bias, h);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hv; ++h) {
      const float x = pa[t * Hv + h] + bias[h];
      const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));  // torch softplus(beta=1, threshold=20)
      pg[t * Hv + h] = neg_a[h] * softplus;
      pbeta[t * Hv + h] = 1.0f / (1.0f + std::exp(-pb[t * Hv + h]));
    }
}

void CpuOps::gated_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                              const TensorView& beta, TensorView state, const StepLayout& step, DeltaRuleMode mode,
                              TensorView out) {
  HeadInputs in{static_cast<const float*>(q.data), static_cast<const float*>(k.data),
                static_cast<const float*>(v.data), static_cast<const float*>(g.data),
                static_cast<const float*>(beta.data), q.dim(1), v.dim(1), q.dim(2), v.dim(2),
                q.dim(0) > 1 ? q.strides[0] : q.dim(1) * q.dim(2), k.dim(0) > 1 ? k.strides[0] : k.dim(1) * k.dim(2),
                v.dim(0) > 1 ? v.strides[0] : v.dim(1) * v.dim(2)};
  for (const TensorView* x : {&q, &k, &v})
    KILN_CHECK(x->ndim() == 3 && x->strides[2] == 1 && x->strides[1] == x->dim(2) &&
                   (x->dim(0) <= 1 || x->strides[0] >= x->dim(1) * x->dim(2)),
               "gated_delta_rule: q / k / v must be [T, heads, D] with contiguous heads (row stride allowed), got {}",
               x->shape.str());
  KILN_CHECK(in.Hv % in.Hk == 0 && state.dim(1) == in.Hv && state.dim(2) == in.Dk && state.dim(3) == in.Dv,
             "gated_delta_rule: q {} v {} state {}", q.shape.str(), v.shape.str(), state.shape.str());
  float* ps = static_cast<float*>(state.data);
  float* po = static_cast<float*>(out.data);
  const bool ckpt = !step.host_token_checkpoint_slot.empty();
  const int64_t items = static_cast<int64_t>(step.num_seqs) * in.Hv;
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int s = static_cast<int>(item / in.Hv);
      const int64_t h = item % in.Hv;
      const int64_t t0 = step.host_seq_token_begin[s], n = step.host_seq_token_begin[s + 1] - t0;
      float* S = ps + (static_cast<int64_t>(step.host_seq_state_slot[s]) * in.Hv + h) * in.Dk * in.Dv;
      if (ckpt) {  // position checkpoints: the recurrence, copying the state after each marked token
        recurrent_head(in, h, t0, n, S, po, [&](int64_t t) -> float* {
          const int32_t cs = step.host_token_checkpoint_slot[t];
          return cs < 0 ? nullptr : ps + (static_cast<int64_t>(cs) * in.Hv + h) * in.Dk * in.Dv;
        });
      } else if (mode == DeltaRuleMode::chunked && n > 1) {
        chunked_head(in, h, t0, n, S, po);
      } else {
        recurrent_head(in, h, t0, n, S, po, {});
      }
    }
  };
  if (step.num_tokens * in.Dk * in.Dv * 4 < (int64_t{1} << 15))
    body(0, items);
  else
    ThreadPool::global().parallel_for(items, body, 1);
}

}  // namespace kiln::backend::cpu
