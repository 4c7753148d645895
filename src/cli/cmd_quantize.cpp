// kiln quantize: BF16 checkpoint -> NVIDIA ModelOpt NVFP4 checkpoint (format/quantize_checkpoint.h).
//
//   kiln quantize --model-path BF16_DIR --output OUT_DIR [--scheme nvfp4-experts|nvfp4-all]
//                 [--exclude GLOB ...] [--calibration-prompts PROMPTS.jsonl | --calibration AMAX.json |
//                  --no-calibration] [--max-shard-gb 5]
//
// input_scale (amax / (6 * 448) of each quantised linear's input activation) comes, by default, from a
// calibration pass through kiln's own CPU engine over the BF16 input model (backend/calibration.h):
// --calibration-prompts (JSONL, one {"text": ...} or {"messages": [...]} per line; messages are rendered with
// the model's chat template) or a small built-in set of varied prompts (chat-templated when the model
// folder has a template). --calibration takes the amaxes from a {"amax": {module: value}} file instead
// (e.g. tools/tiny/calib_amax.json, measured with transformers); --no-calibration writes 1.0 everywhere
// (only W4A4 kernels read input_scale; W4A16 engines, kiln on Hopper and CPU, ignore it).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#include "backend/calibration.h"
#include "cli/command.h"
#include "core/error.h"
#include "format/model_dir.h"
#include "format/quantize_checkpoint.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace kiln;
using namespace kiln::format;

struct QuantizeCliOptions {
  std::string model_path;
  std::string output;
  std::string scheme = "nvfp4-experts";
  std::vector<std::string> exclude;
  std::string calibration;
  std::string calibration_prompts;
  bool no_calibration = false;
  int64_t calibration_max_tokens = 1024;
  double max_shard_gb = 5.0;
};

// The built-in calibration set: short and varied (chat, code, maths, multilingual, reasoning, long-form),
// so each layer sees typical activation ranges; rendered with the chat template when there is one.
const char* const kBuiltinPrompts[] = {
    "Hello! Can you tell me a little about yourself?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.",
    "What is 17 * 23? Show your working step by step.",
    "Explain the difference between TCP and UDP to a new network engineer.",
    "Translate into French and German: 'The weather is lovely today, shall we go for a walk?'",
    "\u4f60\u597d\uff0c\u8bf7\u7528\u4e2d\u6587\u4ecb\u7ecd\u4e00\u4e0b\u957f\u57ce\u3002",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "List five prime numbers greater than 100 and explain how you checked them.",
    "Write a short haiku about autumn leaves.",
    "A train leaves at 14:05 and arrives at 17:50. How long is the journey in minutes?",
    "Give me a JSON object describing a book with title, author, year and a list of tags.",
    "What are the main causes of inflation, and how do central banks respond?",
    "Fix the bug: for (int i = 0; i <= n; i++) sum += a[i];",
    "Describe how photosynthesis works, including the light and dark reactions.",
    "Plan a three-day trip to Kyoto with a budget; use a table.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Why?",
};

// Token ids of the calibration prompts: the JSONL file's, or the built-in set.
std::vector<std::vector<int32_t>> calibration_token_ids(const format::ModelDir& dir, const std::string& jsonl) {
  if (!dir.has("tokenizer.json"))
    fail("{} has no tokenizer.json, needed for the calibration pass: pass --calibration AMAX.json or "
         "--no-calibration", dir.display_path());
  const std::string tok_config = dir.has("tokenizer_config.json") ? dir.read_text("tokenizer_config.json") : "";
  auto tokenizer = tok::Tokenizer::from_json(dir.read_text("tokenizer.json"), tok_config);
  std::unique_ptr<tmpl::ChatTemplate> chat;
  const bool has_template =
      dir.has("chat_template.jinja") || tok_config.find("\"chat_template\"") != std::string::npos;
  auto get_chat = [&]() -> const tmpl::ChatTemplate& {
    if (!chat) {
      std::optional<std::string> jinja;
      if (dir.has("chat_template.jinja")) jinja = dir.read_text("chat_template.jinja");
      chat = tmpl::ChatTemplate::from_model_files(jinja, tok_config);
    }
    return *chat;
  };
  auto render_messages = [&](const nlohmann::ordered_json& messages) {
    nlohmann::ordered_json req;
    req["messages"] = messages;
    // A whole conversation when it ends with the assistant's reply; else up to the generation prompt.
    req["add_generation_prompt"] = !(messages.is_array() && !messages.empty() && messages.back().is_object() &&
                                     messages.back().value("role", "") == "assistant");
    return get_chat().render(req);
  };

  std::vector<std::string> texts;
  if (jsonl.empty()) {
    for (const char* p : kBuiltinPrompts) {
      const std::string text = p;
      texts.push_back(has_template ? render_messages(nlohmann::ordered_json::array({{{"role", "user"}, {"content", text}}}))
                                   : text);
    }
  } else {
    std::ifstream f(jsonl, std::ios::binary);
    if (!f) fail("cannot read calibration prompts file '{}'", jsonl);
    std::string line;
    int line_no = 0;
    while (std::getline(f, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::ordered_json j;
      try {
        j = nlohmann::ordered_json::parse(line);
      } catch (const std::exception& e) {
        fail("{}:{}: not valid JSON ({}): each line must be {{\"text\": ...}} or {{\"messages\": [...]}}", jsonl,
             line_no, e.what());
      }
      if (j.is_object() && j.contains("text") && j["text"].is_string()) {
        texts.push_back(j["text"].get<std::string>());
      } else if (j.is_object() && j.contains("messages") && j["messages"].is_array()) {
        if (!has_template) fail("{}:{}: \"messages\" needs a chat template, and {} has none", jsonl, line_no,
                                dir.display_path());
        texts.push_back(render_messages(j["messages"]));
      } else {
        fail("{}:{}: expected {{\"text\": \"...\"}} or {{\"messages\": [...]}}", jsonl, line_no);
      }
    }
    if (texts.empty()) fail("calibration prompts file '{}' holds no prompts", jsonl);
  }
  std::vector<std::vector<int32_t>> ids;
  for (const auto& t : texts) {
    ids.push_back(tokenizer->encode(t));
    if (ids.back().empty()) fail("calibration prompt {} encodes to no tokens", ids.size());
  }
  return ids;
}

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
  if (int(!o.calibration.empty()) + int(!o.calibration_prompts.empty()) + int(o.no_calibration) > 1)
    fail("--calibration, --calibration-prompts and --no-calibration are alternatives: pass one at most");
  if (o.calibration_max_tokens <= 0) fail("--calibration-max-tokens must be positive");
  if (!o.calibration.empty()) opt.input_amax = load_calibration_amax(o.calibration);

  const auto start = std::chrono::steady_clock::now();
  std::printf("kiln quantize: %s -> %s (%s)\n", o.model_path.c_str(), o.output.c_str(), o.scheme.c_str());
  if (o.no_calibration) {
    std::printf("  --no-calibration: every input_scale = %.1f (unused by W4A16 engines)\n", opt.default_input_scale);
  } else if (!o.calibration.empty()) {
    std::printf("  calibration: %zu activation ranges from %s\n", opt.input_amax.size(), o.calibration.c_str());
  } else {
    const format::ModelDir dir = format::ModelDir::open(o.model_path);
    if (dir.has("hf_quant_config.json"))
      fail("'{}' is already quantised (it has hf_quant_config.json); kiln quantize needs a BF16 checkpoint",
           o.model_path);
    const auto prompts = calibration_token_ids(dir, o.calibration_prompts);
    std::printf("  calibrating through kiln's CPU engine: %zu prompts from %s\n", prompts.size(),
                o.calibration_prompts.empty() ? "the built-in set" : o.calibration_prompts.c_str());
    std::fflush(stdout);
    backend::CalibrationOptions copt;
    copt.max_tokens_per_prompt = o.calibration_max_tokens;
    copt.on_progress = [](const backend::CalibrationProgress& p) {
      std::printf("  calibration [%zu/%zu] %lld tokens\n", p.prompts_done, p.prompts_total,
                  static_cast<long long>(p.tokens_done));
      std::fflush(stdout);
    };
    opt.input_amax = backend::calibrate_input_amax(dir, prompts, copt);
    std::printf("  calibration: %zu activation ranges measured in %.1f s\n", opt.input_amax.size(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::fflush(stdout);

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
  app.add_option("--calibration-prompts", o->calibration_prompts,
                 "JSONL prompts for the calibration pass through kiln's CPU engine (the default, with a built-in "
                 "prompt set): one {\"text\": ...} or {\"messages\": [...]} (chat template) per line");
  app.add_option("--calibration", o->calibration,
                 "take input_scale amaxes from this JSON ({\"amax\": {module: value}}) instead of the engine pass");
  app.add_flag("--no-calibration", o->no_calibration, "skip calibration: every input_scale = 1.0");
  app.add_option("--calibration-max-tokens", o->calibration_max_tokens,
                 "longest calibration prompt in tokens (longer ones are truncated; default 1024)");
  app.add_option("--max-shard-gb", o->max_shard_gb, "largest safetensors shard, GB (default 5)");
  return [o]() -> int { return run_quantize(*o); };
}};

}  // namespace
