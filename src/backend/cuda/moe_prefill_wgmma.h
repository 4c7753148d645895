// The NVFP4 routed experts of prefill-sized steps as grouped GEMMs on Hopper's warpgroup MMA (moe_prefill_wgmma.cu;
// sm_90a only). The step's (token, slot) pairs are sorted by expert (moe_group_rows), cut into row tiles of at most
// 64 or 128 rows of one expert (a tile list built on the device: no host synchronisation, so the path may be
// captured), x is rounded to bf16 once per token with each 128-k block permuted (moe_wgmma_layout.h), then:
//   gate/up: a block = 64 intermediate features x one row tile; warpgroup 0 multiplies the gate rows, warpgroup 1 the
//            up rows (wgmma m64nNk16, A = the weights decoded from NVFP4 in registers, B = the tile's x rows in
//            shared memory; both staged by cp.async, 4-5 stages of 128 k); the epilogue writes silu(gate) * up as
//            bf16 in the permuted order the down GEMM reads;
//   down:    a block = 128 output features x one row tile, both warpgroups on 64 rows each, bf16 outputs;
// and the combine (moe_combine_bf16) sums each token's rows in ascending expert id, as the other paths do.
// Each weight is read once per row tile and decoded once per row tile, against once per 16 rows on the mma.sync
// kernels (moe_experts.cu); no dequantised copy of the weights is written (moe_prefill_blas.cu).
// Accuracy (--dtype bfloat16 only): x and silu(gate) * up rounded to bf16 as on the other paths, fp32 accumulation,
// the expert outputs stored in bf16 (as the cuBLAS path). Plain C++ (no CUDA syntax).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backend/cuda/kernels.h"

namespace kiln::cuda::ops {

// True when this build and GPU run the path (compute capability 9.0: the kernels are sm_90a code) and it serves
// these experts: all NVFP4 with 16-byte aligned codes (experts_gemv2_kind 1, experts_vec_ok) and 8-byte aligned
// block scales, no bias, H and I multiples of 128.
bool moe_prefill_wgmma_supported(int compute_major, int compute_minor, int64_t H, int64_t I, int experts_gemv2_kind,
                                 bool experts_vec_ok, const WeightDesc* host_experts, int64_t E);
// The per-pass workspace (the grouping, the tile list, x, silu(gate) * up and the expert outputs in bf16):
// no more than moe_workspace_bytes() of the same shape (checked by a test).
size_t moe_prefill_wgmma_workspace_bytes(int64_t T, int top_k, int64_t E, int64_t H, int64_t I, int tile_rows = 0);
// Rows per row tile the path takes for a step: 128 when the experts receive >= 128 rows on average, else 64.
// tile_rows 64, 128 or 256 pins one (CudaOptions::moe_wgmma_tile_rows; 256: experimental, each decoded weight serves
// twice the rows of a 128-row tile; no producer form, no down walk).
int moe_prefill_wgmma_tile_rows(int64_t T, int top_k, int64_t E, int tile_rows = 0);

// The kernels' forms (CudaOptions' moe_wgmma_*: flags for A/B timing). All give the same bits.
struct MoeWgmmaForm {
  int tile_rows = 0;      // moe_prefill_wgmma_tile_rows' tile_rows
  bool producer = false;  // one more warp streams the stages, the warpgroups wait on mbarriers instead of a block
                          // barrier per k block (experimental)
  int down_walk = 0;      // >= 2: a down block walks this many 128-feature blocks with the tile's activations kept
                          // in shared memory (where moe_wgmma_down_walk_taken; experimental)
  bool narrow = false;    // the MMAs of a tile cover its rows rounded up to 32 (m64n32 / n64 / n96 / n128), not the
                          // whole tile height: a tile's tail rows cost no MMAs (experimental)
  bool wide_group = false;  // the grouping over many blocks (moe_group_rows' wide; experimental)
};
// Whether the down GEMM walks: down_walk >= 2 and the tile's activations (tile_rows x I, bf16) plus the weight stages
// fit the shared memory of a block (64-row tiles: still two blocks per multiprocessor): I <= 512 at 64 rows, <= 640 at
// 128. Else the down GEMM is moe_wgmma_kernel's form.
bool moe_wgmma_down_walk_taken(int down_walk, int tile_rows, int64_t I);

// out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (+ shared[t] * sigmoid(shared_gate[t])), ids outside
// [0, E) skipped. experts: the [E][3] {gate, up, down} descriptors in device memory.
void moe_prefill_wgmma(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* weights, int top_k,
                       const WeightDesc* experts, int64_t E, int64_t I, void* workspace, float* out,
                       const float* shared, const float* shared_gate, Stream stream, const MoeWgmmaForm& form = {});

}  // namespace kiln::cuda::ops
