// BF16 GEMMs through cuBLASLt: out[m, n] = alpha * x[m, k] . w[n, k]^T (+ beta * out), fp32 accumulate; out is bf16
// or fp32. CudaOps runs dense BF16 linears of many rows through it (--dtype float32: x split into 3 bf16 parts,
// linear.cu's split_bf16x3 / sum3_rows around the GEMM; --dtype bfloat16: x rounded to bf16, the GEMM writing the
// layer's output itself). One instance per stream / thread (it holds a workspace). Plain C++.
// The algorithm is chosen for the pointers' alignment (up to 256 bytes, cuBLASLt's default assumption), so an
// output that starts anywhere 16-byte aligned inside a larger buffer gets an algorithm that can write it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

namespace kiln::cuda {

class BlasLt {
 public:
  explicit BlasLt(size_t workspace_bytes = size_t(32) << 20);
  ~BlasLt();
  BlasLt(const BlasLt&) = delete;
  BlasLt& operator=(const BlasLt&) = delete;

  void gemm(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, void* out, int64_t ldo, bool out_f32,
            int m, int n, int k, cudaStream_t stream, float alpha = 1.0f, float beta = 0.0f);

 private:
  struct Plan;
  // align: bytes of alignment of w (A), x (B) and out (C / D), each a power of two <= 256.
  struct Align {
    uint32_t w = 256, x = 256, out = 256;
  };
  Plan* plan_for(bool out_f32, int m, int n, int k, int64_t ldx, int64_t ldw, int64_t ldo, Align align);
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<bool, int, int, int, int64_t, int64_t, int64_t, uint32_t, uint32_t, uint32_t>, Plan*> plans_;
};

}  // namespace kiln::cuda
