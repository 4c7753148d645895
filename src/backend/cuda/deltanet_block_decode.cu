// The Gated DeltaNet mixer of a decode step of 1-4 sequences (one token each) as ONE persistent kernel: the input norm
// (with the residual step before it), the input projections, the causal conv + SiLU, the gates, the L2 norms of q and
// k, the delta rule, the gated output norm and the output projection.
//
// Why: the unfused decode path is five dependent kernels per DeltaNet layer (add_rms_norm, linear_multi of
// q/k/v/z/b/a, causal_conv1d_silu, the delta rule with its output norm, the output projection), each a few
// microseconds of its own latency around 50-70 MB of weights (docs/perf/decode-latency.md). Here they are the phases of
// one grid (persistent_grid.cuh: one block of 512 threads per multiprocessor, grid-wide barriers between phases).
//
// Phases:
//  0. every block computes x = rmsnorm(residual (+ y)) * (w + 1) into shared memory (add_rms_norm's maths);
//  A. the input projections' dense BF16 rows [qkv C; z Hv Dv; b Hv; a Hv], a warp per row over all warps, every token
//     against the row's one read, into the workspace;                                   -- grid barrier
//     (block 0 then writes residual + y back to the residual stream: every block has read it)
//  B. items (sequence t, value head h, 32 value columns) over the blocks: the block computes the conv + SiLU of the
//     head's key head's q and k channels and of its 32 v channels from the conv state (writing the new conv state of
//     its v channels, which no other item reads), the gates, the L2 norms, then the delta rule on its 32 x Dk slice of
//     the state (read, updated in fp32 registers, written back) and the 32 outputs into the workspace;
//                                                                                        -- grid barrier
//  C. the new conv state of the q and k channels (read by several items in B, so written only now); every block
//     copies the step's outputs into shared memory and applies the gated output norm w * rmsnorm(o) * silu(z) per head;
//     then the output projection's rows h of H, a warp per row, every token against the row's one read.
//
// Maths: the unfused kernels' (conv1d_silu_kernel, delta_rule_kernel with the gates and the norm, gated_rms_norm),
// fp32 throughout, the projections on fp32 x (as the decode GEMV); only the order of some fp32 sums differs (the delta
// rule's partial sums over 16 warps instead of 8 or 32, the input norm's sum of squares).
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/deltanet_block_decode.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/persistent_grid.cuh"

namespace kiln::cuda::ops {
namespace {

using namespace dev;
using namespace persistent;

constexpr int kCols = 32;     // value columns per item of phase B (a lane each)
constexpr int kKc = 4;        // conv kernel
constexpr int kMaxT = 4;
constexpr int kMaxH = 4096;
constexpr int kMaxHv = 64;
constexpr int kMaxSmem = 200 * 1024;

// Dk == Dv == D (64 or 128: the kernel's instances).
size_t smem_bytes(int64_t T, int64_t H, int64_t Hv, int64_t D) {
  return sizeof(float) * static_cast<size_t>(T * std::max<int64_t>(H, Hv * D));
}

// Element f of row t of a swizzled shared-memory matrix with rows of K floats.
__device__ __forceinline__ float& srow(float4* base, int K, int t, int f) {
  return reinterpret_cast<float*>(base + t * (K / 4) + swz(f >> 2))[f & 3];
}

// kD: Dk == Dv (64 or 128).
template <int kKC, int kT, int kD>
__global__ void __launch_bounds__(kThreads, 1) deltanet_block_decode_kernel(const DeltaNetBlockArgs a) {
  constexpr int kGroups = kD / kCols;
  constexpr int kRowsPerWarp = kD / kWarps;  // state rows per thread in phase B: row i = warp + kWarps r
  dev::pdl_enter();  // first statement: see launch.cuh
  extern __shared__ float4 smem4[];
  __shared__ float q_s[kD], k_s[kD], v_s[kCols];
  __shared__ float red_kv[kWarps][kCols], red_o[kWarps][kCols];
  __shared__ float s_inv[2], s_decay, s_beta;

  const int H = a.H, T = a.T, Hk = a.Hk, Hv = a.Hv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int QK = 2 * Hk * kD, C = QK + Hv * kD, Z = Hv * kD, K = Hv * kD;
  const int R = C + Z + 2 * Hv, R4 = (R + 3) & ~3;  // phase A rows; a token's stride in the workspace
  float* ws = static_cast<float*>(a.workspace);      // [T][R4] projections, then [T][K] the delta rule's outputs
  float* ws_core = ws + T * R4;

  // ---- 0: x = the input norm of the residual stream (+ y), into shared memory
  residual_norm_rows(a.residual, a.residual_y, T, H, a.in_norm_w, a.in_norm_elem, a.in_norm_eps,
                     a.in_norm_zero_centred, smem4);

  // ---- A: the input projections (two rows in flight per warp where the registers allow: ~6 rows per warp)
  dense_rows<kKC, kT, kKC <= 2 ? 2 : 1>(
      [&](int r) {
        if (r < C) return static_cast<const uint16_t*>(a.w_qkv) + int64_t(r) * H;
        if (r < C + Z) return static_cast<const uint16_t*>(a.w_z) + int64_t(r - C) * H;
        if (r < C + Z + Hv) return static_cast<const uint16_t*>(a.w_b) + int64_t(r - C - Z) * H;
        return static_cast<const uint16_t*>(a.w_a) + int64_t(r - C - Z - Hv) * H;
      },
      R, H, T, smem4, ws, R4, a.prefetch);
  grid_barrier(a.barrier);
  if (a.prefetch && lane == 0)  // the output projection's rows this warp reads in phase C, while phase B runs
    for (int r = blockIdx.x * kWarps + warp; r < H; r += gridDim.x * kWarps)
      ptx::prefetch_l2_bulk(static_cast<const uint16_t*>(a.w_out) + int64_t(r) * K, 2u * K);
  if (a.residual_y && blockIdx.x == 0) residual_write_back(a.residual, a.residual_y, T, H);

  // ---- B: (sequence, value head, 32 value columns) items: conv, gates, norms, the delta rule
  const int n_items = T * Hv * kGroups;
  for (int item = blockIdx.x; item < n_items; item += gridDim.x) {
    const int t = item / (Hv * kGroups), h = (item / kGroups) % Hv, cg = item % kGroups;
    const int kh = h / (Hv / Hk);
    const int slot = __ldg(a.state_slot + t);
    const int j = cg * kCols + lane;  // this thread's value column
    const int64_t S0 = (int64_t(slot) * Hv + h) * kD * kD;
    // The state slice first: its loads are in flight while the conv runs.
    float sv[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) sv[r] = load_state(a.state, S0 + int64_t(warp + kWarps * r) * kD + j);
    const float* xt = ws + t * R4;
    if (tid < 2 * kD + kCols) {  // the conv + SiLU of q (tid < kD), k (< 2 kD) and this item's v channels
      const int c = tid < kD ? kh * kD + tid : tid < 2 * kD ? Hk * kD + kh * kD + (tid - kD)
                                                            : QK + h * kD + cg * kCols + (tid - 2 * kD);
      float* st = a.conv_state + (int64_t(slot) * C + c) * (kKc - 1);
      const float win[kKc] = {__ldcg(st), __ldcg(st + 1), __ldcg(st + 2), __ldcg(xt + c)};
      float acc = 0.0f;
#pragma unroll
      for (int q = 0; q < kKc; ++q) acc += load_elem(a.conv_w, a.conv_elem, int64_t(c) * kKc + q) * win[q];
      const float o = silu(acc);
      if (tid < kD) q_s[tid] = o;
      else if (tid < 2 * kD) k_s[tid - kD] = o;
      else {
        v_s[tid - 2 * kD] = o;
        // This item alone reads these v channels: their new conv state now (the last 3 inputs).
        st[0] = win[1];
        st[1] = win[2];
        st[2] = win[3];
      }
    } else if (tid == 2 * kD + kCols) {  // the gates: delta_rule_gates_kernel's arithmetic
      float decay, beta;
      delta_gates(__ldcg(xt + C + Z + Hv + h), __ldcg(xt + C + Z + h), load_elem(a.A_log, a.A_log_elem, h),
                  load_elem(a.dt_bias, a.dt_bias_elem, h), decay, beta);
      s_decay = decay;
      s_beta = beta;
    }
    __syncthreads();
    if (warp < 2) {  // warp 0: |q|, warp 1: |k| (l2norm_qk_kernel's sums)
      const float inv = warp_inv_l2(warp == 0 ? q_s : k_s, kD);
      if (lane == 0) s_inv[warp] = inv;
    }
    __syncthreads();
    if (tid < kD) q_s[tid] = (q_s[tid] * s_inv[0]) / sqrtf(static_cast<float>(kD));
    else if (tid < 2 * kD) k_s[tid - kD] = k_s[tid - kD] * s_inv[1];
    __syncthreads();
    const float decay = s_decay, bt = s_beta;
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      sv[r] *= decay;
      part += sv[r] * k_s[warp + kWarps * r];
    }
    red_kv[warp][lane] = part;
    __syncthreads();
    float kv = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) kv += red_kv[w][lane];
    const float delta = (v_s[lane] - kv) * bt;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp + kWarps * r;
      sv[r] += k_s[i] * delta;
      o += sv[r] * q_s[i];
    }
    red_o[warp][lane] = o;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) store_state(a.state, S0 + int64_t(warp + kWarps * r) * kD + j, sv[r]);
    __syncthreads();
    if (warp == 0) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += red_o[w][lane];
      ws_core[t * K + h * kD + j] = sum;
    }
    __syncthreads();  // q_s, k_s, v_s, red_* are rewritten by the next item
  }
  grid_barrier(a.barrier);

  // ---- C: the q / k channels' new conv state; the gated output norm; the output projection
  for (int q = blockIdx.x * kThreads + tid; q < T * QK; q += gridDim.x * kThreads) {
    const int t = q / QK, c = q % QK;
    float* st = a.conv_state + (int64_t(__ldg(a.state_slot + t)) * C + c) * (kKc - 1);
    const float s1 = __ldcg(st + 1), s2 = __ldcg(st + 2), x = __ldcg(ws + t * R4 + c);
    st[0] = s1;
    st[1] = s2;
    st[2] = x;
  }
  {
    const float4* src = reinterpret_cast<const float4*>(ws_core);
    for (int k4 = tid; k4 < T * K / 4; k4 += kThreads) {
      const int t = k4 / (K / 4), r4 = k4 % (K / 4);
      smem4[t * (K / 4) + swz(r4)] = __ldcg(src + k4);
    }
  }
  __syncthreads();
  for (int row = warp; row < T * Hv; row += kWarps) {  // gated_rms_norm_kernel's arithmetic, a warp per head row
    const int t = row / Hv, h = row % Hv;
    float o[kD / 32];
    float ss = 0.0f;
#pragma unroll
    for (int m = 0; m < kD / 32; ++m) {
      o[m] = srow(smem4, K, t, h * kD + lane + 32 * m);
      ss += o[m] * o[m];
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / float(kD) + a.out_norm_eps);
#pragma unroll
    for (int m = 0; m < kD / 32; ++m) {
      const int jj = lane + 32 * m;
      const float z = __ldcg(ws + t * R4 + C + h * kD + jj);
      srow(smem4, K, t, h * kD + jj) = (load_elem(a.out_norm_w, a.out_norm_elem, jj) * (o[m] * inv)) * silu(z);
    }
  }
  __syncthreads();
  dense_rows<4, kT>([&](int r) { return static_cast<const uint16_t*>(a.w_out) + int64_t(r) * K; }, H, K, T, smem4,
                    a.out, H, a.prefetch);
}

template <int kKC, int kT, int kD>
void prepare_one(bool& ok) {
  ok = ok && allow_smem(deltanet_block_decode_kernel<kKC, kT, kD>, kMaxSmem) >= 1;
}
template <int kKC>
void prepare_kc(bool& ok) {
  prepare_one<kKC, 1, 64>(ok);
  prepare_one<kKC, kMaxT, 64>(ok);
  prepare_one<kKC, 1, 128>(ok);
  prepare_one<kKC, kMaxT, 128>(ok);
}

template <int kKC, int kD>
void launch_kd(const DeltaNetBlockArgs& a, int grid, Stream stream) {
  const size_t smem = smem_bytes(a.T, a.H, a.Hv, kD);
  if (a.T == 1)
    launch_kernel(deltanet_block_decode_kernel<kKC, 1, kD>, dim3(static_cast<unsigned>(grid)), dim3(kThreads), smem,
                  stream, a);
  else
    launch_kernel(deltanet_block_decode_kernel<kKC, kMaxT, kD>, dim3(static_cast<unsigned>(grid)), dim3(kThreads),
                  smem, stream, a);
  KILN_CUDA_CHECK_LAUNCH();
}
template <int kKC>
void launch_kc(const DeltaNetBlockArgs& a, int grid, Stream stream) {
  if (a.Dk == 64) launch_kd<kKC, 64>(a, grid, stream);
  else launch_kd<kKC, 128>(a, grid, stream);
}

}  // namespace

bool deltanet_block_decode_supported(int64_t T, int64_t H, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  return T >= 1 && T <= kMaxT && H >= 32 && H % 32 == 0 && H <= kMaxH && (Dk == 64 || Dk == 128) && Dv == Dk &&
         Hk >= 1 && Hv >= Hk && Hv % Hk == 0 && Hv <= kMaxHv &&
         smem_bytes(T, H, Hv, Dk) <= static_cast<size_t>(kMaxSmem);
}

size_t deltanet_block_decode_workspace_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
  const int64_t R = 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv;
  return sizeof(float) * static_cast<size_t>(T * ((R + 3) & ~int64_t(3)) + T * Hv * Dv);
}

bool deltanet_block_decode_prepare(int device) {
  (void)device;  // the attributes apply to the current device
  bool ok = true;
  prepare_kc<1>(ok);
  prepare_kc<2>(ok);
  prepare_kc<3>(ok);
  prepare_kc<4>(ok);
  return ok;
}

void deltanet_block_decode(const DeltaNetBlockArgs& a, int grid, Stream stream) {
  if (!deltanet_block_decode_supported(a.T, a.H, a.Hk, a.Hv, a.Dk, a.Dv) || grid < 1)
    cuda_fail("deltanet_block_decode: T {} H {} Hk {} Hv {} Dk {} Dv {} grid {} outside the kernel's shapes",
              {a.T, a.H, a.Hk, a.Hv, a.Dk, a.Dv, grid});
  switch ((a.H + 1023) / 1024) {
    case 1: launch_kc<1>(a, grid, stream); break;
    case 2: launch_kc<2>(a, grid, stream); break;
    case 3: launch_kc<3>(a, grid, stream); break;
    default: launch_kc<4>(a, grid, stream); break;
  }
}

}  // namespace kiln::cuda::ops
