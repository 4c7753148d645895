// CPU ops of the vision encoder (model/qwen3_5_vision.h): LayerNorm with bias, GELU (erf and tanh forms), rotary
// embedding from per-token cos/sin tables, bidirectional attention within segments, weighted row gathers. fp32
// activations, sums of squares and softmax denominators in double where a row is long (the reference, not the
// fastest form).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/cpu_parallel.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::backend::cpu {
namespace {

void check_f32_contiguous(const TensorView& t, const char* op, const char* what) {
  KILN_CHECK(t.dtype == DType::F32 && t.is_contiguous(), "{}: {} must be contiguous F32, got {} {}", op, what,
             dtype_name(t.dtype), t.shape.str());
}

}  // namespace

void CpuOps::layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias, float eps,
                        TensorView out) {
  check_f32_contiguous(x, "layer_norm", "x");
  check_f32_contiguous(out, "layer_norm", "out");
  KILN_CHECK(x.ndim() == 2 && out.shape == x.shape, "layer_norm: x {} out {}", x.shape.str(), out.shape.str());
  const int64_t R = x.dim(0), D = x.dim(1);
  KILN_CHECK(weight.numel() == D && bias.numel() == D, "layer_norm: weight {} bias {} for D {}", weight.numel(),
             bias.numel(), D);
  std::vector<float> w(D), b(D);
  for (int64_t i = 0; i < D; ++i) {
    w[i] = load_f32(weight, i);
    b[i] = load_f32(bias, i);
  }
  const float* xs = x.ptr<float>();
  float* o = out.ptr<float>();
  for_range(R, D * 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xs + r * D;
      double sum = 0;
      for (int64_t i = 0; i < D; ++i) sum += xr[i];
      const double mean = sum / D;
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += (xr[i] - mean) * (xr[i] - mean);
      const float m = static_cast<float>(mean);
      const float rstd = static_cast<float>(1.0 / std::sqrt(ss / D + eps));
      float* orow = o + r * D;
      for (int64_t i = 0; i < D; ++i) orow[i] = (xr[i] - m) * rstd * w[i] + b[i];
    }
  });
}

void CpuOps::gelu(const TensorView& x, GeluKind kind, TensorView out) {
  check_f32_contiguous(x, "gelu", "x");
  check_f32_contiguous(out, "gelu", "out");
  KILN_CHECK(out.numel() == x.numel(), "gelu: x {} out {}", x.shape.str(), out.shape.str());
  const float* xs = x.ptr<float>();
  float* o = out.ptr<float>();
  const float inv_sqrt2 = 0.70710678118654752f, sqrt_2_over_pi = 0.79788456080286536f;
  for_range(x.numel(), 16, [&](int64_t b, int64_t e) {
    if (kind == GeluKind::erf) {
      for (int64_t i = b; i < e; ++i) o[i] = 0.5f * xs[i] * (1.0f + std::erf(xs[i] * inv_sqrt2));
    } else {
      for (int64_t i = b; i < e; ++i) {
        const float v = xs[i];
        o[i] = 0.5f * v * (1.0f + std::tanh(sqrt_2_over_pi * (v + 0.044715f * v * v * v)));
      }
    }
  });
}

void CpuOps::rope_cos_sin(TensorView x, const TensorView& cos, const TensorView& sin) {
  check_f32_contiguous(x, "rope_cos_sin", "x");
  check_f32_contiguous(cos, "rope_cos_sin", "cos");
  check_f32_contiguous(sin, "rope_cos_sin", "sin");
  KILN_CHECK(x.ndim() == 3, "rope_cos_sin expects x [T, heads, D], got {}", x.shape.str());
  const int64_t T = x.dim(0), heads = x.dim(1), D = x.dim(2), half = D / 2;
  KILN_CHECK(D % 2 == 0 && cos.shape == sin.shape && cos.ndim() == 2 && cos.dim(0) == T && cos.dim(1) == half,
             "rope_cos_sin: x {} with cos {} sin {}", x.shape.str(), cos.shape.str(), sin.shape.str());
  float* xs = x.ptr<float>();
  const float* cs = cos.ptr<float>();
  const float* sn = sin.ptr<float>();
  for_range(T, heads * D * 2, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cs + t * half;
      const float* s = sn + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xs + (t * heads + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], z = v[i + half];
          v[i] = a * c[i] - z * s[i];  // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
          v[i + half] = z * c[i] + a * s[i];
        }
      }
    }
  });
}

void CpuOps::attention_segments(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& cu_seqlens, int64_t max_seqlen, float scale, TensorView out) {
  for (const auto* t : {&q, &k, &v}) check_f32_contiguous(*t, "attention_segments", "q/k/v");
  check_f32_contiguous(out, "attention_segments", "out");
  KILN_CHECK(q.ndim() == 3 && k.shape == q.shape && v.shape == q.shape && out.shape == q.shape,
             "attention_segments: q {} k {} v {} out {}", q.shape.str(), k.shape.str(), v.shape.str(),
             out.shape.str());
  KILN_CHECK(cu_seqlens.dtype == DType::I32 && cu_seqlens.ndim() == 1 && cu_seqlens.dim(0) >= 2,
             "attention_segments: cu_seqlens must be I32 [S + 1], got {} {}", dtype_name(cu_seqlens.dtype),
             cu_seqlens.shape.str());
  const int64_t T = q.dim(0), H = q.dim(1), D = q.dim(2), S = cu_seqlens.dim(0) - 1;
  const int32_t* cu = cu_seqlens.ptr<int32_t>();
  KILN_CHECK(cu[0] == 0 && cu[S] == T, "attention_segments: cu_seqlens runs from {} to {} for {} tokens", cu[0],
             cu[S], T);
  std::vector<int32_t> seg_of(T);
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) {
    KILN_CHECK(cu[s + 1] >= cu[s], "attention_segments: cu_seqlens decreases at {}", s);
    longest = std::max<int64_t>(longest, cu[s + 1] - cu[s]);
    for (int32_t t = cu[s]; t < cu[s + 1]; ++t) seg_of[t] = static_cast<int32_t>(s);
  }
  KILN_CHECK(longest <= max_seqlen, "attention_segments: a segment of {} tokens, max_seqlen {}", longest, max_seqlen);
  const float* pq = q.ptr<float>();
  const float* pk = k.ptr<float>();
  const float* pv = v.ptr<float>();
  float* po = out.ptr<float>();
  const int64_t row = H * D;
  auto body = [&](int64_t b, int64_t e) {
    std::vector<float> scores(static_cast<size_t>(std::max<int64_t>(longest, 1)));
    std::vector<double> acc(D);
    for (int64_t item = b; item < e; ++item) {
      const int64_t t = item / H, h = item % H;
      const int64_t j0 = cu[seg_of[t]], j1 = cu[seg_of[t] + 1];
      const float* qv = pq + t * row + h * D;
      float m = -INFINITY;
      for (int64_t j = j0; j < j1; ++j) {
        const float* kv = pk + j * row + h * D;
        float dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qv[d] * kv[d];
        scores[j - j0] = dot * scale;
        m = std::max(m, scores[j - j0]);
      }
      double sum = 0;
      for (int64_t j = j0; j < j1; ++j) sum += (scores[j - j0] = std::exp(scores[j - j0] - m));
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = j0; j < j1; ++j) {
        const double p = scores[j - j0] / sum;
        const float* vv = pv + j * row + h * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += p * vv[d];
      }
      float* o = po + t * row + h * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(acc[d]);
    }
  };
  const int64_t items = T * H;
  if (items * longest * D < (int64_t{1} << 15))
    body(0, items);
  else
    ThreadPool::global().parallel_for(items, body, std::max<int64_t>(1, 64 / std::max<int64_t>(H, 1)));
}

void CpuOps::weighted_embedding(const TensorView& table, const TensorView& ids, const TensorView& weights,
                                TensorView out) {
  KILN_CHECK(table.ndim() == 2 && table.is_contiguous(), "weighted_embedding: table {}", table.shape.str());
  KILN_CHECK(ids.dtype == DType::I32 && ids.ndim() == 2 && ids.is_contiguous(), "weighted_embedding: ids {} {}",
             dtype_name(ids.dtype), ids.shape.str());
  check_f32_contiguous(weights, "weighted_embedding", "weights");
  check_f32_contiguous(out, "weighted_embedding", "out");
  const int64_t T = ids.dim(0), J = ids.dim(1), V = table.dim(0), H = table.dim(1);
  KILN_CHECK(weights.shape == ids.shape && out.ndim() == 2 && out.dim(0) == T && out.dim(1) == H,
             "weighted_embedding: ids {} weights {} out {} for table {}", ids.shape.str(), weights.shape.str(),
             out.shape.str(), table.shape.str());
  const int32_t* id = ids.ptr<int32_t>();
  const float* w = weights.ptr<float>();
  for (int64_t i = 0; i < T * J; ++i)
    KILN_CHECK(id[i] >= 0 && id[i] < V, "weighted_embedding: row id {} outside [0, {})", id[i], V);
  float* o = out.ptr<float>();
  for_range(T, J * H * 2, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* orow = o + t * H;
      std::fill(orow, orow + H, 0.0f);
      for (int64_t j = 0; j < J; ++j) {
        const int64_t base = static_cast<int64_t>(id[t * J + j]) * H;
        const float wt = w[t * J + j];
        for (int64_t c = 0; c < H; ++c) orow[c] += load_f32(table, base + c) * wt;
      }
    }
  });
}

}  // namespace kiln::backend::cpu
