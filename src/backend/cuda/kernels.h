// The host API of the CUDA kernels: the launchers behind CudaOps (cuda_ops.h), by family, each section naming the
// .cu file that implements it. F32 activations on the device, weights read as stored. Plain C++ (no CUDA syntax, no
// fmt) so that both nvcc (the .cu files) and g++ (cuda_ops.cpp, which validates shapes and turns them into these
// calls; the GPU tests) can include it.
//
// Pointers are device pointers. Element types of float tensors the kernels read (weights, norms, pools)
// are passed as ElemType. Launchers only check the launch (KILN_CUDA_CHECK_LAUNCH); shapes are checked by
// the caller. Nothing here synchronises the stream.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "model/sampling.h"

namespace kiln::cuda::ops {

using Stream = cudaStream_t;

// Programmatic dependent launch (launch.cuh): whether this thread's launch_kernel() launches now carry the attribute.
// CudaRuntime turns it on for the span of a CUDA graph capture when its CudaOptions::pdl is on (sm_90+).
bool pdl_launches_now();
void set_pdl_launches(bool on);
// Inside such a capture, with CudaOptions::weight_prefetch: the bandwidth gemv's blocks prefetch their weight rows
// into L2 before their PDL wait (linear.cu).
bool weight_prefetch_now();
void set_weight_prefetch(bool on);

// Profiling of the kernels inside one launcher (CudaOps --profile): when a hook is set, launchers of several kernels
// call profile_mark(label) after each stage; CudaOps times the stage from the previous mark (or the op's start).
using ProfileMarkFn = void (*)(void* ctx, const char* label);
void set_profile_mark(ProfileMarkFn fn, void* ctx);
void profile_mark(const char* label);

enum class ElemType : int32_t { f32 = 0, bf16 = 1, f16 = 2, e4m3 = 3 };
enum class WeightKind : int32_t { dense = 0, fp8_tensor = 1, nvfp4 = 2 };

// One linear weight W [n, k] as the kernels read it (see model::LinearWeight).
struct WeightDesc {
  const void* data = nullptr;            // dense [n, k] (elem); fp8 [n, k] bytes; nvfp4 [n, k/2] code pairs
  const uint8_t* block_scale = nullptr;  // nvfp4: F8_E4M3 [n, k/16]
  const void* bias = nullptr;            // [n] (bias_elem) or null
  float scale = 1.0f;                    // fp8: weight_scale; nvfp4: weight_scale_2
  WeightKind kind = WeightKind::dense;
  ElemType elem = ElemType::bf16;        // dense element type
  ElemType bias_elem = ElemType::f32;
  int32_t n = 0, k = 0;
};

// Which bandwidth gemv (linear.cu) can stream W: 0 bf16 (k % 8 == 0), 1 nvfp4 (k % 32 == 0), -1 none
// (the generic kernel runs). Needs 16-byte aligned codes / values.
inline int gemv2_kind_host(const WeightDesc& w) {
  if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0) return -1;
  if (w.kind == WeightKind::dense && w.elem == ElemType::bf16 && w.k % 8 == 0) return 0;
  if (w.kind == WeightKind::nvfp4 && w.k % 32 == 0 && reinterpret_cast<uintptr_t>(w.block_scale) % 2 == 0) return 1;
  return -1;
}

// The step layout (model::StepLayout) as device arrays.
struct StepArgs {
  const int32_t* token_pos = nullptr;        // [T]
  const int32_t* seq_token_begin = nullptr;  // [S + 1]
  const int32_t* seq_state_slot = nullptr;   // [S]
  const int32_t* page_table = nullptr;       // [S, max_pages]
  int32_t num_tokens = 0, num_seqs = 0, max_pages = 0, page_size = 0;
  int32_t max_seq_tokens = 0;  // longest sequence of the step (host-known)
  // [T] or null: the state slot that receives each token's conv / recurrent state after it (-1: none); the conv kernel
  // and the delta rule's recurrence write these position checkpoints (the chunked form takes no such step).
  const int32_t* token_checkpoint_slot = nullptr;
};

// One layer's paged KV pool: [pages, page_size, kv_heads, head_dim] each.
struct KvPoolArgs {
  void* k = nullptr;
  void* v = nullptr;
  ElemType elem = ElemType::bf16;  // f32, bf16 or e4m3 (value = code * scale)
  float k_scale = 1.0f, v_scale = 1.0f;
  int32_t kv_heads = 0, head_dim = 0;
};

// ---- memory-shaped ops (elementwise.cu; argmax_rows: sampling.cu)
// dst = src over up to 4 dims (shape / strides in elements, leading dims padded with 1 / 0); elem_bytes 1..8.
void copy_strided(const void* src, void* dst, int elem_bytes, const int64_t shape[4], const int64_t src_strides[4],
                  const int64_t dst_strides[4], Stream stream);
// Many contiguous byte copies in one launch: spans[i] (a device table of n entries) copies bytes from src to dst.
// Each span is one block row (gridDim.y); 16-byte words where src, dst and bytes allow, else bytes.
struct ByteSpan {
  const void* src;
  void* dst;
  uint64_t bytes;
};
void copy_spans(const ByteSpan* spans, int n, uint64_t max_bytes, Stream stream);
// ids[r] = argmax_v logits[r * ld + v] over v < V (lowest index on ties, NaN never wins, all NaN: 0).
// work: argmax_workspace_bytes(R, V) bytes of device memory.
size_t argmax_workspace_bytes(int64_t R, int64_t V);
// values (optional, device): each row's best logit (NaN for a row without a number). id_offset is added to every id
// written (a lone tensor-parallel rank's first vocabulary id; values are still read at the row's own index).
void argmax_rows(const float* logits, int64_t ld, int64_t R, int64_t V, int32_t* ids, void* work, Stream stream,
                 float* values = nullptr, int32_t id_offset = 0);
// *result = max |x| (result: one device float, overwritten).
void max_abs(const float* x, int64_t n, float* result, Stream stream);

// ---- fills (fill.cu) and the split / sum around cuBLASLt GEMMs (linear.cu)
// A tensor-parallel rank's slice of a random tensor (format::SliceLoops): out element i holds element source(i) of the
// full fill, so a rank fills its slice on the device with the same values as the whole tensor of TP 1.
struct FillSlice {
  static constexpr int kMaxRows = 8;
  int64_t outer_begin = 0, split_full = 1, split_local = 1, mid = 1, last_full = 1, last_local = 1, last_begin = 0;
  int num_rows = 0;  // 0: split rows [0, split_local)
  int64_t row_begin[kMaxRows] = {}, row_count[kMaxRows] = {};
};
// The device twin of model::fill_random_host (same bytes): bytes in [byte_lo, byte_hi) (+ random sign bit), or
// uniform floats lo + (hi - lo) * u rounded to elem. With `slice`: n elements of the slice (fill_random_host_slice).
void fill_random_bytes(uint8_t* out, int64_t n, uint64_t seed, uint32_t byte_lo, uint32_t byte_hi, bool random_sign,
                       Stream stream, const FillSlice* slice = nullptr);
void fill_random_uniform(void* out, ElemType elem, int64_t n, uint64_t seed, float lo, float hi, Stream stream,
                         const FillSlice* slice = nullptr);
// Tensor-core linears at fp32 accuracy: x [T, K] (row stride ldx) = hi + mid + lo in bf16, written as the row
// blocks of out [3T, K]; one bf16 GEMM of the 3T rows against W, then out = (lo + mid) + hi per row (sum3_rows).
void split_bf16x3(const float* x, int64_t ldx, int64_t T, int64_t K, uint16_t* out, Stream stream);
// Tensor-core linears with bf16 inputs (--dtype bfloat16): out [T, K] = x rounded to bf16 (nearest even); the GEMM of
// the T rows writes the fp32 output itself.
void round_bf16(const float* x, int64_t ldx, int64_t T, int64_t K, uint16_t* out, Stream stream);
// bf16 parts per fp32 activation at a tensor-core input (CudaOptions::mma_parts(), --dtype): 3 (x = hi + mid + lo,
// fp32 accuracy) or 1 (x rounded once to bf16). The tensor-core launchers below take no other value.
constexpr int kMmaPartsFp32 = 3;
constexpr int kMmaPartsBf16 = 1;
// bias: [N] (bias_elem) or null; when set, out = ((lo + mid) + hi) + bias[n] (the fp32 kernels' sum + bias), in the
// same launch. Without a bias the sum is the same as before (nothing added).
void sum3_rows(const float* part, int64_t T, int64_t N, float* out, int64_t ldo, Stream stream,
               const void* bias = nullptr, ElemType bias_elem = ElemType::f32);
// sum3_rows for one GEMM over several adjacent weights: columns [col0[s], col0[s + 1]) (the last to N) go to out[s]
// (row stride ldo[s]), plus bias[s][column within the segment] where bias[s] is set; col0 ascending, col0[0] == 0.
struct Sum3Segments {
  static constexpr int kMax = 4;
  float* out[kMax] = {};
  int64_t ldo[kMax] = {};
  int64_t col0[kMax] = {};
  const void* bias[kMax] = {};
  ElemType bias_elem[kMax] = {};
  int count = 0;
};
void sum3_rows_segments(const float* part, int64_t T, int64_t N, const Sum3Segments& segs, Stream stream);
// out[t, n] += bias[n] (bias_elem) for t < T, n < N (row stride ldo): the bias of a linear whose one-part GEMM
// (--dtype bfloat16) wrote out itself. (cuBLASLt's bias epilogue wants the bias in the output's type, F32 here,
// and checkpoints store it in BF16.)
void add_row_bias(float* out, int64_t ldo, int64_t T, int64_t N, const void* bias, ElemType bias_elem, Stream stream);
// One thread spinning for `microseconds` (the profiler queues it so that the ops after it run back to back).
void busy_wait(double microseconds, Stream stream);

// ---- dense maths (elementwise.cu)
// out[t] = table[ids[t] - id_begin] (ids outside [id_begin, id_begin + V) give a zero row: a vocabulary shard of
// a tensor-parallel rank holds rows [id_begin, id_begin + V)). table [V, H], out [T, H].
void embedding(const void* table, ElemType elem, int64_t V, int64_t H, const int32_t* ids, int64_t id_begin, int64_t T,
               float* out, Stream stream);
// x [R, D] with row stride ldx; w [D]; out [R, D] contiguous. out = x_hat * (w or 1 + w).
void rms_norm(const float* x, int64_t ldx, int64_t R, int64_t D, const void* w, ElemType w_elem, float eps,
              bool zero_centred, float* out, Stream stream);
// hidden += y, then out = rms_norm(hidden) (a block per row). hidden, y, out [R, D] contiguous.
void add_rms_norm(float* hidden, const float* y, int64_t R, int64_t D, const void* w, ElemType w_elem, float eps,
                  bool zero_centred, float* out, Stream stream);
// out = (w * x_hat) * silu(z); x, z, out [R, D].
void gated_rms_norm(const float* x, const float* z, int64_t R, int64_t D, const void* w, ElemType w_elem, float eps,
                    float* out, Stream stream);
// A full-attention prologue in one launch (CudaOps::qk_norm_rope): per (token, head) row of q (heads [0, Hq), row t
// head h at q + t * ldq + h * q_head_stride) and k (heads [Hq, Hq + Hkv), at k + t * ldk + h * D): rms_norm as
// rms_norm() computes it for D < 512, then rope() / mrope() (pos_stride 1 or 3); q_out [T, Hq, D], k_out [T, Hkv, D];
// gate_out (or null) [T, Hq, D] takes each q head's next D values (the gated layout). D < 512, even rotary_dim <= D.
bool qk_norm_rope_fits(int64_t D);
void qk_norm_rope(const float* q, int64_t ldq, int64_t q_head_stride, const float* k, int64_t ldk, int64_t T,
                  int64_t Hq, int64_t Hkv, int64_t D, const void* q_w, ElemType q_w_elem, const void* k_w,
                  ElemType k_w_elem, float eps, bool zero_centred, const int32_t* positions, int pos_stride,
                  uint64_t axes_lo, uint64_t axes_hi, int rotary_dim, double theta, float* q_out, float* gate_out,
                  float* k_out, Stream stream);
// In place on x [T, heads, D]: rotate_half RoPE over the first rotary_dim dims.
void rope(float* x, int64_t T, int64_t heads, int64_t D, const int32_t* positions, int rotary_dim, double theta,
          Stream stream);
// M-RoPE: positions [T, 3]; frequency p takes axis (axes >> 2p) & 3 (axes_lo: p < 32, axes_hi: p >= 32).
void mrope(float* x, int64_t T, int64_t heads, int64_t D, const int32_t* positions, uint64_t axes_lo,
           uint64_t axes_hi, int rotary_dim, double theta, Stream stream);
// dst[rows[r]] = src[r]; src [R, H], dst [dst_rows, H].
void scatter_rows(const float* src, const int32_t* rows, int64_t R, int64_t H, float* dst, int64_t dst_rows,
                  Stream stream);
void add(const float* a, const float* b, float* out, int64_t n, Stream stream);
void silu_mul(const float* gate, const float* up, float* out, int64_t n, Stream stream);
// out[t, i] = x[t, i] * sigmoid(g[t, g_cols == 1 ? 0 : i]); x, out [T, N], g [T, g_cols].
void sigmoid_mul(const float* x, const float* g, float* out, int64_t T, int64_t N, int64_t g_cols, Stream stream);
// out[r] = x[rows[r]] (rows outside [0, x_rows) give a zero row). x [x_rows, H], out [R, H].
void gather_rows(const float* x, int64_t x_rows, int64_t H, const int32_t* rows, int64_t R, float* out,
                 Stream stream);

// ---- Gated DeltaNet, token by token (deltanet.cu)
// Depthwise causal conv (kernel Kc <= 8) + SiLU per sequence, continuing from / updating conv_state
// [slots, C, Kc - 1]. x, out [T, C]; w [C, Kc].
void causal_conv1d_silu(const float* x, int64_t C, const void* w, ElemType w_elem, int Kc, float* conv_state,
                        const StepArgs& step, float* out, Stream stream);
// g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b). a, b, g, beta [T, Hv].
void delta_rule_gates(const float* a, const float* b, const void* A_log, ElemType A_log_elem, const void* dt_bias,
                      ElemType dt_bias_elem, int64_t T, int64_t Hv, float* g, float* beta, Stream stream);
// A DeltaNet recurrent state [slots, Hv, Dk, Dv] (per head S[i * Dv + j], i the key index), fp32 or bf16 (half the
// bytes; CudaOptions::recurrent_state_bf16). The kernels load it into fp32, update it in fp32 and round a bf16 state
// once, to nearest even, when they store it.
struct DeltaStateRef {
  void* data = nullptr;
  bool bf16 = false;
};
// The gated delta rule over `state` (above). q, k [T, Hk, Dk]; v, out [T, Hv, Dv]; g, beta [T, Hv]. q, k,
// v rows are ldq / ldk / ldv elements apart (heads contiguous inside a row). qk_work: 2 * T * Hk * Dk floats (the
// normalised q and k). Dk <= 256. Token by token, or with `chunked` (where gated_delta_rule_chunked_supported) in
// chunks of 64 tokens (gated_delta_rule_chunked below; equal up to rounding).
// The raw inputs of delta_rule_gates, for the recurrent kernel to compute g / beta itself (a, b [T, Hv]).
struct DeltaGateArgs {
  const float* a = nullptr;
  const float* b = nullptr;
  const void* A_log = nullptr;
  const void* dt_bias = nullptr;
  ElemType A_log_elem = ElemType::f32, dt_bias_elem = ElemType::f32;
};
// The gated RMSNorm of each head's output row, for the recurrent kernel to apply as it produces the row:
// out = w * rmsnorm(o) * silu(z) per [Dv] row (gated_rms_norm's arithmetic); z and out [T, Hv, Dv] contiguous.
struct DeltaNormArgs {
  const float* z = nullptr;
  const void* w = nullptr;
  ElemType w_elem = ElemType::f32;
  float eps = 0.0f;
  float* out = nullptr;
};
constexpr int64_t kDeltaNormMaxDim = 128;  // the fused output norm: one block per head, Dk and Dv <= this
inline bool delta_rule_norm_supported(int64_t Dk, int64_t Dv) {
  return Dk <= kDeltaNormMaxDim && Dv <= kDeltaNormMaxDim;
}
// `gates` (recurrent form only; ignored by the chunked one, which reads g / beta): g and beta are computed in the
// kernel from the raw inputs and g / beta are not read. `norm` (recurrent form only, delta_rule_norm_supported(Dk,
// Dv)): the kernel also writes the gated RMSNorm of each head's output row; out is written as without it.
// chunked_tf32_parts: the chunked kernel's tf32_parts (gated_delta_rule_chunked below; 0: its FMA form).
// chunked_workspace: gated_delta_rule_chunked's workspace (null: the single-kernel form; else the split form where it
// serves the call).
void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta,
                      DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t ldq, int64_t ldk,
                      int64_t ldv,
                      const StepArgs& step, float* out, float* qk_work, Stream stream, bool chunked = false,
                      const DeltaGateArgs* gates = nullptr, const DeltaNormArgs* norm = nullptr,
                      int chunked_tf32_parts = 0, void* chunked_workspace = nullptr);

// ---- paged attention, any step shape (attention_decode.cu)
// k, v [T, kv_heads, head_dim] -> the pool rows of each token's position.
void kv_store(const float* k, const float* v, const KvPoolArgs& pool, const StepArgs& step, Stream stream);
// Causal GQA softmax attention over the pool. q, out [T, q_heads, head_dim]; head_dim <= 512. Keys are split over
// blocks when T x q_heads is small (decode); `workspace` holds attention_workspace_bytes() bytes (null when 0).
size_t attention_workspace_bytes(int64_t T, int64_t q_heads, int64_t head_dim, const StepArgs& step);
void attention(const float* q, int64_t q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale, float* out,
               void* workspace, Stream stream);

// ---- linear layers (linear.cu)
// out[t, n] = sum_k x[t, k] W[n, k] (+ bias[n]); x [T, K] row stride ldx, out [T, N] row stride ldo. fp32 FMA.
void linear(const WeightDesc& w, const float* x, int64_t ldx, int64_t T, float* out, int64_t ldo, Stream stream);
// Several linears of one x in a single launch (the bandwidth gemv with one segment per weight): outs[i] [T, n_i]
// with row stride ldos[i]. Only for T <= 64 rows (tiles of 8), <= 4 weights of one gemv2 kind and one k; returns false
// (nothing launched) otherwise.
bool linear_multi(const WeightDesc* ws, int count, const float* x, int64_t ldx, int64_t T, float* const* outs,
                  const int64_t* ldos, Stream stream);
// out = act(x, x2) W^T with the activation applied as the bandwidth gemv reads x (no intermediate tensor): act 1 silu(x)
// * x2 (an MLP's down projection), 2 x * sigmoid(x2) (attention's output gate); x, x2 [T, K] (row strides ldx, ldx2).
// Only bf16 / nvfp4 weights the gemv streams and T <= 4; returns false (nothing launched) otherwise.
bool linear_gated_input(const WeightDesc& w, const float* x, int64_t ldx, const float* x2, int64_t ldx2, int act,
                        int64_t T, float* out, int64_t ldo, Stream stream);
constexpr int64_t kGemvMaxRows = 128;  // dense layers with at most this many rows take the gemv path (8-row tiles)
// Name of the linear path linear() picks for T tokens (for describe()).
const char* linear_path_name(int64_t T);

// ---- MoE routing, grouping, combine (moe_routing.cu)
// softmax over E (fp32), top-k (ties: lower id first), optionally renormalised. logits [T, E]; ids, weights [T, k].
void moe_route(const float* logits, int64_t T, int64_t E, int top_k, bool renormalise, int32_t* ids, float* weights,
               Stream stream);

// Routed experts: out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]), summed in ascending expert id.
// experts: device table [E][3] of {gate [I, H], up [I, H], down [H, I]}; experts_vec_ok: every one of them has
// k % 8 == 0 and 16-byte aligned data (the 8-wide load path). workspace: moe_workspace_bytes() bytes, 256-aligned.
// out[i] = ids[i] - begin when that lies in [0, count), else -1 (an expert-parallel rank holds experts
// [begin, begin + count) of the layer; moe_experts skips pairs of id -1).
void moe_local_ids(const int32_t* ids, int64_t n, int32_t begin, int32_t count, int32_t* out, Stream stream);
size_t moe_workspace_bytes(int64_t T, int top_k, int64_t E, int64_t H, int64_t I);
// experts_gemv2_kind: the bandwidth gemv every expert matrix can use (0 bf16, 1 nvfp4), or -1. tensor_cores: NVFP4
// experts on tensor cores (moe_experts.cu, x and silu(gate) * up in mma_parts bf16 parts: kMmaPartsFp32 or
// kMmaPartsBf16) where moe_mma_supported; false, or experts it does not serve: the fp32 CUDA-core kernels
// (moe_experts_fp32). shared / shared_gate (both or neither): out += shared[t] * sigmoid(shared_gate[t]) ([T, H] and
// [T] fp32).
void moe_experts(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* weights, int top_k,
                 const WeightDesc* experts, bool experts_vec_ok, int experts_gemv2_kind, int64_t E, int64_t I,
                 void* workspace, float* out, Stream stream, bool tensor_cores = true, const float* shared = nullptr,
                 const float* shared_gate = nullptr, int mma_parts = kMmaPartsFp32);

// The grouping and the combine on their own (the dequantised cuBLAS path of moe_prefill_blas.cu runs its GEMMs
// between them). moe_group_rows: the (token, slot) pairs of ids [T, top_k] sorted by expert (ids outside [0, E):
// skipped, pair_pos -1); workspace: moe_row_groups_bytes() bytes, 256-aligned; the pointers returned point into it.
struct MoeRowGroups {
  int32_t* group_offset = nullptr;  // [E + 1] first sorted row of each expert; [E]: rows in all
  int32_t* tile_offset = nullptr;   // [E + 1] (row tiles of 64 rows; the kernel writes them, nothing reads them here)
  int32_t* tile_group = nullptr;    // [tiles]
  int32_t* row_token = nullptr;     // [P] token of each sorted row
  int32_t* pair_pos = nullptr;      // [P] sorted row of each pair, -1 when skipped
};
// wide (large steps; experimental, --enable-wide-moe-grouping): count, scan and place over ceil(P / 2048) blocks
// instead of one; the same groups, rows within an expert in another order (nothing depends on it).
size_t moe_row_groups_bytes(int64_t T, int top_k, int64_t E);
MoeRowGroups moe_group_rows(const int32_t* ids, int64_t T, int top_k, int64_t E, void* workspace, Stream stream,
                            bool wide = false);
// out[t] = sum over the token's slots in ascending (expert id, slot) order of weights[t, j] * y[pair_pos[t, j]]
// (+ shared[t] * sigmoid(shared_gate[t]) when given): moe_experts' combine. y [P, H] fp32, or bf16 (moe_combine_bf16).
void moe_combine(const float* y, const int32_t* ids, const float* weights, const int32_t* pair_pos, int top_k,
                 int64_t T, int64_t H, float* out, const float* shared, const float* shared_gate, Stream stream);
void moe_combine_bf16(const uint16_t* y, const int32_t* ids, const float* weights, const int32_t* pair_pos, int top_k,
                      int64_t T, int64_t H, float* out, const float* shared, const float* shared_gate, Stream stream);

// The routed experts' gate/up and down GEMMs on the CUDA cores (linear.cu's kernels; moe_experts() calls it when the
// tensor-core kernels do not serve the experts): act [P, I] = silu(x W_gate^T) * (x W_up^T), y [P, H] = act W_down^T
// over the grouping moe_experts() built (sorted rows by expert, row tiles of tile_m rows).
struct ExpertGroups {
  const int32_t* group_offset = nullptr;  // [E + 1] first sorted row of each expert
  const int32_t* tile_offset = nullptr;   // [E + 1] first row tile of each expert
  const int32_t* tile_group = nullptr;    // [tiles] expert of each row tile
  const int32_t* row_token = nullptr;     // [P] token of each sorted row
  int tile_m = 0;                         // rows per row tile
  int64_t max_tiles = 0;                  // grid bound on row tiles
  bool gemv = false;                      // the gemv kernels (tiles of <= kGemvTileRows rows), else the gemm
};
void moe_experts_fp32(const float* x, int64_t T, int64_t H, int64_t I, const WeightDesc* experts, int64_t E,
                      bool experts_vec_ok, bool x_vec, int experts_gemv2_kind, const ExpertGroups& groups, float* act,
                      float* y, Stream stream);
constexpr int kGemvTileRows = 8;   // row tile of the gemv kernels
constexpr int kGemmTileRows = 64;  // row tile of the fp32 gemm
// Launch shapes are sized for the H200's 132 SMs (the tuned target; other GPUs get the same shapes).
constexpr int64_t kSms = 132;
constexpr int64_t kTwoBlocksPerSm = 2 * kSms;

// ---- routed experts on tensor cores (moe_experts.cu)
// True when the tensor-core expert kernels serve these experts: all NVFP4 (16-byte aligned codes), H and I
// multiples of 128.
bool moe_mma_supported(int64_t H, int64_t I, int experts_gemv2_kind);
// The grouping (moe_experts' workspace) and buffers one tensor-core expert pass uses.
// x and silu(gate) * up are split into `parts` bf16 parts (3: fp32 accuracy; 1: rounded to bf16). Row tiles of >= 16
// rows run the kernel that stages x in shared memory with 2 token sub-tiles per pass over the weights; smaller ones
// the decode-sized kernel.
struct MoeMmaPlan {
  int tile_m = 8;        // sorted rows per row tile
  int mt_up = 2, mt_down = 4;  // 16-row weight tiles per block (1, 2, 4 or 8) of the decode-sized launches
  // Blocks per SM asked of the decode-sized launches (3 or 4; 0: the register allocator's choice).
  int occ_up = 0, occ_down = 0;
  int64_t max_tiles = 0; // grid bound on row tiles
  int parts = kMmaPartsFp32;              // bf16 parts per value of x and silu(gate) * up (3 or 1)
  const int4* tile_info = nullptr;        // [max_tiles] {expert (-1: no tile), first sorted row, end row, 0}
  const int32_t* row_token = nullptr;     // [P] token of each sorted row
  uint16_t* xs = nullptr;     // [T][H/32][parts][32] the split x
  uint16_t* act_s = nullptr;  // [P][I/32][parts][32] the split silu(gate) * up
  float* y = nullptr;         // [P][H] each sorted row's expert output
};
// y[r] = down(silu(gate(x[row_token[r]])) * up(...)) for every sorted row r of every tile.
void moe_experts_mma(const float* x, int64_t T, int64_t H, int64_t I, const WeightDesc* experts, int64_t E,
                     const MoeMmaPlan& plan, Stream stream);

// A dense NVFP4 linear on tensor cores (the routed-expert kernel with the weight as its only expert; x split into
// mma_parts bf16 parts, 3 or 1): for many rows (prefill). Needs linear_nvfp4_mma_supported(w): no bias,
// K % 128 == 0, N % 64 == 0. w_dev: the WeightDesc in device memory; tiles: [n_tiles] {0, first row, end row, 0} of
// kLinearTileRows rows; xs: T * K * mma_parts bf16 values of scratch; out [T, N] contiguous.
constexpr int64_t kLinearTileRows = 64;
bool linear_nvfp4_mma_supported(const WeightDesc& w);
void linear_nvfp4_mma(const WeightDesc* w_dev, const int4* tiles, int64_t n_tiles, int64_t K, int64_t N,
                      const float* x, int64_t ldx, int64_t T, uint16_t* xs, float* out, Stream stream,
                      int mma_parts = kMmaPartsFp32);


// ---- paged attention for prefill-shaped steps (attention_prefill.cu)
// Causal GQA attention over the paged KV pool for prefill-shaped steps (flash-attention style, tensor cores; q and
// the softmax weights p enter the MMAs in mma_parts bf16 parts: 3, fp32 accuracy, or 1, rounded to bf16). Same maths
// and layouts as attention() above: q, out
// [T, q_heads, head_dim]; a query at position p sees keys 0..p of its own sequence; a row with no keys gives 0.
// attention_prefill runs only when the step's longest sequence (StepArgs::max_seq_tokens, host-known) has at least
// this many tokens: below that the split-over-keys kernels of ops::attention are the better fit.
constexpr int kAttentionPrefillMinTokens = 16;

// Launches the prefill kernel and returns true, or launches nothing and returns false when the case is not served:
// head_dim not 64, 128 or 256; pool elements not bf16 or e4m3 (f32 pools fall back); q_heads not a multiple of
// kv_heads; step.max_seq_tokens < kAttentionPrefillMinTokens; more than 65535 sequences; q / out / pool pointers not
// 16-byte aligned; or the kernel's shared memory above the device's per-block limit. No workspace.
bool attention_prefill(const float* q, int64_t q_heads, const KvPoolArgs& pool, const StepArgs& step, float scale,
                       float* out, Stream stream, int mma_parts = kMmaPartsFp32);

// ---- the gated delta rule in chunks of 64 tokens, for prefill (deltanet_chunked.cu, deltanet_chunked_split.cu)
// The gated delta rule in chunks of 64 tokens (the UT-transform form), for sequences with many tokens (prefill).
// Same inputs, outputs and state as gated_delta_rule() above, except that q and k are the
// already L2-normalised qn / kn ([T, Hk, Dk] contiguous, q also divided by sqrt(Dk)), as l2norm_qk_kernel writes
// them. g, beta [T, Hv] contiguous; v rows ldv elements apart (heads contiguous inside a row); out [T, Hv, Dv]
// contiguous; state as gated_delta_rule's (fp32 or bf16: read at the first chunk, written after the last).
// A sequence's slot must hold its running state (zeros for a fresh sequence); sequences of 0 tokens are left as
// they are. No fast-math. tf32_parts picks how the chunk's matrix products (k.k / q.k / k S / q S, P V and the
// state update; the split form's T [k | v] too) run: 0, fp32 FMA on the CUDA cores; kMmaPartsFp32 (3), tensor cores
// with every input split into 2 tf32 parts (3 mmas per product: fp32-class accuracy, as the FMA form up to
// summation order); kMmaPartsBf16 (1), tensor cores with the inputs rounded once to tf32 (relative error <= 2^-11
// per input). sm_80+ for 1 and 3. The triangular solve, gates and decays are fp32 FMA in every form. CudaOps passes
// 3 or 1 by CudaOptions::mma_parts() (CudaOptions::delta_rule_tensor_cores) or 0.
// Two forms (deltanet_chunked.cu's opening comment): `workspace` null runs the single kernel (a block per sequence,
// value head and value tile walks its chunks); non-null, gated_delta_rule_chunked_workspace_bytes(...) bytes (256-byte
// aligned), runs the split form (a parallel per-chunk preparation, then the scan over chunks) wherever
// gated_delta_rule_chunked_split_supported, the single kernel elsewhere.
size_t gated_delta_rule_chunked_workspace_bytes(int64_t T, int64_t Hv, int64_t Dk, int64_t Dv, const StepArgs& step);
void gated_delta_rule_chunked(const float* qn, const float* kn, const float* v, const float* g, const float* beta,
                              DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t ldv,
                              const StepArgs& step, float* out, void* workspace, cudaStream_t stream,
                              int tf32_parts = 0);
// True when the chunked kernel serves these head sizes on the current device: 1 <= Dk <= 128 (padded to 32, 64 or
// 128), any Dv >= 1 (tiles of 32 or 64 value columns, the last one masked), and the block's shared memory within
// the device's opt-in limit (the larger of the two forms' layouts: Dk 128: 185 KB with 32 value columns, 225 KB with
// 64; Dk <= 32: 98 KB). True on sm_90 / sm_100 (227 KB); on parts with 99 KB per block (sm_86 / sm_89 / sm_120) only
// for Dk <= 32: elsewhere the caller keeps the recurrent kernel. The same for every tf32_parts.
bool gated_delta_rule_chunked_supported(int64_t Dk, int64_t Dv);
// True when the split form serves this call: gated_delta_rule_chunked_supported, tf32_parts 1 or 3 (the split form
// runs on tensor cores only; 0 keeps the single FMA kernel), sm_80+, both split kernels' shared memory within the
// device's opt-in limit (Dk 128: 224 KB; Dk 64: 134 KB; Dk <= 32: 89 KB), and at most 65535 sequences and heads (grid
// dimensions).
bool gated_delta_rule_chunked_split_supported(int64_t Hv, int64_t Dk, int64_t Dv, const StepArgs& step,
                                              int tf32_parts);

// ---- token sampling (sampling.cu)
// Token sampling on the device (CudaOps::sample_rows): model::sample_row_host's definition (model/sampling.h:
// temperature, top-k, top-p, min-p, one draw with the row's uniform) over rows of fp32 logits, so that only the ids
// come back.
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
// A row's parameters: model::RowSampling itself (plain data, read by the kernel as the host stores it).
using SampleRowArgs = model::RowSampling;

// ids[r] = the token of row r (logits + r * ld, V values) drawn as rows[r] says. rows, ids: device arrays [R].
// V at most 2^30.
void sample_rows(const float* logits, int64_t ld, int64_t R, int64_t V, const SampleRowArgs* rows, int32_t* ids,
                 Stream stream);

// ---- tensor-parallel collectives (allreduce.cu)
constexpr int kPeerMaxRanks = 16;
constexpr int kPeerBlocks = 32;  // every launch: the per-block counters advance in step on every rank
struct PeerAllReduceArgs {
  int rank = 0, nranks = 1;
  int64_t capacity = 0;                   // floats per half of each exchange buffer
  float* exchange[kPeerMaxRanks] = {};    // rank r's exchange buffer [2][capacity] (device memory, peer-accessible)
  uint32_t* flags[kPeerMaxRanks] = {};    // rank r's notices [kPeerBlocks][kPeerMaxRanks], written by its peers
  uint32_t* counter = nullptr;            // this rank's calls per block [kPeerBlocks]
  const uint32_t* abort = nullptr;        // mapped host word: non-zero makes waiting kernels trap
  uint64_t timeout_ns = 0;                // a wait longer than this traps; 0: wait for the peers or abort
};
// data[0, n) = sum over ranks of each rank's data[0, n), in rank order (bitwise the same on every rank); every rank
// of the group launches it with the same n, in the same order of calls. n <= capacity. Its blocks wait on the GPU
// for the peers' kernels: every rank needs a GPU of its own (ranks sharing one could wait on each other behind a
// device-wide synchronisation such as cudaFree).
void peer_all_reduce(const PeerAllReduceArgs& args, float* data, int64_t n, Stream stream);
// Loads both all-reduce kernels on the current device (call on every rank's device before the first all-reduce).
void preload_all_reduce_kernels();
// out[i] = sum over r < nranks of inputs[r][i], in rank order (the host has made every input ready). No waiting on
// the GPU: the transport of ranks that share a GPU.
struct PeerInputs {
  int nranks = 0;
  const float* in[kPeerMaxRanks] = {};
};
void sum_rank_buffers(const PeerInputs& inputs, int64_t n, float* out, Stream stream);

}  // namespace kiln::cuda::ops
