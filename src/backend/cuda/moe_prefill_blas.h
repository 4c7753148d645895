// The NVFP4 routed experts of large steps (prefill) through cuBLAS: the experts that received tokens are dequantised
// to bf16 into a scratch buffer (e2m1 code x e4m3 block scale, exact in bf16; the per-tensor weight_scale_2 is each
// GEMM's alpha), the step's (token, slot) pairs are sorted by expert (moe_group_rows), x is gathered into that order
// as bf16, and cuBLAS grouped GEMMs (cublasGemmGroupedBatchedEx, bf16 in, fp32 compute, bf16 out) run gate/up, then
// silu(gate) * up (fp32, rounded to bf16), then down; the combine (moe_combine_bf16) sums each token's rows in
// ascending expert id as the mma path does. Experts that do not fit the scratch run in batches of consecutive ones.
//
// The GEMM shapes need each expert's row count on the host: after the grouping, the counts are copied back and the
// stream synchronised (once per layer), so the path must not run inside a CUDA graph capture (CudaOps checks
// cudaStreamIsCapturing; cuda_options.h, moe_prefill_blas()).
// Accuracy (--dtype bfloat16 only): x and silu(gate) * up rounded to bf16 as on the mma kernels, plus gate / up and
// the expert outputs stored in bf16 (cuBLAS's grouped GEMM writes bf16 for bf16 inputs): ~2^-9 RMS each, within the
// budget of the bf16 expert checks (op_check.h, kBf16InputTol). Plain C++ (no CUDA syntax).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

// True when the path serves these experts: all NVFP4 (experts_gemv2_kind 1, 16-byte aligned codes: experts_vec_ok),
// no bias, H and I multiples of 16 (cuBLAS's 16-byte rows and the scale blocks).
bool moe_prefill_blas_supported(int64_t H, int64_t I, int experts_gemv2_kind, bool experts_vec_ok,
                                const WeightDesc* host_experts, int64_t E);
// Bytes of one expert's dequantised gate, up and down (bf16).
size_t moe_prefill_blas_expert_bytes(int64_t H, int64_t I);
// The per-pass workspace (the grouping; x sorted, gate/up, silu(gate) * up and the expert outputs in bf16; the GEMMs'
// device pointer arrays): no more than moe_workspace_bytes() of the same shape (checked by a test), which the memory
// plan's activation estimate already covers, so the path takes its per-pass buffers from what the plan reserves.
size_t moe_prefill_blas_workspace_bytes(int64_t T, int top_k, int64_t E, int64_t H, int64_t I);

// One per CudaOps (one stream): the cuBLAS handle and the pinned host buffers of the row counts and GEMM arguments.
class MoePrefillBlas {
 public:
  MoePrefillBlas();
  ~MoePrefillBlas();
  MoePrefillBlas(const MoePrefillBlas&) = delete;
  MoePrefillBlas& operator=(const MoePrefillBlas&) = delete;

  // out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (+ shared[t] * sigmoid(shared_gate[t])), ids outside
  // [0, E) skipped. experts_dev / experts_host: the [E][3] {gate, up, down} descriptors in device / host memory.
  // workspace: moe_prefill_blas_workspace_bytes(); weight_scratch: at least moe_prefill_blas_expert_bytes() bytes
  // (the experts run in batches of weight_scratch_bytes / expert bytes). Synchronises the stream once.
  void run(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* weights, int top_k,
           const WeightDesc* experts_dev, const WeightDesc* experts_host, int64_t E, int64_t I, void* workspace,
           void* weight_scratch, size_t weight_scratch_bytes, float* out, const float* shared,
           const float* shared_gate, Stream stream);

 private:
  void* handle_ = nullptr;
  void* host_ = nullptr;  // pinned: the row offsets, then the GEMM pointer arrays
  size_t host_bytes_ = 0;
  void host_reserve(size_t bytes);
  // The grouped GEMMs' host arrays (one problem per group), reused across calls.
  std::vector<int> transa_, transb_, m_, n_, k_, lda_, ldb_, ldc_, group_size_;
  std::vector<float> alpha_, beta_;
};

}  // namespace kiln::cuda::ops
