// Memory and bandwidth planning for a model on N GPUs (kiln inspect; the engine's startup summary).
//
// Definitions (all bytes as stored, language model and its MTP head (config.mtp_num_layers); vision tower excluded):
//  - params_total: logical parameters (an FP4 byte holds 2; scale tensors hold none).
//  - params_active: everything except routed experts, plus experts_per_tok / num_experts of them (main model;
//    the MTP head is counted in params_total / weight_bytes and on its own in mtp_params / mtp_weight_bytes).
//  - decode_bytes_per_token: what one decode step at batch 1 reads: all non-expert weights, top-k
//    routed experts (k/E of the routed bytes), shared experts, lm_head; the embedding counts one row.
//  - kv_bytes_per_token: (full-attention layers + MTP layers) x 2 (K, V) x kv_heads x head_dim x KV dtype size.
//  - state_bytes_per_sequence: per linear-attention layer, the recurrent state
//    (value_heads x key_dim x value_dim x recurrent_state_bytes) + the conv state (conv_dim x (kernel-1) x
//    conv_state_bytes); twice that with an MTP head (the runner's checkpoint of each slot for speculative
//    verification).
//  - Tensor parallel over tp GPUs (ep of them expert-parallel groups): each GPU's bytes are the slices the
//    loader gives its rank (format/shard_plan.h, the one definition): heads, intermediate rows / columns, experts
//    and vocabulary rows split; norms, routers, scalar scales replicated; KV projections (and linear-attention key
//    heads) replicated once tp exceeds them. A tp / ep that does not divide the model is a kiln::Error, as at
//    load time. weight_bytes_per_gpu is the busiest rank's.
//  - max_kv_tokens = (gpu_mem x mem_fraction_static - weights per GPU - activation reserve)
//                    / kv_bytes_per_token_per_gpu  (recurrent state for live sequences not included).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "format/model_config.h"
#include "format/safetensors.h"
#include "format/weight_map.h"

namespace kiln::format {

struct CapacityOptions {
  int tp = 1;                          // GPUs the model is split over
  int ep = 1;                          // expert-parallel groups among them (divides tp)
  double gpu_mem_gib = 0;              // memory per GPU; 0: skip the per-GPU budget (max_kv_tokens = -1)
  double mem_fraction_static = 0.90;   // share of GPU memory for weights + KV cache (rest: runtime)
  double activation_reserve_gib = 2.0; // per GPU, for activations / workspaces
  DType kv_dtype = DType::BF16;        // BF16 or F8_E4M3
  int conv_state_bytes = 4;            // element size of the conv state (kiln keeps it in fp32)
  int recurrent_state_bytes = 4;       // element size of the recurrent state (4: fp32; 2: --mamba-ssm-dtype bfloat16)
};

struct CapacityPlan {
  int64_t params_total = 0;
  int64_t params_active = 0;
  int64_t mtp_params = 0;           // the MTP head's share of params_total (0 without one)
  uint64_t mtp_weight_bytes = 0;    // its share of weight_bytes
  uint64_t weight_bytes = 0;
  std::map<DType, uint64_t> weight_bytes_by_dtype;
  std::map<std::string, uint64_t> weight_bytes_by_role;
  uint64_t decode_bytes_per_token = 0;
  std::map<std::string, uint64_t> decode_bytes_by_role;
  uint64_t kv_bytes_per_token = 0;
  uint64_t recurrent_state_bytes_per_layer = 0;  // S at recurrent_state_bytes per element
  uint64_t conv_state_bytes_per_layer = 0;
  uint64_t state_bytes_per_sequence = 0;
  bool sizes_from_checkpoint = false;  // real tensor sizes were used

  // Per GPU (tp).
  int tp = 1, ep = 1;
  uint64_t weight_bytes_per_gpu = 0;  // the busiest GPU
  uint64_t decode_bytes_per_token_per_gpu = 0;  // average over GPUs (routed experts spread evenly)
  uint64_t kv_bytes_per_token_per_gpu = 0;
  uint64_t state_bytes_per_sequence_per_gpu = 0;
  uint64_t gpu_bytes = 0;                // gpu_mem_gib in bytes
  uint64_t static_budget_bytes = 0;      // gpu_bytes x mem_fraction_static
  uint64_t activation_reserve_bytes = 0;
  int64_t kv_budget_bytes = 0;           // may be negative: weights do not fit
  int64_t max_kv_tokens = -1;            // -1 when gpu_mem_gib is 0; 0 when nothing fits
  std::vector<std::string> notes;        // replication and other caveats
};

// `ckpt` (optional): use the real stored size of each expected tensor found in it.
CapacityPlan plan_capacity(const ModelConfig& config, const std::vector<ExpectedTensor>& tensors,
                           const CapacityOptions& options, const Checkpoint* ckpt = nullptr);

}  // namespace kiln::format
