// The server core (src/server/http_server.cpp): the body limit, the API key, 405 for a wrong method, the
// rejected-request log line.
#include <gtest/gtest.h>
#include <fcntl.h>

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

}  // namespace
}  // namespace kiln::server
