// Which tensors a checkpoint of a given model family + quantisation must contain, with dtypes and
// shapes, and a checker that reports every mismatch at once.
//
// Names follow transformers exactly. With P = config.tensor_prefix ("model.language_model." or
// "model.") and L = P + "layers.{i}.":
//   P embed_tokens.weight [V, H]; P norm.weight [H]; lm_head.weight [V, H] (absent when tied)
//   L input_layernorm.weight, L post_attention_layernorm.weight [H]
//   full attention:   L self_attn.{q_proj,k_proj,v_proj,o_proj}, L self_attn.{q_norm,k_norm}.weight [D]
//                     (q_proj has 2*heads*D rows when attn_output_gate)
//   linear attention: L linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj},
//                     conv1d.weight [C,1,K], A_log [Hv], dt_bias [Hv], norm.weight [Dv]
//                     (qwen3_next: in_proj_qkvz and in_proj_ba instead of the four in_proj_*)
//   MoE:              L mlp.gate.weight [E, H]; L mlp.shared_expert.{gate,up,down}_proj;
//                     L mlp.shared_expert_gate.weight [1, H];
//                     BF16 experts fused: L mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]
//                     quantised experts:  L mlp.experts.{e}.{gate,up,down}_proj.*
//   dense MLP:        L mlp.{gate,up,down}_proj
//   MTP head (config.mtp_num_layers > 0): mtp.fc.weight [H, 2H] (always unquantised: NVFP4 releases store it BF16
//                     without listing it in the exclude list), mtp.pre_fc_norm_embedding.weight,
//                     mtp.pre_fc_norm_hidden.weight, mtp.norm.weight [H], and layer num_layers + k under
//                     "mtp.layers.k." with the full-attention layer's tensors above (layer index num_layers + k)
// A linear "X" [N out, K in] expands by scheme: none -> X.weight (BF16/F16/F32); nvfp4 -> X.weight U8
// [N, K/2], X.weight_scale F8_E4M3 [N, K/16], X.weight_scale_2 F32 [], X.input_scale F32 [];
// fp8 -> X.weight F8_E4M3 [N, K], X.weight_scale F32 [], X.input_scale F32 [].
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/safetensors.h"

namespace kiln::format {

// Roles (ExpectedTensor::role), used by capacity planning and tensor-parallel splitting.
namespace role {
inline constexpr const char* kEmbedding = "embedding";          // embed_tokens
inline constexpr const char* kLmHead = "lm_head";
inline constexpr const char* kNorm = "norm";                    // every RMSNorm weight
inline constexpr const char* kAttention = "attention";          // full-attention projections
inline constexpr const char* kLinearAttention = "linear_attention";  // Gated DeltaNet params
inline constexpr const char* kRouter = "router";                // mlp.gate, shared_expert_gate
inline constexpr const char* kRoutedExpert = "routed_expert";
inline constexpr const char* kSharedExpert = "shared_expert";
inline constexpr const char* kDenseMlp = "dense_mlp";
inline constexpr const char* kKvScale = "kv_scale";             // k_proj.k_scale / v_proj.v_scale
inline constexpr const char* kMtpFc = "mtp_fc";                 // mtp.fc (replicated under tensor parallelism)
inline constexpr const char* kVision = "vision";                // the vision tower (model.visual.*)
}  // namespace role

struct ExpectedTensor {
  std::string name;
  std::vector<DType> dtypes;  // accepted dtypes, first = the one expected by default (used for sizes)
  Shape shape;
  std::string role;           // one of role::k*
  int layer = -1;             // decoder layer, -1 for embeddings / final norm / lm_head
  int expert = -1;            // routed expert index when stored per expert, else -1
  bool optional = false;      // may be absent (kv scales)
  int64_t params = 0;         // logical parameters it holds (FP4 weight: 2 per byte; scales: 0)

  uint64_t nbytes() const;  // shape x dtype_size(dtypes[0]) (U8 FP4 packed: already halved in shape)
};

// Tensor name of layer i's prefix: config.tensor_prefix + "layers.{i}."; the MTP head's layer k is layer
// num_layers + k: "mtp.layers.{k}.".
std::string layer_prefix(const ModelConfig& config, int layer);

// The scheme a linear module actually uses: routers (mlp.gate, mlp.shared_expert_gate) are always
// none; everything else follows quant.scheme_for(). Logs a note (once per process) when the quant config
// would have quantised a router.
QuantScheme effective_scheme(const ModelConfig& config, const QuantConfig& quant, const std::string& module);

// Every tensor the language model needs, in layer order. Scalars (shape []) also match a stored [1].
// Uses config.tensor_prefix and config.expert_layout as they are (verify_checkpoint() sets both from
// the checkpoint).
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& config, const QuantConfig& quant);

// "model.language_model." or "model.", whichever the checkpoint's embed_tokens uses; kiln::Error if
// neither is found.
std::string detect_tensor_prefix(const Checkpoint& ckpt);

// The vision tower's tensors (config.vision, config.has_vision) under `prefix`, every one BF16 / F16 / F32 (the NVFP4
// releases keep the tower BF16 and list model.visual* in their exclude list), with h = hidden_size, I =
// intermediate_size, M = h * spatial_merge_size^2, role kVision, layer = the block (-1 for the others):
//   patch_embed.proj.weight [h, C, T, P, P] (the Conv3d), patch_embed.proj.bias [h], pos_embed.weight [num_pos, h]
//   blocks.{i}.norm1.{weight,bias} [h], blocks.{i}.norm2.{weight,bias} [h]
//   blocks.{i}.attn.qkv.weight [3h, h] (rows q | k | v), .bias [3h]; blocks.{i}.attn.proj.weight [h, h], .bias [h]
//   blocks.{i}.mlp.linear_fc1.weight [I, h], .bias [I]; blocks.{i}.mlp.linear_fc2.weight [h, I], .bias [h]
//   merger.norm.{weight,bias} [h]; merger.linear_fc1.weight [M, M], .bias [M];
//   merger.linear_fc2.weight [out_hidden_size, M], .bias [out_hidden_size]
std::vector<ExpectedTensor> expected_vision_tensors(const ModelConfig& config, const std::string& prefix);
// "model.visual." (the Qwen3.5 releases) or "visual.", whichever holds patch_embed.proj.weight; "" when neither does.
std::string detect_vision_prefix(const Checkpoint& ckpt);
// Checks the vision tower against expected_vision_tensors under detect_vision_prefix and returns that prefix. One
// kiln::Error listing every mismatch, or saying that config.json has no usable vision_config (config.vision_problem)
// or that the checkpoint holds no vision tower.
std::string verify_vision_tensors(const Checkpoint& ckpt, const ModelConfig& config);

struct VerifyReport {
  int64_t matched = 0;          // expected tensors found with the right dtype and shape
  int64_t ignored_vision = 0;   // model.visual.* tensors (not used by a text server)
  int64_t ignored_mtp = 0;      // mtp.* tensors not used (the config names no MTP head, or it was left off)
  std::string mtp_problem;      // why the checkpoint's MTP head was left off ("" when loaded or absent)
  int64_t unexpected = 0;       // other tensors nobody asked for (logged, not an error)
  int64_t optional_missing = 0;
};

// Checks `ckpt` against expected_tensors(config, quant). Reports ALL mismatches (missing, wrong dtype,
// wrong shape) in one kiln::Error (first 20 listed, then the count). Sets config.tensor_prefix from
// the checkpoint first (detect_tensor_prefix). An MTP head the config names but the checkpoint lacks (or holds
// with other shapes / dtypes) is left off with a note: config.mtp_num_layers becomes 0 and the main model loads.
VerifyReport verify_checkpoint(const Checkpoint& ckpt, ModelConfig& config, const QuantConfig& quant);

}  // namespace kiln::format
