// compare_ops / startup_op_check: every op of one Ops against another on the same random inputs (see op_check.h).
// Inputs are made on the host, then placed / uploaded to each backend; outputs are downloaded and compared as
// fp32. Persistent tensors (KV pools, conv / recurrent state) carry over two steps so that state handling (a
// prefill of mixed lengths, then a mixed decode + chunk step with a fresh sequence) is checked too.
#include "backend/op_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "core/error.h"
#include "core/log.h"
#include "backend/backend.h"
#include "core/tensor.h"
#include "model/blocks.h"

namespace kiln::backend {

std::string OpCheck::str() const {
  if (mismatches) return fmt::format("{}: {} mismatching ids", op, mismatches);
  if (!finite) return fmt::format("{}: NaN or inf in the output", op);
  return fmt::format("{}: rel {:.2e} (max abs {:.2e}, tol {:.0e})", op, rel_err, max_abs_err, tol);
}

std::string op_check_failures(const std::vector<OpCheck>& results) {
  if (results.empty()) return "no op was checked";
  std::vector<const OpCheck*> failed;
  for (const OpCheck& r : results)
    if (!r.passed()) failed.push_back(&r);
  if (failed.empty()) return {};
  std::string what;
  for (size_t i = 0; i < failed.size() && i < 4; ++i) what += (i ? "; " : "") + failed[i]->str();
  if (failed.size() > 4) what += fmt::format("; and {} more", failed.size() - 4);
  return fmt::format("{} of {} op checks disagree ({})", failed.size(), results.size(), what);
}

namespace {

using model::Ops;

struct Pair {
  TensorView test, ref;
};

// A view of `base` with another shape / strides (elements) at an element offset, on both backends.
Pair view_of(const Pair& base, int64_t offset, Shape shape, std::initializer_list<int64_t> strides) {
  return {model::strided_view(base.test, offset, shape, strides), model::strided_view(base.ref, offset, shape, strides)};
}

class Harness {
 public:
  Harness(Ops& test, Ops& ref, const OpCheckConfig& c) : t_(test), r_(ref), c_(c), rng_(c.seed) {}

  std::vector<OpCheck> results;

  // ---- inputs

  TensorView host(DType dtype, Shape shape) {
    const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    host_.emplace_back(std::max<size_t>(bytes, 64));
    std::memset(host_.back().data(), 0, host_.back().size());
    return TensorView(host_.back().data(), dtype, shape);
  }
  float normal(float stddev) { return std::normal_distribution<float>(0.0f, stddev)(rng_); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng_); }
  int32_t below(int32_t n) { return std::uniform_int_distribution<int32_t>(0, n - 1)(rng_); }

  // Random normal values stored as F32 / BF16 / F16.
  TensorView host_normal(DType dtype, Shape shape, float stddev, float mean = 0.0f) {
    TensorView t = host(dtype, shape);
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float v = mean + normal(stddev);
      switch (dtype) {
        case DType::F32: t.ptr<float>()[i] = v; break;
        case DType::BF16: t.ptr<uint16_t>()[i] = f32_to_bf16(v); break;
        case DType::F16: t.ptr<uint16_t>()[i] = f32_to_f16(v); break;
        default: KILN_CHECK(false, "host_normal dtype {}", dtype_name(dtype));
      }
    }
    return t;
  }
  TensorView host_uniform(Shape shape, float lo, float hi) {
    TensorView t = host(DType::F32, shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = uniform(lo, hi);
    return t;
  }
  TensorView host_ids(Shape shape, int32_t n) {
    TensorView t = host(DType::I32, shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.ptr<int32_t>()[i] = below(n);
    return t;
  }

  Pair place(const TensorView& h) {
    Pair p{t_.place_weight(h), r_.place_weight(h)};
    t_.finish_weights();  // h may go once placed
    r_.finish_weights();
    return p;
  }
  Pair upload(const TensorView& h) { return {t_.upload(h.data, h.dtype, h.shape), r_.upload(h.data, h.dtype, h.shape)}; }
  Pair scratch(DType dtype, Shape shape) { return {t_.scratch(dtype, shape), r_.scratch(dtype, shape)}; }
  Pair alloc(DType dtype, Shape shape) { return {t_.allocate(dtype, shape), r_.allocate(dtype, shape)}; }
  void reset() {
    t_.reset_scratch();
    r_.reset_scratch();
  }
  Ops& test() { return t_; }
  Ops& ref() { return r_; }
  const OpCheckConfig& config() const { return c_; }

  // A linear weight [N, K] in `format` (dense: `dtype`), random, placed on both backends.
  std::pair<LinearWeight, LinearWeight> linear_weight(WeightFormat format, DType dtype, int64_t N, int64_t K,
                                                      bool bias) {
    LinearWeight h;
    h.format = format;
    h.out_features = N;
    h.in_features = K;
    const float std_w = 1.0f / std::sqrt(static_cast<float>(K));
    switch (format) {
      case WeightFormat::dense: h.weight = host_normal(dtype, Shape{N, K}, std_w); break;
      case WeightFormat::fp8_tensor: {
        h.weight = host(DType::F8_E4M3, Shape{N, K});
        for (int64_t i = 0; i < N * K; ++i) h.weight.ptr<uint8_t>()[i] = f32_to_e4m3(normal(64.0f));
        h.scale = std_w / 64.0f;
        break;
      }
      case WeightFormat::nvfp4: {
        h.weight = host(DType::U8, Shape{N, K / 2});
        for (int64_t i = 0; i < N * K / 2; ++i) h.weight.ptr<uint8_t>()[i] = static_cast<uint8_t>(below(256));
        h.block_scale = host(DType::F8_E4M3, Shape{N, K / 16});
        for (int64_t i = 0; i < N * K / 16; ++i)
          h.block_scale.ptr<uint8_t>()[i] = f32_to_e4m3(std::exp2(uniform(-2.0f, 2.0f)));
        h.scale = std_w / 3.0f;
        break;
      }
    }
    if (bias) h.bias = host_normal(DType::F32, Shape{N}, 0.5f);
    LinearWeight a = h, b = h;
    auto put = [&](TensorView& ta, TensorView& tb, const TensorView& src) {
      if (!src.data) return;
      Pair p = place(src);
      ta = p.test;
      tb = p.ref;
    };
    put(a.weight, b.weight, h.weight);
    put(a.block_scale, b.block_scale, h.block_scale);
    put(a.bias, b.bias, h.bias);
    return {a, b};
  }

  // ---- outputs

  std::vector<float> read(Ops& ops, const TensorView& v) {
    std::vector<uint8_t> bytes(v.nbytes());
    ops.download(v, bytes.data());
    std::vector<float> out(static_cast<size_t>(v.numel()));
    const size_t es = dtype_size(v.dtype);
    for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_f32(v.dtype, bytes.data() + i * es);
    return out;
  }

  void record(const std::string& name, const std::vector<float>& got, const std::vector<float>& want, double tol) {
    OpCheck r;
    r.op = name;
    r.tol = tol;
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (!std::isfinite(got[i])) r.finite = false;
      const double d = static_cast<double>(got[i]) - want[i];
      if (std::isfinite(d)) r.max_abs_err = std::max(r.max_abs_err, std::fabs(d));
      num += d * d;
      den += static_cast<double>(want[i]) * want[i];
    }
    r.rel_err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    if (!std::isfinite(r.rel_err)) r.finite = false;
    results.push_back(r);
  }
  void compare(const std::string& name, const Pair& p, double tol = -1) {
    record(name, read(t_, p.test), read(r_, p.ref), tol < 0 ? c_.tol : tol);
  }
  void compare_ids(const std::string& name, const Pair& p) {
    const std::vector<float> a = read(t_, p.test), b = read(r_, p.ref);
    OpCheck r;
    r.op = name;
    r.tol = 0;
    for (size_t i = 0; i < a.size(); ++i) r.mismatches += a[i] != b[i];
    results.push_back(r);
  }

 private:
  Ops& t_;
  Ops& r_;
  OpCheckConfig c_;
  std::mt19937_64 rng_;
  std::vector<Buffer> host_;
};

// ---------------------------------------------------------------------------------------------------
// The checks

void check_memory_and_elementwise(Harness& h) {
  const auto& c = h.config();
  h.reset();
  const int64_t T = std::max<int64_t>(c.linear_rows.back(), 2), H = c.hidden;
  Pair x = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));

  // copy: every other column; a 3-d split of the row into two halves (the q / gate split of gated attention)
  Pair dst = h.scratch(DType::F32, Shape{T, H / 2});
  Pair src = view_of(x, 1, Shape{T, H / 2}, {H, 2});
  h.test().copy(src.test, dst.test);
  h.ref().copy(src.ref, dst.ref);
  h.compare("copy strided 2-d", dst);
  Pair dst3 = h.scratch(DType::F32, Shape{T, 2, H / 4});
  Pair src3 = view_of(x, H / 4, Shape{T, 2, H / 4}, {H, H / 2, 1});
  h.test().copy(src3.test, dst3.test);
  h.ref().copy(src3.ref, dst3.ref);
  h.compare("copy strided 3-d", dst3);

  // fill_zero, max_abs
  Pair z = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));
  h.test().fill_zero(z.test);
  h.ref().fill_zero(z.ref);
  h.compare("fill_zero", z);
  const float ma = h.test().max_abs(x.test), mb = h.ref().max_abs(x.ref);
  h.record("max_abs", {ma}, {mb}, c.tol);

  // add (out aliasing a, as the residual add does), silu_mul, sigmoid_mul (full and broadcast gate)
  Pair y = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));
  Pair acc = h.scratch(DType::F32, Shape{T, H});
  h.test().copy(x.test, acc.test);
  h.ref().copy(x.ref, acc.ref);
  h.test().add(acc.test, y.test, acc.test);
  h.ref().add(acc.ref, y.ref, acc.ref);
  h.compare("add (in place)", acc);
  Pair sm = h.scratch(DType::F32, Shape{T, H});
  h.test().silu_mul(x.test, y.test, sm.test);
  h.ref().silu_mul(x.ref, y.ref, sm.ref);
  h.compare("silu_mul", sm);
  Pair g1 = h.upload(h.host_normal(DType::F32, Shape{T, 1}, 2.0f));
  h.test().sigmoid_mul(x.test, y.test, sm.test);
  h.ref().sigmoid_mul(x.ref, y.ref, sm.ref);
  h.compare("sigmoid_mul", sm);
  h.test().sigmoid_mul(x.test, g1.test, sm.test);
  h.ref().sigmoid_mul(x.ref, g1.ref, sm.ref);
  h.compare("sigmoid_mul broadcast", sm);

  // gather_rows
  const int64_t R = 3;
  Pair rows = h.upload(h.host_ids(Shape{R}, static_cast<int32_t>(T)));
  Pair g = h.scratch(DType::F32, Shape{R, H});
  h.test().gather_rows(x.test, rows.test, g.test);
  h.ref().gather_rows(x.ref, rows.ref, g.ref);
  h.compare("gather_rows", g);

  // embedding from BF16 and F32 tables
  for (DType dt : {DType::BF16, DType::F32}) {
    Pair table = h.place(h.host_normal(dt, Shape{c.vocab, H}, 1.0f));
    Pair ids = h.upload(h.host_ids(Shape{T}, static_cast<int32_t>(c.vocab)));
    Pair e = h.scratch(DType::F32, Shape{T, H});
    h.test().embedding(table.test, ids.test, e.test);
    h.ref().embedding(table.ref, ids.ref, e.ref);
    h.compare(fmt::format("embedding {}", dtype_name(dt)), e);
  }
}

void check_norms_and_rope(Harness& h) {
  const auto& c = h.config();
  h.reset();
  const int64_t T = std::max<int64_t>(c.linear_rows.back(), 2), H = c.hidden;
  // rms_norm over strided rows (row stride H + 8), plain and zero-centred, BF16 and F32 weights
  Pair xs = h.upload(h.host_normal(DType::F32, Shape{T, H + 8}, 3.0f));
  Pair x = view_of(xs, 0, Shape{T, H}, {H + 8, 1});
  for (DType dt : {DType::BF16, DType::F32}) {
    Pair w = h.place(h.host_normal(dt, Shape{H}, 0.3f));
    for (NormKind kind : {NormKind::plain, NormKind::zero_centred}) {
      Pair out = h.scratch(DType::F32, Shape{T, H});
      h.test().rms_norm(x.test, w.test, 1e-6f, kind, out.test);
      h.ref().rms_norm(x.ref, w.ref, 1e-6f, kind, out.ref);
      h.compare(fmt::format("rms_norm {} {} strided rows", kind == NormKind::plain ? "plain" : "zero-centred",
                            dtype_name(dt)),
                out);
    }
  }
  // add_rms_norm: hidden += y (checked too), out = rms_norm(hidden); BF16 weights, both kinds; D = H and a long row
  for (int64_t D : {H, int64_t(4104)}) {
    Pair w = h.place(h.host_normal(DType::BF16, Shape{D}, 0.3f));
    for (NormKind kind : {NormKind::plain, NormKind::zero_centred}) {
      Pair hid = h.upload(h.host_normal(DType::F32, Shape{T, D}, 2.0f));
      Pair y = h.upload(h.host_normal(DType::F32, Shape{T, D}, 1.0f));
      Pair out = h.scratch(DType::F32, Shape{T, D});
      h.test().add_rms_norm(hid.test, y.test, w.test, 1e-6f, kind, out.test);
      h.ref().add_rms_norm(hid.ref, y.ref, w.ref, 1e-6f, kind, out.ref);
      const char* k = kind == NormKind::plain ? "plain" : "zero-centred";
      h.compare(fmt::format("add_rms_norm {} D={} hidden", k, D), hid);
      h.compare(fmt::format("add_rms_norm {} D={} out", k, D), out);
    }
  }
  // gated_rms_norm [T * Hv, Dv]
  {
    const int64_t R = T * c.v_heads, D = c.v_dim;
    Pair gx = h.upload(h.host_normal(DType::F32, Shape{R, D}, 1.0f));
    Pair gz = h.upload(h.host_normal(DType::F32, Shape{R, D}, 2.0f));
    Pair w = h.place(h.host_normal(DType::F32, Shape{D}, 0.5f, 1.0f));
    Pair out = h.scratch(DType::F32, Shape{R, D});
    h.test().gated_rms_norm(gx.test, gz.test, w.test, 1e-6f, out.test);
    h.ref().gated_rms_norm(gx.ref, gz.ref, w.ref, 1e-6f, out.ref);
    h.compare("gated_rms_norm", out);
  }
  // rope: partial and full rotary dims, positions up to 6000
  for (int rd : {c.rotary_dim, static_cast<int>(c.head_dim)}) {
    for (double theta : {1e4, 1e7}) {
      TensorView hx = h.host_normal(DType::F32, Shape{T, c.q_heads, c.head_dim}, 1.0f);
      Pair q = h.upload(hx);
      Pair pos = h.upload(h.host_ids(Shape{T}, 6000));
      h.test().rope(q.test, pos.test, rd, theta);
      h.ref().rope(q.ref, pos.ref, rd, theta);
      h.compare(fmt::format("rope rotary {} theta {:g}", rd, theta), q);
    }
  }
  // mrope (image positions): three positions per token, Qwen3.5's interleaved sections scaled to the rotary dim
  {
    const int half = c.rotary_dim / 2;
    const int hs = half / 3 + (half % 3 > 1 ? 1 : 0), ws = half / 3;
    const model::MRopeAxes axes = model::MRopeAxes::from_sections({half - hs - ws, hs, ws}, true, half);
    Pair q = h.upload(h.host_normal(DType::F32, Shape{T, c.q_heads, c.head_dim}, 1.0f));
    Pair pos = h.upload(h.host_ids(Shape{T, 3}, 6000));
    h.test().mrope(q.test, pos.test, c.rotary_dim, 1e7, axes);
    h.ref().mrope(q.ref, pos.ref, c.rotary_dim, 1e7, axes);
    h.compare(fmt::format("mrope rotary {}", c.rotary_dim), q);
  }
  // qk_norm_rope: q heads (the gated layout [q | gate] per head, and plain) and k heads normed and rotated by text and
  // image positions, gate halves split out; BF16 norm weights, zero-centred (Qwen3.5) and plain (Qwen3)
  for (bool gated : {true, false}) {
    for (bool image : {false, true}) {
      const int64_t D = c.head_dim, Hq = c.q_heads, Hkv = c.kv_heads;
      const NormKind kind = gated ? NormKind::zero_centred : NormKind::plain;
      const int half = c.rotary_dim / 2;
      const int hs = half / 3 + (half % 3 > 1 ? 1 : 0), ws = half / 3;
      const model::MRopeAxes axes = model::MRopeAxes::from_sections({half - hs - ws, hs, ws}, true, half);
      Pair qp = h.upload(h.host_normal(DType::F32, Shape{T, Hq * D * (gated ? 2 : 1)}, 2.0f));
      Pair kp = h.upload(h.host_normal(DType::F32, Shape{T, Hkv * D}, 2.0f));
      Pair qw = h.place(h.host_normal(DType::BF16, Shape{D}, 0.3f));
      Pair kw = h.place(h.host_normal(DType::BF16, Shape{D}, 0.3f));
      Pair pos = h.upload(h.host_ids(image ? Shape{T, 3} : Shape{T}, 6000));
      Pair qo = h.scratch(DType::F32, Shape{T, Hq, D}), ko = h.scratch(DType::F32, Shape{T, Hkv, D});
      Pair go = h.scratch(DType::F32, Shape{T, Hq * D});
      for (Ops* ops : {&h.test(), &h.ref()}) {
        const bool t = ops == &h.test();
        ops->qk_norm_rope(t ? qp.test : qp.ref, t ? kp.test : kp.ref, gated, t ? qw.test : qw.ref,
                          t ? kw.test : kw.ref, 1e-6f, kind, t ? pos.test : pos.ref, c.rotary_dim, 1e7,
                          image ? &axes : nullptr, t ? qo.test : qo.ref, gated ? (t ? go.test : go.ref) : TensorView(),
                          t ? ko.test : ko.ref);
      }
      const std::string name = fmt::format("qk_norm_rope {} {}", gated ? "gated" : "plain", image ? "m-rope" : "text");
      h.compare(name + " q", qo);
      h.compare(name + " k", ko);
      if (gated) h.compare(name + " gate", go);
    }
  }
  // scatter_rows: image embeddings over token embeddings
  {
    Pair dst = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));
    Pair src = h.upload(h.host_normal(DType::F32, Shape{2, H}, 1.0f));
    std::vector<int32_t> r2 = {static_cast<int32_t>(T - 1), 0};
    Pair rows = h.upload(TensorView(r2.data(), DType::I32, Shape{2}));
    h.test().scatter_rows(src.test, rows.test, dst.test);
    h.ref().scatter_rows(src.ref, rows.ref, dst.ref);
    h.compare("scatter_rows", dst);
  }
}

void check_linear(Harness& h) {
  const auto& c = h.config();
  struct Variant {
    WeightFormat format;
    DType dtype;
    const char* name;
    bool bias;
    int64_t k_extra;    // dense only: K not a multiple of 8 (the scalar path)
    bool tensor_cores;  // a CUDA backend may take a tensor-core path (checked at tensor_core_linear_tol)
  };
  const Variant variants[] = {
      {WeightFormat::dense, DType::BF16, "bf16", false, 0, true},
      {WeightFormat::dense, DType::BF16, "bf16+bias", true, 0, true},  // the bias added after the GEMM
      {WeightFormat::dense, DType::F32, "f32", false, 0, false},
      {WeightFormat::dense, DType::F16, "f16", false, 0, false},
      {WeightFormat::dense, DType::BF16, "bf16 K%8!=0", false, 4, false},
      {WeightFormat::fp8_tensor, DType::F8_E4M3, "fp8", false, 0, false},
      {WeightFormat::nvfp4, DType::U8, "nvfp4", false, 0, true},
  };
  for (const Variant& v : variants) {
    h.reset();
    const int64_t K = c.hidden + v.k_extra, N = c.out_features;
    auto [wt, wr] = h.linear_weight(v.format, v.dtype, N, K, v.bias);
    for (int64_t T : c.linear_rows) {
      Pair x = h.upload(h.host_normal(DType::F32, Shape{T, K}, 1.0f));
      Pair out = h.scratch(DType::F32, Shape{T, N});
      h.test().linear(x.test, wt, out.test);
      h.ref().linear(x.ref, wr, out.ref);
      h.compare(fmt::format("linear {} T={} K={} N={}", v.name, T, K, N), out,
                v.tensor_cores ? c.tensor_core_linear_tol : c.tol);
    }
  }
  // linear_gated_input: silu(x) * x2 and x * sigmoid(x2) applied as the linear reads x (bf16 and nvfp4 weights)
  for (const Variant& v : {variants[0], variants[6]}) {
    h.reset();
    const int64_t K = c.hidden, N = c.out_features;
    auto [wt, wr] = h.linear_weight(v.format, v.dtype, N, K, false);
    for (int64_t T : c.linear_rows) {
      Pair x = h.upload(h.host_normal(DType::F32, Shape{T, K}, 2.0f));
      Pair x2 = h.upload(h.host_normal(DType::F32, Shape{T, K}, 2.0f));
      for (model::InputAct act : {model::InputAct::silu_mul, model::InputAct::sigmoid_mul}) {
        Pair out = h.scratch(DType::F32, Shape{T, N});
        h.test().linear_gated_input(x.test, x2.test, act, wt, out.test);
        h.ref().linear_gated_input(x.ref, x2.ref, act, wr, out.ref);
        h.compare(fmt::format("linear_gated_input {} {} T={} K={} N={}", v.name,
                              act == model::InputAct::silu_mul ? "silu_mul" : "sigmoid_mul", T, K, N),
                  out, c.tensor_core_linear_tol);
      }
    }
  }
  // linear_multi: the projections of one x in one call (bf16: four weights of different N; nvfp4: two).
  struct Multi {
    WeightFormat format;
    DType dtype;
    const char* name;
    int count;
  };
  // bf16x3: widths the tensor-core path takes (multiples of 16) when out_features is one. bf16x3+bias: the same with
  // a BF16 bias (the checkpoints' type) on the first and last weights, placed after the three weights (which stay
  // back to back: a CUDA backend's one GEMM over them adds each bias to its own columns only).
  for (const Multi& m : {Multi{WeightFormat::dense, DType::BF16, "bf16", 4}, Multi{WeightFormat::nvfp4, DType::U8,
                                                                                  "nvfp4", 2},
                         Multi{WeightFormat::dense, DType::BF16, "bf16x3", 3},
                         Multi{WeightFormat::dense, DType::BF16, "bf16x3+bias", 3}}) {
    h.reset();
    const int64_t K = c.hidden;
    const bool biased = std::string_view(m.name) == "bf16x3+bias";
    const bool x3 = biased || std::string_view(m.name) == "bf16x3";
    const int64_t Ns[4] = {c.out_features, 32, x3 ? 2 * c.out_features : c.out_features + 8, 1};
    std::vector<std::pair<LinearWeight, LinearWeight>> ws;
    for (int i = 0; i < m.count; ++i) ws.push_back(h.linear_weight(m.format, m.dtype, Ns[i], K, false));
    for (int i = 0; biased && i < m.count; i += 2) {
      const Pair b = h.place(h.host_normal(DType::BF16, Shape{Ns[i]}, 0.5f));
      ws[static_cast<size_t>(i)].first.bias = b.test;
      ws[static_cast<size_t>(i)].second.bias = b.ref;
    }
    for (int64_t T : c.linear_rows) {
      Pair x = h.upload(h.host_normal(DType::F32, Shape{T, K}, 1.0f));
      std::vector<Pair> outs;
      std::vector<const LinearWeight*> wt, wr;
      std::vector<TensorView> ot, orf;
      for (int i = 0; i < m.count; ++i) {
        outs.push_back(h.scratch(DType::F32, Shape{T, Ns[i]}));
        wt.push_back(&ws[i].first);
        wr.push_back(&ws[i].second);
        ot.push_back(outs.back().test);
        orf.push_back(outs.back().ref);
      }
      h.test().linear_multi(x.test, wt, ot);
      h.ref().linear_multi(x.ref, wr, orf);
      for (int i = 0; i < m.count; ++i)
        h.compare(fmt::format("linear_multi {} [{}] T={} K={} N={}", m.name, i, T, K, Ns[i]), outs[i],
                  c.tensor_core_linear_tol);
    }
  }
}

// Two steps over persistent state: a prefill of mixed lengths, then decode / chunk continuations and a fresh sequence.
struct Steps {
  HostStep first, second;
  int64_t pages = 0;
  int slots = 0;
};

Steps make_steps(Harness& h) {
  const auto& c = h.config();
  Steps st;
  const int n = static_cast<int>(c.prefill_lens.size());
  const int live_slots = n + 3;
  st.slots = live_slots + 2 * n;  // then a spare pair per sequence for the second step's position checkpoints
  int max_len = 4;
  for (int len : c.prefill_lens) max_len = std::max(max_len, len + 3);
  const int pages_per_seq = (max_len + c.page_size - 1) / c.page_size;
  st.pages = static_cast<int64_t>(n + 1) * pages_per_seq;
  // Pages handed out in a shuffled order: page tables are not contiguous ranges.
  std::vector<int32_t> perm(static_cast<size_t>(st.pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(static_cast<uint32_t>(c.seed)));
  auto table_of = [&](int seq) {
    std::vector<int32_t> t(pages_per_seq);
    for (int p = 0; p < pages_per_seq; ++p) t[p] = perm[static_cast<size_t>(seq) * pages_per_seq + p];
    return t;
  };
  auto slot_of = [&](int seq) { return live_slots - 1 - seq; };  // distinct, not the identity
  st.first.page_size = st.second.page_size = c.page_size;
  st.first.max_pages = st.second.max_pages = pages_per_seq;
  for (int s = 0; s < n; ++s) st.first.add_seq(0, c.prefill_lens[s], slot_of(s), table_of(s));
  // Second step, in another order: sequence n (fresh, 2 tokens) first, then the others backwards, odd ones with
  // a 3-token chunk, even ones decoding one token.
  st.second.add_seq(0, 2, slot_of(n), table_of(n));
  for (int s = n - 1; s >= 0; --s) st.second.add_seq(c.prefill_lens[s], s % 2 ? 3 : 1, slot_of(s), table_of(s));
  // The 3-token chunks keep position checkpoints (a speculative verify): the state after each token but the last
  // goes to a spare slot, so the conv and delta-rule checks compare those slots too.
  st.second.checkpoint_slot.assign(static_cast<size_t>(st.second.num_tokens()), -1);
  for (int i = 0; i < st.second.num_seqs(); ++i) {
    const int32_t b = st.second.seq_begin[static_cast<size_t>(i)], e = st.second.seq_begin[static_cast<size_t>(i) + 1];
    if (e - b != 3) continue;
    for (int32_t t = b; t + 1 < e; ++t) st.second.checkpoint_slot[static_cast<size_t>(t)] = live_slots + 2 * i + (t - b);
  }
  return st;
}

// Runs body(step_no, step, test layout, ref layout) on each of the two steps (1, then 2), each on fresh scratch.
template <typename Body>
void for_each_step(Harness& h, const Steps& st, Body body) {
  int step_no = 0;
  for (const HostStep* hs : {&st.first, &st.second}) {
    ++step_no;
    h.reset();
    body(step_no, *hs, layout_on(h.test(), *hs), layout_on(h.ref(), *hs));
  }
}

void check_attention(Harness& h, const Steps& st) {
  const auto& c = h.config();
  const int64_t Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (DType kv : {DType::F32, DType::BF16, DType::F8_E4M3}) {
    KvLayerView ct, cr;
    Pair k_pool = h.alloc(kv, Shape{st.pages, c.page_size, Hkv, D});
    Pair v_pool = h.alloc(kv, Shape{st.pages, c.page_size, Hkv, D});
    ct.k = k_pool.test;
    ct.v = v_pool.test;
    cr.k = k_pool.ref;
    cr.v = v_pool.ref;
    for_each_step(h, st, [&](int step_no, const HostStep& hs, const StepLayout& lt, const StepLayout& lr) {
      const int64_t T = hs.num_tokens();
      TensorView hk = h.host_normal(DType::F32, Shape{T, Hkv, D}, 1.5f);
      TensorView hv = h.host_normal(DType::F32, Shape{T, Hkv, D}, 1.0f);
      if (kv == DType::F8_E4M3 && step_no == 1) {
        float km = 0, vm = 0;
        for (int64_t i = 0; i < hk.numel(); ++i) {
          km = std::max(km, std::fabs(hk.ptr<float>()[i]));
          vm = std::max(vm, std::fabs(hv.ptr<float>()[i]));
        }
        ct.k_scale = cr.k_scale = km / 448.0f;
        ct.v_scale = cr.v_scale = vm / 448.0f;
      }
      Pair k = h.upload(hk), v = h.upload(hv);
      Pair q = h.upload(h.host_normal(DType::F32, Shape{T, Hq, D}, 1.0f));
      h.test().kv_store(k.test, v.test, ct, lt);
      h.ref().kv_store(k.ref, v.ref, cr, lr);
      Pair out = h.scratch(DType::F32, Shape{T, Hq, D});
      h.test().attention(q.test, ct, lt, scale, out.test);
      h.ref().attention(q.ref, cr, lr, scale, out.ref);
      // bf16 / fp8 pools: the prefill kernel (tensor cores) may serve the step.
      h.compare(fmt::format("attention kv={} step {} (T={}, {} seqs)", dtype_name(kv), step_no, T, hs.num_seqs()),
                out, kv == DType::F32 ? c.tol : c.tensor_core_tol);
    });
    h.compare(fmt::format("kv_store pool k kv={}", dtype_name(kv)), k_pool);
    h.compare(fmt::format("kv_store pool v kv={}", dtype_name(kv)), v_pool);
  }
}

void check_deltanet(Harness& h, const Steps& st) {
  const auto& c = h.config();
  const int64_t Hk = c.k_heads, Hv = c.v_heads, Dk = c.k_dim, Dv = c.v_dim, Kc = c.conv_kernel;
  const int64_t C = 2 * Hk * Dk + Hv * Dv;
  Pair conv_w = h.place(h.host_normal(DType::BF16, Shape{C, Kc}, 0.5f));
  Pair conv_state = h.alloc(DType::F32, Shape{st.slots, C, Kc - 1});
  Pair state = h.alloc(DType::F32, Shape{st.slots, Hv, Dk, Dv});
  Pair A_log = h.place(h.host_normal(DType::F32, Shape{Hv}, 0.5f, -1.0f));
  Pair dt_bias = h.place(h.host_normal(DType::BF16, Shape{Hv}, 0.5f));
  Pair norm_w = h.place(h.host_normal(DType::BF16, Shape{Dv}, 0.5f, 1.0f));
  const DeltaRuleMode mode = c.chunked_reference ? DeltaRuleMode::chunked : DeltaRuleMode::recurrent;
  for_each_step(h, st, [&](int step_no, const HostStep& hs, const StepLayout& lt, const StepLayout& lr) {
    const int64_t T = hs.num_tokens();
    const std::string at = fmt::format("step {} (T={}, {} seqs)", step_no, T, hs.num_seqs());

    Pair x = h.upload(h.host_normal(DType::F32, Shape{T, C}, 1.0f));
    Pair conv = h.scratch(DType::F32, Shape{T, C});
    h.test().causal_conv1d_silu(x.test, conv_w.test, conv_state.test, lt, conv.test);
    h.ref().causal_conv1d_silu(x.ref, conv_w.ref, conv_state.ref, lr, conv.ref);
    h.compare("causal_conv1d_silu " + at, conv);
    h.compare("causal_conv1d_silu state " + at, conv_state);

    Pair a = h.upload(h.host_normal(DType::F32, Shape{T, Hv}, 2.0f));
    Pair b = h.upload(h.host_normal(DType::F32, Shape{T, Hv}, 2.0f));
    Pair g = h.scratch(DType::F32, Shape{T, Hv}), beta = h.scratch(DType::F32, Shape{T, Hv});
    h.test().delta_rule_gates(a.test, b.test, A_log.test, dt_bias.test, g.test, beta.test);
    h.ref().delta_rule_gates(a.ref, b.ref, A_log.ref, dt_bias.ref, g.ref, beta.ref);
    h.compare("delta_rule_gates g " + at, g);
    h.compare("delta_rule_gates beta " + at, beta);

    // The rule itself on fresh q / k / v (the conv output's split is the runner's business) and the reference's
    // gates, so that only the recurrence differs.
    Pair q = h.upload(h.host_normal(DType::F32, Shape{T, Hk, Dk}, 1.0f));
    Pair k = h.upload(h.host_normal(DType::F32, Shape{T, Hk, Dk}, 1.0f));
    Pair v = h.upload(h.host_normal(DType::F32, Shape{T, Hv, Dv}, 1.0f));
    TensorView hg = h.host(DType::F32, Shape{T, Hv}), hb = h.host(DType::F32, Shape{T, Hv});
    h.ref().download(g.ref, hg.data);
    h.ref().download(beta.ref, hb.data);
    Pair gg = h.upload(hg), bb = h.upload(hb);
    Pair out = h.scratch(DType::F32, Shape{T, Hv, Dv});
    h.test().gated_delta_rule(q.test, k.test, v.test, gg.test, bb.test, state.test, lt, mode, out.test);
    h.ref().gated_delta_rule(q.ref, k.ref, v.ref, gg.ref, bb.ref, state.ref, lr, mode, out.ref);
    h.compare(std::string("gated_delta_rule ") + (c.chunked_reference ? "vs chunked " : "") + at, out,
              c.delta_rule_tol);
    h.compare(std::string("gated_delta_rule state ") + (c.chunked_reference ? "vs chunked " : "") + at, state,
              c.delta_rule_tol);
    // Gates and rule as one op (the recurrent CUDA kernel computes the gates itself) on the raw gate inputs.
    Pair g2 = h.scratch(DType::F32, Shape{T, Hv}), beta2 = h.scratch(DType::F32, Shape{T, Hv});
    Pair out2 = h.scratch(DType::F32, Shape{T, Hv, Dv});
    h.test().gated_delta_rule_with_gates(q.test, k.test, v.test, a.test, b.test, A_log.test, dt_bias.test, g2.test,
                                         beta2.test, state.test, lt, mode, out2.test);
    h.ref().gated_delta_rule_with_gates(q.ref, k.ref, v.ref, a.ref, b.ref, A_log.ref, dt_bias.ref, g2.ref,
                                        beta2.ref, state.ref, lr, mode, out2.ref);
    h.compare(std::string("gated_delta_rule_with_gates ") + (c.chunked_reference ? "vs chunked " : "") + at, out2,
              c.delta_rule_tol);
    h.compare(std::string("gated_delta_rule_with_gates state ") + (c.chunked_reference ? "vs chunked " : "") + at,
              state, c.delta_rule_tol);
    // Gates, rule and the gated output norm as one op (with CUDA's fused decode ops: the norm inside the recurrent
    // kernel, one block per head).
    Pair z = h.upload(h.host_normal(DType::F32, Shape{T * Hv, Dv}, 2.0f));
    Pair core = h.scratch(DType::F32, Shape{T, Hv, Dv}), normed = h.scratch(DType::F32, Shape{T * Hv, Dv});
    h.test().gated_delta_rule_norm(q.test, k.test, v.test, a.test, b.test, A_log.test, dt_bias.test, g2.test,
                                   beta2.test, state.test, lt, mode, z.test, norm_w.test, 1e-6f, core.test, normed.test);
    h.ref().gated_delta_rule_norm(q.ref, k.ref, v.ref, a.ref, b.ref, A_log.ref, dt_bias.ref, g2.ref, beta2.ref,
                                  state.ref, lr, mode, z.ref, norm_w.ref, 1e-6f, core.ref, normed.ref);
    const std::string vs = c.chunked_reference ? "vs chunked " : "";
    h.compare("gated_delta_rule_norm " + vs + at, normed, c.delta_rule_tol);
    h.compare("gated_delta_rule_norm core " + vs + at, core, c.delta_rule_tol);
    h.compare("gated_delta_rule_norm state " + vs + at, state, c.delta_rule_tol);
  });
}

void check_moe(Harness& h) {
  const auto& c = h.config();
  const int64_t H = c.hidden, E = c.experts, I = c.expert_inter;
  const int k = static_cast<int>(c.top_k);
  // routing
  for (bool renorm : {true, false}) {
    h.reset();
    const int64_t T = c.linear_rows.back();
    Pair logits = h.upload(h.host_normal(DType::F32, Shape{T, E}, 2.0f));
    Pair ids = h.scratch(DType::I32, Shape{T, k}), w = h.scratch(DType::F32, Shape{T, k});
    h.test().moe_route(logits.test, k, renorm, ids.test, w.test);
    h.ref().moe_route(logits.ref, k, renorm, ids.ref, w.ref);
    h.compare_ids(fmt::format("moe_route ids renormalise={}", renorm), ids);
    h.compare(fmt::format("moe_route weights renormalise={}", renorm), w);
  }
  // experts: NVFP4 and BF16 weights; few tokens (gemv path) and enough that experts get > 16 rows (gemm path)
  for (WeightFormat f : {WeightFormat::nvfp4, WeightFormat::dense}) {
    std::vector<ExpertWeights> et(E), er(E);
    for (int64_t e = 0; e < E; ++e) {
      std::tie(et[e].gate, er[e].gate) = h.linear_weight(f, DType::BF16, I, H, false);
      std::tie(et[e].up, er[e].up) = h.linear_weight(f, DType::BF16, I, H, false);
      std::tie(et[e].down, er[e].down) = h.linear_weight(f, DType::BF16, H, I, false);
    }
    std::vector<int64_t> rows = c.linear_rows;
    rows.push_back(17 * E / k + 1);
    if (c.large_step_rows > 0) rows.push_back(c.large_step_rows);
    for (int64_t T : rows) {
      h.reset();
      TensorView hids = h.host(DType::I32, Shape{T, k});
      TensorView hw = h.host_uniform(Shape{T, k}, 0.05f, 1.0f);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int32_t> all(E);
        std::iota(all.begin(), all.end(), 0);
        for (int j = 0; j < k; ++j) {
          const int32_t pick = j + h.below(static_cast<int32_t>(E) - j);
          std::swap(all[j], all[pick]);
          hids.ptr<int32_t>()[t * k + j] = all[j];
        }
      }
      Pair x = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));
      Pair ids = h.upload(hids), w = h.upload(hw);
      Pair out = h.scratch(DType::F32, Shape{T, H});
      h.test().moe_experts(x.test, ids.test, w.test, et, out.test);
      h.ref().moe_experts(x.ref, ids.ref, w.ref, er, out.ref);
      // NVFP4 experts may run on tensor cores; others always take the fp32 kernels.
      const double tol = f == WeightFormat::nvfp4 ? c.tensor_core_tol : c.tol;
      h.compare(fmt::format("moe_experts {} T={} E={} k={}", model::weight_format_name(f), T, E, k), out, tol);
      if (T == c.linear_rows.front()) {  // with a gated shared expert's output folded in (the shared-expert layers)
        Pair shared = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));
        Pair gate = h.upload(h.host_normal(DType::F32, Shape{T, 1}, 2.0f));
        Pair out2 = h.scratch(DType::F32, Shape{T, H});
        h.test().moe_experts_shared(x.test, ids.test, w.test, et, shared.test, gate.test, out2.test);
        h.ref().moe_experts_shared(x.ref, ids.ref, w.ref, er, shared.ref, gate.ref, out2.ref);
        h.compare(fmt::format("moe_experts+shared {} T={} E={} k={}", model::weight_format_name(f), T, E, k), out2,
                  tol);
      }
      if (T <= 8) {  // routing and experts as one op (a GPU backend fuses them for decode-sized steps)
        Pair logits = h.upload(h.host_normal(DType::F32, Shape{T, E}, 2.0f));
        Pair shared = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));
        Pair gate = h.upload(h.host_normal(DType::F32, Shape{T, 1}, 2.0f));
        Pair rids = h.scratch(DType::I32, Shape{T, k}), rw = h.scratch(DType::F32, Shape{T, k});
        Pair out3 = h.scratch(DType::F32, Shape{T, H});
        h.test().moe_route_experts(x.test, logits.test, k, true, et, shared.test, gate.test, rids.test, rw.test,
                                   out3.test);
        h.ref().moe_route_experts(x.ref, logits.ref, k, true, er, shared.ref, gate.ref, rids.ref, rw.ref, out3.ref);
        h.compare_ids(fmt::format("moe_route ids of moe_route_experts T={}", T), rids);
        h.compare(fmt::format("moe_experts routed+shared {} T={} E={} k={}", model::weight_format_name(f), T, E, k),
                  out3, tol);
      }
      if (f == WeightFormat::nvfp4 && T == 1) {  // the whole MoE block as one op (CUDA: one persistent kernel)
        auto [router_t, router_r] = h.linear_weight(WeightFormat::dense, DType::BF16, E, H, false);
        auto [sg_t, sg_r] = h.linear_weight(WeightFormat::dense, DType::BF16, I, H, false);
        auto [su_t, su_r] = h.linear_weight(WeightFormat::dense, DType::BF16, I, H, false);
        auto [sd_t, sd_r] = h.linear_weight(WeightFormat::dense, DType::BF16, H, I, false);
        auto [gate_t, gate_r] = h.linear_weight(WeightFormat::dense, DType::BF16, 1, H, false);
        Pair out4 = h.scratch(DType::F32, Shape{T, H});
        // A backend that does not fuse this step returns false: nothing to compare.
        if (h.test().moe_block(x.test, nullptr, router_t, sg_t, su_t, sd_t, gate_t, et, k, true, out4.test)) {
          // The reference: model::moe's unfused ops.
          Pair logits = h.scratch(DType::F32, Shape{T, E}), g = h.scratch(DType::F32, Shape{T, I});
          Pair u = h.scratch(DType::F32, Shape{T, I}), sgate = h.scratch(DType::F32, Shape{T, 1});
          Pair shared = h.scratch(DType::F32, Shape{T, H});
          Pair rids = h.scratch(DType::I32, Shape{T, k}), rw = h.scratch(DType::F32, Shape{T, k});
          const LinearWeight* ws[] = {&router_r, &sg_r, &su_r, &gate_r};
          const TensorView outs[] = {logits.ref, g.ref, u.ref, sgate.ref};
          h.ref().linear_multi(x.ref, ws, outs);
          h.ref().linear_gated_input(g.ref, u.ref, model::InputAct::silu_mul, sd_r, shared.ref);
          h.ref().moe_route_experts(x.ref, logits.ref, k, true, er, shared.ref, sgate.ref, rids.ref, rw.ref, out4.ref);
          h.compare(fmt::format("moe_block (router + shared + nvfp4 experts) T=1 E={} k={}", E, k), out4, tol);
          // With the residual step before the block folded in: hidden += y, the input rms_norm(hidden) (1 + w).
          Pair hidden = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));
          Pair y = h.upload(h.host_normal(DType::F32, Shape{T, H}, 1.0f));
          Pair norm_w = h.upload(h.host_normal(DType::BF16, Shape{H}, 0.5f));
          Pair out5 = h.scratch(DType::F32, Shape{T, H});
          const float eps = 1e-6f;
          const model::ResidualNorm pre_t{hidden.test, y.test, norm_w.test, eps, model::NormKind::zero_centred};
          if (h.test().moe_block(TensorView(), &pre_t, router_t, sg_t, su_t, sd_t, gate_t, et, k, true, out5.test)) {
            Pair xn = h.scratch(DType::F32, Shape{T, H});
            h.ref().add_rms_norm(hidden.ref, y.ref, norm_w.ref, eps, model::NormKind::zero_centred, xn.ref);
            h.ref().linear_multi(xn.ref, ws, outs);
            h.ref().linear_gated_input(g.ref, u.ref, model::InputAct::silu_mul, sd_r, shared.ref);
            h.ref().moe_route_experts(xn.ref, logits.ref, k, true, er, shared.ref, sgate.ref, rids.ref, rw.ref,
                                      out5.ref);
            h.compare(fmt::format("moe_block add_rms_norm residual T=1 H={}", H), hidden, c.tol);
            h.compare(fmt::format("moe_block after add_rms_norm T=1 E={} k={}", E, k), out5, tol);
          }
        }
      }
    }
  }
}

// The vision encoder's ops at one shape: rows [R, D] (layer_norm, gelu, weighted_embedding over a [table_rows, D]
// table), heads [T, heads, head_dim] (rope_cos_sin, attention_segments over `segments`, T their sum).
struct VisionShape {
  int64_t rows = 0, dim = 0, heads = 0, head_dim = 0, table_rows = 0;
  std::vector<int> segments;
};

void check_vision(Harness& h, const VisionShape& v) {
  const auto& c = h.config();
  h.reset();
  const int64_t R = v.rows, D = v.dim, Hd = v.head_dim;
  // layer_norm: BF16 and F32 weight / bias, rows with a non-zero mean (the residual stream); out of place, in place
  for (DType dt : {DType::BF16, DType::F32}) {
    Pair w = h.place(h.host_normal(dt, Shape{D}, 0.2f, 1.0f));
    Pair b = h.place(h.host_normal(dt, Shape{D}, 0.2f));
    Pair x = h.upload(h.host_normal(DType::F32, Shape{R, D}, 2.0f, 0.7f));
    Pair out = h.scratch(DType::F32, Shape{R, D});
    h.test().layer_norm(x.test, w.test, b.test, 1e-6f, out.test);
    h.ref().layer_norm(x.ref, w.ref, b.ref, 1e-6f, out.ref);
    h.compare(fmt::format("layer_norm {} R={} D={}", dtype_name(dt), R, D), out);
    h.test().layer_norm(x.test, w.test, b.test, 1e-6f, x.test);
    h.ref().layer_norm(x.ref, w.ref, b.ref, 1e-6f, x.ref);
    h.compare(fmt::format("layer_norm {} in place R={} D={}", dtype_name(dt), R, D), x);
  }
  // gelu, erf and tanh forms; out of place, in place
  for (model::GeluKind kind : {model::GeluKind::erf, model::GeluKind::tanh}) {
    const char* form = kind == model::GeluKind::erf ? "erf" : "tanh";
    Pair x = h.upload(h.host_normal(DType::F32, Shape{R, D}, 2.0f));
    Pair out = h.scratch(DType::F32, Shape{R, D});
    h.test().gelu(x.test, kind, out.test);
    h.ref().gelu(x.ref, kind, out.ref);
    h.compare(fmt::format("gelu {} R={} D={}", form, R, D), out);
    h.test().gelu(x.test, kind, x.test);
    h.ref().gelu(x.ref, kind, x.ref);
    h.compare(fmt::format("gelu {} in place R={} D={}", form, R, D), x);
  }
  // weighted_embedding: 4 taps per row (the bilinear resampling), BF16 and F32 tables
  for (DType dt : {DType::BF16, DType::F32}) {
    Pair table = h.place(h.host_normal(dt, Shape{v.table_rows, D}, 1.0f));
    Pair ids = h.upload(h.host_ids(Shape{R, 4}, static_cast<int32_t>(v.table_rows)));
    Pair wts = h.upload(h.host_uniform(Shape{R, 4}, 0.0f, 1.0f));
    Pair out = h.scratch(DType::F32, Shape{R, D});
    h.test().weighted_embedding(table.test, ids.test, wts.test, out.test);
    h.ref().weighted_embedding(table.ref, ids.ref, wts.ref, out.ref);
    h.compare(fmt::format("weighted_embedding {} [{}, {}] R={} J=4", dtype_name(dt), v.table_rows, D, R), out);
  }
  // rope_cos_sin over the segments' tokens: tables of random angles
  std::vector<int32_t> cu{0};
  int64_t longest = 0;
  std::string segs;
  for (int n : v.segments) {
    cu.push_back(cu.back() + n);
    longest = std::max<int64_t>(longest, n);
    segs += (segs.empty() ? "" : ",") + std::to_string(n);
  }
  const int64_t T = cu.back(), S = static_cast<int64_t>(v.segments.size());
  {
    TensorView hc = h.host(DType::F32, Shape{T, Hd / 2}), hs = h.host(DType::F32, Shape{T, Hd / 2});
    for (int64_t i = 0; i < hc.numel(); ++i) {
      const float angle = h.uniform(-60.0f, 60.0f);
      hc.ptr<float>()[i] = std::cos(angle);
      hs.ptr<float>()[i] = std::sin(angle);
    }
    Pair cos_t = h.upload(hc), sin_t = h.upload(hs);
    Pair x = h.upload(h.host_normal(DType::F32, Shape{T, v.heads, Hd}, 1.0f));
    h.test().rope_cos_sin(x.test, cos_t.test, sin_t.test);
    h.ref().rope_cos_sin(x.ref, cos_t.ref, sin_t.ref);
    h.compare(fmt::format("rope_cos_sin T={} heads {} D={}", T, v.heads, Hd), x);
  }
  // attention_segments: each segment's tokens attend to each other only (an empty segment among them)
  {
    Pair cu_seqlens = h.upload(TensorView(cu.data(), DType::I32, Shape{S + 1}));
    Pair q = h.upload(h.host_normal(DType::F32, Shape{T, v.heads, Hd}, 1.0f));
    Pair k = h.upload(h.host_normal(DType::F32, Shape{T, v.heads, Hd}, 1.5f));
    Pair val = h.upload(h.host_normal(DType::F32, Shape{T, v.heads, Hd}, 1.0f));
    Pair out = h.scratch(DType::F32, Shape{T, v.heads, Hd});
    const float scale = 1.0f / std::sqrt(static_cast<float>(Hd));
    h.test().attention_segments(q.test, k.test, val.test, cu_seqlens.test, longest, scale, out.test);
    h.ref().attention_segments(q.ref, k.ref, val.ref, cu_seqlens.ref, longest, scale, out.ref);
    // A GPU backend may run it on tensor cores.
    h.compare(fmt::format("attention_segments heads {} D={} segments {}", v.heads, Hd, segs), out,
              c.tensor_core_tol);
  }
}

void check_vision_ops(Harness& h) {
  const auto& c = h.config();
  VisionShape at_config;  // the config's sizes; the prefill lengths as segments, an empty one second
  at_config.rows = std::max<int64_t>(c.linear_rows.back(), 2);
  at_config.dim = c.hidden;
  at_config.heads = c.q_heads;
  at_config.head_dim = c.head_dim;
  at_config.table_rows = c.vocab;
  at_config.segments = c.prefill_lens;
  at_config.segments.insert(at_config.segments.begin() + 1, 0);
  check_vision(h, at_config);
  if (c.vision_tower_shapes) {
    VisionShape tower;  // Qwen3.5's vision tower: hidden 1152 (16 heads of 72; 2 here), a 48 x 48 position grid
    tower.rows = 64;
    tower.dim = 1152;
    tower.heads = 2;
    tower.head_dim = 72;
    tower.table_rows = 2304;
    tower.segments = {1, 0, 17, 300, 1024};
    check_vision(h, tower);
  }
}

}  // namespace

std::vector<OpCheck> compare_ops(Ops& test, Ops& reference, const OpCheckConfig& config) {
  KILN_CHECK(config.hidden % 16 == 0 && config.expert_inter % 16 == 0 && !config.linear_rows.empty() &&
                 !config.prefill_lens.empty(),
             "compare_ops config");
  Harness h(test, reference, config);
  check_memory_and_elementwise(h);
  check_norms_and_rope(h);
  check_linear(h);
  const Steps steps = make_steps(h);
  check_attention(h, steps);
  check_deltanet(h, steps);
  check_moe(h);
  check_vision_ops(h);
  h.reset();
  return std::move(h.results);
}

OpCheckConfig use_bf16_input_budgets(OpCheckConfig config) {
  config.tensor_core_linear_tol = kBf16InputLinearTol;
  config.tensor_core_tol = kBf16InputTol;
  return config;
}

OpCheckConfig startup_op_check_config(bool bf16_inputs) {
  OpCheckConfig config;  // the defaults: small, every op and variant
  config.seed = 20261130;
  config.hidden = 128;         // H and I multiples of 128: the tensor-core expert kernels run too
  config.expert_inter = 128;
  config.large_step_rows = 1024;  // and the large-step expert path (wgmma on sm_90 under bf16)
  if (bf16_inputs) config = use_bf16_input_budgets(config);
  return config;
}

void startup_op_check(Ops& test, Ops& reference, bool bf16_inputs) {
  const auto start = std::chrono::steady_clock::now();
  const OpCheckConfig config = startup_op_check_config(bf16_inputs);
  const std::vector<OpCheck> results = compare_ops(test, reference, config);
  double worst = 0;
  for (const OpCheck& r : results) worst = std::max(worst, r.rel_err / std::max(r.tol, 1e-30));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  const std::string failures = op_check_failures(results);
  if (!failures.empty())
    fail("{} self-check failed against the {} backend: {}. Refusing to run on this device; --skip-self-check bypasses "
         "the check", test.name(), reference.name(), failures);
  KILN_LOG_INFO("{} self-check passed: {} op checks against the {} backend in {:.0f} ms (worst error {:.2f} of its "
                "tolerance{})",
                test.name(), results.size(), reference.name(), ms, worst,
                bf16_inputs ? fmt::format("; tensor-core ops with bf16 inputs at rel-L2 {:.0e} (linears) / {:.0e}",
                                          kBf16InputLinearTol, kBf16InputTol)
                            : std::string());
}

void HostStep::add_seq(int32_t start, int32_t n, int32_t state_slot, const std::vector<int32_t>& pages) {
  for (int32_t i = 0; i < n; ++i) token_pos.push_back(start + i);
  seq_begin.push_back(static_cast<int32_t>(token_pos.size()));
  seq_start.push_back(start);
  slot.push_back(state_slot);
  page_table.insert(page_table.end(), pages.begin(), pages.end());
  max_seq_tokens = std::max(max_seq_tokens, n);
}

model::StepLayout layout_on(model::Ops& ops, const HostStep& h) {
  model::StepLayout s;
  s.num_tokens = h.num_tokens();
  s.num_seqs = h.num_seqs();
  s.page_size = h.page_size;
  s.max_pages_per_seq = h.max_pages;
  s.host_token_pos = h.token_pos;
  s.host_seq_token_begin = h.seq_begin;
  s.host_seq_start_pos = h.seq_start;
  s.host_seq_state_slot = h.slot;
  s.host_page_table = h.page_table;
  s.host_token_checkpoint_slot = h.checkpoint_slot;
  model::upload_step(ops, s);
  return s;
}

}  // namespace kiln::backend
