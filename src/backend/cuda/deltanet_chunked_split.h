// The split form of the chunked gated delta rule (deltanet_chunked_split.cu), as gated_delta_rule_chunked
// (deltanet_chunked.cu) dispatches to it: the kernels.h entry points check the shapes and the device first.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

// The larger of the two kernels' shared memory for this key dim (padded to 32, 64 or 128).
size_t delta_rule_split_shared_bytes(int64_t Dk);

// The preparation kernel, then the scan; workspace: gated_delta_rule_chunked_workspace_bytes(...) bytes, 256-byte
// aligned. tf32_parts 1 or 3 (anything else runs as 3).
void gated_delta_rule_chunked_split(const float* qn, const float* kn, const float* v, const float* g,
                                    const float* beta, DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk,
                                    int64_t Dv, int64_t ldv, const StepArgs& step, float* out, void* workspace,
                                    cudaStream_t stream, int tf32_parts);

}  // namespace kiln::cuda::ops
