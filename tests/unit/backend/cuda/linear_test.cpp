// The linear layers (linear.cu, blas_lt.cpp, and the NVFP4 tensor-core linear of moe_experts.cu) against the CPU:
// dense linears at 16..64 rows (gemv, multi-linear launches, cuBLASLt), NVFP4 linears with more rows than the gemv
// takes, both tensor-core paths with x in 3 bf16 parts (--dtype float32, rel-L2 1e-5) and rounded once to bf16
// (--dtype bfloat16: the CPU on the rounded x at 1e-5, the CPU on x within the bf16 budget), and the cuBLASLt
// wrapper against a double-precision product; biased dense BF16 linears at the vision tower's shapes on cuBLASLt (both
// dtypes, linear and linear_multi). Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <iterator>
#include <random>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/blas_lt.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/op_check.h"
#include "core/dtype.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using model::WeightFormat;
using test::checks_of;
using test::expect_all_pass;

// Each linear test runs with the tensor-core paths on (the default: x in 3 bf16 parts), on with x rounded once to
// bf16 (--dtype bfloat16: the tensor-core checks at the budget of bf16 inputs, op_check.h) and off (every linear on
// the fp32 kernels).
struct LinearPaths {
  const char* name;
  bool tensor_cores;
  bool bf16 = false;
};
CudaOptions options_of(const LinearPaths& p) {
  CudaOptions o;
  o.dense_bf16_blas = p.tensor_cores;
  o.fp4_linear_tensor_cores = p.tensor_cores;
  if (p.bf16) o.dtype = CudaOptions::ActivationDtype::bfloat16;
  return o;
}
// gtest prints the parameter by its name (not as bytes).
void PrintTo(const LinearPaths& p, std::ostream* os) { *os << p.name; }
std::string path_name(const ::testing::TestParamInfo<LinearPaths>& info) { return info.param.name; }
const auto kLinearPaths = ::testing::Values(LinearPaths{"TensorCores", true},
                                            LinearPaths{"TensorCoresBf16", true, true},
                                            LinearPaths{"Fp32Kernels", false});

// Dense linears at 16..64 rows: the gemv for small weights (multi-linear launches included), cuBLASLt for large ones,
// or everything on the fp32 kernels (CudaOptions::dense_bf16_blas off), against the CPU.
class DenseLinear : public ::testing::TestWithParam<LinearPaths> {};

TEST_P(DenseLinear, PathsMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOps gpu(options_of(GetParam()));
  OpCheckConfig c;
  if (GetParam().bf16) c = use_bf16_input_budgets(c);
  c.seed = 8;
  c.hidden = 384;
  c.out_features = 96;
  c.linear_rows = {16, 24, 33, 64, 65};
  const std::vector<OpCheck> lin = checks_of(compare_ops(gpu, *cpu, c), "linear");
  EXPECT_GE(lin.size(), 40u);
  expect_all_pass(lin, std::string("dense linears, ") + GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(Paths, DenseLinear, kLinearPaths, path_name);

// Dense NVFP4 linears with more rows than the gemv takes (prefill): on tensor cores (the routed-expert kernel with
// the weight as its only expert, x split into 3 bf16 parts or rounded once to bf16) or on the fp32 gemm
// (--fp4-gemm-backend kiln-fp32), against the CPU at the op checks' tolerance (rel-L2 1e-5; bf16 inputs: the budget).
class Nvfp4LinearManyRows : public ::testing::TestWithParam<LinearPaths> {};

TEST_P(Nvfp4LinearManyRows, MatchesCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOps gpu(options_of(GetParam()));
  OpCheckConfig c;
  if (GetParam().bf16) c = use_bf16_input_budgets(c);
  c.seed = 11;
  c.hidden = 384;        // K: 3 k-steps of 128
  c.out_features = 192;  // N: 3 blocks of 64 weight rows
  c.linear_rows = {129, 200, 517};  // partial 64-row tiles
  const std::vector<OpCheck> lin = checks_of(compare_ops(gpu, *cpu, c), "linear nvfp4");
  EXPECT_EQ(lin.size(), 3u);
  expect_all_pass(lin, std::string("nvfp4 linear, many rows, ") + GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(Paths, Nvfp4LinearManyRows, kLinearPaths, path_name);

// --dtype bfloat16 on the two tensor-core linears (dense BF16 through cuBLASLt at > 32 rows, NVFP4 on the expert
// kernel at > 128 rows), against two oracles:
//  - the CPU on x already rounded to bf16 (round to nearest even, as the device rounds): the same products, exact in
//    fp32, summed in another order: rel-L2 <= 1e-5, the op checks' fp32 tolerance. This pins that x is rounded once
//    (nothing more is lost, nothing is split) and that the one-part GEMM / kernel writes every output;
//  - the CPU on x itself: within kBf16InputLinearTol (5e-3; ~1.7e-3 expected, op_check.h), and above 2e-4, so a
//    path that silently kept fp32 accuracy (3 parts) would fail too.
// out_row0: the output is rows [out_row0, out_row0 + T) of a larger buffer (an output that is only 16-byte aligned:
// the one-part GEMM writes it directly, so cuBLASLt must pick an algorithm for that alignment).
struct Bf16LinearCase {
  WeightFormat format;
  int64_t T, K, N;
  int64_t out_row0 = 0;
};

TEST(Bf16Inputs, TensorCoreLinearsRoundXOnce) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOptions o;
  o.dtype = CudaOptions::ActivationDtype::bfloat16;
  CudaOps gpu(o);
  EXPECT_NE(gpu.describe().find("x rounded once to bf16"), std::string::npos) << gpu.describe();
  EXPECT_EQ(gpu.describe().find("x split into 3 bf16 parts"), std::string::npos) << gpu.describe();
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> octave(-2.0f, 2.0f);
  for (const Bf16LinearCase& c : {Bf16LinearCase{WeightFormat::dense, 33, 384, 96},
                                  Bf16LinearCase{WeightFormat::dense, 200, 1024, 512},
                                  Bf16LinearCase{WeightFormat::dense, 48, 256, 100, 1},  // out at byte 400
                                  // 8 and 12 rows of 4M-element weights: cuBLASLt from 8 rows with bf16 inputs
                                  // (batch-8 decode, verify passes); the gemv would keep x in fp32.
                                  Bf16LinearCase{WeightFormat::dense, 8, 2048, 2048},
                                  Bf16LinearCase{WeightFormat::dense, 12, 4096, 1024},
                                  Bf16LinearCase{WeightFormat::nvfp4, 129, 384, 192},
                                  Bf16LinearCase{WeightFormat::nvfp4, 517, 1024, 256}}) {
    const float std_w = 1.0f / std::sqrt(static_cast<float>(c.K));
    model::LinearWeight host;
    host.format = c.format;
    host.out_features = c.N;
    host.in_features = c.K;
    std::vector<uint16_t> w_bf16;
    std::vector<uint8_t> codes, scales;
    if (c.format == WeightFormat::dense) {
      w_bf16.resize(size_t(c.N * c.K));
      for (auto& v : w_bf16) v = f32_to_bf16(normal(rng) * std_w);
      host.weight = TensorView(w_bf16.data(), DType::BF16, Shape{c.N, c.K});
    } else {
      codes.resize(size_t(c.N * c.K / 2));
      for (auto& v : codes) v = static_cast<uint8_t>(rng() & 0xff);
      scales.resize(size_t(c.N * c.K / 16));
      for (auto& v : scales) v = f32_to_e4m3(std::exp2(octave(rng)));
      host.weight = TensorView(codes.data(), DType::U8, Shape{c.N, c.K / 2});
      host.block_scale = TensorView(scales.data(), DType::F8_E4M3, Shape{c.N, c.K / 16});
      host.scale = std_w / 3.0f;
    }
    auto place = [&](model::Ops& ops) {
      model::LinearWeight w = host;
      w.weight = ops.place_weight(host.weight);
      if (host.block_scale.data) w.block_scale = ops.place_weight(host.block_scale);
      ops.finish_weights();
      return w;
    };
    const model::LinearWeight w_gpu = place(gpu), w_cpu = place(*cpu);
    std::vector<float> x(size_t(c.T * c.K)), x_rounded(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = normal(rng);
      x_rounded[i] = bf16_to_f32(f32_to_bf16(x[i]));
    }
    auto run = [&](model::Ops& ops, const model::LinearWeight& w, const std::vector<float>& in) {
      ops.reset_scratch();
      const TensorView xv = ops.upload(in.data(), DType::F32, Shape{c.T, c.K});
      const TensorView buf = ops.scratch(DType::F32, Shape{c.T + c.out_row0, c.N});
      const TensorView out(buf.ptr<float>() + c.out_row0 * c.N, DType::F32, Shape{c.T, c.N});
      ops.linear(xv, w, out);
      std::vector<float> h(size_t(c.T * c.N));
      ops.download(out, h.data());
      return h;
    };
    const std::vector<float> got = run(gpu, w_gpu, x);
    const double vs_rounded = test::rel_err(got, run(*cpu, w_cpu, x_rounded));
    const double vs_exact = test::rel_err(got, run(*cpu, w_cpu, x));
    const std::string label = fmt::format("{} T={} K={} N={}{}", model::weight_format_name(c.format), c.T, c.K, c.N,
                                          c.out_row0 ? " (output 16-byte aligned)" : "");
    std::printf("[ bf16 in  ] linear %s: vs cpu on bf16(x) %.2e, vs cpu on x %.2e\n", label.c_str(), vs_rounded,
                vs_exact);
    EXPECT_LE(vs_rounded, 1e-5) << label;
    EXPECT_LE(vs_exact, kBf16InputLinearTol) << label;
    EXPECT_GE(vs_exact, 2e-4) << label << ": no sign of bf16 rounding";
  }
}

// ---- Biased dense BF16 linears on cuBLASLt (the vision tower's linears all carry a bias)

// The tower's linears (N x K): mlp.linear_fc1, mlp.linear_fc2, attn.qkv, attn.proj; BF16 biases as checkpoints store
// them (proj: F32, the other type the kernels read).
struct TowerLinear {
  const char* name;
  int64_t N, K;
  DType bias_dtype;
};
constexpr TowerLinear kTowerLinears[] = {{"fc1", 4304, 1152, DType::BF16},
                                         {"fc2", 1152, 4304, DType::BF16},
                                         {"qkv", 3456, 1152, DType::BF16},
                                         {"proj", 1152, 1152, DType::F32}};

// cuda_ops.cpp's blas_rows: cuBLASLt from 16 rows for weights of >= 4M elements, from 33 rows for any; a biased
// linear in row blocks of at most kBlasBiasedMaxRows (8192) rows, one GEMM each.
bool takes_blas(int64_t T, int64_t N, int64_t K) { return T >= 16 && (T > 32 || N * K >= (int64_t(4) << 20)); }
int64_t biased_blas_gemms(int64_t T) { return (T + 8191) / 8192; }

// Calls of the cuBLASLt path's GEMM and of its bias stage in a profile (the nested rows cuda_ops.cpp's linear
// marks: "cuBLASLt: GEMM", then "cuBLASLt: sum of the 3 parts + bias" or "cuBLASLt: + bias").
struct BlasCalls {
  int64_t gemm = 0, bias = 0;
};
BlasCalls blas_calls(const std::vector<model::OpTime>& rows) {
  BlasCalls c;
  for (const model::OpTime& r : rows) {
    if (!r.nested || r.label.find("cuBLASLt:") == std::string::npos) continue;
    if (r.label.find("GEMM") != std::string::npos) c.gemm += r.calls;
    if (r.label.find("bias") != std::string::npos) c.bias += r.calls;
  }
  return c;
}

// ops.linear_multi(x, ws) (one weight: ops.linear) with x [T, K] from the host, into outputs that start as NaN (an
// output left unwritten fails the comparison); with `prof`, the call is profiled.
std::vector<std::vector<float>> run_linears(model::Ops& ops, const std::vector<model::LinearWeight>& ws,
                                            const std::vector<float>& x, int64_t T,
                                            std::vector<model::OpTime>* prof = nullptr) {
  ops.reset_scratch();
  const int64_t K = ws[0].in_features;
  const TensorView xv = ops.upload(x.data(), DType::F32, Shape{T, K});
  std::vector<TensorView> outs;
  std::vector<const model::LinearWeight*> wp;
  for (const model::LinearWeight& w : ws) {
    const std::vector<float> nan(size_t(T * w.out_features), NAN);
    outs.push_back(ops.upload(nan.data(), DType::F32, Shape{T, w.out_features}));
    wp.push_back(&w);
  }
  if (prof) EXPECT_TRUE(ops.profile_begin());
  if (ws.size() == 1) ops.linear(xv, ws[0], outs[0]);
  else ops.linear_multi(xv, wp, outs);
  if (prof) *prof = ops.profile_end();
  std::vector<std::vector<float>> h;
  for (const TensorView& o : outs) {
    h.emplace_back(size_t(o.numel()));
    ops.download(o, h.back().data());
  }
  return h;
}

// The tower's biased linears at 16, 33, 300 and 4096 rows (4096: the patches of one 1024x1024 image; proj also at
// 8492: two row blocks) with the tensor-core paths on, against the CPU (the same bf16 weights and biases, sum + bias
// in fp32):
//  - the path: cuBLASLt where takes_blas says (its GEMM and its bias stage each ran once per row block, read from the
//    profile), else the fp32 gemv (T = 16 on qkv and proj: no cuBLASLt stage ran);
//  - --dtype float32 (x in 3 bf16 parts; the bias added where the 3 partial outputs are summed): rel-L2 <= 1e-5,
//    the op checks' fp32 tolerance (summation order only);
//  - --dtype bfloat16 (x rounded once; the bias added after the GEMM): on cuBLASLt, rel-L2 <= 1e-5 against the CPU
//    on bf16(x) and within kBf16InputLinearTol of the CPU on x, above 2e-4 (the rounding happened); on the gemv
//    (fp32), 1e-5 against the CPU on x.
// A bias that is missing, added twice or to the wrong columns is off by ~0.45 (bias std 0.5, outputs std ~1).
TEST(BiasedDenseLinear, TowerShapesTakeCublasLtAndMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOptions o16;
  o16.dtype = CudaOptions::ActivationDtype::bfloat16;
  CudaOps gpu32, gpu16(o16);
  EXPECT_NE(gpu32.describe().find("with or without a bias, added where the 3 parts are summed"), std::string::npos)
      << gpu32.describe();
  EXPECT_NE(gpu16.describe().find("with or without a bias, added after the GEMM"), std::string::npos)
      << gpu16.describe();
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr size_t kCount = std::size(kTowerLinears);
  std::vector<std::vector<uint16_t>> w_host(kCount), b_bf16(kCount);
  std::vector<std::vector<float>> b_f32(kCount);
  std::vector<model::LinearWeight> host(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    const TowerLinear& t = kTowerLinears[i];
    const float std_w = 1.0f / std::sqrt(static_cast<float>(t.K));
    w_host[i].resize(size_t(t.N * t.K));
    for (auto& v : w_host[i]) v = f32_to_bf16(normal(rng) * std_w);
    host[i].out_features = t.N;
    host[i].in_features = t.K;
    host[i].weight = TensorView(w_host[i].data(), DType::BF16, Shape{t.N, t.K});
    if (t.bias_dtype == DType::BF16) {
      b_bf16[i].resize(size_t(t.N));
      for (auto& v : b_bf16[i]) v = f32_to_bf16(0.5f * normal(rng));
      host[i].bias = TensorView(b_bf16[i].data(), DType::BF16, Shape{t.N});
    } else {
      b_f32[i].resize(size_t(t.N));
      for (auto& v : b_f32[i]) v = 0.5f * normal(rng);
      host[i].bias = TensorView(b_f32[i].data(), DType::F32, Shape{t.N});
    }
  }
  // Weights first, then the biases (the weights stay back to back, as a checkpoint's would).
  auto place = [&](model::Ops& ops) {
    std::vector<model::LinearWeight> ws = host;
    for (size_t i = 0; i < kCount; ++i) ws[i].weight = ops.place_weight(host[i].weight);
    for (size_t i = 0; i < kCount; ++i) ws[i].bias = ops.place_weight(host[i].bias);
    ops.finish_weights();
    return ws;
  };
  const std::vector<model::LinearWeight> w_cpu = place(*cpu), w32 = place(gpu32), w16 = place(gpu16);
  auto rounded = [](std::vector<float> v) {
    for (float& f : v) f = bf16_to_f32(f32_to_bf16(f));
    return v;
  };

  for (size_t i = 0; i < kCount; ++i) {
    const TowerLinear& t = kTowerLinears[i];
    std::vector<int64_t> rows = {16, 33, 300, 4096};
    if (std::string_view(t.name) == "proj") rows.push_back(8192 + 300);
    for (int64_t T : rows) {
      const std::string label = fmt::format("{} {}x{} ({} bias) T={}", t.name, t.N, t.K, dtype_name(t.bias_dtype), T);
      const bool blas = takes_blas(T, t.N, t.K);
      const int64_t gemms = blas ? biased_blas_gemms(T) : 0;
      std::vector<float> x(size_t(T * t.K));
      for (float& v : x) v = normal(rng);
      const std::vector<float> ref = run_linears(*cpu, {w_cpu[i]}, x, T)[0];

      std::vector<model::OpTime> prof;
      const std::vector<float> got32 = run_linears(gpu32, {w32[i]}, x, T, &prof)[0];
      const BlasCalls c32 = blas_calls(prof);
      EXPECT_EQ(c32.gemm, gemms) << label << " (float32)";
      EXPECT_EQ(c32.bias, gemms) << label << " (float32)";
      const double e32 = test::rel_err(got32, ref);
      EXPECT_LE(e32, 1e-5) << label << " (float32)";

      const std::vector<float> got16 = run_linears(gpu16, {w16[i]}, x, T, &prof)[0];
      const BlasCalls c16 = blas_calls(prof);
      EXPECT_EQ(c16.gemm, gemms) << label << " (bfloat16)";
      EXPECT_EQ(c16.bias, gemms) << label << " (bfloat16)";
      const double e16 = test::rel_err(got16, ref);
      double e16_rounded = -1;
      if (blas) {
        e16_rounded = test::rel_err(got16, run_linears(*cpu, {w_cpu[i]}, rounded(x), T)[0]);
        EXPECT_LE(e16_rounded, 1e-5) << label << " (bfloat16, against the CPU on bf16(x))";
        EXPECT_LE(e16, kBf16InputLinearTol) << label << " (bfloat16)";
        EXPECT_GE(e16, 2e-4) << label << " (bfloat16): no sign of bf16 rounding";
      } else {
        EXPECT_LE(e16, 1e-5) << label << " (bfloat16, fp32 gemv)";
      }
      std::printf("[ bias     ] linear %s on %s: float32 %.2e; bfloat16 %.2e vs cpu on x, %.2e vs cpu on bf16(x)\n",
                  label.c_str(), blas ? "cuBLASLt" : "the gemv", e32, e16, e16_rounded);
    }
  }

  // linear_multi over fc1 and qkv (biased) and proj without its bias: every weight on cuBLASLt from 33 rows, in one
  // call (its profile row "linear_blas ..."); each bias lands on its own weight's outputs only.
  auto multi = [](const std::vector<model::LinearWeight>& w) {
    std::vector<model::LinearWeight> m = {w[0], w[2], w[3]};
    m[2].bias = TensorView();
    return m;
  };
  const std::vector<model::LinearWeight> m_cpu = multi(w_cpu), m32 = multi(w32), m16 = multi(w16);
  for (int64_t T : {33, 300}) {
    std::vector<float> x(size_t(T * 1152));
    for (float& v : x) v = normal(rng);
    const auto ref = run_linears(*cpu, m_cpu, x, T);
    const auto ref_rounded = run_linears(*cpu, m_cpu, rounded(x), T);
    for (bool bf16 : {false, true}) {
      std::vector<model::OpTime> prof;
      const auto got = run_linears(bf16 ? static_cast<model::Ops&>(gpu16) : gpu32, bf16 ? m16 : m32, x, T, &prof);
      int64_t grouped = 0;
      for (const model::OpTime& r : prof) grouped += !r.nested && r.label.rfind("linear_blas ", 0) == 0 ? r.calls : 0;
      const std::string label = fmt::format("linear_multi fc1 + qkv + proj (no bias) T={} ({})", T,
                                            bf16 ? "bfloat16" : "float32");
      EXPECT_EQ(grouped, 1) << label;
      for (size_t j = 0; j < got.size(); ++j) {
        const double e = test::rel_err(got[j], ref[j]);
        if (bf16) {
          const double er = test::rel_err(got[j], ref_rounded[j]);
          EXPECT_LE(er, 1e-5) << label << " [" << j << "] against the CPU on bf16(x)";
          EXPECT_LE(e, kBf16InputLinearTol) << label << " [" << j << "]";
          EXPECT_GE(e, 2e-4) << label << " [" << j << "]: no sign of bf16 rounding";
        } else {
          EXPECT_LE(e, 1e-5) << label << " [" << j << "]";
        }
        std::printf("[ bias     ] %s [%zu]: %.2e vs cpu on x\n", label.c_str(), j, e);
      }
    }
  }
}

// cuBLASLt's BF16 GEMM (bf16 and f32 outputs) against the product in double of the same bf16 values.
TEST(CudaBlas, Bf16GemmMatchesReference) {
  KILN_REQUIRE_CUDA_DEVICE();
  using ::kiln::cuda::BlasLt;
  using ::kiln::cuda::DeviceBuffer;
  std::mt19937 rng(5);
  auto random_bf16 = [&](size_t n, float scale) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = f32_to_bf16(d(rng));
    return v;
  };
  auto upload = [](const std::vector<uint16_t>& h) {
    DeviceBuffer d(h.size() * 2);
    KILN_CUDA_CHECK(cudaMemcpy(d.data(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    return d;
  };
  BlasLt blas;
  struct Shape {
    int m, n, k;
  };
  for (const Shape s : {Shape{1, 2048, 2048}, Shape{7, 512, 256}, Shape{130, 384, 512}}) {
    for (bool f32 : {false, true}) {
      const auto x = random_bf16(size_t(s.m) * s.k, 1.0f), w = random_bf16(size_t(s.n) * s.k, 0.05f);
      DeviceBuffer d_x = upload(x), d_w = upload(w), d_out(size_t(s.m) * s.n * 4);
      KILN_CUDA_CHECK(cudaMemset(d_out.data(), 0xff, d_out.size()));  // NaN if not written
      blas.gemm(d_x.as<uint16_t>(), s.k, d_w.as<uint16_t>(), s.k, d_out.data(), s.n, f32, s.m, s.n, s.k, nullptr);
      KILN_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> out(size_t(s.m) * s.n);
      if (f32) {
        KILN_CUDA_CHECK(cudaMemcpy(out.data(), d_out.data(), out.size() * 4, cudaMemcpyDeviceToHost));
      } else {
        std::vector<uint16_t> o(out.size());
        KILN_CUDA_CHECK(cudaMemcpy(o.data(), d_out.data(), o.size() * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < o.size(); ++i) out[i] = bf16_to_f32(o[i]);
      }
      double num = 0, den = 0;
      for (int i = 0; i < s.m; ++i)
        for (int j = 0; j < s.n; ++j) {
          double ref = 0;
          for (int q = 0; q < s.k; ++q)
            ref += double(bf16_to_f32(x[size_t(i) * s.k + q])) * bf16_to_f32(w[size_t(j) * s.k + q]);
          const double o = out[size_t(i) * s.n + j];
          num += std::isfinite(o) ? (o - ref) * (o - ref) : INFINITY;
          den += ref * ref;
        }
      const double err = std::sqrt(num / den);
      std::printf("[ err      ] cublasLt %dx%dx%d %s out: %.3e\n", s.m, s.n, s.k, f32 ? "f32" : "bf16", err);
      EXPECT_LT(err, f32 ? 1e-4 : 1e-2) << s.m << "x" << s.n << "x" << s.k << (f32 ? " f32" : " bf16");
    }
  }
}

}  // namespace
}  // namespace kiln::backend::cuda
