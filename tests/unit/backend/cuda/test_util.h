// Helpers of the CUDA backend tests: skip without a usable GPU, report op checks, device round trips, error norms.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/op_check.h"

// Skips the test when no GPU this build supports is present (CI has none).
#define KILN_REQUIRE_CUDA_DEVICE()                                                        \
  do {                                                                                    \
    const ::kiln::backend::cuda::CudaDeviceProbe probe_ = ::kiln::backend::cuda::probe_cuda_device(); \
    if (!probe_.usable) GTEST_SKIP() << "no usable CUDA device: " << probe_.reason;       \
  } while (0)

namespace kiln::backend::cuda::test {

// There must be checks and every one must pass (op_check_failures); prints each one and the worst error (the GPU
// run's log keeps every number).
inline void expect_all_pass(const std::vector<OpCheck>& results, const std::string& label) {
  EXPECT_EQ(op_check_failures(results), "") << label;
  double worst = 0;
  for (const OpCheck& r : results) {
    std::printf("[ op       ] %s | %s%s\n", label.c_str(), r.str().c_str(), r.passed() ? "" : "  <-- FAIL");
    EXPECT_TRUE(r.passed()) << label << ": " << r.str();
    worst = std::max(worst, r.rel_err);
  }
  std::printf("[ ops      ] %s: %zu checks, worst rel error %.2e\n", label.c_str(), results.size(), worst);
}

// ||out - ref|| / ||ref|| (||out - ref|| when ref is all zeros); infinity if anything is NaN or inf.
template <typename A, typename B>
double rel_err(const std::vector<A>& out, const std::vector<B>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = static_cast<double>(out[i]), r = static_cast<double>(ref[i]);
    if (!std::isfinite(o) || !std::isfinite(r)) return INFINITY;
    num += (o - r) * (o - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The checks of compare_ops whose op name starts with `prefix`.
inline std::vector<OpCheck> checks_of(const std::vector<OpCheck>& all, const std::string& prefix) {
  std::vector<OpCheck> out;
  for (const OpCheck& r : all)
    if (r.op.rfind(prefix, 0) == 0) out.push_back(r);
  return out;
}

}  // namespace kiln::backend::cuda::test
