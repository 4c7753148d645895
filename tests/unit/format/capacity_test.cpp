// kiln inspect maths against hand arithmetic for the bundled Qwen3.5-397B-A17B NVFP4 config
// (configs/qwen3.5-397b-a17b-nvfp4): every number below is written out from the model's sizes.
#include "format/capacity.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "fixture_util.h"

namespace kiln::format {
namespace {

struct Loaded {
  ModelConfig config;
  QuantConfig quant;
  std::vector<ExpectedTensor> tensors;
};
Loaded load_bundled(const std::string& name) {
  ModelDir dir = ModelDir::open(std::string(KILN_SOURCE_DIR) + "/configs/" + name);
  Loaded x{load_model_config(dir), load_quant_config(dir), {}};
  x.tensors = expected_tensors(x.config, x.quant);
  return x;
}

// Sizes of the 397B model.
constexpr int64_t H = 4096, V = 248320, L = 60, LIN = 45, FULL = 15, E = 512, K = 10, I = 1024, S = 1024;
constexpr int64_t NQ = 32, NKV = 2, D = 256, HK = 16, HV = 64, DK = 128, DV = 128, CONV = 4;

// Parameters by part.
constexpr int64_t kLinearAttnParams = (2 * HK * DK + HV * DV) * H  // in_proj_qkv
                                      + HV * DV * H                // in_proj_z
                                      + 2 * HV * H                 // in_proj_b, in_proj_a
                                      + H * HV * DV                // out_proj
                                      + (2 * HK * DK + HV * DV) * CONV  // conv1d
                                      + 2 * HV + DV;               // A_log, dt_bias, norm
constexpr int64_t kAttnProjParams = 2 * NQ * D * H + 2 * NKV * D * H + H * NQ * D;  // q (with gate), k, v, o
constexpr int64_t kAttnParams = kAttnProjParams + 2 * D;                            // + q_norm, k_norm
constexpr int64_t kExpertParamsPerLayer = E * 3 * I * H;
constexpr int64_t kSharedParamsPerLayer = 3 * S * H;
constexpr int64_t kRouterParamsPerLayer = E * H + H;  // mlp.gate + shared_expert_gate
constexpr int64_t kLayerNormParams = 2 * H;
constexpr int64_t kTotalParams = LIN * kLinearAttnParams + FULL * kAttnParams +
                                 L * (kExpertParamsPerLayer + kSharedParamsPerLayer + kRouterParamsPerLayer + kLayerNormParams) +
                                 2 * V * H + H;  // embed, lm_head, final norm

TEST(Capacity, Qwen35_397B_ParamsAndBytes) {
  Loaded x = load_bundled("qwen3.5-397b-a17b-nvfp4");
  CapacityOptions o;
  CapacityPlan p = plan_capacity(x.config, x.tensors, o);

  EXPECT_EQ(p.params_total, kTotalParams);
  EXPECT_NEAR(p.params_total / 1e9, 397, 1.0);  // "397B"
  const int64_t active = kTotalParams - L * kExpertParamsPerLayer + L * K * 3 * I * H;
  EXPECT_EQ(p.params_active, active);
  EXPECT_NEAR(p.params_active / 1e9, 17, 0.5);  // "A17B"

  // Stored bytes: routed experts NVFP4 (K/2 bytes per row + K/16 scales + two f32 scalars per linear),
  // everything else BF16.
  const int64_t fp4_linear_gate_up = I * H / 2 + I * H / 16 + 8;  // [I, H]
  const int64_t fp4_linear_down = H * I / 2 + H * I / 16 + 8;     // [H, I]
  const int64_t expert_bytes = L * E * (2 * fp4_linear_gate_up + fp4_linear_down);
  const int64_t bf16_bytes = 2 * (kTotalParams - L * kExpertParamsPerLayer);
  EXPECT_EQ(p.weight_bytes, static_cast<uint64_t>(expert_bytes + bf16_bytes));
  EXPECT_EQ(p.weight_bytes_by_dtype.at(DType::U8), static_cast<uint64_t>(L * E * 3 * I * H / 2));
  EXPECT_EQ(p.weight_bytes_by_dtype.at(DType::F8_E4M3), static_cast<uint64_t>(L * E * 3 * I * H / 16));
  EXPECT_EQ(p.weight_bytes_by_dtype.at(DType::F32), static_cast<uint64_t>(L * E * 3 * 8));
  EXPECT_EQ(p.weight_bytes_by_dtype.at(DType::BF16), static_cast<uint64_t>(bf16_bytes));
  EXPECT_EQ(p.weight_bytes_by_role.at(role::kRoutedExpert), static_cast<uint64_t>(expert_bytes));

  // Decode at batch 1: all BF16 weights but the embedding table (one row), k/E of the experts.
  const double decode = bf16_bytes - 2.0 * V * H + 2.0 * H + expert_bytes * double(K) / E;
  EXPECT_NEAR(double(p.decode_bytes_per_token), decode, 1.0);
  EXPECT_NEAR(p.decode_bytes_per_token / 1e9, 22, 0.5);  // REFERENCE: ~22 GB
  EXPECT_NEAR(p.decode_bytes_by_role.at(role::kRoutedExpert) / 1e9, 4.3, 0.1);
  EXPECT_NEAR(p.decode_bytes_by_role.at(role::kLinearAttention) / 1e9, 10.6, 0.1);
  EXPECT_NEAR(p.decode_bytes_by_role.at(role::kAttention) / 1e9, 3.1, 0.1);
  EXPECT_NEAR(p.decode_bytes_by_role.at(role::kSharedExpert) / 1e9, 1.5, 0.1);
  EXPECT_NEAR(p.decode_bytes_by_role.at(role::kLmHead) / 1e9, 2.0, 0.1);
  EXPECT_NEAR(p.decode_bytes_by_role.at(role::kRouter) / 1e9, 0.25, 0.01);

  // KV: 15 full layers x 2 KV heads x 256 x (K, V) x 2 bytes.
  EXPECT_EQ(p.kv_bytes_per_token, 15u * 2 * 256 * 2 * 2);
  EXPECT_EQ(p.kv_bytes_per_token, 30720u);
  // State: 45 linear layers x (64 x 128 x 128 fp32 + conv state 12288 channels x 3 taps x fp32).
  EXPECT_EQ(p.recurrent_state_bytes_per_layer, 64u * 128 * 128 * 4);
  EXPECT_EQ(p.conv_state_bytes_per_layer, 12288u * 3 * 4);
  EXPECT_EQ(p.state_bytes_per_sequence, 45u * (64 * 128 * 128 * 4 + 12288 * 3 * 4));
  EXPECT_EQ(p.max_kv_tokens, -1);  // no GPU memory given

  o.kv_dtype = DType::F8_E4M3;
  EXPECT_EQ(plan_capacity(x.config, x.tensors, o).kv_bytes_per_token, 15360u);
}

TEST(Capacity, Qwen35_397B_Tp8At96GiB) {
  Loaded x = load_bundled("qwen3.5-397b-a17b-nvfp4");
  CapacityOptions o;
  o.tp = 8;
  o.gpu_mem_gib = 96;
  CapacityPlan p = plan_capacity(x.config, x.tensors, o);
  // Per GPU: each expert's intermediate (its FP4 bytes and block scales; its two f32 scalars per linear are
  // replicated), query heads, linear-attention heads, shared expert, embedding and lm_head / 8; 2 KV heads over 8
  // GPUs: one KV head each (k_proj, v_proj / 2); norms and routers whole.
  const double fp4_expert = 2.0 * (I * H / 2 + I * H / 16) + (H * I / 2 + H * I / 16);
  const double per_gpu = L * E * fp4_expert / 8 + L * E * 3 * 8.0 +
                         FULL * 2.0 * (2 * NQ * D * H + H * NQ * D) / 8 + FULL * 2.0 * (2 * NKV * D * H) / 2 +
                         FULL * 2.0 * 2 * D + LIN * 2.0 * (kLinearAttnParams - DV) / 8 + LIN * 2.0 * DV +
                         L * 2.0 * kSharedParamsPerLayer / 8 + L * 2.0 * kRouterParamsPerLayer +
                         L * 2.0 * kLayerNormParams + 2 * 2.0 * V * H / 8 + 2.0 * H;
  EXPECT_NEAR(double(p.weight_bytes_per_gpu), per_gpu, 2.0);
  EXPECT_EQ(p.kv_bytes_per_token_per_gpu, 15u * 2 * 1 * 256 * 2);  // one KV head per GPU
  EXPECT_EQ(p.state_bytes_per_sequence_per_gpu, p.state_bytes_per_sequence / 8);
  const double gib = 1024.0 * 1024 * 1024;
  const double budget = 96 * gib * 0.90 - per_gpu - 2 * gib;
  EXPECT_NEAR(double(p.kv_budget_bytes), budget, 2.0);
  EXPECT_NEAR(double(p.max_kv_tokens), std::floor(budget / 15360), 1.0);
  EXPECT_GT(p.max_kv_tokens, 3'900'000);
  bool kv_note = false;
  for (const auto& n : p.notes) kv_note |= n.find("2 KV heads < tp 8") != std::string::npos;
  EXPECT_TRUE(kv_note);
}

TEST(Capacity, Qwen35_397B_Tp2At141GiB) {
  Loaded x = load_bundled("qwen3.5-397b-a17b-nvfp4");
  CapacityOptions o;
  o.tp = 2;
  o.gpu_mem_gib = 141;
  CapacityPlan p = plan_capacity(x.config, x.tensors, o);
  const double norms_and_routers = FULL * 2.0 * 2 * D + LIN * 2.0 * DV + L * 2.0 * kRouterParamsPerLayer +
                                   L * 2.0 * kLayerNormParams + 2.0 * H;
  const double expert_scalars = L * E * 3 * 8.0;  // weight_scale_2 + input_scale per expert linear: replicated
  const double split = p.weight_bytes - norms_and_routers - expert_scalars;
  EXPECT_NEAR(double(p.weight_bytes_per_gpu), split / 2 + norms_and_routers + expert_scalars, 2.0);
  EXPECT_EQ(p.kv_bytes_per_token_per_gpu, 15360u);
  const double gib = 1024.0 * 1024 * 1024;
  const double budget = 141 * gib * 0.90 - (split / 2 + norms_and_routers + expert_scalars) - 2 * gib;
  EXPECT_NEAR(double(p.max_kv_tokens), std::floor(budget / 15360), 1.0);
}

TEST(Capacity, WeightsThatDoNotFit) {
  Loaded x = load_bundled("qwen3.5-397b-a17b-nvfp4");
  CapacityOptions o;
  o.tp = 1;
  o.gpu_mem_gib = 80;
  CapacityPlan p = plan_capacity(x.config, x.tensors, o);
  EXPECT_LT(p.kv_budget_bytes, 0);
  EXPECT_EQ(p.max_kv_tokens, 0);
}

TEST(Capacity, Qwen35_35B_DecodeBytes) {
  Loaded x = load_bundled("qwen3.5-35b-a3b-nvfp4");
  CapacityPlan p = plan_capacity(x.config, x.tensors, {});
  EXPECT_NEAR(p.decode_bytes_per_token / 1e9, 4.4, 0.1);  // REFERENCE: ~4.4 GB
  EXPECT_EQ(p.kv_bytes_per_token, 10u * 2 * 2 * 256 * 2);
  EXPECT_EQ(p.state_bytes_per_sequence, 30u * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 4));
  // A bf16 recurrent state (--mamba-ssm-dtype bfloat16): 2 bytes per element of S, the conv state stays fp32; per
  // GPU at tp 2 half of the heads.
  CapacityOptions o;
  o.recurrent_state_bytes = 2;
  const CapacityPlan b = plan_capacity(x.config, x.tensors, o);
  EXPECT_EQ(b.recurrent_state_bytes_per_layer, 32u * 128 * 128 * 2);
  EXPECT_EQ(b.state_bytes_per_sequence, 30u * (32 * 128 * 128 * 2 + (2 * 16 * 128 + 32 * 128) * 3 * 4));
  o.tp = 2;
  EXPECT_EQ(plan_capacity(x.config, x.tensors, o).state_bytes_per_sequence_per_gpu,
            30u * (16 * 128 * 128 * 2 + (2 * 8 * 128 + 16 * 128) * 3 * 4));
  EXPECT_NEAR(p.params_total / 1e9, 35, 1.0);
  EXPECT_NEAR(p.params_active / 1e9, 3, 0.5);
}

TEST(Capacity, TpThatDoesNotDivideIsAnError) {
  // The plan is the loader's shard plan: a size the model cannot be split by fails with the numbers, as serve does.
  Loaded x = load_bundled("qwen3.5-397b-a17b-nvfp4");
  CapacityOptions o;
  o.tp = 3;
  try {
    plan_capacity(x.config, x.tensors, o);
    FAIL() << "tp 3 accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("32 query heads do not split over 3 ranks"));
  }
  o.tp = 8;
  o.ep = 3;
  EXPECT_THROW(plan_capacity(x.config, x.tensors, o), Error);
}

TEST(Capacity, Qwen35_397B_Tp8Ep8) {
  // EP 8: 64 whole experts per GPU (their scalars too); everything else as at TP 8.
  Loaded x = load_bundled("qwen3.5-397b-a17b-nvfp4");
  CapacityOptions o;
  o.tp = 8;
  CapacityPlan tp8 = plan_capacity(x.config, x.tensors, o);
  o.ep = 8;
  CapacityPlan ep8 = plan_capacity(x.config, x.tensors, o);
  EXPECT_EQ(ep8.ep, 8);
  const double scalars_saved = L * E * 3 * 8.0 * 7 / 8;  // TP keeps every expert's scalars, EP 1/8 of them
  EXPECT_NEAR(double(tp8.weight_bytes_per_gpu) - double(ep8.weight_bytes_per_gpu), scalars_saved, 2.0);
  EXPECT_EQ(ep8.kv_bytes_per_token_per_gpu, tp8.kv_bytes_per_token_per_gpu);
}

TEST(Capacity, BadOptions) {
  Loaded x = load_bundled("qwen3.5-35b-a3b-nvfp4");
  CapacityOptions o;
  o.tp = 0;
  EXPECT_THROW(plan_capacity(x.config, x.tensors, o), Error);
  o.tp = 1;
  o.mem_fraction_static = 1.5;
  EXPECT_THROW(plan_capacity(x.config, x.tensors, o), Error);
}

}  // namespace
}  // namespace kiln::format
