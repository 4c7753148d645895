// A small HTTP client for OpenAI-compatible servers (kiln, SGLang, vLLM, llama-server), on top of
// cpp-httplib: plain and streamed JSON POSTs, bearer-token auth, one-line failure descriptions.
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace httplib {
class Client;
}

namespace kiln::clients {

// Where the server is and how to talk to it.
struct ServerAddress {
  std::string base_url;     // scheme://host:port, no trailing slash
  std::string path_prefix;  // "" or "/prefix" (a reverse proxy's mount point); never ends in "/v1"
  std::string api_key;      // sent as "Authorization: Bearer <key>" when not empty
  double timeout_s = 300;   // longest wait for the next byte of a response

  std::string display() const { return base_url + path_prefix; }
};

// Parses --url: http(s)://host[:port][/prefix]. A trailing "/" or "/v1" is dropped, so both
// "http://h:8000" and "http://h:8000/v1" (as OpenAI clients write it) work. Throws kiln::Error.
ServerAddress parse_server_url(std::string_view url, std::string api_key, double timeout_s);

struct HttpResponse {
  int status = 0;               // HTTP status; 0 when no response came (transport_error says why)
  std::string body;             // the body (for streamed requests: only when the status is not 2xx)
  std::string transport_error;  // "connection refused", "timed out after 30 s waiting ...", ...

  bool ok() const { return transport_error.empty() && status >= 200 && status < 300; }
  // One line for a failed request: "HTTP 400: <error.message from the body>" or the transport error.
  std::string describe_failure() const;
};

// A client for one server. Not thread-safe: use one per thread.
class HttpClient {
 public:
  explicit HttpClient(ServerAddress address);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  HttpResponse get(const std::string& path);
  HttpResponse post_json(const std::string& path, const nlohmann::json& body);
  // POSTs and hands the body to on_bytes piece by piece as it arrives (2xx only; otherwise the body
  // is collected into the response). on_bytes returns false to stop reading.
  HttpResponse post_json_streamed(const std::string& path, const nlohmann::json& body,
                                  const std::function<bool(std::string_view)>& on_bytes);

  const ServerAddress& address() const { return address_; }

 private:
  HttpResponse send(const std::string& method, const std::string& path, const nlohmann::json* body,
                    const std::function<bool(std::string_view)>* on_bytes);

  ServerAddress address_;
  std::unique_ptr<httplib::Client> client_;
};

// Throws kiln::Error (one line: the URL, what happened, what to do) unless the server answers HTTP
// at all. An HTTP 401/403 is reported as an API key problem.
void require_reachable(HttpClient& client);

}  // namespace kiln::clients
