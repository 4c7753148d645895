// kiln serve's flags and the pure builders that turn them, with what startup found (the resolved device, the step
// sizes, the model's config, the tokenizer's ids), into the options of the server, the engine and the loader, and
// into the startup summary. Nothing here reads files, probes a device or prints: cmd_serve.cpp does that and calls
// these (each tested in tests/unit/cli/serve_options_test.cpp).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/device.h"
#include "cli/environment.h"
#include "cli/gpu_flags.h"
#include "cli/speculative_flags.h"
#include "media/media_options.h"
#include "core/dtype.h"
#include "core/log.h"
#include "engine/dummy_runner.h"
#include "engine/engine.h"
#include "format/model_config.h"
#include "model/model_runner.h"
#include "server/http_server.h"

namespace kiln::cli {

// The HTTP front's limits against slow, idle and too many clients (server/request_gate.h).
struct HttpFrontFlags {
  int request_timeout_s = 60;
  int min_upload_rate = 500;  // bytes per second; 0: no minimum
  int max_connections = 0;    // 0: as many as the open-file limit allows
  int max_connections_per_client = 0;  // 0: no limit
};

struct ServeArgs {
  std::string model_path;  // empty: the embedded model
  std::string host = "127.0.0.1";
  int port = 30000;
  std::string served_model_name;
  std::string api_key;
  std::string api_key_file;     // the key from a file (not visible in /proc/<pid>/cmdline); cmd_serve reads it
  std::string allowed_origins;  // CORS: comma-separated origins or *
  std::string log_format = "text";
  int64_t context_length = 0;
  std::string kv_cache_dtype = "auto";
  std::string reasoning_parser = "auto";
  std::string tool_call_parser = "auto";
  std::string chat_template;
  int max_running_requests = 0;  // 0: the memory plan's (cuda), 32 (cpu)
  int max_queued_requests = 256;
  std::string chunked_prefill_size = "auto";  // backend::resolve_prefill_sizes
  std::string max_pass_tokens = "auto";        // backend::resolve_prefill_sizes
  std::string chunked_prefill_size_while_decoding = "auto";  // backend::resolve_prefill_sizes
  int64_t max_total_tokens = 0;
  bool disable_radix_cache = false;
  bool disable_chunk_snapshots = false;
  int threads = 0;
  std::string device = "auto";
  bool skip_self_check = false;
  GpuFlags gpu;
  backend::ParallelOptions parallel;
  SpeculativeFlags speculative;
  double shutdown_timeout_s = 30;
  int64_t max_request_bytes = 32 << 20;
  int64_t responses_store_size = 1024;  // /v1/responses kept for previous_response_id (0: none)
  int64_t responses_store_ttl_s = 3600;
  std::string dummy_runner;  // "", hash or echo
  HttpFrontFlags http_front;
  // Image inputs (a checkpoint with a vision tower): how many per request ("image=N" or {"image": N}; 0 leaves the
  // tower unloaded), and where images may come from (media/media_options.h names these flags in its errors).
  std::string limit_mm_per_prompt = "image=16";
  int64_t max_image_bytes = int64_t{20} << 20;
  int64_t max_image_pixels = int64_t{1} << 26;
  std::string allowed_local_media_path;
  bool allow_image_url_fetch = false;
  double image_fetch_timeout_s = 10.0;
};

// --limit-mm-per-prompt: "image=N" or a JSON object {"image": N} (vLLM's form); kiln::Error for other modalities
// (kiln reads images only) or a negative count.
int parse_image_limit(const std::string& flag);
// The image knobs of the server, checked (kiln::Error naming the flag).
media::MediaOptions build_media_options(const ServeArgs& a);

// The flags' own checks (kiln::Error naming the flag), before anything slow. Returns the KV cache dtype asked for.
DType check_serve_args(const ServeArgs& a);

// --log-format: text or json (kiln::Error otherwise).
LogFormat serve_log_format(const ServeArgs& a);

// --allowed-origins: "*" or a comma-separated list of origins ("https://app.example.com"), spaces and trailing
// slashes dropped (browsers send origins without one); an item that is neither is a kiln::Error.
std::vector<std::string> parse_allowed_origins(const std::string& flag);

// The checks that need the model's config.json: a --context-length past max_position_embeddings (positions never
// trained; kiln reads no RoPE scaling that would stretch them) is a kiln::Error.
void check_serve_args_against_model(const ServeArgs& a, const format::ModelConfig& config);

// Running requests a CPU launch (and --dummy-runner) plans for when --max-running-requests is not set.
inline constexpr int kCpuDefaultRunning = 32;

// What startup has resolved before the options are built.
struct ServeContext {
  std::string device;        // the backend: "cpu" or "cuda"
  std::string model_path;    // --model-path, or the embedded model's name
  backend::PrefillSizes prefill;
  int slots_per_request = 1;  // engine::state_slots_per_request(prefix cache on)
  // The device as /get_server_info shows it: device, or "dummy-hash" / "dummy-echo".
  std::string shown_device(const ServeArgs& a) const { return a.dummy_runner.empty() ? device : "dummy-" + a.dummy_runner; }
};

// The server's options: listener, API key, CORS origins, parsers, limits (the HTTP front's too), the model's facts (eos ids, default sampling and the
// /get_server_info echo of the flags are set by the caller once known: see serve_args_json).
server::ServerOptions build_server_options(const ServeArgs& a, const ServeContext& c, const format::ModelConfig& config);
// The flags as /get_server_info echoes them.
nlohmann::json serve_args_json(const ServeArgs& a, const ServeContext& c, const std::string& served_model_name);

// The ids that end a sequence: config.json's and generation_config.json's, <|im_end|> and <|endoftext|> (chat models
// end a turn with either) and the tokenizer's eos token, each where the vocabulary has it; sorted, unique.
// token_id: the tokenizer's id of a token text, < 0 when it has none.
std::vector<int32_t> collect_eos_ids(const std::vector<int64_t>& config_ids,
                                     const std::function<int32_t(const std::string&)>& token_id,
                                     const std::optional<std::string>& eos_token);

engine::EngineOptions build_engine_options(const ServeArgs& a, const ServeContext& c,
                                           std::vector<int32_t> eos_token_ids);

// KV pages of a CPU launch (no memory plan): a full context for every running request, at most 256k tokens, at
// least one context. context_flag: --context-length (0: the model's).
int64_t cpu_kv_pages(int running, int64_t context_flag, int64_t model_context, int page_size);

// The loader's options of this launch (one code path for node 0 and the other nodes of several machines).
backend::LoadOptions build_load_options(const ServeArgs& a, const ServeContext& c, const format::ModelConfig& config,
                                        DType kv_dtype);

// Sampling defaults a model ships in generation_config.json (what SGLang applies to fields a request leaves out);
// OpenAI's defaults otherwise (also for an empty or unparsable text). described: "temperature 0.6, top_p 0.95".
engine::SamplingParams default_sampling(std::string_view generation_config_json, std::string* described);

// --dummy-runner: the runner's sizes as a CPU launch would take them; the token ids echo mode needs.
struct DummyTokens {
  int64_t vocab = 0;                                   // the tokenizer's vocabulary
  int32_t turn_start = -1, turn_end = -1, newline = -1;  // <|im_start|>, <|im_end|>, "\n" as one token (-1: none)
};
engine::DummyRunner::Options build_dummy_runner_options(const ServeArgs& a, const ServeContext& c,
                                                        const format::ModelConfig& config, const DummyTokens& t);

// Everything the startup summary says, gathered after the engine has started.
struct ServeSummary {
  std::string model, model_type, architecture;  // model: the folder's display path
  std::string dummy_runner;
  int64_t vocab_size = 0;
  std::vector<int32_t> eos_token_ids;
  std::string template_source;  // "" : no chat template
  int64_t context_length = 0;
  model::RunnerCapacity capacity;
  std::string kv_cache_dtype;  // the flag
  int max_running = 0, max_queued = 0;
  backend::PrefillSizes prefill;
  bool prefix_cache = true;
  std::string speculative;  // speculative decoding: on / off and why (cli/speculative_flags.h); "": no line
  std::string images;       // image inputs: on (the processor, the limits) or off and why
  std::string sampling;  // default_sampling's description
  bool reasoning_parser = false, tool_call_parser = false;
  std::string runner;  // the runner's describe()
  std::vector<EnvReport> nccl;  // empty: no NCCL in this launch
  bool api_key = false;
  std::string host, served_model_name;
  int port = 0;
};
// The summary and the "ready:" line, as printed.
std::string startup_summary(const ServeSummary& s);

// 1536 -> "1.5 KiB".
std::string human_bytes(double bytes);

}  // namespace kiln::cli
