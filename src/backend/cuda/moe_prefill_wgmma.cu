// The NVFP4 routed experts of prefill-sized steps on Hopper's warpgroup MMA (moe_prefill_wgmma.h).
//
// Block: 256 threads, two warpgroups. out^T[features, rows] = W[features, k] . x^T[k, rows]: the MMA's M is 64 weight
// rows per warpgroup, its N the row tile (kNT = 64 or 128 tokens; 256 pinned by --moe-wgmma-tile-rows 256,
// experimental), K walked 128 at a time.
// - Pipeline: per 128-k block a shared-memory stage holds the tile's activation rows (bf16, stored in the permuted k
//   order of moe_wgmma_layout.h, 128-byte swizzled: read by the MMAs through shared-memory descriptors) and the
//   block's 128 weight rows' NVFP4 codes and block scales, copied by cp.async; 4 stages for 64-row tiles (two blocks
//   per multiprocessor), 5 for 128 (one); the copies run stages - 1 blocks ahead, so tens of KiB of weights are in
//   flight per multiprocessor. Every thread copies, and a block barrier per k block makes each stage visible.
// - Producer form (kProducer, --enable-wgmma-producer, experimental): one more warp does all the copying and signals
//   each stage's mbarrier as its copies land; each warpgroup waits on it and releases the stage through a second
//   mbarrier when its MMAs are done, so the warpgroups never meet at a barrier in the loop (6 stages for 64-row tiles,
//   5 for 128; one block per multiprocessor).
// - A (weights): each lane reads 16 bytes of codes of its two rows (g, g + 8) from the stage and decodes them to the
//   bf16 A fragments of the block's 8 k-steps (e2m1 * e4m3 block scale * 2^-8, exact; moe_experts.cu's decoding).
//   The fragments of two blocks alternate: block s + 1 is decoded while block s's MMAs run, then the warpgroup waits
//   for them (a wait with nothing else in flight: ptxas keeps the MMAs asynchronous only so).
// - Epilogue: gate/up (warpgroup 0 the gate rows, 1 the up rows of the same 64 features) meets in shared memory,
//   silu(gate) * up is rounded to bf16 and written as 128-byte rows at the features' logical positions; down writes
//   128 features of each row as bf16.
// - Experimental forms, flags for A/B timing, built without a GPU at hand: the narrow-tile form (kNarrow: MMAs as wide
//   as the tile's rows rounded up to 32, with_mma_cols) and the down GEMM walking several feature blocks with the
//   tile's activations resident (moe_wgmma_down_walk_kernel). All forms should give the default's bits (the tests
//   check it).
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe_prefill_wgmma.h"
#include "backend/cuda/moe_wgmma_layout.h"
#include "backend/cuda/ptx.cuh"
#include "backend/cuda/wgmma.cuh"


namespace kiln::cuda::ops {
namespace {

namespace wl = wgmma_layout;

constexpr int kThreads = 256;  // two warpgroups

struct WgArgs {
  const WeightDesc* table = nullptr;  // [E][3] {gate, up, down}
  const int4* tiles = nullptr;        // [max tiles] {expert (-1: none), first sorted row, end row, 0}
  const uint16_t* xs = nullptr;       // [rows][K] bf16, each 128-k block in logical order
  const int32_t* row_index = nullptr; // row of xs of each sorted row (null: the sorted row itself)
  uint16_t* out = nullptr;            // gate/up: [rows][N] silu(gate) * up in logical order; down: [rows][N]
  int K = 0, N = 0;                   // in features; out features (I for gate/up, H for down)
};

// A pipeline stage: the tile's activations (nt rows x 128 k, bf16), the block's 128 weight rows' codes (64 bytes
// each) and block scales (8 bytes each) of one 128-k block; 1024-byte multiples (the swizzle atom).
constexpr size_t stage_bytes(int nt) { return size_t(nt) * 256 + 128 * 64 + 128 * 8; }
// Stages in shared memory (copies run stages - 1 ahead of the MMAs, stages - 2 ahead of the decoding): 4 x 25 KiB for
// 64-row tiles (two blocks per multiprocessor: one block's MMAs run while the other waits at its barrier or decodes),
// 5 x 41 KiB for 128 (one block).
// The producer form (one more warp streams the stages; mbarriers instead of block barriers) runs one block per
// multiprocessor: 6 stages for 64-row tiles. 256-row tiles (--moe-wgmma-tile-rows 256, experimental: each decoded
// weight serves twice the rows) fit 3 x 73 KiB; no producer form.
constexpr int stages(int nt, bool producer) { return nt == 64 ? (producer ? 6 : 4) : nt == 128 ? 5 : 3; }
constexpr int blocks_per_sm(int nt, bool producer) { return nt == 64 && !producer ? 2 : 1; }
constexpr int block_threads(bool producer) { return producer ? kThreads + 32 : kThreads; }
constexpr size_t smem_bytes(int nt, bool producer) {
  return stages(nt, producer) * stage_bytes(nt) + 1024;  // + alignment slack
}
static_assert(stage_bytes(64) % 1024 == 0 && stage_bytes(128) % 1024 == 0);
static_assert(smem_bytes(128, true) <= 227 * 1024 && smem_bytes(64, true) <= 227 * 1024);
static_assert(2 * (smem_bytes(64, false) + 1024) <= 228 * 1024);
static_assert(stage_bytes(256) % 1024 == 0 && smem_bytes(256, false) + 256 * 8 <= 227 * 1024);

#ifdef KILN_HAVE_WGMMA
using namespace wgmma;

// The 8 k-steps of one 128-k block whose activations start at shared-memory address `base`, over the tile's first
// kCols columns (kNT: all of them; the narrow-tile form takes fewer, see with_mma_cols).
template <int kNT, int kCols>
__device__ __forceinline__ void mma_kblock(float (&acc)[kNT / 2], const uint32_t (&A)[8][4], uint32_t base) {
  static_assert(kCols <= kNT);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const uint64_t desc = smem_desc(base + wl::kstep_offset(kk, kNT));
    if constexpr (kCols == 32) wgmma_m64n32k16(acc, A[kk], desc);
    else if constexpr (kCols == 64) wgmma_m64n64k16(acc, A[kk], desc);
    else if constexpr (kCols == 96) wgmma_m64n96k16(acc, A[kk], desc);
    else if constexpr (kCols == 128) wgmma_m64n128k16(acc, A[kk], desc);
    else if constexpr (kCols == 192) wgmma_m64n192k16(acc, A[kk], desc);
    else wgmma_m64n256k16(acc, A[kk], desc);
  }
}
// Runs body(std::integral_constant<int, kCols>) with the MMA width of the tile: kNT, or with kNarrow (the narrow-tile
// form, --enable-wgmma-narrow-tiles) the tile's rows rounded up to 32 (64-row tiles: 32 or 64; 128: up to 96 / 128;
// 256: up to 192 / 256). The columns left out keep their zero accumulators, and the epilogues never store them (rows
// past the tile's end). The choice is made once per block around the whole main loop: with the width chosen per k
// block inside it, ptxas fences the accumulators at every merge (info C7519).
template <int kNT, bool kNarrow, typename Body>
__device__ __forceinline__ void with_mma_cols(int rows, Body&& body) {
  using std::integral_constant;
  if constexpr (!kNarrow) {
    body(integral_constant<int, kNT>{});
  } else if (rows <= 32) {
    body(integral_constant<int, 32>{});
  } else if constexpr (kNT == 64) {
    body(integral_constant<int, 64>{});
  } else if (rows <= 64) {
    body(integral_constant<int, 64>{});
  } else if (rows <= 96) {
    body(integral_constant<int, 96>{});
  } else if constexpr (kNT == 128) {
    body(integral_constant<int, 128>{});
  } else if (rows <= 128) {
    body(integral_constant<int, 128>{});
  } else if (rows <= 192) {
    body(integral_constant<int, 192>{});
  } else {
    body(integral_constant<int, 256>{});
  }
}

// Keeps registers live (and in place) up to this point: a wgmma in flight still reads them, which the compiler does
// not see.
template <int kN>
__device__ __forceinline__ void hold(uint32_t (&r)[8][kN]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}
template <int kN>
__device__ __forceinline__ void hold(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// The A fragments of the 8 k-steps of one 128-k block from a lane's codes (rows g, g + 8) and block-scale bytes:
// k-step 2j + h is half h of word j (dev::decode_fragment).
__device__ __forceinline__ void decode_block(const uint4 (&wv)[2], const uint32_t (&sc)[2], uint32_t (&A)[8][4]) {
  // The 4 block scales of the lane's two rows (two 16-code blocks each), converted once.
  const uint32_t s[2][2] = {{dev::nvfp4_scale_bf16x2(sc[0] & 0xffu), dev::nvfp4_scale_bf16x2((sc[0] >> 8) & 0xffu)},
                            {dev::nvfp4_scale_bf16x2(sc[1] & 0xffu), dev::nvfp4_scale_bf16x2((sc[1] >> 8) & 0xffu)}};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t s0 = s[0][j >> 1], s1 = s[1][j >> 1];
    const uint32_t w0 = dev::word_of(wv[0], j), w1 = dev::word_of(wv[1], j);
    dev::decode_fragment<0>(w0, w1, s0, s1, A[2 * j]);
    dev::decode_fragment<1>(w0, w1, s0, s1, A[2 * j + 1]);
  }
}
// The A fragments of one 128-k block from a weight stage in shared memory (128 rows' codes, 64 bytes each, then
// their block scales, 8 bytes each): this lane's 16 bytes of rows `row` and row + 8 and their 2 scale bytes.
__device__ __forceinline__ void decode_stage_rows(const uint8_t* w, int row, int q, uint32_t (&A)[8][4]) {
  const uint8_t* codes = w + row * 64 + 16 * q;
  const uint8_t* scales = w + 128 * 64 + row * 8 + 2 * q;
  const uint4 wv[2] = {*reinterpret_cast<const uint4*>(codes), *reinterpret_cast<const uint4*>(codes + 8 * 64)};
  const uint32_t sc[2] = {*reinterpret_cast<const uint16_t*>(scales), *reinterpret_cast<const uint16_t*>(scales + 64)};
  decode_block(wv, sc, A);
}
#endif  // KILN_HAVE_WGMMA

// One row tile x one feature block (moe_prefill_wgmma.h). kGateUp: features are 64 logical positions of I, warpgroup
// 0 the gate rows, 1 the up rows; else 128 output features, 64 per warpgroup.
template <int kNT, bool kGateUp, bool kProducer, bool kNarrow>
__global__ void __launch_bounds__(block_threads(kProducer), blocks_per_sm(kNT, kProducer))
    moe_wgmma_kernel(const WgArgs a) {
  dev::pdl_enter();  // first statement: see launch.cuh
#ifdef KILN_HAVE_WGMMA
  constexpr int kAcc = kNT / 2, kStages = stages(kNT, kProducer);
  constexpr uint32_t kStageBytes = static_cast<uint32_t>(stage_bytes(kNT));
  constexpr uint32_t kXBytes = kNT * 256, kCodeBytes = 128 * 64;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t smem0 = (raw + 1023u) & ~1023u;  // the swizzle pattern is taken from address bits 7-9
  uint8_t* smem = smem_raw + (smem0 - raw);

  __shared__ const uint16_t* src_row[kNT];  // each of the tile's rows in xs (rows past its end: null)
  __shared__ uint64_t full_bar[kStages], empty_bar[kStages];  // the producer form's stage barriers
  const int4 tile = a.tiles[blockIdx.y];
  const int e = tile.x, r0 = tile.y, r1 = tile.z;
  if (e < 0 || r0 >= r1) return;
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, warp = wtid >> 5, lane = tid & 31;
  if (tid < kNT)
    src_row[tid] = r0 + tid < r1 ? a.xs + int64_t(a.row_index ? a.row_index[r0 + tid] : r0 + tid) * a.K : nullptr;
  if (kProducer && tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(ptx::smem_addr(&full_bar[i]), 32);  // the producer warp's lanes, as their copies land
      mbar_init(ptx::smem_addr(&empty_bar[i]), 8);  // one lane of each consumer warp, its MMAs on the stage done
    }
  }
  __syncthreads();
  const int g = lane >> 2, q = lane & 3;
  const int fb = blockIdx.x;

  const WeightDesc* table = a.table + 3 * e;
  const int m0 = 16 * warp + g;  // this lane's weight rows: m0 and m0 + 8 of its warpgroup's 64
  const int64_t row_bytes = a.K / 2, row_scales = a.K / 16;
  const float gscale = table[kGateUp ? wg : 2].scale * dev::kNvfp4AccumScale;
  const int steps = a.K / wl::kKBlock;

  // Stage s: the tile's activation rows x 128 k (rows past its end zero-filled: their columns are never stored),
  // then the block's 128 weight rows' codes (64 bytes each) and block scales (8 bytes each) of that k block.
  // A thread's copies are the same every stage: activation chunk c16 = tid % 16 of rows tid / 16 + 16 k (the swizzled
  // chunk, c16 ^ (row % 8), is the same for all of them), and weight units tid + 256 k of the 512 code chunks (16
  // bytes) and 128 scale rows (8 bytes). Their addresses are worked out once.
  constexpr int kXCopies = kNT / 16, kWCopies = (128 * 4 + 128 + kThreads - 1) / kThreads;
  const int c16 = tid & 15, n0 = tid >> 4;
  const uint32_t x_dst = static_cast<uint32_t>((c16 >> 3) * kNT * 128 + n0 * 128 + (((c16 & 7) ^ (n0 & 7)) << 4));
  const uint16_t* last_row = src_row[r1 - r0 - 1];
  const uint8_t* w_src[kWCopies];
  uint32_t w_dst[kWCopies];
#pragma unroll
  for (int k = 0; k < kWCopies; ++k) {
    const int i = tid + kThreads * k;
    const int row = i < 512 ? i >> 2 : i - 512;  // the block's weight row: warpgroup row / 64, row % 64
    const int rwg = row >> 6, m = row & 63;
    const WeightDesc& w = table[kGateUp ? rwg : 2];
    const int64_t grow = kGateUp ? wl::gate_up_feature(fb, m) : 128 * fb + row;
    w_src[k] = i < 512 ? static_cast<const uint8_t*>(w.data) + grow * row_bytes + (i & 3) * 16
                       : w.block_scale + grow * row_scales;
    w_dst[k] = i < 512 ? kXBytes + row * 64 + (i & 3) * 16 : kXBytes + kCodeBytes + row * 8;
  }
  auto copy_stage = [&](int s) {
    const uint32_t base = smem0 + (s % kStages) * kStageBytes;
#pragma unroll
    for (int k = 0; k < kXCopies; ++k) {
      const uint16_t* row = src_row[n0 + 16 * k];
      ptx::cp_async_16(base + x_dst + k * 16 * 128, (row ? row : last_row) + int64_t(s) * wl::kKBlock + c16 * 8,
                       row ? 16 : 0);
    }
#pragma unroll
    for (int k = 0; k < kWCopies; ++k) {
      const int i = tid + kThreads * k;
      if (i < 512) ptx::cp_async_16(base + w_dst[k], w_src[k] + int64_t(s) * 64);
      else if (i < 640) ptx::cp_async_8(base + w_dst[k], w_src[k] + int64_t(s) * 8);
    }
  };
  if constexpr (kProducer) {
    if (tid >= kThreads) {
      // The producer warp: stage s into buffer s % kStages once the consumers have released its previous use. Lane p
      // copies activation chunks p + 32 k and weight units p + 32 k (their addresses worked out once).
      const int p = tid - kThreads;
      constexpr int kPW = (128 * 4 + 128) / 32;  // weight units per lane: 16 code chunks then 4 scale rows
      const uint8_t* pw_src[kPW];
      uint32_t pw_dst[kPW];
#pragma unroll
      for (int k = 0; k < kPW; ++k) {
        const int i = p + 32 * k;
        const int row = i < 512 ? i >> 2 : i - 512;
        const WeightDesc& w = table[kGateUp ? row >> 6 : 2];
        const int64_t grow = kGateUp ? wl::gate_up_feature(fb, row & 63) : 128 * fb + row;
        pw_src[k] = i < 512 ? static_cast<const uint8_t*>(w.data) + grow * row_bytes + (i & 3) * 16
                            : w.block_scale + grow * row_scales;
        pw_dst[k] = i < 512 ? kXBytes + row * 64 + (i & 3) * 16 : kXBytes + kCodeBytes + row * 8;
      }
      for (int s = 0; s < steps; ++s) {
        const int slot = s % kStages;
        if (s >= kStages) mbar_wait(ptx::smem_addr(&empty_bar[slot]), ((s / kStages) - 1) & 1);
        const uint32_t base = smem0 + slot * kStageBytes;
#pragma unroll 4
        for (int k = 0; k < kNT / 2; ++k) {
          const int i = p + 32 * k, n = i >> 4, c = i & 15;
          const uint16_t* row = src_row[n];
          ptx::cp_async_16(base + wl::stage_offset(n, c * 8, kNT),
                           (row ? row : last_row) + int64_t(s) * wl::kKBlock + c * 8, row ? 16 : 0);
        }
#pragma unroll
        for (int k = 0; k < kPW; ++k) {
          if (p + 32 * k < 512) ptx::cp_async_16(base + pw_dst[k], pw_src[k] + int64_t(s) * 64);
          else ptx::cp_async_8(base + pw_dst[k], pw_src[k] + int64_t(s) * 8);
        }
        cp_async_mbar_arrive(ptx::smem_addr(&full_bar[slot]));
      }
      ptx::cp_async_wait_all();
      return;
    }
  }
  // The A fragments of stage s: this lane's rows m0, m0 + 8 of its warpgroup's 64.
  auto decode_stage = [&](int s, uint32_t(&A)[8][4]) {
    decode_stage_rows(smem + (s % kStages) * kStageBytes + kXBytes, 64 * wg + m0, q, A);
  };

  // The main loop and the epilogue, with the MMA width of the tile (with_mma_cols).
  with_mma_cols<kNT, kNarrow>(r1 - r0, [&](auto cols) {
    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    uint32_t A0[8][4], A1[8][4];
    auto mma_step = [&](int s, uint32_t(&A)[8][4]) {
      const uint32_t base = smem0 + (s % kStages) * kStageBytes;
      hold(acc);
      wgmma_fence();
      mma_kblock<kNT, decltype(cols)::value>(acc, A, base);
      wgmma_commit();
      hold(acc);
    };
    if constexpr (kProducer) {
      // Consumers: wait for stage s + 1's copies (its full barrier) while step s's MMAs run, decode it, wait for the
      // MMAs, release stage s (its empty barrier). No block barrier: the two warpgroups run apart.
      auto wait_full = [&](int s) {
        mbar_wait(ptx::smem_addr(&full_bar[s % kStages]), (s / kStages) & 1);
        fence_proxy_async();
      };
      auto step = [&](int s, uint32_t(&A)[8][4], uint32_t(&A_next)[8][4]) {
        mma_step(s, A);
        if (s + 1 < steps) {
          wait_full(s + 1);
          decode_stage(s + 1, A_next);
        }
        wgmma_wait<0>();
        hold(A);
        __syncwarp();
        if (lane == 0) mbar_arrive(ptx::smem_addr(&empty_bar[s % kStages]));
      };
      wait_full(0);
      decode_stage(0, A0);
      for (int s = 0; s < steps; s += 2) {
        step(s, A0, A1);
        if (s + 1 < steps) step(s + 1, A1, A0);
      }
      hold(acc);
      consumers_sync();  // both warpgroups' MMAs are done: the stages become the epilogue's buffers
    } else {
      // Stages 0 .. kStages - 2 in flight; step s copies stage s + kStages - 1 into the buffer step s - 1 used.
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < steps) copy_stage(s);
        ptx::cp_async_commit();
      }
      ptx::cp_async_wait<kStages - 2>();  // stage 0
      fence_proxy_async();
      __syncthreads();
      decode_stage(0, A0);
      // A holds step s's fragments; A_next gets step s + 1's (from shared memory) while step s's MMAs run.
      auto step = [&](int s, uint32_t(&A)[8][4], uint32_t(&A_next)[8][4]) {
        mma_step(s, A);
        ptx::cp_async_wait<kStages - 3>();  // this thread's copies of stage s + 1 have landed
        fence_proxy_async();
        __syncthreads();  // everyone's copies of stage s + 1; every warpgroup is done with step s - 1
        if (s + kStages - 1 < steps) copy_stage(s + kStages - 1);
        ptx::cp_async_commit();
        if (s + 1 < steps) decode_stage(s + 1, A_next);
        wgmma_wait<0>();
        hold(A);
      };
      for (int s = 0; s < steps; s += 2) {
        step(s, A0, A1);
        if (s + 1 < steps) step(s + 1, A1, A0);
      }
      hold(acc);
      ptx::cp_async_wait_all();
      __syncthreads();  // every warpgroup's MMAs are done: the stages become the epilogue's buffers
    }

    auto sync = [] {
      if constexpr (kProducer) consumers_sync();
      else __syncthreads();
    };
    const int rows = r1 - r0;
    if constexpr (kGateUp) {
      float* up = reinterpret_cast<float*>(smem);  // [kAcc][128]: warpgroup 1's values, by register and lane
      constexpr int kLd = 64 + 8;                    // act rows (bf16), padded
      uint16_t* act = reinterpret_cast<uint16_t*>(smem + kAcc * 128 * 4);  // [kNT][kLd]
      if (wg == 1) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) up[i * 128 + wtid] = acc[i] * gscale;
      }
      sync();
      if (wg == 0) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) {
          const int m = m0 + 8 * ((i & 3) >> 1), n = 8 * (i >> 2) + 2 * q + (i & 1);
          const float v = dev::silu(acc[i] * gscale) * up[i * 128 + wtid];
          act[n * kLd + m] = dev::f32_to_bf16(v);
        }
      }
      sync();
      for (int i = tid; i < rows * 8; i += kThreads) {
        const int n = i >> 3, c = i & 7;
        *reinterpret_cast<uint4*>(a.out + int64_t(r0 + n) * a.N + 64 * fb + 8 * c) =
            *reinterpret_cast<const uint4*>(act + n * kLd + 8 * c);
      }
    } else {
      constexpr int kLd = 128 + 8;
      uint16_t* y = reinterpret_cast<uint16_t*>(smem);  // [kNT][kLd]
#pragma unroll
      for (int i = 0; i < kAcc; ++i) {
        const int m = 64 * wg + m0 + 8 * ((i & 3) >> 1), n = 8 * (i >> 2) + 2 * q + (i & 1);
        y[n * kLd + m] = dev::f32_to_bf16(acc[i] * gscale);
      }
      sync();
      for (int i = tid; i < rows * 16; i += kThreads) {
        const int n = i >> 4, c = i & 15;
        *reinterpret_cast<uint4*>(a.out + int64_t(r0 + n) * a.N + 128 * fb + 8 * c) =
            *reinterpret_cast<const uint4*>(y + n * kLd + 8 * c);
      }
    }
  });
#endif  // KILN_HAVE_WGMMA
}

// ---- The down GEMM walking several feature blocks per block (--moe-wgmma-down-walk N; experimental, built without a
// GPU at hand: not yet run). A block = up to N consecutive 128-feature blocks x one row tile. The tile's activation
// rows (all K / 128 k blocks) are copied to shared memory once and stay there; only the weights stream through the
// stages, as (feature block, k block) items in order. Each feature block's outputs go from the accumulators straight
// to global memory (two features per 4-byte store, paired through a lane exchange), so the pipeline never drains
// between feature blocks. Against moe_wgmma_kernel's down form: the activations are read once per N feature blocks
// instead of once per feature block (the 35B-A3B's 8192-token pass: 128 KiB per 128-row tile and feature block, from
// L2), a block's fixed costs (start, first copies) are shared by N feature blocks (the 397B TP-8 rank's K = 128 is a
// single k block per feature block), and the MMAs are the same, in the same order: the same bits.
constexpr uint32_t kWalkStageBytes = 128 * 64 + 128 * 8;  // one k block of 128 weight rows: codes, block scales
constexpr int kWalkStages = 5;                             // copies run 4 items ahead
static_assert(kWalkStageBytes % 1024 == 0);
constexpr size_t walk_smem_bytes(int nt, int64_t K) {
  return static_cast<size_t>(K / wl::kKBlock) * nt * 256 + kWalkStages * kWalkStageBytes + 1024;
}
// 64-row tiles keep two blocks per multiprocessor (228 KiB, 1 KiB of it reserved per block); a block's dynamic plus
// static shared memory (src_row: 8 bytes a row) stays within the 227 KiB a block may have.
constexpr size_t walk_smem_limit(int nt) { return nt == 64 ? 115200 : 224 * 1024; }
static_assert(walk_smem_limit(64) + 64 * 8 <= 227 * 1024 && 2 * (walk_smem_limit(64) + 64 * 8 + 1024) <= 228 * 1024);
static_assert(walk_smem_limit(128) + 128 * 8 <= 227 * 1024);

#ifdef KILN_HAVE_WGMMA
// Feature block `fb`'s outputs: out[row n][128 fb + feature m] = bf16(acc * gscale), rows < `rows`. Register pair
// (i, i + 1) holds columns n, n + 1 of weight row m; lanes g and g ^ 1 (lane ^ 4) hold rows m and m ^ 1. The even-g
// lane stores (n; m, m + 1), the odd one (n + 1; m - 1, m): each hands the other one value.
// (wgmma_layout::down_pair_store: the same maps, checked on the host.)
template <int kNT>
__device__ __forceinline__ void store_down_block(const float (&acc)[kNT / 2], float gscale, int wg, int warp, int g,
                                                 int q, int rows, uint16_t* out, int64_t ld) {
#pragma unroll
  for (int i = 0; i < kNT / 2; i += 2) {
    const wl::PairStore p = wl::down_pair_store(warp, g, q, i);
    const float v0 = acc[i] * gscale, v1 = acc[i + 1] * gscale;  // selected below: no dynamic register index
    const float own = p.own_reg == i ? v0 : v1;
    const float other = __shfl_xor_sync(0xffffffffu, p.sent_reg == i ? v0 : v1, 4);
    const uint32_t packed = p.own_low ? dev::pack_bf16x2(own, other) : dev::pack_bf16x2(other, own);
    if (p.col < rows) *reinterpret_cast<uint32_t*>(out + int64_t(p.col) * ld + 64 * wg + p.row) = packed;
  }
}
#endif  // KILN_HAVE_WGMMA

template <int kNT, bool kNarrow>
__global__ void __launch_bounds__(kThreads, blocks_per_sm(kNT, false))
    moe_wgmma_down_walk_kernel(const WgArgs a, int walk) {
  dev::pdl_enter();  // first statement: see launch.cuh
#ifdef KILN_HAVE_WGMMA
  constexpr int kAcc = kNT / 2, kS = kWalkStages;
  constexpr uint32_t kXBytes = kNT * 256, kCodeBytes = 128 * 64;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = ptx::smem_addr(smem_raw);
  const uint32_t smem0 = (raw + 1023u) & ~1023u;  // the swizzle pattern is taken from address bits 7-9
  uint8_t* smem = smem_raw + (smem0 - raw);

  __shared__ const uint16_t* src_row[kNT];  // each of the tile's rows in xs (rows past its end: null)
  const int4 tile = a.tiles[blockIdx.y];
  const int e = tile.x, r0 = tile.y, r1 = tile.z;
  const int fb0 = static_cast<int>(blockIdx.x) * walk, F = min(walk, a.N / 128 - fb0);
  if (e < 0 || r0 >= r1 || F <= 0) return;
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, warp = wtid >> 5, lane = tid & 31;
  if (tid < kNT)
    src_row[tid] = r0 + tid < r1 ? a.xs + int64_t(a.row_index ? a.row_index[r0 + tid] : r0 + tid) * a.K : nullptr;
  __syncthreads();
  const int g = lane >> 2, q = lane & 3;
  const WeightDesc& wd = a.table[3 * e + 2];
  const int m0 = 16 * warp + g;  // this lane's weight rows: m0 and m0 + 8 of its warpgroup's 64
  const int64_t row_bytes = a.K / 2, row_scales = a.K / 16;
  const float gscale = wd.scale * dev::kNvfp4AccumScale;
  const int steps = a.K / wl::kKBlock, items = F * steps;
  const uint32_t w_base = smem0 + static_cast<uint32_t>(steps) * kXBytes;  // the weight stages follow the activations
  const uint8_t* w_smem = smem + static_cast<size_t>(steps) * kXBytes;

  // The activations: thread chunk c16 = tid % 16 of rows tid / 16 + 16 k, every k block (moe_wgmma_kernel's copies).
  const int c16 = tid & 15, n0 = tid >> 4;
  const uint32_t x_dst = static_cast<uint32_t>((c16 >> 3) * kNT * 128 + n0 * 128 + (((c16 & 7) ^ (n0 & 7)) << 4));
  const uint16_t* last_row = src_row[r1 - r0 - 1];
  // A weight stage: units tid + 256 k of the 512 code chunks (16 bytes) and 128 scale rows (8 bytes) of one k block;
  // item (f, s) is k block s of feature block fb0 + f. The addresses are worked out per copy (few live registers:
  // 64-row tiles run two blocks per multiprocessor, 128 registers a thread).
  constexpr int kWCopies = (128 * 4 + 128 + kThreads - 1) / kThreads;
  const uint8_t* codes = static_cast<const uint8_t*>(wd.data) + 128 * int64_t(fb0) * row_bytes;
  const uint8_t* scales = wd.block_scale + 128 * int64_t(fb0) * row_scales;
  auto copy_weights = [&](int j) {
    const int f = j / steps, s = j - f * steps;
    const uint32_t base = w_base + (j % kS) * kWalkStageBytes;
    const uint8_t* c = codes + f * 128 * row_bytes + s * 64;
    const uint8_t* sc = scales + f * 128 * row_scales + s * 8;
#pragma unroll
    for (int k = 0; k < kWCopies; ++k) {
      const int i = tid + kThreads * k;
      if (i < 512) ptx::cp_async_16(base + (i >> 2) * 64 + (i & 3) * 16, c + (i >> 2) * row_bytes + (i & 3) * 16);
      else if (i < 640) ptx::cp_async_8(base + kCodeBytes + (i - 512) * 8, sc + (i - 512) * row_scales);
    }
  };
  // The A fragments of item j from its stage.
  auto decode_item = [&](int j, uint32_t(&A)[8][4]) {
    decode_stage_rows(w_smem + (j % kS) * kWalkStageBytes, 64 * wg + m0, q, A);
  };

  // Commit group 0: every k block of the activations and the first weight stage; groups 1 .. kS - 2: the next stages.
  for (int s = 0; s < steps; ++s) {
#pragma unroll
    for (int k = 0; k < kNT / 16; ++k) {
      const uint16_t* row = src_row[n0 + 16 * k];
      ptx::cp_async_16(smem0 + s * kXBytes + x_dst + k * 16 * 128,
                       (row ? row : last_row) + int64_t(s) * wl::kKBlock + c16 * 8, row ? 16 : 0);
    }
  }
#pragma unroll
  for (int j = 0; j < kS - 1; ++j) {
    if (j < items) copy_weights(j);
    ptx::cp_async_commit();
  }
  ptx::cp_async_wait<kS - 2>();  // group 0
  fence_proxy_async();           // the activations are read by the MMAs (async proxy) from here on
  __syncthreads();

  with_mma_cols<kNT, kNarrow>(r1 - r0, [&](auto cols) {
    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    uint32_t A0[8][4], A1[8][4];
    decode_item(0, A0);
    // Item j: its MMAs on k block j % steps; meanwhile item j + 1's stage is awaited and decoded and item j + kS - 1's
    // copies start (into the buffer item j - 1 used, decoded before item j's MMAs); at the last k block of a feature
    // block, its outputs are stored.
    auto step = [&](int j, uint32_t(&A)[8][4], uint32_t(&A_next)[8][4]) {
      const uint32_t xb = smem0 + static_cast<uint32_t>(j % steps) * kXBytes;
      hold(acc);
      wgmma_fence();
      mma_kblock<kNT, decltype(cols)::value>(acc, A, xb);
      wgmma_commit();
      hold(acc);
      ptx::cp_async_wait<kS - 3>();  // this thread's copies of item j + 1 have landed
      __syncthreads();               // everyone's; item j - 1's buffer was decoded by every warp a step ago
      if (j + kS - 1 < items) copy_weights(j + kS - 1);
      ptx::cp_async_commit();
      if (j + 1 < items) decode_item(j + 1, A_next);
      wgmma_wait<0>();
      hold(A);
      if ((j + 1) % steps == 0) {
        store_down_block<kNT>(acc, gscale, wg, warp, g, q, r1 - r0,
                              a.out + int64_t(r0) * a.N + 128 * (fb0 + j / steps), a.N);
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
      }
    };
    for (int j = 0; j < items; j += 2) {
      step(j, A0, A1);
      if (j + 1 < items) step(j + 1, A1, A0);
    }
  });
  ptx::cp_async_wait_all();
#endif  // KILN_HAVE_WGMMA
}

// The row tiles of every expert, in expert order: {expert, first sorted row, end row, 0}, at most nt rows each; the
// rest of the list {-1, 0, 0, 0}. One warp (a scan over the experts 32 at a time).
__global__ void build_tiles_kernel(const int32_t* __restrict__ group_offset, int E, int nt, int4* __restrict__ tiles,
                                   int max_tiles) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int lane = threadIdx.x;
  int base = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const int b = e < E ? group_offset[e] : 0, end = e < E ? group_offset[e + 1] : 0;
    const int n = (end - b + nt - 1) / nt;
    int incl = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    const int first = base + incl - n;
    for (int i = 0; i < n && first + i < max_tiles; ++i)
      tiles[first + i] = make_int4(e, b + i * nt, min(b + (i + 1) * nt, end), 0);
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  for (int i = base + lane; i < max_tiles; i += 32) tiles[i] = make_int4(-1, 0, 0, 0);
}

// xs[t, 128 b + L] = bf16(x[t, 128 b + phys_k(L)]) for every token t (the GEMM reads each sorted row's token through
// row_token); a thread writes 8 logical positions (16 bytes).
__global__ void permute_rows_bf16_kernel(const float* __restrict__ x, int64_t H, int64_t T,
                                         uint16_t* __restrict__ xs) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t per_row = H / 8, n = T * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = i - r * per_row;
    const float* src = x + r * H + (c / 16) * wl::kKBlock;
    const int L0 = static_cast<int>(c % 16) * 8;
    uint32_t o[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      o[p] = dev::pack_bf16x2(src[wl::phys_k(L0 + 2 * p)], src[wl::phys_k(L0 + 2 * p + 1)]);
    }
    *reinterpret_cast<uint4*>(xs + r * H + c * 8) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

int64_t max_tiles_of(int64_t T, int top_k, int64_t E, int nt) {
  const int64_t P = T * top_k;
  return (P + nt - 1) / nt + std::min<int64_t>(E, P);
}

struct Carve {
  void* groups;
  int4* tiles;
  uint16_t *xs, *act, *y;
  size_t bytes;
};
Carve carve(void* base, int64_t T, int top_k, int64_t E, int64_t H, int64_t I, int tile_rows) {
  const size_t P = static_cast<size_t>(T * top_k);
  const int nt = moe_prefill_wgmma_tile_rows(T, top_k, E, tile_rows);
  Carve c{};
  WorkspaceCarve w(base);
  c.groups = w.take(moe_row_groups_bytes(T, top_k, E));
  c.tiles = static_cast<int4*>(w.take(static_cast<size_t>(max_tiles_of(T, top_k, E, nt)) * sizeof(int4)));
  c.xs = static_cast<uint16_t*>(w.take(static_cast<size_t>(T * H) * 2));
  c.act = static_cast<uint16_t*>(w.take(P * I * 2));
  c.y = static_cast<uint16_t*>(w.take(P * H * 2));
  c.bytes = w.bytes;
  return c;
}

// Sets the kernel's dynamic shared memory limit (once per device), then launches it.
template <int kNT, bool kGateUp, bool kProducer, bool kNarrow>
void launch_wgmma(const WgArgs& a, unsigned feature_blocks, int64_t max_tiles, Stream stream) {
  auto kernel = moe_wgmma_kernel<kNT, kGateUp, kProducer, kNarrow>;
  constexpr size_t bytes = smem_bytes(kNT, kProducer);
  static std::atomic<uint64_t> configured{0};
  set_dynamic_smem_once(kernel, bytes, configured);
  launch_kernel(kernel, dim3(feature_blocks, static_cast<unsigned>(max_tiles)), block_threads(kProducer), bytes,
                stream, a);
  KILN_CUDA_CHECK_LAUNCH();
}

template <int kNT, bool kNarrow>
void launch_down_walk(const WgArgs& a, int walk, int64_t max_tiles, Stream stream) {
  auto kernel = moe_wgmma_down_walk_kernel<kNT, kNarrow>;
  static std::atomic<uint64_t> configured{0};
  set_dynamic_smem_once(kernel, walk_smem_limit(kNT), configured);
  const unsigned groups = static_cast<unsigned>((a.N / 128 + walk - 1) / walk);
  launch_kernel(kernel, dim3(groups, static_cast<unsigned>(max_tiles)), kThreads, walk_smem_bytes(kNT, a.K), stream,
                a, walk);
  KILN_CUDA_CHECK_LAUNCH();
}

template <int kNT, bool kProducer, bool kNarrow>
void run_gemms(const WeightDesc* experts, const int4* tiles, int64_t max_tiles, int64_t H, int64_t I,
               const uint16_t* xs, const int32_t* row_token, uint16_t* act, uint16_t* y, int down_walk,
               Stream stream) {
  WgArgs gu{experts, tiles, xs, row_token, act, static_cast<int>(H), static_cast<int>(I)};
  launch_wgmma<kNT, true, kProducer, kNarrow>(gu, static_cast<unsigned>(I / 64), max_tiles, stream);
  profile_mark("gate_up wgmma");
  WgArgs down{experts, tiles, act, nullptr, y, static_cast<int>(I), static_cast<int>(H)};
  bool walked = false;
  if constexpr (kNT != 256) {  // a 256-row tile's activations never fit (moe_wgmma_down_walk_taken)
    if (moe_wgmma_down_walk_taken(down_walk, kNT, I)) {
      launch_down_walk<kNT, kNarrow>(down, down_walk, max_tiles, stream);
      profile_mark("down wgmma walk");
      walked = true;
    }
  }
  if (!walked) {
    launch_wgmma<kNT, false, kProducer, kNarrow>(down, static_cast<unsigned>(H / 128), max_tiles, stream);
    profile_mark("down wgmma");
  }
}

template <int kNT>
auto pick_gemms(bool producer, bool narrow) {
  if constexpr (kNT == 256) {  // no producer form at 256 rows
    return narrow ? run_gemms<kNT, false, true> : run_gemms<kNT, false, false>;
  } else {
    return producer ? (narrow ? run_gemms<kNT, true, true> : run_gemms<kNT, true, false>)
                    : (narrow ? run_gemms<kNT, false, true> : run_gemms<kNT, false, false>);
  }
}

}  // namespace

bool moe_prefill_wgmma_supported(int compute_major, int compute_minor, int64_t H, int64_t I, int experts_gemv2_kind,
                                 bool experts_vec_ok, const WeightDesc* host_experts, int64_t E) {
  if (compute_major != 9 || compute_minor != 0) return false;
  if (experts_gemv2_kind != 1 || !experts_vec_ok || H % 128 != 0 || I % 128 != 0 || H <= 0 || I <= 0 || E <= 0)
    return false;
  if (H > (int64_t(1) << 20) || I > (int64_t(1) << 20)) return false;
  for (int64_t i = 0; i < 3 * E; ++i) {
    const WeightDesc& w = host_experts[i];
    if (w.kind != WeightKind::nvfp4 || w.bias || reinterpret_cast<uintptr_t>(w.data) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(w.block_scale) % 8 != 0)
      return false;
  }
  return true;
}

bool moe_wgmma_down_walk_taken(int down_walk, int tile_rows, int64_t I) {
  if (down_walk < 2 || (tile_rows != 64 && tile_rows != 128) || I <= 0 || I % wl::kKBlock != 0) return false;
  return walk_smem_bytes(tile_rows, I) <= walk_smem_limit(tile_rows);
}

int moe_prefill_wgmma_tile_rows(int64_t T, int top_k, int64_t E, int tile_rows) {
  if (tile_rows == 64 || tile_rows == 128 || tile_rows == 256) return tile_rows;
  return E > 0 && T * top_k >= 128 * E ? 128 : 64;
}

size_t moe_prefill_wgmma_workspace_bytes(int64_t T, int top_k, int64_t E, int64_t H, int64_t I, int tile_rows) {
  return carve(nullptr, T, top_k, E, H, I, tile_rows).bytes;
}

void moe_prefill_wgmma(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* weights, int top_k,
                       const WeightDesc* experts, int64_t E, int64_t I, void* workspace, float* out,
                       const float* shared, const float* shared_gate, Stream stream, const MoeWgmmaForm& form) {
  if (T == 0) return;
  const int tile_rows = form.tile_rows;
  const bool producer = form.producer;
  if (H % 128 != 0 || I % 128 != 0) cuda_fail("moe_prefill_wgmma: H {} and I {} must be multiples of 128", {H, I});
  const int nt = moe_prefill_wgmma_tile_rows(T, top_k, E, tile_rows);
  const int64_t max_tiles = max_tiles_of(T, top_k, E, nt);
  if (max_tiles > 65535) cuda_fail("moe_prefill_wgmma: {} row tiles exceed the grid's 65535", {max_tiles});
  const Carve c = carve(workspace, T, top_k, E, H, I, tile_rows);
  const MoeRowGroups g = moe_group_rows(ids, T, top_k, E, c.groups, stream, form.wide_group);
  launch_kernel(build_tiles_kernel, 1, 32, 0, stream, g.group_offset, static_cast<int>(E), nt, c.tiles,
                static_cast<int>(max_tiles));
  KILN_CUDA_CHECK_LAUNCH();
  profile_mark("group");
  const int64_t chunks = T * (H / 8);
  launch_kernel(permute_rows_bf16_kernel, capped_grid(chunks), 256, 0, stream, x, H, T, c.xs);
  KILN_CUDA_CHECK_LAUNCH();
  profile_mark("x to bf16");
  auto gemms = nt == 256   ? pick_gemms<256>(producer, form.narrow)
               : nt == 128 ? pick_gemms<128>(producer, form.narrow)
                           : pick_gemms<64>(producer, form.narrow);
  gemms(experts, c.tiles, max_tiles, H, I, c.xs, g.row_token, c.act, c.y, form.down_walk, stream);
  moe_combine_bf16(c.y, ids, weights, g.pair_pos, top_k, T, H, out, shared, shared_gate, stream);
  profile_mark("combine");
}

}  // namespace kiln::cuda::ops
