// The linear layers (linear.cu, blas_lt.cpp, and the NVFP4 tensor-core linear of moe_experts.cu) against the CPU:
// dense linears at 16..64 rows (gemv, multi-linear launches, cuBLASLt), NVFP4 linears with more rows than the gemv
// takes, and the cuBLASLt wrapper against a double-precision product. Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <ostream>
#include <string>
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

using test::expect_all_pass;
using test::checks_of;

// Each linear test runs with the tensor-core paths on (the default) and off (every linear on the fp32 kernels).
struct LinearPaths {
  const char* name;
  bool tensor_cores;
};
// gtest prints the parameter by its name (not as bytes).
void PrintTo(const LinearPaths& p, std::ostream* os) { *os << p.name; }
std::string path_name(const ::testing::TestParamInfo<LinearPaths>& info) { return info.param.name; }
const auto kLinearPaths = ::testing::Values(LinearPaths{"TensorCores", true}, LinearPaths{"Fp32Kernels", false});

// Dense linears at 16..64 rows: the gemv for small weights (multi-linear launches included), cuBLASLt for large ones,
// or everything on the fp32 kernels (CudaOptions::dense_bf16_blas off), against the CPU.
class DenseLinear : public ::testing::TestWithParam<LinearPaths> {};

TEST_P(DenseLinear, PathsMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOptions o;
  o.dense_bf16_blas = GetParam().tensor_cores;
  CudaOps gpu(o);
  OpCheckConfig c;
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
// the weight as its only expert, x split into 3 bf16 parts) or on the fp32 gemm (--fp4-gemm-backend kiln-fp32),
// against the CPU at the op checks' tolerance (rel-L2 1e-5).
class Nvfp4LinearManyRows : public ::testing::TestWithParam<LinearPaths> {};

TEST_P(Nvfp4LinearManyRows, MatchesCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOptions o;
  o.fp4_linear_tensor_cores = GetParam().tensor_cores;
  CudaOps gpu(o);
  OpCheckConfig c;
  c.seed = 11;
  c.hidden = 384;        // K: 3 k-steps of 128
  c.out_features = 192;  // N: 3 blocks of 64 weight rows
  c.linear_rows = {129, 200, 517};  // partial 64-row tiles
  const std::vector<OpCheck> lin = checks_of(compare_ops(gpu, *cpu, c), "linear nvfp4");
  EXPECT_EQ(lin.size(), 3u);
  expect_all_pass(lin, std::string("nvfp4 linear, many rows, ") + GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(Paths, Nvfp4LinearManyRows, kLinearPaths, path_name);

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
