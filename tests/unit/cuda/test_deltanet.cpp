// Gated DeltaNet: conv1d with rolling state and the recurrent gated delta rule (with the fused gated
// RMSNorm) against the CPU reference, over several sequences in one launch (a fresh one, continuing
// ones, different lengths, scattered state slots). Tolerances: outputs 1e-2 (bf16), conv state exact,
// recurrent state 1e-4 (fp32 vs double).
#include <gtest/gtest.h>

#include "backend/cuda/kernels.h"
#include "cuda_test_util.h"

namespace kiln::cuda {
namespace {

using namespace test;

struct Seqs {
  std::vector<int32_t> start, slot, reset;
  int T = 0;
};

Seqs make_seqs(const std::vector<int>& lens, const std::vector<int>& slots, const std::vector<int>& resets) {
  Seqs s;
  s.start.push_back(0);
  for (int len : lens) s.start.push_back(s.start.back() + len);
  s.slot = slots;
  s.reset = resets;
  s.T = s.start.back();
  return s;
}

TEST(CudaDeltaNet, Conv1dWithState) {
  KILN_REQUIRE_GPU();
  const int C = 1024 + 64, ldx = C + 16, slots = 4;
  const Seqs sq = make_seqs({5, 1, 9, 0}, {2, 0, 3, 1}, {1, 0, 0, 0});
  const int T = sq.T;
  const auto x = random_bf16(size_t(T) * ldx), w = random_bf16(size_t(C) * 4, 0.5f);
  const auto state0 = random_bf16(size_t(slots) * 3 * C);
  DeviceBuffer d_x = upload(x), d_w = upload(w), d_state = upload(state0);
  DeviceBuffer d_start = upload(sq.start), d_slot = upload(sq.slot), d_reset = upload(sq.reset);
  DeviceBuffer d_out = poisoned(size_t(T) * C * 2);
  GdnSeqs seqs{d_start.as<int32_t>(), d_slot.as<int32_t>(), d_reset.as<int32_t>(), int(sq.slot.size())};
  gdn_conv1d(d_x.as<uint16_t>(), ldx, d_w.as<uint16_t>(), d_state.as<uint16_t>(), seqs, C, d_out.as<uint16_t>(),
             nullptr);
  const auto out = bf16_to_float(download<uint16_t>(d_out, size_t(T) * C));
  const auto state = download<uint16_t>(d_state, state0.size());

  std::vector<float> expect(size_t(T) * C);
  std::vector<uint16_t> expect_state = state0;
  for (size_t s = 0; s < sq.slot.size(); ++s) {
    const int t0 = sq.start[s], n = sq.start[s + 1] - t0, slot = sq.slot[s];
    for (int c = 0; c < C; ++c) {
      float win[3], wf[4], xs[16], ys[16];
      for (int j = 0; j < 3; ++j) win[j] = sq.reset[s] ? 0.0f : bf16_to_f32(state0[(size_t(slot) * 3 + j) * C + c]);
      for (int j = 0; j < 4; ++j) wf[j] = bf16_to_f32(w[size_t(c) * 4 + j]);
      for (int t = 0; t < n; ++t) xs[t] = bf16_to_f32(x[size_t(t0 + t) * ldx + c]);
      ref::conv1d_channel(xs, n, wf, win, ys);
      for (int t = 0; t < n; ++t) expect[size_t(t0 + t) * C + c] = ys[t];
      if (n > 0 || sq.reset[s])
        for (int j = 0; j < 3; ++j) expect_state[(size_t(slot) * 3 + j) * C + c] = f32_to_bf16(win[j]);
    }
  }
  KILN_EXPECT_ERR(rel_err(out, expect), 1e-2, "gdn conv1d");
  EXPECT_EQ(state, expect_state);
}

TEST(CudaDeltaNet, RecurrentGatedDeltaRule) {
  KILN_REQUIRE_GPU();
  for (const auto [nk, nv] : {std::pair{2, 4}, std::pair{2, 2}, std::pair{1, 4}}) {
    const int dk = 128, dv = 128, slots = 4;
    const int C = 2 * nk * dk + nv * dv, ld_qkv = C + 8, ld_z = nv * dv, ld_ab = nv + 2;
    const Seqs sq = make_seqs({5, 1, 12}, {2, 0, 3}, {1, 0, 0});
    const int T = sq.T;
    const auto qkv = random_bf16(size_t(T) * ld_qkv), z = random_bf16(size_t(T) * ld_z);
    const auto a = random_bf16(size_t(T) * ld_ab), b = random_bf16(size_t(T) * ld_ab);
    const auto A_log = random_f32(nv, -1.0f, 1.0f), dt_bias = random_f32(nv, -0.5f, 0.5f);
    const auto norm_w = random_f32(dv, 0.8f, 1.2f);
    const auto state0 = random_f32(size_t(slots) * nv * dv * dk, -0.05f, 0.05f);
    DeviceBuffer d_qkv = upload(qkv), d_z = upload(z), d_a = upload(a), d_b = upload(b), d_alog = upload(A_log),
                 d_dt = upload(dt_bias), d_nw = upload(norm_w), d_state = upload(state0);
    DeviceBuffer d_start = upload(sq.start), d_slot = upload(sq.slot), d_reset = upload(sq.reset);
    DeviceBuffer d_out = poisoned(size_t(T) * nv * dv * 2);
    GdnSeqs seqs{d_start.as<int32_t>(), d_slot.as<int32_t>(), d_reset.as<int32_t>(), int(sq.slot.size())};
    const float eps = 1e-6f;
    gdn_recurrent(d_qkv.as<uint16_t>(), ld_qkv, d_z.as<uint16_t>(), ld_z, d_a.as<uint16_t>(), ld_ab,
                  d_b.as<uint16_t>(), ld_ab, d_alog.as<float>(), d_dt.as<float>(), d_nw.as<float>(), eps,
                  d_state.as<float>(), seqs, GdnShape{nk, nv, dk, dv}, d_out.as<uint16_t>(), nullptr);
    const auto out = bf16_to_float(download<uint16_t>(d_out, size_t(T) * nv * dv));
    const auto state = download<float>(d_state, state0.size());

    std::vector<float> expect(size_t(T) * nv * dv);
    std::vector<double> expect_state(state0.begin(), state0.end());
    for (size_t s = 0; s < sq.slot.size(); ++s) {
      for (int h = 0; h < nv; ++h) {
        const int kh = h / (nv / nk);
        double* S = &expect_state[(size_t(sq.slot[s]) * nv + h) * dv * dk];
        if (sq.reset[s]) std::fill(S, S + size_t(dv) * dk, 0.0);
        for (int t = sq.start[s]; t < sq.start[s + 1]; ++t) {
          std::vector<float> qf(dk), kf(dk), vf(dv), zf(dv);
          for (int i = 0; i < dk; ++i) {
            qf[i] = bf16_to_f32(qkv[size_t(t) * ld_qkv + kh * dk + i]);
            kf[i] = bf16_to_f32(qkv[size_t(t) * ld_qkv + (nk + kh) * dk + i]);
          }
          for (int i = 0; i < dv; ++i) {
            vf[i] = bf16_to_f32(qkv[size_t(t) * ld_qkv + 2 * nk * dk + h * dv + i]);
            zf[i] = bf16_to_f32(z[size_t(t) * ld_z + h * dv + i]);
          }
          ref::gdn_step(qf.data(), kf.data(), vf.data(), zf.data(), bf16_to_f32(a[size_t(t) * ld_ab + h]),
                        bf16_to_f32(b[size_t(t) * ld_ab + h]), A_log[h], dt_bias[h], norm_w.data(), eps, dk, dv, S,
                        &expect[size_t(t) * nv * dv + h * dv]);
        }
      }
    }
    const std::string label = "gdn recurrent nk=" + std::to_string(nk) + " nv=" + std::to_string(nv);
    KILN_EXPECT_ERR(rel_err(out, expect), 1e-2, label + " out");
    KILN_EXPECT_ERR(rel_err(state, expect_state), 1e-4, label + " state");
  }
}

}  // namespace
}  // namespace kiln::cuda
