// Loading a model directory into backend weight views: config + quantisation config, checkpoint verification
// (every mismatch listed in one error), the family chosen by architecture, and the weights bound.
#pragma once
#include <memory>
#include <optional>

#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "format/shard_plan.h"
#include "format/weight_map.h"
#include "model/family.h"
#include "model/qwen3_5_vision.h"
#include "model/weights.h"

namespace kiln::model {

struct LoadedModel {
  format::ModelDir dir;
  format::ModelConfig config;       // what the runner runs: a tensor-parallel rank's local head counts / sizes
  format::ModelConfig full_config;  // the checkpoint's (equal to config on one device)
  std::optional<format::RankShard> shard;  // set for a rank of a tensor-parallel group (tp > 1)
  format::QuantConfig quant;
  std::unique_ptr<format::Checkpoint> checkpoint;  // keeps the mapped bytes alive
  format::VerifyReport report;
  const Family* family = nullptr;
  ModelWeights weights;
  std::optional<VisionWeights> vision;  // the vision tower, when loaded
};

// How weights are obtained: from the checkpoint's safetensors, or random (`--load-format dummy`: config.json alone,
// see dummy_weights.h).
enum class LoadFormat : uint8_t { safetensors, dummy };
// "auto" / "safetensors" -> safetensors, "dummy" -> dummy; kiln::Error otherwise.
LoadFormat parse_load_format(const std::string& name);

// Throws kiln::Error when the config is unsupported or the checkpoint does not match it. With `shard` (a rank of a
// tensor-parallel plan, format/shard_plan.h), only the rank's slice of each tensor is placed and the model's config
// is the rank's (format::rank_config).
// With `with_mtp` false an MTP head in the checkpoint is left unloaded (config.mtp_num_layers 0). With `with_vision`
// the vision tower (model.visual.*) is loaded when config.json describes one it can run and the checkpoint holds its
// tensors (not with dummy weights; on a tensor-parallel group only by rank 0, which encodes every image).
std::unique_ptr<LoadedModel> load_model(const format::ModelDir& dir, Ops& ops,
                                        LoadFormat load_format = LoadFormat::safetensors,
                                        const format::RankShard* shard = nullptr, bool with_mtp = false,
                                        bool with_vision = false);

}  // namespace kiln::model
