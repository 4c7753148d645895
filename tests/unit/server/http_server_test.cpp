// The server core (src/server/http_server.cpp): the body limit, the API key, 405 for a wrong method, the
// rejected-request log line, CORS, the client's X-Request-Id.
#include <gtest/gtest.h>
#include <fcntl.h>

#include <functional>

#include "core/log.h"

#include "http_test_server.h"

namespace kiln::server {
namespace {

using namespace test;

TEST(HttpServer, BodyOverTheLimitIs413) {
  ServerConfig cfg;
  cfg.max_request_bytes = 4096;
  TestServer s(cfg);
  Reply r = post(s, "/v1/chat/completions", chat_body(std::string(10000, 'x')));
  EXPECT_EQ(r.status, 413);
  EXPECT_TRUE(r.j["error"]["message"].is_string()) << r.body;
  EXPECT_EQ(post(s, "/v1/chat/completions", chat_body("ok")).status, 200);
}

TEST(HttpServer, ApiKey) {
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

TEST(HttpServer, WrongMethodIs405) {
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

TEST(HttpServer, RejectedRequestsAreLogged) {
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


std::string header_of(const Reply& r, const std::string& name) {
  auto it = r.headers.find(name);
  return it == r.headers.end() ? "" : it->second;
}

// Runs `fn` with stderr (the log) caught in a file until `until` shows up in it (up to 5 s); returns the log.
std::string capture_log(const std::function<void()>& fn, const std::string& until) {
  std::string path = std::string(KILN_BINARY_DIR) + "/http_server_test_log.txt";
  fflush(stderr);
  int saved = dup(2);
  int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  dup2(fd, 2);
  LogLevel level = log_level();
  set_log_level(LogLevel::info);
  fn();
  for (int i = 0; i < 500; ++i) {
    fflush(stderr);
    if (read_file(path).find(until) != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  set_log_level(level);
  fflush(stderr);
  dup2(saved, 2);
  close(fd);
  close(saved);
  return read_file(path);
}

// httplib compresses an answer for a client that sends Accept-Encoding before its logger runs: the rejection line is
// written before that, so it keeps its reason.
TEST(HttpServer, RejectedRequestLogKeepsItsReasonWithAcceptEncoding) {
  TestServer& s = shared_server();
  Reply r;
  std::string log = capture_log(
      [&] {
        r = post(s, "/v1/chat/completions", chat_body("hi", {{"temperature", 9}}).dump(),
                 {{"Accept-Encoding", "gzip, deflate, br"}});
      },
      "status=400");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.j["error"]["param"], "temperature") << r.body;  // the client decompressed a whole error
  EXPECT_NE(log.find("status=400 error=\"'temperature' must be"), std::string::npos) << log;
}

TEST(HttpServer, BearerSchemeInAnyCase) {
  ServerConfig cfg;
  cfg.api_key = "sekret";
  TestServer s(cfg);
  for (const char* auth : {"Bearer sekret", "bearer sekret", "BEARER sekret", "Bearer  sekret"})
    EXPECT_EQ(get(s, "/v1/models", {{"Authorization", auth}}).status, 200) << auth;
  for (const char* auth : {"Bearersekret", "Basic sekret", "bearer sekret2", "bearer"})
    EXPECT_EQ(get(s, "/v1/models", {{"Authorization", auth}}).status, 401) << auth;
}

// Without --allowed-origins: no CORS headers, and OPTIONS is a method the routes do not take (405 with Allow).
TEST(HttpServer, NoCorsByDefault) {
  TestServer& s = shared_server();
  auto c = s.client();
  auto pre = c.Options("/v1/chat/completions",
                       {{"Origin", "https://app.example"}, {"Access-Control-Request-Method", "POST"}});
  ASSERT_TRUE(pre);
  EXPECT_EQ(pre->status, 405);
  EXPECT_EQ(pre->get_header_value("Allow"), "POST");
  EXPECT_FALSE(pre->has_header("Access-Control-Allow-Origin"));
  Reply r = get(s, "/v1/models", {{"Origin", "https://app.example"}});
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.headers.count("Access-Control-Allow-Origin"), 0u);
}

TEST(HttpServer, CorsForAllowedOrigins) {
  ServerConfig cfg;
  cfg.api_key = "sekret";  // a preflight carries no credentials: answered before the key check
  cfg.allowed_origins = {"https://app.example", "http://localhost:5173"};
  TestServer s(cfg);
  auto c = s.client();
  auto pre = c.Options("/v1/chat/completions", {{"Origin", "https://app.example"},
                                                {"Access-Control-Request-Method", "POST"},
                                                {"Access-Control-Request-Headers", "authorization, content-type"}});
  ASSERT_TRUE(pre);
  EXPECT_EQ(pre->status, 204);
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Origin"), "https://app.example");
  EXPECT_EQ(pre->get_header_value("Vary"), "Origin");
  EXPECT_NE(pre->get_header_value("Access-Control-Allow-Methods").find("POST"), std::string::npos);
  EXPECT_EQ(pre->get_header_value("Access-Control-Allow-Headers"), "authorization, content-type");
  // The request itself: the header on the answer (errors too), none for another origin.
  Reply ok = post(s, "/v1/chat/completions", chat_body("hi").dump(),
                  {{"Origin", "http://localhost:5173"}, {"Authorization", "Bearer sekret"}});
  EXPECT_EQ(ok.status, 200);
  EXPECT_EQ(header_of(ok, "Access-Control-Allow-Origin"), "http://localhost:5173");
  Reply denied = get(s, "/v1/models", {{"Origin", "https://app.example"}});
  EXPECT_EQ(denied.status, 401);
  EXPECT_EQ(header_of(denied, "Access-Control-Allow-Origin"), "https://app.example");
  Reply other = get(s, "/v1/models", {{"Origin", "https://evil.example"}, {"Authorization", "Bearer sekret"}});
  EXPECT_EQ(other.status, 200);
  EXPECT_EQ(other.headers.count("Access-Control-Allow-Origin"), 0u);
  auto other_pre = c.Options("/v1/models", {{"Origin", "https://evil.example"}, {"Access-Control-Request-Method", "GET"}});
  ASSERT_TRUE(other_pre);
  EXPECT_NE(other_pre->status, 204);
  EXPECT_FALSE(other_pre->has_header("Access-Control-Allow-Origin"));
}

TEST(HttpServer, CorsAnyOrigin) {
  ServerConfig cfg;
  cfg.allowed_origins = {"*"};
  TestServer s(cfg);
  Reply r = get(s, "/v1/models", {{"Origin", "https://anything.example"}});
  EXPECT_EQ(header_of(r, "Access-Control-Allow-Origin"), "*");
}

TEST(HttpServer, ClientRequestIdIsKept) {
  TestServer& s = shared_server();
  // A generation: echoed, and its log line carries it (the response body keeps its own id).
  Reply r;
  std::string log = capture_log(
      [&] { r = post(s, "/v1/chat/completions", chat_body("hi").dump(), {{"X-Request-Id", "trace-42.a"}}); },
      "request id=trace-42.a");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(header_of(r, "X-Request-Id"), "trace-42.a");
  EXPECT_EQ(r.j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_NE(log.find("request id=trace-42.a endpoint=/v1/chat/completions"), std::string::npos) << log;
  EXPECT_NE(log.find("response_id=" + r.j["id"].get<std::string>()), std::string::npos) << log;
  // A rejected request: echoed and logged; another route: echoed.
  Reply bad;
  log = capture_log(
      [&] {
        bad = post(s, "/v1/chat/completions", chat_body("hi", {{"n", 0}}).dump(), {{"X-Request-Id", "trace-43"}});
      },
      "request_id=trace-43");
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(header_of(bad, "X-Request-Id"), "trace-43");
  EXPECT_NE(log.find("status=400"), std::string::npos) << log;
  EXPECT_EQ(header_of(get(s, "/v1/models", {{"X-Request-Id", "m-1"}}), "X-Request-Id"), "m-1");
  // Sanitised: characters outside [A-Za-z0-9._:/+=-] dropped, at most 128 kept; none without one.
  EXPECT_EQ(header_of(get(s, "/v1/models", {{"X-Request-Id", "a b<script>\"c"}}), "X-Request-Id"), "abscriptc");
  EXPECT_EQ(header_of(get(s, "/v1/models", {{"X-Request-Id", std::string(300, 'x')}}), "X-Request-Id"),
            std::string(128, 'x'));
  EXPECT_EQ(header_of(get(s, "/v1/models"), "X-Request-Id"), "");
  // Without one, a generation answers its own id as before.
  Reply plain = post(s, "/v1/chat/completions", chat_body("hi"));
  EXPECT_EQ(header_of(plain, "X-Request-Id"), plain.j["id"].get<std::string>());
}

}  // namespace
}  // namespace kiln::server
