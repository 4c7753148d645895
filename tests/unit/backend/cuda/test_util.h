// Helpers of the CUDA backend tests: skip without a usable GPU, report op checks, device round trips, error norms.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
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

// A dense BF16 weight [N, K] of N(0, 1 / K) values on the host, its bytes kept in `store` (which must outlive it).
inline model::LinearWeight random_bf16_weight(std::vector<std::vector<uint16_t>>& store, std::mt19937_64& rng,
                                              int64_t N, int64_t K) {
  std::vector<uint16_t>& v = store.emplace_back(static_cast<size_t>(N * K));
  std::normal_distribution<float> d(0.0f, 1.0f / std::sqrt(static_cast<float>(K)));
  for (uint16_t& e : v) e = f32_to_bf16(d(rng));
  model::LinearWeight w;
  w.format = model::WeightFormat::dense;
  w.out_features = N;
  w.in_features = K;
  w.weight = TensorView(v.data(), DType::BF16, Shape{N, K});
  return w;
}

// A step of lens[s] tokens for sequence s in slots[s], its first token at position start[s].
inline model::StepLayout step_on(model::Ops& ops, const std::vector<int>& lens, const std::vector<int>& slots,
                                 const std::vector<int>& start) {
  model::StepLayout st;
  st.num_seqs = static_cast<int>(lens.size());
  st.page_size = 16;
  st.max_pages_per_seq = 1;
  st.host_seq_token_begin.push_back(0);
  for (size_t s = 0; s < lens.size(); ++s) {
    for (int t = 0; t < lens[s]; ++t) st.host_token_pos.push_back(start[s] + t);
    st.host_seq_token_begin.push_back(st.host_seq_token_begin.back() + lens[s]);
    st.host_seq_start_pos.push_back(start[s]);
    st.host_seq_state_slot.push_back(slots[s]);
  }
  st.host_page_table.assign(lens.size(), -1);
  st.num_tokens = st.host_seq_token_begin.back();
  model::upload_step(ops, st);
  return st;
}

// A state (or any F32 / BF16 tensor) on any Ops as fp32 on the host.
inline std::vector<float> state_on_host(model::Ops& ops, const TensorView& state) {
  const size_t n = static_cast<size_t>(state.numel());
  std::vector<float> out(n);
  if (state.dtype == DType::F32) {
    ops.download(state, out.data());
  } else {
    std::vector<uint16_t> raw(n);
    ops.download(state, raw.data());
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(raw[i]);
  }
  return out;
}

// Sets a state (F32 or BF16 slots) to `values` (fp32 on the host; a BF16 state takes them rounded).
inline void set_state(model::Ops& ops, TensorView state, const std::vector<float>& values) {
  ops.reset_scratch();
  if (state.dtype == DType::F32) {
    ops.copy(ops.upload(values.data(), DType::F32, state.shape), state);
  } else {
    std::vector<uint16_t> raw(values.size());
    for (size_t i = 0; i < values.size(); ++i) raw[i] = f32_to_bf16(values[i]);
    ops.copy(ops.upload(raw.data(), DType::BF16, state.shape), state);
  }
}

// The checks of compare_ops whose op name starts with `prefix`.
inline std::vector<OpCheck> checks_of(const std::vector<OpCheck>& all, const std::string& prefix) {
  std::vector<OpCheck> out;
  for (const OpCheck& r : all)
    if (r.op.rfind(prefix, 0) == 0) out.push_back(r);
  return out;
}

}  // namespace kiln::backend::cuda::test
