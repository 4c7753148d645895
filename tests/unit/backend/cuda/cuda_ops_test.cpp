// CudaOps against the CPU oracle, every op on random inputs at several shapes (op_check.h's compare_ops: tiny, odd
// sizes, the 397B's head / state sizes), fp32 paths at rel-L2 <= 1e-5, and with --dtype bfloat16 (the tensor-core
// ops within the budgets of bf16 inputs, every other op still at 1e-5); the startup op check itself; describe().
// Skipped without a usable GPU (CI has none).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/device.h"
#include "backend/op_check.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using test::expect_all_pass;

TEST(CudaOps, EveryOpMatchesCpuSmall) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  OpCheckConfig c;
  c.seed = 1;
  expect_all_pass(compare_ops(gpu, *cpu, c), "small");
}

TEST(CudaOps, EveryOpMatchesCpuOddShapes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  OpCheckConfig c;
  c.seed = 2;
  c.hidden = 48;        // K % 8 == 0 but not a multiple of 32 lanes * 8
  c.out_features = 50;  // N not a multiple of the 8 / 64 column tiles
  c.linear_rows = {1, 2, 7, 8, 9, 16, 17, 65, 130};
  c.prefill_lens = {2, 65, 1, 33, 129};
  c.q_heads = 6;
  c.kv_heads = 3;
  c.head_dim = 16;
  c.rotary_dim = 4;
  c.k_heads = 3;
  c.v_heads = 6;
  c.k_dim = 8;
  c.v_dim = 40;  // not a multiple of the 32 value columns of a block
  c.conv_kernel = 3;
  c.experts = 5;
  c.top_k = 3;
  c.expert_inter = 48;
  c.vocab = 77;
  c.page_size = 3;
  expect_all_pass(compare_ops(gpu, *cpu, c), "odd shapes");
}

OpCheckConfig qwen35_head_sizes() {
  OpCheckConfig c;  // 397B-A17B head / state sizes, fewer heads and a smaller hidden size
  c.seed = 3;
  c.hidden = 1024;
  c.out_features = 512;
  c.linear_rows = {1, 4, 24, 200};
  c.prefill_lens = {1, 70, 150};
  c.q_heads = 8;
  c.kv_heads = 2;
  c.head_dim = 256;
  c.rotary_dim = 64;
  c.k_heads = 2;
  c.v_heads = 4;
  c.k_dim = 128;
  c.v_dim = 128;
  c.experts = 64;
  c.top_k = 10;
  c.expert_inter = 128;
  c.vocab = 1000;
  c.page_size = 16;
  return c;
}

TEST(CudaOps, EveryOpMatchesCpuAtQwen35HeadSizes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  expect_all_pass(compare_ops(gpu, *cpu, qwen35_head_sizes()), "qwen3.5 head sizes");
}

// --dtype bfloat16 at the same shapes (dense linears of 24 / 200 rows through cuBLASLt, NVFP4 ones of 200 rows and
// the NVFP4 experts on the MMA kernels, prefill attention at head_dim 256 over bf16 / fp8 pools): the tensor-core ops
// within use_bf16_input_budgets, everything else at 1e-5.
TEST(CudaOps, EveryOpMatchesCpuAtQwen35HeadSizesWithBf16Inputs) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOptions o;
  o.dtype = CudaOptions::ActivationDtype::bfloat16;
  CudaOps gpu(o);
  auto cpu = make_cpu_backend();
  expect_all_pass(compare_ops(gpu, *cpu, use_bf16_input_budgets(qwen35_head_sizes())), "qwen3.5 head sizes, bf16 in");
}

TEST(CudaOps, SelfCheckPasses) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  EXPECT_NO_THROW(startup_op_check(gpu, *cpu));
  // The factory path (resolve + self-check) too.
  const DeviceChoice choice = resolve_device("auto");
  EXPECT_EQ(choice.device, "cuda") << choice.reason;
  EXPECT_NO_THROW(make_ops("cuda", true));
  // --dtype bfloat16 through the factory: its self-check at the budgets of bf16 inputs.
  LoadOptions bf16;
  bf16.gpu.dtype = "bfloat16";
  std::unique_ptr<model::Ops> ops;
  EXPECT_NO_THROW(ops = make_ops("cuda", true, bf16));
  ASSERT_TRUE(ops);
  EXPECT_NE(ops->describe().find("dtype bfloat16"), std::string::npos) << ops->describe();
  EXPECT_NE(ops->describe().find("x rounded once to bf16"), std::string::npos) << ops->describe();
  CudaOptions o;
  o.dtype = CudaOptions::ActivationDtype::bfloat16;
  CudaOps gpu_bf16(o);
  EXPECT_NO_THROW(startup_op_check(gpu_bf16, *cpu, true));
}

TEST(CudaOps, DescribesTheDevice) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  std::printf("[ describe ] %s\n", gpu.describe().c_str());
  EXPECT_NE(gpu.describe().find("compute capability"), std::string::npos);
  EXPECT_NE(gpu.describe().find("dtype float32"), std::string::npos);  // the default (--dtype auto, for now)
  EXPECT_NE(gpu.describe().find("x split into 3 bf16 parts"), std::string::npos);
  EXPECT_EQ(gpu.describe().find("rounded once to bf16"), std::string::npos);
}


}  // namespace
}  // namespace kiln::backend::cuda
