// CudaOps::argmax_rows (chunked device argmax) against model::host_argmax, the definition: lowest index on ties,
// NaN never wins, an all-NaN row gives 0, -0 ties +0. Rows of 1 .. 248,320 values (the target vocabulary), ties
// across chunk boundaries, NaN / inf. Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "model/ops.h"

namespace kiln::backend::cuda {
namespace {

TEST(CudaArgmaxRows, MatchesHostDefinition) {
  const CudaDeviceProbe probe = probe_cuda_device();
  if (!probe.usable) GTEST_SKIP() << "no usable CUDA device: " << probe.reason;
  CudaOps ops;
  std::mt19937 rng(123);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  int cases = 0;
  for (int64_t V : {1, 2, 31, 4095, 4096, 4097, 50000, 248320}) {
    for (int kind = 0; kind < 7; ++kind) {
      const int64_t R = kind == 0 ? 37 : 3;
      std::vector<float> h(static_cast<size_t>(R * V));
      std::uniform_real_distribution<float> u(-20.0f, 20.0f);
      for (float& x : h) x = kind == 4 ? std::round(u(rng)) : u(rng);  // kind 4: many exact ties
      for (int64_t r = 0; r < R; ++r) {
        float* row = h.data() + r * V;
        std::uniform_int_distribution<int64_t> pos(0, V - 1);
        switch (kind) {
          case 1: {  // the maximum twice, far apart (different chunks when V is large): the lower index wins
            const int64_t a = pos(rng), b = pos(rng);
            row[a] = row[b] = 25.0f;
            break;
          }
          case 2:  // NaNs everywhere but one finite value somewhere
            for (int64_t v = 0; v < V; ++v) row[v] = nan;
            row[pos(rng)] = -3.0f;
            break;
          case 3:  // all NaN: 0
            for (int64_t v = 0; v < V; ++v) row[v] = nan;
            break;
          case 5:  // -inf everywhere, +inf somewhere, NaN at the front
            for (int64_t v = 0; v < V; ++v) row[v] = -inf;
            row[pos(rng)] = inf;
            row[0] = nan;
            break;
          case 6:  // zeros of both signs only: the first wins
            for (int64_t v = 0; v < V; ++v) row[v] = (v % 3 == 0) ? 0.0f : -0.0f;
            break;
          default: break;
        }
      }
      TensorView d = ops.upload(h.data(), DType::F32, Shape{R, V});
      std::vector<int32_t> ids(static_cast<size_t>(R), -7);
      ops.argmax_rows(d, ids);
      for (int64_t r = 0; r < R; ++r) {
        EXPECT_EQ(ids[static_cast<size_t>(r)], model::host_argmax(h.data() + r * V, V))
            << "V " << V << " kind " << kind << " row " << r;
        ++cases;
      }
      ops.reset_scratch();
    }
  }
  EXPECT_GT(cases, 100);
}

}  // namespace
}  // namespace kiln::backend::cuda
