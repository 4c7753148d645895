#include "server/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "server/api_error.h"
#include "server/metrics_text.h"
#include "server/protocol.h"
#include "server/response.h"
#include "server/structured_output.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

using json = nlohmann::json;

namespace {

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

const char* status_reason(int status) {
  switch (status) {
    case 400: return "bad request";
    case 401: return "unauthorized";
    case 404: return "not found";
    case 405: return "method not allowed";
    case 408: return "request timeout";
    case 413: return "payload too large";
    case 414: return "URI too long";
    case 500: return "internal server error";
    case 503: return "service unavailable";
    default: return "error";
  }
}

}  // namespace

// cpp-httplib listens with a backlog of 5 (a compile-time constant of the system library): a burst of
// clients would see dropped or reset connections. This subclass reaches the listening socket to
// raise it.
class ListeningServer : public httplib::Server {
 public:
  void raise_backlog(int backlog) {
    socket_t fd = svr_sock_;
    if (fd != INVALID_SOCKET) ::listen(fd, backlog);
  }
};

struct HttpServer::Impl {
  ServerOptions opts;
  ListeningServer svr;
  int bound_port = -1;
  std::atomic<bool> ready{false};
  std::atomic<bool> draining{false};
  ModelContext model;
  bool reasoning_on = false;
  bool tools_on = false;
  ProtocolLimits limits;
  int64_t created_at = unix_now();
  std::mutex stats_mu;
  HttpCounts http_counts;
  std::atomic<int> active_jobs{0};

  explicit Impl(ServerOptions o) : opts(std::move(o)) {}

  // Constrained decoding: the vocabulary's byte strings, built on the first constrained request.
  std::once_flag token_table_once;
  std::shared_ptr<const grammar::TokenTable> token_table_;

  std::shared_ptr<const grammar::Constraint> make_constraint(std::shared_ptr<const grammar::Grammar> g,
                                                             bool starts_in_reasoning) {
    if (!g) return nullptr;
    std::call_once(token_table_once,
                   [&] { token_table_ = token_table(*model.tokenizer, model.engine->vocab_size()); });
    auto c = std::make_shared<grammar::Constraint>();
    c->grammar = std::move(g);
    c->tokens = token_table_;
    // Thinking stays free: the grammar starts after "</think>".
    if (starts_in_reasoning) c->start_after_token = model.tokenizer->token_to_id("</think>");
    return c;
  }

  // --- helpers ---

  static void send_json(httplib::Response& res, int status, const json& body) {
    res.status = status;
    res.set_content(dump_json(body), "application/json");
  }

  void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    if (e.status == 503) res.set_header("Retry-After", std::to_string(opts.retry_after_s));
    res.set_content(error_body(e), "application/json");
  }

  void require_model() const {
    if (!ready.load()) throw ApiError(503, "the model is still loading; retry shortly", "", "model_loading");
  }

  void require_generation() const {
    require_model();
    if (draining.load()) throw ApiError(503, "the server is shutting down", "", "shutting_down");
  }

  void check_model_name(const std::optional<std::string>& name) const {
    if (!name || name->empty()) return;
    if (*name == opts.served_model_name || *name == opts.model_path) return;
    throw ApiError(404,
                   "The model '" + *name + "' does not exist; this server serves '" + opts.served_model_name + "'",
                   "model", "model_not_found");
  }

  // Wraps a handler: ApiError and other exceptions become OpenAI error answers.
  httplib::Server::Handler wrap(std::function<void(const httplib::Request&, httplib::Response&)> fn) {
    return [this, fn = std::move(fn)](const httplib::Request& req, httplib::Response& res) {
      try {
        fn(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const InternalError& e) {
        KILN_LOG_ERROR("{} {}: internal error: {}", req.method, req.path, e.what());
        send_error(res, ApiError(500, std::string("internal error: ") + e.what()));
      } catch (const Error& e) {
        send_error(res, ApiError(400, e.what()));
      } catch (const std::exception& e) {
        KILN_LOG_ERROR("{} {}: {}", req.method, req.path, e.what());
        send_error(res, ApiError(500, std::string("internal error: ") + e.what()));
      }
    };
  }

  // --- generation ---

  std::vector<engine::GenerateRequest> make_requests(const std::string& id, const std::vector<int32_t>& prompt,
                                                     const GenerationFields& f, int64_t max_tokens) const {
    std::vector<engine::GenerateRequest> reqs;
    for (int i = 0; i < f.n; ++i) {
      engine::GenerateRequest r;
      r.id = f.n > 1 ? id + "-" + std::to_string(i) : id;
      r.prompt = prompt;
      r.sampling = f.sampling;
      if (r.sampling.seed && i > 0) r.sampling.seed = *r.sampling.seed + static_cast<uint64_t>(i);
      r.max_tokens = max_tokens;
      r.ignore_eos = f.ignore_eos;
      r.stop_token_ids = f.stop_token_ids;
      r.want_logprobs = f.logprobs;
      r.top_logprobs = f.top_logprobs;
      r.constraint = f.constraint;
      reqs.push_back(std::move(r));
    }
    return reqs;
  }

  void run_generation(const httplib::Request& req, httplib::Response& res, std::shared_ptr<GenerationJob> job,
                      const std::vector<int32_t>& prompt, const ChoiceOptions& choice_opts, const char* prompt_param) {
    engine::Engine& eng = *model.engine;
    const GenerationFields& f = job->fields;
    int64_t prompt_len = static_cast<int64_t>(prompt.size());
    int64_t context = eng.context_length();
    if (prompt_len == 0) throw bad_param(prompt_param, "the prompt is empty");
    if (prompt_len >= context)
      throw ApiError(400,
                     fmt::format("the prompt has {} tokens, but the context length is {} tokens; shorten it",
                                 prompt_len, context),
                     prompt_param, "context_length_exceeded");
    int64_t max_tokens = f.max_tokens.value_or(context - prompt_len);
    if (std::string why = eng.check_fits(prompt_len, max_tokens); !why.empty())
      throw ApiError(400, why, f.max_tokens ? "max_tokens" : prompt_param, "context_length_exceeded");

    job->prompt_tokens = prompt_len;
    job->tokenizer = model.tokenizer;
    for (int i = 0; i < f.n; ++i) job->choices.emplace_back(*model.tokenizer, choice_opts);
    job->acc.resize(static_cast<size_t>(f.n));
    job->probe = ConnectionProbe(req.remote_addr, req.remote_port, req.local_port);

    engine::SubmitResult sr = eng.submit(make_requests(job->id, prompt, f, max_tokens));
    switch (sr.status) {
      case engine::SubmitStatus::ok: break;
      case engine::SubmitStatus::queue_full: throw ApiError(503, sr.message, "", "queue_full");
      case engine::SubmitStatus::draining: throw ApiError(503, sr.message, "", "shutting_down");
      case engine::SubmitStatus::invalid: throw ApiError(400, sr.message, prompt_param, "invalid_request");
    }
    job->channel = sr.channel;

    if (f.stream) {
      res.status = 200;
      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      res.set_chunked_content_provider(
          "text/event-stream",
          [job](size_t, httplib::DataSink& sink) -> bool {
            std::string out;
            if (!job->started) {
              job->started = true;
              out = job->stream_prologue();
            }
            std::vector<engine::TokenEvent> events;
            job->channel->wait(events, kWaitSlice);
            if (!events.empty()) {
              auto deltas = job->absorb(events);
              out += job->stream_events(deltas);
            }
            // Tokens that show no text (held back, special) write nothing: look at the socket too.
            if (!job->done && job->probe_due() && job->probe.peer_gone()) {
              job->client_gone = true;
              job->channel->cancel();
              return false;
            }
            if (!out.empty() && !sink.write(out.data(), out.size())) {
              job->client_gone = true;
              job->channel->cancel();
              return false;
            }
            if (job->done) sink.done();
            return true;
          },
          [job](bool success) {
            if (!success || !job->done) {
              job->client_gone = true;
              job->channel->cancel();
              if (job->status == 200) job->status = 499;  // client closed the request
            }
            job->log_line();
          });
      return;
    }

    // Non-streamed: wait here, watching for the client to leave.
    while (!job->all_finished()) {
      std::vector<engine::TokenEvent> events;
      job->channel->wait(events, kWaitSlice);
      if (!events.empty()) job->accumulate_text(job->absorb(events));
      if (!job->all_finished() && job->probe_due() && job->probe.peer_gone()) {
        job->client_gone = true;
        job->channel->cancel();
        job->status = 499;
        job->log_line();
        res.status = 499;
        return;
      }
    }
    for (const auto& c : job->choices)
      if (c.engine_reason() == engine::FinishReason::error) {
        job->status = 500;
        job->log_line();
        throw ApiError(500, "generation failed: " + c.error());
      }
    send_json(res, 200, job->final_response());
    job->log_line();
  }

  std::shared_ptr<GenerationJob> new_job(bool chat, const char* endpoint, const GenerationFields& f) {
    auto job = std::make_shared<GenerationJob>();
    active_jobs.fetch_add(1);
    job->active = &active_jobs;
    job->chat = chat;
    job->id = (chat ? "chatcmpl-" : "cmpl-") + random_hex(24);
    job->endpoint = endpoint;
    job->created = unix_now();
    job->model_name = opts.served_model_name;
    job->fields = f;
    return job;
  }

  void handle_chat(const httplib::Request& req, httplib::Response& res) {
    require_generation();
    ChatRequest cr = parse_chat_request(req.body, limits);
    check_model_name(cr.model);
    auto answer_grammar = chat_grammar(cr, tools_on);
    if (!model.chat_template)
      throw ApiError(400,
                     "this model has no chat template; use /v1/completions, or start kiln serve with --chat-template",
                     "messages");
    std::string prompt_text;
    try {
      prompt_text = model.chat_template->render(cr.template_input);
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      throw ApiError(400, std::string("the chat template rejected the request: ") + e.what(), "messages");
    }
    std::vector<int32_t> prompt = model.tokenizer->encode(prompt_text, /*parse_special=*/true);

    ChoiceOptions co;
    co.stop = cr.stop;
    co.skip_special_tokens = cr.skip_special_tokens;
    co.parse_reasoning = reasoning_on && cr.separate_reasoning;
    co.start_in_reasoning = tmpl::ChatTemplate::prompt_ends_inside_think(prompt_text);
    co.parse_tool_calls = tools_on && !cr.tools.is_null() && !cr.tool_choice_none;
    if (co.parse_tool_calls) co.tools = json::parse(cr.tools.dump());
    co.want_logprobs = cr.logprobs;
    cr.constraint = make_constraint(std::move(answer_grammar), co.start_in_reasoning);
    auto job = new_job(true, "/v1/chat/completions", cr);
    run_generation(req, res, job, prompt, co, "messages");
  }

  void handle_completion(const httplib::Request& req, httplib::Response& res) {
    require_generation();
    CompletionRequest cr = parse_completion_request(req.body, limits);
    check_model_name(cr.model);
    if (cr.echo && cr.logprobs) throw bad_param("echo", "'echo' together with 'logprobs' is not supported");
    cr.constraint = make_constraint(completion_grammar(cr), false);
    std::vector<int32_t> prompt;
    std::string echo_text;
    if (auto* text = std::get_if<std::string>(&cr.prompt)) {
      prompt = model.tokenizer->encode(*text, /*parse_special=*/true);
      echo_text = *text;
    } else {
      prompt = std::get<std::vector<int32_t>>(cr.prompt);
      if (cr.echo) echo_text = model.tokenizer->decode(prompt, false);
    }
    ChoiceOptions co;
    co.stop = cr.stop;
    co.skip_special_tokens = cr.skip_special_tokens;
    co.want_logprobs = cr.logprobs;
    auto job = new_job(false, "/v1/completions", cr);
    if (cr.echo) job->echo_text = echo_text;
    run_generation(req, res, job, prompt, co, "prompt");
  }

  // --- operational endpoints ---

  void handle_health(const httplib::Request&, httplib::Response& res) {
    res.status = ready.load() && !draining.load() ? 200 : 503;
    res.set_content("", "text/plain");
  }

  void handle_health_generate(const httplib::Request&, httplib::Response& res) {
    require_generation();
    engine::GenerateRequest r;
    r.id = "health-" + random_hex(8);
    r.prompt = model.tokenizer->encode("ping", false);
    if (r.prompt.empty()) r.prompt = {0};
    r.max_tokens = 1;
    r.ignore_eos = true;
    r.sampling.temperature = 0.0f;
    engine::SubmitResult sr = model.engine->submit({r});
    if (sr.status != engine::SubmitStatus::ok) throw ApiError(503, "health generation not accepted: " + sr.message);
    auto deadline = Clock::now() + std::chrono::seconds(60);
    std::vector<engine::TokenEvent> events;
    bool ok = false;
    while (Clock::now() < deadline) {
      sr.channel->wait(events, kWaitSlice);
      for (const auto& ev : events)
        if (ev.finished) {
          if (ev.finish_reason == engine::FinishReason::error)
            throw ApiError(503, "health generation failed: " + ev.error);
          ok = true;
        }
      if (ok) break;
    }
    if (!ok) {
      sr.channel->cancel();
      throw ApiError(503, "health generation did not finish within 60 s");
    }
    res.status = 200;
    res.set_content("", "text/plain");
  }

  json model_card() const {
    return {{"id", opts.served_model_name},
            {"object", "model"},
            {"created", created_at},
            {"owned_by", "kiln"},
            {"root", opts.model_path},
            {"max_model_len", model.engine ? model.engine->context_length() : 0}};
  }

  void handle_models(const httplib::Request&, httplib::Response& res) {
    require_model();
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model_card()})}});
  }

  void handle_model(const httplib::Request& req, httplib::Response& res) {
    require_model();
    std::string name = req.matches[1];
    check_model_name(name);
    send_json(res, 200, model_card());
  }

  void handle_model_info(const httplib::Request&, httplib::Response& res) {
    require_model();
    send_json(res, 200,
              {{"model_path", opts.model_path},
               {"tokenizer_path", opts.tokenizer_path},
               {"is_generation", true},
               {"preferred_sampling_params", nullptr},
               {"weight_version", opts.weight_version},
               {"has_image_understanding", false},
               {"has_audio_understanding", false},
               {"model_type", opts.model_type},
               {"architectures", opts.architectures},
               {"served_model_name", opts.served_model_name},
               {"context_length", model.engine->context_length()},
               {"vocab_size", model.engine->vocab_size()},
               {"eos_token_ids", opts.eos_token_ids}});
  }

  void handle_server_info(const httplib::Request&, httplib::Response& res) {
    json info = opts.server_args.is_object() ? opts.server_args : json::object();
    info["version"] = "0.1.0";
    info["status"] = !ready.load() ? "loading" : draining.load() ? "draining" : "ready";
    info["served_model_name"] = opts.served_model_name;
    info["reasoning_parser"] = reasoning_on ? "qwen3" : "none";
    info["tool_call_parser"] = tools_on ? "qwen3_coder" : "none";
    if (ready.load()) {
      engine::Engine& eng = *model.engine;
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
      info["backend"] = eng.describe();
      info["internal_states"] = json::array({{{"num_running_reqs", m.num_running},
                                              {"num_queue_reqs", m.num_waiting},
                                              {"kv_pages_used", m.kv_pages_used},
                                              {"token_usage", m.kv_pages_total ? double(m.kv_pages_used) / m.kv_pages_total : 0.0}}});
    }
    send_json(res, 200, info);
  }

  void handle_metrics(const httplib::Request&, httplib::Response& res) {
    engine::EngineMetricsSnapshot m;
    if (ready.load()) m = model.engine->metrics();
    HttpCounts counts;
    {
      std::lock_guard<std::mutex> lock(stats_mu);
      counts = http_counts;
    }
    res.status = 200;
    res.set_content(render_metrics(m, counts, opts.served_model_name), "text/plain; version=0.0.4");
  }

  void handle_tokenize(const httplib::Request& req, httplib::Response& res) {
    require_model();
    ojson body = parse_json_object(req.body);
    const char* key = body.contains("prompt") ? "prompt" : "text";
    if (!body.contains(key)) throw bad_param("prompt", "'prompt' (or 'text') is required");
    const ojson& p = body[key];
    auto encode = [&](const ojson& s) {
      if (!s.is_string()) throw bad_param(key, std::string("'") + key + "' must be a string or a list of strings");
      return model.tokenizer->encode(s.get<std::string>(), true);
    };
    json out = {{"max_model_len", model.engine->context_length()}};
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
    require_model();
    ojson body = parse_json_object(req.body);
    if (!body.contains("tokens")) throw bad_param("tokens", "'tokens' is required");
    bool skip_special = true;
    if (body.contains("skip_special_tokens")) {
      if (!body["skip_special_tokens"].is_boolean())
        throw bad_param("skip_special_tokens", "'skip_special_tokens' must be a boolean");
      skip_special = body["skip_special_tokens"].get<bool>();
    }
    const int64_t vocab = model.tokenizer->vocab_size();
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
      for (const auto& row : t) texts.push_back(model.tokenizer->decode(ids_of(row), skip_special));
      out["text"] = texts;
    } else {
      out["text"] = model.tokenizer->decode(ids_of(t), skip_special);
    }
    send_json(res, 200, out);
  }

  // --- wiring ---

  void setup() {
    // A fixed pool: each connection (an SSE stream included) holds one thread while it is open.
    svr.new_task_queue = [this] {
      int n = opts.http_threads > 0 ? opts.http_threads : 64;
      return new httplib::ThreadPool(static_cast<size_t>(n));
    };
    svr.set_payload_max_length(opts.max_request_bytes);
    svr.set_read_timeout(opts.read_timeout_s, 0);
    svr.set_write_timeout(opts.write_timeout_s, 0);
    svr.set_keep_alive_timeout(opts.keep_alive_timeout_s);
    svr.set_keep_alive_max_count(1000);
    svr.set_tcp_nodelay(true);
    // httplib's default also sets SO_REUSEPORT, which lets a second server bind the same port and
    // silently share its traffic. Keep only SO_REUSEADDR (quick restarts).
    svr.set_socket_options([](socket_t sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    });

    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (opts.api_key.empty()) return httplib::Server::HandlerResponse::Unhandled;
      if (req.path == "/health" || req.path == "/health_generate" || req.path == "/metrics")
        return httplib::Server::HandlerResponse::Unhandled;
      std::string auth = req.get_header_value("Authorization");
      const std::string prefix = "Bearer ";
      if (auth.size() > prefix.size() && auth.compare(0, prefix.size(), prefix) == 0 &&
          constant_time_equal(auth.substr(prefix.size()), opts.api_key))
        return httplib::Server::HandlerResponse::Unhandled;
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_content(error_body(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                 "authentication_error", "", "invalid_api_key"),
                      "application/json");
      return httplib::Server::HandlerResponse::Handled;
    });

    svr.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;  // a handler already wrote its answer
      std::string msg;
      if (res.status == 404)
        msg = "no route for " + req.method + " " + req.path;
      else if (res.status == 413)
        msg = "the request body is larger than the limit of " + std::to_string(opts.max_request_bytes) + " bytes";
      else
        msg = std::string(status_reason(res.status));
      res.set_content(error_body(res.status, msg), "application/json");
    });

    svr.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown error";
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      KILN_LOG_ERROR("{} {}: unhandled: {}", req.method, req.path, what);
      res.status = 500;
      res.set_content(error_body(500, "internal error: " + what), "application/json");
    });

    svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      static const char* known[] = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                                    "/health_generate", "/get_model_info", "/model_info", "/get_server_info",
                                    "/server_info", "/metrics", "/tokenize", "/v1/tokenize", "/detokenize",
                                    "/v1/detokenize"};
      std::string endpoint = "other";
      for (const char* k : known)
        if (req.path == k) endpoint = k;
      if (req.path.rfind("/v1/models/", 0) == 0) endpoint = "/v1/models/{id}";
      std::lock_guard<std::mutex> lock(stats_mu);
      ++http_counts.requests[{endpoint, res.status}];
    });

    auto bind_get = [this](const char* path, void (Impl::*fn)(const httplib::Request&, httplib::Response&)) {
      svr.Get(path, wrap([this, fn](const httplib::Request& q, httplib::Response& r) { (this->*fn)(q, r); }));
    };
    auto bind_post = [this](const char* path, void (Impl::*fn)(const httplib::Request&, httplib::Response&)) {
      svr.Post(path, wrap([this, fn](const httplib::Request& q, httplib::Response& r) { (this->*fn)(q, r); }));
    };
    bind_get("/health", &Impl::handle_health);
    bind_get("/health_generate", &Impl::handle_health_generate);
    bind_get("/v1/models", &Impl::handle_models);
    bind_get(R"(/v1/models/(.+))", &Impl::handle_model);
    bind_get("/get_model_info", &Impl::handle_model_info);
    bind_get("/model_info", &Impl::handle_model_info);
    bind_get("/get_server_info", &Impl::handle_server_info);
    bind_get("/server_info", &Impl::handle_server_info);
    bind_get("/metrics", &Impl::handle_metrics);
    bind_post("/v1/chat/completions", &Impl::handle_chat);
    bind_post("/v1/completions", &Impl::handle_completion);
    bind_post("/tokenize", &Impl::handle_tokenize);
    bind_post("/v1/tokenize", &Impl::handle_tokenize);
    bind_post("/detokenize", &Impl::handle_detokenize);
    bind_post("/v1/detokenize", &Impl::handle_detokenize);
  }
};

HttpServer::HttpServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  if (impl_->opts.reasoning_parser != "auto" && impl_->opts.reasoning_parser != "qwen3" &&
      impl_->opts.reasoning_parser != "none")
    fail("unknown --reasoning-parser '{}' (use auto, qwen3 or none)", impl_->opts.reasoning_parser);
  if (impl_->opts.tool_call_parser != "auto" && impl_->opts.tool_call_parser != "qwen3_coder" &&
      impl_->opts.tool_call_parser != "none")
    fail("unknown --tool-call-parser '{}' (use auto, qwen3_coder or none)", impl_->opts.tool_call_parser);
  impl_->setup();
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::bind() {
  const auto& o = impl_->opts;
  if (o.port == 0) {
    impl_->bound_port = impl_->svr.bind_to_any_port(o.host);
    if (impl_->bound_port <= 0) fail("cannot listen on {} (any port)", o.host);
  } else {
    if (!impl_->svr.bind_to_port(o.host, o.port))
      fail("cannot listen on {}:{} (in use, or not an address of this machine); pick another with --port / --host",
           o.host, o.port);
    impl_->bound_port = o.port;
  }
  impl_->svr.raise_backlog(4096);  // the kernel caps it at net.core.somaxconn
}

int HttpServer::port() const { return impl_->bound_port; }

void HttpServer::run() { impl_->svr.listen_after_bind(); }

void HttpServer::stop() { impl_->svr.stop(); }

void HttpServer::attach(const ModelContext& model) {
  Impl& s = *impl_;
  KILN_CHECK(model.engine && model.tokenizer, "attach needs an engine and a tokenizer");
  s.model = model;
  s.limits.vocab_size = model.engine->vocab_size();
  s.limits.default_sampling = s.opts.default_sampling;
  const tmpl::ChatTemplate* t = model.chat_template;
  if (s.opts.reasoning_parser == "qwen3")
    s.reasoning_on = true;
  else if (s.opts.reasoning_parser == "auto")
    s.reasoning_on = t && t->injects_think();
  if (s.opts.tool_call_parser == "qwen3_coder")
    s.tools_on = true;
  else if (s.opts.tool_call_parser == "auto")
    s.tools_on = t && t->source().find("<function=") != std::string::npos &&
                 t->source().find("<parameter=") != std::string::npos;
  s.ready.store(true);
}

void HttpServer::set_draining() { impl_->draining.store(true); }
int HttpServer::active_requests() const { return impl_->active_jobs.load(); }
bool HttpServer::reasoning_parser_on() const { return impl_->reasoning_on; }
bool HttpServer::tool_call_parser_on() const { return impl_->tools_on; }

}  // namespace kiln::server
