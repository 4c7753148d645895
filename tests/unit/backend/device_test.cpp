// Kernel choices (--dtype / --attention-backend / --moe-runner-backend / --fp4-gemm-backend), the device memory
// plan, the parallel sizes' one check and the placement of ranks on GPUs, host-only: the plan is made from
// config.json, the placement from a list of GPUs (faked here) before anything touches a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
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
  EXPECT_EQ(h.moe_runner, "kiln-grouped");  // the fused decode kernels are by name only (slower at batch 1)
  EXPECT_EQ(resolve_kernels("cuda", 12, o).moe_runner, "kiln-grouped");
  EXPECT_EQ(h.fp4_gemm, "kiln-w4a16");
  EXPECT_NE(h.str().find("fp4-gemm kiln-w4a16"), std::string::npos);
}

// The CUDA-core alternatives of each kernel choice are accepted on a GPU and named as asked; the CPU has none.
TEST(KernelChoice, Fp32AlternativesResolveOnCuda) {
  LoadOptions o;
  o.gpu.attention_backend = "kiln-paged-fp32";
  o.gpu.moe_runner_backend = "kiln-grouped-fp32";
  o.gpu.fp4_gemm_backend = "kiln-fp32";
  const KernelChoice h = resolve_kernels("cuda", 9, o);
  EXPECT_EQ(h.attention, "kiln-paged-fp32");
  EXPECT_EQ(h.moe_runner, "kiln-grouped-fp32");
  EXPECT_EQ(h.fp4_gemm, "kiln-fp32");
  EXPECT_NE(error_of([&] { resolve_kernels("cpu", 0, o); }), "");
  o = LoadOptions();
  o.gpu.moe_runner_backend = "kiln-grouped-fp16";
  const std::string e = error_of([&] { resolve_kernels("cuda", 9, o); });
  EXPECT_NE(e.find("kiln-grouped-fp32"), std::string::npos) << e;
}

TEST(KernelChoice, UnsupportedChoicesAreClearErrors) {
  LoadOptions o;
  o.gpu.attention_backend = "fa3";
  std::string e = error_of([&] { resolve_kernels("cuda", 9, o); });
  EXPECT_NE(e.find("--attention-backend 'fa3'"), std::string::npos) << e;
  EXPECT_NE(e.find("kiln-paged"), std::string::npos) << e;
  o = LoadOptions();
  o.gpu.fp4_gemm_backend = "native-fp4";
  e = error_of([&] { resolve_kernels("cuda", 9, o); });
  EXPECT_NE(e.find("sm_90"), std::string::npos) << e;
  EXPECT_NE(e.find("kiln-w4a16"), std::string::npos) << e;
  o = LoadOptions();
  o.gpu.moe_runner_backend = "kiln-grouped";
  EXPECT_NE(error_of([&] { resolve_kernels("cpu", 0, o); }), "");
  EXPECT_EQ(error_of([&] { resolve_kernels("cuda", 9, o); }), "");
}

// --dtype: auto is bfloat16 on CUDA (kCudaAutoDtype, the one line that decides it); bfloat16 and float32 pass;
// float16 is refused with the reason; the CPU backend takes auto / float32 only.
TEST(Dtype, ResolvesPerDevice) {
  EXPECT_STREQ(kCudaAutoDtype, "bfloat16");  // docs/perf/dtype-h200.md: within the budget, faster
  EXPECT_EQ(resolve_dtype("cuda", "auto"), kCudaAutoDtype);
  EXPECT_EQ(resolve_dtype("cuda", "bfloat16"), "bfloat16");
  EXPECT_EQ(resolve_dtype("cuda", "float32"), "float32");
  EXPECT_EQ(resolve_dtype("cpu", "auto"), "float32");
  EXPECT_EQ(resolve_dtype("cpu", "float32"), "float32");
  std::string e = error_of([] { resolve_dtype("cuda", "float16"); });
  EXPECT_NE(e.find("--dtype float16 is not supported by the CUDA backend yet; use bfloat16 or float32"),
            std::string::npos)
      << e;
  for (const char* d : {"bfloat16", "float16"}) {
    e = error_of([&] { resolve_dtype("cpu", d); });
    EXPECT_NE(e.find("the CPU backend always runs fp32"), std::string::npos) << d << ": " << e;
  }
  EXPECT_EQ(resolve_dtype("cuda", "float"), "float32");  // SGLang's aliases
  EXPECT_EQ(resolve_dtype("cpu", "float"), "float32");
  EXPECT_NE(error_of([] { resolve_dtype("cuda", "half"); }).find("float16 is not supported"), std::string::npos);
  e = error_of([] { resolve_dtype("cuda", "bf16"); });
  EXPECT_NE(e.find("auto, bfloat16, float16 or float32"), std::string::npos) << e;
}

TEST(Dtype, IsPartOfTheKernelChoice) {
  LoadOptions o;
  EXPECT_EQ(resolve_kernels("cpu", 0, o).dtype, "float32");
  KernelChoice h = resolve_kernels("cuda", 9, o);  // auto
  EXPECT_EQ(h.dtype, "bfloat16");
  EXPECT_NE(h.str().find("dtype bfloat16"), std::string::npos) << h.str();
  o.gpu.dtype = "float32";
  h = resolve_kernels("cuda", 9, o);
  EXPECT_EQ(h.dtype, "float32");
  EXPECT_NE(h.str().find("dtype float32"), std::string::npos) << h.str();
  o.gpu.dtype = "bfloat16";
  h = resolve_kernels("cuda", 9, o);
  EXPECT_EQ(h.dtype, "bfloat16");
  EXPECT_NE(h.str().find("dtype bfloat16"), std::string::npos) << h.str();
  EXPECT_NE(error_of([&] { resolve_kernels("cpu", 0, o); }).find("CPU backend"), std::string::npos);
}

// --mamba-ssm-dtype (the DeltaNet recurrent state): auto is float32 (bfloat16 is opt-in on cuda); an explicit choice
// wins on cuda; bfloat16 on the CPU and unknown names fail.
TEST(MambaSsmDtype, AutoIsFp32AndBf16IsOptInOnCuda) {
  EXPECT_EQ(resolve_mamba_ssm_dtype("cuda", "bfloat16", "auto"), "float32");
  EXPECT_EQ(resolve_mamba_ssm_dtype("cuda", "float32", "auto"), "float32");
  EXPECT_EQ(resolve_mamba_ssm_dtype("cuda", "bfloat16", "float32"), "float32");
  EXPECT_EQ(resolve_mamba_ssm_dtype("cuda", "float32", "bfloat16"), "bfloat16");
  EXPECT_EQ(resolve_mamba_ssm_dtype("cpu", "float32", "auto"), "float32");
  EXPECT_EQ(resolve_mamba_ssm_dtype("cpu", "float32", "float32"), "float32");
  EXPECT_NE(error_of([] { resolve_mamba_ssm_dtype("cpu", "float32", "bfloat16"); }).find("CPU backend"),
            std::string::npos);
  const std::string e = error_of([] { resolve_mamba_ssm_dtype("cuda", "bfloat16", "float16"); });
  EXPECT_NE(e.find("--mamba-ssm-dtype 'float16'"), std::string::npos) << e;
  // Part of the kernel choice, so the startup summary names it.
  LoadOptions o;
  KernelChoice h = resolve_kernels("cuda", 9, o);
  EXPECT_EQ(h.mamba_ssm_dtype, "float32");
  EXPECT_NE(h.str().find("mamba-ssm-dtype float32"), std::string::npos) << h.str();
  o.gpu.mamba_ssm_dtype = "bfloat16";
  EXPECT_NE(resolve_kernels("cuda", 9, o).str().find("mamba-ssm-dtype bfloat16"), std::string::npos);
  o.gpu.mamba_ssm_dtype = "auto";
  o.gpu.dtype = "float32";
  EXPECT_EQ(resolve_kernels("cuda", 9, o).mamba_ssm_dtype, "float32");
  o.gpu.mamba_ssm_dtype = "bfloat16";
  EXPECT_EQ(resolve_kernels("cuda", 9, o).mamba_ssm_dtype, "bfloat16");
  EXPECT_NE(error_of([&] { resolve_kernels("cpu", 0, o); }), "");
  EXPECT_EQ(resolve_kernels("cpu", 0, LoadOptions()).mamba_ssm_dtype, "float32");
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
  EXPECT_DOUBLE_EQ(p.kv_bytes, p.kv_tokens * kv_per_token);
  // All the budget leaves goes to KV pages: less than one page's bytes stays unused.
  const double left = 141.0 * GiB * 0.9 - p.weight_bytes - p.state_bytes - p.activation_bytes;
  EXPECT_LE(p.kv_bytes, left);
  EXPECT_GT(p.kv_bytes, left - 16 * kv_per_token);
  EXPECT_EQ(p.state_slots, 64);
  EXPECT_EQ(p.context, 4096);
  EXPECT_GT(p.weight_bytes, 15.0 * GiB);
  EXPECT_LT(p.weight_bytes, 25.0 * GiB);
  // State per sequence: 30 linear layers x (32 heads x 128 x 128 fp32 (--mamba-ssm-dtype auto: float32) + conv
  // 8192 x 3 fp32).
  EXPECT_DOUBLE_EQ(p.state_bytes, 64.0 * 30 * (32.0 * 128 * 128 * 4 + 8192.0 * 3 * 4));
  EXPECT_NE(p.str().find("memory plan"), std::string::npos);
  // A bf16 state (--mamba-ssm-dtype bfloat16) takes half the recurrent bytes, and the KV cache gets what it leaves.
  {
    LoadOptions f = o;
    f.gpu.mamba_ssm_dtype = "bfloat16";
    const MemoryPlan p16 = plan_device_memory(dir, f, 141.0 * GiB, 140.0 * GiB);
    EXPECT_DOUBLE_EQ(p16.state_bytes, 64.0 * 30 * (32.0 * 128 * 128 * 2 + 8192.0 * 3 * 4));
    EXPECT_GT(p16.kv_pages, p.kv_pages);
  }
  // float32 named, or --dtype float32: the same plan as auto, except that --dtype float32 never dequantises the
  // experts (cuda_options.h, moe_prefill_blas), so its activations lack that buffer.
  for (const char* flag : {"mamba", "dtype"}) {
    LoadOptions f = o;
    const bool dtype = std::string(flag) == "dtype";
    (dtype ? f.gpu.dtype : f.gpu.mamba_ssm_dtype) = "float32";
    const MemoryPlan p32 = plan_device_memory(dir, f, 141.0 * GiB, 140.0 * GiB);
    EXPECT_DOUBLE_EQ(p32.state_bytes, 64.0 * 30 * (32.0 * 128 * 128 * 4 + 8192.0 * 3 * 4)) << flag;
    EXPECT_DOUBLE_EQ(p32.weight_bytes, p.weight_bytes) << flag;
    EXPECT_DOUBLE_EQ(p32.activation_bytes, p.activation_bytes - (dtype ? p.moe_dequant_bytes : 0.0)) << flag;
    if (dtype) EXPECT_GE(p32.kv_pages, p.kv_pages) << flag;
    else EXPECT_EQ(p32.kv_pages, p.kv_pages) << flag;
  }

  // Nothing asked: the budget decides, and stays inside gpu x fraction.
  o.max_context = 262144;
  o.state_slots = 128;
  const MemoryPlan q = plan_device_memory(dir, o, 141.0 * GiB, 0);
  EXPECT_LT(q.kv_pages, 128 * (262144 / 16));
  EXPECT_GT(q.kv_bytes, 50.0 * GiB);
  EXPECT_LE(q.weight_bytes + q.kv_bytes + q.state_bytes + q.activation_bytes, 141.0 * GiB * 0.9 + 1);
}

// The NVFP4 experts dequantised for large steps (cuda/moe_prefill_blas.h): one bf16 buffer of at most 256 MiB, in
// the activation estimate when the runner takes that path (bf16 inputs; kiln-blas, or auto with large passes where
// the wgmma GEMMs do not serve the experts).
// The 35B-A3B's experts hold 256 x 3 x 512 x 2048 x 2 bytes = 1.5 GiB in bf16 per layer, so the cap applies.
TEST(MemoryPlan, DequantisedExpertsBufferIsPlannedWhenThePathCanRun) {
  const format::ModelDir dir = format::ModelDir::open(kConfig35);
  LoadOptions o;
  o.state_slots = 64;
  o.max_context = 4096;
  o.gpu.moe_runner_backend = "kiln-blas";
  const MemoryPlan p = plan_device_memory(dir, o, 141.0 * GiB, 0);
  EXPECT_DOUBLE_EQ(p.moe_dequant_bytes, 256.0 * 1024 * 1024);
  EXPECT_NE(p.str().find("of which 0.25 GiB dequantised experts"), std::string::npos) << p.str();
  for (const char* runner : {"auto", "kiln-grouped", "kiln-fused-decode", "kiln-mma", "kiln-grouped-fp32"}) {
    LoadOptions f = o;
    f.gpu.moe_runner_backend = runner;
    const MemoryPlan q = plan_device_memory(dir, f, 141.0 * GiB, 0);
    EXPECT_EQ(q.moe_dequant_bytes, 0.0) << runner;
    EXPECT_DOUBLE_EQ(q.activation_bytes, p.activation_bytes - p.moe_dequant_bytes) << runner;
    EXPECT_EQ(q.str().find("dequantised"), std::string::npos) << q.str();
  }
  // auto with passes of >= kMoePrefillBlasMinTokens: the buffer, except on sm_90, where the wgmma GEMMs serve the
  // 35B-A3B's experts (H 2048, I 512) and take those passes instead (unknown GPU: planned, to be safe).
  LoadOptions a = o;
  a.gpu.moe_runner_backend = "auto";
  a.prefill_chunk = 8192;
  EXPECT_DOUBLE_EQ(plan_device_memory(dir, a, 141.0 * GiB, 0).moe_dequant_bytes, 256.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(plan_device_memory(dir, a, 141.0 * GiB, 0, 10).moe_dequant_bytes, 256.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(plan_device_memory(dir, a, 141.0 * GiB, 0, 12).moe_dequant_bytes, 256.0 * 1024 * 1024);
  EXPECT_EQ(plan_device_memory(dir, a, 141.0 * GiB, 0, 9).moe_dequant_bytes, 0.0);
  // kiln-blas pins the path: planned on sm_90 too.
  EXPECT_DOUBLE_EQ(plan_device_memory(dir, o, 141.0 * GiB, 0, 9).moe_dequant_bytes, 256.0 * 1024 * 1024);
}

// kiln-mma / kiln-blas pin the routed experts' path (A/B timing); kiln-blas needs bf16 inputs and sm_90+.
TEST(KernelChoice, MoePrefillPathsResolveAndKilnBlasNeedsBf16OnSm90) {
  LoadOptions o;
  for (const char* runner : {"kiln-mma", "kiln-blas"}) {
    o.gpu.moe_runner_backend = runner;
    EXPECT_EQ(resolve_kernels("cuda", 9, o).moe_runner, runner);
    EXPECT_EQ(resolve_kernels("cuda", 12, o).moe_runner, runner);
    EXPECT_NE(error_of([&] { resolve_kernels("cpu", 0, o); }), "") << runner;
  }
  o.gpu.moe_runner_backend = "kiln-blas";
  o.gpu.dtype = "float32";
  std::string e = error_of([&] { resolve_kernels("cuda", 9, o); });
  EXPECT_NE(e.find("--dtype bfloat16"), std::string::npos) << e;
  o.gpu.dtype = "auto";
  e = error_of([&] { resolve_kernels("cuda", 8, o); });
  EXPECT_NE(e.find("sm_90"), std::string::npos) << e;
  o.gpu.moe_runner_backend = "kiln-mma";
  o.gpu.dtype = "float32";
  EXPECT_EQ(error_of([&] { resolve_kernels("cuda", 8, o); }), "");
  // kiln-wgmma: Hopper's warpgroup MMA with bf16 inputs, sm_90 only.
  o.gpu.moe_runner_backend = "kiln-wgmma";
  o.gpu.dtype = "auto";
  EXPECT_EQ(resolve_kernels("cuda", 9, o).moe_runner, "kiln-wgmma");
  for (int major : {8, 10, 12}) {
    e = error_of([&] { resolve_kernels("cuda", major, o); });
    EXPECT_NE(e.find("an sm_90 GPU"), std::string::npos) << major << ": " << e;
  }
  o.gpu.dtype = "float32";
  e = error_of([&] { resolve_kernels("cuda", 9, o); });
  EXPECT_NE(e.find("--dtype bfloat16"), std::string::npos) << e;
}

TEST(PrefillSizes, AutoByDeviceAndTheSetValues) {
  // auto: 8192 on a GPU of 80 GB (decimal) or more, 2048 below, 512 on the CPU; a set pass size is kept.
  PrefillSizes h200 = resolve_prefill_sizes("auto", "512", "cuda", 139.8 * GiB);
  EXPECT_EQ(h200.step_tokens, 8192);
  EXPECT_EQ(h200.pass_tokens, 512);
  EXPECT_NE(h200.reason.find("auto"), std::string::npos) << h200.reason;
  EXPECT_EQ(resolve_prefill_sizes("auto", "512", "cuda", 80e9).step_tokens, 8192);
  EXPECT_EQ(resolve_prefill_sizes("auto", "512", "cuda", 79.9e9).step_tokens, 2048);
  EXPECT_EQ(resolve_prefill_sizes("auto", "512", "cuda", 48e9).step_tokens, 2048);
  PrefillSizes cpu = resolve_prefill_sizes("auto", "512", "cpu", 0);
  EXPECT_EQ(cpu.step_tokens, 512);
  EXPECT_EQ(cpu.pass_tokens, 512);
  // A set value is used as it is; the pass is never larger than a positive step budget.
  EXPECT_EQ(resolve_prefill_sizes("4096", "512", "cuda", 139.8 * GiB).step_tokens, 4096);
  EXPECT_EQ(resolve_prefill_sizes("4096", "2048", "cuda", 139.8 * GiB).pass_tokens, 2048);
  PrefillSizes small = resolve_prefill_sizes("256", "512", "cuda", 139.8 * GiB);
  EXPECT_EQ(small.step_tokens, 256);
  EXPECT_EQ(small.pass_tokens, 256);
  // <= 0: no per-step budget (whole prompts in one step), passes of --max-pass-tokens.
  for (const char* off : {"0", "-1"}) {
    PrefillSizes p = resolve_prefill_sizes(off, "512", "cuda", 139.8 * GiB);
    EXPECT_EQ(p.step_tokens, 0) << off;
    EXPECT_EQ(p.pass_tokens, 512) << off;
  }
  EXPECT_EQ(resolve_pass_tokens(4096, 0), 4096);
  EXPECT_EQ(resolve_pass_tokens(4096, 1024), 1024);
  for (const char* bad : {"", "big", "12x", "8k"})
    EXPECT_NE(error_of([&] { resolve_prefill_sizes(bad, "512", "cpu", 0); }).find("--chunked-prefill-size"),
              std::string::npos)
        << bad;
  EXPECT_NE(error_of([] { resolve_prefill_sizes("auto", "0", "cpu", 0); }).find("--max-pass-tokens"), std::string::npos);
  EXPECT_NE(error_of([] { resolve_prefill_sizes("auto", "lots", "cpu", 0); }).find("--max-pass-tokens"),
            std::string::npos);
  // --max-pass-tokens auto: one pass per step (the step budget), 8192 without one.
  EXPECT_EQ(resolve_prefill_sizes("auto", "auto", "cuda", 139.8 * GiB).pass_tokens, 8192);
  EXPECT_EQ(resolve_prefill_sizes("auto", "auto", "cuda", 48e9).pass_tokens, 2048);
  EXPECT_EQ(resolve_prefill_sizes("auto", "auto", "cpu", 0).pass_tokens, 512);
  EXPECT_EQ(resolve_prefill_sizes("3000", "auto", "cuda", 139.8 * GiB).pass_tokens, 3000);
  EXPECT_EQ(resolve_prefill_sizes("0", "auto", "cuda", 139.8 * GiB).pass_tokens, kAutoPassTokensNoBudget);
}

TEST(PrefillSizes, StepsWithDecodes) {
  // auto: 2048 on CUDA where the step budget is larger, else none (0: the step budget serves those steps too).
  PrefillSizes h200 = resolve_prefill_sizes("auto", "auto", "cuda", 139.8 * GiB);
  EXPECT_EQ(h200.step_tokens_while_decoding, 2048);
  EXPECT_EQ(h200.pass_tokens, 8192);  // the pass (and its activation plan) stays the large step's
  EXPECT_NE(h200.reason.find("steps with decodes: 2048"), std::string::npos) << h200.reason;
  EXPECT_EQ(resolve_prefill_sizes("auto", "auto", "cuda", 48e9).step_tokens_while_decoding, 0);  // 2048 already
  EXPECT_EQ(resolve_prefill_sizes("auto", "auto", "cpu", 0).step_tokens_while_decoding, 0);
  EXPECT_EQ(resolve_prefill_sizes("16384", "auto", "cuda", 139.8 * GiB).step_tokens_while_decoding, 2048);
  EXPECT_EQ(resolve_prefill_sizes("0", "auto", "cuda", 139.8 * GiB).step_tokens_while_decoding, 0);  // no budget
  // A set value where smaller than the step budget (any value without one); <= 0 or larger: none.
  EXPECT_EQ(resolve_prefill_sizes("auto", "auto", "cuda", 139.8 * GiB, "1024").step_tokens_while_decoding, 1024);
  EXPECT_EQ(resolve_prefill_sizes("auto", "auto", "cpu", 0, "128").step_tokens_while_decoding, 128);
  EXPECT_EQ(resolve_prefill_sizes("0", "auto", "cuda", 139.8 * GiB, "4096").step_tokens_while_decoding, 4096);
  for (const char* none : {"0", "-1", "8192", "20000"})
    EXPECT_EQ(resolve_prefill_sizes("auto", "auto", "cuda", 139.8 * GiB, none).step_tokens_while_decoding, 0) << none;
  for (const char* bad : {"", "half", "2k"})
    EXPECT_NE(error_of([&] { resolve_prefill_sizes("auto", "auto", "cuda", 139.8 * GiB, bad); })
                  .find("--chunked-prefill-size-while-decoding"),
              std::string::npos)
        << bad;
}

// The plan reserves activations for one forward pass (--max-pass-tokens), not for the step budget: serve's auto
// 8192-token steps on an H200 plan the same activations as 512-token steps, and a pass of 8192 tokens would take
// most of the GPU for the 35B shape (scratch is held over all 40 layers of a pass).
TEST(MemoryPlan, ActivationsFollowThePassAndItsLayerRelease) {
  const format::ModelDir dir = format::ModelDir::open(kConfig35);
  LoadOptions o;
  o.state_slots = 64;
  o.max_context = 4096;
  o.prefill_chunk = resolve_prefill_sizes("auto", "512", "cuda", 139.8 * GiB).pass_tokens;
  const MemoryPlan serve_auto = plan_device_memory(dir, o, 139.8 * GiB, 0);
  o.prefill_chunk = 512;
  const MemoryPlan pass512 = plan_device_memory(dir, o, 139.8 * GiB, 0);
  EXPECT_DOUBLE_EQ(serve_auto.activation_bytes, pass512.activation_bytes);
  o.prefill_chunk = 8192;
  const MemoryPlan pass8k = plan_device_memory(dir, o, 139.8 * GiB, 0);
  EXPECT_LT(pass512.activation_bytes, 8.0 * GiB);
  // A pass of >= model::kLayerScratchReleaseMinTokens tokens frees each layer's buffers when the layer is done: an
  // 8192-token pass holds about two layers' (not 40), while a 256-token pass (a decode step of 256 sequences: no
  // release) holds all 40. One layer of the 35B per token, in floats: 8 H + 3 max(C, Q) + the MoE rows
  // = 8 x 2048 + 3 x 8192 + (8 x (512 + 2048) + 256 + 3 x 512 + 1.5 x (2048 + 8 x 512)) = 72,448, i.e. 289,792 bytes.
  const double layer8k = 8192.0 * 289792;
  EXPECT_GT(pass8k.activation_bytes, layer8k);
  EXPECT_LT(pass8k.activation_bytes, 3 * layer8k);
  EXPECT_LT(pass8k.kv_bytes, pass512.kv_bytes);
  o.prefill_chunk = 256;
  const MemoryPlan pass256 = plan_device_memory(dir, o, 139.8 * GiB, 0);
  EXPECT_GT(pass256.activation_bytes, 40 * 256.0 * 289792);
}

// The vision tower (LoadOptions::vision): its BF16 weights, the forward's buffers per patch of the largest image, and
// the biased linears' cuBLASLt buffers (blocks of at most 8192 rows: 3 fp32 partial outputs of the widest linear,
// fc1's 4304 columns, at least 8192 x 12 x 4304 bytes); nothing without it.
TEST(MemoryPlan, VisionTowerIsPlannedWhenLoaded) {
  const format::ModelDir dir = format::ModelDir::open(kConfig35);
  LoadOptions o;
  o.state_slots = 8;
  o.max_context = 4096;
  EXPECT_EQ(plan_device_memory(dir, o, 141.0 * GiB, 0).vision_bytes, 0.0);
  o.vision = true;
  o.vision_max_patches = 0;
  const double weights_only = plan_device_memory(dir, o, 141.0 * GiB, 0).vision_bytes;
  EXPECT_GT(weights_only, 0.8e9);  // ~0.4 B parameters in BF16
  EXPECT_LT(weights_only, 1.2e9);
  o.vision_max_patches = 16384;
  const double big = plan_device_memory(dir, o, 141.0 * GiB, 0).vision_bytes;
  EXPECT_GE(big - weights_only, 8192.0 * 12 * 4304 + 16384.0 * 4 * (10 * 1152 + 4304));
}

TEST(MemoryPlan, StateSlotsAndContextComeFromThePlan) {
  const format::ModelDir dir = format::ModelDir::open(kConfig35);
  LoadOptions o;
  o.state_slots = 0;  // the plan chooses
  o.slots_per_request = 3;
  const MemoryPlan p = plan_device_memory(dir, o, 141.0 * GiB, 0);
  const double per_seq = 30 * (32.0 * 128 * 128 * 4 + 8192.0 * 3 * 4);  // fp32 recurrent state (--mamba-ssm-dtype auto)
  EXPECT_EQ(p.state_slots, 3 * p.max_running);
  EXPECT_GE(p.max_running, 1);
  EXPECT_LE(p.max_running, 256);
  // The slots take at most a quarter of what weights and activations leave.
  EXPECT_LE(p.state_bytes, (141.0 * GiB * 0.9 - p.weight_bytes) / 4);
  EXPECT_DOUBLE_EQ(p.state_bytes, p.state_slots * per_seq);
  EXPECT_EQ(p.context, 32768);  // the 35B config's max_position_embeddings (no 8192 cap)
  EXPECT_GE(p.kv_tokens, 32768);
  // A GPU whose KV cache holds about 16000 tokens, less than one 32768-token sequence: the context is capped to it.
  o.state_slots = 8;
  const MemoryPlan big = plan_device_memory(dir, o, 141.0 * GiB, 0);
  const double kv_per_token = 10 * 2 * 2 * 256 * 2;
  const double gpu = (big.weight_bytes + big.activation_bytes + big.state_bytes + 16000 * kv_per_token) / 0.9;
  const MemoryPlan q = plan_device_memory(dir, o, gpu, 0);
  EXPECT_LT(q.kv_tokens, 32768);
  EXPECT_GT(q.kv_tokens, 15000);
  EXPECT_EQ(q.context, q.kv_tokens);
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
  o.gpu.mem_fraction_static = 0.99;
  EXPECT_NE(error_of([&] { plan_device_memory(dir, o, 141.0 * GiB, 0); }), "");
}


// The plan of one rank's GPU at tp 1 / 2 / 8 (what kiln serve --tp-size N allocates on each GPU, and kiln inspect
// --tp N prints), against figures worked out here from the configs (REFERENCE's shapes).
struct Shape {
  const char* dir;
  int full_layers, linear_layers, kv_heads, key_heads, value_heads, layers, experts, inter, hidden;
};
const Shape k397{"/configs/qwen3.5-397b-a17b-nvfp4", 15, 45, 2, 16, 64, 60, 512, 1024, 4096};
const Shape k35{"/configs/qwen3.5-35b-a3b-nvfp4", 10, 30, 2, 16, 32, 40, 256, 512, 2048};

TEST(MemoryPlan, PerRankPlanAtTp1To8) {
  for (const Shape& m : {k397, k35}) {
    const format::ModelDir dir = format::ModelDir::open(std::string(KILN_SOURCE_DIR) + m.dir);
    // Routed experts: gate, up, down of inter x hidden each, NVFP4 (half a byte per weight + one E4M3 scale per 16).
    const double routed = double(m.layers) * m.experts * 3.0 * m.inter * m.hidden * (0.5 + 1.0 / 16);
    double whole = 0;
    for (int tp : {1, 2, 8}) {
      LoadOptions o;
      o.parallel.tp_size = tp;
      o.state_slots = 16;
      o.max_context = 8192;
      const MemoryPlan p = plan_device_memory(dir, o, 400.0 * GiB, 0);
      SCOPED_TRACE(std::string(m.dir) + " tp " + std::to_string(tp));
      EXPECT_EQ(p.tp, tp);
      EXPECT_EQ(p.ranks_per_gpu, 1);
      // KV: one KV head per rank once tp >= the 2 KV heads (replicated), x 2 (K, V) x 256 x bf16.
      const int kv_local = std::max(1, m.kv_heads / tp);
      const double kv_per_token = m.full_layers * 2.0 * kv_local * 256 * 2;
      EXPECT_DOUBLE_EQ(p.kv_bytes, p.kv_tokens * kv_per_token);
      // State per slot: the rank's value heads' 128 x 128 state in fp32 (--mamba-ssm-dtype auto: float32) + conv
      // state (q, k of its key heads, v of its value heads) x 3 taps x fp32.
      const double vh = m.value_heads / tp, kh = std::max(1, m.key_heads / tp);
      const double state = m.linear_layers * (vh * 128 * 128 * 4 + (2 * kh * 128 + vh * 128) * 3 * 4);
      EXPECT_DOUBLE_EQ(p.state_bytes, 16 * state);
      // Weights: each rank holds 1 / tp of every routed expert, plus at most everything else whole.
      if (tp == 1) whole = p.weight_bytes;
      EXPECT_GE(p.weight_bytes, routed / tp);
      EXPECT_LE(p.weight_bytes, routed / tp + (whole - routed));
      if (tp > 1) EXPECT_LT(p.weight_bytes, whole / tp * 1.2);
      // The KV cache takes what is left of the rank's budget, to within one page.
      const double left = 400.0 * GiB * 0.9 - p.weight_bytes - p.state_bytes - p.activation_bytes;
      EXPECT_LE(p.kv_bytes, left);
      EXPECT_GT(p.kv_bytes, left - 16 * kv_per_token);
      if (tp > 1) EXPECT_NE(p.str().find("per GPU of tp " + std::to_string(tp)), std::string::npos) << p.str();
    }
  }
}

TEST(MemoryPlan, RanksSharingOneGpuSplitItsBudget) {
  const format::ModelDir dir = format::ModelDir::open(kConfig35);
  LoadOptions o;
  o.parallel.tp_size = 2;
  o.state_slots = 8;
  o.max_context = 4096;
  const MemoryPlan own = plan_device_memory(dir, o, 141.0 * GiB, 0);
  o.parallel.gpu_id_step = 0;  // both ranks on one GPU
  const MemoryPlan shared = plan_device_memory(dir, o, 141.0 * GiB, 0);
  EXPECT_EQ(shared.ranks_per_gpu, 2);
  EXPECT_DOUBLE_EQ(shared.budget_bytes, 141.0 * GiB * 0.9 / 2);
  EXPECT_DOUBLE_EQ(shared.weight_bytes, own.weight_bytes);
  EXPECT_LT(shared.kv_pages, own.kv_pages);
  EXPECT_LE(2 * (shared.weight_bytes + shared.kv_bytes + shared.state_bytes + shared.activation_bytes),
            141.0 * GiB * 0.9 + 1);
  EXPECT_NE(shared.str().find("2 ranks share each GPU"), std::string::npos) << shared.str();
}

TEST(MemoryPlan, ShardErrorsAndTooSmallGpusNameTheTpSize) {
  const format::ModelDir dir = format::ModelDir::open(std::string(KILN_SOURCE_DIR) + k397.dir);
  LoadOptions o;
  o.parallel.tp_size = 3;  // does not divide 32 heads
  EXPECT_NE(error_of([&] { plan_device_memory(dir, o, 141.0 * GiB, 0); }), "");
  o.parallel.tp_size = 2;
  const std::string e = error_of([&] { plan_device_memory(dir, o, 96.0 * GiB, 0); });
  EXPECT_NE(e.find("on each GPU of tp 2"), std::string::npos) << e;
  EXPECT_NE(e.find("--tp-size"), std::string::npos) << e;
}

// ---------------------------------------------------------------------------------------------------
// validate_parallel: the one check of the parallel sizes.

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

void expect_invalid(const ParallelOptions& p, const std::string& message) {
  EXPECT_THAT([&] { validate_parallel(p); }, ThrowsMessage<Error>(HasSubstr(message)));
}

TEST(ValidateParallel, DefaultsAndGoodSizesPass) {
  EXPECT_NO_THROW(validate_parallel(ParallelOptions{}));
  ParallelOptions p;
  p.tp_size = 8;
  p.ep_size = 4;
  p.nnodes = 2;
  p.node_rank = 1;
  p.dist_init_addr = "node0:5000";
  EXPECT_NO_THROW(validate_parallel(p));
}

TEST(ValidateParallel, SizesThatDoNotDivide) {
  ParallelOptions p;
  p.tp_size = 4;
  p.ep_size = 3;
  expect_invalid(p, "--ep-size 3 must divide --tp-size 4");
  p = {};
  p.tp_size = 6;
  p.nnodes = 4;
  p.node_rank = 1;
  p.dist_init_addr = "10.0.0.1:5000";
  expect_invalid(p, "--tp-size 6 does not divide over --nnodes 4: every machine runs tp-size / nnodes ranks");
}

TEST(ValidateParallel, OutOfRangeValues) {
  ParallelOptions p;
  p.tp_size = 0;
  expect_invalid(p, "--tp-size must be at least 1, got 0");
  p = {};
  p.ep_size = 0;
  expect_invalid(p, "--ep-size must be at least 1, got 0");
  p = {};
  p.nnodes = 0;
  expect_invalid(p, "--nnodes must be at least 1, got 0");
  p = {};
  p.base_gpu_id = -1;
  expect_invalid(p, "--base-gpu-id must not be negative, got -1");
  p = {};
  p.gpu_id_step = -1;
  expect_invalid(p, "--gpu-id-step must not be negative, got -1");
  p = {};
  p.tp_size = 8;
  p.nnodes = 2;
  p.node_rank = 2;
  p.dist_init_addr = "10.0.0.1:5000";
  expect_invalid(p, "--node-rank 2 is outside 0..1 (--nnodes 2)");
}

TEST(ValidateParallel, SeveralNodesNeedAnAddressWithAPort) {
  ParallelOptions p;
  p.tp_size = 4;
  p.nnodes = 2;
  expect_invalid(p, "--nnodes 2 needs --dist-init-addr host:port");
  p.dist_init_addr = "10.0.0.1";
  expect_invalid(p, "--dist-init-addr '10.0.0.1': no port");
  p.dist_init_addr = "10.0.0.1:99999";
  expect_invalid(p, "port 99999 is outside 1..65535");
}

TEST(ValidateParallel, SingleRankIsOneRankOfALargerPlanOnOneMachine) {
  ParallelOptions p;
  p.single_rank = 0;
  expect_invalid(p, "--single-rank 0 needs --tp-size greater than it (got --tp-size 1)");
  p.tp_size = 4;
  p.single_rank = 4;
  expect_invalid(p, "--single-rank 4 needs --tp-size greater than it");
  p.single_rank = 3;
  EXPECT_NO_THROW(validate_parallel(p));
  EXPECT_EQ(p.local_ranks(), 1);
  p.nnodes = 2;
  p.dist_init_addr = "10.0.0.1:5000";
  expect_invalid(p, "--single-rank runs one GPU of one machine: drop --nnodes");
}

TEST(ValidateParallel, LocalRanksAreTpOverNodes) {
  ParallelOptions p;
  EXPECT_EQ(p.local_ranks(), 1);
  p.tp_size = 8;
  EXPECT_EQ(p.local_ranks(), 8);
  p.nnodes = 2;
  EXPECT_EQ(p.local_ranks(), 4);
  p = {};
  EXPECT_FALSE(p.is_group());
  p.ep_size = 2;  // expert parallel alone is a group too
  EXPECT_TRUE(p.is_group());
}

// ---------------------------------------------------------------------------------------------------
// place_ranks over fake GPU probes.

std::vector<GpuInfo> gpus(int n, double gib = 80, const char* name = "NVIDIA H100 80GB HBM3") {
  std::vector<GpuInfo> out(n);
  for (int i = 0; i < n; ++i) {
    out[i].name = name;
    out[i].major = 9;
    out[i].memory_bytes = gib * GiB;
    out[i].free_bytes = (gib - 1) * GiB;
  }
  return out;
}

ParallelOptions tp(int n) {
  ParallelOptions p;
  p.tp_size = n;
  return p;
}

TEST(PlaceRanks, OneRankPerGpuFromTheBase) {
  RankPlacement r = place_ranks(tp(4), gpus(8));
  EXPECT_EQ(r.devices, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(r.ranks_on_first_gpu, 1);
  EXPECT_EQ(r.first_rank, 0);
  EXPECT_EQ(r.gpu_list(), "0,1,2,3");
  ParallelOptions p = tp(2);
  p.base_gpu_id = 4;
  p.gpu_id_step = 2;
  EXPECT_EQ(place_ranks(p, gpus(8)).devices, (std::vector<int>{4, 6}));
  EXPECT_EQ(place_ranks(ParallelOptions{}, gpus(1)).devices, (std::vector<int>{0}));
}

TEST(PlaceRanks, StepZeroPutsEveryRankOnOneGpu) {
  ParallelOptions p = tp(4);
  p.gpu_id_step = 0;
  const RankPlacement r = place_ranks(p, gpus(1));
  EXPECT_EQ(r.devices, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(r.ranks_on_first_gpu, 4);
}

TEST(PlaceRanks, MoreRanksThanGpusIsAClearError) {
  EXPECT_THAT([] { place_ranks(tp(4), gpus(2)); },
              ThrowsMessage<Error>(HasSubstr("--tp-size 4 puts rank 2 on GPU 2 (--base-gpu-id 0 --gpu-id-step 1), but "
                                             "this machine has 2 GPU(s) (0..1): lower --tp-size, or --gpu-id-step 0")));
  ParallelOptions p = tp(2);
  p.gpu_id_step = 64;
  EXPECT_THAT([&] { place_ranks(p, gpus(2)); }, ThrowsMessage<Error>(HasSubstr("rank 1 on GPU 64")));
  EXPECT_THAT([] { place_ranks(ParallelOptions{}, {}); },
              ThrowsMessage<Error>(HasSubstr("but this machine has 0 GPU(s):")));
}

TEST(PlaceRanks, UnusableAndMismatchedGpusAreRefused) {
  std::vector<GpuInfo> g = gpus(2);
  g[1].usable = false;
  g[1].reason = "compute capability 8.0 not supported";
  EXPECT_THAT([&] { place_ranks(tp(2), g); },
              ThrowsMessage<Error>(HasSubstr("rank 1 on GPU 1: compute capability 8.0 not supported")));
  g = gpus(2);
  g[1].name = "NVIDIA H200";
  g[1].memory_bytes = 141 * GiB;
  EXPECT_THAT([&] { place_ranks(tp(2), g); },
              ThrowsMessage<Error>(HasSubstr("tensor parallel needs GPUs of one kind: GPU 0 is NVIDIA H100 80GB HBM3")));
}

TEST(PlaceRanks, FreeMemoryIsTheLeastOfTheGpusUsed) {
  std::vector<GpuInfo> g = gpus(4);
  g[2].free_bytes = 10 * GiB;
  g[3].free_bytes = 5 * GiB;  // not used by tp 3
  EXPECT_DOUBLE_EQ(place_ranks(tp(3), g).free_bytes, 10 * GiB);
}

TEST(PlaceRanks, SeveralNodesPlaceTheirOwnRanks) {
  ParallelOptions p = tp(8);
  p.nnodes = 2;
  p.node_rank = 1;
  p.dist_init_addr = "10.0.0.1:5000";
  const RankPlacement r = place_ranks(p, gpus(4));
  EXPECT_EQ(r.devices, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(r.first_rank, 4);
}

TEST(PlaceRanks, SingleRankRunsOnTheBaseGpu) {
  ParallelOptions p = tp(8);
  p.single_rank = 5;
  p.base_gpu_id = 1;
  EXPECT_EQ(place_ranks(p, gpus(2)).devices, (std::vector<int>{1}));
}

// kiln's NCCL settings: NVLink multicast off (the reason is given for the startup summary).
TEST(NcclEnvDefaults, NvlsOffWithAReason) {
  const auto& d = nccl_env_defaults();
  ASSERT_EQ(d.size(), 1u);
  EXPECT_STREQ(d[0].name, "NCCL_NVLS_ENABLE");
  EXPECT_STREQ(d[0].value, "0");
  EXPECT_NE(std::string(d[0].why), "");
}

}  // namespace
}  // namespace kiln::backend
