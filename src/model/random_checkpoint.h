// A full-size checkpoint with random weights in the real on-disk layout, written from config.json alone.
//
// The tensors are those of `--load-format dummy` (model/dummy_weights.h), with the same values: loading the
// written folder gives the same weights as `--load-format dummy` on its config. A config with a vision tower
// (vision_config) also gets the tower's tensors (BF16, under model.visual.), as the releases ship it, so that
// `kiln serve` on the folder takes images (`--load-format dummy` loads no tower). What it is for: timing the
// real load path (safetensors shards, mmap, upload) and serving benchmarks through `kiln serve` on a model
// of the real size without a download. The output of such a model is meaningless text.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "format/model_dir.h"

namespace kiln::model {

struct RandomCheckpointOptions {
  uint64_t max_shard_bytes = 5ull << 30;  // as Hugging Face's default-ish 5 GB shards
  // Called after each tensor with (bytes written so far, total bytes).
  std::function<void(uint64_t done, uint64_t total)> progress;
};

struct RandomCheckpointSummary {
  size_t tensors = 0;
  uint64_t bytes = 0;
  std::vector<std::string> files;  // safetensors shards (+ index) written
};

// Writes the weights of `config_dir` (config.json, optional hf_quant_config.json) into `out_dir` (created;
// kiln::Error if it already holds safetensors files). Only weights: the caller adds tokenizer and config files.
RandomCheckpointSummary write_random_checkpoint(const format::ModelDir& config_dir, const std::string& out_dir,
                                                const RandomCheckpointOptions& options);

}  // namespace kiln::model
