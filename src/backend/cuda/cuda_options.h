// How the CUDA backend runs: the kernel choices a user may make (built from the command-line flags by
// backend/device.cpp) and the forms the tests pin. Defaults are the fast paths. Plain C++.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kiln::backend::cuda {

// ---- The NVFP4 routed experts of large steps: dequantised to bf16, then cuBLAS grouped GEMMs (moe_prefill_blas.cu)
// Steps of at least this many tokens take that path under `auto` (tunable). The mma kernels read 0.56 bytes per weight
// and stay cheap at few rows per expert; the dequantised path writes and reads 2 bytes per weight of every expert that
// received a token (~3.7 GB per layer at the 35B-A3B and at a 397B TP-8 rank: ~0.9 ms on an H200) and then runs at
// tensor-core speed. Measured on an H100 (35B-A3B, one pass; docs/perf/prefill.md): 1024 tokens 0.64x the mma
// kernels, 2048 0.94x, 4096 1.19x, 8192 1.34x; so from 4096.
constexpr int64_t kMoePrefillBlasMinTokens = 4096;
// The bf16 scratch of the dequantised experts (gate, up, down of one batch of experts; a layer with more experts than
// fit runs in batches). A buffer reused by every layer and step (CudaRuntime::reusable), outside the scratch arena;
// the memory plan adds it to its activation estimate (backend/device.cpp, moe_dequant_scratch_bytes).
constexpr size_t kMoePrefillWeightScratchBytes = size_t(256) << 20;
// ---- The NVFP4 routed experts of prefill-sized steps on Hopper's warpgroup MMA (moe_prefill_wgmma.cu, sm_90 only):
// FP4 decoded in registers, each weight read and decoded once per row tile of 64 or 128 rows; no host
// synchronisation. Steps of at least this many tokens take it under `auto` on sm_90 (tunable). Measured on an H100
// (35B-A3B, one pass; docs/perf/prefill.md), first form in one call: 512 tokens 0.90x the mma kernels, 1024 1.20x,
// 4096 1.27x the cuBLAS path, 8192 1.12x; so from 1024. The current form: 8192 1.20x cuBLAS (same call), 1024 1.47x
// the mma kernels of the earlier call; 512 not re-measured.
constexpr int64_t kMoePrefillWgmmaMinTokens = 1024;
// --moe-runner-backend's choice for the NVFP4 routed experts of non-decode steps: by_step (auto, kiln-grouped,
// kiln-fused-decode): on sm_90 the wgmma path from kMoePrefillWgmmaMinTokens tokens, elsewhere the dequantised path
// from kMoePrefillBlasMinTokens, the mma kernels below; mma (kiln-mma): the mma kernels at every size; blas
// (kiln-blas): the dequantised path at every size it serves; wgmma (kiln-wgmma): the wgmma path at every size.
enum class MoePrefill { by_step, mma, blas, wgmma };
enum class MoePrefillPath { mma, blas, wgmma };
// Which path a step of `tokens` tokens runs its NVFP4 routed experts on. Only with bf16 activation inputs
// (--dtype bfloat16: the GEMMs take x rounded once to bf16, as the mma kernels do; float32 keeps its 3-part fp32
// accuracy on the mma kernels). wgmma: where wgmma_ok (the caller's moe_prefill_wgmma_supported: compute capability
// 9.0, the sm_90a code, and experts of the shapes it serves). blas: sm_90 or newer (the caller checks the experts'
// shapes and falls back to the mma kernels), and never while
// the stream is being captured into a CUDA graph: it reads each expert's row count back to the host (one stream
// synchronisation per layer), which a captured graph cannot do (the check is cudaStreamIsCapturing on the op's
// stream, so it holds whatever steps get captured). The wgmma path keeps everything on the device and may be captured,
// but `auto` leaves captured steps (decode, verify) on the mma kernels.
constexpr MoePrefillPath moe_prefill_path(MoePrefill mode, int64_t tokens, bool bf16_inputs, int compute_major,
                                          bool wgmma_ok, bool capturing) {
  if (mode == MoePrefill::mma || !bf16_inputs || compute_major < 9 || tokens < 1) return MoePrefillPath::mma;
  if (mode == MoePrefill::wgmma) return wgmma_ok ? MoePrefillPath::wgmma : MoePrefillPath::mma;
  if (capturing) return MoePrefillPath::mma;
  if (mode == MoePrefill::blas) return MoePrefillPath::blas;
  if (wgmma_ok && tokens >= kMoePrefillWgmmaMinTokens) return MoePrefillPath::wgmma;
  return tokens >= kMoePrefillBlasMinTokens ? MoePrefillPath::blas : MoePrefillPath::mma;
}

struct CudaOptions {
  // The CUDA device (a tensor-parallel rank's, from --base-gpu-id / --gpu-id-step); < 0: the first supported one.
  int device = -1;
  // --dtype: how the fp32 activations enter the bf16 tensor-core MMAs (the expert and NVFP4 linear kernels, cuBLASLt
  // dense linears, prefill attention's q and p). float32: split into 3 bf16 parts (hi + mid + lo carry ~24 bits: the
  // fp32 kernels' result up to summation order); bfloat16: rounded once to bf16 (one MMA per weight fragment instead
  // of three; relative error <= 2^-8 per input, ~2^-9 RMS). Activations stay stored in fp32 and every accumulation
  // is fp32 either way; the CUDA-core kernels are the same for both.
  enum class ActivationDtype { float32, bfloat16 };
  ActivationDtype dtype = ActivationDtype::float32;
  // bf16 parts per activation at a tensor-core input: 3 (float32) or 1 (bfloat16).
  int mma_parts() const { return dtype == ActivationDtype::bfloat16 ? 1 : 3; }
  // --attention-backend: prefill-shaped steps on the flash-style tensor-core kernel (attention_prefill.cu, q and p in
  // mma_parts() bf16 parts), or every step on the split-over-keys kernel on the CUDA cores (kiln-paged-fp32).
  bool prefill_attention_tensor_cores = true;
  // --moe-runner-backend: NVFP4 routed experts on tensor cores (moe_experts.cu, x in mma_parts() bf16 parts), or on
  // the fp32 CUDA-core kernels (kiln-grouped-fp32). Other weight formats always take the CUDA-core kernels.
  bool moe_tensor_cores = true;
  // --moe-runner-backend kiln-fused-decode (by name only; auto is kiln-grouped): steps of at most kMoeDecodeMaxTokens
  // tokens run the routing and NVFP4 routed experts in two kernels (moe_decode_fused.cu, Ops::moe_route_experts);
  // larger steps and other weight formats as moe_tensor_cores says. false (kiln-grouped, the default, as the CLI's):
  // the six-kernel path at every size.
  bool moe_decode_fused = false;
  // The MoE block of steps of <= moe_block_max_tokens tokens (decode at batch 1-4, draft steps, verify passes of K <= 3
  // at batch 1) as one persistent kernel (moe_block_decode.cu:
  // router, shared expert, routing, NVFP4 experts and combine as phases of one grid with grid-wide barriers), where
  // the router and shared expert are dense BF16 and the experts NVFP4. Its grid holds one block per multiprocessor
  // and waits on all of them, so it is taken only where no other rank's kernels share the GPU: the CLI turns it on
  // (sm_90, one rank per GPU) with --enable-persistent-moe; false here (tests ask for it).
  bool moe_block_persistent = false;
  // Its largest step (the kernel serves 1-4 tokens: decode at batch <= 4, verify passes of K <= 3 at batch 1). 1: on an
  // H100 the kernel matched the unfused ops' decode step at batch 1 and was slower at 2-4 tokens (+14% at batch 2,
  // +25% at batch 4, verify of 4 tokens 6.8 ms against 5.5; docs/perf/decode-latency.md); the tests ask for 4.
  int moe_block_max_tokens = 1;
  // The Gated DeltaNet mixer of decode steps of 1-4 sequences (one token each, no position checkpoints) as one
  // persistent kernel (deltanet_block_decode.cu: the input norm, the input projections, conv, gates, delta rule, output
  // norm and output projection as phases of one grid), where the projections are dense BF16. Taken as
  // moe_block_persistent is (sm_90, one rank per GPU) with --enable-persistent-deltanet; false here.
  bool deltanet_block_persistent = false;
  // Its largest step (the kernel serves 1-4 sequences). 1: on an H100 it was 2.1% faster than the unfused ops at batch
  // 1, 0.9% slower at 2 and 2.9% at 4 (docs/perf/decode-latency.md); the tests ask for 4.
  int deltanet_block_max_tokens = 1;
  // The persistent kernels ask L2 for the weights a warp reads next (cp.async.bulk.prefetch: the next dense row, the
  // rows of the following phase while the current one runs); --enable-persistent-prefetch, experimental.
  bool persistent_prefetch = false;
  // Row-tile height of the wgmma expert GEMMs (moe_prefill_wgmma.h): 0 picks by the rows per expert (128 from 128 on
  // average, else 64), 64 or 128 pins one (--moe-wgmma-tile-rows, A/B timing); 256 (experimental, not yet run).
  int moe_wgmma_tile_rows = 0;
  // The wgmma expert GEMMs' producer form (moe_prefill_wgmma.h): one more warp per block streams the shared-memory
  // stages and the two warpgroups wait on mbarriers instead of meeting at a block barrier every k block.
  // --enable-wgmma-producer, experimental (built without a GPU at hand: not yet run).
  bool moe_wgmma_producer = false;
  // >= 2: the wgmma down GEMM walks this many 128-feature blocks per block with the row tile's activations kept in
  // shared memory (moe_prefill_wgmma.h, moe_wgmma_down_walk_taken); --moe-wgmma-down-walk, experimental (built
  // without a GPU at hand: not yet run). 0: one feature block per block.
  int moe_wgmma_down_walk = 0;
  // The wgmma GEMMs' MMAs cover each tile's rows rounded up to 32 (m64n32 / n64 / n96 / n128) instead of the whole
  // tile height, so a tile's tail rows cost no MMAs (moe_prefill_wgmma.h); --enable-wgmma-narrow-tiles, experimental
  // (built without a GPU at hand: not yet run).
  bool moe_wgmma_narrow = false;
  // The wgmma path's grouping of the (token, slot) pairs by expert over many blocks instead of one (kernels.h,
  // moe_group_rows' wide): ~96 us a layer on one multiprocessor for an 8192-token pass of the 35B-A3B.
  // --enable-wide-moe-grouping, experimental (built without a GPU at hand: not yet run).
  bool moe_group_wide = false;
  // --moe-runner-backend kiln-mma / kiln-blas / kiln-wgmma (else by_step): the path of the NVFP4 routed experts of
  // large steps (moe_prefill_path above), only with moe_tensor_cores.
  MoePrefill moe_prefill = MoePrefill::by_step;
  // --fp4-gemm-backend: dense NVFP4 linears of more rows than the gemv takes on tensor cores (the expert kernel with
  // the weight as its only expert), or on the fp32 gemm (kiln-fp32).
  bool fp4_linear_tensor_cores = true;
  // Dense BF16 linears of many rows through cuBLASLt (x in mma_parts() bf16 parts); false keeps them on the fp32
  // kernels. No flag: the tests cover both paths.
  bool dense_bf16_blas = true;
  // Programmatic dependent launch between the kernels of captured steps (launch.cuh), sm_90+ (the runtime keeps it off
  // below); on by default, `--disable-pdl` turns it off.
  bool pdl = true;
  // With pdl: the bandwidth gemv's blocks of a captured step prefetch their (static) weight rows into L2 before their
  // PDL wait, so the weights stream while the previous kernel finishes (linear.cu). Measured no faster on an H100
  // (docs/perf/decode-latency.md), so off; `--enable-weight-prefetch`, experimental.
  bool weight_prefetch = false;
  // Small ops of decode-sized steps fused into one launch: the attention q / k prologue (CudaOps::qk_norm_rope), the
  // activation of a down / output projection's input applied as the gemv reads it (linear_gated_input), and the
  // DeltaNet output norm inside the delta rule's kernel (gated_delta_rule_norm).
  // The same arithmetic as the separate kernels (test_cuda: bit-identical logits on every fixture model);
  // `--disable-fused-decode-ops` runs the separate kernels.
  bool fused_decode_ops = true;
  // Which form of the gated delta rule runs. by_step: chunks of 64 tokens for prefill steps with a sequence of >= 32
  // tokens (where the chunked kernel serves the head sizes), the recurrence otherwise; chunked: the chunked form for
  // every step where it serves the head sizes. No flag: the tests check the chunked kernel on every step shape.
  enum class DeltaRule { by_step, chunked };
  DeltaRule delta_rule = DeltaRule::by_step;
  // The chunked delta rule's three matrix products (phase 1's k.k / q.k / k S / q S, P V and the state update) on
  // tensor cores (deltanet_chunked.cu: mma.sync m16n8k8 with tf32 inputs, mma_parts() tf32 parts: 3 under float32,
  // fp32-class accuracy; 1 under bfloat16, each input rounded once to tf32), or on the fp32 CUDA-core kernel
  // (`--disable-delta-rule-tensor-cores`). The triangular solve, gates and decays are fp32 CUDA-core work either way.
  bool delta_rule_tensor_cores = true;
  // The chunked kernel's tf32_parts (kernels.h gated_delta_rule_chunked): 0 for the CUDA-core kernel.
  int delta_rule_tf32_parts() const { return delta_rule_tensor_cores ? mma_parts() : 0; }
  // The chunked delta rule in two kernels (deltanet_chunked_split.cu: a per-chunk preparation parallel over chunks and
  // heads, writing W, U, P to a workspace from the scratch arena, then the scan over each sequence's chunks), or the
  // single kernel that walks a sequence's chunks doing all of it (`--disable-delta-rule-split`). The split form runs on
  // tensor cores only: with delta_rule_tensor_cores off the single FMA kernel runs either way.
  bool delta_rule_split = true;
  bool delta_rule_split_active() const { return delta_rule_split && delta_rule_tensor_cores; }
  // --mamba-ssm-dtype: the DeltaNet recurrent state slots in bf16 (half the bytes the delta rule streams per step and
  // the memory plan reserves) instead of fp32. The kernels still update the state in fp32 registers and round it once,
  // to nearest even, when they store it. On by default under --dtype bfloat16 (backend/device.h).
  bool recurrent_state_bf16 = false;
  // The memory plan's activation estimate for one pass (bytes; 0: none): the scratch arena's first block
  // (CudaRuntime::set_scratch_plan).
  size_t scratch_plan_bytes = 0;
};

}  // namespace kiln::backend::cuda
