// The gated delta rule in chunks of 64 tokens (cuda_ops_deltanet_chunked.cu), the prefill companion of the
// token-by-token gated_delta_rule() of cuda_ops_kernels.h. Plain C++ (no CUDA syntax, no fmt) so that both nvcc and
// g++ can include it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/cuda_ops_kernels.h"

namespace kiln::cuda::ops {

// The gated delta rule in chunks of 64 tokens (the UT-transform form), for sequences with many tokens (prefill).
// Same inputs, outputs and state as gated_delta_rule() in cuda_ops_kernels.h, except that q and k are the
// already L2-normalised qn / kn ([T, Hk, Dk] contiguous, q also divided by sqrt(Dk)), as l2norm_qk_kernel writes
// them. g, beta [T, Hv] contiguous; v rows ldv elements apart (heads contiguous inside a row); out [T, Hv, Dv]
// contiguous; state [slots, Hv, Dk, Dv] fp32, indexed like delta_rule_kernel's (S[i * Dv + j], i the key index).
// A sequence's slot must hold its running state (zeros for a fresh sequence); sequences of 0 tokens are left as
// they are. fp32 FMA throughout (no tensor cores, no fast-math).
// workspace: gated_delta_rule_chunked_workspace_bytes(...) bytes (0 today: the kernel needs none; pass null).
size_t gated_delta_rule_chunked_workspace_bytes(int64_t T, int64_t Hv, int64_t Dk, int64_t Dv, const StepArgs& step);
void gated_delta_rule_chunked(const float* qn, const float* kn, const float* v, const float* g, const float* beta,
                              float* state, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t ldv,
                              const StepArgs& step, float* out, void* workspace, cudaStream_t stream);
// True when the chunked kernel serves these head sizes on the current device: 1 <= Dk <= 128 (padded to 32, 64 or
// 128), any Dv >= 1 (tiles of 32 or 64 value columns, the last one masked), and the block's shared memory within
// the device's opt-in limit (Dk 128: 180 KB with 32 value columns, 220 KB with 64; Dk <= 32: 97 KB). True on sm_90 /
// sm_100 (227 KB); on parts with 99 KB per block (sm_86 / sm_89 / sm_120) only for Dk <= 32: elsewhere the caller
// keeps the recurrent kernel.
bool gated_delta_rule_chunked_supported(int64_t Dk, int64_t Dv);

}  // namespace kiln::cuda::ops
