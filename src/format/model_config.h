// The typed model configuration, parsed from a Hugging Face config.json (+ generation_config.json).
//
// Supported model_type values: qwen3_5_moe (settings under text_config, or at top level for a text-only
// Qwen3_5MoeForCausalLM checkpoint), qwen3_5 (dense hybrid), qwen3_next, qwen3_moe, qwen3. Missing keys
// take the defaults of the matching transformers configuration_*.py.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "format/model_dir.h"

namespace kiln::format {

enum class Arch { qwen3, qwen3_moe, qwen3_next, qwen3_5, qwen3_5_moe };
const char* arch_name(Arch a);  // the model_type spelling: "qwen3_5_moe"

enum class LayerType { linear_attention, full_attention };
// How BF16 routed experts are stored: fused 3-D tensors (mlp.experts.gate_up_proj [E, 2I, H],
// mlp.experts.down_proj [E, H, I]) or one set of linears per expert (mlp.experts.{e}.{gate,up,down}_proj).
// Quantised (ModelOpt) experts are always per expert.
enum class ExpertLayout { fused, per_expert };
const char* layer_type_name(LayerType t);  // "linear_attention" / "full_attention"

// The vision tower of a Qwen3.5 / Qwen3.5-MoE checkpoint (config.json "vision_config"; transformers
// Qwen3_5MoeVisionConfig / Qwen3_5VisionConfig, whose defaults these are). model/qwen3_5_vision.h runs it.
struct VisionConfig {
  int depth = 27;                        // transformer blocks
  int64_t hidden_size = 1152;
  int64_t intermediate_size = 4304;      // the blocks' MLP
  int num_heads = 16;
  std::string hidden_act = "gelu_pytorch_tanh";  // the blocks' MLP activation (the merger's is always erf GELU)
  int in_channels = 3;
  int patch_size = 16;                   // spatial patch side, pixels
  int temporal_patch_size = 2;           // frames per patch (an image is repeated to fill them)
  int spatial_merge_size = 2;            // m: m x m patches merge into one output token
  int64_t out_hidden_size = 3584;        // the merger's output: the language model's hidden size
  int64_t num_position_embeddings = 2304;  // learned position grid side^2 (48 x 48)
  double rope_theta = 10000.0;           // vision_config.rope_parameters.rope_theta (axial 2-D rotary)
  double layer_norm_eps = 1e-6;          // fixed in transformers (nn.LayerNorm(..., eps=1e-6))

  int64_t head_dim() const { return num_heads > 0 ? hidden_size / num_heads : 0; }
  // Values per patch row of pixel_values: C * T * P * P (the Conv3d's flattened kernel).
  int64_t patch_dim() const {
    return int64_t{in_channels} * temporal_patch_size * patch_size * patch_size;
  }
  int64_t merge_unit() const { return int64_t{spatial_merge_size} * spatial_merge_size; }  // patches per token
  int64_t merged_hidden() const { return hidden_size * merge_unit(); }  // the merger's input width
  int position_grid_side() const;  // sqrt(num_position_embeddings); 0 when that is not a square
};

struct ModelConfig {
  Arch arch = Arch::qwen3;
  std::string model_type;    // as written at the top level of config.json ("qwen3_5_moe")
  std::string architecture;  // architectures[0] ("Qwen3_5MoeForConditionalGeneration"), may be empty
  // Things config.json says that kiln does not act on but the user should know (architectures naming
  // another family than model_type). load_model_config logs them as warnings.
  std::vector<std::string> warnings;
  // The vision tower (qwen3_5 / qwen3_5_moe with a "vision_config" object). has_vision is false without one, or when
  // its settings cannot run (vision_problem says why; the text model is unaffected and a warning is logged).
  bool has_vision = false;
  VisionConfig vision;
  std::string vision_problem;
  // The multimodal special tokens (top level of config.json; transformers' defaults for Qwen3.5 when absent).
  int64_t image_token_id = -1;
  int64_t video_token_id = -1;
  int64_t vision_start_token_id = -1;
  int64_t vision_end_token_id = -1;

  int64_t hidden_size = 0;
  int num_layers = 0;
  std::vector<LayerType> layer_types;  // [num_layers]
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;

  // Full (softmax) attention.
  int num_attention_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  bool attn_output_gate = false;  // q_proj emits [q | gate] per head (qwen3_5*, qwen3_next)
  bool attention_bias = false;    // q/k/v/o projections have biases

  // Linear attention (Gated DeltaNet); zero for qwen3/qwen3_moe.
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel = 0;

  // Feed-forward. num_experts == 0: dense MLP of intermediate_size in every layer.
  int num_experts = 0;
  int experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  // 0: no shared expert
  int64_t intermediate_size = 0;                // dense MLP size (dense models, qwen3_moe mlp_only layers)
  bool norm_topk_prob = true;                   // renormalise the top-k routing weights
  int decoder_sparse_step = 1;                  // qwen3_moe / qwen3_next: MoE in layers (i+1) % step == 0
  std::vector<int> mlp_only_layers;             // qwen3_moe / qwen3_next: dense MLP in these layers

  // Rotary embedding.
  std::string rope_type = "default";
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;  // fraction of head_dim that is rotated
  std::vector<int> mrope_section;      // M-RoPE sections (qwen3_5*), empty otherwise
  bool mrope_interleaved = false;

  // Multi-token prediction head (mtp.* tensors, qwen3_5* / qwen3_next): decoder layers after the main ones,
  // config.json's mtp_num_hidden_layers (or num_nextn_predict_layers). Layer index num_layers + k names MTP layer k
  // (format::layer_prefix gives "mtp.layers.k."). weight_map's verify_checkpoint() sets it to 0 when the checkpoint
  // holds no usable head.
  int mtp_num_layers = 0;

  double rms_norm_eps = 1e-6;
  bool norm_zero_centred = false;  // RMSNorm computes x * (1 + w) (qwen3_5*, qwen3_next)
  bool tie_word_embeddings = false;

  std::vector<int64_t> eos_token_ids;  // union of config.json and generation_config.json, sorted
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;
  std::string torch_dtype;  // "bfloat16", ... ("" when absent)

  // Prefix of the language model's tensors: "model.language_model." (VL checkpoint) or "model.".
  // Set from the architecture; weight_map's detect_tensor_prefix() refines it from the checkpoint.
  std::string tensor_prefix = "model.";
  // BF16 expert layout: fused for qwen3_5_moe, per expert for qwen3_moe / qwen3_next (their released
  // checkpoints); weight_map's verify_checkpoint() refines it from the checkpoint.
  ExpertLayout expert_layout = ExpertLayout::fused;
  ExpertLayout mtp_expert_layout = ExpertLayout::fused;  // the MTP layers' (may differ from the main layers')

  // Helpers.
  bool is_moe() const { return num_experts > 0; }
  bool layer_is_full_attention(int layer) const { return layer_types[layer] == LayerType::full_attention; }
  bool layer_is_moe(int layer) const;  // this layer's FFN is the sparse MoE block (MTP layers: as layer k)
  bool has_mtp() const { return mtp_num_layers > 0; }
  int num_full_attention_layers() const;
  int num_linear_attention_layers() const;
  int rotary_dim() const;  // head_dim * partial_rotary_factor (even)
  // "15 x [linear, linear, linear, full]" or "28 x [full]" or the full list when there is no period.
  std::string layer_pattern() const;
};

// Parses config.json text (and optionally generation_config.json text; empty = absent).
// `source` names the config in error messages.
ModelConfig parse_model_config(std::string_view config_json, std::string_view generation_config_json = {},
                               std::string_view source = "config.json");
// config.json (+ generation_config.json if present) of a model directory.
ModelConfig load_model_config(const ModelDir& dir);

}  // namespace kiln::format
