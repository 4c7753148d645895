// kiln serve: the OpenAI-compatible HTTP server over the engine loop.
//
// Startup: bind the port first (so a taken port fails at once and /health answers 503 while
// loading), load tokenizer, chat template and weights, start the engine, open the API, print a
// summary and a "ready" line. SIGTERM / SIGINT: /health turns 503, new requests get 503, in-flight
// requests finish (up to --shutdown-timeout, then they are aborted), exit 0.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "backend/device.h"
#include "cli/command.h"
#include "cli/gpu_flags.h"
#include "cli/parallel_flags.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/dummy_runner.h"
#include "engine/engine.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "model/tp_runner.h"
#include "server/http_server.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace kiln;

// The HTTP front's limits against slow, idle and too many clients (server/request_gate.h).
struct HttpFrontFlags {
  int request_timeout_s = 60;
  int min_upload_rate = 500;
  int max_connections = 0;
  int max_connections_per_client = 0;

  void add_to(CLI::App& app) {
    app.add_option("--request-timeout", request_timeout_s,
                   "Seconds a request (headers and body) may take to arrive (slower: 408)")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    app.add_option("--min-upload-rate", min_upload_rate,
                   "Bytes per second a request must arrive at, on average, after its first 5 s (slower: 408; 0: no "
                   "minimum)")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
    app.add_option("--max-connections", max_connections,
                   "Connections open at once; beyond it the one idle or waiting longest for its request is closed, "
                   "or the new one gets 503 (default 0: as many as the open-file limit allows, at most 65536)")
        ->check(CLI::NonNegativeNumber);
    app.add_option("--max-connections-per-client", max_connections_per_client,
                   "Connections open at once from one client address (beyond: 429; default 0: no limit)")
        ->check(CLI::NonNegativeNumber);
  }
  void apply(kiln::server::ServerOptions& so) const {
    so.request_timeout_s = request_timeout_s;
    so.min_upload_rate_bytes_s = min_upload_rate;
    so.max_connections = max_connections;
    so.max_connections_per_client = max_connections_per_client;
  }
};

struct ServeArgs {
  std::string model_path;  // empty: the embedded model
  std::string host = "127.0.0.1";
  int port = 30000;
  std::string served_model_name;
  std::string api_key;
  int64_t context_length = 0;
  std::string kv_cache_dtype = "auto";
  std::string reasoning_parser = "auto";
  std::string tool_call_parser = "auto";
  std::string chat_template;
  int max_running_requests = 0;  // 0: the memory plan's (cuda), 32 (cpu)
  int max_queued_requests = 256;
  std::string chunked_prefill_size = "auto";  // backend::resolve_prefill_sizes
  int64_t max_pass_tokens = backend::kDefaultMaxPassTokens;
  int64_t max_total_tokens = 0;
  bool disable_radix_cache = false;
  int threads = 0;
  std::string device = "auto";
  bool skip_self_check = false;
  kiln::cli::GpuFlags gpu;
  kiln::cli::ParallelFlags parallel;
  double shutdown_timeout_s = 30;
  int64_t max_request_bytes = 32 << 20;
  int64_t responses_store_size = 1024;  // /v1/responses kept for previous_response_id (0: none)
  int64_t responses_store_ttl_s = 3600;
  std::string dummy_runner;  // "", hash or echo
  HttpFrontFlags http_front;
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", b, units[u]);
}

// Sampling defaults a model ships in generation_config.json (what SGLang applies to fields a request
// leaves out); OpenAI's defaults otherwise.
engine::SamplingParams default_sampling(const format::ModelDir& dir, std::string* described) {
  engine::SamplingParams s;
  if (!dir.has("generation_config.json")) return s;
  auto j = nlohmann::json::parse(dir.read_text("generation_config.json"), nullptr, false);
  if (!j.is_object()) return s;
  std::vector<std::string> parts;
  auto num = [&](const char* key, auto& field) {
    auto it = j.find(key);
    if (it != j.end() && it->is_number()) {
      field = static_cast<std::remove_reference_t<decltype(field)>>(it->get<double>());
      parts.push_back(fmt::format("{} {}", key, it->get<double>()));
    }
  };
  num("temperature", s.temperature);
  num("top_p", s.top_p);
  num("top_k", s.top_k);
  num("min_p", s.min_p);
  num("repetition_penalty", s.repetition_penalty);
  if (s.top_k < 0) s.top_k = 0;
  for (const auto& p : parts) *described += (described->empty() ? "" : ", ") + p;
  return s;
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

int run_serve(const ServeArgs& a) {
  // Validate flags before doing anything slow.
  if (a.port < 0 || a.port > 65535) fail("--port must be 0..65535 (got {})", a.port);
  if (a.max_running_requests < 0) fail("--max-running-requests must be at least 1 (got {})", a.max_running_requests);
  if (a.max_queued_requests < 0) fail("--max-queued-requests must be 0 or more (got {})", a.max_queued_requests);
  if (a.context_length < 0) fail("--context-length must be positive (got {})", a.context_length);
  if (a.shutdown_timeout_s < 0) fail("--shutdown-timeout must be 0 or more seconds");
  if (a.max_request_bytes < 1024) fail("--max-request-bytes must be at least 1024");
  if (a.responses_store_size < 0) fail("--responses-store-size must be 0 (store nothing) or more");
  if (a.responses_store_ttl_s < 1) fail("--responses-store-ttl must be at least 1 second");
  DType kv_dtype = DType::BF16;
  if (a.kv_cache_dtype == "fp8_e4m3")
    kv_dtype = DType::F8_E4M3;
  else if (a.kv_cache_dtype != "auto" && a.kv_cache_dtype != "bf16")
    fail("unknown --kv-cache-dtype '{}' (use auto, bf16 or fp8_e4m3)", a.kv_cache_dtype);
  // Block SIGINT/SIGTERM before anything starts a thread: resolving the device initialises the CUDA
  // runtime, whose threads would otherwise inherit an unblocked mask and let SIGTERM kill the process.
  SignalWaiter signals;
  // auto / cpu / cuda -> the backend (an unknown name, or cuda without a usable GPU, fails here before loading)
  const backend::DeviceChoice device_choice = backend::resolve_device(a.device);
  const std::string device = a.dummy_runner.empty() ? device_choice.device : "dummy-" + a.dummy_runner;
  if (!a.dummy_runner.empty() && a.dummy_runner != "hash" && a.dummy_runner != "echo")
    fail("unknown --dummy-runner '{}' (use hash or echo)", a.dummy_runner);
  // The per-step token budget and the forward-pass size, from the device (the plan reserves the pass's activations).
  const backend::PrefillSizes prefill = backend::resolve_prefill_sizes(a.chunked_prefill_size, a.max_pass_tokens,
                                                                       device_choice.device, device_choice.gpu_bytes);

  std::mutex mu;
  std::condition_variable cv;
  int signals_seen = 0;
  bool model_ready = false;

  server::ServerOptions so;
  so.host = a.host;
  so.port = a.port;
  so.api_key = a.api_key;
  so.reasoning_parser = a.reasoning_parser;
  so.tool_call_parser = a.tool_call_parser;
  so.max_request_bytes = static_cast<size_t>(a.max_request_bytes);
  so.responses_store.max_entries = static_cast<size_t>(a.responses_store_size);
  so.responses_store.max_age_s = a.responses_store_ttl_s;
  a.http_front.apply(so);
  so.http_threads = std::min(2048, (a.max_running_requests > 0 ? a.max_running_requests : 256) + a.max_queued_requests + 32);

  // Resolve the model folder (cheap) so the server's name and paths are known before loading.
  format::ModelDir dir = format::ModelDir::open_or_embedded(a.model_path);
  so.model_path = a.model_path.empty() ? std::string(format::ModelDir::embedded_name()) : a.model_path;
  so.tokenizer_path = so.model_path;
  so.served_model_name = !a.served_model_name.empty() ? a.served_model_name : so.model_path;
  nlohmann::json args_json = {{"model_path", so.model_path},
                              {"host", a.host},
                              {"port", a.port},
                              {"served_model_name", so.served_model_name},
                              {"api_key_set", !a.api_key.empty()},
                              {"context_length_flag", a.context_length},
                              {"kv_cache_dtype", a.kv_cache_dtype},
                              {"dtype", a.gpu.dtype},  // as given; the resolved one is in "backend" (kernels: dtype)
                              {"reasoning_parser_flag", a.reasoning_parser},
                              {"tool_call_parser_flag", a.tool_call_parser},
                              {"chat_template", a.chat_template},
                              {"max_total_tokens", a.max_total_tokens},
                              {"threads", a.threads},
                              {"device", device},
                              {"shutdown_timeout", a.shutdown_timeout_s},
                              {"max_request_bytes", a.max_request_bytes},
                              {"responses_store_size", a.responses_store_size},
                              {"responses_store_ttl", a.responses_store_ttl_s}};

  // Load everything that can fail on bad input before opening the port for traffic.
  format::ModelConfig config = format::load_model_config(dir);
  kiln::cli::check_parallel_flags(a.parallel, config, dir);  // --tp-size / --ep-size the model cannot take
  so.model_type = config.model_type;
  if (!config.architecture.empty()) so.architectures = {config.architecture};
  if (!dir.has("tokenizer.json")) fail("{}: no tokenizer.json in the model folder", dir.display_path());
  std::string tokenizer_config = dir.has("tokenizer_config.json") ? dir.read_text("tokenizer_config.json") : "";
  std::unique_ptr<tok::Tokenizer> tokenizer = tok::Tokenizer::from_json(dir.read_text("tokenizer.json"), tokenizer_config);
  std::unique_ptr<tmpl::ChatTemplate> chat_template;
  std::string template_source;
  if (!a.chat_template.empty()) {
    std::ifstream f(a.chat_template);
    if (!f) fail("cannot read --chat-template '{}'", a.chat_template);
    std::stringstream ss;
    ss << f.rdbuf();
    chat_template = std::make_unique<tmpl::ChatTemplate>(ss.str());
    template_source = a.chat_template;
  } else {
    std::optional<std::string> jinja;
    if (dir.has("chat_template.jinja")) jinja = dir.read_text("chat_template.jinja");
    try {
      chat_template = tmpl::ChatTemplate::from_model_files(jinja, tokenizer_config);
      template_source = jinja ? "chat_template.jinja" : "tokenizer_config.json";
    } catch (const Error& e) {
      KILN_LOG_WARN("no chat template ({}); /v1/chat/completions will answer 400", e.what());
    }
  }
  std::string sampling_desc;
  so.default_sampling = default_sampling(dir, &sampling_desc);
  engine::EngineOptions eo;
  eo.max_running_requests = a.max_running_requests;
  eo.max_queued_requests = a.max_queued_requests;
  eo.chunked_prefill_size = prefill.step_tokens;
  eo.context_length = a.context_length;
  eo.enable_prefix_cache = !a.disable_radix_cache;
  // State slots per running request: its own; with the prefix cache also its two pending page-boundary snapshots
  // (engine/scheduler.h); slots that running requests do not hold keep cached snapshots.
  const int slots_per_request = engine::state_slots_per_request(!a.disable_radix_cache);
  for (int64_t id : config.eos_token_ids) eo.eos_token_ids.push_back(static_cast<int32_t>(id));
  // Chat models end a turn with <|im_end|> and may also end with <|endoftext|>.
  for (const char* t : {"<|im_end|>", "<|endoftext|>"})
    if (int32_t id = tokenizer->token_to_id(t); id >= 0) eo.eos_token_ids.push_back(id);
  if (auto eos = tokenizer->eos_token())
    if (int32_t id = tokenizer->token_to_id(*eos); id >= 0) eo.eos_token_ids.push_back(id);
  std::sort(eo.eos_token_ids.begin(), eo.eos_token_ids.end());
  eo.eos_token_ids.erase(std::unique(eo.eos_token_ids.begin(), eo.eos_token_ids.end()), eo.eos_token_ids.end());
  so.eos_token_ids = eo.eos_token_ids;
  args_json["max_running_requests"] = a.max_running_requests;
  args_json["disable_radix_cache"] = a.disable_radix_cache;
  args_json["max_queued_requests"] = a.max_queued_requests;
  args_json["chunked_prefill_size_flag"] = a.chunked_prefill_size;
  args_json["chunked_prefill_size"] = prefill.step_tokens;
  args_json["max_pass_tokens"] = prefill.pass_tokens;
  so.server_args = args_json;

  // The load options of this launch (one code path for node 0 and the other nodes of several machines).
  auto load_options = [&]() {
    const int64_t context = a.context_length;
    backend::CpuLoadOptions lo;
    lo.kv_dtype = kv_dtype;
    lo.max_context = context;
    lo.threads = a.threads;
    lo.slots_per_request = slots_per_request;
    lo.prefill_chunk = prefill.pass_tokens;
    if (a.max_total_tokens > 0) lo.kv_pages = (a.max_total_tokens + lo.page_size - 1) / lo.page_size;
    if (device_choice.device == "cuda") {
      lo.state_slots = a.max_running_requests * slots_per_request;  // 0: the memory plan chooses
    } else {
      // CPU: no memory plan; a full context for every running request, at most 256k tokens (at least one
      // context).
      const int running = a.max_running_requests > 0 ? a.max_running_requests : 32;
      lo.state_slots = running * slots_per_request;
      const int64_t ctx = context > 0 ? std::min<int64_t>(context, config.max_position_embeddings)
                                      : config.max_position_embeddings;
      if (lo.kv_pages == 0)
        lo.kv_pages = (std::max<int64_t>(ctx, std::min<int64_t>(int64_t(running) * ctx, 262144)) + lo.page_size - 1) /
                      lo.page_size;
    }
    kiln::cli::apply_gpu_flags(a.gpu, lo);
    kiln::cli::apply_parallel_flags(a.parallel, lo, device_choice.device);
    return lo;
  };

  // Several machines, a node other than 0: no HTTP front and no scheduler; load this node's ranks, meet the others,
  // then run node 0's steps until it stops the group (model/tp_runner.h).
  if (a.parallel.nnodes > 1 && a.parallel.node_rank > 0) {
    if (!a.dummy_runner.empty()) fail("--dummy-runner runs no model: it cannot join --nnodes {}", a.parallel.nnodes);
    signals.start([&](int sig) {
      std::fprintf(stderr, "kiln serve: %s on node %d, exiting (node 0's steps will fail: restart every node)\n",
                   sig == SIGINT ? "SIGINT" : "SIGTERM", a.parallel.node_rank);
      std::_Exit(0);
    });
    backend::CpuLoadOptions lo = load_options();
    auto runner = backend::load_model(dir, a.device, lo, !a.skip_self_check);
    auto* tp = dynamic_cast<model::TpRunner*>(runner.get());
    if (!tp) fail("--nnodes {}: the loaded model is not a tensor-parallel group", a.parallel.nnodes);
    std::printf("kiln serve: node %d of %d ready (ranks %d-%d of tp %d); following node 0 (no HTTP on this node)\n",
                a.parallel.node_rank, a.parallel.nnodes, tp->first_rank(), tp->first_rank() + tp->size() - 1,
                a.parallel.tp_size);
    std::fflush(stdout);
    tp->follow();
    std::printf("kiln serve: node %d: node 0 stopped the group, exiting\n", a.parallel.node_rank);
    return 0;
  }

  server::HttpServer http(so);
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
  signals.start([&](int sig) {
    std::lock_guard<std::mutex> lock(mu);
    ++signals_seen;
    if (!model_ready) {
      std::fprintf(stderr, "kiln serve: %s during startup, exiting\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
      std::_Exit(0);
    }
    if (signals_seen >= 2) {
      std::fprintf(stderr, "kiln serve: second signal, exiting without waiting for requests\n");
      std::_Exit(1);
    }
    cv.notify_all();
  });
  KILN_LOG_INFO("listening on http://{}:{} (loading the model; /health answers 503 until ready)", a.host, http.port());

  std::unique_ptr<model::ModelRunner> runner;
  {
    int64_t context = a.context_length;
    if (!a.dummy_runner.empty()) {
      engine::DummyRunner::Options d;
      if (a.dummy_runner == "echo") {
        d.echo = true;
        d.turn_start = tokenizer->token_to_id("<|im_start|>");
        d.turn_end = tokenizer->token_to_id("<|im_end|>");
        auto nl = tokenizer->encode("\n", false);
        d.newline = nl.size() == 1 ? nl[0] : -1;
      }
      d.vocab = std::max<int64_t>(config.vocab_size, tokenizer->vocab_size());
      const int64_t mpe = config.max_position_embeddings > 0 ? config.max_position_embeddings : 4096;
      d.max_context = context > 0 ? std::min(context, mpe) : mpe;
      d.page_size = 16;
      const int running = a.max_running_requests > 0 ? a.max_running_requests : 32;
      d.state_slots = running * slots_per_request;
      d.kv_pages = a.max_total_tokens > 0 ? (a.max_total_tokens + 15) / 16 : running * ((d.max_context + 15) / 16);
      runner = std::make_unique<engine::DummyRunner>(d);
    } else {
      backend::CpuLoadOptions lo = load_options();
      runner = backend::load_model(dir, a.device, lo, !a.skip_self_check);  // the user's choice: its log says why
    }
  }
  std::string description = runner->describe();
  if (eo.max_running_requests <= 0)
    eo.max_running_requests = std::max(1, runner->capacity().state_slots / slots_per_request);
  engine::Engine engine(std::move(runner), eo);
  engine.start();
  server::ModelContext mc;
  mc.engine = &engine;
  mc.tokenizer = tokenizer.get();
  mc.chat_template = chat_template.get();
  http.attach(mc);

  const auto& cap = engine.capacity();
  std::printf("kiln serve\n");
  std::printf("  model:     %s (%s%s%s)\n", dir.display_path().c_str(), config.model_type.c_str(),
              config.architecture.empty() ? "" : ", ", config.architecture.c_str());
  if (!a.dummy_runner.empty()) std::printf("  weights:   none (--dummy-runner %s, for testing)\n", a.dummy_runner.c_str());
  std::printf("  tokenizer: %lld tokens; eos ids", static_cast<long long>(tokenizer->vocab_size()));
  for (int32_t id : eo.eos_token_ids) std::printf(" %d", id);
  std::printf("\n  template:  %s\n", chat_template ? template_source.c_str() : "none (chat completions disabled)");
  std::printf("  context:   %lld tokens per sequence\n", static_cast<long long>(engine.context_length()));
  std::printf("  KV cache:  %lld pages x %d tokens = %lld tokens, max_total_num_tokens (%s, %s); %d state slots (%s)\n",
              static_cast<long long>(cap.kv_pages), cap.page_size,
              static_cast<long long>(cap.kv_pages * cap.page_size), a.kv_cache_dtype == "auto" ? "bf16" : a.kv_cache_dtype.c_str(),
              human_bytes(double(cap.kv_pages) * cap.page_size * cap.kv_bytes_per_token).c_str(), cap.state_slots,
              human_bytes(double(cap.state_slots) * cap.state_bytes_per_slot).c_str());
  std::printf("  batching:  up to %d running, %d queued; KV pages allocated as sequences grow (preemption when the "
              "pool is full)\n",
              engine.options().max_running_requests, a.max_queued_requests);
  std::printf("  prefill:   %s; forward passes of at most %lld tokens (--max-pass-tokens; activation memory is "
              "planned for one)\n",
              prefill.step_tokens > 0
                  ? fmt::format("steps of at most {} tokens, decodes + prompt chunks ({})", prefill.step_tokens,
                                prefill.reason).c_str()
                  : prefill.reason.c_str(),
              static_cast<long long>(prefill.pass_tokens));
  std::printf("  prefix cache: %s\n", engine.options().enable_prefix_cache
                                          ? "on (radix tree over KV pages + state snapshots; --disable-radix-cache)"
                                          : "off");
  std::printf("  sampling:  defaults %s\n", sampling_desc.empty() ? "OpenAI's (temperature 1, top_p 1)"
                                                                  : ("from generation_config.json: " + sampling_desc).c_str());
  std::printf("  parsers:   reasoning %s, tool calls %s\n", http.reasoning_parser_on() ? "qwen3" : "off",
              http.tool_call_parser_on() ? "qwen3_coder" : "off");
  std::printf("  runner:    %s\n", description.c_str());
  std::printf("  api key:   %s\n", a.api_key.empty() ? "none (open)" : "required (Authorization: Bearer ...)");
  std::printf("ready: http://%s:%d (model \"%s\")\n", a.host.c_str(), http.port(), so.served_model_name.c_str());
  std::fflush(stdout);

  {
    std::unique_lock<std::mutex> lock(mu);
    model_ready = true;
    cv.wait(lock, [&] { return signals_seen > 0; });
  }
  KILN_LOG_INFO("shutting down: refusing new requests, finishing {} in flight (up to {} s)", http.active_requests(),
                a.shutdown_timeout_s);
  http.set_draining();
  bool clean = engine.drain(std::chrono::milliseconds(static_cast<int64_t>(a.shutdown_timeout_s * 1000)));
  if (!clean) KILN_LOG_WARN("shutdown timeout: aborted the requests still running");
  // Let the HTTP threads write the last chunks of the finished requests.
  for (int i = 0; i < 100 && http.active_requests() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  stop_http();
  engine.stop();
  KILN_LOG_INFO("stopped");
  return 0;
}

kiln::cli::Registrar reg{"serve", "Serve a model over an OpenAI-compatible HTTP API", [](CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  app.add_option("--model-path", a->model_path, "Model folder (default: the embedded kiln-tiny)");
  app.add_option("--host", a->host, "Address to listen on")->capture_default_str();
  app.add_option("--port", a->port, "Port to listen on")->capture_default_str();
  app.add_option("--served-model-name", a->served_model_name, "Model name in the API (default: the model path)");
  app.add_option("--api-key", a->api_key, "Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (/health, /health_generate, /metrics stay open)");
  app.add_option("--context-length", a->context_length, "Longest sequence, prompt + output (default: the model's)");
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
                 "Sequences decoded together at most (default: cuda: the memory plan's, at most 256; cpu: 32)");
  app.add_option("--max-queued-requests", a->max_queued_requests,
                 "Waiting sequences at most; beyond, requests get 503 + Retry-After")
      ->capture_default_str();
  app.add_option("--chunked-prefill-size", a->chunked_prefill_size,
                 "Tokens per engine step, decodes included: every step carries each decoding sequence's token plus "
                 "prompt chunks up to the rest, so long prompts are prefilled over several steps while streams keep "
                 "flowing. auto: 8192 on a GPU of 80 GB or more, 2048 on a smaller GPU, 512 on the CPU; <= 0: whole "
                 "prompts in one step")
      ->capture_default_str();
  app.add_option("--max-pass-tokens", a->max_pass_tokens,
                 "Most tokens in one forward pass (a larger step runs as several passes); cuda: the memory plan "
                 "reserves activation scratch for one such pass. Never more than --chunked-prefill-size")
      ->capture_default_str();
  app.add_option("--max-total-tokens", a->max_total_tokens,
                 "KV cache size in tokens (default: cuda: all memory the plan leaves; cpu: a context per running "
                 "request, at most 256k tokens)");
  app.add_flag("--disable-radix-cache", a->disable_radix_cache,
               "Turn the prefix cache (shared KV pages + state snapshots across requests) off");
  app.add_option("--threads", a->threads, "CPU worker threads (default: all cores or $KILN_THREADS)");
  app.add_option("--device", a->device, "auto, cpu or cuda")->capture_default_str();
  app.add_flag("--skip-self-check", a->skip_self_check,
               "cuda: start without the numerical self-check against the CPU backend");
  kiln::cli::add_gpu_flags(app, a->gpu);
  kiln::cli::add_parallel_flags(app, a->parallel);
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
  a->http_front.add_to(app);
  app.add_option("--dummy-runner", a->dummy_runner,
                 "Testing without weights: 'hash' (logits hash each sequence's tokens) or 'echo' (repeats the "
                 "last chat turn); uses the model folder's tokenizer and template only")
      ->group("");  // hidden
  return [a]() -> int { return run_serve(*a); };
}};

}  // namespace
