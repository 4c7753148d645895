// The weights of a loaded language model, as views the backend reads (mmapped checkpoint bytes on the
// CPU; device copies on a GPU). Built by a family's bind_layer() through a WeightBinder.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "format/shard_plan.h"
#include "format/weight_map.h"
#include "model/ops.h"

namespace kiln::model {

struct AttentionWeights {
  LinearWeight q_proj;  // [q_heads * D * (output gate ? 2 : 1), H]; with the gate, per head [q(D) | gate(D)]
  LinearWeight k_proj;  // [kv_heads * D, H]
  LinearWeight v_proj;  // [kv_heads * D, H]
  LinearWeight o_proj;  // [H, q_heads * D]
  TensorView q_norm;    // [D]
  TensorView k_norm;    // [D]
  float k_scale = 0.0f;  // FP8 KV-cache scales from the checkpoint (k_proj.k_scale); 0 = absent
  float v_scale = 0.0f;
};

struct LinearAttentionWeights {
  // qwen3_5 / qwen3_5_moe: separate projections.
  LinearWeight in_proj_qkv;  // [2 * Hk * Dk + Hv * Dv, H]   rows q | k | v
  LinearWeight in_proj_z;    // [Hv * Dv, H]
  LinearWeight in_proj_b;    // [Hv, H]
  LinearWeight in_proj_a;    // [Hv, H]
  // qwen3_next: fused, interleaved per key-head group g: [q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)] and
  // [b_g (r) | a_g (r)], r = Hv / Hk.
  LinearWeight in_proj_qkvz;  // [Hk * (2 Dk + 2 r Dv), H]
  LinearWeight in_proj_ba;    // [Hk * 2 r, H]
  TensorView conv1d;   // [C, Kc] (the checkpoint's [C, 1, Kc]), C = 2 Hk Dk + Hv Dv
  TensorView A_log;    // [Hv]
  TensorView dt_bias;  // [Hv]
  TensorView norm;     // [Dv] gated RMSNorm weight (plain w)
  LinearWeight out_proj;  // [H, Hv * Dv]
};

struct MlpWeights {
  LinearWeight gate_proj;  // [I, H]
  LinearWeight up_proj;    // [I, H]
  LinearWeight down_proj;  // [H, I]
};

struct MoeWeights {
  LinearWeight router;  // [E, H], never quantised
  std::vector<ExpertWeights> experts;  // [E]
  bool has_shared_expert = false;
  MlpWeights shared_expert;
  LinearWeight shared_expert_gate;  // [1, H]
};

struct LayerWeights {
  format::LayerType type = format::LayerType::full_attention;
  TensorView input_norm;           // [H]
  TensorView post_attention_norm;  // [H]
  AttentionWeights attn;           // full-attention layers
  LinearAttentionWeights linear;   // linear-attention layers
  bool is_moe = false;
  MoeWeights moe;   // is_moe
  MlpWeights mlp;   // !is_moe
};

// The multi-token-prediction head (Qwen3.5 / Qwen3-Next "mtp.*"): x = fc([norm_e(embed(t)) | norm_h(h)]), one
// decoder layer (bound by the family as layer num_layers), then `norm` and the shared lm_head.
struct MtpWeights {
  LinearWeight fc;                  // [H, 2H], columns [embedding | hidden]
  TensorView pre_fc_norm_embedding;  // [H]
  TensorView pre_fc_norm_hidden;     // [H]
  TensorView norm;                   // [H]
  LayerWeights layer;                // full attention + the family's FFN
};

struct ModelWeights {
  TensorView embed_tokens;  // [V, H]; a vocabulary-parallel rank: its rows [vocab_begin, vocab_begin + V / tp)
  TensorView final_norm;    // [H]
  LinearWeight lm_head;     // [V, H] (the embedding when tied); a vocabulary-parallel rank: the same rows
  bool vocab_parallel = false;  // embed_tokens / lm_head hold only the rows from vocab_begin (tensor-parallel rank)
  int64_t vocab_begin = 0;
  std::vector<LayerWeights> layers;
  bool has_mtp = false;  // config.mtp_num_layers > 0 and the head was bound
  MtpWeights mtp;
  int64_t bytes_by_format[3] = {0, 0, 0};  // linear weight bytes per WeightFormat
  // Host copies of tensor-parallel slices that are not contiguous in the checkpoint, kept where the backend reads
  // them in place (the CPU); a backend that copies them gets them freed once its copies are done.
  std::vector<std::unique_ptr<uint8_t[]>> slice_storage;
};

// A tensor-parallel rank's view of the checkpoint: the full config (what the checkpoint stores), the rank's shard
// (format/shard_plan.h) and every expected tensor by name, for slice_tensor().
struct RankSlicing {
  format::ModelConfig full;
  format::RankShard rank;
  std::map<std::string, format::ExpectedTensor, std::less<>> tensors;
};

// Looks tensors up by name and turns them into backend views (Ops::place_weight), choosing each linear's
// storage from the quantisation config (format::effective_scheme) and checking shapes. With a RankSlicing, every
// tensor is first cut to the rank's slice (rows / columns / heads / experts; NVFP4 bytes and block scales alike) and
// shapes are checked against the rank's config (`config`, format::rank_config); another rank's expert comes back
// empty (present() false).
class WeightBinder {
 public:
  WeightBinder(const format::Checkpoint& ckpt, const format::ModelConfig& config, const format::QuantConfig& quant,
               Ops& ops, ModelWeights& model, const RankSlicing* slicing = nullptr)
      : ckpt_(ckpt), config_(config), quant_(quant), ops_(ops), model_(model), slicing_(slicing) {}

  const format::ModelConfig& config() const { return config_; }
  // Norm weights' identity for a synthetic (--load-format dummy) checkpoint's random fill.
  void set_dummy_norm_kind(NormKind k) { dummy_norm_kind_ = k; }
  // config.tensor_prefix + "layers.{layer}."
  std::string layer_prefix(int layer) const;
  // A plain tensor (norm weights, conv, A_log, ...), viewed with `shape` (numel must match).
  TensorView tensor(const std::string& name, Shape shape) const;
  bool has(const std::string& name) const { return ckpt_.has(name); }
  // The linear module `module` (no ".weight"), W [out_features, in_features].
  LinearWeight linear(const std::string& module, int64_t out_features, int64_t in_features) const;
  // A view of rows [row_begin, row_begin + rows) of a dense 3-D tensor [E, R, K], as a dense LinearWeight.
  LinearWeight dense_slice(const std::string& name, int64_t expert, int64_t row_begin, int64_t rows) const;
  float scalar(const std::string& name) const;
  // The bytes this binder will place for the tensors of `expected` found in the checkpoint (the rank's slices;
  // scalars read on the host left out): the total of the load's progress line.
  uint64_t bytes_to_place(const std::vector<format::ExpectedTensor>& expected) const;
  // Ops::finish_weights(): every placed weight holds its bytes; then frees the host copies of slices the backend
  // copied from (the CPU backend reads its slices in place: those stay in ModelWeights::slice_storage).
  void finish();

 private:
  // Ops::place_weight once per checkpoint tensor (slices of one tensor share the placement); the rank's slice of
  // it with a RankSlicing (data null when the rank holds none of it).
  TensorView place(const format::TensorInfo& t) const;
  // The rank's slice of t (whole without a RankSlicing).
  format::TensorSlice slice_of(const format::TensorInfo& t) const;

  const format::Checkpoint& ckpt_;
  const format::ModelConfig& config_;
  const format::QuantConfig& quant_;
  Ops& ops_;
  ModelWeights& model_;
  mutable std::map<std::string, TensorView, std::less<>> placed_;
  // Host copies of slices a backend is copying from: alive until finish().
  mutable std::vector<std::unique_ptr<uint8_t[]>> copying_from_;
  NormKind dummy_norm_kind_ = NormKind::plain;
  const RankSlicing* slicing_ = nullptr;
};

}  // namespace kiln::model
