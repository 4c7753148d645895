// MoE: routing (ids exact, weights 1e-5), grouped NVFP4 expert FFN through the GEMV and GEMM paths,
// and the combine with a shared expert, against the CPU reference. Output tolerance 1e-2: the expert
// activations and outputs are rounded to bf16 by contract (the reference rounds at the same points),
// so what remains is rounding-boundary flips and fp32-vs-double accumulation.
#include <gtest/gtest.h>

#include "backend/cuda/kernels.h"
#include "cuda_test_util.h"

namespace kiln::cuda {
namespace {

using namespace test;

struct MoeCase {
  int E, k, H, I, T;
  Nvfp4Path path;
};

class CudaMoe : public ::testing::TestWithParam<MoeCase> {};

TEST_P(CudaMoe, RouteExpertsCombine) {
  KILN_REQUIRE_GPU();
  const MoeCase c = GetParam();
  const int E = c.E, k = c.k, H = c.H, I = c.I, T = c.T;

  // Routing.
  const auto logits = random_f32(size_t(T) * E, -4.0f, 4.0f);
  DeviceBuffer d_logits = upload(logits);
  DeviceBuffer d_route(moe_routing_bytes(T, E, k));
  KILN_CUDA_CHECK(cudaMemset(d_route.data(), 0xff, d_route.size()));
  const MoeRouting r = moe_routing_carve(d_route.data(), T, E, k);
  moe_route(d_logits.as<float>(), E, T, /*renormalize=*/true, r, nullptr);
  std::vector<int> ids(size_t(T) * k), ref_ids(size_t(T) * k);
  std::vector<float> ws(size_t(T) * k), ref_ws(size_t(T) * k);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  KILN_CUDA_CHECK(cudaMemcpy(ids.data(), r.topk_ids, ids.size() * 4, cudaMemcpyDeviceToHost));
  KILN_CUDA_CHECK(cudaMemcpy(ws.data(), r.topk_weights, ws.size() * 4, cudaMemcpyDeviceToHost));
  ref::moe_route(logits.data(), T, E, k, true, ref_ids.data(), ref_ws.data());
  ASSERT_EQ(ids, ref_ids);
  KILN_EXPECT_ERR(rel_err(ws, ref_ws), 1e-5, "moe route weights");

  // Experts.
  struct HostExpert {
    std::vector<uint8_t> codes[3], scales[3];
    float gs[3];
    std::vector<float> dense[3];
  };
  std::vector<HostExpert> experts(E);
  std::vector<DeviceBuffer> keep;
  std::vector<Nvfp4Weight> tables[3];
  const int rows[3] = {I, I, H}, cols[3] = {H, H, I};
  for (auto& ex : experts)
    for (int m = 0; m < 3; ++m) {
      ex.codes[m] = random_bytes(size_t(rows[m]) * cols[m] / 2);
      ex.scales[m] = random_e4m3_scales(size_t(rows[m]) * cols[m] / 16);
      ex.gs[m] = random_f32(1, 0.002f, 0.01f)[0];
      ex.dense[m] = ref::nvfp4_dequant(ex.codes[m].data(), ex.scales[m].data(), ex.gs[m], rows[m], cols[m]);
      keep.push_back(upload(ex.codes[m]));
      const uint8_t* dc = keep.back().as<uint8_t>();
      keep.push_back(upload(ex.scales[m]));
      tables[m].push_back(Nvfp4Weight{dc, keep.back().as<uint8_t>(), ex.gs[m]});
    }
  DeviceBuffer d_gate = upload(tables[0]), d_up = upload(tables[1]), d_down = upload(tables[2]);
  MoeExperts me{d_gate.as<Nvfp4Weight>(), d_up.as<Nvfp4Weight>(), d_down.as<Nvfp4Weight>(), H, I};

  const auto x = random_bf16(size_t(T) * H);
  const auto shared = random_bf16(size_t(T) * H, 0.5f);
  const auto shared_gate = random_f32(size_t(T) * 2, -3.0f, 3.0f);  // ld 2: column 0 is used
  DeviceBuffer d_x = upload(x), d_shared = upload(shared), d_sg = upload(shared_gate);
  DeviceBuffer d_act = poisoned(size_t(T) * k * I * 2), d_y = poisoned(size_t(T) * k * H * 2);
  DeviceBuffer d_out = poisoned(size_t(T) * H * 2);
  moe_expert_ffn(me, d_x.as<uint16_t>(), H, T, r, d_act.as<uint16_t>(), d_y.as<uint16_t>(), nullptr, c.path);
  moe_combine(d_y.as<uint16_t>(), r, T, H, d_shared.as<uint16_t>(), H, d_sg.as<float>(), 2, d_out.as<uint16_t>(), H,
              nullptr);
  const auto out = bf16_to_float(download<uint16_t>(d_out, size_t(T) * H));

  std::vector<double> expect(size_t(T) * H);
  for (int t = 0; t < T; ++t) {
    const double sg = 1.0 / (1.0 + std::exp(-double(shared_gate[size_t(t) * 2])));
    for (int h = 0; h < H; ++h) expect[size_t(t) * H + h] = sg * bf16_to_f32(shared[size_t(t) * H + h]);
    for (int j = 0; j < k; ++j) {
      const HostExpert& ex = experts[ref_ids[t * k + j]];
      const auto y = ref::expert_ffn(&x[size_t(t) * H], ex.dense[0].data(), ex.dense[1].data(), ex.dense[2].data(),
                                     H, I);
      for (int h = 0; h < H; ++h) expect[size_t(t) * H + h] += double(ref_ws[t * k + j]) * bf16_to_f32(y[h]);
    }
  }
  const double err = rel_err(out, expect);
  KILN_EXPECT_ERR(err, 1e-2, "moe E=" + std::to_string(E) + " k=" + std::to_string(k) + " T=" + std::to_string(T) +
                                 " " + nvfp4_path_name(c.path));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaMoe,
                         ::testing::Values(MoeCase{16, 4, 256, 128, 1, Nvfp4Path::kGemv},
                                           MoeCase{16, 4, 256, 128, 5, Nvfp4Path::kGemv},
                                           MoeCase{16, 4, 256, 128, 37, Nvfp4Path::kGemv},
                                           MoeCase{16, 4, 256, 128, 5, Nvfp4Path::kGemm},
                                           MoeCase{16, 4, 256, 128, 150, Nvfp4Path::kGemm},
                                           MoeCase{64, 8, 512, 256, 9, Nvfp4Path::kAuto},
                                           MoeCase{8, 2, 256, 128, 300, Nvfp4Path::kAuto}));

// Routing alone at the 35B-A3B router shape (256 experts, top-8), with and without renormalisation.
TEST(CudaMoeRoute, WideRouter) {
  KILN_REQUIRE_GPU();
  const int T = 64, E = 256, k = 8;
  for (bool renorm : {true, false}) {
    const auto logits = random_f32(size_t(T) * E, -6.0f, 6.0f);
    DeviceBuffer d_logits = upload(logits);
    DeviceBuffer d_route(moe_routing_bytes(T, E, k));
    const MoeRouting r = moe_routing_carve(d_route.data(), T, E, k);
    moe_route(d_logits.as<float>(), E, T, renorm, r, nullptr);
    std::vector<int> ids(T * k), ref_ids(T * k), offsets(E + 1);
    std::vector<float> ws(T * k), ref_ws(T * k);
    int num_groups = 0;
    KILN_CUDA_CHECK(cudaDeviceSynchronize());
    KILN_CUDA_CHECK(cudaMemcpy(ids.data(), r.topk_ids, ids.size() * 4, cudaMemcpyDeviceToHost));
    KILN_CUDA_CHECK(cudaMemcpy(ws.data(), r.topk_weights, ws.size() * 4, cudaMemcpyDeviceToHost));
    KILN_CUDA_CHECK(cudaMemcpy(&num_groups, r.num_groups, 4, cudaMemcpyDeviceToHost));
    KILN_CUDA_CHECK(cudaMemcpy(offsets.data(), r.group_offset, (num_groups + 1) * 4, cudaMemcpyDeviceToHost));
    ref::moe_route(logits.data(), T, E, k, renorm, ref_ids.data(), ref_ws.data());
    EXPECT_EQ(ids, ref_ids);
    EXPECT_LT(rel_err(ws, ref_ws), 1e-5);
    std::vector<int> used(E, 0);
    for (int id : ref_ids) used[id] = 1;
    int expect_groups = 0;
    for (int u : used) expect_groups += u;
    EXPECT_EQ(num_groups, expect_groups);
    EXPECT_EQ(offsets[num_groups], T * k);
  }
}

}  // namespace
}  // namespace kiln::cuda
