// kiln quantize: BF16 checkpoint -> NVIDIA ModelOpt NVFP4 checkpoint (format/quantize_checkpoint.h).
//
//   kiln quantize --model-path BF16_DIR --output OUT_DIR [--scheme nvfp4-experts|nvfp4-all]
//                 [--exclude GLOB ...] [--calibration AMAX.json] [--max-shard-gb 5]
//
// input_scale comes from --calibration (a {"amax": {module: value}} file, e.g. tools/tiny/calib_amax.json
// made by tools/tiny/train.py with transformers). kiln's own calibration pass (running the CPU engine
// over sample prompts) is not wired in yet: without --calibration every input_scale is 1.0, which only
// W4A4 kernels would use; W4A16 engines (kiln on Hopper and CPU) ignore it.
#include <chrono>
#include <cstdio>
#include <memory>

#include "cli/command.h"
#include "core/error.h"
#include "format/quantize_checkpoint.h"

namespace {

using namespace kiln;
using namespace kiln::format;

struct QuantizeCliOptions {
  std::string model_path;
  std::string output;
  std::string scheme = "nvfp4-experts";
  std::vector<std::string> exclude;
  std::string calibration;
  double max_shard_gb = 5.0;
};

int run_quantize(const QuantizeCliOptions& o) {
  QuantizeOptions opt;
  if (o.scheme == "nvfp4-experts") {
    opt.scope = QuantizeScope::routed_experts;
  } else if (o.scheme == "nvfp4-all") {
    opt.scope = QuantizeScope::all_linears;
  } else {
    fail("unknown --scheme '{}': use nvfp4-experts (routed experts only, like nvidia's Qwen3.5 release) or "
         "nvfp4-all (every linear except routers, embeddings and lm_head)", o.scheme);
  }
  if (!(o.max_shard_gb > 0)) fail("--max-shard-gb must be positive, got {}", o.max_shard_gb);
  opt.exclude = o.exclude;
  opt.max_shard_bytes = static_cast<uint64_t>(o.max_shard_gb * 1e9);
  if (!o.calibration.empty()) opt.input_amax = load_calibration_amax(o.calibration);

  std::printf("kiln quantize: %s -> %s (%s)\n", o.model_path.c_str(), o.output.c_str(), o.scheme.c_str());
  if (o.calibration.empty())
    std::printf("  no --calibration: every input_scale = %.1f (uncalibrated; unused by W4A16 engines)\n",
                opt.default_input_scale);
  else
    std::printf("  calibration: %zu activation ranges from %s\n", opt.input_amax.size(), o.calibration.c_str());
  std::fflush(stdout);

  const auto start = std::chrono::steady_clock::now();
  auto last_print = start - std::chrono::seconds(10);
  opt.on_progress = [&](const QuantizeProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    if (p.linears_done != p.linears_total && now - last_print < std::chrono::milliseconds(500)) return;
    last_print = now;
    std::printf("  [%lld/%lld] %s  (%.1f / %.1f MB of weights)\n", static_cast<long long>(p.linears_done),
                static_cast<long long>(p.linears_total), p.module.c_str(), p.source_bytes_done / 1e6,
                p.source_bytes_total / 1e6);
    std::fflush(stdout);
  };

  QuantizeSummary s = quantize_checkpoint_nvfp4(o.model_path, o.output, opt);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("quantised %lld linears to NVFP4, copied %lld tensors unchanged; %.1f MB -> %.1f MB in %.1f s\n",
              static_cast<long long>(s.quantized_linears), static_cast<long long>(s.copied_tensors), s.bytes_in / 1e6,
              s.bytes_out / 1e6, secs);
  std::printf("input_scale: %lld calibrated, %lld from the layer's other experts, %lld default\n",
              static_cast<long long>(s.calibrated), static_cast<long long>(s.calibrated_from_layer),
              static_cast<long long>(s.uncalibrated));
  std::printf("hf_quant_config.json: %zu modules excluded (kept as they are)\n", s.exclude_modules.size());
  std::printf("wrote:");
  for (const auto& f : s.files_written) std::printf(" %s", f.c_str());
  std::printf("\n");
  return 0;
}

kiln::cli::Registrar reg{"quantize", "Quantise a BF16 checkpoint to NVFP4 (ModelOpt layout)", [](CLI::App& app) {
  auto o = std::make_shared<QuantizeCliOptions>();
  app.add_option("--model-path", o->model_path, "BF16 model folder (config.json + safetensors)")->required();
  app.add_option("--output", o->output, "output folder (created)")->required();
  app.add_option("--scheme", o->scheme, "nvfp4-experts (default) or nvfp4-all");
  app.add_option("--exclude", o->exclude, "module-name glob to keep unquantised (repeatable)");
  app.add_option("--calibration", o->calibration, "activation amax JSON for input_scale ({\"amax\": {module: value}})");
  app.add_option("--max-shard-gb", o->max_shard_gb, "largest safetensors shard, GB (default 5)");
  return [o]() -> int { return run_quantize(*o); };
}};

}  // namespace
