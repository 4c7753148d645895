// The host API of the one-kernel Gated DeltaNet mixer of a decode step of 1-4 sequences (deltanet_block_decode.cu): the
// input norm (with the residual step before it), the input projections, the causal conv, the gates, the delta rule,
// the gated output norm and the output projection as the phases of one persistent grid. Plain C++ like kernels.h.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

struct DeltaNetBlockArgs {
  int T = 1, H = 0;  // T sequences of one token each
  // The residual stream [T, H] (residual_y, if not null, is added to it first and the sum written back, as
  // add_rms_norm does) and the input norm: x = rmsnorm(residual) * (norm_w (+ 1 when zero_centred)).
  float* residual = nullptr;
  const float* residual_y = nullptr;
  const void* in_norm_w = nullptr;
  ElemType in_norm_elem = ElemType::f32;
  float in_norm_eps = 0.0f;
  bool in_norm_zero_centred = true;
  // Dense BF16 input projections [rows, H]: qkv [C, H] (C = 2 Hk Dk + Hv Dv; rows q | k | v), z [Hv Dv, H], b and a
  // [Hv, H].
  const void* w_qkv = nullptr;
  const void* w_z = nullptr;
  const void* w_b = nullptr;
  const void* w_a = nullptr;
  int Hk = 0, Hv = 0, Dk = 0, Dv = 0;
  // The causal conv (kernel 4): weight [C, 4], its state F32 [slots, C, 3].
  const void* conv_w = nullptr;
  ElemType conv_elem = ElemType::f32;
  float* conv_state = nullptr;
  // The gates' parameters [Hv].
  const void* A_log = nullptr;
  ElemType A_log_elem = ElemType::f32;
  const void* dt_bias = nullptr;
  ElemType dt_bias_elem = ElemType::f32;
  // The recurrent state [slots, Hv, Dk, Dv] and each sequence's slot [T].
  DeltaStateRef state;
  const int32_t* state_slot = nullptr;
  // The gated output norm: w [Dv] (plain), eps.
  const void* out_norm_w = nullptr;
  ElemType out_norm_elem = ElemType::f32;
  float out_norm_eps = 0.0f;
  const void* w_out = nullptr;  // dense BF16 [H, Hv Dv]
  void* workspace = nullptr;    // deltanet_block_decode_workspace_bytes()
  unsigned* barrier = nullptr;  // 2 words, zero before the first launch; the kernel leaves them ready for the next
  float* out = nullptr;         // [T, H]
  // L2 prefetch (cp.async.bulk.prefetch) of the weights a warp reads next: the next input-projection row, and during
  // phase B the output projection's rows (CudaOptions::persistent_prefetch).
  bool prefetch = false;
};

// Whether the kernel serves the shapes: 1 <= T <= 4, H % 32 == 0 and H <= 4096, Dk == Dv == 64 or 128, Hk >= 1,
// Hv % Hk == 0, Hv <= 64 (the rank's heads), and x / the normed output rows within the shared memory limit. The caller
// also checks the dtypes (dense BF16 projections, F32 conv state) and 16-byte alignment.
bool deltanet_block_decode_supported(int64_t T, int64_t H, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv);
size_t deltanet_block_decode_workspace_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv);
// Sets the kernels' shared memory limit on CUDA device `device` (current) and returns whether one block per
// multiprocessor fits: call once, outside stream capture, before any launch (the grid is moe_block_decode_grid's).
bool deltanet_block_decode_prepare(int device);
// One launch of `grid` blocks (one per multiprocessor).
void deltanet_block_decode(const DeltaNetBlockArgs& a, int grid, Stream stream);

}  // namespace kiln::cuda::ops
