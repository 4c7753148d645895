// The host API of the one-kernel MoE block of a step of 1-4 tokens (moe_block_decode.cu): router, shared expert, routing,
// routed NVFP4 experts and the weighted combine as the phases of one persistent grid. Plain C++ like kernels.h (both
// nvcc and g++ include it).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

struct MoeBlockArgs {
  const float* x = nullptr;  // [T, H] the block's (normed) input; null when `residual` is set
  int T = 1, H = 0;
  // The post-attention residual add + RMSNorm folded in (residual non-null; x null): residual += residual_y and the
  // block's input is rmsnorm(residual) * (norm_w (+ 1 when zero_centred)), add_rms_norm's maths. [T, H] each; norm_w
  // [H] of norm_w_elem (f32 or bf16).
  float* residual = nullptr;
  const float* residual_y = nullptr;
  const void* norm_w = nullptr;
  ElemType norm_w_elem = ElemType::f32;
  float norm_eps = 0.0f;
  bool norm_zero_centred = false;
  // Dense BF16 weights, [rows, H] unless said: the router [E, H], the shared expert's gate and up [Is, H], its gate
  // [1, H] and its down projection [H, Is].
  const void* router = nullptr;
  const void* shared_gate_proj = nullptr;
  const void* shared_up_proj = nullptr;
  const void* shared_expert_gate = nullptr;
  const void* shared_down_proj = nullptr;
  int E = 0, Is = 0, top_k = 0;
  bool renormalise = false;
  // The held routed experts' device table [E_held][3] {gate [I, H], up [I, H], down [H, I]}, NVFP4.
  const WeightDesc* experts = nullptr;
  int held_begin = 0, E_held = 0, I = 0;
  // --dtype bfloat16: x and silu(gate) * up rounded to bf16 where they enter the NVFP4 experts (as the tensor-core
  // path rounds them); false: fp32.
  bool bf16_expert_inputs = false;
  void* workspace = nullptr;   // moe_block_decode_workspace_bytes()
  unsigned* barrier = nullptr; // 2 words, zero before the first launch; the kernel leaves them ready for the next
  float* out = nullptr;        // [T, H]
  int32_t* ids = nullptr;      // [T, top_k] (may be null): the routing's ids and weights, as moe_route writes them
  float* weights = nullptr;
  // L2 prefetch (cp.async.bulk.prefetch) of the weights a warp reads next: the next dense row of phase A, and during
  // phase C the shared and routed down rows of its phase-D rows (CudaOptions::persistent_prefetch).
  bool prefetch = false;
};

// Whether the kernel serves the shapes: 1 <= T <= 4, H % 32 == 0 and H <= 4096, top_k <= E <= 1024, 1 <= top_k <= 16,
// I % 32 == 0 and 32 <= I <= 1024, Is % 8 == 0 and 8 <= Is <= 1024. The caller also checks 16-byte alignment of x, out
// and every weight, and that the weights are dense BF16 (router, shared expert) and NVFP4 (routed experts). Also: x,
// the experts' activations and the shared expert's in <= 200 KiB of shared memory (T (H + top_k I + Is) floats).
bool moe_block_decode_supported(int64_t T, int64_t H, int64_t E, int64_t Is, int64_t I, int top_k);
size_t moe_block_decode_workspace_bytes(int64_t T, int64_t E, int64_t Is, int top_k, int64_t I);
// The blocks of the persistent grid on CUDA device `device` (all resident at once: one per multiprocessor); 0 when a
// block does not fit a multiprocessor (the caller then takes the unfused ops). Also sets the kernels' shared memory
// limit: call it once with `device` current, before any launch and outside stream capture.
int moe_block_decode_grid(int device);
// One launch of `grid` blocks (moe_block_decode_grid's).
void moe_block_decode(const MoeBlockArgs& a, int grid, Stream stream);

}  // namespace kiln::cuda::ops
