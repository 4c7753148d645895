// Quantisation config of a ModelOpt checkpoint: hf_quant_config.json, or config.json's
// "quantization_config" (quant_method "modelopt"). Absent both: nothing is quantised.
//
// quant_algo NVFP4 or FP8: every linear is quantised except modules matching an exclude glob
// (exclude_modules / ignore); MIXED_PRECISION: exactly the modules listed in quantized_layers, each with
// its own algo. Globs: '*' matches any run of characters (dots included), '?' one character, and the
// pattern must match the whole module name.
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "format/model_dir.h"

namespace kiln::format {

enum class QuantScheme { none, nvfp4, fp8 };
const char* quant_scheme_name(QuantScheme s);  // "none", "nvfp4", "fp8"

// Whole-name glob match ('*' any run incl. '.', '?' one char).
bool glob_match(std::string_view pattern, std::string_view name);

struct QuantConfig {
  std::string source;      // "hf_quant_config.json", "config.json quantization_config" or "" (none)
  std::string quant_algo;  // "NVFP4", "FP8", "MIXED_PRECISION" or "" (not quantised)
  int group_size = 16;     // NVFP4 block size
  std::vector<std::string> exclude_patterns;
  std::map<std::string, QuantScheme> quantized_layers;  // MIXED_PRECISION: module name -> scheme
  std::string kv_cache_quant_algo;                      // "FP8" or ""

  bool is_quantized() const { return !quant_algo.empty(); }
  // How the linear module `module_name` (e.g. "model.language_model.layers.0.mlp.experts.3.up_proj",
  // no ".weight") is stored according to this config alone. weight_map applies model rules on top
  // (routers stay BF16).
  QuantScheme scheme_for(const std::string& module_name) const;
  bool kv_cache_fp8() const;
};

// Parses hf_quant_config.json text, or a config.json's quantization_config object (given as the JSON text
// of that object). `source` names it in errors.
QuantConfig parse_hf_quant_config(std::string_view json_text, std::string_view source = "hf_quant_config.json");
QuantConfig parse_quantization_config(std::string_view json_text,
                                      std::string_view source = "config.json quantization_config");
// hf_quant_config.json if present, else config.json's quantization_config, else none.
QuantConfig load_quant_config(const ModelDir& dir);

}  // namespace kiln::format
