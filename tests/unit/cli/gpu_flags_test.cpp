// The GPU load flags (cli/gpu_flags.h): --dtype as `kiln serve` / `kiln bench-engine` (add_gpu_flags) and
// `kiln generate` (add_dtype_flag) parse it, into the load options that backend::resolve_kernels resolves per device.
#include "cli/gpu_flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "backend/device.h"
#include "core/error.h"

namespace kiln::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Parses argv (after the program name) the way serve and bench-engine do, into load options.
backend::LoadOptions parse_gpu(std::vector<std::string> args) {
  CLI::App app;
  GpuFlags f;
  add_gpu_flags(app, f);
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector form last-first
  app.parse(args);
  backend::LoadOptions lo;
  apply_gpu_flags(f, lo);
  return lo;
}

// The way generate does (the --dtype flag alone).
std::string parse_dtype(std::vector<std::string> args) {
  CLI::App app;
  std::string dtype = "auto";
  add_dtype_flag(app, dtype);
  std::reverse(args.begin(), args.end());
  app.parse(args);
  return dtype;
}

TEST(DtypeFlag, ParsesIntoLoadOptions) {
  EXPECT_EQ(parse_gpu({}).gpu.dtype, "auto");
  EXPECT_EQ(parse_gpu({"--dtype", "bfloat16"}).gpu.dtype, "bfloat16");
  EXPECT_EQ(parse_gpu({"--dtype", "float32"}).gpu.dtype, "float32");
  EXPECT_EQ(parse_dtype({}), "auto");
  EXPECT_EQ(parse_dtype({"--dtype", "bfloat16"}), "bfloat16");
  // float16 (and SGLang's half) are not supported: they fail at parse time, as other unknown names do.
  EXPECT_THROW(parse_dtype({"--dtype", "float16"}), CLI::ValidationError);
  EXPECT_THROW(parse_gpu({"--dtype", "half"}), CLI::ValidationError);
  EXPECT_THROW(parse_gpu({"--dtype", "bf16"}), CLI::ValidationError);
  EXPECT_EQ(parse_dtype({"--dtype", "float"}), "float");  // SGLang's alias of float32 (resolve_dtype maps it)
  EXPECT_THROW(parse_dtype({"--dtype", "fp16"}), CLI::ValidationError);
}

// What each command's value becomes on each device: the one resolution the three commands share.
TEST(DtypeFlag, ResolvesPerDevice) {
  const backend::LoadOptions bf16 = parse_gpu({"--dtype", "bfloat16"});
  EXPECT_EQ(backend::resolve_kernels("cuda", 9, bf16).dtype, "bfloat16");
  EXPECT_EQ(backend::resolve_kernels("cuda", 9, parse_gpu({})).dtype, "bfloat16");  // auto
  EXPECT_EQ(backend::resolve_kernels("cpu", 0, parse_gpu({})).dtype, "float32");
  EXPECT_EQ(backend::resolve_kernels("cuda", 9, parse_gpu({"--dtype", "float"})).dtype, "float32");
  EXPECT_THAT([&] { backend::resolve_kernels("cpu", 0, bf16); }, ThrowsMessage<Error>(HasSubstr("CPU backend")));
  backend::LoadOptions f16 = parse_gpu({});
  f16.gpu.dtype = "float16";  // not a flag value any more; the backend still refuses it with the reason
  EXPECT_THAT([&] { backend::resolve_kernels("cuda", 9, f16); },
              ThrowsMessage<Error>(HasSubstr(
                  "--dtype float16 is not supported by the CUDA backend yet; use bfloat16 or float32")));
}

// --mamba-ssm-dtype (the DeltaNet recurrent state): parsed into the load options; auto is float32 on cuda.
TEST(MambaSsmDtypeFlag, ParsesAndResolves) {
  EXPECT_EQ(parse_gpu({}).gpu.mamba_ssm_dtype, "auto");
  EXPECT_EQ(backend::resolve_kernels("cuda", 9, parse_gpu({})).mamba_ssm_dtype, "float32");
  EXPECT_EQ(backend::resolve_kernels("cuda", 9, parse_gpu({"--mamba-ssm-dtype", "bfloat16"})).mamba_ssm_dtype,
            "bfloat16");
  EXPECT_EQ(backend::resolve_kernels("cuda", 9, parse_gpu({"--dtype", "float32"})).mamba_ssm_dtype, "float32");
  EXPECT_EQ(backend::resolve_kernels("cuda", 9, parse_gpu({"--mamba-ssm-dtype", "float32"})).mamba_ssm_dtype,
            "float32");
  EXPECT_EQ(backend::resolve_kernels("cuda", 9, parse_gpu({"--dtype", "float32", "--mamba-ssm-dtype", "bfloat16"}))
                .mamba_ssm_dtype,
            "bfloat16");
  EXPECT_THROW(parse_gpu({"--mamba-ssm-dtype", "float16"}), CLI::ValidationError);
}

// Programmatic dependent launch is on by default; --disable-pdl turns it off; the old opt-in is still accepted.
TEST(GpuFlags, PdlOnByDefaultAndDisablePdlTurnsItOff) {
  EXPECT_TRUE(parse_gpu({}).gpu.pdl);
  EXPECT_FALSE(parse_gpu({"--disable-pdl"}).gpu.pdl);
  EXPECT_TRUE(parse_gpu({"--enable-pdl"}).gpu.pdl);
}

// The gemv kernels' L2 weight prefetch (with PDL) is experimental: off by default, --enable-weight-prefetch turns it
// on (and leaves PDL on).
TEST(GpuFlags, WeightPrefetchOffByDefaultAndItsFlagTurnsItOn) {
  EXPECT_FALSE(parse_gpu({}).gpu.weight_prefetch);
  const auto on = parse_gpu({"--enable-weight-prefetch"});
  EXPECT_TRUE(on.gpu.weight_prefetch);
  EXPECT_TRUE(on.gpu.pdl);
}

// The fused decode ops are on by default; --disable-fused-decode-ops runs the separate kernels.
TEST(GpuFlags, FusedDecodeOpsOnByDefaultAndTheFlagTurnsThemOff) {
  EXPECT_TRUE(parse_gpu({}).gpu.fused_decode_ops);
  EXPECT_FALSE(parse_gpu({"--disable-fused-decode-ops"}).gpu.fused_decode_ops);
  EXPECT_THROW(parse_gpu({"--enable-fused-decode-ops"}), CLI::ParseError);
}

// The chunked delta rule's products run on tensor cores by default; --disable-delta-rule-tensor-cores keeps the FMA
// kernel (and nothing else changes).
TEST(GpuFlags, DeltaRuleTensorCoresOnByDefaultAndTheFlagTurnsThemOff) {
  EXPECT_TRUE(parse_gpu({}).gpu.delta_rule_tensor_cores);
  const auto off = parse_gpu({"--disable-delta-rule-tensor-cores"});
  EXPECT_FALSE(off.gpu.delta_rule_tensor_cores);
  EXPECT_TRUE(off.gpu.fused_decode_ops);
  EXPECT_TRUE(off.gpu.pdl);
  EXPECT_TRUE(off.gpu.delta_rule_split);
}

// The chunked delta rule runs as two kernels (preparation, then the scan) by default; --disable-delta-rule-split runs
// the single kernel and leaves the tensor cores on.
TEST(GpuFlags, DeltaRuleSplitOnByDefaultAndTheFlagTurnsItOff) {
  EXPECT_TRUE(parse_gpu({}).gpu.delta_rule_split);
  const auto off = parse_gpu({"--disable-delta-rule-split"});
  EXPECT_FALSE(off.gpu.delta_rule_split);
  EXPECT_TRUE(off.gpu.delta_rule_tensor_cores);
}

// Every GPU flag lands in its field of LoadOptions::gpu (the part the CUDA loader reads); the two spelled otherwise
// on the command line are turned around (--disable-cuda-graph) or parsed (--load-format).
TEST(GpuFlags, FillTheGpuPartOfTheLoadOptions) {
  const backend::LoadOptions d = parse_gpu({});
  EXPECT_TRUE(d.gpu.cuda_graphs);
  EXPECT_EQ(d.gpu.mem_fraction_static, 0);
  EXPECT_EQ(d.load_format, model::LoadFormat::safetensors);
  const backend::LoadOptions lo =
      parse_gpu({"--mem-fraction-static", "0.5", "--attention-backend", "kiln-paged-fp32", "--moe-runner-backend",
                 "kiln-grouped-fp32", "--fp4-gemm-backend", "kiln-fp32", "--disable-cuda-graph",
                 "--disable-custom-all-reduce", "--load-format", "dummy"});
  EXPECT_EQ(lo.gpu.mem_fraction_static, 0.5);
  EXPECT_EQ(lo.gpu.attention_backend, "kiln-paged-fp32");
  EXPECT_EQ(lo.gpu.moe_runner_backend, "kiln-grouped-fp32");
  EXPECT_EQ(lo.gpu.fp4_gemm_backend, "kiln-fp32");
  EXPECT_FALSE(lo.gpu.cuda_graphs);
  EXPECT_TRUE(lo.gpu.disable_custom_all_reduce);
  EXPECT_EQ(lo.load_format, model::LoadFormat::dummy);
}

}  // namespace
}  // namespace kiln::cli
