// kiln generate: one prompt through the engine (CPU or CUDA), text streamed to stdout as it is generated, speeds on stderr.
//
//   kiln generate [--model-path DIR] --prompt TEXT [--chat] [--no-think] [--max-tokens N] [--temperature T]
//                 [--seed S] [--threads N] [--device auto|cpu|cuda] [--dtype auto|bfloat16|float32]
//                 [--skip-self-check] [--speculative-algorithm auto|NEXTN|none] [--speculative-num-steps K]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "backend/cpu/cpu_backend.h"
#include "backend/device.h"
#include "cli/command.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "format/model_dir.h"
#include "cli/gpu_flags.h"
#include "cli/parallel_flags.h"
#include "cli/speculative_flags.h"
#include "model/runner.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

struct GenerateOptions {
  std::string model_path;
  std::string prompt;
  bool chat = false;
  bool no_think = false;
  int64_t max_tokens = 1024;  // room for kiln-tiny's thinking on its own arithmetic before the answer
  float temperature = 0.0f;
  std::optional<uint64_t> seed;
  int threads = 0;
  std::string kv_dtype = "bf16";
  std::string device = "auto";
  std::string dtype = "auto";
  bool skip_self_check = false;
  kiln::backend::ParallelOptions parallel;
  kiln::cli::SpeculativeFlags speculative;
};

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int run_generate(const GenerateOptions& o) {
  using namespace kiln;
  const format::ModelDir dir = format::ModelDir::open_or_embedded(o.model_path);
  if (o.max_tokens <= 0) fail("--max-tokens must be positive, got {}", o.max_tokens);

  const std::string tok_config = dir.has("tokenizer_config.json") ? dir.read_text("tokenizer_config.json") : "";
  if (!dir.has("tokenizer.json")) fail("{} has no tokenizer.json", dir.display_path());
  auto tokenizer = tok::Tokenizer::from_json(dir.read_text("tokenizer.json"), tok_config);

  std::string text = o.prompt;
  if (o.chat) {
    std::optional<std::string> jinja;
    if (dir.has("chat_template.jinja")) jinja = dir.read_text("chat_template.jinja");
    auto tmpl = tmpl::ChatTemplate::from_model_files(jinja, tok_config);
    nlohmann::ordered_json req;
    req["messages"] = nlohmann::ordered_json::array({{{"role", "user"}, {"content", o.prompt}}});
    req["add_generation_prompt"] = true;
    if (o.no_think) req["chat_template_kwargs"] = {{"enable_thinking", false}};
    text = tmpl->render(req);
  } else if (o.no_think) {
    fail("--no-think only applies with --chat");
  }
  const std::vector<int32_t> prompt = tokenizer->encode(text);
  if (prompt.empty()) fail("the prompt encodes to no tokens");

  backend::LoadOptions lo;
  lo.threads = o.threads;
  lo.state_slots = 1;
  lo.max_context = static_cast<int64_t>(prompt.size()) + o.max_tokens;
  lo.prefill_chunk = backend::resolve_pass_tokens(backend::kDefaultMaxPassTokens, 0);  // serve's default pass
  if (o.kv_dtype == "bf16") lo.kv_dtype = DType::BF16;
  else if (o.kv_dtype == "fp8") lo.kv_dtype = DType::F8_E4M3;
  else if (o.kv_dtype == "f32") lo.kv_dtype = DType::F32;
  else fail("--kv-dtype must be bf16, fp8 or f32, got '{}'", o.kv_dtype);
  lo.gpu.dtype = o.dtype;
  kiln::cli::check_node_zero(o.parallel, "generate");
  lo.parallel = o.parallel;
  const format::ModelConfig config = format::load_model_config(dir);  // eos ids (any runner, TP too)
  kiln::cli::SpeculativeChoice speculative = kiln::cli::resolve_speculative_flags(o.speculative, config, lo.parallel.nnodes);
  kiln::cli::apply_speculative_choice(speculative, lo);
  auto runner = backend::load_model(dir, o.device, lo, !o.skip_self_check);
  kiln::cli::check_speculative_runner(speculative, *runner);
  KILN_LOG_INFO("speculative decoding: {}", speculative.summary);
  if (tokenizer->vocab_size() > runner->vocab_size())
    KILN_LOG_WARN("tokenizer has {} ids but the model only {}", tokenizer->vocab_size(), runner->vocab_size());

  // One request through the engine (the server's step: speculative decoding included).
  engine::EngineOptions eo;
  eo.max_running_requests = 1;
  eo.chunked_prefill_size = 0;  // the whole prompt in one step (the runner splits it into passes)
  eo.context_length = lo.max_context;
  eo.enable_prefix_cache = false;
  eo.speculative_num_steps = speculative.num_steps;
  eo.speculative_adaptive = speculative.adaptive;
  eo.speculative_carry = speculative.carry;
  eo.speculative_defer_chain = speculative.defer;
  for (int64_t id : config.eos_token_ids) eo.eos_token_ids.push_back(static_cast<int32_t>(id));
  engine::Engine engine(std::move(runner), eo);
  engine.start();
  engine::GenerateRequest req;
  req.prompt = prompt;
  req.max_tokens = o.max_tokens;
  req.sampling.temperature = o.temperature;
  req.sampling.seed = o.seed ? *o.seed : std::random_device{}();
  const auto t0 = Clock::now();
  engine::SubmitResult submitted = engine.submit({req});
  if (submitted.status != engine::SubmitStatus::ok) fail("{}", submitted.message);

  tok::StreamDecoder stream(*tokenizer, /*skip_special=*/true);
  double prefill_s = 0;
  Clock::time_point t1{};
  int64_t generated = 0;
  bool hit_eos = false, done = false;
  while (!done) {
    std::vector<engine::TokenEvent> events;
    submitted.channel->wait(events, std::chrono::milliseconds(100));
    for (const engine::TokenEvent& ev : events) {
      if (ev.token >= 0) {
        if (++generated == 1) {
          prefill_s = seconds_since(t0);  // the first token comes from the prefill's logits
          t1 = Clock::now();
        }
        if (ev.is_stop_token) hit_eos = true;
        const std::string piece =
            !ev.is_stop_token && ev.token < tokenizer->vocab_size() ? stream.push(ev.token) : std::string();
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      }
      if (ev.finished) {
        if (ev.finish_reason == engine::FinishReason::error) fail("generation failed: {}", ev.error);
        done = true;
      }
    }
  }
  const std::string rest = stream.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  // The text ends its line, and reaches the terminal before the stats line on stderr.
  std::printf("\n");
  std::fflush(stdout);
  const double decode_s = generated > 0 ? seconds_since(t1) : 0.0;
  const engine::EngineMetricsSnapshot m = engine.metrics();
  const uint64_t verifies = m.spec_accept_length.count;
  // Decode speed: the forward passes after the prefill (the first token comes from the prefill's logits).
  std::fprintf(stderr, "prompt: %zu tokens, %.1f tok/s | generated: %lld tokens%s, decode %.1f tok/s%s\n",
               prompt.size(), prompt.size() / std::max(prefill_s, 1e-9), static_cast<long long>(generated),
               hit_eos ? " (eos)" : " (stopped at --max-tokens)",
               generated > 1 ? (generated - 1) / std::max(decode_s, 1e-9) : 0.0,
               verifies > 0 ? fmt::format(" | speculative: mean accept length {:.2f} ({} of {} drafts accepted)",
                                          m.spec_accept_length.sum / verifies, m.spec_accepted_tokens_total,
                                          m.spec_draft_tokens_total).c_str()
                            : "");
  return 0;
}

kiln::cli::Registrar reg{"generate", "Generate text from a prompt (CPU or CUDA engine, --device)", [](CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  app.add_option("--model-path", o->model_path, "Model folder (default: the embedded model)");
  app.add_option("--prompt", o->prompt, "Prompt text")->required();
  app.add_flag("--chat", o->chat, "Apply the model's chat template (one user message)");
  app.add_flag("--no-think", o->no_think, "With --chat: enable_thinking=false");
  app.add_option("--max-tokens", o->max_tokens, "Most tokens to generate (default 1024)");
  app.add_option("--temperature", o->temperature, "Sampling temperature (default 0: greedy)");
  app.add_option("--seed", o->seed, "Sampling seed (default: random)");
  app.add_option("--threads", o->threads, "CPU threads (default: KILN_THREADS or all cores)");
  app.add_option("--kv-dtype", o->kv_dtype, "KV cache dtype: bf16 (default), fp8, f32");
  app.add_option("--device", o->device, "auto (default: cuda when a supported GPU is present), cpu or cuda");
  kiln::cli::add_dtype_flag(app, o->dtype);
  app.add_flag("--skip-self-check", o->skip_self_check,
               "cuda: start without the numerical self-check against the CPU backend");
  kiln::cli::add_parallel_flags(app, o->parallel);
  kiln::cli::add_speculative_flags(app, o->speculative);
  return [o]() -> int { return run_generate(*o); };
}};

}  // namespace
