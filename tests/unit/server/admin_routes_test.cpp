// The operational routes (src/server/admin_routes.cpp) on an in-process server: health, model and server info,
// tokenize / detokenize, /metrics, draining and /health_generate under load.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "http_test_server.h"

namespace kiln::server {
namespace {

using namespace test;

TEST(AdminRoutes, HealthModelsInfo) {
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

TEST(AdminRoutes, TokenizeDetokenize) {
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

TEST(AdminRoutes, MetricsText) {
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

TEST(AdminRoutes, DrainingAnswers503) {
  TestServer s;
  s.http().set_draining();
  EXPECT_EQ(get(s, "/health").status, 503);
  Reply r = post(s, "/v1/chat/completions", chat_body("hi"));
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.headers.count("Retry-After"), 1u);
}

TEST(AdminRoutes, HealthGenerateAnswersWhileBusy) {
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


TEST(AdminRoutes, Version) {
  TestServer& s = shared_server();
  Reply r = get(s, "/version");
  ASSERT_EQ(r.status, 200);
  // The project's version, as CMakeLists.txt's project() declares it.
  const std::string cmake = read_file(std::string(KILN_SOURCE_DIR) + "/CMakeLists.txt");
  const size_t at = cmake.find("project(kiln VERSION ");
  ASSERT_NE(at, std::string::npos);
  const std::string version = cmake.substr(at + 21, cmake.find(' ', at + 21) - at - 21);
  EXPECT_EQ(r.j["version"], version);
}

// /flush_cache empties the prefix cache: the same prompt is served from it again, but not right after a flush.
TEST(AdminRoutes, FlushCacheEmptiesThePrefixCache) {
  TestServer s;
  json body = chat_body(std::string(200, 'a'), {{"max_tokens", 2}});
  auto cached = [&] {
    Reply r = post(s, "/v1/chat/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
    return r.j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
  };
  cached();
  EXPECT_GT(cached(), 0);
  Reply f = post(s, "/flush_cache", std::string());
  EXPECT_EQ(f.status, 200) << f.body;
  EXPECT_EQ(cached(), 0);
  EXPECT_GT(cached(), 0);
  EXPECT_EQ(get(s, "/flush_cache").status, 200);  // SGLang takes GET too
}

// While requests run, their pages may be in the cache: the flush is refused (400), as SGLang does.
TEST(AdminRoutes, FlushCacheRefusedWhileBusy) {
  ServerConfig cfg;
  cfg.step_delay_us = 2000;
  TestServer s(cfg);
  std::thread t([&] { post(s, "/v1/chat/completions", chat_body("x", {{"max_tokens", 1500}, {"ignore_eos", true}})); });
  for (int i = 0; i < 200 && metric(s, "kiln:num_running_reqs") < 1; ++i) std::this_thread::sleep_for(10ms);
  Reply f = post(s, "/flush_cache", std::string());
  EXPECT_EQ(f.status, 400) << f.body;
  EXPECT_NE(f.j["error"]["message"].get<std::string>().find("running"), std::string::npos);
  s.engine().drain(std::chrono::milliseconds(0));
  t.join();
}

}  // namespace
}  // namespace kiln::server
