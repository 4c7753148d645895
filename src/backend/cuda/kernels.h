// Host API of the CUDA kernels, by family. Plain C++ (no CUDA syntax): tests, benchmarks and the CUDA
// backend call these. All pointers are device pointers unless a comment says otherwise; bf16 data is
// passed as uint16_t bit patterns. Every launcher checks its shape preconditions (kiln::Error naming
// what is supported) and the launch itself (KILN_CUDA_CHECK). Nothing here synchronises the stream.
//
// The maths of each kernel is written out as plain C++ in reference.h; tests compare the two.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

namespace kiln::cuda {

using Stream = cudaStream_t;

// ============================================================================================
// NVFP4 W4A16 linear: out[m, n] = x[m, k] . W[n, k]^T, W dequantised as
// e2m1(code) * e4m3(scale[n, k/16]) * global_scale; bf16 activations and output, fp32 accumulate.
// ============================================================================================
struct Nvfp4Weight {
  const uint8_t* codes = nullptr;   // [n, k/2]   two E2M1 codes per byte, element 2i in the low nibble
  const uint8_t* scales = nullptr;  // [n, k/16]  F8_E4M3 block scales
  float global_scale = 1.0f;        // weight_scale_2
};

// Which kernel runs: the GEMV path (tensor-core MMA over 8-token tiles, weights streamed once per
// tile; best for m <= ~16) or the tiled GEMM path (128x128 tiles, FP4 decoded to bf16 in shared
// memory). kAuto picks by m.
enum class Nvfp4Path { kAuto, kGemv, kGemm };
const char* nvfp4_path_name(Nvfp4Path p);

// n % 16 == 0 (GEMV) / n % 128 == 0 (GEMM); k % 128 == 0.
void nvfp4_linear(const Nvfp4Weight& w, int n, int k,
                  const uint16_t* x, int64_t ldx,  // [m, k]
                  int m, uint16_t* out, int64_t ldo,  // [m, n]
                  Stream stream, Nvfp4Path path = Nvfp4Path::kAuto);

// ============================================================================================
// MoE: routing (fp32 softmax over experts, top-k, optional renormalisation), grouping of the
// (token, slot) pairs by expert, NVFP4 expert FFN down(silu(gate x) * up x) per pair, and the
// weighted combine with an optional shared expert scaled by sigmoid(shared gate).
// ============================================================================================
struct MoeRouting {
  int* topk_ids = nullptr;           // [T, k]
  float* topk_weights = nullptr;     // [T, k]
  int* group_expert = nullptr;       // [E]    expert of each non-empty group, in expert order
  int* group_offset = nullptr;       // [E+1]  first sorted pair of each group
  int* group_tile_offset = nullptr;  // [E+1]  first 128-pair GEMM tile of each group
  int* num_groups = nullptr;         // [1]
  int* sorted_token = nullptr;       // [T*k]  token of each sorted pair
  int* pair_pos = nullptr;           // [T*k]  sorted position of pair (t, slot)
  int max_tokens = 0, num_experts = 0, top_k = 0;
};
// Bytes of device memory moe_routing_carve needs.
size_t moe_routing_bytes(int max_tokens, int num_experts, int top_k);
// Lays a MoeRouting out in `mem` (moe_routing_bytes(...) bytes, 256-byte aligned).
MoeRouting moe_routing_carve(void* mem, int max_tokens, int num_experts, int top_k);

// logits[t, 0..E) (fp32, row stride ld_logits) -> topk_ids/weights and the grouping. T <= max_tokens.
void moe_route(const float* logits, int64_t ld_logits, int T, bool renormalize, const MoeRouting& r,
               Stream stream);

struct MoeExperts {
  const Nvfp4Weight* gate = nullptr;  // [E] device table: gate_proj [inter, hidden]
  const Nvfp4Weight* up = nullptr;    // [E] up_proj [inter, hidden]
  const Nvfp4Weight* down = nullptr;  // [E] down_proj [hidden, inter]
  int hidden = 0, inter = 0;
};
// For every pair p of the grouping: act[p] = silu(x[tok] Wg^T) * (x[tok] Wu^T) (bf16), then
// y[p] = act[p] Wd^T (bf16). `act` is [T*k, inter], `y` is [T*k, hidden] (sorted pair order).
void moe_expert_ffn(const MoeExperts& experts, const uint16_t* x, int64_t ldx, int T, const MoeRouting& r,
                    uint16_t* act, uint16_t* y, Stream stream, Nvfp4Path path = Nvfp4Path::kAuto);

// out[t] = sum_slot w[t, slot] * y[pair_pos[t, slot]] (+ sigmoid(shared_gate[t]) * shared[t]).
// shared / shared_gate may be null (no shared expert). Sums in fp32 in slot order: deterministic.
void moe_combine(const uint16_t* y, const MoeRouting& r, int T, int hidden,
                 const uint16_t* shared, int64_t ld_shared,          // [T, hidden] or null
                 const float* shared_gate, int64_t ld_shared_gate,   // [T] logits (pre-sigmoid) or null
                 uint16_t* out, int64_t ldo, Stream stream);

// ============================================================================================
// BF16 GEMMs through cuBLASLt: out[m, n] = alpha * x[m, k] . w[n, k]^T (+ beta * out),
// fp32 accumulate; out is bf16 or fp32. One instance per stream/thread (holds a workspace).
// ============================================================================================
class BlasLt {
 public:
  explicit BlasLt(size_t workspace_bytes = size_t(32) << 20);
  ~BlasLt();
  BlasLt(const BlasLt&) = delete;
  BlasLt& operator=(const BlasLt&) = delete;

  void gemm(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, void* out, int64_t ldo,
            bool out_f32, int m, int n, int k, Stream stream, float alpha = 1.0f, float beta = 0.0f);

 private:
  struct Plan;
  Plan* plan_for(bool out_f32, int m, int n, int k, int64_t ldx, int64_t ldw, int64_t ldo);
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<bool, int, int, int, int64_t, int64_t, int64_t>, Plan*> plans_;
};

// ============================================================================================
// Gated attention (full-attention layers), head_dim 256, paged KV cache.
// ============================================================================================
struct KvCache {
  void* k = nullptr;  // [num_pages, page_size, n_kv_heads, head_dim]  bf16 or F8_E4M3
  void* v = nullptr;  // same
  bool fp8 = false;   // F8_E4M3 with per-tensor scales (dequantised value = code * scale)
  float k_scale = 1.0f, v_scale = 1.0f;
  int page_size = 16, n_kv_heads = 0, head_dim = 256;
};

// Per token t: q = q_norm(q_proj[t, h, 0:256]) (zero-centred RMSNorm), k = k_norm(k_proj), v;
// partial RoPE (rotate_half over the first `rotary_dim` dims, inv_freq = theta^(-2i/rotary_dim));
// q goes to q_out, k and v to the cache at row kv_slot[t] (= page * page_size + offset).
void attention_prep(const uint16_t* q_proj, int64_t ld_q,  // [T, n_heads * 2 * 256]: per head q | gate
                    const uint16_t* k_proj, int64_t ld_k,  // [T, n_kv_heads * 256]
                    const uint16_t* v_proj, int64_t ld_v,  // [T, n_kv_heads * 256]
                    const uint16_t* q_norm_w, const uint16_t* k_norm_w,  // [256] each
                    const int32_t* positions,  // [T]
                    const int64_t* kv_slot,    // [T]
                    int T, int n_heads, float rope_theta, int rotary_dim, float eps, const KvCache& cache,
                    uint16_t* q_out,  // [T, n_heads, 256]
                    Stream stream);

// The sequences of one attention launch (device arrays) plus host-known bounds for sizing grids.
struct AttnBatch {
  const int32_t* q_start = nullptr;     // [S+1] query token offsets (rows of q / out)
  const int32_t* pos0 = nullptr;        // [S]   position of each sequence's first query token
  const int32_t* page_table = nullptr;  // [S, page_table_stride]
  int page_table_stride = 0;
  int num_seqs = 0;
  int max_q_len = 0;   // max over sequences of q_start[s+1] - q_start[s]
  int max_kv_len = 0;  // max over sequences of pos0[s] + q_len(s)
};

// Causal GQA softmax attention over the cache (keys 0..pos inclusive for the query at pos),
// scale 1/sqrt(256), then out = attn * sigmoid(gate). q_len 1 uses split-KV flash decoding.
// `workspace` must hold attention_workspace_bytes(...) bytes (may be null when that is 0).
size_t attention_workspace_bytes(const AttnBatch& b, int n_heads, const KvCache& cache);
void attention(const uint16_t* q,  // [T, n_heads, 256]
               const uint16_t* gate, int64_t gate_token_stride, int64_t gate_head_stride,
               const AttnBatch& batch, int n_heads, const KvCache& cache,
               uint16_t* out,  // [T, n_heads * 256]
               void* workspace, Stream stream);

// ============================================================================================
// Gated DeltaNet (linear-attention layers).
// ============================================================================================
struct GdnSeqs {
  const int32_t* seq_start = nullptr;  // [S+1] token offsets
  const int32_t* slot = nullptr;       // [S]   state slot of each sequence
  const int32_t* reset = nullptr;      // [S]   1: fresh sequence, start from zero state
  int num_seqs = 0;
};

// out[t, c] = silu(sum_j w[c, j] * in[t - 3 + j, c]) per sequence, with in[<0] from the conv state
// (the last 3 inputs, [slots, 3, C] bf16, updated). w is conv1d.weight [C, 1, 4] as [C, 4].
void gdn_conv1d(const uint16_t* x, int64_t ldx,  // [T, C]
                const uint16_t* w,               // [C, 4]
                uint16_t* conv_state,            // [slots, 3, C]
                const GdnSeqs& seqs, int C, uint16_t* out,  // [T, C]
                Stream stream);

struct GdnShape {
  int n_k_heads = 16, n_v_heads = 32, k_dim = 128, v_dim = 128;
};
// The gated delta rule per value head (REFERENCE §1 steps 3-6): qkv = conv output [T, 2*nk*dk + nv*dv]
// (q | k | v), z [T, nv*dv], a and b [T, nv]; state [slots, nv, dv, dk] fp32 (S transposed: one
// value column's 128 keys contiguous); out = norm_w * rmsnorm(o) * silu(z) per head, bf16.
void gdn_recurrent(const uint16_t* qkv, int64_t ld_qkv, const uint16_t* z, int64_t ld_z,
                   const uint16_t* a, int64_t ld_a, const uint16_t* b, int64_t ld_b,
                   const float* A_log, const float* dt_bias,  // [nv]
                   const float* norm_w, float eps,           // [dv]
                   float* state, const GdnSeqs& seqs, const GdnShape& shape,
                   uint16_t* out,  // [T, nv * dv]
                   Stream stream);

// ============================================================================================
// Norms, residuals, embedding, activation, sampling.
// ============================================================================================
// out = x * rsqrt(mean(x^2) + eps) * (zero_centred ? 1 + w : w), fp32 maths, bf16 out.
void rmsnorm(const uint16_t* x, int64_t ldx, const uint16_t* w, int T, int H, float eps, bool zero_centred,
             uint16_t* out, int64_t ldo, Stream stream);
// residual = bf16(residual + delta); out = rmsnorm(residual). H % 8 == 0.
void add_rmsnorm(uint16_t* residual, const uint16_t* delta, const uint16_t* w, int T, int H, float eps,
                 bool zero_centred, uint16_t* out, Stream stream);
// out[t] = table[ids[t]]; ids outside [0, V) give a zero row.
void embedding(const uint16_t* table, const int32_t* ids, int T, int H, int64_t V, uint16_t* out,
               Stream stream);
// out[t, i] = silu(gu[t, i]) * gu[t, I + i].
void silu_mul(const uint16_t* gu, int64_t ld_gu, int T, int I, uint16_t* out, int64_t ldo, Stream stream);

// Pseudo-random device fills (a hash of index and seed; for benchmarks and synthetic weights).
void fill_random_u8(uint8_t* p, size_t n, uint32_t seed, uint8_t lo, uint8_t hi, Stream stream);  // [lo, hi]
void fill_random_bf16(uint16_t* p, size_t n, uint32_t seed, float scale, Stream stream);         // [-scale, scale)
void fill_random_f32(float* p, size_t n, uint32_t seed, float lo, float hi, Stream stream);       // [lo, hi)

}  // namespace kiln::cuda
