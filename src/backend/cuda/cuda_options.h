// How the CUDA backend runs: the kernel choices a user may make (built from the command-line flags by
// backend/device.cpp) and the forms the tests pin. Defaults are the fast paths. Plain C++.
#pragma once

namespace kiln::backend::cuda {

struct CudaOptions {
  // The CUDA device (a tensor-parallel rank's, from --base-gpu-id / --gpu-id-step); < 0: the first supported one.
  int device = -1;
  // --attention-backend: prefill-shaped steps on the flash-style tensor-core kernel (attention_prefill.cu, q and p in
  // 3 bf16 parts), or every step on the split-over-keys kernel on the CUDA cores (kiln-paged-fp32).
  bool prefill_attention_tensor_cores = true;
  // --moe-runner-backend: NVFP4 routed experts on tensor cores (moe_experts.cu, x in 3 bf16 parts), or on the fp32
  // CUDA-core kernels (kiln-grouped-fp32). Other weight formats always take the CUDA-core kernels.
  bool moe_tensor_cores = true;
  // --fp4-gemm-backend: dense NVFP4 linears of more rows than the gemv takes on tensor cores (the expert kernel with
  // the weight as its only expert), or on the fp32 gemm (kiln-fp32).
  bool fp4_linear_tensor_cores = true;
  // Dense BF16 linears of many rows through cuBLASLt (x in 3 bf16 parts); false keeps them on the fp32 kernels.
  // No flag: the tests cover both paths.
  bool dense_bf16_blas = true;
  // --enable-pdl (experimental): programmatic dependent launch between adjacent kernels (launch.cuh), sm_90+.
  bool pdl = false;
  // Which form of the gated delta rule runs. by_step: chunks of 64 tokens for prefill steps with a sequence of >= 32
  // tokens (where the chunked kernel serves the head sizes), the recurrence otherwise; chunked: the chunked form for
  // every step where it serves the head sizes. No flag: the tests check the chunked kernel on every step shape.
  enum class DeltaRule { by_step, chunked };
  DeltaRule delta_rule = DeltaRule::by_step;
};

}  // namespace kiln::backend::cuda
