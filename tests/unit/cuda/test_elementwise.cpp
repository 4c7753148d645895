// RMSNorm (plain / zero-centred, fused residual add), embedding, silu_mul, argmax, and the cuBLASLt
// BF16 GEMM against CPU references. Tolerances: bf16 outputs 1e-2 (one rounding: ~2e-3 observed),
// fp32 GEMM output 1e-4, exact for residual sums, gathers and argmax.
#include <gtest/gtest.h>

#include <algorithm>

#include "backend/cuda/cuda_ops_kernels.h"
#include "backend/cuda/kernels.h"
#include "cuda_test_util.h"

namespace kiln::cuda {
namespace {

using namespace test;

TEST(CudaNorm, RmsNormBothForms) {
  KILN_REQUIRE_GPU();
  for (int H : {2048, 4096, 264}) {
    for (bool zc : {true, false}) {
      const int T = 7, ldx = H + 8;
      const auto x = random_bf16(size_t(T) * ldx, 3.0f), w = random_bf16(H, 0.3f);
      DeviceBuffer d_x = upload(x), d_w = upload(w), d_out = poisoned(size_t(T) * H * 2);
      rmsnorm(d_x.as<uint16_t>(), ldx, d_w.as<uint16_t>(), T, H, 1e-6f, zc, d_out.as<uint16_t>(), H, nullptr);
      const auto out = bf16_to_float(download<uint16_t>(d_out, size_t(T) * H));
      std::vector<float> expect(size_t(T) * H);
      for (int t = 0; t < T; ++t) ref::rmsnorm(&x[size_t(t) * ldx], w.data(), H, 1e-6f, zc, &expect[size_t(t) * H]);
      KILN_EXPECT_ERR(rel_err(out, expect), 1e-2, "rmsnorm H=" + std::to_string(H) + (zc ? " zero-centred" : " plain"));
    }
  }
}

TEST(CudaNorm, AddRmsNorm) {
  KILN_REQUIRE_GPU();
  const int T = 5, H = 2048;
  const auto res = random_bf16(size_t(T) * H, 4.0f), delta = random_bf16(size_t(T) * H), w = random_bf16(H, 0.3f);
  DeviceBuffer d_res = upload(res), d_delta = upload(delta), d_w = upload(w), d_out = poisoned(size_t(T) * H * 2);
  add_rmsnorm(d_res.as<uint16_t>(), d_delta.as<uint16_t>(), d_w.as<uint16_t>(), T, H, 1e-6f, true,
              d_out.as<uint16_t>(), nullptr);
  const auto new_res = download<uint16_t>(d_res, res.size());
  const auto out = bf16_to_float(download<uint16_t>(d_out, size_t(T) * H));
  std::vector<uint16_t> expect_res(res.size());
  for (size_t i = 0; i < res.size(); ++i) expect_res[i] = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(delta[i]));
  EXPECT_EQ(new_res, expect_res);
  std::vector<float> expect(size_t(T) * H);
  for (int t = 0; t < T; ++t) ref::rmsnorm(&expect_res[size_t(t) * H], w.data(), H, 1e-6f, true, &expect[size_t(t) * H]);
  KILN_EXPECT_ERR(rel_err(out, expect), 1e-2, "add_rmsnorm");
}

TEST(CudaMisc, EmbeddingGather) {
  KILN_REQUIRE_GPU();
  const int V = 1000, H = 512, T = 9;
  const auto table = random_bf16(size_t(V) * H);
  std::vector<int32_t> ids = {0, 999, 17, 17, 500, -1, 1000, 3, 42};
  DeviceBuffer d_t = upload(table), d_ids = upload(ids), d_out = poisoned(size_t(T) * H * 2);
  embedding(d_t.as<uint16_t>(), d_ids.as<int32_t>(), T, H, V, d_out.as<uint16_t>(), nullptr);
  const auto out = download<uint16_t>(d_out, size_t(T) * H);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const bool ok = ids[t] >= 0 && ids[t] < V;
      ASSERT_EQ(out[size_t(t) * H + h], ok ? table[size_t(ids[t]) * H + h] : 0) << t << " " << h;
    }
}

TEST(CudaMisc, SiluMul) {
  KILN_REQUIRE_GPU();
  const int T = 3, I = 512, ld = 2 * I + 16;
  const auto gu = random_bf16(size_t(T) * ld, 2.0f);
  DeviceBuffer d_gu = upload(gu), d_out = poisoned(size_t(T) * I * 2);
  silu_mul(d_gu.as<uint16_t>(), ld, T, I, d_out.as<uint16_t>(), I, nullptr);
  const auto out = bf16_to_float(download<uint16_t>(d_out, size_t(T) * I));
  std::vector<double> expect(size_t(T) * I);
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < I; ++i) {
      const double g = bf16_to_f32(gu[size_t(t) * ld + i]), u = bf16_to_f32(gu[size_t(t) * ld + I + i]);
      expect[size_t(t) * I + i] = g / (1.0 + std::exp(-g)) * u;
    }
  KILN_EXPECT_ERR(rel_err(out, expect), 1e-2, "silu_mul");
}

TEST(CudaMisc, ArgmaxGreedy) {
  KILN_REQUIRE_GPU();
  const int B = 4;
  const int64_t V = 248320;
  auto logits = random_f32(size_t(B) * V, -10.0f, 10.0f);
  logits[5] = 50.0f;                 // row 0: clear winner
  logits[V + 100] = 60.0f;           // row 1: tie -> lowest index
  logits[V + 200] = 60.0f;
  logits[2 * V + 7] = NAN;           // row 2: NaN never wins
  logits[2 * V + 9] = 55.0f;
  logits[3 * V + V - 1] = 70.0f;     // row 3: last element
  DeviceBuffer d_l = upload(logits), d_ids = poisoned(B * 4), d_work(ops::argmax_workspace_bytes(B, V));
  ops::argmax_rows(d_l.as<float>(), V, B, V, d_ids.as<int32_t>(), d_work.data(), nullptr);
  const auto ids = download<int32_t>(d_ids, B);
  EXPECT_EQ(ids, (std::vector<int32_t>{5, 100, 9, int32_t(V - 1)}));
}

TEST(CudaBlas, Bf16GemmMatchesReference) {
  KILN_REQUIRE_GPU();
  BlasLt blas;
  struct Shape {
    int m, n, k;
  };
  for (const Shape s : {Shape{1, 2048, 2048}, Shape{7, 512, 256}, Shape{130, 384, 512}}) {
    for (bool f32 : {false, true}) {
      const auto x = random_bf16(size_t(s.m) * s.k), w = random_bf16(size_t(s.n) * s.k, 0.05f);
      DeviceBuffer d_x = upload(x), d_w = upload(w), d_out = poisoned(size_t(s.m) * s.n * 4);
      blas.gemm(d_x.as<uint16_t>(), s.k, d_w.as<uint16_t>(), s.k, d_out.data(), s.n, f32, s.m, s.n, s.k, nullptr);
      std::vector<float> wf(w.size());
      for (size_t i = 0; i < w.size(); ++i) wf[i] = bf16_to_f32(w[i]);
      const auto expect = ref::linear(x.data(), s.k, wf.data(), s.m, s.n, s.k);
      double err;
      if (f32) err = rel_err(download<float>(d_out, expect.size()), expect);
      else err = rel_err(bf16_to_float(download<uint16_t>(d_out, expect.size())), expect);
      KILN_EXPECT_ERR(err, f32 ? 1e-4 : 1e-2, "cublasLt " + std::to_string(s.m) + "x" + std::to_string(s.n) + "x" +
                                                   std::to_string(s.k) + (f32 ? " f32 out" : " bf16 out"));
    }
  }
}

}  // namespace
}  // namespace kiln::cuda
