// The chunked gated delta rule (deltanet_chunked.cu, deltanet_chunked_split.cu) through CudaOps against the CPU
// backend, its tensor-core forms (tf32_parts 3 and 1) against the CPU and against the FMA form called directly on the
// same inputs, and the split form (preparation kernel + scan) against a double-precision recurrence and against the
// single kernel. Skipped without a usable GPU. The tensor-core tilings themselves are checked on the host by
// deltanet_chunked_tiles_test.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/kernels.h"
#include "backend/op_check.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

namespace kops = ::kiln::cuda::ops;
using test::rel_err;

// The delta-rule checks of compare_ops (every step chunked) for one CudaOptions, at the Qwen3.5 head sizes (Dk = Dv =
// 128, partial chunks, several sequences, continuations from a carried state) and at odd sizes (Dk 40, Dv 40: padded
// keys, a masked value tile). `kernel`: the phrase of CudaOps::describe naming the delta rule's kernel. Returns the
// worst rel error.
// `form`: the phrase naming the single-kernel or split form.
double check_chunked_against_cpu(CudaOptions o, double tol, const std::string& label, const std::string& kernel,
                                 const std::string& form) {
  auto cpu = make_cpu_backend();
  o.delta_rule = CudaOptions::DeltaRule::chunked;
  CudaOps gpu(o);
  EXPECT_NE(gpu.describe().find("wherever supported [every step]"), std::string::npos) << gpu.describe();
  EXPECT_NE(gpu.describe().find(kernel), std::string::npos) << gpu.describe();
  EXPECT_NE(gpu.describe().find(form), std::string::npos) << gpu.describe();
  double worst = 0;
  for (int64_t d : {128, 40}) {
    OpCheckConfig c;
    c.seed = 9;
    c.k_heads = 2;
    c.v_heads = 4;
    c.k_dim = d;
    c.v_dim = d;
    c.prefill_lens = {1, 70, 150, 600};
    c.delta_rule_tol = tol;
    std::vector<OpCheck> dr;
    for (const OpCheck& r : compare_ops(gpu, *cpu, c))
      if (r.op.rfind("gated_delta_rule", 0) == 0) dr.push_back(r);
    EXPECT_GE(dr.size(), 4u);
    test::expect_all_pass(dr, fmt::format("{} Dk=Dv={}", label, d));
    for (const OpCheck& r : dr) worst = std::max(worst, r.rel_err);
  }
  return worst;
}

constexpr const char* kSplitForm = "split form: a per-chunk preparation kernel";
constexpr const char* kSingleForm = "single-kernel form, a block walking each sequence's chunks";

// The chunked delta rule on the GPU (CudaOptions::DeltaRule::chunked: every multi-token step) against the CPU's
// token-by-token recurrence: the FMA kernel and the tensor-core kernels with 3 tf32 parts (--dtype float32), in the
// split form (the default) and the single-kernel form, at the same fp32 budget (delta_rule_tol 1e-5: 3 tf32 parts
// carry 22 of 24 bits, so the products are the FMA ones up to ~2^-21 per term, below the summation-order differences
// the budget already covers; the split form's explicit T = (I + A)^-1 is the same solve reassociated).
TEST(CudaOps, ChunkedDeltaRuleMatchesCpuRecurrence) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOptions fma;
  fma.delta_rule_tensor_cores = false;
  check_chunked_against_cpu(fma, 1e-5, "chunked delta rule (FMA)", "on fp32 CUDA cores",
                            "single-kernel form (the split form needs the tensor cores)");
  CudaOptions tc;
  ASSERT_EQ(tc.delta_rule_tf32_parts(), 3);
  ASSERT_TRUE(tc.delta_rule_split_active());
  check_chunked_against_cpu(tc, 1e-5, "chunked delta rule (split, tensor cores, 3 tf32 parts)",
                            "on tensor cores (tf32 mma, inputs in 2 tf32 parts", kSplitForm);
  CudaOptions single = tc;
  single.delta_rule_split = false;
  check_chunked_against_cpu(single, 1e-5, "chunked delta rule (single kernel, tensor cores, 3 tf32 parts)",
                            "on tensor cores (tf32 mma, inputs in 2 tf32 parts", kSingleForm);
}

// The tf32 budget of the chunk products with inputs rounded once to tf32 (tf32_parts 1, --dtype bfloat16). tf32 keeps
// 11 significant bits: an input moves by at most 2^-11 (4.9e-4) relative, ~2^-12.5 (1.7e-4) RMS. A product term with
// both inputs rounded is off by ~2.4e-4 RMS, and a dot product of random-signed terms by about that relative to its
// size, whatever its length (the host emulation of the split measures <= 3.2e-4 worst-case against the sum of
// |terms|). The chunk feeds those products through the solve ((I + A)^-1 with |A_ij| <= beta |k_i.k_j| < 1:
// well-conditioned for unit keys), and the state carries each chunk's error into the next, decayed (e^g <= 1) and
// contracted (I - beta k k^T); so outputs and the final state should land at ~3e-4 .. 1.5e-3 rel-L2 after 600 tokens
// (10 chunks). The budget is 5e-3 (as the bf16-input linears' kBf16InputLinearTol): ~3x over the estimate, while a wrong
// fragment mapping, a skipped tile or a lost decay is off by O(1), 200x more. At least 2e-5 must show: the products
// were rounded (the FMA and 3-part kernels stay near 1e-6).
constexpr double kDeltaRuleTf32Tol = 5e-3;
constexpr double kDeltaRuleTf32MinErr = 2e-5;

// The same budget for the split form: its products (k.k, q.k, T [k | v] in the preparation; W S, q S, P X and the
// state update in the scan) each round their inputs once to tf32 as the single kernel's do; W and U pass through one
// more rounded product than the single kernel's X (T applied on tensor cores instead of the fp32 solve), which the
// ~3x margin of the estimate covers.
TEST(CudaOps, ChunkedDeltaRuleBf16TensorCoresMatchCpuRecurrence) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOptions o;
  o.dtype = CudaOptions::ActivationDtype::bfloat16;
  ASSERT_EQ(o.delta_rule_tf32_parts(), 1);
  for (bool split : {true, false}) {
    o.delta_rule_split = split;
    const double worst =
        check_chunked_against_cpu(o, kDeltaRuleTf32Tol,
                                  split ? "chunked delta rule (split, tensor cores, tf32)"
                                        : "chunked delta rule (single kernel, tensor cores, tf32)",
                                  "on tensor cores (tf32 mma, inputs rounded once to tf32)",
                                  split ? kSplitForm : kSingleForm);
    EXPECT_GT(worst, kDeltaRuleTf32MinErr) << "no tf32 rounding showed: did the tensor-core kernel run?";
  }
}

// ---- the kernel called directly: the tensor-core form against the FMA form on the same inputs

uint16_t to_bf16(float x) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct DirectCase {
  int64_t Dk, Dv, Hk, Hv;
  std::vector<int> lens;  // tokens per sequence (0 and 1 included where listed)
  bool state_bf16;
  std::string str() const {
    std::string s = fmt::format("Dk {} Dv {} Hk {} Hv {} {} state, seqs", Dk, Dv, Hk, Hv, state_bf16 ? "bf16" : "f32");
    for (int n : lens) s += " " + std::to_string(n);
    return s;
  }
};

struct DirectResult {
  std::vector<float> out, state;
  std::vector<float> ref_out, ref_state;  // the double-precision recurrence on the same inputs (ref_state rounded to
                                          // bf16 for a bf16 state)
};

// The gated delta rule token by token in double (the CPU's recurrent_head on already normalised q / k): per value
// head S = e^g S; delta = beta (v - S^T k); S += k delta^T; out = S^T q.
void reference_recurrence(const DirectCase& c, const std::vector<int32_t>& begin, const std::vector<int32_t>& slot,
                          const std::vector<float>& qn, const std::vector<float>& kn, const std::vector<float>& v,
                          const std::vector<float>& g, const std::vector<float>& beta, const std::vector<float>& state0,
                          std::vector<float>& out, std::vector<float>& state) {
  const int64_t Dk = c.Dk, Dv = c.Dv, Hv = c.Hv, Hk = c.Hk;
  out.assign(v.size(), 0.0f);
  state = state0;
  std::vector<double> S(Dk * Dv), kv(Dv);
  for (size_t s = 0; s + 1 < begin.size(); ++s)
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t kh = h / (Hv / Hk);
      float* st = &state[(int64_t(slot[s]) * Hv + h) * Dk * Dv];
      for (int64_t i = 0; i < Dk * Dv; ++i) S[i] = st[i];
      for (int64_t t = begin[s]; t < begin[s + 1]; ++t) {
        const float* k = &kn[(t * Hk + kh) * Dk];
        const float* q = &qn[(t * Hk + kh) * Dk];
        const float* vv = &v[(t * Hv + h) * Dv];
        const double decay = std::exp(double(g[t * Hv + h])), b = beta[t * Hv + h];
        for (double& x : S) x *= decay;
        std::fill(kv.begin(), kv.end(), 0.0);
        for (int64_t i = 0; i < Dk; ++i)
          for (int64_t j = 0; j < Dv; ++j) kv[j] += S[i * Dv + j] * k[i];
        for (int64_t j = 0; j < Dv; ++j) kv[j] = b * (vv[j] - kv[j]);  // delta
        for (int64_t i = 0; i < Dk; ++i)
          for (int64_t j = 0; j < Dv; ++j) S[i * Dv + j] += double(k[i]) * kv[j];
        for (int64_t j = 0; j < Dv; ++j) {
          double o = 0;
          for (int64_t i = 0; i < Dk; ++i) o += S[i * Dv + j] * q[i];
          out[(t * Hv + h) * Dv + j] = static_cast<float>(o);
        }
      }
      for (int64_t i = 0; i < Dk * Dv; ++i) st[i] = static_cast<float>(S[i]);
    }
}

// Random normalised qn / kn (k unit rows, q unit rows / sqrt(Dk), as l2norm_qk_kernel writes them), v ~ N(0, 1),
// g in [-0.5, -0.01), beta in [0, 1), a random carried state; one gated_delta_rule_chunked call with tf32_parts, in
// the split form (a workspace of gated_delta_rule_chunked_workspace_bytes, filled with NaN first: nothing the
// preparation kernel does not write may be read) or the single kernel (no workspace).
DirectResult run_direct(const DirectCase& c, int tf32_parts, uint32_t seed, bool split = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(0.0f, 1.0f);
  const int S = static_cast<int>(c.lens.size());
  std::vector<int32_t> begin(S + 1, 0), slot(S);
  for (int s = 0; s < S; ++s) {
    begin[s + 1] = begin[s] + c.lens[s];
    slot[s] = S - 1 - s;  // slots in another order than the sequences
  }
  const int64_t T = begin[S];
  std::vector<float> qn(T * c.Hk * c.Dk), kn(qn.size()), v(T * c.Hv * c.Dv), g(T * c.Hv), beta(g.size());
  for (int64_t r = 0; r < T * c.Hk; ++r)
    for (std::vector<float>* x : {&qn, &kn}) {
      float ss = 0;
      for (int64_t d = 0; d < c.Dk; ++d) ss += std::pow((*x)[r * c.Dk + d] = normal(rng), 2.0f);
      const float scale = 1.0f / std::sqrt(ss) / (x == &qn ? std::sqrt(float(c.Dk)) : 1.0f);
      for (int64_t d = 0; d < c.Dk; ++d) (*x)[r * c.Dk + d] *= scale;
    }
  for (float& x : v) x = normal(rng);
  for (float& x : g) x = -0.01f - 0.49f * uni(rng);
  for (float& x : beta) x = uni(rng);
  const size_t state_elems = size_t(S) * c.Hv * c.Dk * c.Dv;
  std::vector<float> state(state_elems);
  for (float& x : state) x = 0.1f * normal(rng);

  auto upload = [](const auto& host) {
    ::kiln::cuda::DeviceBuffer b(std::max<size_t>(host.size() * sizeof(host[0]), 4));
    if (!host.empty()) KILN_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), host.size() * sizeof(host[0]), cudaMemcpyHostToDevice));
    return b;
  };
  ::kiln::cuda::DeviceBuffer d_qn = upload(qn), d_kn = upload(kn), d_v = upload(v), d_g = upload(g),
                             d_beta = upload(beta), d_begin = upload(begin), d_slot = upload(slot);
  std::vector<uint16_t> state16(state_elems);
  for (size_t i = 0; i < state_elems; ++i) state16[i] = to_bf16(state[i]);
  ::kiln::cuda::DeviceBuffer d_state = c.state_bf16 ? upload(state16) : upload(state);
  ::kiln::cuda::DeviceBuffer d_out(std::max<size_t>(v.size() * sizeof(float), 4));
  KILN_CUDA_CHECK(cudaMemset(d_out.data(), 0xff, d_out.size()));  // NaN: every token's row must be written

  kops::StepArgs step;
  step.seq_token_begin = static_cast<const int32_t*>(d_begin.data());
  step.seq_state_slot = static_cast<const int32_t*>(d_slot.data());
  step.num_tokens = static_cast<int32_t>(T);
  step.num_seqs = S;
  step.max_seq_tokens = *std::max_element(c.lens.begin(), c.lens.end());
  const kops::DeltaStateRef ref{d_state.data(), c.state_bf16};
  const size_t ws_bytes = kops::gated_delta_rule_chunked_workspace_bytes(T, c.Hv, c.Dk, c.Dv, step);
  ::kiln::cuda::DeviceBuffer d_ws(std::max<size_t>(ws_bytes, 256));
  KILN_CUDA_CHECK(cudaMemset(d_ws.data(), 0xff, d_ws.size()));
  if (split) EXPECT_TRUE(kops::gated_delta_rule_chunked_split_supported(c.Hv, c.Dk, c.Dv, step, tf32_parts)) << c.str();
  kops::gated_delta_rule_chunked(static_cast<const float*>(d_qn.data()), static_cast<const float*>(d_kn.data()),
                                 static_cast<const float*>(d_v.data()), static_cast<const float*>(d_g.data()),
                                 static_cast<const float*>(d_beta.data()), ref, c.Hk, c.Hv, c.Dk, c.Dv, c.Hv * c.Dv,
                                 step, static_cast<float*>(d_out.data()), split ? d_ws.data() : nullptr, nullptr,
                                 tf32_parts);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  DirectResult r;
  r.out.resize(v.size());
  if (!v.empty()) KILN_CUDA_CHECK(cudaMemcpy(r.out.data(), d_out.data(), v.size() * sizeof(float), cudaMemcpyDeviceToHost));
  r.state.resize(state_elems);
  if (c.state_bf16) {
    KILN_CUDA_CHECK(cudaMemcpy(state16.data(), d_state.data(), state_elems * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < state_elems; ++i) r.state[i] = from_bf16(state16[i]);
  } else {
    KILN_CUDA_CHECK(cudaMemcpy(r.state.data(), d_state.data(), state_elems * 4, cudaMemcpyDeviceToHost));
  }
  // The reference starts from the state as the kernels read it (a bf16 state widened) and rounds its final state as
  // they store it.
  std::vector<float> state0 = state;
  if (c.state_bf16)
    for (size_t i = 0; i < state_elems; ++i) state0[i] = from_bf16(to_bf16(state[i]));
  reference_recurrence(c, begin, slot, qn, kn, v, g, beta, state0, r.ref_out, r.ref_state);
  if (c.state_bf16)
    for (float& x : r.ref_state) x = from_bf16(to_bf16(x));
  return r;
}

const std::vector<DirectCase> kDirectCases = {
    {128, 128, 2, 4, {0, 1, 64, 65, 300}, false},  // the Qwen3.5 head sizes; empty, 1-token, exact and partial chunks
    {128, 128, 2, 4, {200, 0, 1}, true},
    {40, 40, 1, 2, {1, 37, 130}, false},  // padded keys (tile 64), a masked value tile
    {40, 40, 1, 2, {129, 5}, true},
    {32, 96, 2, 2, {70, 64}, false},   // Dk 32; Dv 96: three 32-column tiles, or two 64-column ones (half masked)
    {64, 64, 4, 8, {0, 100}, false},
    {17, 8, 1, 1, {1, 63, 200}, false},  // tiny dims: one masked 32-column tile
    {17, 8, 1, 1, {65, 64}, true},
    {128, 128, 2, 4, {63, 300, 1, 0}, true},
    {32, 96, 2, 2, {300, 1, 63}, true},
};

// The tensor-core kernel (3 tf32 parts) against the FMA kernel on the same inputs: outputs within the fp32 budget
// (1e-5: both fp32-class, only summation order and the split's ~2^-21 differ). A bf16 final state is rounded once from
// each kernel's fp32 copy: values within ~1e-6 of a rounding boundary may round to neighbouring bf16 values (2^-8
// apart), so the bf16 state's budget is 1e-3 (a few in 10^4 elements flipping), its fp32 state's 1e-5.
TEST(DeltaRuleChunked, TensorCoresMatchFmaKernel) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (const DirectCase& c : kDirectCases) {
    const DirectResult fma = run_direct(c, 0, 5), tc = run_direct(c, kops::kMmaPartsFp32, 5);
    const double out_err = rel_err(tc.out, fma.out), state_err = rel_err(tc.state, fma.state);
    std::printf("[ delta tc ] %s: out rel %.2e, state rel %.2e\n", c.str().c_str(), out_err, state_err);
    EXPECT_LE(out_err, 1e-5) << c.str();
    EXPECT_LE(state_err, c.state_bf16 ? 1e-3 : 1e-5) << c.str();
  }
}

// The tensor-core kernel with inputs rounded once to tf32 (tf32_parts 1, --dtype bfloat16) against the FMA kernel:
// within kDeltaRuleTf32Tol (derived above), and the rounding shows.
TEST(DeltaRuleChunked, Tf32TensorCoresMatchFmaKernelWithinTf32Budget) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (const DirectCase& c : kDirectCases) {
    const DirectResult fma = run_direct(c, 0, 6), tc = run_direct(c, kops::kMmaPartsBf16, 6);
    const double out_err = rel_err(tc.out, fma.out), state_err = rel_err(tc.state, fma.state);
    std::printf("[ delta tf ] %s: out rel %.2e, state rel %.2e\n", c.str().c_str(), out_err, state_err);
    EXPECT_LE(out_err, kDeltaRuleTf32Tol) << c.str();
    EXPECT_LE(state_err, kDeltaRuleTf32Tol) << c.str();
    EXPECT_GT(out_err, kDeltaRuleTf32MinErr) << c.str();
  }
}

// ---- the split form (deltanet_chunked_split.cu): the preparation kernel + the scan

// Against the double-precision recurrence: 3 tf32 parts at the fp32 budget (1e-5 for outputs and an fp32 state; a bf16
// final state is compared with the reference rounded the same way, 1e-3: values within ~1e-6 of a rounding boundary
// may round to a neighbour); 1 part within kDeltaRuleTf32Tol, the rounding showing in the outputs. Every case must be
// served by the split form (run_direct checks gated_delta_rule_chunked_split_supported).
TEST(DeltaRuleChunked, SplitMatchesRecurrence) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (const DirectCase& c : kDirectCases) {
    const DirectResult r = run_direct(c, kops::kMmaPartsFp32, 7, true);
    const double out_err = rel_err(r.out, r.ref_out), state_err = rel_err(r.state, r.ref_state);
    std::printf("[ split 3  ] %s: out rel %.2e, state rel %.2e\n", c.str().c_str(), out_err, state_err);
    EXPECT_LE(out_err, 1e-5) << c.str();
    EXPECT_LE(state_err, c.state_bf16 ? 1e-3 : 1e-5) << c.str();
  }
  for (const DirectCase& c : kDirectCases) {
    const DirectResult r = run_direct(c, kops::kMmaPartsBf16, 8, true);
    const double out_err = rel_err(r.out, r.ref_out), state_err = rel_err(r.state, r.ref_state);
    std::printf("[ split 1  ] %s: out rel %.2e, state rel %.2e\n", c.str().c_str(), out_err, state_err);
    EXPECT_LE(out_err, kDeltaRuleTf32Tol) << c.str();
    EXPECT_LE(state_err, kDeltaRuleTf32Tol) << c.str();
    EXPECT_GT(out_err, kDeltaRuleTf32MinErr) << c.str();
  }
}

// Against the single kernel on the same inputs: 3 parts against its 3-part form (1e-5; bf16 state 1e-3 as above), 1
// part against its FMA form (kDeltaRuleTf32Tol). The single kernel runs with its own checks above.
TEST(DeltaRuleChunked, SplitMatchesSingleKernel) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (const DirectCase& c : kDirectCases) {
    const DirectResult single = run_direct(c, kops::kMmaPartsFp32, 9), split = run_direct(c, kops::kMmaPartsFp32, 9, true);
    const double out_err = rel_err(split.out, single.out), state_err = rel_err(split.state, single.state);
    std::printf("[ split/1k ] %s: out rel %.2e, state rel %.2e\n", c.str().c_str(), out_err, state_err);
    EXPECT_LE(out_err, 1e-5) << c.str();
    EXPECT_LE(state_err, c.state_bf16 ? 1e-3 : 1e-5) << c.str();
  }
  for (const DirectCase& c : kDirectCases) {
    const DirectResult fma = run_direct(c, 0, 10), split = run_direct(c, kops::kMmaPartsBf16, 10, true);
    const double out_err = rel_err(split.out, fma.out), state_err = rel_err(split.state, fma.state);
    std::printf("[ split/fm ] %s: out rel %.2e, state rel %.2e\n", c.str().c_str(), out_err, state_err);
    EXPECT_LE(out_err, kDeltaRuleTf32Tol) << c.str();
    EXPECT_LE(state_err, kDeltaRuleTf32Tol) << c.str();
  }
}

// The single kernel against the same double-precision recurrence (the baseline the split form is held to).
TEST(DeltaRuleChunked, SingleKernelMatchesRecurrence) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (int parts : {0, kops::kMmaPartsFp32}) {
    for (const DirectCase& c : kDirectCases) {
      const DirectResult r = run_direct(c, parts, 11);
      const double out_err = rel_err(r.out, r.ref_out), state_err = rel_err(r.state, r.ref_state);
      std::printf("[ single %d ] %s: out rel %.2e, state rel %.2e\n", parts, c.str().c_str(), out_err, state_err);
      EXPECT_LE(out_err, 1e-5) << c.str();
      EXPECT_LE(state_err, c.state_bf16 ? 1e-3 : 1e-5) << c.str();
    }
  }
}

// The workspace size the CUDA ops take from the scratch arena and the memory plan counts: 323.5 MiB for one
// 8192-token sequence at the 35B-A3B's heads; a step of several sequences adds 64 rows per sequence.
TEST(DeltaRuleChunked, SplitWorkspaceBytes) {
  kops::StepArgs step;
  step.num_seqs = 1;
  step.num_tokens = 8192;
  EXPECT_EQ(kops::gated_delta_rule_chunked_workspace_bytes(8192, 32, 128, 128, step), size_t{339222528});
  step.num_seqs = 3;
  EXPECT_EQ(kops::gated_delta_rule_chunked_workspace_bytes(8192, 32, 128, 128, step),
            size_t{339222528} + size_t{2} * 64 * 32 * (128 + 128 + 64 + 1) * 4);
  step.num_seqs = 0;
  EXPECT_EQ(kops::gated_delta_rule_chunked_workspace_bytes(0, 32, 128, 128, step), size_t{0});
}

}  // namespace
}  // namespace kiln::backend::cuda
