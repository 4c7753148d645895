// BF16 checkpoint -> NVIDIA ModelOpt NVFP4 checkpoint (what `kiln quantize` does).
//
// Works from tensor names and shapes alone, so it handles any qwen3-family checkpoint:
//  - routed experts, fused (`<L>mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and
//    `<L>mlp.experts.down_proj` [E, H, I]) or per expert (`<L>mlp.experts.{e}.{gate,up,down}_proj.weight`),
//    become per-expert NVFP4 linears `<L>mlp.experts.{e}.{gate,up,down}_proj.{weight, weight_scale,
//    weight_scale_2, input_scale}` (layout in nvfp4_quant.h);
//  - with QuantizeScope::all_linears, every other 2-D linear weight too, except routers (mlp.gate,
//    shared_expert_gate), embeddings, lm_head, vision tower (model.visual.*) and MTP head (mtp.*);
//  - modules matching an exclude glob, or whose input size is not a multiple of 16, stay as they are;
//  - every other tensor is copied unchanged (norms, embeddings, conv1d, A_log, ...).
// It writes model.safetensors (or shards + index), hf_quant_config.json (producer modelopt, NVFP4,
// group_size 16, exclude_modules = every linear left unquantised, kv_cache_quant_algo null) and copies the
// folder's other files (config, tokenizer, chat template, generation config, ...).
//
// input_scale = amax / (6 * 448) of the activation entering the linear, from calibration data
// (module name -> amax). A module without data takes the largest amax calibrated for the same
// projection of the same layer's experts, else `default_input_scale` (counted as uncalibrated).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace kiln::format {

enum class QuantizeScope { routed_experts, all_linears };

struct QuantizeProgress {
  int64_t linears_done = 0, linears_total = 0;
  uint64_t source_bytes_done = 0, source_bytes_total = 0;  // bytes of the weights being quantised
  std::string module;                                      // the linear just quantised
};

struct QuantizeOptions {
  QuantizeScope scope = QuantizeScope::routed_experts;
  std::vector<std::string> exclude;          // module-name globs ('*' any run, '?' one char) kept as they are
  std::map<std::string, float> input_amax;   // calibration: module name -> max |input activation|
  // No calibration for a module: input_scale = this (1.0 means activations up to 6 * 448 = 2688 without
  // clipping: harmless for weight-only (W4A16) engines, coarse for W4A4 kernels).
  float default_input_scale = 1.0f;
  uint64_t max_shard_bytes = 5ull << 30;
  std::function<void(const QuantizeProgress&)> on_progress;
};

struct QuantizeSummary {
  int64_t quantized_linears = 0;
  int64_t copied_tensors = 0;
  int64_t calibrated = 0;        // input_scale from the module's own calibration amax
  int64_t calibrated_from_layer = 0;  // from the layer's other experts
  int64_t uncalibrated = 0;      // default_input_scale
  uint64_t bytes_in = 0, bytes_out = 0;
  std::vector<std::string> exclude_modules;  // as written to hf_quant_config.json
  std::vector<std::string> files_written;
};

// Reads a calibration file {"amax": {"<module>": <float>, ...}} (tools/tiny/train.py writes one).
std::map<std::string, float> load_calibration_amax(const std::string& path);

// Quantises the checkpoint in `in_dir` into `out_dir` (created; must not already hold safetensors).
QuantizeSummary quantize_checkpoint_nvfp4(const std::string& in_dir, const std::string& out_dir,
                                          const QuantizeOptions& options);

}  // namespace kiln::format
