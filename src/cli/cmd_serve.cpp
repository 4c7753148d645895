// kiln serve: the OpenAI-compatible HTTP server over the engine loop.
//
// Startup: bind the port first (so a taken port fails at once and /health answers 503 while
// loading), load tokenizer, chat template and weights, start the engine, open the API, print a
// summary and a "ready" line. SIGTERM / SIGINT: /health turns 503, new requests get 503, in-flight
// requests finish (up to --shutdown-timeout, then they are aborted), exit 0.
// The options and the summary are built by the pure functions of cli/serve_options.h; this file does the I/O.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "backend/device.h"
#include "cli/command.h"
#include "cli/environment.h"
#include "cli/gpu_flags.h"
#include "cli/parallel_flags.h"
#include "cli/serve_options.h"
#include "media/image_processor.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/dummy_runner.h"
#include "engine/engine.h"
#include "engine/scheduler.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "model/tp_runner.h"
#include "server/http_server.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace kiln;
using kiln::cli::ServeArgs;

// The HTTP front's limits against slow, idle and too many clients (server/request_gate.h).
void add_http_front_flags(CLI::App& app, cli::HttpFrontFlags& f) {
  app.add_option("--request-timeout", f.request_timeout_s,
                 "Seconds a request (headers and body) may take to arrive (slower: 408)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--min-upload-rate", f.min_upload_rate,
                 "Bytes per second a request must arrive at, on average, after its first 5 s (slower: 408; 0: no "
                 "minimum)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-connections", f.max_connections,
                 "Connections open at once; beyond it the one idle or waiting longest for its request is closed, "
                 "or the new one gets 503 (default 0: as many as the open-file limit allows, at most 65536)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-connections-per-client", f.max_connections_per_client,
                 "Connections open at once from one client address (beyond: 429; default 0: no limit)")
      ->check(CLI::NonNegativeNumber);
}

// Waits for SIGINT / SIGTERM on a thread of its own (the signals are blocked everywhere else).
class SignalWaiter {
 public:
  SignalWaiter() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    sigaddset(&set_, SIGUSR2);                   // our own wake-up at exit
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);  // before any other thread starts: they inherit it
    signal(SIGPIPE, SIG_IGN);                    // a vanished client must not kill the server
  }
  void start(std::function<void(int)> on_signal) {
    thread_ = std::thread([this, on_signal = std::move(on_signal)] {
      for (;;) {
        int sig = 0;
        if (sigwait(&set_, &sig) != 0) continue;
        if (sig == SIGUSR2) return;
        on_signal(sig);
      }
    });
  }
  ~SignalWaiter() {
    if (thread_.joinable()) {
      pthread_kill(thread_.native_handle(), SIGUSR2);
      thread_.join();
    }
  }

 private:
  sigset_t set_;
  std::thread thread_;
};

// --api-key-file: the file's text without its trailing newline (and surrounding whitespace).
std::string read_api_key_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) fail("cannot read --api-key-file '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string key = ss.str();
  const char* ws = " \t\r\n";
  const size_t b = key.find_first_not_of(ws);
  key = b == std::string::npos ? "" : key.substr(b, key.find_last_not_of(ws) - b + 1);
  if (key.empty()) fail("--api-key-file '{}' is empty; put the key in it", path);
  if (key.find_first_of(ws) != std::string::npos)
    fail("--api-key-file '{}' holds more than one word; put only the key in it", path);
  return key;
}

// The tokenizer and the chat template (--chat-template, else the model folder's; none: chat completions answer 400).
struct TextSide {
  std::unique_ptr<tok::Tokenizer> tokenizer;
  std::unique_ptr<tmpl::ChatTemplate> chat_template;
  std::string template_source;  // "" without a template
};

TextSide load_text_side(const format::ModelDir& dir, const std::string& template_flag) {
  TextSide t;
  if (!dir.has("tokenizer.json")) fail("{}: no tokenizer.json in the model folder", dir.display_path());
  const std::string tokenizer_config = dir.has("tokenizer_config.json") ? dir.read_text("tokenizer_config.json") : "";
  t.tokenizer = tok::Tokenizer::from_json(dir.read_text("tokenizer.json"), tokenizer_config);
  if (!template_flag.empty()) {
    std::ifstream f(template_flag);
    if (!f) fail("cannot read --chat-template '{}'", template_flag);
    std::stringstream ss;
    ss << f.rdbuf();
    t.chat_template = std::make_unique<tmpl::ChatTemplate>(ss.str());
    t.template_source = template_flag;
    return t;
  }
  std::optional<std::string> jinja;
  if (dir.has("chat_template.jinja")) jinja = dir.read_text("chat_template.jinja");
  try {
    t.chat_template = tmpl::ChatTemplate::from_model_files(jinja, tokenizer_config);
    t.template_source = jinja ? "chat_template.jinja" : "tokenizer_config.json";
  } catch (const Error& e) {
    KILN_LOG_WARN("no chat template ({}); /v1/chat/completions will answer 400", e.what());
  }
  return t;
}

// Everything startup has read and built before the model loads.
struct Startup {
  const ServeArgs& args;
  cli::ServeContext ctx;
  format::ModelDir dir;
  format::ModelConfig config;
  TextSide text;
  server::ServerOptions server_options;
  engine::EngineOptions engine_options;
  backend::LoadOptions load;
  std::vector<cli::EnvReport> nccl;
  std::string sampling_desc;
  cli::SpeculativeChoice speculative;
  int max_images = 0;  // --limit-mm-per-prompt
  media::MediaOptions media;
  std::string images_desc;  // the summary's images line
};

// Reads the model folder and builds every option; kiln::Error on bad input, before the port opens.
Startup prepare(const ServeArgs& a, const backend::DeviceChoice& device, DType kv_dtype) {
  Startup s{a, {}, format::ModelDir::open_or_embedded(a.model_path), {}, {}, {}, {}, {}, {}, {}, {}};
  s.ctx.device = device.device;
  s.ctx.model_path = a.model_path.empty() ? std::string(format::ModelDir::embedded_name()) : a.model_path;
  // The per-step token budget and the forward-pass size, from the device (the plan reserves the pass's activations).
  s.ctx.prefill =
      backend::resolve_prefill_sizes(a.chunked_prefill_size, a.max_pass_tokens, device.device, device.gpu_bytes,
                                     a.chunked_prefill_size_while_decoding);
  // State slots per running request: its own; with the prefix cache also its two pending page-boundary snapshots
  // (engine/scheduler.h); slots that running requests do not hold keep cached snapshots.
  s.ctx.slots_per_request = engine::state_slots_per_request(!a.disable_radix_cache);
  s.config = format::load_model_config(s.dir);
  cli::check_serve_args_against_model(a, s.config);        // --context-length past max_position_embeddings
  cli::check_parallel_flags(a.parallel, s.config, s.dir);  // --tp-size / --ep-size the model cannot take
  if (a.dummy_runner.empty()) backend::resolve_dtype(device.device, a.gpu.gpu.dtype);  // a --dtype the device refuses
  s.server_options = cli::build_server_options(a, s.ctx, s.config);
  s.text = load_text_side(s.dir, a.chat_template);
  const std::string gen = s.dir.has("generation_config.json") ? s.dir.read_text("generation_config.json") : "";
  s.server_options.default_sampling = cli::default_sampling(gen, &s.sampling_desc);
  const tok::Tokenizer& tokenizer = *s.text.tokenizer;
  s.engine_options = cli::build_engine_options(
      a, s.ctx,
      cli::collect_eos_ids(s.config.eos_token_ids, [&](const std::string& t) { return tokenizer.token_to_id(t); },
                           tokenizer.eos_token()));
  s.server_options.eos_token_ids = s.engine_options.eos_token_ids;
  s.load = cli::build_load_options(a, s.ctx, s.config, kv_dtype);
  // Speculative decoding with the checkpoint's MTP head (the runner loads the head only when it is on).
  s.speculative = a.dummy_runner.empty()
                      ? cli::resolve_speculative_flags(a.speculative, s.config, a.parallel.nnodes)
                      : cli::SpeculativeChoice{0, false, "off (--dummy-runner)"};
  cli::apply_speculative_choice(s.speculative, s.load);
  // Image inputs: the vision tower is loaded when the checkpoint has one and images are not turned off.
  s.max_images = cli::parse_image_limit(a.limit_mm_per_prompt);
  s.media = cli::build_media_options(a);
  s.load.vision = s.max_images > 0 && s.config.has_vision && a.dummy_runner.empty();
  if (s.load.vision) {  // the memory plan reserves the tower's activations for the largest image the processor makes
    const media::ImageProcessorConfig pc = media::ImageProcessorConfig::load(s.dir);
    s.load.vision_max_patches = pc.max_pixels / (int64_t{pc.patch_size} * pc.patch_size);
  }
  // NCCL runs only for a CUDA group: kiln's settings where the user has none (the summary says which).
  if (device.device == "cuda" && a.parallel.is_group()) s.nccl = cli::apply_nccl_env();
  return s;
}

// The image processor when the loaded runner encodes images (its vision tower loaded); the summary line either way.
std::unique_ptr<media::ImageProcessor> image_side(Startup& s, const model::ModelRunner& runner) {
  const int merge = runner.vision_merge_size();
  if (merge <= 0) {
    if (s.config.has_vision)
      s.images_desc = s.max_images == 0 ? "off (--limit-mm-per-prompt image=0)"
                                        : "off (the checkpoint's vision tower is not loaded: see the log)";
    else if (!s.config.vision_problem.empty())
      s.images_desc = "off (config.json vision_config: " + s.config.vision_problem + ")";
    return nullptr;
  }
  auto proc = std::make_unique<media::ImageProcessor>(media::ImageProcessorConfig::load(s.dir));
  const media::ImageProcessorConfig& pc = proc->config();
  if (pc.merge_size != merge)
    fail("{}: preprocessor_config.json merge_size {} differs from the vision tower's spatial_merge_size {}",
         s.dir.display_path(), pc.merge_size, merge);
  if (s.config.image_token_id < 0) fail("{}: config.json names no image_token_id", s.dir.display_path());
  s.images_desc = fmt::format(
      "on, up to {} per request (--limit-mm-per-prompt); {} to {} pixels, patch {} x merge {}, {} resize ({}); "
      "sources: data URLs{}{}",
      s.max_images, pc.min_pixels, pc.max_pixels, pc.patch_size, pc.merge_size,
      media::processor_backend_name(pc.backend), pc.source,
      s.media.allowed_local_path.empty() ? "" : ", files under " + s.media.allowed_local_path,
      s.media.allow_url_fetch ? ", http(s) URLs" : "");
  return proc;
}

// Several machines, a node other than 0: no HTTP front and no scheduler; load this node's ranks, meet the others,
// then run node 0's steps until it stops the group (model/tp_runner.h).
int run_follower(const Startup& s, SignalWaiter& signals) {
  const backend::ParallelOptions& par = s.args.parallel;
  if (!s.args.dummy_runner.empty()) fail("--dummy-runner runs no model: it cannot join --nnodes {}", par.nnodes);
  signals.start([&](int sig) {
    std::fprintf(stderr, "kiln serve: %s on node %d, exiting (node 0's steps will fail: restart every node)\n",
                 sig == SIGINT ? "SIGINT" : "SIGTERM", par.node_rank);
    std::_Exit(0);
  });
  auto runner = backend::load_model(s.dir, s.args.device, s.load, !s.args.skip_self_check);
  auto* tp = dynamic_cast<model::TpRunner*>(runner.get());
  if (!tp) fail("--nnodes {}: the loaded model is not a tensor-parallel group", par.nnodes);
  std::printf("kiln serve: node %d of %d ready (ranks %d-%d of tp %d); following node 0 (no HTTP on this node)\n",
              par.node_rank, par.nnodes, tp->first_rank(), tp->first_rank() + tp->size() - 1, par.tp_size);
  std::fflush(stdout);
  tp->follow();
  std::printf("kiln serve: node %d: node 0 stopped the group, exiting\n", par.node_rank);
  return 0;
}

// The model runner of this launch: the checkpoint on the device, or --dummy-runner's.
std::unique_ptr<model::ModelRunner> load_runner(const Startup& s) {
  if (s.args.dummy_runner.empty())
    return backend::load_model(s.dir, s.args.device, s.load, !s.args.skip_self_check);  // its log says why
  const tok::Tokenizer& t = *s.text.tokenizer;
  cli::DummyTokens ids;
  ids.vocab = t.vocab_size();
  ids.turn_start = t.token_to_id("<|im_start|>");
  ids.turn_end = t.token_to_id("<|im_end|>");
  const auto nl = t.encode("\n", false);
  ids.newline = nl.size() == 1 ? nl[0] : -1;
  return std::make_unique<engine::DummyRunner>(cli::build_dummy_runner_options(s.args, s.ctx, s.config, ids));
}

// SIGINT / SIGTERM during startup exit at once; once ready, the first starts the drain, a second exits.
class ShutdownGate {
 public:
  void on_signal(int sig) {
    std::lock_guard<std::mutex> lock(mu_);
    ++signals_seen_;
    if (!ready_) {
      std::fprintf(stderr, "kiln serve: %s during startup, exiting\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
      std::_Exit(0);
    }
    if (signals_seen_ >= 2) {
      std::fprintf(stderr, "kiln serve: second signal, exiting without waiting for requests\n");
      std::_Exit(1);
    }
    cv_.notify_all();
  }
  // Marks startup done and waits for the first signal.
  void ready_then_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    ready_ = true;
    cv_.wait(lock, [&] { return signals_seen_ > 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int signals_seen_ = 0;
  bool ready_ = false;
};

cli::ServeSummary summarize(const Startup& s, const engine::Engine& engine, const server::HttpServer& http,
                            const std::string& runner_description) {
  cli::ServeSummary m;
  m.model = s.dir.display_path();
  m.model_type = s.config.model_type;
  m.architecture = s.config.architecture;
  m.dummy_runner = s.args.dummy_runner;
  m.vocab_size = s.text.tokenizer->vocab_size();
  m.eos_token_ids = s.engine_options.eos_token_ids;
  if (s.text.chat_template) m.template_source = s.text.template_source;
  m.context_length = engine.context_length();
  m.capacity = engine.capacity();
  m.kv_cache_dtype = s.args.kv_cache_dtype;
  m.max_running = engine.options().max_running_requests;
  m.max_queued = s.args.max_queued_requests;
  m.prefill = s.ctx.prefill;
  m.prefix_cache = engine.options().enable_prefix_cache;
  m.speculative = s.speculative.summary;
  m.images = s.images_desc;
  m.sampling = s.sampling_desc;
  m.reasoning_parser = http.reasoning_parser_on();
  m.tool_call_parser = http.tool_call_parser_on();
  m.runner = runner_description;
  m.nccl = s.nccl;
  m.api_key = !s.args.api_key.empty();
  m.host = s.args.host;
  m.port = http.port();
  m.served_model_name = s.server_options.served_model_name;
  return m;
}

// Node 0: the HTTP front over the engine, until a signal; then drain and stop.
int run_server(Startup& s, SignalWaiter& signals) {
  server::HttpServer http(s.server_options);
  http.bind();
  std::thread http_thread([&] { http.run(); });
  auto stop_http = [&] {
    http.stop();
    if (http_thread.joinable()) http_thread.join();
  };
  // Whatever fails from here on (loading, engine setup), the HTTP thread is stopped and joined.
  struct OnExit {
    std::function<void()> fn;
    ~OnExit() { fn(); }
  } join_http{stop_http};
  ShutdownGate gate;
  signals.start([&](int sig) { gate.on_signal(sig); });
  KILN_LOG_INFO("listening on http://{}:{} (loading the model; /health answers 503 until ready)", s.args.host,
                http.port());

  std::unique_ptr<model::ModelRunner> runner = load_runner(s);
  const std::string description = runner->describe();
  std::unique_ptr<media::ImageProcessor> image_processor = image_side(s, *runner);
  cli::check_speculative_runner(s.speculative, *runner);
  s.engine_options.speculative_num_steps = s.speculative.num_steps;
  s.engine_options.speculative_adaptive = s.speculative.adaptive;
  s.engine_options.speculative_carry = s.speculative.carry;
  s.engine_options.speculative_defer_chain = s.speculative.defer;
  if (s.engine_options.max_running_requests <= 0)
    s.engine_options.max_running_requests = std::max(1, runner->capacity().state_slots / s.ctx.slots_per_request);
  engine::Engine engine(std::move(runner), s.engine_options);
  engine.start();
  server::ModelContext mc;
  mc.engine = &engine;
  mc.tokenizer = s.text.tokenizer.get();
  mc.chat_template = s.text.chat_template.get();
  mc.image_processor = image_processor.get();
  mc.image_token_id = static_cast<int32_t>(s.config.image_token_id);
  mc.media = s.media;
  mc.max_images = s.max_images;
  http.attach(mc);
  std::fputs(cli::startup_summary(summarize(s, engine, http, description)).c_str(), stdout);
  std::fflush(stdout);

  gate.ready_then_wait();
  KILN_LOG_INFO("shutting down: refusing new requests, finishing {} in flight (up to {} s)", http.active_requests(),
                s.args.shutdown_timeout_s);
  http.set_draining();
  const bool clean =
      engine.drain(std::chrono::milliseconds(static_cast<int64_t>(s.args.shutdown_timeout_s * 1000)));
  if (!clean) KILN_LOG_WARN("shutdown timeout: aborted the requests still running");
  // Let the HTTP threads write the last chunks of the finished requests.
  for (int i = 0; i < 100 && http.active_requests() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  stop_http();
  engine.stop();
  KILN_LOG_INFO("stopped");
  return 0;
}

int run_serve(ServeArgs a) {
  const DType kv_dtype = cli::check_serve_args(a);  // flags first, before anything slow (and before the port is bound)
  set_log_format(cli::serve_log_format(a));
  if (!a.api_key_file.empty()) a.api_key = read_api_key_file(a.api_key_file);
  // Block SIGINT/SIGTERM before anything starts a thread: resolving the device initialises the CUDA
  // runtime, whose threads would otherwise inherit an unblocked mask and let SIGTERM kill the process.
  SignalWaiter signals;
  // auto / cpu / cuda -> the backend (an unknown name, or cuda without a usable GPU, fails here before loading)
  const backend::DeviceChoice device = backend::resolve_device(a.device);
  Startup s = prepare(a, device, kv_dtype);
  if (a.parallel.nnodes > 1 && a.parallel.node_rank > 0) return run_follower(s, signals);
  return run_server(s, signals);
}

kiln::cli::Registrar reg{"serve", "Serve a model over an OpenAI-compatible HTTP API", [](CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  // Counts where 0 once meant "the default": 0 is refused, the flag's absence is the default.
  const CLI::Validator at_least_one(
      [](std::string& v) {
        long long n = 0;
        try {
          n = std::stoll(v);
        } catch (const std::exception&) {
          return std::string();  // not a number: the option's own parse says so
        }
        return n >= 1 ? std::string() : "must be at least 1, got " + v + " (leave the flag out for the default)";
      },
      "N>=1");
  app.add_option("--model-path", a->model_path, "Model folder (default: the embedded kiln-tiny)");
  app.add_option("--host", a->host, "Address to listen on")->capture_default_str();
  app.add_option("--port", a->port, "Port to listen on")->capture_default_str();
  app.add_option("--served-model-name", a->served_model_name, "Model name in the API (default: the model path)");
  auto* api_key = app.add_option("--api-key", a->api_key, "Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (/health, /health_generate, /metrics stay open)");
  app.add_option("--api-key-file", a->api_key_file,
                 "Read the API key from this file (surrounding whitespace and the newline are dropped), so it is not "
                 "visible in the process list")
      ->excludes(api_key);
  app.add_option("--allowed-origins", a->allowed_origins,
                 "CORS: browser origins allowed to call the API, comma-separated (https://app.example.com), or *; "
                 "answers OPTIONS preflights. Default: none (no CORS headers)");
  app.add_option("--log-format", a->log_format, "Log lines as text or json (one object per line); UTC timestamps")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  app.add_option("--context-length", a->context_length,
                 "Longest sequence, prompt + output, at most the model's max_position_embeddings (default: the model's)")
      ->check(at_least_one);
  app.add_option("--kv-cache-dtype", a->kv_cache_dtype, "KV cache type: auto (bf16), bf16 or fp8_e4m3")
      ->capture_default_str();
  app.add_option("--reasoning-parser", a->reasoning_parser,
                 "Split reasoning_content from content: auto (when the template opens <think>), qwen3, none")
      ->capture_default_str();
  app.add_option("--tool-call-parser", a->tool_call_parser,
                 "Parse tool calls: auto (for Qwen3.5 / Qwen3-Coder templates), qwen3_coder, none. With it, "
                 "tool_choice required / {function: {name}} and strict tools are enforced by constrained decoding; "
                 "response_format json_object / json_schema (a subset: docs/deploy.md) works either way")
      ->capture_default_str();
  app.add_option("--chat-template", a->chat_template, "Jinja chat template file (default: the model's)");
  app.add_option("--max-running-requests", a->max_running_requests,
                 "Sequences decoded together at most (default: cuda: the memory plan's, at most 256; cpu: 32)")
      ->check(at_least_one);
  app.add_option("--max-queued-requests", a->max_queued_requests,
                 "Waiting sequences at most; beyond, requests get 503 + Retry-After")
      ->capture_default_str();
  app.add_option("--chunked-prefill-size", a->chunked_prefill_size,
                 "Tokens per engine step, decodes included: every step carries each decoding sequence's token plus "
                 "prompt chunks up to the rest, so long prompts are prefilled over several steps while streams keep "
                 "flowing. auto: 8192 on a GPU of 80 GB or more, 2048 on a smaller GPU, 512 on the CPU; <= 0: whole "
                 "prompts in one step")
      ->capture_default_str();
  app.add_option("--chunked-prefill-size-while-decoding", a->chunked_prefill_size_while_decoding,
                 "Tokens per engine step while any running request is decoding, where smaller than "
                 "--chunked-prefill-size: the decodes of such a step wait for fewer prompt tokens, so the inter-token "
                 "latency of running streams stays bounded while long prompts arrive (a prompt that arrives while "
                 "nothing decodes still gets the whole budget). auto: 2048 on CUDA where the step budget is larger, "
                 "else the step budget; <= 0: the step budget")
      ->capture_default_str();
  app.add_option("--max-pass-tokens", a->max_pass_tokens,
                 "Most tokens in one forward pass (a larger step runs as several passes); cuda: the memory plan "
                 "reserves activation scratch for one such pass. Never more than --chunked-prefill-size. auto: the "
                 "step budget (one pass per step; a large pass holds about one layer's activations at a time)")
      ->capture_default_str();
  app.add_option("--max-total-tokens", a->max_total_tokens,
                 "KV cache size in tokens (default: cuda: all memory the plan leaves; cpu: a context per running "
                 "request, at most 256k tokens)");
  app.add_flag("--disable-radix-cache", a->disable_radix_cache,
               "Turn the prefix cache (shared KV pages + state snapshots across requests) off");
  app.add_flag("--disable-chunk-snapshots", a->disable_chunk_snapshots,
               "Prefix cache of a model with recurrent state: cut each prompt at the page boundaries whose state is "
               "snapshotted (one or two more engine steps per prompt) instead of saving the state there inside the "
               "step; for A/B runs");
  app.add_option("--threads", a->threads, "CPU worker threads (default: all cores or $KILN_THREADS)")
      ->check(at_least_one);
  app.add_option("--device", a->device, "auto, cpu or cuda")->capture_default_str();
  app.add_flag("--skip-self-check", a->skip_self_check,
               "cuda: start without the numerical self-check against the CPU backend");
  kiln::cli::add_gpu_flags(app, a->gpu);
  kiln::cli::add_parallel_flags(app, a->parallel);
  kiln::cli::add_speculative_flags(app, a->speculative);
  app.add_option("--shutdown-timeout", a->shutdown_timeout_s,
                 "Seconds to let in-flight requests finish on SIGTERM / SIGINT")
      ->capture_default_str();
  app.add_option("--responses-store-size", a->responses_store_size,
                 "Responses kept in memory for /v1/responses previous_response_id (oldest evicted; 0: none)")
      ->capture_default_str();
  app.add_option("--responses-store-ttl", a->responses_store_ttl_s,
                 "Seconds a stored response stays usable as previous_response_id")
      ->capture_default_str();
  app.add_option("--max-request-bytes", a->max_request_bytes, "Largest request body (larger: 413)")
      ->capture_default_str();
  add_http_front_flags(app, a->http_front);
  app.add_option("--limit-mm-per-prompt", a->limit_mm_per_prompt,
                 "Images per request: image=N or '{\"image\": N}' (0: the vision tower is not loaded)")
      ->capture_default_str();
  app.add_option(media::kFlagMaxImageBytes, a->max_image_bytes, "Largest encoded image (bytes)")->capture_default_str();
  app.add_option(media::kFlagMaxImagePixels, a->max_image_pixels,
                 "Most pixels an image file may declare (checked before decoding)")
      ->capture_default_str();
  app.add_option(media::kFlagAllowedLocalMediaPath, a->allowed_local_media_path,
                 "Serve file:// and absolute-path images from under this directory (default: none)");
  app.add_flag(media::kFlagAllowImageUrlFetch, a->allow_image_url_fetch,
               "Fetch http(s) image URLs named in requests (default: only data URLs)");
  app.add_option(media::kFlagImageFetchTimeout, a->image_fetch_timeout_s, "Seconds for one image fetch")
      ->capture_default_str();
  app.add_option("--dummy-runner", a->dummy_runner,
                 "Testing without weights: 'hash' (logits hash each sequence's tokens) or 'echo' (repeats the "
                 "last chat turn); uses the model folder's tokenizer and template only")
      ->group("");  // hidden
  return [a]() -> int { return run_serve(*a); };  // a copy: --api-key-file fills its api_key
}};

}  // namespace
