// The server core: options checked, the listener bound, the request pipeline around the routes (API-key check,
// error answers for unrouted requests, the rejected-request log line and the HTTP counters) and the routes of
// each concern (admin_routes.cpp, generation_routes.cpp, anthropic_api.cpp, responses_api.cpp) registered.
#include "server/http_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <optional>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "server/listening_server.h"
#include "server/response.h"
#include "server/server_state.h"
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

// The credentials of "Authorization: Bearer <token>": the scheme in any case, then one or more spaces (RFC 9110).
std::optional<std::string> bearer_token(const std::string& auth) {
  static constexpr std::string_view kScheme = "bearer";
  if (auth.size() <= kScheme.size() || auth[kScheme.size()] != ' ') return std::nullopt;
  for (size_t i = 0; i < kScheme.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(auth[i])) != kScheme[i]) return std::nullopt;
  const size_t start = auth.find_first_not_of(' ', kScheme.size());
  if (start == std::string::npos) return std::nullopt;
  return auth.substr(start);
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

// The endpoint label of a path in the HTTP counters (unknown paths count as "other").
std::string endpoint_label(const std::string& path) {
  static const char* known[] = {"/v1/chat/completions", "/v1/completions", "/v1/messages",
                                "/v1/messages/count_tokens", "/v1/responses", "/v1/models", "/health",
                                "/health_generate", "/get_model_info", "/model_info", "/get_server_info",
                                "/server_info", "/metrics", "/tokenize", "/v1/tokenize", "/detokenize",
                                "/v1/detokenize", "/version", "/flush_cache"};
  for (const char* k : known)
    if (path == k) return k;
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

// The message of an error body in either style ("" when there is none).
std::string error_message_of(const std::string& body) {
  auto j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() && j["error"].contains("message") &&
      j["error"]["message"].is_string())
    return j["error"]["message"].get<std::string>();
  return "";
}

}  // namespace

struct HttpServer::Impl {
  ServerState state;
  ListeningServer svr;
  Routes routes{svr, state};
  int bound_port = -1;

  explicit Impl(ServerOptions o) : state(std::move(o)) {}

  // The client's key: "Authorization: Bearer <key>" (OpenAI; the scheme in any case, RFC 9110) or
  // "x-api-key: <key>" (Anthropic).
  bool authorized(const httplib::Request& req) const {
    const std::string& key = state.opts.api_key;
    if (auto token = bearer_token(req.get_header_value("Authorization")); token && constant_time_equal(*token, key))
      return true;
    return req.has_header("x-api-key") && constant_time_equal(req.get_header_value("x-api-key"), key);
  }

  // CORS: the Access-Control-Allow-Origin value for this request's Origin ("" when it is not allowed).
  std::string allowed_origin(const httplib::Request& req) const {
    const auto& allowed = state.opts.allowed_origins;
    if (allowed.empty() || !req.has_header("Origin")) return "";
    const std::string origin = req.get_header_value("Origin");
    for (const auto& o : allowed) {
      if (o == "*") return "*";
      if (o == origin) return origin;
    }
    return "";
  }

  // Before routing: CORS headers for an allowed Origin (a preflight is answered here, 204, before the API key:
  // browsers send no credentials on a preflight), then the API key.
  httplib::Server::HandlerResponse pre_route(const httplib::Request& req, httplib::Response& res) const {
    if (const std::string origin = allowed_origin(req); !origin.empty()) {
      res.set_header("Access-Control-Allow-Origin", origin);
      if (origin != "*") res.set_header("Vary", "Origin");
      res.set_header("Access-Control-Expose-Headers", "X-Request-Id, Retry-After");
      if (req.method == "OPTIONS" && req.has_header("Access-Control-Request-Method")) {
        res.status = 204;
        res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        std::string asked = req.get_header_value("Access-Control-Request-Headers");
        asked.erase(std::remove_if(asked.begin(), asked.end(),
                                   [](char c) { return !(std::isalnum(static_cast<unsigned char>(c)) || c == '-' ||
                                                         c == '_' || c == ',' || c == ' '); }),
                    asked.end());
        res.set_header("Access-Control-Allow-Headers",
                       asked.empty() ? "Authorization, Content-Type, X-Api-Key, X-Request-Id" : asked.substr(0, 1024));
        res.set_header("Access-Control-Max-Age", "600");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    return check_api_key(req, res);
  }

  httplib::Server::HandlerResponse check_api_key(const httplib::Request& req, httplib::Response& res) const {
    if (state.opts.api_key.empty()) return httplib::Server::HandlerResponse::Unhandled;
    if (req.path == "/health" || req.path == "/health_generate" || req.path == "/metrics")
      return httplib::Server::HandlerResponse::Unhandled;
    if (authorized(req)) return httplib::Server::HandlerResponse::Unhandled;
    res.status = 401;
    res.set_header("WWW-Authenticate", "Bearer");
    ApiError e(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", "", "invalid_api_key",
               "authentication_error");
    res.set_content(error_body(e, error_style_of(req.path)), "application/json");
    return httplib::Server::HandlerResponse::Handled;
  }

  // Every answer of status >= 400 passes here before httplib writes (and perhaps compresses) it: the body of those
  // no handler wrote, then the rejected-request log line (generations log their own line: their answer carries
  // X-Request-Id already) and the client's X-Request-Id echoed.
  void answer_error(const httplib::Request& req, httplib::Response& res) const {
    if (res.body.empty()) answer_unrouted(req, res);
    if (res.has_header("X-Request-Id")) return;
    const std::string request_id = client_request_id(req);
    KILN_LOG_INFO("request rejected method={} path={} remote={}:{} status={} error={}{}", req.method, req.path,
                  req.remote_addr, req.remote_port, res.status, dump_json(error_message_of(res.body)),
                  request_id.empty() ? "" : " request_id=" + request_id);
    if (!request_id.empty()) res.set_header("X-Request-Id", request_id);
  }

  // Answers that no handler wrote: unknown paths (404, or 405 when another method takes the path), 413 ...
  void answer_unrouted(const httplib::Request& req, httplib::Response& res) const {
    std::string msg;
    if (res.status == 404) {
      const std::string allowed = routes.other_methods(req.path, req.method);
      if (!allowed.empty()) {
        res.status = 405;
        res.set_header("Allow", allowed);
        msg = "method " + req.method + " is not allowed on " + req.path + " (use " + allowed + ")";
      } else {
        msg = "no route for " + req.method + " " + req.path;
      }
    } else if (res.status == 413) {
      msg = "the request body is larger than the limit of " + std::to_string(state.opts.max_request_bytes) + " bytes";
    } else {
      msg = std::string(status_reason(res.status));
    }
    res.set_content(error_body(ApiError(res.status, msg), error_style_of(req.path)), "application/json");
  }

  // Counts every answer (the rejected ones were logged by answer_error: here the body may be compressed already).
  void log_answer(const httplib::Request& req, const httplib::Response& res) {
    std::lock_guard<std::mutex> lock(state.stats_mu);
    ++state.http_counts.requests[{endpoint_label(req.path), res.status}];
  }

  void configure_listener() {
    const ServerOptions& o = state.opts;
    svr.configure(o);
    svr.set_payload_max_length(o.max_request_bytes);
    svr.set_read_timeout(o.read_timeout_s, 0);
    svr.set_write_timeout(o.write_timeout_s, 0);
    svr.set_keep_alive_timeout(o.keep_alive_timeout_s);
    svr.set_keep_alive_max_count(1000);
    svr.set_tcp_nodelay(true);
    // httplib's default also sets SO_REUSEPORT, which lets a second server bind the same port and
    // silently share its traffic. Keep only SO_REUSEADDR (quick restarts).
    svr.set_socket_options([](socket_t sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    });
  }

  void setup() {
    configure_listener();
    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) { return pre_route(req, res); });
    svr.set_error_handler([this](const httplib::Request& req, httplib::Response& res) { answer_error(req, res); });
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
      res.set_content(error_body(ApiError(500, "internal error: " + what), error_style_of(req.path)),
                      "application/json");
    });
    svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) { log_answer(req, res); });
    add_admin_routes(routes, state);
    add_generation_routes(routes, state);
    add_anthropic_routes(routes, state);
    add_responses_routes(routes, state);
  }
};

HttpServer::HttpServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  const ServerOptions& o = impl_->state.opts;
  if (o.reasoning_parser != "auto" && o.reasoning_parser != "qwen3" && o.reasoning_parser != "none")
    fail("unknown --reasoning-parser '{}' (use auto, qwen3 or none)", o.reasoning_parser);
  if (o.tool_call_parser != "auto" && o.tool_call_parser != "qwen3_coder" && o.tool_call_parser != "none")
    fail("unknown --tool-call-parser '{}' (use auto, qwen3_coder or none)", o.tool_call_parser);
  impl_->setup();
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::bind() {
  const auto& o = impl_->state.opts;
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

void HttpServer::stop() {
  impl_->svr.stop();
  impl_->svr.stop_gate();
}

void HttpServer::attach(const ModelContext& model) {
  ServerState& s = impl_->state;
  KILN_CHECK(model.engine && model.tokenizer, "attach needs an engine and a tokenizer");
  s.model = model;
  // Requests name ids of the tokenizer's vocabulary; the embedding's rows past it are padding (empty tokens).
  s.limits.vocab_size = std::min(model.engine->vocab_size(), model.tokenizer->vocab_size());
  s.limits.default_sampling = s.opts.default_sampling;
  s.limits.max_images = model.image_processor && model.image_token_id >= 0 ? model.max_images : 0;
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

void HttpServer::set_draining() { impl_->state.draining.store(true); }
int HttpServer::active_requests() const { return impl_->state.active_jobs.load(); }
bool HttpServer::reasoning_parser_on() const { return impl_->state.reasoning_on; }
bool HttpServer::tool_call_parser_on() const { return impl_->state.tools_on; }

}  // namespace kiln::server
