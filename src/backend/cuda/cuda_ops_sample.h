// Token sampling on the device (CudaOps::sample_rows): model::sample_row_host's definition (model/sampling.h:
// temperature, top-k, top-p, min-p, one draw with the row's uniform) over rows of fp32 logits, so that only the ids
// come back. Plain C++ (no CUDA syntax, no fmt): cuda_ops.cpp includes it.
//
// One block of 1024 threads per row. The logits are scaled as the host scales them (x * (1.0f / T) in float, round
// to nearest) and the probabilities are doubles exp(x - max), as on the host; what differs is the order of the sums
// (tree and segment sums here, a running sum in ascending id / sorted order there) and the last bit of exp (CUDA's
// vs the C library's, both within an ulp). The token is therefore the
// host's except when a uniform or a top-p / min-p threshold lands within rounding (~1e-16 relative) of a boundary.
// Each row's sums have a fixed order (no floating-point atomics): the same inputs give the same token on every run.
//  - greedy (T < 1e-6): argmax, lowest id on ties;
//  - top-k: radix select of the k-th largest value over order-preserving uint32 keys (4 passes of 8 bits, counts);
//  - top-p: the same radix select where each bucket carries its probability mass (double) instead of its count:
//    it finds the value at which the mass summed from the top reaches top_p * sum; of the tokens at that value
//    (equal probabilities, ordered by ascending id on the host) as many are kept as the host's running sum
//    (p = e / sum added one token at a time) needs to reach top_p, the crossing one included: the j lowest ids
//    (a counting select in ascending id);
//  - min-p: drops the tokens with e / S < min_p * (1 / S) (e = exp(x - max), S the survivors' mass);
//  - the draw: the survivors' mass in ascending id, each thread one contiguous segment (segment sums, a block scan);
//    the segment where the prefix passes u * S is walked in order.
// A row with no finite largest value (all -inf / NaN, or +inf) gets -1. NaN logits are unsupported.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cuda/cuda_ops_kernels.h"

namespace kiln::cuda::ops {

// model::RowSampling as the kernel reads it.
struct SampleRowArgs {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  double u = 0.0;
};

// ids[r] = the token of row r (logits + r * ld, V values) drawn as rows[r] says. rows, ids: device arrays [R].
// V at most 2^30.
void sample_rows(const float* logits, int64_t ld, int64_t R, int64_t V, const SampleRowArgs* rows, int32_t* ids,
                 Stream stream);

}  // namespace kiln::cuda::ops
