// The HTTP server in-process: a real engine over the echo dummy runner (the "model" repeats the last chat
// turn, so a test decides what the model writes), the byte-level test tokenizer and the Qwen3.5 chat
// template from tests/fixtures. Checks the OpenAI wire format, reasoning and tool-call parsing, stop
// strings, validation errors, limits, auth and that disconnects free capacity.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fcntl.h>

#include <fstream>
#include <sstream>
#include <chrono>
#include <thread>

#include "core/log.h"
#include "engine/dummy_runner.h"
#include "engine/engine.h"
#include "server/http_server.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::string read_file(const std::string& path) {
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
    d.vocab = 512;
    d.kv_pages = 4096;
    d.page_size = 16;
    d.state_slots = cfg.max_running;
    d.max_context = cfg.context;
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

TestServer& shared_server() {
  static TestServer* s = new TestServer();
  return *s;
}

json chat_body(const std::string& user_text, json extra = json::object()) {
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

Reply post(TestServer& s, const std::string& path, const std::string& body,
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

Reply post(TestServer& s, const std::string& path, const json& body) { return post(s, path, body.dump()); }

Reply get(TestServer& s, const std::string& path, const httplib::Headers& headers = {}) {
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
std::vector<json> sse_events(const std::string& body, bool* done) {
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

struct StreamedChat {
  std::string reasoning, content, finish_reason, role;
  std::vector<json> tool_calls;  // merged by index
  json usage;
  bool done = false;
  int chunks = 0;
};

StreamedChat stream_chat(TestServer& s, json body) {
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

int64_t metric(TestServer& s, const std::string& name) {
  Reply r = get(s, "/metrics");
  std::istringstream in(r.body);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + "{", 0) == 0) return std::stoll(line.substr(line.rfind(' ') + 1));
  ADD_FAILURE() << "no metric " << name;
  return -1;
}

bool wait_for_zero(TestServer& s, const std::string& name, std::chrono::milliseconds limit = 5000ms) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (metric(s, name) == 0) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// --- basics ---

TEST(Http, HealthModelsInfo) {
  TestServer& s = shared_server();
  EXPECT_EQ(get(s, "/health").status, 200);
  EXPECT_EQ(get(s, "/health").body, "");
  Reply m = get(s, "/v1/models");
  ASSERT_EQ(m.status, 200);
  EXPECT_EQ(m.j["object"], "list");
  EXPECT_EQ(m.j["data"][0]["id"], "test-model");
  Reply info = get(s, "/get_model_info");
  ASSERT_EQ(info.status, 200);
  for (const char* k : {"model_path", "tokenizer_path", "is_generation", "model_type", "architectures", "weight_version"})
    EXPECT_TRUE(info.j.contains(k)) << k;
  EXPECT_EQ(info.j["model_path"], "/models/test");
  EXPECT_EQ(get(s, "/model_info").j, info.j);
  Reply si = get(s, "/get_server_info");
  ASSERT_EQ(si.status, 200);
  EXPECT_EQ(si.j["context_length"], 2048);
  EXPECT_EQ(si.j["max_total_num_tokens"], 4096 * 16);
  EXPECT_EQ(si.j["reasoning_parser"], "qwen3");
  EXPECT_EQ(si.j["tool_call_parser"], "qwen3_coder");
  EXPECT_EQ(get(s, "/health_generate").status, 200);
  Reply nf = get(s, "/nope");
  EXPECT_EQ(nf.status, 404);
  EXPECT_TRUE(nf.j["error"]["message"].is_string());
}

TEST(Http, TokenizeDetokenize) {
  TestServer& s = shared_server();
  Reply t = post(s, "/tokenize", json{{"prompt", "hi!"}});
  ASSERT_EQ(t.status, 200) << t.body;
  EXPECT_EQ(t.j["tokens"], json({104, 105, 33}));
  EXPECT_EQ(t.j["count"], 3);
  Reply t2 = post(s, "/v1/tokenize", json{{"text", "a<|im_end|>"}});
  EXPECT_EQ(t2.j["tokens"], json({97, 511}));
  Reply d = post(s, "/detokenize", json{{"tokens", {104, 105, 511}}});
  EXPECT_EQ(d.j["text"], "hi");
  Reply d2 = post(s, "/detokenize", json{{"tokens", {104, 105, 511}}, {"skip_special_tokens", false}});
  EXPECT_EQ(d2.j["text"], "hi<|im_end|>");
  EXPECT_EQ(post(s, "/detokenize", json{{"tokens", {100000}}}).status, 400);
  EXPECT_EQ(post(s, "/tokenize", json{{"prompt", 5}}).status, 400);
}

// --- chat: reasoning, content, usage ---

TEST(Http, ChatThinkingSplitsReasoning) {
  TestServer& s = shared_server();
  std::string said = "First, 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.";
  Reply r = post(s, "/v1/chat/completions", chat_body(said));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& msg = r.j["choices"][0]["message"];
  EXPECT_EQ(msg["role"], "assistant");
  EXPECT_EQ(msg["reasoning_content"], "First, 2+2.\nIt is 4.");
  EXPECT_EQ(msg["content"], "The answer is 4.");
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r.j["object"], "chat.completion");
  EXPECT_EQ(r.j["model"], "test-model");
  // Byte tokens: every byte of the echoed text is a token, plus the <|im_end|> that stops it.
  EXPECT_EQ(r.j["usage"]["completion_tokens"], static_cast<int>(said.size()) + 1);
  // Reasoning tokens: the bytes up to and including the closing tag.
  EXPECT_EQ(r.j["usage"]["completion_tokens_details"]["reasoning_tokens"],
            static_cast<int>(said.find("</think>") + 8));
  int prompt = r.j["usage"]["prompt_tokens"];
  EXPECT_EQ(r.j["usage"]["total_tokens"], prompt + static_cast<int>(said.size()) + 1);
  // Streamed: the same text.
  StreamedChat st = stream_chat(s, chat_body(said));
  EXPECT_EQ(st.role, "assistant");
  EXPECT_EQ(st.reasoning, "First, 2+2.\nIt is 4.");
  EXPECT_EQ(st.content, "The answer is 4.");
  EXPECT_EQ(st.finish_reason, "stop");
  EXPECT_TRUE(st.done);
  EXPECT_TRUE(st.usage.is_null());
}

TEST(Http, ChatStopsBeforeThinkCloseIsAllReasoning) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body("still thinking about it", {{"max_tokens", 10}}));
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.j["choices"][0]["message"]["reasoning_content"], "still thin");
  EXPECT_TRUE(r.j["choices"][0]["message"]["content"].is_null());
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "length");
}

TEST(Http, ChatThinkingOffIsAllContent) {
  TestServer& s = shared_server();
  json kw = {{"chat_template_kwargs", {{"enable_thinking", false}}}};
  Reply r = post(s, "/v1/chat/completions", chat_body("Plain answer.", kw));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "Plain answer.");
  EXPECT_TRUE(r.j["choices"][0]["message"]["reasoning_content"].is_null());
  EXPECT_EQ(r.j["usage"]["completion_tokens_details"]["reasoning_tokens"], 0);
  StreamedChat st = stream_chat(s, chat_body("Plain answer.", kw));
  EXPECT_EQ(st.content, "Plain answer.");
  EXPECT_EQ(st.reasoning, "");
}

TEST(Http, SeparateReasoningFalseGivesRawText) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body("hmm\n</think>\n\nyes", {{"separate_reasoning", false}}));
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "hmm\n</think>\n\nyes");
  EXPECT_TRUE(r.j["choices"][0]["message"]["reasoning_content"].is_null());
}

TEST(Http, StreamUsageChunk) {
  TestServer& s = shared_server();
  StreamedChat st =
      stream_chat(s, chat_body("x</think>ok", {{"stream_options", {{"include_usage", true}}}}));
  ASSERT_TRUE(st.usage.is_object());
  EXPECT_EQ(st.usage["completion_tokens"], 12);
  EXPECT_EQ(st.usage["total_tokens"], st.usage["prompt_tokens"].get<int>() + 12);
  EXPECT_EQ(st.usage["completion_tokens_details"]["reasoning_tokens"], 9);
  EXPECT_TRUE(st.done);
}

// --- tool calls ---

json weather_tools() {
  return json::parse(R"([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
    "metric": {"type": "boolean"}}, "required": ["city"]}}}])");
}

const char* kToolCallText =
    "Need weather.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n"
    "</tool_call>";

TEST(Http, ToolCallsNonStreamed) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body(kToolCallText, {{"tools", weather_tools()}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& c = r.j["choices"][0];
  EXPECT_EQ(c["finish_reason"], "tool_calls");
  EXPECT_EQ(c["message"]["reasoning_content"], "Need weather.");
  EXPECT_EQ(c["message"]["content"], "Checking.");
  ASSERT_EQ(c["message"]["tool_calls"].size(), 1u);
  const json& call = c["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(call["function"]["name"], "get_weather");
  json args = json::parse(call["function"]["arguments"].get<std::string>());
  EXPECT_EQ(args, json::parse(R"({"city": "Paris", "days": 3, "metric": true})"));
}

TEST(Http, ToolCallsStreamed) {
  TestServer& s = shared_server();
  StreamedChat st = stream_chat(s, chat_body(kToolCallText, {{"tools", weather_tools()}}));
  EXPECT_EQ(st.finish_reason, "tool_calls");
  EXPECT_EQ(st.content, "Checking.");
  ASSERT_EQ(st.tool_calls.size(), 1u);
  EXPECT_EQ(st.tool_calls[0]["name"], "get_weather");
  EXPECT_EQ(st.tool_calls[0]["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(json::parse(st.tool_calls[0]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris", "days": 3, "metric": true})"));
}

TEST(Http, WithoutToolsTheXmlIsContent) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body(kToolCallText));
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(r.j["choices"][0]["message"]["tool_calls"].is_null());
  EXPECT_NE(r.j["choices"][0]["message"]["content"].get<std::string>().find("<tool_call>"), std::string::npos);
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
}

// --- stop strings, limits, n, logprobs ---

TEST(Http, StopStringsNeverLeak) {
  TestServer& s = shared_server();
  json body = chat_body("r</think>alpha beta END gamma", {{"stop", {"END", "zzz"}}});
  Reply r = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "alpha beta ");
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r.j["choices"][0]["matched_stop"], "END");
  body["stream"] = true;
  Reply sr = post(s, "/v1/chat/completions", body);
  bool done;
  std::string content;
  for (const auto& ev : sse_events(sr.body, &done))
    for (const auto& ch : ev["choices"])
      if (ch["delta"].contains("content")) {
        std::string piece = ch["delta"]["content"];
        EXPECT_EQ(piece.find('E'), std::string::npos) << "partial stop string streamed: " << piece;
        content += piece;
      }
  EXPECT_EQ(content, "alpha beta ");
  EXPECT_TRUE(done);
}

TEST(Http, CompletionsPlainEchoLogprobsAndN) {
  TestServer& s = shared_server();
  // Raw prompt: the echo model repeats what follows the last "<|im_start|>...\n" line.
  std::string prompt = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n";
  Reply r = post(s, "/v1/completions", json{{"model", "test-model"}, {"prompt", prompt}, {"max_tokens", 20}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["object"], "text_completion");
  EXPECT_EQ(r.j["choices"][0]["text"], "hello");
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r.j["usage"]["prompt_tokens"], 24);
  EXPECT_FALSE(r.j["usage"].contains("completion_tokens_details"));
  // Token ids as the prompt; echo; logprobs; n = 2.
  Reply t = post(s, "/tokenize", json{{"prompt", prompt}});
  Reply r2 = post(s, "/v1/completions",
                  json{{"prompt", t.j["tokens"]}, {"max_tokens", 3}, {"logprobs", 2}, {"n", 2}, {"temperature", 0.5}});
  ASSERT_EQ(r2.status, 200) << r2.body;
  ASSERT_EQ(r2.j["choices"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const json& c = r2.j["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["text"], "hel");
    EXPECT_EQ(c["finish_reason"], "length");
    EXPECT_EQ(c["logprobs"]["tokens"], json({"h", "e", "l"}));
    EXPECT_EQ(c["logprobs"]["text_offset"], json({0, 1, 2}));
    ASSERT_EQ(c["logprobs"]["top_logprobs"].size(), 3u);
    EXPECT_EQ(c["logprobs"]["top_logprobs"][0].size(), 2u);
  }
  EXPECT_EQ(r2.j["usage"]["completion_tokens"], 6);
  Reply e = post(s, "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 2}, {"echo", true}});
  EXPECT_EQ(e.j["choices"][0]["text"], prompt + "he");
  // Streamed completions.
  Reply st = post(s, "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 50}, {"stream", true}});
  bool done;
  std::string text;
  std::string finish;
  for (const auto& ev : sse_events(st.body, &done))
    for (const auto& ch : ev["choices"]) {
      text += ch["text"].get<std::string>();
      if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
    }
  EXPECT_EQ(text, "hello");
  EXPECT_EQ(finish, "stop");
  EXPECT_TRUE(done);
}

TEST(Http, ChatLogprobs) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body("ab", {{"logprobs", true}, {"top_logprobs", 3}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& lp = r.j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 3u);  // a, b, <|im_end|>
  EXPECT_EQ(lp[0]["token"], "a");
  EXPECT_EQ(lp[0]["bytes"], json({97}));
  EXPECT_EQ(lp[0]["top_logprobs"].size(), 3u);
  EXPECT_EQ(lp[0]["top_logprobs"][0]["token"], "a");
  EXPECT_LE(lp[0]["logprob"].get<double>(), 0.0);
}

TEST(Http, MaxTokensDefaultsToTheRestOfTheContext) {
  TestServer& s = shared_server();
  json body = chat_body("hi");
  body["ignore_eos"] = true;
  body["max_tokens"] = 30;
  Reply r = post(s, "/v1/chat/completions", body);
  EXPECT_EQ(r.j["usage"]["completion_tokens"], 30);
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "length");
}

// --- bad input ---

TEST(Http, ValidationErrorsNameTheParameter) {
  TestServer& s = shared_server();
  struct Case {
    std::string body;
    int status;
    std::string param;  // "" = null
  };
  json ok = chat_body("hi");
  auto with = [&](const char* key, json v) {
    json b = ok;
    b[key] = v;
    return b.dump();
  };
  std::vector<Case> cases = {
      {"{not json", 400, ""},
      {"[1,2]", 400, ""},
      {"", 400, ""},
      {R"({"model": "test-model"})", 400, "messages"},
      {R"({"messages": []})", 400, "messages"},
      {R"({"messages": "hi"})", 400, "messages"},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", 400, "messages[0].role"},
      {R"({"messages": [{"content": "x"}]})", 400, "messages[0].role"},
      {R"({"messages": [{"role": "user"}]})", 400, "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": 5}]})", 400, "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400, "messages[0].content"},
      {with("temperature", 3), 400, "temperature"},
      {with("temperature", "hot"), 400, "temperature"},
      {with("top_p", 0), 400, "top_p"},
      {with("top_p", 1.5), 400, "top_p"},
      {with("top_k", -5), 400, "top_k"},
      {with("min_p", 2), 400, "min_p"},
      {with("presence_penalty", 3), 400, "presence_penalty"},
      {with("frequency_penalty", -2.5), 400, "frequency_penalty"},
      {with("repetition_penalty", 0), 400, "repetition_penalty"},
      {with("max_tokens", 0), 400, "max_tokens"},
      {with("max_tokens", 1.5), 400, "max_tokens"},
      {with("max_completion_tokens", -1), 400, "max_completion_tokens"},
      {with("n", 0), 400, "n"},
      {with("n", 1000), 400, "n"},
      {with("seed", "x"), 400, "seed"},
      {with("stop", 5), 400, "stop"},
      {with("stop", json::array({"a", 1})), 400, "stop"},
      {with("stop", json::array({""})), 400, "stop"},
      {with("stream", "yes"), 400, "stream"},
      {with("top_logprobs", 5), 400, "top_logprobs"},
      {with("logprobs", 1), 400, "logprobs"},
      {with("tools", "x"), 400, "tools"},
      {with("tools", json::parse(R"([{"type": "function", "function": {}}])")), 400, "tools[0].function.name"},
      {with("tool_choice", "sometimes"), 400, "tool_choice"},
      {with("stop_token_ids", json::array({99999})), 400, "stop_token_ids"},
      {with("chat_template_kwargs", json::parse(R"({"enable_thinking": "no"})")), 400, "chat_template_kwargs"},
      {with("response_format", json::parse(R"({"type": "json_schema"})")), 400, "response_format"},
      {with("stream_options", json::parse(R"({"include_usage": true})")), 400, "stream_options"},
  };
  for (const auto& c : cases) {
    Reply r = post(s, "/v1/chat/completions", c.body);
    EXPECT_EQ(r.status, c.status) << c.body << " -> " << r.body;
    ASSERT_TRUE(r.j.is_object()) << c.body << " -> " << r.body;
    ASSERT_TRUE(r.j.contains("error")) << r.body;
    const json& e = r.j["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty());
    EXPECT_EQ(e["type"], "invalid_request_error");
    if (c.param.empty())
      EXPECT_TRUE(e["param"].is_null()) << c.body << " -> " << r.body;
    else
      EXPECT_EQ(e["param"], c.param) << c.body << " -> " << r.body;
    EXPECT_TRUE(e.contains("code"));
  }
  // Completions.
  EXPECT_EQ(post(s, "/v1/completions", std::string(R"({"max_tokens": 3})")).j["error"]["param"], "prompt");
  EXPECT_EQ(post(s, "/v1/completions", std::string(R"({"prompt": ""})")).status, 400);
  EXPECT_EQ(post(s, "/v1/completions", std::string(R"({"prompt": [1, 99999]})")).j["error"]["param"], "prompt");
  EXPECT_EQ(post(s, "/v1/completions", std::string(R"({"prompt": "x", "logprobs": 50})")).j["error"]["param"], "logprobs");
  // Still fine afterwards.
  EXPECT_EQ(post(s, "/v1/chat/completions", ok).status, 200);
}

TEST(Http, UnknownModelIs404) {
  TestServer& s = shared_server();
  json b = chat_body("hi");
  b["model"] = "gpt-17";
  Reply r = post(s, "/v1/chat/completions", b);
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.j["error"]["code"], "model_not_found");
  EXPECT_EQ(r.j["error"]["param"], "model");
  b["model"] = "/models/test";  // the model path is accepted as a name too
  EXPECT_EQ(post(s, "/v1/chat/completions", b).status, 200);
  EXPECT_EQ(get(s, "/v1/models/gpt-17").status, 404);
  EXPECT_EQ(get(s, "/v1/models/test-model").status, 200);
}

TEST(Http, TooLongPromptGivesTheCounts) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body(std::string(3000, 'x')));
  EXPECT_EQ(r.status, 400);
  std::string msg = r.j["error"]["message"];
  EXPECT_NE(msg.find("2048"), std::string::npos) << msg;
  EXPECT_NE(msg.find("30"), std::string::npos) << msg;
  EXPECT_EQ(r.j["error"]["code"], "context_length_exceeded");
  Reply r2 = post(s, "/v1/chat/completions", chat_body("short", {{"max_tokens", 5000}}));
  EXPECT_EQ(r2.status, 400);
  EXPECT_EQ(r2.j["error"]["param"], "max_tokens");
  EXPECT_NE(r2.j["error"]["message"].get<std::string>().find("2048"), std::string::npos);
}

TEST(Http, BodyOverTheLimitIs413) {
  ServerConfig cfg;
  cfg.max_request_bytes = 4096;
  TestServer s(cfg);
  Reply r = post(s, "/v1/chat/completions", chat_body(std::string(10000, 'x')));
  EXPECT_EQ(r.status, 413);
  EXPECT_TRUE(r.j["error"]["message"].is_string()) << r.body;
  EXPECT_EQ(post(s, "/v1/chat/completions", chat_body("ok")).status, 200);
}

TEST(Http, ApiKey) {
  ServerConfig cfg;
  cfg.api_key = "sekret";
  TestServer s(cfg);
  Reply no = post(s, "/v1/chat/completions", chat_body("hi"));
  EXPECT_EQ(no.status, 401);
  EXPECT_EQ(no.j["error"]["code"], "invalid_api_key");
  EXPECT_EQ(post(s, "/v1/chat/completions", chat_body("hi").dump(), {{"Authorization", "Bearer wrong"}}).status, 401);
  EXPECT_EQ(post(s, "/v1/chat/completions", chat_body("hi").dump(), {{"Authorization", "Bearer sekret"}}).status, 200);
  EXPECT_EQ(get(s, "/v1/models").status, 401);
  EXPECT_EQ(get(s, "/v1/models", {{"Authorization", "Bearer sekret"}}).status, 200);
  EXPECT_EQ(get(s, "/health").status, 200);
  EXPECT_EQ(get(s, "/metrics").status, 200);
}

TEST(Http, QueueFullIs503WithRetryAfter) {
  ServerConfig cfg;
  cfg.max_running = 1;
  cfg.max_queued = 1;
  cfg.step_delay_us = 2000;
  TestServer s(cfg);
  // Long enough (1,000 steps of 2 ms) that the first request is still running when the last thread gets its answer,
  // even on a loaded 2-core machine.
  json slow = chat_body("x", {{"max_tokens", 1000}, {"ignore_eos", true}});
  std::vector<std::thread> threads;
  std::atomic<int> ok{0}, full{0};
  for (int i = 0; i < 6; ++i) {
    if (i == 1) std::this_thread::sleep_for(100ms);  // the first one is running by then
    threads.emplace_back([&] {
      Reply r = post(s, "/v1/chat/completions", slow);
      if (r.status == 200) ++ok;
      if (r.status == 503) {
        ++full;
        EXPECT_EQ(r.headers.count("Retry-After"), 1u);
        EXPECT_EQ(r.j["error"]["code"], "queue_full");
        // One running, one waiting: the message counts the waiting one only.
        EXPECT_NE(r.j["error"]["message"].get<std::string>().find("(1 waiting, limit 1)"), std::string::npos)
            << r.j["error"]["message"];
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 2);
  EXPECT_EQ(full.load(), 4);
  EXPECT_TRUE(wait_for_zero(s, "kiln:kv_pages_used"));
}

// --- disconnects ---

int connect_to(int port) {
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

void send_request(int fd, const std::string& path, const std::string& body) {
  std::string req = "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                    std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
}

TEST(Http, DisconnectsFreeCapacity) {
  ServerConfig cfg;
  cfg.step_delay_us = 3000;
  TestServer s(cfg);
  json long_gen = chat_body("x", {{"max_tokens", 1500}, {"ignore_eos", true}});
  // Streamed: read a little, then hang up.
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) {
    int fd = connect_to(s.port());
    ASSERT_GE(fd, 0);
    json b = long_gen;
    b["stream"] = true;
    send_request(fd, "/v1/chat/completions", b.dump());
    char buf[512];
    ASSERT_GT(recv(fd, buf, sizeof(buf), 0), 0);
    fds.push_back(fd);
  }
  // Non-streamed: hang up while it runs.
  for (int i = 0; i < 2; ++i) {
    int fd = connect_to(s.port());
    send_request(fd, "/v1/chat/completions", long_gen.dump());
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(metric(s, "kiln:num_running_reqs"), 5);
  EXPECT_GT(metric(s, "kiln:kv_pages_used"), 0);
  for (int fd : fds) close(fd);
  EXPECT_TRUE(wait_for_zero(s, "kiln:kv_pages_used", 3000ms)) << "capacity leaked after disconnects";
  EXPECT_EQ(metric(s, "kiln:num_running_reqs"), 0);
  // Still answering.
  Reply r = post(s, "/v1/chat/completions", chat_body("a</think>b"));
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "b");
  for (int i = 0; i < 100 && s.http().active_requests() > 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(s.http().active_requests(), 0);
}

TEST(Http, ManyIdleStreamsDoNotStarveOtherClients) {
  ServerConfig cfg;
  cfg.echo = false;
  cfg.step_delay_us = 2000;
  TestServer s(cfg);  // 96 HTTP threads, 8 running, 64 queued
  json b = chat_body("x", {{"max_tokens", 1000}, {"ignore_eos", true}, {"stream", true}});
  std::vector<int> fds;
  for (int i = 0; i < 60; ++i) {  // clients that start a stream and never read it
    int fd = connect_to(s.port());
    ASSERT_GE(fd, 0);
    send_request(fd, "/v1/chat/completions", b.dump());
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(200ms);
  for (int i = 0; i < 10; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(get(s, "/health").status, 200);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  }
  // Every stream is running or queued (none rejected); how many run at once depends on the pages and state
  // slots the scheduler grants (at most the 8 running requests of the config).
  const double running = metric(s, "kiln:num_running_reqs");
  EXPECT_GE(running, 1);
  EXPECT_LE(running, 8);
  EXPECT_EQ(running + metric(s, "kiln:num_queue_reqs"), 60);
  for (int fd : fds) close(fd);
  EXPECT_TRUE(wait_for_zero(s, "kiln:num_queue_reqs", 5000ms));
  EXPECT_TRUE(wait_for_zero(s, "kiln:kv_pages_used", 5000ms));
}

TEST(Http, GarbageAndTruncatedRequestsDoNotHurt) {
  TestServer s;
  // Random bytes, a truncated body (then hang up), a header-only request, a slow trickle.
  std::mt19937 rng(5);
  for (int i = 0; i < 5; ++i) {
    int fd = connect_to(s.port());
    std::string junk(200 + rng() % 500, '\0');
    for (auto& c : junk) c = static_cast<char>(rng());
    send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    close(fd);
  }
  {
    int fd = connect_to(s.port());
    std::string req = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"messages\": [";
    send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    close(fd);
  }
  {
    int fd = connect_to(s.port());
    std::string body = chat_body("slow</think>client").dump();
    std::string req = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    for (char c : req) {  // one byte at a time, well within the read timeout
      send(fd, &c, 1, MSG_NOSIGNAL);
      if (rng() % 50 == 0) std::this_thread::sleep_for(1ms);
    }
    std::string resp;
    char buf[4096];
    ssize_t n;
    while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) {
      resp.append(buf, static_cast<size_t>(n));
      if (resp.find("\"client\"") != std::string::npos) break;
    }
    close(fd);
    EXPECT_NE(resp.find("200 OK"), std::string::npos) << resp.substr(0, 200);
  }
  Reply r = post(s, "/v1/chat/completions", chat_body("fine</think>ok"));
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "ok");
  EXPECT_TRUE(wait_for_zero(s, "kiln:kv_pages_used"));
}

TEST(Http, ManyConcurrentStreamsMatchAlone) {
  ServerConfig cfg;
  cfg.echo = false;  // hash model: each output depends on the whole sequence
  cfg.max_running = 8;
  TestServer s(cfg);
  std::vector<json> bodies;
  for (int i = 0; i < 40; ++i)
    bodies.push_back(chat_body("request " + std::to_string(i) + std::string(static_cast<size_t>(i * 7), '.'),
                               {{"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}}));
  std::vector<std::string> alone;
  for (const auto& b : bodies) alone.push_back(stream_chat(s, b).reasoning);
  std::vector<std::string> together(bodies.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < bodies.size(); ++i)
    threads.emplace_back([&, i] { together[i] = stream_chat(s, bodies[i]).reasoning; });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < bodies.size(); ++i) EXPECT_EQ(together[i], alone[i]) << i;
  EXPECT_TRUE(wait_for_zero(s, "kiln:kv_pages_used"));
}

TEST(Http, DrainingAnswers503) {
  TestServer s;
  s.http().set_draining();
  EXPECT_EQ(get(s, "/health").status, 503);
  Reply r = post(s, "/v1/chat/completions", chat_body("hi"));
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.headers.count("Retry-After"), 1u);
}

TEST(Http, MetricsText) {
  TestServer& s = shared_server();
  post(s, "/v1/chat/completions", chat_body("m</think>n"));
  Reply m = get(s, "/metrics");
  ASSERT_EQ(m.status, 200);
  for (const char* name :
       {"kiln:num_running_reqs", "kiln:num_queue_reqs", "kiln:kv_cache_usage_ratio", "kiln:prompt_tokens_total",
        "kiln:generation_tokens_total", "kiln:time_to_first_token_seconds_bucket",
        "kiln:inter_token_latency_seconds_count", "kiln:http_requests_total", "kiln:requests_finished_total"})
    EXPECT_NE(m.body.find(name), std::string::npos) << name;
  // The HTTP counters are updated by the server thread after the reply is sent: poll for the chat request's line.
  const std::string chat_200 = "endpoint=\"/v1/chat/completions\",status=\"200\"";
  for (int i = 0; i < 200 && m.body.find(chat_200) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    m = get(s, "/metrics");
  }
  EXPECT_NE(m.body.find(chat_200), std::string::npos);
  EXPECT_GT(metric(s, "kiln:generation_tokens_total"), 0);
}

// --- issue 20: the defects found by a new user and an SRE ---

int64_t finished_metric(TestServer& s, const std::string& reason) {
  Reply r = get(s, "/metrics");
  std::istringstream in(r.body);
  std::string line;
  const std::string label = "finish_reason=\"" + reason + "\"}";
  while (std::getline(in, line))
    if (line.rfind("kiln:requests_finished_total{", 0) == 0 && line.find(label) != std::string::npos)
      return std::stoll(line.substr(line.rfind(' ') + 1));
  return 0;
}

TEST(Http, UnimplementedFieldsAreRejectedNullIsAbsent) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body("hi", {{"reasoning_effort", "high"}}));
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.j["error"]["param"], "reasoning_effort");
  EXPECT_EQ(r.j["error"]["code"], "unsupported_parameter");
  Reply c = post(s, "/v1/completions", json{{"prompt", "x"}, {"functions", json::array({1})}});
  EXPECT_EQ(c.status, 400);
  EXPECT_EQ(c.j["error"]["param"], "functions");
  // Chat-only fields are unknown to completions.
  EXPECT_EQ(post(s, "/v1/completions", json{{"prompt", "x"}, {"tools", json::array()}}).status, 400);
  // null means "not given"; user is accepted (nothing to act on).
  EXPECT_EQ(post(s, "/v1/chat/completions", chat_body("hi", {{"reasoning_effort", nullptr}, {"user", "u1"}})).status,
            200);
}

TEST(Http, LogitBiasChangesTheTokens) {
  ServerConfig cfg;
  cfg.echo = false;  // hash logits in [0, 10): a bias of 100 decides every token
  TestServer s(cfg);
  json body = {{"prompt", "Once"}, {"max_tokens", 5}, {"temperature", 0}};
  Reply plain = post(s, "/v1/completions", body);
  ASSERT_EQ(plain.status, 200) << plain.body;
  body["logit_bias"] = {{"90", 100}};  // 'Z'
  Reply z = post(s, "/v1/completions", body);
  ASSERT_EQ(z.status, 200) << z.body;
  EXPECT_EQ(z.j["choices"][0]["text"], "ZZZZZ");
  for (json bad : {json{{"abc", 1}}, json{{"999999", 1}}, json{{"5", 101}}, json(json::array({1}))}) {
    body["logit_bias"] = bad;
    Reply r = post(s, "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << bad.dump();
    EXPECT_EQ(r.j["error"]["param"], "logit_bias");
  }
}

const char* kTwoCallsText =
    "r</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
    "</tool_call>";

TEST(Http, ParallelToolCallsFalseKeepsTheFirstCall) {
  TestServer& s = shared_server();
  Reply both = post(s, "/v1/chat/completions", chat_body(kTwoCallsText, {{"tools", weather_tools()}}));
  ASSERT_EQ(both.status, 200) << both.body;
  EXPECT_EQ(both.j["choices"][0]["message"]["tool_calls"].size(), 2u);
  json body = chat_body(kTwoCallsText, {{"tools", weather_tools()}, {"parallel_tool_calls", false}});
  Reply one = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(one.j["choices"][0]["message"]["tool_calls"].size(), 1u) << one.body;
  EXPECT_EQ(json::parse(one.j["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(one.j["choices"][0]["finish_reason"], "tool_calls");
  StreamedChat st = stream_chat(s, body);
  EXPECT_EQ(st.tool_calls.size(), 1u);
}

TEST(Http, CallsOfUnknownFunctionsAreDropped) {
  TestServer& s = shared_server();
  const char* text =
      "r</think>\n\nOk.\n<tool_call>\n<function=delete_everything>\n<parameter=really>\nyes\n</parameter>\n"
      "</function>\n</tool_call>";
  Reply r = post(s, "/v1/chat/completions", chat_body(text, {{"tools", weather_tools()}}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.j["choices"][0]["message"]["tool_calls"].is_null()) << r.body;
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "Ok.");
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
}

TEST(Http, ToolCallCutByMaxTokensLeaksNoTagFragment) {
  TestServer& s = shared_server();
  // The byte tokenizer: one token per byte, so max_tokens cuts the text at a byte: right inside "</parameter>".
  const std::string answer = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</";
  const std::string text = "r</think>\n\n" + answer + "parameter>\n</function>\n</tool_call>";
  Reply r = post(s, "/v1/chat/completions",
                 chat_body(text, {{"tools", weather_tools()}, {"max_tokens", 11 + static_cast<int>(answer.size())}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& c = r.j["choices"][0];
  EXPECT_EQ(c["finish_reason"], "length");
  ASSERT_EQ(c["message"]["tool_calls"].size(), 1u) << r.body;
  EXPECT_EQ(json::parse(c["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris"})"));
}

TEST(Http, StreamReasoningFalseSendsReasoningInOnePiece) {
  TestServer& s = shared_server();
  json body = chat_body("think think think</think>\n\nanswer", {{"stream", true}, {"stream_reasoning", false}});
  Reply r = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200);
  bool done;
  int reasoning_chunks = 0;
  std::string reasoning, content;
  bool content_before_reasoning = false;
  for (const auto& ev : sse_events(r.body, &done))
    for (const auto& ch : ev["choices"]) {
      if (ch["delta"].contains("reasoning_content")) {
        ++reasoning_chunks;
        reasoning += ch["delta"]["reasoning_content"].get<std::string>();
      }
      if (ch["delta"].contains("content") && !ch["delta"]["content"].get<std::string>().empty()) {
        if (reasoning_chunks == 0) content_before_reasoning = true;
        content += ch["delta"]["content"].get<std::string>();
      }
    }
  EXPECT_EQ(reasoning_chunks, 1);
  EXPECT_EQ(reasoning, "think think think");
  EXPECT_EQ(content, "answer");
  EXPECT_FALSE(content_before_reasoning);
  // Streamed as usual: the same reasoning.
  body["stream_reasoning"] = true;
  StreamedChat st = stream_chat(s, body);
  EXPECT_EQ(st.reasoning, "think think think");
  EXPECT_EQ(st.content, "answer");
}

TEST(Http, StopStringFinishesCountAsStopInMetrics) {
  TestServer s;
  for (int i = 0; i < 3; ++i) {
    Reply r = post(s, "/v1/chat/completions", chat_body("r</think>alpha END beta gamma delta", {{"stop", "END"}}));
    ASSERT_EQ(r.j["choices"][0]["finish_reason"], "stop");
  }
  // The engine learns of the stop at its next step: wait for it.
  for (int i = 0; i < 100 && finished_metric(s, "stop") < 3; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(finished_metric(s, "stop"), 3);
  EXPECT_EQ(finished_metric(s, "abort"), 0);
}

TEST(Http, HealthGenerateAnswersWhileBusy) {
  ServerConfig cfg;
  cfg.max_running = 1;
  cfg.max_queued = 1;
  cfg.step_delay_us = 2000;
  TestServer s(cfg);
  json slow = chat_body("x", {{"max_tokens", 1500}, {"ignore_eos", true}});
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) threads.emplace_back([&] { post(s, "/v1/chat/completions", slow); });
  std::this_thread::sleep_for(200ms);  // one running, one queued: the queue is full
  auto start = std::chrono::steady_clock::now();
  Reply h = get(s, "/health_generate");
  double s_taken = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(h.status, 200) << h.body;
  EXPECT_LT(s_taken, 1.0) << "health_generate waited for the queue";
  s.engine().drain(std::chrono::milliseconds(0));  // ends the long requests
  for (auto& t : threads) t.join();
}

// A client that sends one header line every `gap` and never finishes its headers.
struct SlowClients {
  std::vector<int> fds;
  std::atomic<bool> stop{false};
  std::thread writer;
  SlowClients(int port, int n, std::chrono::milliseconds gap) {
    for (int i = 0; i < n; ++i) {
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(port));
      inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
      if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) fds.push_back(fd);
      else close(fd);
    }
    writer = std::thread([this, gap] {
      std::string first = "POST /v1/chat/completions HTTP/1.1\r\n";
      for (int fd : fds) send(fd, first.data(), first.size(), MSG_NOSIGNAL);
      for (int line = 0; !stop; ++line) {
        std::this_thread::sleep_for(gap);
        std::string h = "X-Slow-" + std::to_string(line) + ": 1\r\n";
        for (int fd : fds) send(fd, h.data(), h.size(), MSG_NOSIGNAL);
      }
    });
  }
  ~SlowClients() {
    stop = true;
    writer.join();
    for (int fd : fds) close(fd);
  }
};

TEST(Http, SlowHeaderClientsDoNotStarveRealRequests) {
  ServerConfig cfg;
  cfg.header_timeout_ms = 3000;
  cfg.max_waiting_connections = 100;
  TestServer s(cfg);  // 96 HTTP workers
  SlowClients slow(s.port(), 250, 200ms);  // more than the 96 workers
  ASSERT_GT(slow.fds.size(), 200u);
  std::this_thread::sleep_for(500ms);
  for (int i = 0; i < 3; ++i) {
    auto start = std::chrono::steady_clock::now();
    Reply r = post(s, "/v1/chat/completions", chat_body("r</think>ok"));
    double taken = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(r.status, 200);
    EXPECT_LT(taken, 1.0) << "a real request waited behind slow clients";
  }
  // Past the deadline every slow one has been answered 408 and closed (the oldest at once, beyond the limit of
  // 100 waiting). The client kept writing, so its side may see the reset rather than the 408 text.
  std::this_thread::sleep_for(3500ms);
  char buf[256];
  size_t closed = 0;
  for (int fd : slow.fds) {
    ssize_t n = recv(fd, buf, sizeof(buf) - 1, MSG_DONTWAIT);
    if (n > 0) {
      buf[n] = 0;
      if (std::string(buf).rfind("HTTP/1.1 408", 0) == 0) ++closed;
    } else if (n == 0 || errno == ECONNRESET || errno == EPIPE) {
      ++closed;
    }
  }
  EXPECT_EQ(closed, slow.fds.size());
}

// Sends raw bytes, returns what the server answered (until it closes or 3 s pass).
std::string raw_exchange(int port, const std::string& bytes, double* seconds = nullptr) {
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

TEST(Http, PostWithoutBodyLengthAnswersAtOnce) {
  TestServer& s = shared_server();
  double taken = 0;
  std::string out = raw_exchange(s.port(), "POST /health HTTP/1.1\r\nHost: x\r\n\r\n", &taken);
  EXPECT_EQ(out.rfind("HTTP/1.1 411", 0), 0u) << out;
  EXPECT_NE(out.find("Content-Length: 0"), std::string::npos) << out;
  EXPECT_LT(taken, 2.0);
}

TEST(Http, WrongMethodIs405) {
  TestServer& s = shared_server();
  Reply g = get(s, "/v1/chat/completions");
  EXPECT_EQ(g.status, 405);
  auto it = g.headers.find("Allow");
  ASSERT_NE(it, g.headers.end());
  EXPECT_EQ(it->second, "POST");
  EXPECT_NE(g.j["error"]["message"].get<std::string>().find("use POST"), std::string::npos);
  Reply p = post(s, "/health", std::string());
  EXPECT_EQ(p.status, 405);
  EXPECT_EQ(get(s, "/no/such/path").status, 404);
}

TEST(Http, InvalidUtf8AndJsonSayWhere) {
  TestServer& s = shared_server();
  Reply u = post(s, "/v1/chat/completions", std::string("{\"model\": \"x\xff\"}"));
  EXPECT_EQ(u.status, 400);
  std::string m = u.j["error"]["message"];
  EXPECT_NE(m.find("not valid UTF-8"), std::string::npos) << m;
  EXPECT_NE(m.find("0xFF at offset 12"), std::string::npos) << m;
  Reply j = post(s, "/v1/chat/completions", std::string("{\"model\": }"));
  std::string jm = j.j["error"]["message"];
  EXPECT_NE(jm.find("not valid JSON"), std::string::npos) << jm;
  EXPECT_NE(jm.find("column 11"), std::string::npos) << jm;
}

TEST(Http, RejectedRequestsAreLogged) {
  ServerConfig cfg;
  cfg.max_request_bytes = 4096;
  TestServer s(cfg);
  // The request log goes to stderr: catch it in a file for the duration.
  std::string path = std::string(KILN_BINARY_DIR) + "/rejected_log.txt";
  fflush(stderr);
  int saved = dup(2);
  int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  dup2(fd, 2);
  LogLevel level = log_level();
  set_log_level(LogLevel::info);
  post(s, "/v1/chat/completions", chat_body("hi", {{"temperature", 7}}));
  post(s, "/v1/chat/completions", chat_body(std::string(10000, 'x')));  // over the limit: 413
  // The server logs a rejection on its connection thread, which may still be writing when the client has the
  // reply: wait (up to 5 s) for both lines before stderr goes back.
  for (int i = 0; i < 500; ++i) {
    fflush(stderr);
    const std::string so_far = read_file(path);
    if (so_far.find("status=400") != std::string::npos && so_far.find("status=413") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  set_log_level(level);
  fflush(stderr);
  dup2(saved, 2);
  close(fd);
  close(saved);
  std::string log = read_file(path);
  EXPECT_NE(log.find("request rejected method=POST path=/v1/chat/completions"), std::string::npos) << log;
  EXPECT_NE(log.find("status=400 error=\"'temperature' must be"), std::string::npos) << log;
  EXPECT_NE(log.find("status=413"), std::string::npos) << log;
}

TEST(Http, CompletionsTakeAListOfPrompts) {
  ServerConfig cfg;
  cfg.echo = false;
  TestServer s(cfg);
  json one_a = {{"prompt", "alpha"}, {"max_tokens", 6}, {"temperature", 0}};
  json one_b = {{"prompt", "beta"}, {"max_tokens", 6}, {"temperature", 0}};
  std::string a = post(s, "/v1/completions", one_a).j["choices"][0]["text"];
  std::string b = post(s, "/v1/completions", one_b).j["choices"][0]["text"];
  Reply r = post(s, "/v1/completions", json{{"prompt", {"alpha", "beta"}}, {"n", 2}, {"max_tokens", 6},
                                            {"temperature", 0}, {"echo", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(r.j["choices"].size(), 4u);
  // OpenAI's order: n choices per prompt, prompts in order.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r.j["choices"][i]["index"], i);
  EXPECT_EQ(r.j["choices"][0]["text"], "alpha" + a);
  EXPECT_EQ(r.j["choices"][1]["text"], "alpha" + a);
  EXPECT_EQ(r.j["choices"][2]["text"], "beta" + b);
  EXPECT_EQ(r.j["choices"][3]["text"], "beta" + b);
  EXPECT_EQ(r.j["usage"]["prompt_tokens"], 9);  // 5 + 4 bytes, each prompt once
  // Token-id prompts in a list, and what is not allowed.
  Reply ids = post(s, "/v1/completions", json{{"prompt", {{97, 108}, {98}}}, {"max_tokens", 2}});
  EXPECT_EQ(ids.status, 200) << ids.body;
  EXPECT_EQ(ids.j["choices"].size(), 2u);
  EXPECT_EQ(post(s, "/v1/completions", json{{"prompt", {"a", 5}}}).status, 400);
  EXPECT_EQ(post(s, "/v1/completions", json{{"prompt", {"a", ""}}}).status, 400);
  Reply many = post(s, "/v1/completions", json{{"prompt", std::vector<std::string>(33, "x")}, {"n", 2}});
  EXPECT_EQ(many.status, 400);
  EXPECT_NE(many.j["error"]["message"].get<std::string>().find("66 choices"), std::string::npos);
}

}  // namespace
}  // namespace kiln::server
