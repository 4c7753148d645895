// CpuOps: memory, elementwise ops, norms, RoPE, embedding, routing and the linear-layer entry point.
#include "backend/cpu/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/cpu/cpu_parallel.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::backend::cpu {
namespace {

size_t align64(size_t n) { return (n + 63) / 64 * 64; }

const float* f32_data(const TensorView& t) {
  KILN_CHECK(t.dtype == DType::F32, "expected F32, got {}", dtype_name(t.dtype));
  return static_cast<const float*>(t.data);
}
float* f32_mut(TensorView& t) {
  KILN_CHECK(t.dtype == DType::F32, "expected F32, got {}", dtype_name(t.dtype));
  return static_cast<float*>(t.data);
}
const int32_t* i32_data(const TensorView& t) {
  KILN_CHECK(t.dtype == DType::I32, "expected I32, got {}", dtype_name(t.dtype));
  return static_cast<const int32_t*>(t.data);
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The RMSNorm scale of one row x[0, D): 1 / sqrt(mean(x^2) + eps), the squares summed in double.
float inv_rms(const float* x, int64_t D, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[i]) * x[i];
  return 1.0f / std::sqrt(static_cast<float>(ss / D) + eps);
}

}  // namespace

float load_f32(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32: return static_cast<const float*>(t.data)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(t.data)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(t.data)[i]);
    default: return load_as_f32(t.dtype, static_cast<const char*>(t.data) + i * dtype_size(t.dtype));
  }
}

CpuOps::CpuOps() = default;
CpuOps::~CpuOps() = default;

std::string CpuOps::describe() const {
  return fmt::format("cpu backend, {} threads, matmul {}", ThreadPool::global().size(), linear_kernel_name());
}

// ---- memory

TensorView CpuOps::allocate(DType dtype, Shape shape) {
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  persistent_.emplace_back(std::max<size_t>(bytes, 64));
  std::memset(persistent_.back().data(), 0, persistent_.back().size());
  return TensorView(persistent_.back().data(), dtype, shape);
}

TensorView CpuOps::scratch(DType dtype, Shape shape) {
  const size_t bytes = align64(std::max<size_t>(static_cast<size_t>(shape.numel()) * dtype_size(dtype), 1));
  if (scratch_blocks_.empty() || scratch_used_ + bytes > scratch_blocks_.back().size()) {
    scratch_blocks_.emplace_back(std::max<size_t>(bytes, size_t{1} << 20));
    scratch_used_ = 0;
  }
  void* p = static_cast<char*>(scratch_blocks_.back().data()) + scratch_used_;
  scratch_used_ += bytes;
  scratch_in_use_ += bytes;
  scratch_high_water_ = std::max(scratch_high_water_, scratch_in_use_);
  return TensorView(p, dtype, shape);
}

model::Ops::ScratchMark CpuOps::scratch_mark() { return {scratch_blocks_.size(), scratch_used_, scratch_in_use_}; }

void CpuOps::scratch_release(const ScratchMark& mark) {
  // Blocks added since the mark hold only released views: the newest is reused from its start.
  scratch_used_ = scratch_blocks_.size() == mark.blocks ? mark.used : 0;
  scratch_in_use_ = mark.in_use;
}

void CpuOps::reset_scratch() {
  if (scratch_blocks_.size() > 1) {
    // Next step: one block big enough for the most the last step held at once.
    const size_t total = align64(scratch_high_water_ + (size_t{1} << 16));
    scratch_blocks_.clear();
    scratch_blocks_.emplace_back(total);
  }
  scratch_used_ = 0;
  scratch_in_use_ = 0;
  scratch_high_water_ = 0;
}

TensorView CpuOps::upload(const void* host, DType dtype, Shape shape) {
  TensorView t = scratch(dtype, shape);
  std::memcpy(t.data, host, t.nbytes());
  return t;
}

void CpuOps::download(const TensorView& src, void* host) {
  KILN_CHECK(src.is_contiguous(), "download of a strided view");
  std::memcpy(host, src.data, src.nbytes());
}

void CpuOps::fill_zero(TensorView t) {
  KILN_CHECK(t.is_contiguous(), "fill_zero of a strided view");
  std::memset(t.data, 0, t.nbytes());
}

void CpuOps::copy(const TensorView& src, TensorView dst) {
  KILN_CHECK(src.shape == dst.shape && src.dtype == dst.dtype, "copy {} {} -> {} {}", src.shape.str(),
             dtype_name(src.dtype), dst.shape.str(), dtype_name(dst.dtype));
  const int nd = src.ndim();
  KILN_CHECK(nd >= 1 && nd <= 4, "copy of {} dims", nd);
  const size_t es = dtype_size(src.dtype);
  // Pad to 4 dims (leading 1s).
  int64_t shape[4] = {1, 1, 1, 1}, ss[4] = {0, 0, 0, 0}, ds[4] = {0, 0, 0, 0};
  for (int i = 0; i < nd; ++i) {
    shape[4 - nd + i] = src.shape[i];
    ss[4 - nd + i] = src.strides[i];
    ds[4 - nd + i] = dst.strides[i];
  }
  const char* s = static_cast<const char*>(src.data);
  char* d = static_cast<char*>(dst.data);
  const bool inner_contig = ss[3] == 1 && ds[3] == 1;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c) {
        const int64_t so = a * ss[0] + b * ss[1] + c * ss[2], dof = a * ds[0] + b * ds[1] + c * ds[2];
        if (inner_contig) {
          std::memcpy(d + dof * es, s + so * es, shape[3] * es);
        } else {
          for (int64_t e = 0; e < shape[3]; ++e) std::memcpy(d + (dof + e * ds[3]) * es, s + (so + e * ss[3]) * es, es);
        }
      }
}

float CpuOps::max_abs(const TensorView& x) {
  KILN_CHECK(x.is_contiguous(), "max_abs of a strided view");
  const float* p = f32_data(x);
  float m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) m = std::max(m, std::fabs(p[i]));
  return m;
}

// ---- dense maths

void CpuOps::embedding(const TensorView& table, const TensorView& ids, TensorView out) {
  const int64_t T = ids.numel(), H = table.dim(1), V = table.dim(0);
  const int32_t* id = i32_data(ids);
  float* o = f32_mut(out);
  for (int64_t t = 0; t < T; ++t) {
    KILN_CHECK(id[t] >= 0 && id[t] < V, "token id {} outside [0, {})", id[t], V);
    for (int64_t h = 0; h < H; ++h) o[t * H + h] = load_f32(table, id[t] * H + h);
  }
}

void CpuOps::embedding_shard(const TensorView& table, const TensorView& ids, int64_t vocab_begin, TensorView out) {
  const int64_t T = ids.numel(), H = table.dim(1), R = table.dim(0);
  const int32_t* id = i32_data(ids);
  float* o = f32_mut(out);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = id[t] - vocab_begin;
    if (row < 0 || row >= R) {
      std::memset(o + t * H, 0, static_cast<size_t>(H) * sizeof(float));
      continue;
    }
    for (int64_t h = 0; h < H; ++h) o[t * H + h] = load_f32(table, row * H + h);
  }
}

void CpuOps::all_reduce(TensorView x) {
  if (!comm_ || comm_->size() == 1) return;
  KILN_CHECK(x.is_contiguous() && x.dtype == DType::F32, "all_reduce of a strided or non-F32 view");
  comm_->all_reduce_sum(f32_mut(x), x.numel());
}

void CpuOps::linear(const TensorView& x, const LinearWeight& w, TensorView out) {
  KILN_CHECK(x.ndim() == 2 && x.dim(1) == w.in_features && x.is_contiguous(), "linear: x {} for W [{}, {}]",
             x.shape.str(), w.out_features, w.in_features);
  KILN_CHECK(out.ndim() == 2 && out.dim(0) == x.dim(0) && out.dim(1) == w.out_features && out.is_contiguous(),
             "linear: out {} for x {} and N {}", out.shape.str(), x.shape.str(), w.out_features);
  linear_f32(f32_data(x), x.dim(0), w, f32_mut(out));
}

void CpuOps::rms_norm(const TensorView& x, const TensorView& weight, float eps, NormKind kind, TensorView out) {
  KILN_CHECK(x.ndim() == 2 && x.strides[1] == 1 && out.is_contiguous() && out.shape == x.shape,
             "rms_norm shapes {} {}", x.shape.str(), out.shape.str());
  const int64_t R = x.dim(0), D = x.dim(1), stride = x.strides[0];
  KILN_CHECK(weight.numel() == D, "rms_norm weight {} for D {}", weight.numel(), D);
  std::vector<float> w(D);
  for (int64_t i = 0; i < D; ++i) w[i] = load_f32(weight, i) + (kind == NormKind::zero_centred ? 1.0f : 0.0f);
  const float* xs = f32_data(x);
  float* o = f32_mut(out);
  for_range(R, D * 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xs + r * stride;
      const float inv = inv_rms(xr, D, eps);
      for (int64_t i = 0; i < D; ++i) o[r * D + i] = (xr[i] * inv) * w[i];
    }
  });
}

void CpuOps::gated_rms_norm(const TensorView& x, const TensorView& z, const TensorView& weight, float eps,
                            TensorView out) {
  KILN_CHECK(x.is_contiguous() && z.is_contiguous() && x.shape == z.shape && out.shape == x.shape, "gated_rms_norm");
  const int64_t R = x.dim(0), D = x.dim(1);
  std::vector<float> w(D);
  for (int64_t i = 0; i < D; ++i) w[i] = load_f32(weight, i);
  const float* xs = f32_data(x);
  const float* zs = f32_data(z);
  float* o = f32_mut(out);
  for_range(R, D * 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xs + r * D;
      const float inv = inv_rms(xr, D, eps);
      // Qwen3_5RMSNormGated: (weight * x_hat) * silu(gate)
      for (int64_t i = 0; i < D; ++i) o[r * D + i] = (w[i] * (xr[i] * inv)) * silu(zs[r * D + i]);
    }
  });
}

namespace {
// Rotary embedding over the first rotary_dim dims of each head; frequency i of token t turns by
// pos(t, i) * inv_freq[i] (rotate_half pairing i <-> i + rotary_dim / 2).
template <typename PosOf>
void rope_rows(TensorView x, int rotary_dim, double theta, PosOf pos_of) {
  KILN_CHECK(x.ndim() == 3 && x.is_contiguous(), "rope expects [T, heads, head_dim], got {}", x.shape.str());
  const int64_t T = x.dim(0), heads = x.dim(1), D = x.dim(2);
  const int half = rotary_dim / 2;
  KILN_CHECK(rotary_dim % 2 == 0 && rotary_dim <= D, "rotary dim {} for head dim {}", rotary_dim, D);
  std::vector<float> inv_freq(half);
  for (int i = 0; i < half; ++i)
    inv_freq[i] = static_cast<float>(1.0 / std::pow(theta, static_cast<double>(2 * i) / rotary_dim));
  float* xs = f32_mut(x);
  for_range(T, heads * D * 2, [&](int64_t b, int64_t e) {
    std::vector<float> cs(half), sn(half);
    for (int64_t t = b; t < e; ++t) {
      for (int i = 0; i < half; ++i) {
        const float angle = static_cast<float>(pos_of(t, i)) * inv_freq[i];
        cs[i] = std::cos(angle);
        sn[i] = std::sin(angle);
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xs + (t * heads + h) * D;
        for (int i = 0; i < half; ++i) {
          const float a = v[i], c = v[i + half];
          v[i] = a * cs[i] - c * sn[i];         // x * cos + rotate_half(x) * sin, rotate_half = [-x2, x1]
          v[i + half] = c * cs[i] + a * sn[i];
        }
      }
    }
  });
}
}  // namespace

void CpuOps::rope(TensorView x, const TensorView& positions, int rotary_dim, double theta) {
  KILN_CHECK(positions.numel() == x.dim(0), "rope: {} positions for {} tokens", positions.numel(), x.dim(0));
  const int32_t* pos = i32_data(positions);
  rope_rows(x, rotary_dim, theta, [&](int64_t t, int) { return pos[t]; });
}

void CpuOps::mrope(TensorView x, const TensorView& positions, int rotary_dim, double theta,
                   const model::MRopeAxes& axes) {
  KILN_CHECK(positions.numel() == 3 * x.dim(0), "mrope: {} positions for {} tokens (3 each)", positions.numel(),
             x.dim(0));
  const int32_t* pos = i32_data(positions);
  rope_rows(x, rotary_dim, theta, [&](int64_t t, int i) { return pos[t * 3 + axes.axis(i)]; });
}

void CpuOps::scatter_rows(const TensorView& src, const TensorView& rows, TensorView dst) {
  const int64_t R = rows.numel(), H = dst.dim(1);
  KILN_CHECK(src.ndim() == 2 && src.dim(0) == R && src.dim(1) == H, "scatter_rows: src {} for {} rows of {}",
             src.shape.str(), R, H);
  KILN_CHECK(src.dtype == dst.dtype && (src.dtype == DType::F32 || src.dtype == DType::I32) && src.is_contiguous() &&
                 dst.is_contiguous(),
             "scatter_rows: src {} and dst {} (both F32 or both I32, contiguous)", dtype_name(src.dtype),
             dtype_name(dst.dtype));
  const int32_t* r = i32_data(rows);
  const char* ps = static_cast<const char*>(src.data);
  char* o = static_cast<char*>(dst.data);
  const size_t row_bytes = static_cast<size_t>(H) * 4;  // F32 and I32 rows alike: bytes as they are
  for (int64_t i = 0; i < R; ++i) {
    KILN_CHECK(r[i] >= 0 && r[i] < dst.dim(0), "scatter row {} of {}", r[i], dst.dim(0));
    std::memcpy(o + r[i] * row_bytes, ps + i * row_bytes, row_bytes);
  }
}

void CpuOps::add(const TensorView& a, const TensorView& b, TensorView out) {
  KILN_CHECK(a.shape == b.shape && a.shape == out.shape, "add {} {} {}", a.shape.str(), b.shape.str(), out.shape.str());
  const float* pa = f32_data(a);
  const float* pb = f32_data(b);
  float* o = f32_mut(out);
  for_range(a.numel(), 1, [&](int64_t s, int64_t e) {
    for (int64_t i = s; i < e; ++i) o[i] = pa[i] + pb[i];
  });
}

void CpuOps::silu_mul(const TensorView& gate, const TensorView& up, TensorView out) {
  KILN_CHECK(gate.shape == up.shape && gate.shape == out.shape, "silu_mul shapes");
  const float* g = f32_data(gate);
  const float* u = f32_data(up);
  float* o = f32_mut(out);
  for_range(gate.numel(), 8, [&](int64_t s, int64_t e) {
    for (int64_t i = s; i < e; ++i) o[i] = silu(g[i]) * u[i];
  });
}

void CpuOps::sigmoid_mul(const TensorView& x, const TensorView& g, TensorView out) {
  const int64_t T = x.dim(0), N = x.numel() / std::max<int64_t>(T, 1);
  const int64_t gn = g.numel() / std::max<int64_t>(T, 1);
  KILN_CHECK(g.dim(0) == T && (gn == N || gn == 1) && out.shape == x.shape, "sigmoid_mul {} {}", x.shape.str(),
             g.shape.str());
  const float* px = f32_data(x);
  const float* pg = f32_data(g);
  float* o = f32_mut(out);
  for_range(T, N * 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t i = 0; i < N; ++i) o[t * N + i] = px[t * N + i] * sigmoid(pg[t * gn + (gn == 1 ? 0 : i)]);
  });
}

void CpuOps::gather_rows(const TensorView& x, const TensorView& rows, TensorView out) {
  const int64_t R = rows.numel(), H = x.dim(1);
  KILN_CHECK(x.dtype == out.dtype && (x.dtype == DType::F32 || x.dtype == DType::I32) && x.is_contiguous() &&
                 out.is_contiguous(),
             "gather_rows: x {} and out {} (both F32 or both I32, contiguous)", dtype_name(x.dtype),
             dtype_name(out.dtype));
  const int32_t* r = i32_data(rows);
  const char* px = static_cast<const char*>(x.data);
  char* o = static_cast<char*>(out.data);
  const size_t row_bytes = static_cast<size_t>(H) * 4;  // F32 and I32 rows alike: bytes as they are
  for (int64_t i = 0; i < R; ++i) {
    KILN_CHECK(r[i] >= 0 && r[i] < x.dim(0), "gather row {}", r[i]);
    std::memcpy(o + i * row_bytes, px + r[i] * row_bytes, row_bytes);
  }
}

// ---- sampling

void CpuOps::argmax_rows_into(const TensorView& logits, TensorView ids, int32_t id_offset) {
  KILN_CHECK(logits.ndim() == 2 && logits.is_contiguous() && ids.dtype == DType::I32 && ids.is_contiguous() &&
                 ids.numel() == logits.dim(0),
             "argmax_rows_into: logits {} for ids {} {}", logits.shape.str(), ids.shape.str(), dtype_name(ids.dtype));
  const float* l = f32_data(logits);
  const int64_t R = logits.dim(0), V = logits.dim(1);
  int32_t* out = static_cast<int32_t*>(ids.data);
  for (int64_t r = 0; r < R; ++r) out[r] = id_offset + model::host_argmax(l + r * V, V);
}

// ---- routing

void CpuOps::moe_route(const TensorView& logits, int top_k, bool renormalise, TensorView expert_ids,
                       TensorView weights) {
  const int64_t T = logits.dim(0), E = logits.dim(1);
  KILN_CHECK(top_k > 0 && top_k <= E, "top_k {} of {} experts", top_k, E);
  const float* l = f32_data(logits);
  int32_t* ids = static_cast<int32_t*>(expert_ids.data);
  float* w = f32_mut(weights);
  std::vector<float> p(E);
  std::vector<int32_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* lt = l + t * E;
    const float m = *std::max_element(lt, lt + E);
    float sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(lt[e] - m));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float top_sum = 0;
    for (int j = 0; j < top_k; ++j) top_sum += p[order[j]];
    for (int j = 0; j < top_k; ++j) {
      ids[t * top_k + j] = order[j];
      w[t * top_k + j] = renormalise ? p[order[j]] / top_sum : p[order[j]];
    }
  }
}

void CpuOps::moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                         std::span<const ExpertWeights> experts, TensorView out) {
  const int64_t T = x.dim(0), H = x.dim(1), k = expert_ids.dim(1), E = static_cast<int64_t>(experts.size());
  const int32_t* ids = i32_data(expert_ids);
  const float* w = f32_data(weights);
  const float* px = f32_data(x);
  float* o = f32_mut(out);
  std::memset(o, 0, static_cast<size_t>(T * H) * sizeof(float));
  // Tokens per expert, experts in ascending id (the order transformers accumulates in).
  std::vector<std::vector<std::pair<int64_t, float>>> routed(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      KILN_CHECK(e >= 0 && e < E, "expert id {} of {}", e, E);
      routed[e].emplace_back(t, w[t * k + j]);
    }
  std::vector<float> xg, gate, up, y;
  for (int64_t e = 0; e < E; ++e) {
    const ExpertWeights& ew = experts[e];
    if (routed[e].empty() || !ew.gate.present()) continue;  // not routed to, or another EP rank's expert
    const int64_t n = static_cast<int64_t>(routed[e].size()), I = ew.gate.out_features;
    xg.resize(n * H);
    for (int64_t i = 0; i < n; ++i) std::memcpy(&xg[i * H], px + routed[e][i].first * H, H * sizeof(float));
    gate.resize(n * I);
    up.resize(n * I);
    y.resize(n * H);
    linear_f32(xg.data(), n, ew.gate, gate.data());
    linear_f32(xg.data(), n, ew.up, up.data());
    for (int64_t i = 0; i < n * I; ++i) gate[i] = silu(gate[i]) * up[i];
    linear_f32(gate.data(), n, ew.down, y.data());
    for (int64_t i = 0; i < n; ++i) {
      float* ot = o + routed[e][i].first * H;
      const float wt = routed[e][i].second;
      for (int64_t h = 0; h < H; ++h) ot[h] += y[i * H + h] * wt;
    }
  }
}

}  // namespace kiln::backend::cpu
