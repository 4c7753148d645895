// Kernel benchmarks on one GPU, with the bytes / FLOPs each call must move or compute, against two
// ceilings measured in the same run (device-to-device copy bandwidth counting read + write, and a
// large cuBLASLt bf16 GEMM). Prints markdown tables (and writes them to --out FILE).
//
// Sections: NVFP4 GEMV at the expert / shared-expert shapes; grouped MoE experts at batch 1/16/64 and
// prefill sizes; NVFP4 GEMM vs cuBLAS bf16; attention decode at 512-token contexts and prefill;
// Gated DeltaNet; and a synthetic "35B-A3B" decode step (random weights with the real shapes): per-op
// times and the whole step replayed as a CUDA graph.
//
// Timing: CUDA events around `reps` back-to-back calls after warm-up; the median of 5 such trials.
// Weights are rotated over enough copies (or layers) that the working set exceeds the 60 MB L2.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops_kernels.h"
#include "backend/cuda/kernels.h"

using namespace kiln::cuda;

namespace {

cudaStream_t g_stream;
std::string g_report;
double g_copy_gbs = 0.0, g_gemm_tflops = 0.0;

void emit(const std::string& s) {
  std::fputs(s.c_str(), stdout);
  std::fflush(stdout);
  g_report += s;
}
std::string strf(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string strf(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// Mean microseconds per call: median over 5 trials of `reps` calls (fn gets the call index).
double time_us(const std::function<void(int)>& fn, int reps) {
  cudaEvent_t a, b;
  KILN_CUDA_CHECK(cudaEventCreate(&a));
  KILN_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn(i);
  KILN_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  std::vector<double> trials;
  for (int t = 0; t < 5; ++t) {
    KILN_CUDA_CHECK(cudaEventRecord(a, g_stream));
    for (int i = 0; i < reps; ++i) fn(i);
    KILN_CUDA_CHECK(cudaEventRecord(b, g_stream));
    KILN_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    trials.push_back(ms * 1000.0 / reps);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(trials.begin(), trials.end());
  return trials[2];
}

DeviceBuffer dalloc(size_t bytes) { return DeviceBuffer(std::max<size_t>(bytes, 256)); }

void table_header(const char* title) {
  emit(strf("\n### %s\n\n| op | us | bytes (MB) | GB/s | %% of copy BW | TFLOP/s |\n|---|---:|---:|---:|---:|---:|\n",
           title));
}
void table_row(const std::string& name, double us, double bytes, double flops = 0.0) {
  const double gbs = bytes / (us * 1e-6) / 1e9;
  emit(strf("| %s | %.2f | %.2f | %.0f | %.0f%% | %s |\n", name.c_str(), us, bytes / 1e6, gbs,
           100.0 * gbs / g_copy_gbs, flops > 0 ? strf("%.1f", flops / (us * 1e-6) / 1e12).c_str() : "-"));
}

// ------------------------------------------------------------------------------------------------
void measure_ceilings() {
  const size_t bytes = size_t(2) << 30;
  DeviceBuffer src = dalloc(bytes), dst = dalloc(bytes);
  fill_random_u8(src.as<uint8_t>(), bytes, 1, 0, 255, g_stream);
  const double us = time_us([&](int) { KILN_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes,
                                                                       cudaMemcpyDeviceToDevice, g_stream)); }, 5);
  g_copy_gbs = 2.0 * bytes / (us * 1e-6) / 1e9;

  const int n = 8192;
  DeviceBuffer x = dalloc(size_t(n) * n * 2), w = dalloc(size_t(n) * n * 2), o = dalloc(size_t(n) * n * 2);
  fill_random_bf16(x.as<uint16_t>(), size_t(n) * n, 2, 1.0f, g_stream);
  fill_random_bf16(w.as<uint16_t>(), size_t(n) * n, 3, 1.0f, g_stream);
  BlasLt blas;
  const double gus = time_us([&](int) {
    blas.gemm(x.as<uint16_t>(), n, w.as<uint16_t>(), n, o.data(), n, false, n, n, n, g_stream);
  }, 10);
  g_gemm_tflops = 2.0 * n * n * double(n) / (gus * 1e-6) / 1e12;
  emit(strf("\n## Ceilings (measured here)\n\n- device-to-device copy: %.0f GB/s (read + write, 2 GiB)\n"
           "- cuBLASLt bf16 GEMM 8192^3, random data: %.0f TFLOP/s\n",
           g_copy_gbs, g_gemm_tflops));
}

// ------------------------------------------------------------------------------------------------
struct Nvfp4Set {  // `copies` random NVFP4 matrices [n, k] in one allocation
  int n, k, copies;
  DeviceBuffer codes, scales;
  size_t bytes_one() const { return size_t(n) * k / 2 + size_t(n) * k / 16; }
  Nvfp4Weight get(int i) const {
    return {codes.as<uint8_t>() + size_t(i % copies) * n * k / 2, scales.as<uint8_t>() + size_t(i % copies) * n * k / 16,
            0.01f};
  }
};
Nvfp4Set make_nvfp4(int n, int k, size_t min_total_bytes, uint32_t seed) {
  Nvfp4Set s{n, k, 1, {}, {}};
  s.copies = int(std::min<size_t>(512, std::max<size_t>(1, (min_total_bytes + s.bytes_one() - 1) / s.bytes_one())));
  s.codes = dalloc(size_t(s.copies) * n * k / 2);
  s.scales = dalloc(size_t(s.copies) * n * k / 16);
  fill_random_u8(s.codes.as<uint8_t>(), size_t(s.copies) * n * k / 2, seed, 0, 255, g_stream);
  fill_random_u8(s.scales.as<uint8_t>(), size_t(s.copies) * n * k / 16, seed + 1, 0x30, 0x3e, g_stream);
  return s;
}

void bench_nvfp4_gemv() {
  table_header("NVFP4 linear, decode shapes (GEMV path; weights rotated over >= 512 MB)");
  struct S {
    const char* name;
    int n, k;
  };
  const S shapes[] = {{"35B expert/shared gate+up 1024x2048", 1024, 2048},
                      {"35B expert/shared down 2048x512", 2048, 512},
                      {"397B expert gate+up 2048x4096", 2048, 4096},
                      {"397B expert down 4096x1024", 4096, 1024},
                      {"dense 8192x4096", 8192, 4096}};
  for (const S& sh : shapes) {
    Nvfp4Set w = make_nvfp4(sh.n, sh.k, size_t(512) << 20, 11);
    for (int m : {1, 8}) {
      DeviceBuffer x = dalloc(size_t(m) * sh.k * 2), out = dalloc(size_t(m) * sh.n * 2);
      fill_random_bf16(x.as<uint16_t>(), size_t(m) * sh.k, 5, 1.0f, g_stream);
      const double us = time_us([&](int i) {
        nvfp4_linear(w.get(i), sh.n, sh.k, x.as<uint16_t>(), sh.k, m, out.as<uint16_t>(), sh.n, g_stream,
                     Nvfp4Path::kGemv);
      }, 200);
      const double bytes = double(w.bytes_one()) + 2.0 * m * (sh.k + sh.n);
      table_row(strf("%s, m=%d", sh.name, m), us, bytes, 2.0 * m * sh.n * double(sh.k));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// All experts of `layers` MoE layers, with device tables.
struct MoeLayers {
  int E, H, I, layers;
  DeviceBuffer codes, scales, tables;
  size_t expert_bytes() const { return (3 * size_t(H) * I) / 2 + (3 * size_t(H) * I) / 16; }
  MoeExperts get(int l) const {
    const Nvfp4Weight* t = tables.as<Nvfp4Weight>() + size_t(l % layers) * 3 * E;
    return {t, t + E, t + 2 * E, H, I};
  }
};
MoeLayers make_moe(int E, int H, int I, int layers, uint32_t seed) {
  MoeLayers m{E, H, I, layers, {}, {}, {}};
  const size_t per = size_t(H) * I;  // elements of one matrix
  const size_t n_mats = size_t(layers) * E * 3;
  m.codes = dalloc(n_mats * per / 2);
  m.scales = dalloc(n_mats * per / 16);
  fill_random_u8(m.codes.as<uint8_t>(), n_mats * per / 2, seed, 0, 255, g_stream);
  fill_random_u8(m.scales.as<uint8_t>(), n_mats * per / 16, seed + 1, 0x30, 0x3e, g_stream);
  std::vector<Nvfp4Weight> host(n_mats);
  for (size_t i = 0; i < n_mats; ++i)
    host[i] = {m.codes.as<uint8_t>() + i * per / 2, m.scales.as<uint8_t>() + i * per / 16, 0.01f};
  m.tables = dalloc(n_mats * sizeof(Nvfp4Weight));
  KILN_CUDA_CHECK(cudaMemcpy(m.tables.data(), host.data(), n_mats * sizeof(Nvfp4Weight), cudaMemcpyHostToDevice));
  return m;
}

double expected_unique_experts(int E, int k, int T) { return E * (1.0 - std::pow(1.0 - double(k) / E, T)); }

void bench_moe() {
  const int E = 256, k = 8, H = 2048, I = 512, layers = 4;
  MoeLayers moe = make_moe(E, H, I, layers, 21);
  table_header("MoE experts, 35B-A3B shape (256 experts, top-8, inter 512), NVFP4; 4 layers x 8 routings rotated");
  for (int T : {1, 16, 64, 512, 2048}) {
    const int R = 8;
    DeviceBuffer logits = dalloc(size_t(R) * T * E * 4), route = dalloc(R * moe_routing_bytes(T, E, k));
    std::vector<MoeRouting> routings;
    fill_random_f32(logits.as<float>(), size_t(R) * T * E, 31 + T, -4.0f, 4.0f, g_stream);
    for (int r = 0; r < R; ++r) {
      routings.push_back(moe_routing_carve(route.as<uint8_t>() + r * moe_routing_bytes(T, E, k), T, E, k));
      moe_route(logits.as<float>() + size_t(r) * T * E, E, T, true, routings.back(), g_stream);
    }
    DeviceBuffer x = dalloc(size_t(T) * H * 2), act = dalloc(size_t(T) * k * I * 2), y = dalloc(size_t(T) * k * H * 2),
                 out = dalloc(size_t(T) * H * 2);
    fill_random_bf16(x.as<uint16_t>(), size_t(T) * H, 7, 1.0f, g_stream);
    const double route_us = time_us([&](int i) {
      moe_route(logits.as<float>() + size_t(i % R) * T * E, E, T, true, routings[i % R], g_stream);
    }, 100);
    const double ffn_us = time_us([&](int i) {
      moe_expert_ffn(moe.get(i / R), x.as<uint16_t>(), H, T, routings[i % R], act.as<uint16_t>(), y.as<uint16_t>(),
                     g_stream);
    }, T >= 512 ? 20 : 100);
    const double comb_us = time_us([&](int i) {
      moe_combine(y.as<uint16_t>(), routings[i % R], T, H, nullptr, 0, nullptr, 0, out.as<uint16_t>(), H, g_stream);
    }, 100);
    const double bytes = expected_unique_experts(E, k, T) * moe.expert_bytes() + 2.0 * T * H * 2;
    const double flops = 6.0 * T * k * double(I) * H;
    table_row(strf("route+plan T=%d", T), route_us, double(T) * E * 4);
    table_row(strf("expert FFN T=%d (%s)", T, T * k <= 16 * E ? "gemv" : "gemm"), ffn_us, bytes, flops);
    table_row(strf("combine T=%d", T), comb_us, double(T) * k * H * 2 + 2.0 * T * H);
  }
}

// ------------------------------------------------------------------------------------------------
void bench_gemm() {
  table_header("Prefill GEMMs: NVFP4 GEMM path vs cuBLASLt bf16 (same shape)");
  BlasLt blas;
  struct S {
    int m, n, k;
  };
  for (const S s : {S{4096, 4096, 4096}, S{2048, 1024, 2048}, S{8192, 2048, 512}}) {
    Nvfp4Set w = make_nvfp4(s.n, s.k, 0, 41);
    DeviceBuffer x = dalloc(size_t(s.m) * s.k * 2), out = dalloc(size_t(s.m) * s.n * 2), wb = dalloc(size_t(s.n) * s.k * 2);
    fill_random_bf16(x.as<uint16_t>(), size_t(s.m) * s.k, 43, 1.0f, g_stream);
    fill_random_bf16(wb.as<uint16_t>(), size_t(s.n) * s.k, 44, 0.05f, g_stream);
    const double flops = 2.0 * s.m * s.n * double(s.k);
    const double us = time_us([&](int i) {
      nvfp4_linear(w.get(i), s.n, s.k, x.as<uint16_t>(), s.k, s.m, out.as<uint16_t>(), s.n, g_stream, Nvfp4Path::kGemm);
    }, 20);
    table_row(strf("nvfp4 gemm %dx%dx%d", s.m, s.n, s.k), us, double(w.bytes_one()) + 2.0 * s.m * (s.k + s.n), flops);
    const double bus = time_us([&](int) {
      blas.gemm(x.as<uint16_t>(), s.k, wb.as<uint16_t>(), s.k, out.data(), s.n, false, s.m, s.n, s.k, g_stream);
    }, 20);
    table_row(strf("cublasLt bf16 %dx%dx%d", s.m, s.n, s.k), bus, 2.0 * s.n * s.k + 2.0 * s.m * (s.k + s.n), flops);
  }
}

// ------------------------------------------------------------------------------------------------
struct AttnSetup {
  int S, ctx, q_len, nh = 16, nkv = 2, page_size = 16;
  bool fp8;
  int copies;
  DeviceBuffer k, v, q, gate, out, ws, q_start, pos0, pages;
  AttnBatch batch;
  KvCache cache(int i) const {
    const size_t per = size_t(S) * ((ctx + q_len + page_size - 1) / page_size) * page_size * nkv * 256 * (fp8 ? 1 : 2);
    return {k.as<uint8_t>() + (i % copies) * per, v.as<uint8_t>() + (i % copies) * per, fp8, 0.05f, 0.05f,
            page_size, nkv, 256};
  }
};
std::unique_ptr<AttnSetup> make_attn(int S, int ctx, int q_len, bool fp8) {
  auto a = std::make_unique<AttnSetup>();
  a->S = S;
  a->ctx = ctx;
  a->q_len = q_len;
  a->fp8 = fp8;
  const int pages_per = (ctx + q_len + a->page_size - 1) / a->page_size;
  const size_t per = size_t(S) * pages_per * a->page_size * a->nkv * 256 * (fp8 ? 1 : 2);
  a->copies = int(std::max<size_t>(1, std::min<size_t>(64, (size_t(256) << 20) / per)));
  a->k = dalloc(per * a->copies);
  a->v = dalloc(per * a->copies);
  if (fp8) {
    fill_random_u8(a->k.as<uint8_t>(), per * a->copies, 51, 0x20, 0x50, g_stream);
    fill_random_u8(a->v.as<uint8_t>(), per * a->copies, 52, 0x20, 0x50, g_stream);
  } else {
    fill_random_bf16(a->k.as<uint16_t>(), per * a->copies / 2, 51, 1.0f, g_stream);
    fill_random_bf16(a->v.as<uint16_t>(), per * a->copies / 2, 52, 1.0f, g_stream);
  }
  const int T = S * q_len;
  a->q = dalloc(size_t(T) * a->nh * 256 * 2);
  a->gate = dalloc(size_t(T) * a->nh * 256 * 2);
  a->out = dalloc(size_t(T) * a->nh * 256 * 2);
  fill_random_bf16(a->q.as<uint16_t>(), size_t(T) * a->nh * 256, 53, 1.0f, g_stream);
  fill_random_bf16(a->gate.as<uint16_t>(), size_t(T) * a->nh * 256, 54, 1.0f, g_stream);
  std::vector<int32_t> qs(S + 1), p0(S, ctx), pt(size_t(S) * pages_per);
  for (int s = 0; s <= S; ++s) qs[s] = s * q_len;
  for (size_t i = 0; i < pt.size(); ++i) pt[i] = int32_t((i * 7919) % pt.size());  // scattered pages
  a->q_start = dalloc(qs.size() * 4);
  a->pos0 = dalloc(p0.size() * 4);
  a->pages = dalloc(pt.size() * 4);
  KILN_CUDA_CHECK(cudaMemcpy(a->q_start.data(), qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
  KILN_CUDA_CHECK(cudaMemcpy(a->pos0.data(), p0.data(), p0.size() * 4, cudaMemcpyHostToDevice));
  KILN_CUDA_CHECK(cudaMemcpy(a->pages.data(), pt.data(), pt.size() * 4, cudaMemcpyHostToDevice));
  a->batch = {a->q_start.as<int32_t>(), a->pos0.as<int32_t>(), a->pages.as<int32_t>(), pages_per, S, q_len, ctx + q_len};
  a->ws = dalloc(attention_workspace_bytes(a->batch, a->nh, a->cache(0)));
  return a;
}

void bench_attention() {
  table_header("Attention (16 q heads / 2 kv heads / 256), paged KV (page 16)");
  for (bool fp8 : {false, true})
    for (int S : {1, 16, 64}) {
      auto a = make_attn(S, 512, 1, fp8);
      const double us = time_us([&](int i) {
        attention(a->q.as<uint16_t>(), a->gate.as<uint16_t>(), a->nh * 256, 256, a->batch, a->nh, a->cache(i),
                  a->out.as<uint16_t>(), a->ws.data(), g_stream);
      }, 100);
      const double bytes = double(S) * 2 * 513 * a->nkv * 256 * (fp8 ? 1 : 2) + 3.0 * S * a->nh * 256 * 2;
      table_row(strf("decode ctx 512, batch %d, %s KV", S, fp8 ? "fp8" : "bf16"), us, bytes,
                4.0 * S * a->nh * 256 * 513.0);
    }
  for (int T : {1024, 4096}) {
    auto a = make_attn(1, 0, T, false);
    const double us = time_us([&](int i) {
      attention(a->q.as<uint16_t>(), a->gate.as<uint16_t>(), a->nh * 256, 256, a->batch, a->nh, a->cache(i),
                a->out.as<uint16_t>(), a->ws.data(), g_stream);
    }, 10);
    table_row(strf("prefill causal %d tokens (bf16 KV)", T), us, 2.0 * T * a->nkv * 256 * 2 + 3.0 * T * a->nh * 256 * 2,
              4.0 * a->nh * 256 * (double(T) * (T + 1) / 2));
  }
}

// ------------------------------------------------------------------------------------------------
void bench_deltanet() {
  table_header("Gated DeltaNet (16 k heads / 32 v heads / 128): decode and prefill");
  const int nk = 16, nv = 32, d = 128, C = 2 * nk * d + nv * d;
  for (int S : {1, 16, 64}) {
    for (int T_per : {1, 1024}) {
      if (T_per > 1 && S > 1) continue;
      const int T = S * T_per;
      DeviceBuffer qkv = dalloc(size_t(T) * C * 2), z = dalloc(size_t(T) * nv * d * 2), ab = dalloc(size_t(T) * nv * 2 * 2),
                   out = dalloc(size_t(T) * nv * d * 2), conv_out = dalloc(size_t(T) * C * 2),
                   cw = dalloc(size_t(C) * 4 * 2), cs = dalloc(size_t(S) * 3 * C * 2),
                   state = dalloc(size_t(S) * nv * d * d * 4), alog = dalloc(nv * 4), dt = dalloc(nv * 4), nw = dalloc(d * 4);
      fill_random_bf16(qkv.as<uint16_t>(), size_t(T) * C, 61, 1.0f, g_stream);
      fill_random_bf16(z.as<uint16_t>(), size_t(T) * nv * d, 62, 1.0f, g_stream);
      fill_random_bf16(ab.as<uint16_t>(), size_t(T) * nv * 2, 63, 1.0f, g_stream);
      fill_random_bf16(cw.as<uint16_t>(), size_t(C) * 4, 64, 0.5f, g_stream);
      fill_random_f32(state.as<float>(), size_t(S) * nv * d * d, 65, -0.01f, 0.01f, g_stream);
      fill_random_f32(alog.as<float>(), nv, 66, -1.0f, 1.0f, g_stream);
      fill_random_f32(dt.as<float>(), nv, 67, -0.5f, 0.5f, g_stream);
      fill_random_f32(nw.as<float>(), d, 68, 0.9f, 1.1f, g_stream);
      KILN_CUDA_CHECK(cudaMemsetAsync(cs.data(), 0, size_t(S) * 3 * C * 2, g_stream));
      std::vector<int32_t> start(S + 1), slot(S), reset(S, 0);
      for (int s = 0; s <= S; ++s) start[s] = s * T_per;
      for (int s = 0; s < S; ++s) slot[s] = s;
      DeviceBuffer d_start = dalloc((S + 1) * 4), d_slot = dalloc(S * 4), d_reset = dalloc(S * 4);
      KILN_CUDA_CHECK(cudaMemcpy(d_start.data(), start.data(), (S + 1) * 4, cudaMemcpyHostToDevice));
      KILN_CUDA_CHECK(cudaMemcpy(d_slot.data(), slot.data(), S * 4, cudaMemcpyHostToDevice));
      KILN_CUDA_CHECK(cudaMemcpy(d_reset.data(), reset.data(), S * 4, cudaMemcpyHostToDevice));
      GdnSeqs seqs{d_start.as<int32_t>(), d_slot.as<int32_t>(), d_reset.as<int32_t>(), S};
      const double conv_us = time_us([&](int) {
        gdn_conv1d(qkv.as<uint16_t>(), C, cw.as<uint16_t>(), cs.as<uint16_t>(), seqs, C, conv_out.as<uint16_t>(), g_stream);
      }, T_per > 1 ? 10 : 100);
      const double rec_us = time_us([&](int) {
        gdn_recurrent(conv_out.as<uint16_t>(), C, z.as<uint16_t>(), nv * d, ab.as<uint16_t>(), 2 * nv,
                      ab.as<uint16_t>() + nv, 2 * nv, alog.as<float>(), dt.as<float>(), nw.as<float>(), 1e-6f,
                      state.as<float>(), seqs, GdnShape{nk, nv, d, d}, out.as<uint16_t>(), g_stream);
      }, T_per > 1 ? 3 : 100);
      table_row(strf("conv1d %d seq x %d tok", S, T_per), conv_us, 2.0 * T * C * 2 + 2.0 * S * 3 * C * 2);
      table_row(strf("recurrent %d seq x %d tok", S, T_per), rec_us,
                2.0 * S * nv * d * d * 4 + double(T) * (C + nv * d * 2) * 2);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Synthetic 35B-A3B: the real shapes with random weights (REFERENCE §1), BF16 everywhere except the
// routed experts (NVFP4), bf16 KV cache; one decode step for B sequences at context `ctx`.
struct Model35 {
  static constexpr int H = 2048, L = 40, NH = 16, NKV = 2, D = 256, NK = 16, NV = 32, DH = 128;
  static constexpr int C = 2 * NK * DH + NV * DH;       // 8192 conv channels
  static constexpr int IN = C + NV * DH + 2 * NV;       // fused in_proj_qkv | z | b | a = 12352
  static constexpr int QKV = NH * 2 * D + 2 * NKV * D;  // fused q|gate, k, v = 9216
  static constexpr int E = 256, K = 8, I = 512, SI = 512, V = 248320, PS = 16;
  static constexpr int RLD = 264;  // router logits row (256 experts + shared gate), padded
  static bool full(int l) { return l % 4 == 3; }

  int B, ctx;
  BlasLt blas;
  std::vector<DeviceBuffer> keep;
  uint32_t seed = 100;
  template <typename T>
  T* alloc(size_t n) {
    keep.push_back(dalloc(n * sizeof(T)));
    return keep.back().as<T>();
  }
  uint16_t* bf16w(size_t n, float scale) {
    uint16_t* p = alloc<uint16_t>(n);
    fill_random_bf16(p, n, seed++, scale, g_stream);
    return p;
  }
  float* f32w(size_t n, float lo, float hi) {
    float* p = alloc<float>(n);
    fill_random_f32(p, n, seed++, lo, hi, g_stream);
    return p;
  }

  struct Lin {
    uint16_t *w_in, *conv_w, *w_out, *conv_state;
    float *A_log, *dt, *nw, *state;
  };
  struct Full {
    uint16_t *w_qkv, *qn, *kn, *w_o;
    KvCache cache;
  };
  struct Layer {
    uint16_t *norm1, *norm2, *router, *sh_gu, *sh_down;
    Lin lin;
    Full fa;
  };
  std::vector<Layer> layers;
  MoeLayers moe;
  uint16_t *embed, *final_norm, *lm_head;
  // activations
  uint16_t *x, *h, *proj, *conv_out, *o, *attn_out, *act, *y, *sgu, *sact, *sh, *delta, *qbuf;
  float *rlogits, *logits;
  int32_t *ids, *positions;
  int64_t* kv_slot;
  MoeRouting routing;
  AttnBatch batch;
  GdnSeqs seqs;
  void* attn_ws;
  void* argmax_work;

  Model35(int B_, int ctx_) : B(B_), ctx(ctx_), moe(make_moe(E, H, I, L, 900)) {
    for (int l = 0; l < L; ++l) {
      Layer ly{};
      ly.norm1 = bf16w(H, 0.1f);
      ly.norm2 = bf16w(H, 0.1f);
      ly.router = bf16w(size_t(RLD) * H, 0.02f);
      ly.sh_gu = bf16w(size_t(2 * SI) * H, 0.02f);
      ly.sh_down = bf16w(size_t(H) * SI, 0.02f);
      if (full(l)) {
        ly.fa.w_qkv = bf16w(size_t(QKV) * H, 0.02f);
        ly.fa.qn = bf16w(D, 0.1f);
        ly.fa.kn = bf16w(D, 0.1f);
        ly.fa.w_o = bf16w(size_t(H) * NH * D, 0.02f);
        const int pages = B * ((ctx + 1 + PS - 1) / PS);
        const size_t n = size_t(pages) * PS * NKV * D;
        ly.fa.cache = {bf16w(n, 1.0f), bf16w(n, 1.0f), false, 1.0f, 1.0f, PS, NKV, D};
      } else {
        ly.lin.w_in = bf16w(size_t(IN) * H, 0.02f);
        ly.lin.conv_w = bf16w(size_t(C) * 4, 0.5f);
        ly.lin.w_out = bf16w(size_t(H) * NV * DH, 0.02f);
        ly.lin.conv_state = bf16w(size_t(B) * 3 * C, 0.5f);
        ly.lin.A_log = f32w(NV, -1.0f, 1.0f);
        ly.lin.dt = f32w(NV, -0.5f, 0.5f);
        ly.lin.nw = f32w(DH, 0.9f, 1.1f);
        ly.lin.state = f32w(size_t(B) * NV * DH * DH, -0.01f, 0.01f);
      }
      layers.push_back(ly);
    }
    embed = bf16w(size_t(V) * H, 0.5f);
    final_norm = bf16w(H, 0.1f);
    lm_head = bf16w(size_t(V) * H, 0.02f);
    x = alloc<uint16_t>(size_t(B) * H);
    h = alloc<uint16_t>(size_t(B) * H);
    proj = alloc<uint16_t>(size_t(B) * IN);
    conv_out = alloc<uint16_t>(size_t(B) * C);
    o = alloc<uint16_t>(size_t(B) * NH * D);
    attn_out = alloc<uint16_t>(size_t(B) * H);
    act = alloc<uint16_t>(size_t(B) * K * I);
    y = alloc<uint16_t>(size_t(B) * K * H);
    sgu = alloc<uint16_t>(size_t(B) * 2 * SI);
    sact = alloc<uint16_t>(size_t(B) * SI);
    sh = alloc<uint16_t>(size_t(B) * H);
    delta = alloc<uint16_t>(size_t(B) * H);
    KILN_CUDA_CHECK(cudaMemsetAsync(delta, 0, size_t(B) * H * 2, g_stream));
    qbuf = alloc<uint16_t>(size_t(B) * NH * D);
    rlogits = alloc<float>(size_t(B) * RLD);
    logits = alloc<float>(size_t(B) * V);
    ids = alloc<int32_t>(B);
    KILN_CUDA_CHECK(cudaMemsetAsync(ids, 0, B * 4, g_stream));
    argmax_work = alloc<uint8_t>(ops::argmax_workspace_bytes(B, V));
    const size_t rb = moe_routing_bytes(B, E, K);
    routing = moe_routing_carve(alloc<uint8_t>(rb), B, E, K);
    // Attention batch: sequence s has ctx cached tokens and decodes position ctx in its own pages.
    const int pages_per = (ctx + 1 + PS - 1) / PS;
    std::vector<int32_t> qs(B + 1), p0(B, ctx), pt(size_t(B) * pages_per), pos(B, ctx), start(B + 1), slot(B), reset(B, 0);
    std::vector<int64_t> kvs(B);
    for (int s = 0; s <= B; ++s) qs[s] = start[s] = s;
    for (size_t i = 0; i < pt.size(); ++i) pt[i] = int32_t(i);
    for (int s = 0; s < B; ++s) {
      slot[s] = s;
      kvs[s] = int64_t(pt[size_t(s) * pages_per + ctx / PS]) * PS + ctx % PS;
    }
    auto up32 = [&](const std::vector<int32_t>& v) {
      int32_t* p = alloc<int32_t>(v.size());
      KILN_CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
      return p;
    };
    batch = {up32(qs), up32(p0), up32(pt), pages_per, B, 1, ctx + 1};
    positions = up32(pos);
    kv_slot = alloc<int64_t>(B);
    KILN_CUDA_CHECK(cudaMemcpy(kv_slot, kvs.data(), B * 8, cudaMemcpyHostToDevice));
    seqs = {up32(start), up32(slot), up32(reset), B};
    attn_ws = alloc<uint8_t>(attention_workspace_bytes(batch, NH, layers[3].fa.cache));
    KILN_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  }

  // The ops of one step, in order. Each op runs for one layer index (or once).
  struct Op {
    std::string name;
    int kind;  // 0: once before layers, 1: every layer, 2: linear layers, 3: full layers, 4: once after
    double bytes;  // per call at this B
    std::function<void(int)> run;
  };
  std::vector<Op> ops() {
    const double b = B;
    const double kv_bytes = b * 2 * (ctx + 1) * NKV * D * 2;
    const double uniq = expected_unique_experts(E, K, B);
    std::vector<Op> v;
    v.push_back({"embedding", 0, b * H * 4, [this](int) { embedding(embed, ids, B, H, V, x, g_stream); }});
    v.push_back({"add + input RMSNorm", 1, b * H * 8, [this](int l) {
                   add_rmsnorm(x, delta, layers[l].norm1, B, H, 1e-6f, true, h, g_stream);
                 }});
    v.push_back({"lin: in_proj qkv|z|b|a (bf16 GEMM 2048->12352)", 2, 2.0 * IN * H + b * (H + IN) * 2,
                 [this](int l) { blas.gemm(h, H, layers[l].lin.w_in, H, proj, IN, false, B, IN, H, g_stream); }});
    v.push_back({"lin: conv1d + silu", 2, b * C * 4 + b * 3 * C * 4, [this](int l) {
                   gdn_conv1d(proj, IN, layers[l].lin.conv_w, layers[l].lin.conv_state, seqs, C, conv_out, g_stream);
                 }});
    v.push_back({"lin: gated delta rule + gated norm", 2, b * NV * DH * DH * 8.0 + b * (C + 2 * NV * DH) * 2,
                 [this](int l) {
                   const Lin& ln = layers[l].lin;
                   gdn_recurrent(conv_out, C, proj + C, IN, proj + C + NV * DH + NV, IN, proj + C + NV * DH, IN,
                                 ln.A_log, ln.dt, ln.nw, 1e-6f, ln.state, seqs, GdnShape{NK, NV, DH, DH}, o, g_stream);
                 }});
    v.push_back({"lin: out_proj (bf16 GEMM 4096->2048)", 2, 2.0 * H * NV * DH + b * (H + NV * DH) * 2,
                 [this](int l) { blas.gemm(o, NV * DH, layers[l].lin.w_out, NV * DH, attn_out, H, false, B, H, NV * DH, g_stream); }});
    v.push_back({"full: qkv|gate proj (bf16 GEMM 2048->9216)", 3, 2.0 * QKV * H + b * (H + QKV) * 2,
                 [this](int l) { blas.gemm(h, H, layers[l].fa.w_qkv, H, proj, QKV, false, B, QKV, H, g_stream); }});
    v.push_back({"full: q/k norm + RoPE + cache write", 3, b * (QKV + NH * D) * 2, [this](int l) {
                   const Full& f = layers[l].fa;
                   attention_prep(proj, QKV, proj + NH * 2 * D, QKV, proj + NH * 2 * D + NKV * D, QKV, f.qn, f.kn,
                                  positions, kv_slot, B, NH, 1e7f, 64, 1e-6f, f.cache, qbuf, g_stream);
                 }});
    v.push_back({"full: attention decode (ctx " + std::to_string(ctx) + ")", 3, kv_bytes + b * NH * D * 6,
                 [this](int l) {
                   attention(qbuf, proj + D, QKV, 2 * D, batch, NH, layers[l].fa.cache, o, attn_ws, g_stream);
                 }});
    v.push_back({"full: o_proj (bf16 GEMM 4096->2048)", 3, 2.0 * H * NH * D + b * (H + NH * D) * 2,
                 [this](int l) { blas.gemm(o, NH * D, layers[l].fa.w_o, NH * D, attn_out, H, false, B, H, NH * D, g_stream); }});
    v.push_back({"add + post-attn RMSNorm", 1, b * H * 8, [this](int l) {
                   add_rmsnorm(x, attn_out, layers[l].norm2, B, H, 1e-6f, true, h, g_stream);
                 }});
    v.push_back({"moe: router + shared gate (bf16 GEMM 2048->257, fp32 out)", 1, 2.0 * RLD * H + b * H * 2 + b * RLD * 4,
                 [this](int l) { blas.gemm(h, H, layers[l].router, H, rlogits, RLD, true, B, E + 1, H, g_stream); }});
    v.push_back({"moe: softmax top-8 + grouping", 1, b * RLD * 4, [this](int) {
                   moe_route(rlogits, RLD, B, true, routing, g_stream);
                 }});
    v.push_back({"moe: routed experts (NVFP4 gate|up+act, down)", 1, uniq * moe.expert_bytes() + b * H * 2 * (1 + K),
                 [this](int l) { moe_expert_ffn(moe.get(l), h, H, B, routing, act, y, g_stream); }});
    v.push_back({"moe: shared gate|up (bf16 GEMM 2048->1024)", 1, 2.0 * 2 * SI * H + b * (H + 2 * SI) * 2,
                 [this](int l) { blas.gemm(h, H, layers[l].sh_gu, H, sgu, 2 * SI, false, B, 2 * SI, H, g_stream); }});
    v.push_back({"moe: shared silu*mul", 1, b * SI * 6, [this](int) { silu_mul(sgu, 2 * SI, B, SI, sact, SI, g_stream); }});
    v.push_back({"moe: shared down (bf16 GEMM 512->2048)", 1, 2.0 * H * SI + b * (H + SI) * 2,
                 [this](int l) { blas.gemm(sact, SI, layers[l].sh_down, SI, sh, H, false, B, H, SI, g_stream); }});
    v.push_back({"moe: combine + shared (sigmoid gate)", 1, b * K * H * 2 + b * H * 4, [this](int) {
                   moe_combine(y, routing, B, H, sh, H, rlogits + E, RLD, delta, H, g_stream);
                 }});
    v.push_back({"final add + RMSNorm", 4, b * H * 8, [this](int) {
                   add_rmsnorm(x, delta, final_norm, B, H, 1e-6f, true, h, g_stream);
                 }});
    v.push_back({"lm_head (bf16 GEMM 2048->248320, fp32 out)", 4, 2.0 * V * H + b * V * 4,
                 [this](int) { blas.gemm(h, H, lm_head, H, logits, V, true, B, V, H, g_stream); }});
    v.push_back({"argmax", 4, b * V * 4,
                 [this](int) { ops::argmax_rows(logits, V, B, V, ids, argmax_work, g_stream); }});
    return v;
  }

  static bool applies(int kind, int l) {
    return kind == 1 || (kind == 2 && !full(l)) || (kind == 3 && full(l));
  }
  void step(std::vector<Op>& v) {
    for (auto& op : v)
      if (op.kind == 0) op.run(0);
    for (int l = 0; l < L; ++l)
      for (auto& op : v)
        if (applies(op.kind, l)) op.run(l);
    for (auto& op : v)
      if (op.kind == 4) op.run(0);
  }
};

void bench_model(int B) {
  const int ctx = 512;
  Model35 m(B, ctx);
  auto ops = m.ops();
  m.step(ops);  // fills every buffer with real intermediate values
  KILN_CUDA_CHECK(cudaStreamSynchronize(g_stream));

  emit(strf("\n### Synthetic 35B-A3B decode step, batch %d, context %d: per-op times\n\n"
           "Each op timed alone, cycling through its layers (distinct weights). 'step us' = us x calls.\n\n"
           "| op | calls/step | us/call | MB/call | GB/s | %% of copy BW | step us |\n|---|---:|---:|---:|---:|---:|---:|\n",
           B, ctx));
  double total_us = 0.0, total_bytes = 0.0;
  for (auto& op : ops) {
    std::vector<int> ls;
    for (int l = 0; l < Model35::L; ++l)
      if (Model35::applies(op.kind, l)) ls.push_back(l);
    if (ls.empty()) ls.push_back(0);
    const double us = time_us([&](int i) { op.run(ls[i % ls.size()]); }, std::max<int>(40, int(ls.size()) * 2));
    const int calls = int(ls.size());
    total_us += us * calls;
    total_bytes += op.bytes * calls;
    const double gbs = op.bytes / (us * 1e-6) / 1e9;
    emit(strf("| %s | %d | %.2f | %.2f | %.0f | %.0f%% | %.1f |\n", op.name.c_str(), calls, us, op.bytes / 1e6, gbs,
             100.0 * gbs / g_copy_gbs, us * calls));
  }

  // The whole step as one CUDA graph.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KILN_CUDA_CHECK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
  m.step(ops);
  KILN_CUDA_CHECK(cudaStreamEndCapture(g_stream, &graph));
  KILN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double graph_us = time_us([&](int) { KILN_CUDA_CHECK(cudaGraphLaunch(exec, g_stream)); }, 20);
  const double eager_us = time_us([&](int) { m.step(ops); }, 10);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  const double floor_us = total_bytes / (g_copy_gbs * 1e9) * 1e6;
  emit(strf("\nBatch %d: bytes per step %.0f MB -> floor %.0f us at the copy bandwidth. Sum of per-op times %.0f us. "
           "Whole step: CUDA graph %.0f us (%.1f steps/s, %.0f tok/s), eager launches %.0f us.\n",
           B, total_bytes / 1e6, floor_us, total_us, graph_us, 1e6 / graph_us, B * 1e6 / graph_us, eager_us));
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else {
      std::fprintf(stderr, "usage: %s [--out FILE] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (device_count() == 0) {
    std::fprintf(stderr, "bench_cuda_kernels: no CUDA device\n");
    return 1;
  }
  try {
    cudaDeviceProp prop;
    KILN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    emit(strf("# kiln CUDA kernel benchmarks\n\nDevice: %s, %d SMs, %.0f MB L2, %.1f GB\n", prop.name,
             prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.totalGlobalMem / 1e9));
    measure_ceilings();
    bench_nvfp4_gemv();
    bench_moe();
    bench_attention();
    bench_deltanet();
    if (!quick) bench_gemm();
    for (int B : {1, 16, 64}) bench_model(B);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench failed: %s\n", e.what());
    if (!out_path.empty()) {
      if (FILE* f = std::fopen(out_path.c_str(), "w")) {
        std::fputs(g_report.c_str(), f);
        std::fclose(f);
      }
    }
    return 1;
  }
  if (!out_path.empty()) {
    if (FILE* f = std::fopen(out_path.c_str(), "w")) {
      std::fputs(g_report.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}
