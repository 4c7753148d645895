#include "server/server_state.h"

#include <cctype>
#include <string_view>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "server/response.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

ServerState::ServerState(ServerOptions o)
    : opts(std::move(o)), created_at(unix_now()), responses(opts.responses_store) {}

std::shared_ptr<const grammar::Constraint> ServerState::make_constraint(std::shared_ptr<const grammar::Grammar> g,
                                                                        bool starts_in_reasoning) {
  if (!g) return nullptr;
  // The vocabulary's byte strings, built (and the JSON string masks warmed) on the first constrained request.
  std::call_once(token_table_once_, [&] {
    token_table_ = token_table(*model.tokenizer, model.engine->vocab_size());
    warm_token_table(token_table_);
  });
  auto c = std::make_shared<grammar::Constraint>();
  c->grammar = std::move(g);
  c->tokens = token_table_;
  c->compiled = grammar_cache_.get(c->grammar, token_table_);  // shared by the choices and by later requests
  // Thinking stays free: the grammar starts after "</think>".
  if (starts_in_reasoning) c->start_after_token = model.tokenizer->token_to_id("</think>");
  return c;
}

void ServerState::require_model() const {
  if (!ready.load()) throw ApiError(503, "the model is still loading; retry shortly", "", "model_loading");
}

void ServerState::require_generation() const {
  require_model();
  if (draining.load()) throw ApiError(503, "the server is shutting down", "", "shutting_down");
}

void ServerState::check_model_name(const std::optional<std::string>& name) const {
  if (!name || name->empty()) return;
  if (*name == opts.served_model_name || *name == opts.model_path) return;
  throw ApiError(404, "The model '" + *name + "' does not exist; this server serves '" + opts.served_model_name + "'",
                 "model", "model_not_found");
}

void send_json(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e, ErrorStyle style, int retry_after_s) {
  res.status = e.status;
  if (e.status == 503) res.set_header("Retry-After", std::to_string(retry_after_s));
  res.set_content(error_body(e, style), "application/json");
}

std::string client_request_id(const httplib::Request& req) {
  constexpr size_t kMaxLength = 128;
  std::string id;
  for (char c : req.get_header_value("X-Request-Id")) {
    if (id.size() == kMaxLength) break;
    if (std::isalnum(static_cast<unsigned char>(c)) || std::string_view("._:/+=-").find(c) != std::string_view::npos)
      id += c;
  }
  return id;
}

ErrorStyle error_style_of(const std::string& path) {
  return path.rfind("/v1/messages", 0) == 0 ? ErrorStyle::anthropic : ErrorStyle::openai;
}

httplib::Server::Handler Routes::wrap(Fn fn, ErrorStyle style) const {
  return [this, fn = std::move(fn), style](const httplib::Request& req, httplib::Response& res) {
    const int retry = state_.opts.retry_after_s;
    try {
      fn(req, res);
      // Answers of status >= 400 get the client's X-Request-Id in the error handler (http_server.cpp).
      if (res.status < 400 && !res.has_header("X-Request-Id"))
        if (const std::string id = client_request_id(req); !id.empty()) res.set_header("X-Request-Id", id);
    } catch (const ApiError& e) {
      send_error(res, e, style, retry);
    } catch (const InternalError& e) {
      KILN_LOG_ERROR("{} {}: internal error: {}", req.method, req.path, e.what());
      send_error(res, ApiError(500, std::string("internal error: ") + e.what()), style, retry);
    } catch (const Error& e) {
      send_error(res, ApiError(400, e.what()), style, retry);
    } catch (const std::exception& e) {
      KILN_LOG_ERROR("{} {}: {}", req.method, req.path, e.what());
      send_error(res, ApiError(500, std::string("internal error: ") + e.what()), style, retry);
    }
  };
}

void Routes::get(const char* path, Fn fn, ErrorStyle style) {
  routes_.emplace_back(std::regex(path), "GET");
  svr_.Get(path, wrap(std::move(fn), style));
}

void Routes::post(const char* path, Fn fn, ErrorStyle style) {
  routes_.emplace_back(std::regex(path), "POST");
  svr_.Post(path, wrap(std::move(fn), style));
}

std::string Routes::other_methods(const std::string& path, const std::string& method) const {
  std::string allowed;
  for (const auto& [pattern, m] : routes_)
    if (m != method && std::regex_match(path, pattern) && allowed.find(m) == std::string::npos)
      allowed += (allowed.empty() ? "" : ", ") + m;
  return allowed;
}

}  // namespace kiln::server
