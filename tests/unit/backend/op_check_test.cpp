// The op-comparison harness (backend/op_check.h) without a GPU: the CPU backend against a second CPU backend is
// exact, with either delta-rule reference.
#include <gtest/gtest.h>

#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/op_check.h"

namespace kiln::backend {
namespace {

// The comparison harness itself, without a GPU: the CPU backend against a second CPU backend is exact.
TEST(OpCompare, CpuAgainstCpuIsExact) {
  auto a = make_cpu_backend(), b = make_cpu_backend();
  for (bool chunked : {false, true}) {
    OpCheckConfig c;
    c.seed = 9;
    c.chunked_reference = chunked;
    const std::vector<OpCheck> results = compare_ops(*a, *b, c);
    EXPECT_GT(results.size(), 50u);
    for (const OpCheck& r : results) {
      EXPECT_TRUE(r.passed()) << r.str();
      EXPECT_EQ(r.rel_err, 0.0) << r.str();
    }
  }
}

}  // namespace
}  // namespace kiln::backend
