// The operational routes: /health, /health_generate, /v1/models, /get_model_info, /get_server_info, /metrics,
// /tokenize, /detokenize, and SGLang's /version and /flush_cache.
#include <chrono>
#include <thread>

#include "engine/engine.h"
#include "server/response.h"
#include "server/server_state.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

using json = nlohmann::json;

namespace {

constexpr const char* kKilnVersion = "0.1.0";  // the project version (CMakeLists.txt, kiln --version)

struct AdminRoutes {
  ServerState& s;


  void handle_health(const httplib::Request&, httplib::Response& res) {
    res.status = s.ready.load() && !s.draining.load() ? 200 : 503;
    res.set_content("", "text/plain");
    // A runner that cannot run steps any more (a multi-node group that broke) is not healthy; say why.
    if (res.status == 200 && s.model.engine) {
      const std::string why = s.model.engine->fatal_error();
      if (!why.empty()) {
        res.status = 503;
        res.set_content(why + "\n", "text/plain");
      }
    }
  }

  // As SGLang's: healthy as soon as the engine finishes a step after the check began, whether the step served
  // this check's own one-token generation or other requests, so a busy server (a full batch, a queue) answers
  // at once instead of after its queue. 503 when the engine makes no step for 20 s or the generation fails.
  void handle_health_generate(const httplib::Request&, httplib::Response& res) {
    s.require_generation();
    engine::Engine& eng = *s.model.engine;
    const uint64_t steps_before = eng.metrics().steps_total;
    engine::GenerateRequest r;
    r.id = "health-" + random_hex(8);
    r.prompt = s.model.tokenizer->encode("ping", false);
    if (r.prompt.empty()) r.prompt = {0};
    r.max_tokens = 1;
    r.ignore_eos = true;
    r.sampling.temperature = 0.0f;
    engine::SubmitResult sr = eng.submit({r});
    if (sr.status == engine::SubmitStatus::draining) throw ApiError(503, "the server is shutting down", "", "shutting_down");
    if (sr.status == engine::SubmitStatus::invalid) throw ApiError(503, "health generation not accepted: " + sr.message);
    // queue_full: the queue is busy, not the engine; its steps answer.
    std::shared_ptr<engine::RequestChannel> channel = sr.status == engine::SubmitStatus::ok ? sr.channel : nullptr;
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    std::vector<engine::TokenEvent> events;
    bool ok = false;
    std::string failure;
    while (!ok && failure.empty() && Clock::now() < deadline) {
      if (channel) {
        events.clear();
        channel->wait(events, std::chrono::milliseconds(20));
        for (const auto& ev : events)
          if (ev.finished) {
            if (ev.finish_reason == engine::FinishReason::error) failure = ev.error;
            else ok = true;
          }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (failure.empty() && eng.metrics().steps_total > steps_before) ok = true;
    }
    if (channel) channel->cancel();  // done with it: the engine drops it if it has not run yet
    if (!failure.empty()) throw ApiError(503, "health generation failed: " + failure);
    if (!ok) throw ApiError(503, "the engine made no step within 20 s");
    res.status = 200;
    res.set_content("", "text/plain");
  }

  json model_card() const {
    return {{"id", s.opts.served_model_name},
            {"object", "model"},
            {"created", s.created_at},
            {"owned_by", "kiln"},
            {"root", s.opts.model_path},
            {"max_model_len", s.model.engine ? s.model.engine->context_length() : 0}};
  }

  void handle_models(const httplib::Request&, httplib::Response& res) {
    s.require_model();
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model_card()})}});
  }

  void handle_model(const httplib::Request& req, httplib::Response& res) {
    s.require_model();
    std::string name = req.matches[1];
    s.check_model_name(name);
    send_json(res, 200, model_card());
  }

  void handle_model_info(const httplib::Request&, httplib::Response& res) {
    s.require_model();
    send_json(res, 200,
              {{"model_path", s.opts.model_path},
               {"tokenizer_path", s.opts.tokenizer_path},
               {"is_generation", true},
               {"preferred_sampling_params", nullptr},
               {"weight_version", s.opts.weight_version},
               {"has_image_understanding", false},
               {"has_audio_understanding", false},
               {"model_type", s.opts.model_type},
               {"architectures", s.opts.architectures},
               {"served_model_name", s.opts.served_model_name},
               {"context_length", s.model.engine->context_length()},
               {"vocab_size", s.model.engine->vocab_size()},
               {"eos_token_ids", s.opts.eos_token_ids}});
  }

  void handle_server_info(const httplib::Request&, httplib::Response& res) {
    json info = s.opts.server_args.is_object() ? s.opts.server_args : json::object();
    info["version"] = kKilnVersion;
    info["status"] = !s.ready.load() ? "loading" : s.draining.load() ? "draining" : "ready";
    info["served_model_name"] = s.opts.served_model_name;
    info["reasoning_parser"] = s.reasoning_on ? "qwen3" : "none";
    info["tool_call_parser"] = s.tools_on ? "qwen3_coder" : "none";
    if (s.ready.load()) {
      engine::Engine& eng = *s.model.engine;
      const auto& cap = eng.capacity();
      auto m = eng.metrics();
      info["context_length"] = eng.context_length();
      info["page_size"] = cap.page_size;
      info["kv_pages"] = cap.kv_pages;
      info["max_total_num_tokens"] = cap.kv_pages * cap.page_size;
      info["state_slots"] = cap.state_slots;
      info["kv_bytes_per_token"] = cap.kv_bytes_per_token;
      info["state_bytes_per_slot"] = cap.state_bytes_per_slot;
      info["max_running_requests"] = eng.options().max_running_requests;
      info["max_queued_requests"] = eng.options().max_queued_requests;
      info["chunked_prefill_size"] = eng.options().chunked_prefill_size;
      info["chunked_prefill_size_while_decoding"] = eng.options().step_budget_while_decoding;
      info["backend"] = eng.describe();
      // One entry per GPU rank of this node (empty on the CPU backend).
      json gpus = json::array();
      for (const model::DeviceMemory& d : eng.device_memory())
        gpus.push_back({{"rank", d.rank}, {"gpu", d.device}, {"name", d.name}, {"weight_bytes", d.weight_bytes},
                        {"kv_cache_bytes", d.kv_bytes}, {"state_bytes", d.state_bytes},
                        {"scratch_bytes", d.scratch_bytes}, {"total_bytes", d.total_bytes}});
      info["gpus"] = gpus;
      info["internal_states"] = json::array({{{"num_running_reqs", m.num_running},
                                              {"num_queue_reqs", m.num_waiting},
                                              {"kv_pages_used", m.kv_pages_used},
                                              {"token_usage", m.kv_pages_total ? double(m.kv_pages_used) / m.kv_pages_total : 0.0}}});
    }
    send_json(res, 200, info);
  }

  // SGLang's GET /version: {"version": ...}.
  void handle_version(const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"version", kKilnVersion}});
  }

  // SGLang's /flush_cache: empties the prefix cache (cached KV pages and state snapshots). 200 once done; 400 while
  // requests run or wait (their pages may be in the cache), as SGLang answers.
  void handle_flush_cache(const httplib::Request&, httplib::Response& res) {
    s.require_model();
    if (!s.model.engine->flush_prefix_cache())
      throw ApiError(400, "the cache was not flushed: requests are running or waiting; retry when the server is idle",
                     "", "server_busy");
    res.status = 200;
    res.set_content("Cache flushed.\n", "text/plain");
  }

  void handle_metrics(const httplib::Request&, httplib::Response& res) {
    engine::EngineMetricsSnapshot m;
    std::vector<model::DeviceMemory> devices;
    if (s.ready.load()) {
      m = s.model.engine->metrics();
      devices = s.model.engine->device_memory();
    }
    HttpCounts counts;
    {
      std::lock_guard<std::mutex> lock(s.stats_mu);
      counts = s.http_counts;
    }
    res.status = 200;
    res.set_content(render_metrics(m, counts, s.opts.served_model_name, devices), "text/plain; version=0.0.4");
  }

  void handle_tokenize(const httplib::Request& req, httplib::Response& res) {
    s.require_model();
    ojson body = parse_json_object(req.body);
    const char* key = body.contains("prompt") ? "prompt" : "text";
    if (!body.contains(key)) throw bad_param("prompt", "'prompt' (or 'text') is required");
    const ojson& p = body[key];
    auto encode = [&](const ojson& text) {
      if (!text.is_string()) throw bad_param(key, std::string("'") + key + "' must be a string or a list of strings");
      return s.model.tokenizer->encode(text.get<std::string>(), true);
    };
    json out = {{"max_model_len", s.model.engine->context_length()}};
    if (p.is_array()) {
      json tokens = json::array(), counts = json::array();
      for (const auto& s : p) {
        auto ids = encode(s);
        counts.push_back(ids.size());
        tokens.push_back(ids);
      }
      out["tokens"] = tokens;
      out["count"] = counts;
    } else {
      auto ids = encode(p);
      out["tokens"] = ids;
      out["count"] = ids.size();
    }
    send_json(res, 200, out);
  }

  void handle_detokenize(const httplib::Request& req, httplib::Response& res) {
    s.require_model();
    ojson body = parse_json_object(req.body);
    if (!body.contains("tokens")) throw bad_param("tokens", "'tokens' is required");
    bool skip_special = true;
    if (body.contains("skip_special_tokens")) {
      if (!body["skip_special_tokens"].is_boolean())
        throw bad_param("skip_special_tokens", "'skip_special_tokens' must be a boolean");
      skip_special = body["skip_special_tokens"].get<bool>();
    }
    const int64_t vocab = s.model.tokenizer->vocab_size();
    auto ids_of = [&](const ojson& list) {
      if (!list.is_array()) throw bad_param("tokens", "'tokens' must be a list of token ids");
      std::vector<int32_t> ids;
      for (const auto& t : list) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
          throw bad_param("tokens", "'tokens' must hold token ids in [0, " + std::to_string(vocab) + ")");
        ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
      }
      return ids;
    };
    const ojson& t = body["tokens"];
    json out;
    if (t.is_array() && !t.empty() && t[0].is_array()) {
      json texts = json::array();
      for (const auto& row : t) texts.push_back(s.model.tokenizer->decode(ids_of(row), skip_special));
      out["text"] = texts;
    } else {
      out["text"] = s.model.tokenizer->decode(ids_of(t), skip_special);
    }
    send_json(res, 200, out);
  }

};

}  // namespace

void add_admin_routes(Routes& routes, ServerState& state) {
  auto admin = std::make_shared<AdminRoutes>(AdminRoutes{state});
  auto bind = [&](auto method, const char* path, void (AdminRoutes::*fn)(const httplib::Request&, httplib::Response&)) {
    (routes.*method)(path, [admin, fn](const httplib::Request& q, httplib::Response& r) { ((*admin).*fn)(q, r); },
                     ErrorStyle::openai);
  };
  bind(&Routes::get, "/health", &AdminRoutes::handle_health);
  bind(&Routes::get, "/health_generate", &AdminRoutes::handle_health_generate);
  bind(&Routes::get, "/v1/models", &AdminRoutes::handle_models);
  bind(&Routes::get, R"(/v1/models/(.+))", &AdminRoutes::handle_model);
  bind(&Routes::get, "/get_model_info", &AdminRoutes::handle_model_info);
  bind(&Routes::get, "/model_info", &AdminRoutes::handle_model_info);
  bind(&Routes::get, "/get_server_info", &AdminRoutes::handle_server_info);
  bind(&Routes::get, "/server_info", &AdminRoutes::handle_server_info);
  bind(&Routes::get, "/metrics", &AdminRoutes::handle_metrics);
  bind(&Routes::get, "/version", &AdminRoutes::handle_version);
  bind(&Routes::post, "/flush_cache", &AdminRoutes::handle_flush_cache);
  bind(&Routes::get, "/flush_cache", &AdminRoutes::handle_flush_cache);  // SGLang takes both
  bind(&Routes::post, "/tokenize", &AdminRoutes::handle_tokenize);
  bind(&Routes::post, "/v1/tokenize", &AdminRoutes::handle_tokenize);
  bind(&Routes::post, "/detokenize", &AdminRoutes::handle_detokenize);
  bind(&Routes::post, "/v1/detokenize", &AdminRoutes::handle_detokenize);
}

}  // namespace kiln::server
