// Prefill attention (attention_prefill.cu): the flash-style kernel for prefill-shaped steps,
// called directly on the device inputs of CudaOps, against the CPU oracle and against the split-over-keys kernel
// (attention_decode.cu) on the same inputs; CudaOps::attention (whichever path it takes) against the CPU too. Prefills
// from scratch, second chunks over a cached prefix, mixed prefill + decode steps, page sizes that tiles and lengths do
// not line up with, GQA ratios 1 to 16, head_dim 64 / 128 / 256, f32 (declined: the fallback's business), bf16 and
// e4m3 pools (k / v scales != 1). q and p in 3 bf16 parts (--dtype float32): fp32-class accuracy, rel-L2 <= 1e-5.
// Rounded once to bf16 (--dtype bfloat16): within kBf16InputTol (op_check.h; ~2-3e-3 expected) and above 2e-4 (the
// rounding happened). Skipped without a usable GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/step_args.h"
#include "backend/op_check.h"
#include "core/error.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

namespace kops = ::kiln::cuda::ops;

constexpr double kPrefillTol = 1e-5;  // the op checks' fp32 tolerance

// How q and p enter the tensor cores, and what the results are held to.
struct Precision {
  int parts = kops::kMmaPartsFp32;
  double tol = kPrefillTol;
  double min_err = 0;  // bf16 inputs: the prefill kernel's error must show the rounding
};
const Precision kFp32Parts;
const Precision kBf16Parts{kops::kMmaPartsBf16, kBf16InputTol, 2e-4};
CudaOptions options_for(const Precision& p) {
  CudaOptions o;
  if (p.parts == kops::kMmaPartsBf16) o.dtype = CudaOptions::ActivationDtype::bfloat16;
  return o;
}

struct PrefillSeq {
  int cached = 0;  // tokens already in the pool (positions 0 .. cached - 1), stored by an earlier step
  int fresh = 0;   // this step's tokens (positions cached .. cached + fresh - 1)
};

struct PrefillCase {
  std::vector<PrefillSeq> seqs;
  int64_t q_heads = 16, kv_heads = 2, head_dim = 256;
  int page_size = 16;
  DType kv = DType::BF16;
  std::string str() const {
    std::string s = std::string(dtype_name(kv)) + " heads " + std::to_string(q_heads) + "/" + std::to_string(kv_heads) +
                    " D " + std::to_string(head_dim) + " page " + std::to_string(page_size) + " seqs";
    for (const PrefillSeq& q : seqs) s += " " + std::to_string(q.cached) + "+" + std::to_string(q.fresh);
    return s;
  }
};

std::vector<float> prefill_normal(std::mt19937& rng, size_t n, float stddev) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The pools and the query step of a case, built identically on `a` and `b` (b may be null: a alone): sequences get
// shuffled pages (page tables one entry wider than needed, the extra entry -1), an earlier step stores the cached
// tokens' K / V, the query step stores its own, then q. e4m3 scales come from the data (max |x| / 448, != 1).
struct PrefillSetup {
  HostStep now;
  model::KvLayerView cache_a, cache_b;
  model::StepLayout layout_a, layout_b;
  TensorView q_a, q_b;
};

PrefillSetup prefill_setup(model::Ops& a, model::Ops* b, const PrefillCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int S = static_cast<int>(c.seqs.size());
  const int64_t Hq = c.q_heads, Hkv = c.kv_heads, D = c.head_dim;
  const int ps = c.page_size;
  int max_pages = 1, total_pages = 1;  // one page no sequence uses
  std::vector<int> n_pages(S);
  for (int s = 0; s < S; ++s) {
    n_pages[s] = (c.seqs[s].cached + c.seqs[s].fresh + ps - 1) / ps;
    max_pages = std::max(max_pages, n_pages[s] + 1);
    total_pages += n_pages[s];
  }
  std::vector<int32_t> perm(total_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> tables(S, std::vector<int32_t>(max_pages, -1));
  for (int s = 0, next = 0; s < S; ++s)
    for (int p = 0; p < n_pages[s]; ++p) tables[s][p] = perm[next++];

  HostStep hist;
  PrefillSetup st;
  hist.page_size = st.now.page_size = ps;
  hist.max_pages = st.now.max_pages = max_pages;
  for (int s = 0; s < S; ++s) {
    if (c.seqs[s].cached > 0) hist.add_seq(0, c.seqs[s].cached, s, tables[s]);
    st.now.add_seq(c.seqs[s].cached, c.seqs[s].fresh, s, tables[s]);
  }
  const int64_t Th = hist.num_tokens(), T = st.now.num_tokens();
  const std::vector<float> hk = prefill_normal(rng, Th * Hkv * D, 1.5f), hv = prefill_normal(rng, Th * Hkv * D, 1.0f);
  const std::vector<float> nk = prefill_normal(rng, T * Hkv * D, 1.5f), nv = prefill_normal(rng, T * Hkv * D, 1.0f);
  const std::vector<float> q = prefill_normal(rng, T * Hq * D, 1.0f);
  float k_scale = 1.0f, v_scale = 1.0f;
  if (c.kv == DType::F8_E4M3) {
    float km = 0, vm = 0;
    for (float x : hk) km = std::max(km, std::fabs(x));
    for (float x : nk) km = std::max(km, std::fabs(x));
    for (float x : hv) vm = std::max(vm, std::fabs(x));
    for (float x : nv) vm = std::max(vm, std::fabs(x));
    k_scale = km / 448.0f;
    v_scale = vm / 448.0f;
  }
  auto build = [&](model::Ops& ops, model::KvLayerView& cache, model::StepLayout& layout, TensorView& qv) {
    ops.reset_scratch();
    cache.k = ops.allocate(c.kv, Shape{total_pages, ps, Hkv, D});
    cache.v = ops.allocate(c.kv, Shape{total_pages, ps, Hkv, D});
    cache.k_scale = k_scale;
    cache.v_scale = v_scale;
    if (Th > 0) {
      const model::StepLayout lh = layout_on(ops, hist);
      ops.kv_store(ops.upload(hk.data(), DType::F32, Shape{Th, Hkv, D}),
                   ops.upload(hv.data(), DType::F32, Shape{Th, Hkv, D}), cache, lh);
    }
    layout = layout_on(ops, st.now);
    ops.kv_store(ops.upload(nk.data(), DType::F32, Shape{T, Hkv, D}), ops.upload(nv.data(), DType::F32, Shape{T, Hkv, D}),
                 cache, layout);
    qv = ops.upload(q.data(), DType::F32, Shape{T, Hq, D});
  };
  build(a, st.cache_a, st.layout_a, st.q_a);
  if (b) build(*b, st.cache_b, st.layout_b, st.q_b);
  return st;
}

// attention_prefill on the GPU setup's device inputs into a NaN-poisoned output (stream 0, synchronised). Returns
// whether it ran; `out` holds its result then.
bool run_attention_prefill(CudaOps& gpu, const PrefillSetup& st, const PrefillCase& c, float scale,
                           std::vector<float>& out, int parts = kops::kMmaPartsFp32) {
  const int64_t T = st.now.num_tokens(), Hq = c.q_heads, D = c.head_dim;
  const TensorView o = gpu.allocate(DType::F32, Shape{T, Hq, D});
  gpu.synchronize();
  KILN_CUDA_CHECK(cudaMemset(o.data, 0xff, o.nbytes()));
  const bool ran = kops::attention_prefill(st.q_a.ptr<const float>(), Hq, pool_args(st.cache_a),
                                           step_args(st.layout_a), scale, o.ptr<float>(), nullptr, parts);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  if (ran) {
    out.resize(static_cast<size_t>(o.numel()));
    gpu.download(o, out.data());
  }
  return ran;
}

// ops::attention (the split-over-keys kernels) on the same inputs.
std::vector<float> run_attention_split(CudaOps& gpu, const PrefillSetup& st, const PrefillCase& c, float scale) {
  const int64_t T = st.now.num_tokens(), Hq = c.q_heads, D = c.head_dim;
  const TensorView o = gpu.allocate(DType::F32, Shape{T, Hq, D});
  const kops::StepArgs sa = step_args(st.layout_a);
  ::kiln::cuda::DeviceBuffer ws(kops::attention_workspace_bytes(T, Hq, D, sa));
  gpu.synchronize();
  kops::attention(st.q_a.ptr<const float>(), Hq, pool_args(st.cache_a), sa, scale, o.ptr<float>(),
                  ws.data(), nullptr);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> out(static_cast<size_t>(o.numel()));
  gpu.download(o, out.data());
  return out;
}

// Whether attention_prefill must serve `c` on this device (H100 / H200 class: every supported shape fits).
bool prefill_expected(const PrefillCase& c, int max_seq_tokens) {
  if (c.kv == DType::F32 || max_seq_tokens < kops::kAttentionPrefillMinTokens) return false;
  if (c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256) return false;
  return probe_cuda_device().major == 9;
}

// One case against the CPU: CudaOps::attention, attention_prefill (when it serves the case) and the split kernel.
// Returns whether attention_prefill ran. `gpu` runs the dtype `prec` is for (options_for).
bool check_prefill_case(CudaOps& gpu, model::Ops& cpu, const PrefillCase& c, uint32_t seed,
                        const Precision& prec = kFp32Parts) {
  const std::string label = c.str();
  const PrefillSetup st = prefill_setup(gpu, &cpu, c, seed);
  const int64_t T = st.now.num_tokens(), Hq = c.q_heads, D = c.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  std::vector<float> want(static_cast<size_t>(T * Hq * D)), got(want.size());
  const TensorView out_r = cpu.allocate(DType::F32, Shape{T, Hq, D});
  cpu.attention(st.q_b, st.cache_b, st.layout_b, scale, out_r);
  cpu.download(out_r, want.data());
  const TensorView out_t = gpu.allocate(DType::F32, Shape{T, Hq, D});
  gpu.attention(st.q_a, st.cache_a, st.layout_a, scale, out_t);
  gpu.download(out_t, got.data());
  const double e_ops = test::rel_err(got, want);
  EXPECT_LE(e_ops, prec.tol) << "CudaOps::attention " << label;

  std::vector<float> pre;
  const bool ran = run_attention_prefill(gpu, st, c, scale, pre, prec.parts);
  EXPECT_EQ(ran, prefill_expected(c, st.now.max_seq_tokens)) << label;
  double e_pre = -1, e_split = -1;
  if (ran) {
    e_pre = test::rel_err(pre, want);
    EXPECT_LE(e_pre, prec.tol) << "attention_prefill vs cpu " << label;
    EXPECT_GE(e_pre, prec.min_err) << "attention_prefill vs cpu " << label << ": no sign of bf16 rounding";
    e_split = test::rel_err(pre, run_attention_split(gpu, st, c, scale));
    EXPECT_LE(e_split, prec.tol) << "attention_prefill vs ops::attention " << label;
    // CudaOps::attention took the prefill kernel with the same parts (no short sequence with a long context here:
    // the rule in CudaOps::attention that keeps those steps on the split kernel): the same result, bit for bit.
    bool long_decode = false;
    for (const PrefillSeq& q : c.seqs)
      long_decode |= q.fresh < kops::kAttentionPrefillMinTokens && q.cached + q.fresh > 2048;
    if (!long_decode) EXPECT_EQ(test::rel_err(got, pre), 0.0) << "CudaOps::attention vs attention_prefill " << label;
  }
  std::printf("[ prefill  ] %s%-62s ops %.2e | prefill %s\n", prec.parts == 1 ? "bf16 in: " : "", label.c_str(),
              e_ops,
              ran ? (fmt::format("{:.2e} (vs split {:.2e})", e_pre, e_split)).c_str() : "declined");
  return ran;
}

void shapes_and_pools_match_cpu(const Precision& prec) {
  CudaOps gpu(options_for(prec));
  auto cpu = make_cpu_backend();
  struct Heads {
    int64_t q_heads, kv_heads, head_dim;
    int page_size;
  };
  const std::vector<Heads> heads = {
      {2, 2, 128, 16},   // GQA 1
      {8, 2, 256, 16},   // GQA 4
      {16, 2, 256, 16},  // GQA 8: the 397B's shape per KV head
      {8, 1, 128, 32},   // GQA 8, pages of 32 (a 64-key tile spans two)
      {6, 2, 64, 8},     // GQA 3: a block's 64 rows straddle tokens; pages of 8
      {16, 1, 128, 16},  // GQA 16: 4 tokens per block
  };
  const std::vector<std::vector<PrefillSeq>> layouts = {
      {{0, 300}},                    // one prefill from scratch
      {{40, 1}, {0, 70}, {17, 1}},   // mixed: a 70-token prefill between two decoding sequences
      {{100, 37}},                   // a second chunk: 100 cached tokens, positions 100 .. 136
  };
  int ran = 0, cases = 0;
  uint32_t seed = 100;
  for (DType kv : {DType::F32, DType::BF16, DType::F8_E4M3})
    for (const Heads& h : heads)
      for (const auto& seqs : layouts) {
        PrefillCase c;
        c.seqs = seqs;
        c.q_heads = h.q_heads;
        c.kv_heads = h.kv_heads;
        c.head_dim = h.head_dim;
        c.page_size = h.page_size;
        c.kv = kv;
        ran += check_prefill_case(gpu, *cpu, c, ++seed, prec) ? 1 : 0;
        ++cases;
      }
  std::printf("[ prefill  ] attention_prefill (%d bf16 parts) served %d of %d cases\n", prec.parts, ran, cases);
}

TEST(CudaAttentionPrefill, MatchesCpuAcrossShapesAndPools) {
  KILN_REQUIRE_CUDA_DEVICE();
  shapes_and_pools_match_cpu(kFp32Parts);
}

// --dtype bfloat16: q and p rounded once to bf16, the same cases within the budget of bf16 inputs.
TEST(CudaAttentionPrefill, Bf16InputsMatchCpuAcrossShapesAndPools) {
  KILN_REQUIRE_CUDA_DEVICE();
  shapes_and_pools_match_cpu(kBf16Parts);
}

void long_prompts_match_cpu(const Precision& prec) {
  CudaOps gpu(options_for(prec));
  auto cpu = make_cpu_backend();
  for (DType kv : {DType::BF16, DType::F8_E4M3}) {
    PrefillCase c;
    c.kv = kv;
    c.seqs = {{0, 1000}};  // 125 blocks per KV head, up to 32 tiles of keys each
    check_prefill_case(gpu, *cpu, c, 7, prec);
    c.seqs = {{700, 333}, {0, 16}, {5, 1}};  // a long second chunk, the shortest prefill the rule takes, a decode
    check_prefill_case(gpu, *cpu, c, 8, prec);
  }
}

TEST(CudaAttentionPrefill, LongPromptsMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  long_prompts_match_cpu(kFp32Parts);
}

TEST(CudaAttentionPrefill, Bf16InputsLongPromptsMatchCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  long_prompts_match_cpu(kBf16Parts);
}

// 4096-token prompts (the CPU oracle would take too long): attention_prefill against the split-over-keys kernel
// (fp32 CUDA cores), with q and p in 3 bf16 parts and rounded once to bf16.
TEST(CudaAttentionPrefill, FourThousandTokenPromptMatchesSplitKernel) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  for (const Precision& prec : {kFp32Parts, kBf16Parts})
    for (DType kv : {DType::BF16, DType::F8_E4M3}) {
      PrefillCase c;
      c.kv = kv;
      c.seqs = {{0, 4096}};
      const PrefillSetup st = prefill_setup(gpu, nullptr, c, 11);
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      std::vector<float> pre;
      const bool ran = run_attention_prefill(gpu, st, c, scale, pre, prec.parts);
      EXPECT_EQ(ran, prefill_expected(c, st.now.max_seq_tokens)) << c.str();
      if (!ran) continue;
      const double e = test::rel_err(pre, run_attention_split(gpu, st, c, scale));
      EXPECT_LE(e, prec.tol) << c.str() << " parts " << prec.parts;
      EXPECT_GE(e, prec.min_err) << c.str() << " parts " << prec.parts << ": no sign of bf16 rounding";
      std::printf("[ prefill  ] %s, %d bf16 parts: vs split kernel %.2e\n", c.str().c_str(), prec.parts, e);
    }
}

// The rule: steps, pools and shapes attention_prefill declines (host checks only: no device needed).
TEST(CudaAttentionPrefill, DeclinesWhatItDoesNotServe) {
  alignas(16) static float dummy[64];
  kops::KvPoolArgs pool;
  pool.k = pool.v = dummy;
  pool.elem = kops::ElemType::bf16;
  pool.kv_heads = 2;
  pool.head_dim = 256;
  kops::StepArgs step;
  step.num_tokens = 3;
  step.num_seqs = 3;
  step.max_pages = 4;
  step.page_size = 16;
  step.max_seq_tokens = 1;  // decode only
  EXPECT_FALSE(kops::attention_prefill(dummy, 16, pool, step, 0.0625f, dummy, nullptr));
  step.max_seq_tokens = kops::kAttentionPrefillMinTokens - 1;
  EXPECT_FALSE(kops::attention_prefill(dummy, 16, pool, step, 0.0625f, dummy, nullptr));
  step.num_tokens = step.max_seq_tokens = 300;
  step.num_seqs = 1;
  kops::KvPoolArgs f32 = pool;
  f32.elem = kops::ElemType::f32;
  EXPECT_FALSE(kops::attention_prefill(dummy, 16, f32, step, 0.0625f, dummy, nullptr));
  for (int32_t d : {32, 96, 512}) {
    kops::KvPoolArgs odd = pool;
    odd.head_dim = d;
    EXPECT_FALSE(kops::attention_prefill(dummy, 16, odd, step, 0.0625f, dummy, nullptr)) << "head_dim " << d;
  }
  EXPECT_FALSE(kops::attention_prefill(dummy, 15, pool, step, 0.0625f, dummy, nullptr));  // 15 heads over 2
  EXPECT_FALSE(kops::attention_prefill(dummy, 16, pool, step, 0.0625f, dummy + 1, nullptr));  // misaligned out
  // Parts other than 3 (fp32 accuracy) and 1 (bf16 inputs) are not built: an error, not a fallback.
  EXPECT_THROW(kops::attention_prefill(dummy, 16, pool, step, 0.0625f, dummy, nullptr, 2), Error);
}

}  // namespace
}  // namespace kiln::backend::cuda
