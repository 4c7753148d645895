// Gated DeltaNet on the device, token by token: the causal depthwise conv + SiLU (a thread per channel and chunk of
// a sequence's tokens), the gates g / beta, and the gated delta rule's recurrence (a block per (sequence, value head,
// 32 value columns) holding its slice of the state in registers). The chunked form for prefill: deltanet_chunked.cu.
// The recurrent state is stored in fp32 or bf16 (DeltaStateRef); either way it is updated in fp32 registers and a
// bf16 state is rounded once, to nearest even, when the block writes it back.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;

constexpr int kBlock = 256;


// ---- Gated DeltaNet: causal conv (a thread per channel and chunk of a sequence's tokens) and gates

// grid (C / 128, S, token chunks of kConvChunk): a thread per (channel, chunk of one sequence), so that a long prefill
// runs in parallel over its tokens. Position checkpoints (step.token_checkpoint_slot) go to slots no sequence of the
// step reads. The window before a chunk's first token comes from x (earlier tokens of the
// sequence) or from conv_state (inputs before the sequence). Only chunk 0 touches conv_state: it reads the old
// state, then writes the new one (the sequence's last KC - 1 inputs), so no block reads a state another rewrites.
constexpr int kConvChunk = 64;

template <int KC>
__global__ void conv1d_silu_kernel(const float* __restrict__ x, int64_t C, const void* w, ElemType w_elem,
                                   float* __restrict__ conv_state, StepArgs step, float* __restrict__ out) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int s = blockIdx.y, chunk = blockIdx.z;
  if (c >= C || s >= step.num_seqs) return;
  const int b = step.seq_token_begin[s], e = step.seq_token_begin[s + 1];
  const int t0 = b + chunk * kConvChunk, t1 = min(e, t0 + kConvChunk);
  if (chunk > 0 && t0 >= e) return;
  float wk[KC];
#pragma unroll
  for (int j = 0; j < KC; ++j) wk[j] = load_elem(w, w_elem, c * KC + j);
  float* state = conv_state + (int64_t(step.seq_state_slot[s]) * C + c) * (KC - 1);
  // Input at position tp of the sequence's timeline: x for tp >= b, else the state (positions b - (KC-1) .. b-1).
  auto input = [&](int tp) { return tp >= b ? x[int64_t(tp) * C + c] : state[tp - b + KC - 1]; };
  float win[KC];  // win[0 .. KC-2]: the previous inputs, oldest first; win[KC-1]: the current one
#pragma unroll
  for (int j = 0; j < KC - 1; ++j) win[j] = input(t0 - (KC - 1) + j);
  for (int t = t0; t < t1; ++t) {
    win[KC - 1] = x[int64_t(t) * C + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < KC; ++j) acc += wk[j] * win[j];
    out[int64_t(t) * C + c] = silu(acc);
#pragma unroll
    for (int j = 0; j < KC - 1; ++j) win[j] = win[j + 1];
    // A position checkpoint: the state as it stands after token t (its last KC - 1 inputs) into another slot.
    const int cs = step.token_checkpoint_slot ? step.token_checkpoint_slot[t] : -1;
    if (cs >= 0) {
      float* dst = conv_state + (int64_t(cs) * C + c) * (KC - 1);
#pragma unroll
      for (int j = 0; j < KC - 1; ++j) dst[j] = win[j];
    }
  }
  if (chunk == 0) {
    float next[KC - 1];
#pragma unroll
    for (int j = 0; j < KC - 1; ++j) next[j] = input(e - (KC - 1) + j);
#pragma unroll
    for (int j = 0; j < KC - 1; ++j) state[j] = next[j];
  }
}

__global__ void delta_rule_gates_kernel(const float* a, const float* b, const void* A_log, ElemType A_log_elem,
                                        const void* dt_bias, ElemType dt_bias_elem, int64_t T, int64_t Hv, float* g,
                                        float* beta) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t total = T * Hv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = i % Hv;
    const float neg_a = -expf(load_elem(A_log, A_log_elem, h));
    const float xv = a[i] + load_elem(dt_bias, dt_bias_elem, h);
    const float softplus = xv > 20.0f ? xv : log1pf(expf(xv));  // torch softplus(beta=1, threshold=20)
    g[i] = neg_a * softplus;
    beta[i] = 1.0f / (1.0f + expf(-b[i]));
  }
}

// ---- gated delta rule

// q, k [T, Hk, Dk] -> L2-normalised (x * rsqrt(sum x^2 + 1e-6)), q also / sqrt(Dk). A warp per vector.
// q, k rows may be strided (ldq / ldk elements per token; heads contiguous inside a row).
__global__ void l2norm_qk_kernel(const float* __restrict__ q, const float* __restrict__ k, int64_t vectors, int64_t Dk,
                                 int64_t Hk, int64_t ldq, int64_t ldk, float* __restrict__ qn,
                                 float* __restrict__ kn) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t vec = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (vec >= 2 * vectors) return;
  const bool is_q = vec < vectors;
  const int64_t v_index = is_q ? vec : vec - vectors, t = v_index / Hk, head = v_index % Hk;
  const float* src = (is_q ? q + t * ldq : k + t * ldk) + head * Dk;
  float* dst = (is_q ? qn : kn) + (is_q ? vec : vec - vectors) * Dk;
  const float inv = warp_inv_l2(src, Dk);
  const float q_scale = sqrtf(static_cast<float>(Dk));
  for (int64_t i = lane; i < Dk; i += 32) dst[i] = is_q ? (src[i] * inv) / q_scale : src[i] * inv;
}

constexpr int kDeltaWarps = 8;        // key rows are spread over the warps: row i lives in warp i % 8
constexpr int kDeltaRowsPerThread = 32;  // Dk <= 8 * 32 = 256

// grid (S, Hv, ceil(Dv / 32)), block 8 warps. Lane l of every warp owns value column j = 32 * blockIdx.z + l; warp
// w holds S[i][j] for i = w, w + 8, ... in registers. Per token: S *= exp(g); kv = sum_i S[i][j] k[i] (partial sums
// per warp, added in warp order); delta = (v[j] - kv) * beta; S[i][j] += k[i] delta; out[j] = sum_i S[i][j] q[i].
// q and k arrive raw (rows ldq / ldk apart) and are L2-normalised here, per token, exactly as l2norm_qk_kernel does
// (lane-strided sums, a warp sum, (x * inv) / sqrt(Dk) for q): one launch fewer per layer and step.
// kRaw: g and beta computed here from the raw gate inputs (`gates`), with delta_rule_gates_kernel's arithmetic, instead
// of read from g / beta.
// kRows: state rows per thread (Dk <= 8 kRows): 16 for the usual Dk = 128 holds half the registers of 32, which lets
// 4 blocks share an SM instead of 2 (the step is a stream of state: more blocks keep more of it in flight).
// kCG: groups of 32 value columns per block (8 kCG warps; warp w holds the rows of column group w / 8 that warp w % 8
// holds above); grid.z = ceil(Dv / (32 kCG)). kNorm (32 kCG >= Dv: one block holds a head's whole output row): after
// each token the block also writes norm.out = w * rmsnorm(o) * silu(z) for its head, with gated_rms_norm_kernel's
// arithmetic (warp_row_inv_rms over the row, then the same products): one launch fewer per DeltaNet layer and step.
template <bool kRaw, int kRows, int kCG = 1, bool kNorm = false>
__global__ void __launch_bounds__(kDeltaWarps * 32 * kCG, kRows <= 16 ? 4 / kCG : 0)
    delta_rule_kernel(const float* __restrict__ q, const float* __restrict__ k, int64_t ldq, int64_t ldk,
                      const float* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta,
                      DeltaGateArgs gates, DeltaStateRef state, int Hk, int Hv, int Dk, int Dv, StepArgs step,
                      int64_t ldv, float* __restrict__ out, DeltaNormArgs norm) {
  dev::pdl_enter();  // first statement: see launch.cuh
  __shared__ float q_s[kDeltaWarps * kRows];
  __shared__ float k_s[kDeltaWarps * kRows];
  __shared__ float red_kv[kDeltaWarps][32 * kCG];
  __shared__ float red_o[kDeltaWarps][32 * kCG];
  __shared__ float inv_norm[2];
  __shared__ float o_s[kNorm ? 32 * kCG : 1];  // kNorm: the head's output row for this token
  __shared__ float inv_out;                     // kNorm: its 1 / rms
  const int s = blockIdx.x, h = blockIdx.y;
  const int warp = (threadIdx.x >> 5) % kDeltaWarps, cg = (threadIdx.x >> 5) / kDeltaWarps, lane = threadIdx.x & 31;
  const int col = cg * 32 + lane;  // this thread's column among the block's 32 kCG
  const int j = blockIdx.z * 32 * kCG + col;
  const bool col_ok = j < Dv;
  const int kh = h / (Hv / Hk);
  const int64_t S0 = (int64_t(step.seq_state_slot[s]) * Hv + h) * Dk * Dv;  // this head's state, in elements

  float sv[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = warp + kDeltaWarps * r;
    sv[r] = (col_ok && i < Dk) ? load_state(state, S0 + int64_t(i) * Dv + j) : 0.0f;
  }
  const int b = step.seq_token_begin[s], e = step.seq_token_begin[s + 1];
  for (int t = b; t < e; ++t) {
    for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
      q_s[i] = q[int64_t(t) * ldq + int64_t(kh) * Dk + i];
      k_s[i] = k[int64_t(t) * ldk + int64_t(kh) * Dk + i];
    }
    __syncthreads();
    if (cg == 0 && warp < 2) {  // warp 0: |q|, warp 1: |k|
      const float inv = warp_inv_l2(warp == 0 ? q_s : k_s, Dk);
      if (lane == 0) inv_norm[warp] = inv;
    }
    __syncthreads();
    {
      const float q_scale = sqrtf(static_cast<float>(Dk));
      for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
        q_s[i] = (q_s[i] * inv_norm[0]) / q_scale;
        k_s[i] = k_s[i] * inv_norm[1];
      }
    }
    __syncthreads();
    float decay, bt;
    if constexpr (kRaw) {  // delta_rule_gates_kernel's arithmetic
      const int64_t th = int64_t(t) * Hv + h;
      const float a_in = gates.a[th], b_in = gates.b[th];
      delta_gates(a_in, b_in, load_elem(gates.A_log, gates.A_log_elem, h),
                  load_elem(gates.dt_bias, gates.dt_bias_elem, h), decay, bt);
    } else {
      decay = expf(g[int64_t(t) * Hv + h]);
      bt = beta[int64_t(t) * Hv + h];
    }
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = warp + kDeltaWarps * r;
      if (i < Dk) {
        sv[r] *= decay;
        part += sv[r] * k_s[i];
      }
    }
    red_kv[warp][col] = part;
    __syncthreads();
    float kv = 0.0f;
#pragma unroll
    for (int w = 0; w < kDeltaWarps; ++w) kv += red_kv[w][col];
    const float vj = col_ok ? v[int64_t(t) * ldv + int64_t(h) * Dv + j] : 0.0f;
    const float delta = (vj - kv) * bt;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = warp + kDeltaWarps * r;
      if (i < Dk) {
        sv[r] += k_s[i] * delta;
        o += sv[r] * q_s[i];
      }
    }
    red_o[warp][col] = o;
    __syncthreads();
    float sum = 0.0f;
    if (warp == 0 && col_ok) {
#pragma unroll
      for (int w = 0; w < kDeltaWarps; ++w) sum += red_o[w][col];
      out[(int64_t(t) * Hv + h) * Dv + j] = sum;
    }
    if constexpr (kNorm) {
      if (warp == 0) o_s[col] = sum;
      __syncthreads();
      if (threadIdx.x < 32) {
        const float inv = warp_row_inv_rms(o_s, Dv, norm.eps);
        if (lane == 0) inv_out = inv;
      }
      __syncthreads();
      if (warp == 0 && col_ok) {
        const int64_t at = (int64_t(t) * Hv + h) * Dv + j;
        norm.out[at] = (load_elem(norm.w, norm.w_elem, j) * (sum * inv_out)) * silu(norm.z[at]);
      }
    }
    // A position checkpoint: the state as it stands after token t into another slot (same rounding as the final
    // write-back).
    const int cs = step.token_checkpoint_slot ? step.token_checkpoint_slot[t] : -1;
    if (cs >= 0) {
      const int64_t C0 = (int64_t(cs) * Hv + h) * Dk * Dv;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = warp + kDeltaWarps * r;
        if (col_ok && i < Dk) store_state(state, C0 + int64_t(i) * Dv + j, sv[r]);
      }
    }
    // The next token's q_s / k_s / red_kv writes come after this token's reads: every thread has passed the
    // red_o barrier (all q_s / k_s reads done); red_kv is next written after the next barrier. kNorm: o_s and
    // inv_out are next written after the next token's first barriers, past this token's reads.
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = warp + kDeltaWarps * r;
    if (col_ok && i < Dk) store_state(state, S0 + int64_t(i) * Dv + j, sv[r]);
  }
}

}  // namespace

void causal_conv1d_silu(const float* x, int64_t C, const void* w, ElemType w_elem, int Kc, float* conv_state,
                        const StepArgs& step, float* out, Stream stream) {
  if (step.num_seqs == 0 || C == 0) return;
  const int chunks = std::max(1, (step.max_seq_tokens + kConvChunk - 1) / kConvChunk);
  const dim3 grid(grid_for(C, 128), static_cast<unsigned>(step.num_seqs), static_cast<unsigned>(chunks));
  switch (Kc) {
    case 2: launch_kernel(conv1d_silu_kernel<2>, grid, 128, 0, stream, x, C, w, w_elem, conv_state, step, out); break;
    case 3: launch_kernel(conv1d_silu_kernel<3>, grid, 128, 0, stream, x, C, w, w_elem, conv_state, step, out); break;
    case 4: launch_kernel(conv1d_silu_kernel<4>, grid, 128, 0, stream, x, C, w, w_elem, conv_state, step, out); break;
    case 5: launch_kernel(conv1d_silu_kernel<5>, grid, 128, 0, stream, x, C, w, w_elem, conv_state, step, out); break;
    case 6: launch_kernel(conv1d_silu_kernel<6>, grid, 128, 0, stream, x, C, w, w_elem, conv_state, step, out); break;
    case 7: launch_kernel(conv1d_silu_kernel<7>, grid, 128, 0, stream, x, C, w, w_elem, conv_state, step, out); break;
    case 8: launch_kernel(conv1d_silu_kernel<8>, grid, 128, 0, stream, x, C, w, w_elem, conv_state, step, out); break;
    default: cuda_fail("causal conv1d: kernel size {} is not supported (2 to 8)", {Kc});
  }
  KILN_CUDA_CHECK_LAUNCH();
}

void delta_rule_gates(const float* a, const float* b, const void* A_log, ElemType A_log_elem, const void* dt_bias,
                      ElemType dt_bias_elem, int64_t T, int64_t Hv, float* g, float* beta, Stream stream) {
  if (T * Hv == 0) return;
  launch_kernel(delta_rule_gates_kernel, capped_grid(T * Hv), kBlock, 0, stream, a, b, A_log, A_log_elem, dt_bias, dt_bias_elem,
                                                                      T, Hv, g, beta);
  KILN_CUDA_CHECK_LAUNCH();
}

void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta,
                      DeltaStateRef state, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t ldq, int64_t ldk,
                      int64_t ldv, const StepArgs& step, float* out, float* qk_work, Stream stream, bool chunked,
                      const DeltaGateArgs* gates, const DeltaNormArgs* norm, int chunked_tf32_parts,
                      void* chunked_workspace) {
  if (step.num_tokens == 0 || step.num_seqs == 0) return;
  if (Dk > kDeltaWarps * kDeltaRowsPerThread)
    cuda_fail("gated delta rule: key head dim {} is not supported (at most {})", {Dk, kDeltaWarps * kDeltaRowsPerThread});
  if (chunked && gated_delta_rule_chunked_supported(Dk, Dv)) {
    if (gates) cuda_fail("gated delta rule: the chunked form reads computed gates");
    if (norm) cuda_fail("gated delta rule: the chunked form has no fused output norm");
    // The chunked kernel reads normalised q / k rows.
    const int64_t vectors = int64_t(step.num_tokens) * Hk;
    float* qn = qk_work;
    float* kn = qk_work + vectors * Dk;
    launch_kernel(l2norm_qk_kernel, grid_for(2 * vectors, 8), 256, 0, stream, q, k, vectors, Dk, Hk, ldq, ldk, qn, kn);
    KILN_CUDA_CHECK_LAUNCH();
    gated_delta_rule_chunked(qn, kn, v, g, beta, state, Hk, Hv, Dk, Dv, ldv, step, out, chunked_workspace, stream,
                             chunked_tf32_parts);
    return;
  }
  const DeltaGateArgs raw = gates ? *gates : DeltaGateArgs{};
  const int hk = static_cast<int>(Hk), hv = static_cast<int>(Hv), dk = static_cast<int>(Dk), dv = static_cast<int>(Dv);
  if (norm) {  // one block of 32 warps per (sequence, head): 4 column groups of 32
    if (!delta_rule_norm_supported(Dk, Dv))
      cuda_fail("gated delta rule with the output norm: Dk {} Dv {} (at most {} each)", {Dk, Dv, kDeltaNormMaxDim});
    constexpr int kCG = kDeltaNormMaxDim / 32;
    static_assert(kDeltaWarps * (kDeltaRowsPerThread / 2) >= kDeltaNormMaxDim, "Dk rows per block");
    const dim3 grid(static_cast<unsigned>(step.num_seqs), static_cast<unsigned>(Hv), 1);
    auto kernel = gates ? delta_rule_kernel<true, kDeltaRowsPerThread / 2, kCG, true>
                        : delta_rule_kernel<false, kDeltaRowsPerThread / 2, kCG, true>;
    launch_kernel(kernel, grid, kDeltaWarps * 32 * kCG, 0, stream, q, k, ldq, ldk, v, g, beta, raw, state, hk, hv, dk,
                  dv, step, ldv, out, *norm);
    KILN_CUDA_CHECK_LAUNCH();
    return;
  }
  const dim3 grid(static_cast<unsigned>(step.num_seqs), static_cast<unsigned>(Hv), grid_for(Dv, 32));
  auto run = [&](auto kernel) {
    launch_kernel(kernel, grid, kDeltaWarps * 32, 0, stream, q, k, ldq, ldk, v, g, beta, raw, state, hk, hv, dk, dv,
                  step, ldv, out, DeltaNormArgs{});
  };
  // 16 state rows per thread up to Dk 128, 32 above.
  const bool narrow = Dk <= kDeltaWarps * kDeltaRowsPerThread / 2;
  if (gates) narrow ? run(delta_rule_kernel<true, kDeltaRowsPerThread / 2>) : run(delta_rule_kernel<true, kDeltaRowsPerThread>);
  else narrow ? run(delta_rule_kernel<false, kDeltaRowsPerThread / 2>) : run(delta_rule_kernel<false, kDeltaRowsPerThread>);
  KILN_CUDA_CHECK_LAUNCH();
}

}  // namespace kiln::cuda::ops