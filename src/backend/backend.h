// The backend interface: the table of ops a forward pass needs, over TensorViews, with shape comments on every
// parameter, and the options a model is loaded with. The ops are defined in the model layer (model/ops.h: the model
// says what it needs, layers point one way) and re-exported here under the backend's name; the generic runner
// (model/runner.h) drives any implementation.
//
//   kiln::backend::Backend      = kiln::model::Ops            (implement this for a new backend)
//   kiln::backend::LinearWeight = kiln::model::LinearWeight   (BF16 / FP8-per-tensor / NVFP4 weight descriptor)
//   kiln::backend::LoadOptions                                (what one load asks for: the runner's sizes, plus a
//                                                              `gpu` part and a `parallel` part)
//
// Backends: cpu/ (the oracle, always built; load_cpu_model in cpu/cpu_backend.h), cuda/ (when nvcc is present).
// The parallel sizes are checked in one place: backend::validate_parallel (device.h).
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "model/model.h"
#include "model/ops.h"
#include "model/runner.h"

namespace kiln::backend {

using Backend = model::Ops;
using model::DeltaRuleMode;
using model::ExpertWeights;
using model::GeluKind;
using model::KvLayerView;
using model::LinearWeight;
using model::NormKind;
using model::StepLayout;
using model::WeightFormat;

// How a CUDA device runs the model (the flags of cli/gpu_flags.h; SGLang's names). The kernel choices and --dtype are
// resolved per device by backend::resolve_kernels (device.h): the CPU backend accepts only "auto" (and float32).
struct GpuLoadOptions {
  // --dtype (SGLang's name): auto, bfloat16, float16 or float32, the precision activations enter the tensor cores
  // with; resolved per device by backend::resolve_dtype. The CPU backend always runs fp32.
  std::string dtype = "auto";
  // --mamba-ssm-dtype (SGLang's name): auto, bfloat16 or float32, the DeltaNet recurrent state's element type;
  // resolved by backend::resolve_mamba_ssm_dtype (device.h). The CPU backend always keeps fp32.
  std::string mamba_ssm_dtype = "auto";
  // Kernel choices: "auto" resolves per device / GPU architecture.
  std::string attention_backend = "auto";
  std::string moe_runner_backend = "auto";
  std::string fp4_gemm_backend = "auto";
  // Share of GPU memory for weights + KV cache + state + activations; 0: 0.90.
  double mem_fraction_static = 0;
  bool cuda_graphs = true;                 // capture and replay decode steps
  bool cuda_graph_verify = true;           // and speculative verify passes (model::RunnerOptions::graph_verify_passes)
  bool disable_custom_all_reduce = false;  // all-reduces through NCCL only, not the one-shot peer-memory kernel
  bool pdl = true;  // programmatic dependent launch inside captured steps (cuda::CudaOptions::pdl; --disable-pdl)
  // The fused small ops of decode steps (cuda::CudaOptions::fused_decode_ops; --disable-fused-decode-ops).
  bool fused_decode_ops = true;
  // The MoE block of one-token steps as one persistent kernel (cuda::CudaOptions::moe_block_persistent, taken on sm_90
  // where each rank has its GPU to itself; --enable-persistent-moe / --disable-persistent-moe). Off: correct on an H100
  // but not yet faster (docs/perf/decode-latency.md).
  bool persistent_moe = false;
  // The DeltaNet mixer of decode steps at batch 1 as one persistent kernel (cuda::CudaOptions::
  // deltanet_block_persistent, taken as persistent_moe is; --enable-persistent-deltanet / --disable-persistent-deltanet).
  // Off until its tests have been seen to pass on a GPU and it is clearly faster.
  bool persistent_deltanet = false;
  // The persistent kernels' L2 prefetch of the weights each warp reads next (cuda::CudaOptions::persistent_prefetch;
  // --enable-persistent-prefetch, experimental).
  bool persistent_prefetch = false;
  // Row-tile height of the wgmma expert GEMMs (cuda::CudaOptions::moe_wgmma_tile_rows): 0 by the rows per expert, or
  // 64 / 128 (--moe-wgmma-tile-rows, A/B timing).
  int moe_wgmma_tile_rows = 0;
  // The wgmma expert GEMMs' producer form (cuda::CudaOptions::moe_wgmma_producer; --enable-wgmma-producer).
  bool moe_wgmma_producer = false;
  // Feature blocks per block of the wgmma down GEMM (cuda::CudaOptions::moe_wgmma_down_walk; --moe-wgmma-down-walk).
  int moe_wgmma_down_walk = 0;
  // MMAs as wide as each tile's rows (cuda::CudaOptions::moe_wgmma_narrow; --enable-wgmma-narrow-tiles).
  bool moe_wgmma_narrow = false;
  // The wgmma path's grouping over many blocks (cuda::CudaOptions::moe_group_wide; --enable-wide-moe-grouping).
  bool moe_group_wide = false;
  // The chunked delta rule's matrix products on tensor cores (cuda::CudaOptions::delta_rule_tensor_cores;
  // --disable-delta-rule-tensor-cores).
  bool delta_rule_tensor_cores = true;
  // The chunked delta rule as a per-chunk preparation kernel plus the scan over chunks (cuda::CudaOptions::
  // delta_rule_split; --disable-delta-rule-split: the single kernel).
  bool delta_rule_split = true;
  // Captured gemv launches prefetch their weights into L2 before the PDL wait (cuda::CudaOptions::weight_prefetch;
  // --enable-weight-prefetch, experimental).
  bool weight_prefetch = false;
  // Set by the loader from the memory plan, not a flag: the activation estimate of one pass (bytes), the size of a
  // CUDA rank's first scratch block.
  double scratch_plan_bytes = 0;
};

// Tensor / expert parallelism and where the ranks run (the flags of cli/parallel_flags.h; SGLang's names). Checked by
// backend::validate_parallel before anything loads.
struct ParallelOptions {
  // tp ranks, ep expert-parallel groups among them. On the CPU the ranks are threads of this process over the
  // in-process communicator (backend/comm_local.h).
  int tp_size = 1;
  int ep_size = 1;
  // GPU ranks: rank r of this node runs on CUDA device base_gpu_id + r * gpu_id_step; a step of 0 puts every rank on
  // one GPU (correctness runs: the ranks share its memory, the peer all-reduce joins them).
  int base_gpu_id = 0;
  int gpu_id_step = 1;
  // Several machines (--nnodes, --node-rank, --dist-init-addr host:port): tp_size ranks over nnodes nodes, this
  // node's tp_size / nnodes of them; NCCL's unique id is exchanged over dist_init_addr (node 0 listens there).
  int nnodes = 1;
  int node_rank = 0;
  std::string dist_init_addr;
  int dist_timeout_s = 600;  // --dist-timeout: the longest wait for the other nodes at startup (rendezvous, loading)
  // bench-engine --single-rank R: load only rank R of the --tp-size plan on one GPU, its all-reduces replaced by a
  // device copy of the same size (the decode cost of one GPU of a larger group); -1: off.
  int single_rank = -1;

  // A group of ranks (tp, ep or several nodes), not one runner.
  bool is_group() const { return tp_size != 1 || ep_size != 1 || nnodes > 1; }
  // The ranks this process runs: tp_size / nnodes in a group, 1 with single_rank or without a group.
  int local_ranks() const { return is_group() && single_rank < 0 ? tp_size / (nnodes > 0 ? nnodes : 1) : 1; }
};

// What one load asks for: the runner's sizes (every backend), the GPU part and the parallel part.
struct LoadOptions {
  DType kv_dtype = DType::BF16;  // KV cache: BF16 (default), F32, or F8_E4M3 (checkpoint k/v scales, else from
                                 // the first prompt chunk; logged either way)
  int64_t max_context = 0;       // longest sequence; 0: the model's max_position_embeddings
  int64_t kv_pages = 0;          // KV pool pages; 0: CPU: state_slots * ceil(max_context / page_size); GPU: the
                                 // memory the plan leaves (backend/device.h)
  int page_size = 16;            // tokens per KV page
  int state_slots = 4;           // recurrent / conv state slots; GPU: 0 lets the memory plan choose
  int slots_per_request = 1;     // GPU plan: state slots per running request (3 with the prefix cache: its
                                 // own, its boundary snapshot, one cached snapshot)
  int threads = 0;               // CPU worker threads (0: the pool's size as it is); only before the pool starts
  int64_t prefill_chunk = 512;   // most tokens per forward pass
  DeltaRuleMode prefill_delta_rule = DeltaRuleMode::chunked;  // recurrent: token by token everywhere
  model::LoadFormat load_format = model::LoadFormat::safetensors;  // dummy: random weights from config.json
  bool mtp = false;  // load and run the checkpoint's MTP head (speculative decoding) when it has one
  bool vision = false;  // load the checkpoint's vision tower (image inputs) when it has one (rank 0 of a group)
  // The most patches one image can have (the image processor's max_pixels / patch^2): the GPU memory plan reserves
  // the vision tower's activations for it.
  int64_t vision_max_patches = 0;
  GpuLoadOptions gpu;
  ParallelOptions parallel;
};

}  // namespace kiln::backend
