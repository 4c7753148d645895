// Loading a model on the CPU backend.
#pragma once
#include <string>
#include <memory>

#include "backend/backend.h"
#include "backend/rendezvous.h"
#include "format/model_dir.h"
#include "model/model.h"
#include "model/model_runner.h"
#include "model/runner.h"

namespace kiln::backend {

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
  int threads = 0;               // worker threads (0: KILN_THREADS or all cores); only before the pool starts
  int64_t prefill_chunk = 512;   // most tokens per forward pass
  DeltaRuleMode prefill_delta_rule = DeltaRuleMode::chunked;  // recurrent: token by token everywhere
  model::LoadFormat load_format = model::LoadFormat::safetensors;  // dummy: random weights from config.json
  // GPU only (backend/device.h): share of GPU memory for weights + KV cache + state + activations; 0: 0.90.
  double mem_fraction_static = 0;
  // Kernel choices (SGLang's flag names): "auto" resolves per device / GPU architecture.
  std::string attention_backend = "auto";
  std::string moe_runner_backend = "auto";
  std::string fp4_gemm_backend = "auto";
  // --dtype (SGLang's name): auto, bfloat16, float16 or float32, the precision activations enter the tensor cores
  // with; resolved per device by backend::resolve_dtype (device.h). The CPU backend always runs fp32.
  std::string dtype = "auto";
  bool cuda_graphs = true;  // capture and replay decode steps
  bool mtp = false;         // load and run the checkpoint's MTP head (speculative decoding) when it has one
  // Tensor / expert parallelism (--tp-size, --ep-size; SGLang's names): tp ranks, ep expert-parallel groups among
  // them. On the CPU the ranks are threads of this process over the in-process communicator (backend/comm_local.h).
  int tp_size = 1;
  int ep_size = 1;
  // GPU ranks (SGLang's names): rank r of this node runs on CUDA device base_gpu_id + r * gpu_id_step; a step of 0
  // puts every rank on one GPU (correctness runs: the ranks share its memory, the peer all-reduce joins them).
  int base_gpu_id = 0;
  int gpu_id_step = 1;
  // Several machines (--nnodes, --node-rank, --dist-init-addr host:port): tp_size ranks over nnodes nodes, this
  // node's tp_size / nnodes of them; NCCL's unique id is exchanged over dist_init_addr (node 0 listens there).
  int nnodes = 1;
  int node_rank = 0;
  std::string dist_init_addr;
  int dist_timeout_s = 600;  // --dist-timeout: the longest wait for the other nodes at startup (rendezvous, loading)
  // cuda: all-reduces through NCCL only, not the one-shot peer-memory kernel (--disable-custom-all-reduce).
  bool disable_custom_all_reduce = false;
  // bench-engine --single-rank R: load only rank R of the --tp-size plan on one GPU, its all-reduces replaced by a
  // device copy of the same size (the decode cost of one GPU of a larger group); -1: off.
  int single_rank = -1;
  // Set by the loader from the memory plan, not a flag: the activation estimate of one pass (bytes), the size of a
  // CUDA rank's first scratch block.
  double scratch_plan_bytes = 0;
};

// The runner options these load options ask for (every backend's runner starts from them).
model::RunnerOptions runner_options(const LoadOptions& options);

// Several machines: meets the other nodes of this launch at options.dist_init_addr (backend/rendezvous.h) and keeps
// the connections as the group's link. Every node must agree on the model, --tp-size, --ep-size, the device and the
// dtypes (the fingerprint). Node 0 decides the runner's sizes: its KV pages, state slots, context, page size and
// pass size (ro) reach every node and replace theirs there (so `kiln generate` on node 0 sizes the group as well as
// `kiln serve`); node 0's payload (the NCCL id) reaches every node. `device`: "cpu" or "cuda".
struct NodeJoin {
  std::shared_ptr<model::NodeLink> link;
  std::vector<uint8_t> payload;
};
NodeJoin join_nodes(const format::ModelDir& dir, const LoadOptions& options, const std::string& device,
                    model::RunnerOptions& ro, const std::vector<uint8_t>& payload);

// The CPU backend's Ops (for tests and tools that drive ops directly).
std::unique_ptr<Backend> make_cpu_backend();

// Loads `dir` (config, quantisation config, checkpoint verified against the config: a mismatch is a kiln::Error
// listing every problem) and returns a ready runner (a model::Runner).
std::unique_ptr<model::ModelRunner> load_cpu_model(const format::ModelDir& dir, const LoadOptions& options);

}  // namespace kiln::backend
