// The device random fill (fill.cu) against model::fill_random_host, byte for byte. Skipped without a usable GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "format/shard_plan.h"
#include "model/ops.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

TEST(CudaOps, RandomFillIsTheHostsBytes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  struct Case {
    DType dtype;
    model::RandomFill fill;
  };
  std::vector<Case> cases;
  model::RandomFill f;
  f.kind = model::RandomFill::Kind::bytes;
  f.seed = 11;
  cases.push_back({DType::U8, f});
  f.byte_lo = 0x28;
  f.byte_hi = 0x48;
  f.random_sign = true;
  cases.push_back({DType::F8_E4M3, f});
  f = model::RandomFill();
  f.lo = -0.0383f;
  f.hi = 0.0383f;
  f.seed = 12;
  for (DType d : {DType::F32, DType::BF16, DType::F16}) cases.push_back({d, f});
  for (const Case& c : cases) {
    const int64_t n = 1000003;
    const TensorView dev = gpu.place_random(c.dtype, Shape{n}, c.fill);
    std::vector<uint8_t> got(n * dtype_size(c.dtype)), want(got.size());
    gpu.download(dev, got.data());
    model::fill_random_host(c.dtype, n, c.fill, want.data());
    EXPECT_EQ(got, want) << dtype_name(c.dtype);
  }
}

// A tensor-parallel rank's dummy slice filled on the device holds the host's slice values (fill_random_host_slice,
// itself checked against slice_source_index in shard_plan_test): every tensor of the fixture families at the TP / EP
// sizes they divide, rows (in_proj_qkv sections), column parts and expert-parallel ranges included.
TEST(CudaOps, RandomSliceFillIsTheHostsSlice) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  int checked = 0;
  for (const char* name : {"qwen3_5_moe_nvfp4", "qwen3_5_bf16", "qwen3_next_nvfp4"}) {
    format::ModelDir d =
        format::ModelDir::open(std::string(KILN_SOURCE_DIR) + "/tests/fixtures/reference/" + name + "/model");
    const format::ModelConfig config = format::load_model_config(d);
    const format::QuantConfig quant = format::load_quant_config(d);
    const std::vector<format::ExpectedTensor> tensors = format::expected_tensors(config, quant);
    for (auto [tp, ep] : {std::pair{2, 1}, {4, 2}}) {
      format::ShardPlan plan;
      try {
        plan = format::plan_shards(config, quant, tp, ep);
      } catch (const Error&) {
        continue;
      }
      for (const format::RankShard& rank : plan.ranks)
        for (const format::ExpectedTensor& t : tensors) {
          const format::TensorSlice s = format::slice_tensor(config, rank, t, t.shape);
          if (!s.held || s.whole() || s.shape.numel() == 0) continue;
          const DType dtype = t.dtypes.at(0);
          model::RandomFill f;
          if (dtype_size(dtype) == 1) {
            f.kind = model::RandomFill::Kind::bytes;
            f.random_sign = true;
            f.byte_hi = 0x48;
          } else {
            f.lo = -0.5f;
            f.hi = 0.5f;
          }
          f.seed = static_cast<uint64_t>(checked) * 7 + 3;
          const TensorView dev = gpu.place_random_slice(dtype, t.shape, s, f);
          gpu.finish_weights();
          std::vector<uint8_t> got(static_cast<size_t>(s.shape.numel()) * dtype_size(dtype)), want(got.size());
          gpu.download(dev, got.data());
          model::fill_random_host_slice(dtype, t.shape, s, f, want.data());
          ASSERT_EQ(got, want) << name << " " << t.name << " tp " << tp << " ep " << ep << " rank " << rank.rank;
          ++checked;
        }
    }
  }
  EXPECT_GT(checked, 100);
}

}  // namespace
}  // namespace kiln::backend::cuda
