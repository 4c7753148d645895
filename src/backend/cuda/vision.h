// The host API of the vision-encoder kernels (vision.cu) behind CudaOps' layer_norm, gelu, rope_cos_sin,
// attention_segments and weighted_embedding (the Qwen3.5 vision tower, model/qwen3_5_vision.h; the maths of each op:
// model/ops.h, the oracle: backend/cpu/cpu_vision.cpp). Same conventions as kernels.h: device pointers, F32
// activations, weights read as stored (ElemType), launchers check only the launch, nothing synchronises the stream, and
// every launch can be captured into a CUDA graph. Plain C++ (nvcc and the host compiler both include it).
#pragma once
#include <cstdint>

#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

// out[r] = (x[r] - mean) * rsqrt(var + eps) * w + b per row of x [R, D] (biased variance; mean and variance in fp32
// over the row, two passes). w, b [D] as stored (f32 / bf16 / f16). out may be x (in place). A block per row.
void layer_norm(const float* x, int64_t R, int64_t D, const void* w, ElemType w_elem, const void* b, ElemType b_elem,
                float eps, float* out, Stream stream);

// out[i] = gelu(x[i]) over n elements, fp32 with the accurate erff / tanhf: the erf form, or with tanh_form the tanh
// approximation ("gelu_pytorch_tanh"). out may be x.
void gelu(const float* x, int64_t n, bool tanh_form, float* out, Stream stream);

// In place over x [T, heads, D] (D even): for i < D/2, (x[i], x[i + D/2]) rotated by the angle whose cosine and sine
// are cos[t, i], sin[t, i] (cos, sin [T, D/2]).
void rope_cos_sin(float* x, int64_t T, int64_t heads, int64_t D, const float* cos, const float* sin, Stream stream);

// out[t, c] = sum_j weights[t, j] * table[ids[t, j], c] (j ascending, fp32) over table [V, H] as stored; ids [T, J],
// weights [T, J], out [T, H]. A row id outside [0, V) contributes nothing (the CPU backend rejects it on the host; the
// device cannot raise without a synchronisation).
void weighted_embedding(const void* table, ElemType elem, int64_t V, int64_t H, const int32_t* ids,
                        const float* weights, int64_t T, int64_t J, float* out, Stream stream);

// ---- attention within segments
// Bidirectional softmax attention: token t of segment s (tokens [cu_seqlens[s], cu_seqlens[s + 1])) attends to every
// token of its segment. q, k, v, out [T, heads, D] contiguous; cu_seqlens [S + 1] on the device (0 first, T last,
// non-decreasing; empty segments allowed); max_seqlen >= the longest segment (host-known: it sizes the grid, and
// rows past it are not computed). scores = (q . k) * scale, softmax in fp32 (running max and sum per row), out =
// sum p v / sum p. Two kernels:
//  - tensor cores (mma_parts 3 or 1, kMmaPartsFp32 / kMmaPartsBf16): flash-style, a block per (64 query rows, head,
//    segment); q, K, V, and the softmax weights p enter bf16 MMAs (m16n8k16, fp32 accumulate) in mma_parts bf16 parts
//    each. 3 parts: x = hi + mid + lo, and every product of parts whose indices sum to <= 2 (6 MMAs where bf16 inputs
//    take 1), so the dropped terms are ~2^-27 relative: fp32-class accuracy (the op checks' 1e-5). 1 part: q, k, p, v
//    rounded once to bf16 (rel-L2 ~3-5e-3; kBf16InputTol). Served where attention_segments_mma_supported says.
//  - CUDA cores (mma_parts kSegmentAttentionFp32): a warp per (token, head), fp32 FMAs, any D <= 256: what serves the
//    rest, and --attention-backend kiln-paged-fp32 (CudaOptions::prefill_attention_tensor_cores false).
constexpr int kSegmentAttentionFp32 = 0;
constexpr int64_t kSegmentAttentionMaxHeadDim = 256;
// True when the tensor-core kernel takes head_dim D with mma_parts (3 or 1) on the current device: D % 4 == 0 and
// 4 <= D <= 256 (padded to 32, 64, 80, 128 or 256 columns), q / k / v / out 16-byte aligned, and its shared memory
// ((3 parts x 64 query rows + 2 x 3 parts x kKeys key rows) x (2 x padded D + 16) bytes; kKeys 64, 32 above 128
// columns: 101,376 bytes at D = 72 with 3 parts, 33,792 with 1) within the device's per-block limit.
bool attention_segments_mma_supported(int64_t D, int mma_parts, const void* q, const void* k, const void* v,
                                      const void* out);
// Launches the kernel mma_parts names (3 / 1: tensor cores, where supported; kSegmentAttentionFp32: CUDA cores).
// num_segments = S; heads * ceil(max_seqlen / 64) must stay below 2^31.
void attention_segments(const float* q, const float* k, const float* v, const int32_t* cu_seqlens,
                        int64_t num_segments, int64_t max_seqlen, int64_t T, int64_t heads, int64_t D, float scale,
                        float* out, int mma_parts, Stream stream);

}  // namespace kiln::cuda::ops
