// `--load-format dummy`: full-size models from config.json alone, for benchmarks with no download.
//
// The tensors are the ones format::expected_tensors() lists (optional ones left out), with no bytes; each is filled
// by the backend (Ops::place_random, on the GPU for the CUDA backend) with deterministic random values of the right
// kind: valid NVFP4 codes and E4M3 block scales in a safe range, BF16 weights of variance 1/K (activations keep their
// scale through the layers), norm weights near their identity. Scalars (weight_scale_2, FP8 weight_scale,
// input_scale) are set so that dequantised weights have the same variance. The output is meaningless text; the
// shapes, dtypes and bytes moved are the real model's.
#pragma once
#include <string>

#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "model/ops.h"

namespace kiln::model {

// The synthetic checkpoint of `config` + `quant` (tensor prefix and expert layout as the architecture implies). With
// `vision` and a config with a usable vision tower, the tower's tensors too (under "model.visual.", BF16, as the
// releases store it).
format::Checkpoint dummy_checkpoint(const format::ModelDir& dir, const format::ModelConfig& config,
                                    const format::QuantConfig& quant, bool vision = false);
// How tensor `t` of a synthetic checkpoint is filled (seeded by its name).
RandomFill dummy_fill(const format::TensorInfo& t, NormKind norm_kind);
// The value of scalar tensor `name` (weight_scale_2, weight_scale, input_scale, k_scale / v_scale).
float dummy_scalar(const std::string& name, const format::Checkpoint& ckpt);

}  // namespace kiln::model
