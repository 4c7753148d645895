#include "cli/serve_options.h"

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>

#include <fmt/format.h>

#include "core/error.h"
#include "engine/scheduler.h"

namespace kiln::cli {

DType check_serve_args(const ServeArgs& a) {
  if (a.port < 0 || a.port > 65535) fail("--port must be 0..65535 (got {})", a.port);
  if (a.max_running_requests < 0) fail("--max-running-requests must be at least 1 (got {})", a.max_running_requests);
  if (a.max_queued_requests < 0) fail("--max-queued-requests must be 0 or more (got {})", a.max_queued_requests);
  if (a.context_length < 0) fail("--context-length must be positive (got {})", a.context_length);
  if (a.shutdown_timeout_s < 0) fail("--shutdown-timeout must be 0 or more seconds");
  if (a.max_request_bytes < 1024) fail("--max-request-bytes must be at least 1024");
  if (a.responses_store_size < 0) fail("--responses-store-size must be 0 (store nothing) or more");
  if (a.responses_store_ttl_s < 1) fail("--responses-store-ttl must be at least 1 second");
  if (!a.dummy_runner.empty() && a.dummy_runner != "hash" && a.dummy_runner != "echo")
    fail("unknown --dummy-runner '{}' (use hash or echo)", a.dummy_runner);
  serve_log_format(a);
  parse_allowed_origins(a.allowed_origins);
  if (a.kv_cache_dtype == "fp8_e4m3") return DType::F8_E4M3;
  if (a.kv_cache_dtype != "auto" && a.kv_cache_dtype != "bf16")
    fail("unknown --kv-cache-dtype '{}' (use auto, bf16 or fp8_e4m3)", a.kv_cache_dtype);
  return DType::BF16;
}

LogFormat serve_log_format(const ServeArgs& a) {
  LogFormat format;
  if (!parse_log_format(a.log_format, &format)) fail("unknown --log-format '{}' (use text or json)", a.log_format);
  return format;
}

std::vector<std::string> parse_allowed_origins(const std::string& flag) {
  std::vector<std::string> out;
  std::stringstream ss(flag);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t b = item.find_first_not_of(' ');
    if (b == std::string::npos) continue;
    item = item.substr(b, item.find_last_not_of(' ') - b + 1);
    if (item != "*" && item.find("://") == std::string::npos)
      fail("--allowed-origins: '{}' is not an origin (scheme://host[:port], e.g. https://app.example.com) or *", item);
    while (item.size() > 1 && item.back() == '/') item.pop_back();  // browsers send origins without a slash
    out.push_back(item);
  }
  return out;
}

void check_serve_args_against_model(const ServeArgs& a, const format::ModelConfig& config) {
  if (a.context_length > config.max_position_embeddings && config.max_position_embeddings > 0)
    fail("--context-length {} is more than the model's max_position_embeddings ({}); use at most {} (or leave the flag "
         "out for the model's length)",
         a.context_length, config.max_position_embeddings, config.max_position_embeddings);
}

server::ServerOptions build_server_options(const ServeArgs& a, const ServeContext& c,
                                           const format::ModelConfig& config) {
  server::ServerOptions so;
  so.host = a.host;
  so.port = a.port;
  so.api_key = a.api_key;
  so.allowed_origins = parse_allowed_origins(a.allowed_origins);
  so.reasoning_parser = a.reasoning_parser;
  so.tool_call_parser = a.tool_call_parser;
  so.max_request_bytes = static_cast<size_t>(a.max_request_bytes);
  so.responses_store.max_entries = static_cast<size_t>(a.responses_store_size);
  so.responses_store.max_age_s = a.responses_store_ttl_s;
  so.request_timeout_s = a.http_front.request_timeout_s;
  so.min_upload_rate_bytes_s = a.http_front.min_upload_rate;
  so.max_connections = a.http_front.max_connections;
  so.max_connections_per_client = a.http_front.max_connections_per_client;
  so.http_threads =
      std::min(2048, (a.max_running_requests > 0 ? a.max_running_requests : 256) + a.max_queued_requests + 32);
  so.model_path = c.model_path;
  so.tokenizer_path = c.model_path;
  so.served_model_name = !a.served_model_name.empty() ? a.served_model_name : c.model_path;
  so.model_type = config.model_type;
  if (!config.architecture.empty()) so.architectures = {config.architecture};
  so.server_args = serve_args_json(a, c, so.served_model_name);
  return so;
}

nlohmann::json serve_args_json(const ServeArgs& a, const ServeContext& c, const std::string& served_model_name) {
  return {{"model_path", c.model_path},
          {"host", a.host},
          {"port", a.port},
          {"served_model_name", served_model_name},
          {"api_key_set", !a.api_key.empty()},
          {"allowed_origins", parse_allowed_origins(a.allowed_origins)},
          {"log_format", a.log_format},
          {"context_length_flag", a.context_length},
          {"kv_cache_dtype", a.kv_cache_dtype},
          {"dtype", a.gpu.gpu.dtype},  // as given; the resolved one is in "backend" (kernels: dtype)
          {"reasoning_parser_flag", a.reasoning_parser},
          {"tool_call_parser_flag", a.tool_call_parser},
          {"chat_template", a.chat_template},
          {"max_total_tokens", a.max_total_tokens},
          {"threads", a.threads},
          {"device", c.shown_device(a)},
          {"shutdown_timeout", a.shutdown_timeout_s},
          {"max_request_bytes", a.max_request_bytes},
          {"responses_store_size", a.responses_store_size},
          {"responses_store_ttl", a.responses_store_ttl_s},
          {"max_running_requests", a.max_running_requests},
          {"disable_radix_cache", a.disable_radix_cache},
          {"disable_chunk_snapshots", a.disable_chunk_snapshots},
          {"max_queued_requests", a.max_queued_requests},
          {"chunked_prefill_size_flag", a.chunked_prefill_size},
          {"chunked_prefill_size", c.prefill.step_tokens},
          {"max_pass_tokens", c.prefill.pass_tokens},
          {"chunked_prefill_size_while_decoding", c.prefill.step_tokens_while_decoding}};
}

std::vector<int32_t> collect_eos_ids(const std::vector<int64_t>& config_ids,
                                     const std::function<int32_t(const std::string&)>& token_id,
                                     const std::optional<std::string>& eos_token) {
  std::vector<int32_t> ids;
  for (int64_t id : config_ids) ids.push_back(static_cast<int32_t>(id));
  for (const char* t : {"<|im_end|>", "<|endoftext|>"})
    if (int32_t id = token_id(t); id >= 0) ids.push_back(id);
  if (eos_token)
    if (int32_t id = token_id(*eos_token); id >= 0) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

engine::EngineOptions build_engine_options(const ServeArgs& a, const ServeContext& c,
                                           std::vector<int32_t> eos_token_ids) {
  engine::EngineOptions eo;
  eo.max_running_requests = a.max_running_requests;  // 0: the runner's state slots decide (cmd_serve)
  eo.max_queued_requests = a.max_queued_requests;
  eo.chunked_prefill_size = c.prefill.step_tokens;
  eo.step_budget_while_decoding = c.prefill.step_tokens_while_decoding;
  eo.context_length = a.context_length;
  eo.enable_prefix_cache = !a.disable_radix_cache;
  eo.chunk_snapshots = !a.disable_chunk_snapshots;
  eo.eos_token_ids = std::move(eos_token_ids);
  return eo;
}

int64_t cpu_kv_pages(int running, int64_t context_flag, int64_t model_context, int page_size) {
  const int64_t ctx = context_flag > 0 ? std::min<int64_t>(context_flag, model_context) : model_context;
  const int64_t tokens = std::max<int64_t>(ctx, std::min<int64_t>(int64_t(running) * ctx, 262144));
  return (tokens + page_size - 1) / page_size;
}

backend::LoadOptions build_load_options(const ServeArgs& a, const ServeContext& c, const format::ModelConfig& config,
                                        DType kv_dtype) {
  backend::LoadOptions lo;
  lo.kv_dtype = kv_dtype;
  lo.max_context = a.context_length;
  lo.threads = a.threads;
  lo.slots_per_request = c.slots_per_request;
  lo.prefill_chunk = c.prefill.pass_tokens;
  if (a.max_total_tokens > 0) lo.kv_pages = (a.max_total_tokens + lo.page_size - 1) / lo.page_size;
  if (c.device == "cuda") {
    lo.state_slots = a.max_running_requests * c.slots_per_request;  // 0: the memory plan chooses
  } else {
    // CPU: no memory plan.
    const int running = a.max_running_requests > 0 ? a.max_running_requests : kCpuDefaultRunning;
    lo.state_slots = running * c.slots_per_request;
    if (lo.kv_pages == 0)
      lo.kv_pages = cpu_kv_pages(running, a.context_length, config.max_position_embeddings, lo.page_size);
  }
  apply_gpu_flags(a.gpu, lo);
  lo.parallel = a.parallel;
  return lo;
}

engine::SamplingParams default_sampling(std::string_view generation_config_json, std::string* described) {
  engine::SamplingParams s;
  if (generation_config_json.empty()) return s;
  auto j = nlohmann::json::parse(generation_config_json.begin(), generation_config_json.end(), nullptr, false);
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

engine::DummyRunner::Options build_dummy_runner_options(const ServeArgs& a, const ServeContext& c,
                                                        const format::ModelConfig& config, const DummyTokens& t) {
  engine::DummyRunner::Options d;
  if (a.dummy_runner == "echo") {
    d.echo = true;
    d.turn_start = t.turn_start;
    d.turn_end = t.turn_end;
    d.newline = t.newline;
  }
  d.vocab = std::max<int64_t>(config.vocab_size, t.vocab);
  const int64_t mpe = config.max_position_embeddings > 0 ? config.max_position_embeddings : 4096;
  d.capacity.max_context = a.context_length > 0 ? std::min(a.context_length, mpe) : mpe;
  d.capacity.page_size = 16;
  const int running = a.max_running_requests > 0 ? a.max_running_requests : kCpuDefaultRunning;
  d.capacity.state_slots = running * c.slots_per_request;
  d.capacity.kv_pages =
      a.max_total_tokens > 0 ? (a.max_total_tokens + 15) / 16 : running * ((d.capacity.max_context + 15) / 16);
  return d;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", b, units[u]);
}

std::string startup_summary(const ServeSummary& s) {
  const model::RunnerCapacity& cap = s.capacity;
  std::string out = "kiln serve\n";
  out += fmt::format("  model:     {} ({}{}{})\n", s.model, s.model_type, s.architecture.empty() ? "" : ", ",
                     s.architecture);
  if (!s.dummy_runner.empty()) out += fmt::format("  weights:   none (--dummy-runner {}, for testing)\n", s.dummy_runner);
  out += fmt::format("  tokenizer: {} tokens; eos ids", s.vocab_size);
  for (int32_t id : s.eos_token_ids) out += fmt::format(" {}", id);
  out += fmt::format("\n  template:  {}\n",
                     !s.template_source.empty() ? s.template_source : "none (chat completions disabled)");
  out += fmt::format("  context:   {} tokens per sequence\n", s.context_length);
  out += fmt::format("  KV cache:  {} pages x {} tokens = {} tokens, max_total_num_tokens ({}, {}); {} state slots ({})\n",
                     cap.kv_pages, cap.page_size, cap.kv_pages * cap.page_size,
                     s.kv_cache_dtype == "auto" ? "bf16" : s.kv_cache_dtype,
                     human_bytes(double(cap.kv_pages) * cap.page_size * cap.kv_bytes_per_token), cap.state_slots,
                     human_bytes(double(cap.state_slots) * cap.state_bytes_per_slot));
  out += fmt::format("  batching:  up to {} running, {} queued; KV pages allocated as sequences grow (preemption when "
                     "the pool is full)\n", s.max_running, s.max_queued);
  out += fmt::format("  prefill:   {}; forward passes of at most {} tokens (--max-pass-tokens; activation memory is "
                     "planned for one)\n",
                     s.prefill.step_tokens > 0 ? fmt::format("steps of at most {} tokens, decodes + prompt chunks ({})",
                                                             s.prefill.step_tokens, s.prefill.reason)
                                               : s.prefill.reason,
                     s.prefill.pass_tokens);
  out += fmt::format("  prefix cache: {}\n", s.prefix_cache
                                                 ? "on (radix tree over KV pages + state snapshots; --disable-radix-cache)"
                                                 : "off");
  if (!s.speculative.empty()) out += fmt::format("  speculative: {}\n", s.speculative);
  if (!s.images.empty()) out += fmt::format("  images:    {}\n", s.images);
  out += fmt::format("  sampling:  defaults {}\n", s.sampling.empty() ? "OpenAI's (temperature 1, top_p 1)"
                                                                     : "from generation_config.json: " + s.sampling);
  out += fmt::format("  parsers:   reasoning {}, tool calls {}\n", s.reasoning_parser ? "qwen3" : "off",
                     s.tool_call_parser ? "qwen3_coder" : "off");
  out += fmt::format("  runner:    {}\n", s.runner);
  for (const EnvReport& e : s.nccl) out += fmt::format("  nccl:      {}\n", e.str());
  out += fmt::format("  api key:   {}\n", s.api_key ? "required (Authorization: Bearer ...)" : "none (open)");
  out += fmt::format("ready: http://{}:{} (model \"{}\")\n", s.host, s.port, s.served_model_name);
  return out;
}

int parse_image_limit(const std::string& flag) {
  std::string f = flag;
  f.erase(std::remove_if(f.begin(), f.end(), [](char c) { return c == ' '; }), f.end());
  int64_t n = -1;
  if (!f.empty() && f.front() == '{') {
    const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      fail("--limit-mm-per-prompt '{}': not a JSON object (use image=N or '{{\"image\": N}}')", flag);
    for (const auto& [k, v] : j.items()) {
      if (k != "image") fail("--limit-mm-per-prompt: '{}' inputs are not supported (kiln reads images only)", k);
      if (!v.is_number_integer()) fail("--limit-mm-per-prompt: the image count must be an integer");
      n = v.get<int64_t>();
    }
  } else if (f.rfind("image=", 0) == 0) {
    const std::string v = f.substr(6);
    char* end = nullptr;
    n = v.empty() ? -1 : std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end) fail("--limit-mm-per-prompt '{}': the count after image= must be an integer", flag);
  } else {
    fail("--limit-mm-per-prompt '{}': use image=N or '{{\"image\": N}}' (kiln reads images only)", flag);
  }
  if (n < 0 || n > 1000) fail("--limit-mm-per-prompt: {} images per request (0 to 1000)", n);
  return static_cast<int>(n);
}

media::MediaOptions build_media_options(const ServeArgs& a) {
  media::MediaOptions m;
  if (a.max_image_bytes < 1) fail("{} must be at least 1", media::kFlagMaxImageBytes);
  if (a.max_image_pixels < 1) fail("{} must be at least 1", media::kFlagMaxImagePixels);
  if (!(a.image_fetch_timeout_s > 0)) fail("{} must be positive (seconds)", media::kFlagImageFetchTimeout);
  m.max_image_bytes = static_cast<size_t>(a.max_image_bytes);
  m.max_pixels = a.max_image_pixels;
  m.allowed_local_path = a.allowed_local_media_path;
  m.allow_url_fetch = a.allow_image_url_fetch;
  m.fetch_timeout_s = a.image_fetch_timeout_s;
  return m;
}

}  // namespace kiln::cli
