// The host API of the fused decode kernels of the routed experts (moe_decode_fused.cu): CudaOps::moe_route_experts
// runs a decode-sized step's routing and NVFP4 experts through it. Plain C++ like kernels.h (both nvcc and g++
// include it); a header of its own so that kernels.h, which every kernel file includes, stays as it is.
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

// Routing (moe_route's maths, bitwise the same ids and weights) + gate/up + silu * up in one kernel, down + the
// weighted combine (+ the gated shared expert) in a second: moe_route() then moe_experts() without the grouping,
// split and combine launches between them. NVFP4 experts only (16-byte aligned codes), on the CUDA cores with the
// tensor-core path's decode; x and silu(gate) * up rounded to bf16 when mma_parts is kMmaPartsBf16, fp32 otherwise.
constexpr int64_t kMoeDecodeMaxTokens = 8;  // steps of more tokens take the grouped path
constexpr int kMoeDecodeMaxTopK = 16;
constexpr int kMoeDecodeMaxExperts = 1024;
// True when the fused kernels serve the shapes: 1 <= T <= 8, NVFP4 experts (experts_gemv2_kind 1), H % 32 == 0,
// 64 <= I <= 1024 with I % 32 == 0, top_k <= E <= 1024, top_k <= 16. The caller also checks that x and the outputs
// are 16-byte aligned.
bool moe_decode_fused_supported(int64_t T, int64_t H, int64_t I, int64_t E, int top_k, int experts_gemv2_kind);
size_t moe_decode_fused_workspace_bytes(int64_t T, int top_k, int64_t I);
// logits [T, E] (all experts of the layer); ids, weights [T, top_k] (written: global expert ids, as moe_route);
// experts: the device table [E_held][3] of the held experts [held_begin, held_begin + E_held) (an expert-parallel
// rank's; pairs of other experts are skipped); x, out [T, H]; shared / shared_gate as moe_experts; workspace:
// moe_decode_fused_workspace_bytes() bytes. Two launches; profile_mark after each.
void moe_decode_fused(const float* logits, const float* x, int64_t T, int64_t H, int64_t E, int top_k,
                      bool renormalise, int32_t* ids, float* weights, const WeightDesc* experts, int32_t held_begin,
                      int64_t E_held, int64_t I, void* workspace, float* out, const float* shared,
                      const float* shared_gate, int mma_parts, Stream stream);

}  // namespace kiln::cuda::ops
