// What every route of the HTTP server shares (internal to src/server): the options, the model once attached,
// the ready / draining flags, the HTTP counters, the grammar cache; the answer helpers; and the route table
// that turns a handler's exceptions into an error answer in the route's API style (OpenAI or Anthropic).
#pragma once
#include <httplib.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "server/api_error.h"
#include "server/http_server.h"
#include "server/metrics_text.h"
#include "server/protocol.h"
#include "server/response_store.h"
#include "server/structured_output.h"

namespace kiln::server {

struct ServerState {
  explicit ServerState(ServerOptions o);

  ServerOptions opts;
  std::atomic<bool> ready{false};
  std::atomic<bool> draining{false};
  ModelContext model;
  bool reasoning_on = false;
  bool tools_on = false;
  ProtocolLimits limits;
  int64_t created_at = 0;
  std::mutex stats_mu;
  HttpCounts http_counts;
  std::atomic<int> active_jobs{0};
  ResponseStore responses;  // /v1/responses with store: previous_response_id looks here

  // The engine constraint for a grammar (null: free), compiled once per grammar and shared. With
  // starts_in_reasoning the grammar starts after "</think>" (thinking stays free).
  std::shared_ptr<const grammar::Constraint> make_constraint(std::shared_ptr<const grammar::Grammar> g,
                                                             bool starts_in_reasoning);

  void require_model() const;       // 503 while loading
  void require_generation() const;  // 503 while loading or draining
  // 404 when a request names a model this server does not serve (empty or absent: fine).
  void check_model_name(const std::optional<std::string>& name) const;

 private:
  std::once_flag token_table_once_;
  std::shared_ptr<const grammar::TokenTable> token_table_;
  grammar::GrammarCache grammar_cache_;
};

void send_json(httplib::Response& res, int status, const nlohmann::json& body);
// An error answer in the given style (503 answers carry Retry-After).
void send_error(httplib::Response& res, const ApiError& e, ErrorStyle style, int retry_after_s);

// Routes bound on the server: each handler runs inside the error wrapper (ApiError -> its status; kiln::Error ->
// 400; anything else -> 500, logged), and every (pattern, method) is remembered for 405 answers.
class Routes {
 public:
  using Fn = std::function<void(const httplib::Request&, httplib::Response&)>;
  Routes(httplib::Server& svr, const ServerState& state) : svr_(svr), state_(state) {}

  void get(const char* path, Fn fn, ErrorStyle style = ErrorStyle::openai);
  void post(const char* path, Fn fn, ErrorStyle style = ErrorStyle::openai);
  // The methods other than `method` that `path` takes ("GET, POST"), or "" when none.
  std::string other_methods(const std::string& path, const std::string& method) const;

 private:
  httplib::Server::Handler wrap(Fn fn, ErrorStyle style) const;

  httplib::Server& svr_;
  const ServerState& state_;
  std::vector<std::pair<std::regex, std::string>> routes_;
};

// The client's X-Request-Id, sanitised for logs and headers: only [A-Za-z0-9._:/+=-] kept, at most 128 characters
// ("" when absent or nothing is left).
std::string client_request_id(const httplib::Request& req);

// The error style of a path: Anthropic's for /v1/messages..., OpenAI's elsewhere.
ErrorStyle error_style_of(const std::string& path);

// The routes of each concern (admin_routes.cpp, generation_routes.cpp, anthropic_api.cpp, responses_api.cpp).
void add_admin_routes(Routes& routes, ServerState& state);
void add_generation_routes(Routes& routes, ServerState& state);
void add_anthropic_routes(Routes& routes, ServerState& state);
void add_responses_routes(Routes& routes, ServerState& state);

}  // namespace kiln::server
