#include "clients/http.h"

#include <httplib.h>

#include <cmath>

#include "core/error.h"

namespace kiln::clients {

ServerAddress parse_server_url(std::string_view url, std::string api_key, double timeout_s) {
  ServerAddress address;
  address.api_key = std::move(api_key);
  if (!(timeout_s > 0)) fail("--timeout must be a positive number of seconds (got {})", timeout_s);
  address.timeout_s = timeout_s;

  std::string_view rest = url;
  std::string scheme;
  if (rest.starts_with("http://")) {
    scheme = "http";
  } else if (rest.starts_with("https://")) {
    scheme = "https";
  } else {
    fail("--url '{}' must start with http:// or https:// (e.g. http://127.0.0.1:30000)", url);
  }
  rest.remove_prefix(scheme.size() + 3);
  size_t slash = rest.find('/');
  std::string_view host_port = rest.substr(0, slash);
  std::string_view path = slash == std::string_view::npos ? std::string_view{} : rest.substr(slash);
  if (host_port.empty()) fail("--url '{}' has no host (e.g. http://127.0.0.1:30000)", url);
  if (host_port.find_first_of("?#@ ") != std::string_view::npos)
    fail("--url '{}': give only scheme, host, port and an optional path prefix", url);

  while (path.ends_with("/")) path.remove_suffix(1);
  if (path.ends_with("/v1")) path.remove_suffix(3);
  while (path.ends_with("/")) path.remove_suffix(1);
  if (path.find_first_of("?#") != std::string_view::npos)
    fail("--url '{}': a query string or fragment is not allowed", url);

  address.base_url = scheme + "://" + std::string(host_port);
  address.path_prefix = std::string(path);
  return address;
}

namespace {

std::string one_line(std::string_view text, size_t max_chars) {
  std::string out;
  for (char c : text) {
    if (out.size() >= max_chars) {
      out += "...";
      break;
    }
    out += (c == '\n' || c == '\r' || c == '\t') ? ' ' : c;
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

std::string transport_error_text(httplib::Error error, const ServerAddress& address) {
  switch (error) {
    case httplib::Error::Connection:
      return "cannot connect (connection refused or host unreachable)";
    case httplib::Error::ConnectionTimeout:
      return "connection timed out";
    case httplib::Error::Read:
      return fmt::format("read failed (the server closed the connection, or sent nothing for {:g} s; "
                         "see --timeout)",
                         address.timeout_s);
    case httplib::Error::Write:
      return "sending the request failed (the server closed the connection)";
    case httplib::Error::SSLConnection:
    case httplib::Error::SSLServerVerification:
    case httplib::Error::SSLLoadingCerts:
      return "TLS connection failed (" + httplib::to_string(error) + ")";
    case httplib::Error::Canceled:
      return "canceled";
    default:
      return "HTTP client error: " + httplib::to_string(error);
  }
}

}  // namespace

std::string HttpResponse::describe_failure() const {
  if (!transport_error.empty()) return transport_error;
  std::string message;
  // OpenAI form {"error": {"message": ...}}; FastAPI {"detail": ...}; some servers {"message": ...}.
  auto parsed = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_object()) {
    const auto& error = parsed.contains("error") ? parsed["error"] : parsed;
    if (error.is_object() && error.contains("message") && error["message"].is_string())
      message = error["message"].get<std::string>();
    else if (error.is_string())
      message = error.get<std::string>();
    else if (parsed.contains("detail"))
      message = parsed["detail"].is_string() ? parsed["detail"].get<std::string>() : parsed["detail"].dump();
  }
  if (message.empty()) message = body;
  message = one_line(message, 300);
  return message.empty() ? fmt::format("HTTP {}", status) : fmt::format("HTTP {}: {}", status, message);
}

HttpClient::HttpClient(ServerAddress address) : address_(std::move(address)) {
  client_ = std::make_unique<httplib::Client>(address_.base_url);
  if (!client_->is_valid()) fail("cannot use --url '{}' (is it a valid http:// or https:// URL?)", address_.base_url);
  auto whole_s = static_cast<time_t>(address_.timeout_s);
  auto rest_us = static_cast<time_t>(std::llround((address_.timeout_s - static_cast<double>(whole_s)) * 1e6));
  client_->set_read_timeout(whole_s, rest_us);
  client_->set_write_timeout(whole_s, rest_us);
  client_->set_connection_timeout(10, 0);
  // Without TCP_NODELAY, Nagle + delayed ACKs can add ~40 ms to a small request: it would show up in TTFT.
  client_->set_tcp_nodelay(true);
  client_->set_keep_alive(false);
  if (!address_.api_key.empty()) client_->set_bearer_token_auth(address_.api_key);
}

HttpClient::~HttpClient() = default;

HttpResponse HttpClient::get(const std::string& path) { return send("GET", path, nullptr, nullptr); }

HttpResponse HttpClient::post_json(const std::string& path, const nlohmann::json& body) {
  return send("POST", path, &body, nullptr);
}

HttpResponse HttpClient::post_json_streamed(const std::string& path, const nlohmann::json& body,
                                            const std::function<bool(std::string_view)>& on_bytes) {
  return send("POST", path, &body, &on_bytes);
}

HttpResponse HttpClient::send(const std::string& method, const std::string& path, const nlohmann::json* body,
                              const std::function<bool(std::string_view)>* on_bytes) {
  httplib::Request request;
  request.method = method;
  request.path = address_.path_prefix + path;
  if (body) {
    // Invalid UTF-8 (from a user's prompt) is replaced rather than aborting the request.
    request.body = body->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    request.set_header("Content-Type", "application/json");
  }
  request.set_header("Accept", on_bytes ? "text/event-stream" : "application/json");

  HttpResponse out;
  request.response_handler = [&out](const httplib::Response& response) {
    out.status = response.status;
    return true;
  };
  request.content_receiver = [&out, on_bytes](const char* data, size_t size, uint64_t, uint64_t) {
    if (on_bytes && out.status >= 200 && out.status < 300) return (*on_bytes)(std::string_view(data, size));
    out.body.append(data, size);
    return true;
  };
  httplib::Response response;
  httplib::Error error = httplib::Error::Success;
  bool sent = client_->send(request, response, error);
  if (response.status > 0) out.status = response.status;
  // A receiver that asked to stop is not a transport failure.
  if (!sent && !(error == httplib::Error::Canceled && out.status > 0))
    out.transport_error = transport_error_text(error, address_);
  return out;
}

void require_reachable(HttpClient& client) {
  const ServerAddress& address = client.address();
  HttpResponse response = client.get("/v1/models");
  if (!response.transport_error.empty())
    fail("cannot reach the server at {}: {}. Start an OpenAI-compatible server there (e.g. `kiln serve`) "
         "or pass --url http://HOST:PORT",
         address.display(), response.transport_error);
  if (response.status == 401 || response.status == 403)
    fail("the server at {} refused the request ({}): pass the right --api-key", address.display(),
         response.describe_failure());
}

}  // namespace kiln::clients
