// An in-process kiln HTTP server for the server tests: a real engine over the dummy runner (echo mode: the "model"
// repeats the last chat turn, so a test decides what the model writes; else hash logits), the byte-level test
// tokenizer and the Qwen3.5 chat template from tests/fixtures; and small HTTP helpers (JSON requests, SSE
// events, Prometheus metrics, raw sockets). Header-only: each test binary that includes it gets one shared server.
#pragma once
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/dummy_runner.h"
#include "engine/engine.h"
#include "server/http_server.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server::test {

using json = nlohmann::json;
using namespace std::chrono_literals;

inline std::string read_file(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct ServerConfig {
  std::string api_key;
  int max_running = 8;
  int max_queued = 64;
  int step_delay_us = 0;
  size_t max_request_bytes = 1 << 20;
  int64_t context = 2048;
  bool echo = true;
  int header_timeout_ms = 10000;
  int max_waiting_connections = 1024;
  int64_t vocab = 512;  // embedding rows; past the tokenizer's 512 ids they are padding
  std::vector<std::string> allowed_origins;
};

// The byte tokenizer: ids 0-255 bytes, 508 <|im_start|>, 510 <|endoftext|>, 511 <|im_end|>.
class TestServer {
 public:
  explicit TestServer(ServerConfig cfg = {}) {
    std::string dir = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/reference/byte_tokenizer";
    tokenizer_ = tok::Tokenizer::load_dir(dir);
    chat_template_ = std::make_unique<tmpl::ChatTemplate>(
        read_file(std::string(KILN_SOURCE_DIR) + "/tests/fixtures/templates/Qwen3.5-4B.jinja"));
    engine::DummyRunner::Options d;
    d.vocab = cfg.vocab;
    d.capacity.kv_pages = 4096;
    d.capacity.page_size = 16;
    // As kiln serve sizes them: a running request's slot plus the prefix cache's snapshots.
    d.capacity.state_slots = cfg.max_running * engine::state_slots_per_request(true);
    d.capacity.max_context = cfg.context;
    d.step_delay_us = cfg.step_delay_us;
    d.echo = cfg.echo;
    d.turn_start = 508;
    d.turn_end = 511;
    d.newline = 10;
    engine::EngineOptions eo;
    eo.max_running_requests = cfg.max_running;
    eo.max_queued_requests = cfg.max_queued;
    eo.chunked_prefill_size = 64;
    eo.eos_token_ids = {510, 511};
    engine_ = std::make_unique<engine::Engine>(std::make_unique<engine::DummyRunner>(d), eo);
    engine_->start();
    ServerOptions so;
    so.port = 0;
    so.served_model_name = "test-model";
    so.model_path = "/models/test";
    so.tokenizer_path = "/models/test";
    so.model_type = "qwen3_5_moe";
    so.architectures = {"Qwen3_5MoeForConditionalGeneration"};
    so.api_key = cfg.api_key;
    so.allowed_origins = cfg.allowed_origins;
    so.max_request_bytes = cfg.max_request_bytes;
    so.http_threads = 96;
    so.read_timeout_s = 2;
    so.header_timeout_ms = cfg.header_timeout_ms;
    so.max_waiting_connections = cfg.max_waiting_connections;
    so.default_sampling.temperature = 0.0f;
    server_ = std::make_unique<HttpServer>(so);
    server_->bind();
    thread_ = std::thread([this] { server_->run(); });
    server_->attach({engine_.get(), tokenizer_.get(), chat_template_.get()});
  }
  ~TestServer() {
    server_->stop();
    thread_.join();
    engine_->stop();
  }
  int port() const { return server_->port(); }
  engine::Engine& engine() { return *engine_; }
  HttpServer& http() { return *server_; }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(30, 0);
    return c;
  }

 private:
  std::unique_ptr<tok::Tokenizer> tokenizer_;
  std::unique_ptr<tmpl::ChatTemplate> chat_template_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
};

inline TestServer& shared_server() {
  static TestServer* s = new TestServer();
  return *s;
}

inline json chat_body(const std::string& user_text, json extra = json::object()) {
  json body = {{"model", "test-model"}, {"messages", {{{"role", "user"}, {"content", user_text}}}}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

struct Reply {
  int status = 0;
  std::string body;
  json j;
  httplib::Headers headers;
};

inline Reply post(TestServer& s, const std::string& path, const std::string& body,
           const httplib::Headers& headers = {}) {
  auto c = s.client();
  auto r = c.Post(path.c_str(), headers, body, "application/json");
  Reply out;
  if (!r) {
    ADD_FAILURE() << "no response for " << path << ": " << httplib::to_string(r.error());
    return out;
  }
  out.status = r->status;
  out.body = r->body;
  out.headers = r->headers;
  out.j = json::parse(r->body, nullptr, false);
  return out;
}

inline Reply post(TestServer& s, const std::string& path, const json& body) { return post(s, path, body.dump()); }

inline Reply get(TestServer& s, const std::string& path, const httplib::Headers& headers = {}) {
  auto c = s.client();
  auto r = c.Get(path.c_str(), headers);
  Reply out;
  if (!r) {
    ADD_FAILURE() << "no response for " << path;
    return out;
  }
  out.status = r->status;
  out.body = r->body;
  out.headers = r->headers;
  out.j = json::parse(r->body, nullptr, false);
  return out;
}

// The JSON events of an SSE body; `done` tells whether it ended with [DONE].
inline std::vector<json> sse_events(const std::string& body, bool* done) {
  std::vector<json> out;
  *done = false;
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("data: ", 0) != 0) continue;
    std::string data = line.substr(6);
    if (data == "[DONE]") {
      *done = true;
      continue;
    }
    EXPECT_FALSE(*done) << "event after [DONE]";
    out.push_back(json::parse(data));
  }
  return out;
}

// The (event name, JSON data) pairs of an SSE body with "event:" lines (Anthropic, Responses).
inline std::vector<std::pair<std::string, json>> named_sse_events(const std::string& body) {
  std::vector<std::pair<std::string, json>> out;
  std::istringstream in(body);
  std::string line, name;
  while (std::getline(in, line)) {
    if (line.rfind("event: ", 0) == 0) name = line.substr(7);
    else if (line.rfind("data: ", 0) == 0) out.emplace_back(name, json::parse(line.substr(6)));
  }
  return out;
}

struct StreamedChat {
  std::string reasoning, content, finish_reason, role;
  std::vector<json> tool_calls;  // merged by index
  json usage;
  bool done = false;
  int chunks = 0;
};

inline StreamedChat stream_chat(TestServer& s, json body) {
  body["stream"] = true;
  Reply r = post(s, "/v1/chat/completions", body);
  EXPECT_EQ(r.status, 200) << r.body;
  StreamedChat out;
  for (const auto& ev : sse_events(r.body, &out.done)) {
    ++out.chunks;
    EXPECT_EQ(ev["object"], "chat.completion.chunk");
    if (ev.contains("usage") && ev["usage"].is_object()) out.usage = ev["usage"];
    for (const auto& ch : ev["choices"]) {
      const json& d = ch["delta"];
      if (d.contains("role")) out.role = d["role"];
      if (d.contains("reasoning_content")) out.reasoning += d["reasoning_content"].get<std::string>();
      if (d.contains("content")) out.content += d["content"].get<std::string>();
      if (d.contains("tool_calls"))
        for (const auto& tc : d["tool_calls"]) {
          size_t i = tc["index"];
          if (i >= out.tool_calls.size()) {
            out.tool_calls.push_back({{"id", tc.value("id", "")},
                                      {"name", tc["function"].value("name", "")},
                                      {"arguments", ""}});
          }
          out.tool_calls[i]["arguments"] =
              out.tool_calls[i]["arguments"].get<std::string>() + tc["function"].value("arguments", "");
        }
      if (!ch["finish_reason"].is_null()) out.finish_reason = ch["finish_reason"];
    }
  }
  return out;
}

inline int64_t metric(TestServer& s, const std::string& name) {
  Reply r = get(s, "/metrics");
  std::istringstream in(r.body);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + "{", 0) == 0) return std::stoll(line.substr(line.rfind(' ') + 1));
  ADD_FAILURE() << "no metric " << name;
  return -1;
}

// Polls the metric until it equals `value` (true) or the limit passes (false).
inline bool wait_for_value(TestServer& s, const std::string& name, int64_t value,
                           std::chrono::milliseconds limit = 5000ms) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (metric(s, name) == value) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

inline bool wait_for_zero(TestServer& s, const std::string& name, std::chrono::milliseconds limit = 5000ms) {
  return wait_for_value(s, name, 0, limit);
}


inline int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

inline void send_request(int fd, const std::string& path, const std::string& body) {
  std::string req = "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                    std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
}

// Sends raw bytes, returns what the server answered (until it closes or 3 s pass).
inline std::string raw_exchange(int port, const std::string& bytes, double* seconds = nullptr) {
  int fd = connect_to(port);
  EXPECT_GE(fd, 0);
  auto start = std::chrono::steady_clock::now();
  send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  timeval tv{3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.find("\r\n\r\n") != std::string::npos) {
      size_t cl = out.find("Content-Length: ");
      size_t head = out.find("\r\n\r\n") + 4;
      if (cl != std::string::npos && out.size() >= head + std::stoul(out.substr(cl + 16))) break;
    }
  }
  if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  close(fd);
  return out;
}

}  // namespace kiln::server::test
