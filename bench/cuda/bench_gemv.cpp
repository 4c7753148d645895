// The bandwidth gemv (linear.cu's gemv_stream_kernel) at the decode shapes of the 35B-A3B and of a 397B-A17B rank of
// TP 8 (a benchmark, not a test): each shape's launch is captured 32 times in one CUDA graph over rotating weight
// copies (more bytes than L2 holds, so every launch reads HBM), the graph replayed 7 times after a warm-up; prints
// the median microseconds per launch and the bytes per second of weights.
//   bench_gemv [--rows 1,8]
// bf16 shapes also time --dtype bfloat16's cuBLASLt path (x rounded to bf16, one GEMM) for the same rows.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/blas_lt.h"
#include "backend/cuda/kernels.h"

namespace {

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

using namespace kiln::cuda::ops;

struct Shape {
  const char* name;
  std::vector<int> n;  // one linear, or the segments of a linear_multi
  int k;
  bool nvfp4;
};

struct Weights {
  std::vector<std::vector<WeightDesc>> copies;  // [copy][segment]
  std::vector<const uint16_t*> bf16_base;       // bf16: [copy] the segments, adjacent in memory ([sum n, k])
  size_t bytes_per_launch = 0;
};

Weights make_weights(const Shape& s, size_t min_total_bytes) {
  Weights w;
  size_t per = 0;
  for (int n : s.n) per += s.nvfp4 ? size_t(n) * s.k / 2 + size_t(n) * s.k / 16 : size_t(n) * s.k * 2;
  w.bytes_per_launch = per;
  const size_t copies = std::max<size_t>(2, (min_total_bytes + per - 1) / per);
  uint64_t seed = 1;
  for (size_t c = 0; c < copies; ++c) {
    std::vector<WeightDesc> segs;
    char* block = nullptr;
    if (!s.nvfp4) {
      CK(cudaMalloc(reinterpret_cast<void**>(&block), per));
      w.bf16_base.push_back(reinterpret_cast<const uint16_t*>(block));
    }
    for (int n : s.n) {
      WeightDesc d;
      d.n = n;
      d.k = s.k;
      if (s.nvfp4) {
        uint8_t* codes = nullptr;
        uint8_t* scales = nullptr;
        CK(cudaMalloc(reinterpret_cast<void**>(&codes), size_t(n) * s.k / 2));
        CK(cudaMalloc(reinterpret_cast<void**>(&scales), size_t(n) * s.k / 16));
        fill_random_bytes(codes, int64_t(n) * s.k / 2, seed++, 0, 256, false, nullptr);
        fill_random_bytes(scales, int64_t(n) * s.k / 16, seed++, 0x20, 0x40, false, nullptr);
        d.data = codes;
        d.block_scale = scales;
        d.kind = WeightKind::nvfp4;
        d.scale = 0.01f;
      } else {
        void* p = block;
        block += size_t(n) * s.k * 2;
        fill_random_uniform(p, ElemType::bf16, int64_t(n) * s.k, seed++, -0.05f, 0.05f, nullptr);
        d.data = p;
        d.kind = WeightKind::dense;
        d.elem = ElemType::bf16;
      }
      segs.push_back(d);
    }
    w.copies.push_back(segs);
  }
  CK(cudaDeviceSynchronize());
  return w;
}

void launch(const std::vector<WeightDesc>& segs, const float* x, int T, int K, const std::vector<float*>& outs,
            const std::vector<int64_t>& ldos, cudaStream_t st) {
  if (segs.size() == 1) {
    linear(segs[0], x, K, T, outs[0], ldos[0], st);
  } else if (!linear_multi(segs.data(), int(segs.size()), x, K, T, outs.data(), ldos.data(), st)) {
    std::fprintf(stderr, "linear_multi refused the shape\n");
    std::exit(1);
  }
}

// Microseconds per launch: one(l) for l < launches, run once outside a graph (warm-up, cuBLASLt's plan), then
// captured into one CUDA graph; the median of 7 timed replays after one untimed replay.
template <typename Fn>
double graph_us(cudaStream_t st, int launches, Fn&& one) {
  one(0);
  CK(cudaStreamSynchronize(st));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int l = 0; l < launches; ++l) one(l);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < 7; ++r) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return ms[ms.size() / 2] * 1e3 / launches;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> rows = {1, 8};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--rows") == 0) {
      rows.clear();
      for (const char* p = argv[i + 1]; *p;) {
        rows.push_back(int(std::strtol(p, const_cast<char**>(&p), 10)));
        if (*p == ',') ++p;
        else if (*p) break;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  const std::vector<Shape> shapes = {
      {"35B DeltaNet in-proj 8192+4096+32+32 x 2048 bf16", {8192, 4096, 32, 32}, 2048, false},
      {"35B attention qkv 8192+512+512 x 2048 bf16", {8192, 512, 512}, 2048, false},
      {"35B out-proj 2048 x 4096 bf16", {2048}, 4096, false},
      {"35B router+shared 256+512+512+1 x 2048 bf16", {256, 512, 512, 1}, 2048, false},
      {"35B shared down 2048 x 512 bf16", {2048}, 512, false},
      {"397B/8 out-proj 4096 x 1024 bf16", {4096}, 1024, false},
      {"397B/8 in-proj 2048+1024+8+8 x 4096 bf16", {2048, 1024, 8, 8}, 4096, false},
      {"397B router+shared 512+128+128+1 x 4096 bf16", {512, 128, 128, 1}, 4096, false},
      {"nvfp4 2048 x 4096", {2048}, 4096, true},
      {"nvfp4 4096 x 2048", {4096}, 2048, true},
      {"lm_head 248320 x 2048 bf16", {248320}, 2048, false},
  };
  const int kLaunches = 32;
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  kiln::cuda::BlasLt blas;
  std::printf("%-48s %4s %12s | %-26s | %s\n", "shape", "T", "MB/launch", "gemv: us  TB/s", "bf16 + cuBLASLt: us  TB/s");
  for (const Shape& s : shapes) {
    const bool big = s.n[0] > 100000;
    Weights w = make_weights(s, big ? 0 : size_t(200) << 20);
    for (int T : rows) {
      float* x = nullptr;
      CK(cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float) * T * s.k));
      fill_random_uniform(x, ElemType::f32, int64_t(T) * s.k, 99, -1.0f, 1.0f, nullptr);
      std::vector<float*> outs;
      std::vector<int64_t> ldos;
      for (int n : s.n) {
        float* o = nullptr;
        CK(cudaMalloc(reinterpret_cast<void**>(&o), sizeof(float) * T * n));
        outs.push_back(o);
        ldos.push_back(n);
      }
      const int launches = big ? 4 : kLaunches;
      auto report = [&](const char* sep, double us) {
        std::printf("%s%8.2f us %5.2f TB/s", sep, us, w.bytes_per_launch / (us * 1e-6) / 1e12);
      };
      std::printf("%-48s %4d %12.2f |", s.name, T, w.bytes_per_launch / 1e6);
      report(" ", graph_us(st, launches, [&](int l) {
               launch(w.copies[l % w.copies.size()], x, T, s.k, outs, ldos, st);
             }));
      if (!s.nvfp4) {
        // --dtype bfloat16's tensor-core path: x rounded to bf16, one cuBLASLt GEMM over the adjacent segments.
        int ntot = 0;
        for (int n : s.n) ntot += n;
        uint16_t* xs = nullptr;
        float* o = nullptr;
        CK(cudaMalloc(reinterpret_cast<void**>(&xs), size_t(2) * T * s.k));
        CK(cudaMalloc(reinterpret_cast<void**>(&o), sizeof(float) * T * ntot));
        report(" | ", graph_us(st, launches, [&](int l) {
                 round_bf16(x, s.k, T, s.k, xs, st);
                 blas.gemm(xs, s.k, w.bf16_base[l % w.bf16_base.size()], s.k, o, ntot, true, T, ntot, s.k, st);
               }));
        CK(cudaFree(xs));
        CK(cudaFree(o));
      }
      std::printf("\n");
      std::fflush(stdout);
      for (float* o : outs) CK(cudaFree(o));
      CK(cudaFree(x));
    }
    for (auto& c : w.copies)
      for (auto& d : c)
        if (d.block_scale) {
          CK(cudaFree(const_cast<void*>(d.data)));
          CK(cudaFree(const_cast<uint8_t*>(d.block_scale)));
        }
    for (const uint16_t* b : w.bf16_base) CK(cudaFree(const_cast<uint16_t*>(b)));
  }
  return 0;
}
