// Kernel choices (--attention-backend / --moe-runner-backend / --fp4-gemm-backend) and the device memory plan,
// host-only: the plan is made from config.json before anything touches a GPU.
#include <gtest/gtest.h>

#include <string>

#include "backend/device.h"
#include "core/error.h"
#include "format/model_dir.h"

namespace kiln::backend {
namespace {

const std::string kConfig35 = std::string(KILN_SOURCE_DIR) + "/configs/qwen3.5-35b-a3b-nvfp4";
constexpr double GiB = 1024.0 * 1024.0 * 1024.0;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(KernelChoice, AutoResolvesPerDevice) {
  LoadOptions o;
  const KernelChoice cpu = resolve_kernels("cpu", 0, o);
  EXPECT_EQ(cpu.attention, "cpu");
  const KernelChoice h = resolve_kernels("cuda", 9, o);
  EXPECT_EQ(h.attention, "kiln-paged");
  EXPECT_EQ(h.moe_runner, "kiln-grouped");
  EXPECT_EQ(h.fp4_gemm, "kiln-w4a16");
  EXPECT_NE(h.str().find("fp4-gemm kiln-w4a16"), std::string::npos);
}

TEST(KernelChoice, UnsupportedChoicesAreClearErrors) {
  LoadOptions o;
  o.attention_backend = "fa3";
  std::string e = error_of([&] { resolve_kernels("cuda", 9, o); });
  EXPECT_NE(e.find("--attention-backend 'fa3'"), std::string::npos) << e;
  EXPECT_NE(e.find("kiln-paged"), std::string::npos) << e;
  o = LoadOptions();
  o.fp4_gemm_backend = "native-fp4";
  e = error_of([&] { resolve_kernels("cuda", 9, o); });
  EXPECT_NE(e.find("sm_90"), std::string::npos) << e;
  EXPECT_NE(e.find("kiln-w4a16"), std::string::npos) << e;
  o = LoadOptions();
  o.moe_runner_backend = "kiln-grouped";
  EXPECT_NE(error_of([&] { resolve_kernels("cpu", 0, o); }), "");
  EXPECT_EQ(error_of([&] { resolve_kernels("cuda", 9, o); }), "");
}

TEST(MemoryPlan, The35BShapeFitsAnH200AndTheKvCacheIsWhatIsLeft) {
  const format::ModelDir dir = format::ModelDir::open(kConfig35);
  LoadOptions o;
  o.state_slots = 64;
  o.max_context = 4096;
  o.kv_pages = 0;
  const MemoryPlan p = plan_device_memory(dir, o, 141.0 * GiB, 140.0 * GiB);
  // KV per token, from REFERENCE's 35B shape: 10 full-attention layers x (K, V) x 2 KV heads x 256 x 2 bytes.
  const double kv_per_token = 10 * 2 * 2 * 256 * 2;
  EXPECT_EQ(p.kv_pages, 64 * (4096 / 16));  // capped at slots x context: the budget holds more
  EXPECT_DOUBLE_EQ(p.kv_bytes, p.kv_tokens * kv_per_token);
  EXPECT_GT(p.weight_bytes, 15.0 * GiB);
  EXPECT_LT(p.weight_bytes, 25.0 * GiB);
  // State per sequence: 30 linear layers x (32 heads x 128 x 128 fp32 + conv 8192 x 3 fp32).
  EXPECT_DOUBLE_EQ(p.state_bytes, 64.0 * 30 * (32.0 * 128 * 128 * 4 + 8192.0 * 3 * 4));
  EXPECT_NE(p.str().find("memory plan"), std::string::npos);

  // Nothing asked: the budget decides, and stays inside gpu x fraction.
  o.max_context = 262144;
  o.state_slots = 128;
  const MemoryPlan q = plan_device_memory(dir, o, 141.0 * GiB, 0);
  EXPECT_LT(q.kv_pages, 128 * (262144 / 16));
  EXPECT_GT(q.kv_bytes, 50.0 * GiB);
  EXPECT_LE(q.weight_bytes + q.kv_bytes + q.state_bytes + q.activation_bytes, 141.0 * GiB * 0.9 + 1);
}

TEST(MemoryPlan, TooSmallGpusAndTooLargeRequestsAreRefusedWithTheNumbers) {
  const format::ModelDir dir = format::ModelDir::open(kConfig35);
  LoadOptions o;
  std::string e = error_of([&] { plan_device_memory(dir, o, 16.0 * GiB, 16.0 * GiB); });
  EXPECT_NE(e.find("out of GPU memory"), std::string::npos) << e;
  EXPECT_NE(e.find("weights"), std::string::npos) << e;
  EXPECT_NE(e.find("--mem-fraction-static"), std::string::npos) << e;
  o.kv_pages = 100000000;
  e = error_of([&] { plan_device_memory(dir, o, 141.0 * GiB, 0); });
  EXPECT_NE(e.find("--max-total-tokens"), std::string::npos) << e;
  o = LoadOptions();
  o.mem_fraction_static = 0.99;
  EXPECT_NE(error_of([&] { plan_device_memory(dir, o, 141.0 * GiB, 0); }), "");
}

}  // namespace
}  // namespace kiln::backend
