// The HTTP front end: OpenAI-compatible API (chat and text completions, Responses; streamed over SSE or not),
// the Anthropic Messages API,
// SGLang-style operational endpoints (/health, /health_generate, /get_model_info, /get_server_info,
// /metrics, /tokenize, /detokenize, /version, /flush_cache), API-key check, CORS, request ids, request logging.
//
// The server can listen before the model is loaded: until attach() every endpoint but /health
// answers 503 (and /health does too). set_draining() turns health and new generations to 503 while
// in-flight requests finish.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/request.h"
#include "media/image_processor.h"
#include "media/media_options.h"
#include "server/response_store.h"

namespace kiln::engine {
class Engine;
}
namespace kiln::tok {
class Tokenizer;
}
namespace kiln::tmpl {
class ChatTemplate;
}

namespace kiln::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 30000;
  std::string served_model_name = "default";
  std::string api_key;                   // empty: no authentication
  // CORS (--allowed-origins): exact origins ("https://app.example.com") or "*". Empty: no CORS headers, and OPTIONS
  // is answered like any other method a path does not take (405 with Allow, or 404).
  std::vector<std::string> allowed_origins;
  std::string reasoning_parser = "auto";  // auto (on when the template opens <think>), qwen3, none
  std::string tool_call_parser = "auto";  // auto (on for Qwen3.5 / Qwen3-Coder templates), qwen3_coder, none
  size_t max_request_bytes = 32u << 20;
  int http_threads = 0;  // 0: enough for every running and queued request plus headroom
  int read_timeout_s = 30;  // socket receive timeout (requests are read by the gate, never by a blocking read)
  int write_timeout_s = 60;
  int keep_alive_timeout_s = 5;
  // The HTTP front's limits (request_gate.h): a request's headers and the whole request must arrive in time and,
  // after a grace, at a minimum rate (else 408); connections open at once (beyond: the one waiting longest for
  // its request is closed, or 503) and per client address (beyond: 429); held while waiting for a request.
  int header_timeout_ms = 10000;
  int request_timeout_s = 60;
  int min_upload_rate_bytes_s = 500;  // 0: no minimum
  int max_connections = 0;            // 0: as many as the open-file limit allows (at most 65536)
  int max_connections_per_client = 0;  // 0: no limit
  int max_waiting_connections = 0;     // 0: up to max_connections
  int retry_after_s = 1;  // Retry-After of 503 answers
  ResponseStoreOptions responses_store;  // /v1/responses store / previous_response_id (count, bytes, age)

  // Model facts for /get_model_info and /v1/models.
  std::string model_path;
  std::string tokenizer_path;
  std::string model_type;
  std::vector<std::string> architectures;
  std::string weight_version = "default";
  engine::SamplingParams default_sampling;  // applied to fields a request leaves out
  std::vector<int32_t> eos_token_ids;       // for /get_model_info
  nlohmann::json server_args;               // echoed by /get_server_info
};

// What the server needs once the model is loaded. The pointers must outlive the server.
struct ModelContext {
  engine::Engine* engine = nullptr;
  const tok::Tokenizer* tokenizer = nullptr;
  const tmpl::ChatTemplate* chat_template = nullptr;  // null: /v1/chat/completions answers 400
  // Image inputs: the model's image processor (null: the model reads no images, image parts answer 400), the
  // placeholder token the chat template writes for each image, where images may come from, and how many a request
  // may carry (--limit-mm-per-prompt).
  const media::ImageProcessor* image_processor = nullptr;
  int32_t image_token_id = -1;
  media::MediaOptions media;
  int max_images = 0;
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the port (kiln::Error when it cannot). port 0 picks a free one; port() tells which.
  void bind();
  int port() const;
  // Serves until stop(). Call bind() first.
  void run();
  void stop();

  void attach(const ModelContext& model);
  void set_draining();
  // Generation requests still being answered (streams included).
  int active_requests() const;
  bool reasoning_parser_on() const;
  bool tool_call_parser_on() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::server
