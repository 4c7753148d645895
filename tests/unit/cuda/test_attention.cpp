// Gated attention: attention_prep (q/k zero-centred norm, partial RoPE, cache write) and attention
// (prefill flash path and split-KV decode path; bf16 and FP8 caches) against the CPU reference.
// The attention reference reads back exactly what prep wrote (q and the cache), so each kernel is
// checked on its own. Tolerances: prep 1e-2 (bf16 outputs; FP8 cache 3e-2: e4m3 quantisation),
// attention 1e-2 (probabilities enter the PV product as bf16).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "backend/cuda/kernels.h"
#include "cuda_test_util.h"

namespace kiln::cuda {
namespace {

using namespace test;

constexpr int kD = 256;

struct AttnCase {
  std::vector<std::pair<int, int>> seqs;  // (context before, new tokens)
  bool fp8;
  int n_heads = 16, n_kv = 2;
};

class CudaAttention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(CudaAttention, PrepAndAttention) {
  KILN_REQUIRE_GPU();
  const AttnCase c = GetParam();
  const int nh = c.n_heads, nkv = c.n_kv, group = nh / nkv, page_size = 16;
  const int S = int(c.seqs.size());
  const float theta = 1e7f, eps = 1e-6f;
  const int rotary = 64;
  std::string label = std::string(c.fp8 ? "fp8" : "bf16") + " heads " + std::to_string(nh) + "/" + std::to_string(nkv);
  for (auto [ctx, n] : c.seqs) label += " (" + std::to_string(ctx) + "+" + std::to_string(n) + ")";

  // Pages: a shuffled pool so sequences' pages are scattered.
  int max_pages = 0, total_pages = 0;
  for (auto [ctx, n] : c.seqs) max_pages = std::max(max_pages, (ctx + n + page_size - 1) / page_size);
  for (auto [ctx, n] : c.seqs) total_pages += (ctx + n + page_size - 1) / page_size;
  total_pages += 3;
  std::vector<int> pool(total_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng());
  std::vector<int32_t> page_table(size_t(S) * max_pages, -1);
  int next = 0;
  for (int s = 0; s < S; ++s) {
    const int np = (c.seqs[s].first + c.seqs[s].second + page_size - 1) / page_size;
    for (int p = 0; p < np; ++p) page_table[size_t(s) * max_pages + p] = pool[next++];
  }

  // Cache: random old context (bf16 values or e4m3 codes); the new tokens' rows are written by prep.
  const size_t cache_elems = size_t(total_pages) * page_size * nkv * kD;
  const size_t elem_bytes = c.fp8 ? 1 : 2;
  const float k_scale = c.fp8 ? 0.05f : 1.0f, v_scale = c.fp8 ? 0.04f : 1.0f;
  std::vector<uint8_t> k_init(cache_elems * elem_bytes), v_init(cache_elems * elem_bytes);
  {
    const auto kb = random_bf16(cache_elems), vb = random_bf16(cache_elems);
    if (c.fp8) {
      for (size_t i = 0; i < cache_elems; ++i) {
        k_init[i] = f32_to_e4m3(bf16_to_f32(kb[i]) / k_scale);
        v_init[i] = f32_to_e4m3(bf16_to_f32(vb[i]) / v_scale);
      }
    } else {
      std::memcpy(k_init.data(), kb.data(), cache_elems * 2);
      std::memcpy(v_init.data(), vb.data(), cache_elems * 2);
    }
  }
  DeviceBuffer d_kc = upload(k_init), d_vc = upload(v_init);
  KvCache cache{d_kc.data(), d_vc.data(), c.fp8, k_scale, v_scale, page_size, nkv, kD};

  // New tokens.
  std::vector<int32_t> q_start(S + 1, 0), pos0(S), positions;
  std::vector<int64_t> kv_slot;
  int max_q = 0, max_kv = 0;
  for (int s = 0; s < S; ++s) {
    const auto [ctx, n] = c.seqs[s];
    q_start[s + 1] = q_start[s] + n;
    pos0[s] = ctx;
    max_q = std::max(max_q, n);
    max_kv = std::max(max_kv, ctx + n);
    for (int i = 0; i < n; ++i) {
      const int pos = ctx + i;
      positions.push_back(pos);
      kv_slot.push_back(int64_t(page_table[size_t(s) * max_pages + pos / page_size]) * page_size + pos % page_size);
    }
  }
  const int T = q_start[S];
  const int ld_q = nh * 2 * kD + 32, ld_kv = nkv * kD;
  const auto q_proj = random_bf16(size_t(T) * ld_q), k_proj = random_bf16(size_t(T) * ld_kv),
             v_proj = random_bf16(size_t(T) * ld_kv);
  const auto q_w = random_bf16(kD, 0.2f), k_w = random_bf16(kD, 0.2f);
  DeviceBuffer d_qp = upload(q_proj), d_kp = upload(k_proj), d_vp = upload(v_proj), d_qw = upload(q_w),
               d_kw = upload(k_w), d_pos = upload(positions), d_slot = upload(kv_slot);
  DeviceBuffer d_q = poisoned(size_t(T) * nh * kD * 2);
  attention_prep(d_qp.as<uint16_t>(), ld_q, d_kp.as<uint16_t>(), ld_kv, d_vp.as<uint16_t>(), ld_kv,
                 d_qw.as<uint16_t>(), d_kw.as<uint16_t>(), d_pos.as<int32_t>(), d_slot.as<int64_t>(), T, nh, theta,
                 rotary, eps, cache, d_q.as<uint16_t>(), nullptr);
  const auto q = bf16_to_float(download<uint16_t>(d_q, size_t(T) * nh * kD));
  const auto kc = download<uint8_t>(d_kc, cache_elems * elem_bytes), vc = download<uint8_t>(d_vc, cache_elems * elem_bytes);
  auto cache_val = [&](const std::vector<uint8_t>& buf, size_t idx, float scale) {
    if (c.fp8) return e4m3_to_f32(buf[idx]) * scale;
    uint16_t b;
    std::memcpy(&b, &buf[idx * 2], 2);
    return bf16_to_f32(b);
  };

  // Prep reference.
  {
    std::vector<float> q_ref(size_t(T) * nh * kD), kv_out, kv_ref;
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < nh; ++h)
        ref::norm_rope(&q_proj[size_t(t) * ld_q + size_t(h) * 2 * kD], q_w.data(), eps, positions[t], theta, rotary,
                       true, &q_ref[(size_t(t) * nh + h) * kD]);
      for (int h = 0; h < nkv; ++h) {
        float kr[kD], vr[kD];
        ref::norm_rope(&k_proj[size_t(t) * ld_kv + h * kD], k_w.data(), eps, positions[t], theta, rotary, true, kr);
        ref::norm_rope(&v_proj[size_t(t) * ld_kv + h * kD], nullptr, eps, positions[t], theta, rotary, false, vr);
        for (int d = 0; d < kD; ++d) {
          const size_t idx = (size_t(kv_slot[t]) * nkv + h) * kD + d;
          kv_out.push_back(cache_val(kc, idx, k_scale));
          kv_out.push_back(cache_val(vc, idx, v_scale));
          kv_ref.push_back(kr[d]);
          kv_ref.push_back(vr[d]);
        }
      }
    }
    KILN_EXPECT_ERR(rel_err(q, q_ref), 1e-2, "attention_prep q " + label);
    KILN_EXPECT_ERR(rel_err(kv_out, kv_ref), c.fp8 ? 3e-2 : 1e-2, "attention_prep kv " + label);
  }

  // Attention.
  AttnBatch b;
  DeviceBuffer d_qs = upload(q_start), d_p0 = upload(pos0), d_pt = upload(page_table);
  b.q_start = d_qs.as<int32_t>();
  b.pos0 = d_p0.as<int32_t>();
  b.page_table = d_pt.as<int32_t>();
  b.page_table_stride = max_pages;
  b.num_seqs = S;
  b.max_q_len = max_q;
  b.max_kv_len = max_kv;
  DeviceBuffer d_ws(std::max<size_t>(1, attention_workspace_bytes(b, nh, cache)));
  DeviceBuffer d_out = poisoned(size_t(T) * nh * kD * 2);
  attention(d_q.as<uint16_t>(), d_qp.as<uint16_t>() + kD, ld_q, 2 * kD, b, nh, cache, d_out.as<uint16_t>(),
            d_ws.data(), nullptr);
  const auto out = bf16_to_float(download<uint16_t>(d_out, size_t(T) * nh * kD));

  std::vector<float> expect(size_t(T) * nh * kD);
  for (int s = 0; s < S; ++s) {
    const int32_t* pages = &page_table[size_t(s) * max_pages];
    for (int i = 0; i < c.seqs[s].second; ++i) {
      const int t = q_start[s] + i, pos = pos0[s] + i;
      for (int h = 0; h < nh; ++h) {
        const int kvh = h / group;
        std::vector<std::vector<float>> krow(pos + 1, std::vector<float>(kD)), vrow(pos + 1, std::vector<float>(kD));
        std::vector<const float*> kp, vp;
        for (int j = 0; j <= pos; ++j) {
          const size_t row = size_t(pages[j / page_size]) * page_size + j % page_size;
          for (int d = 0; d < kD; ++d) {
            krow[j][d] = cache_val(kc, (row * nkv + kvh) * kD + d, k_scale);
            vrow[j][d] = cache_val(vc, (row * nkv + kvh) * kD + d, v_scale);
          }
          kp.push_back(krow[j].data());
          vp.push_back(vrow[j].data());
        }
        float gate[kD];
        for (int d = 0; d < kD; ++d) gate[d] = bf16_to_f32(q_proj[size_t(t) * ld_q + size_t(h) * 2 * kD + kD + d]);
        ref::attention_row(&q[(size_t(t) * nh + h) * kD], kp, vp, gate, &expect[(size_t(t) * nh + h) * kD]);
      }
    }
  }
  KILN_EXPECT_ERR(rel_err(out, expect), 1e-2, "attention " + label);
}

INSTANTIATE_TEST_SUITE_P(
    Batches, CudaAttention,
    ::testing::Values(AttnCase{{{0, 37}, {20, 50}, {0, 1}}, false},       // prefill, mixed
                      AttnCase{{{0, 37}, {20, 50}}, true},                 // prefill, fp8 cache
                      AttnCase{{{100, 1}, {517, 1}, {0, 1}}, false},       // decode, split-KV
                      AttnCase{{{100, 1}, {517, 1}}, true},                // decode, fp8
                      AttnCase{{{63, 2}, {200, 1}}, false},                // two-token decode
                      AttnCase{{{0, 20}, {31, 9}}, false, 32, 2},          // group 16 (397B shape)
                      AttnCase{{{300, 1}}, false, 32, 2}));

}  // namespace
}  // namespace kiln::cuda
