// The generation driver every generating route shares (src/server/generation.cpp): context checks, the output
// budget, queue-full answers, disconnects that free capacity, concurrent streams.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "http_test_server.h"

namespace kiln::server {
namespace {

using namespace test;

TEST(Generation, MaxTokensDefaultsToTheRestOfTheContext) {
  TestServer& s = shared_server();
  json body = chat_body("hi");
  body["ignore_eos"] = true;
  body["max_tokens"] = 30;
  Reply r = post(s, "/v1/chat/completions", body);
  EXPECT_EQ(r.j["usage"]["completion_tokens"], 30);
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "length");
}

TEST(Generation, TooLongPromptGivesTheCounts) {
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

TEST(Generation, QueueFullIs503WithRetryAfter) {
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

TEST(Generation, DisconnectsFreeCapacity) {
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
  // All five admitted (on a loaded machine the gate and the engine may take more than a moment).
  EXPECT_TRUE(wait_for_value(s, "kiln:num_running_reqs", 5, 3000ms)) << metric(s, "kiln:num_running_reqs");
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

TEST(Generation, ManyConcurrentStreamsMatchAlone) {
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


// A shutdown whose timeout runs out aborts what still runs: a stream ends with an error event (503 shutting_down)
// and no [DONE]; a non-streamed request gets that error as its answer, not a 200 cut short.
TEST(Generation, ShutdownTimeoutEndsStreamsWithAnError) {
  ServerConfig cfg;
  cfg.step_delay_us = 3000;
  TestServer s(cfg);
  json long_gen = chat_body("x", {{"max_tokens", 1500}, {"ignore_eos", true}});
  Reply streamed, whole;
  std::thread a([&] {
    json b = long_gen;
    b["stream"] = true;
    streamed = post(s, "/v1/chat/completions", b);
  });
  std::thread w([&] { whole = post(s, "/v1/chat/completions", long_gen); });
  for (int i = 0; i < 200 && metric(s, "kiln:num_running_reqs") < 2; ++i) std::this_thread::sleep_for(10ms);
  s.http().set_draining();
  EXPECT_FALSE(s.engine().drain(std::chrono::milliseconds(50)));  // times out: the rest is aborted
  a.join();
  w.join();
  EXPECT_EQ(streamed.status, 200);  // the stream had begun
  bool done = true;
  std::vector<json> events = sse_events(streamed.body, &done);
  EXPECT_FALSE(done) << "a stream the shutdown cut short ended with [DONE]";
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["error"]["code"], "shutting_down") << events.back();
  for (const auto& ev : events)
    if (ev.contains("choices"))
      for (const auto& ch : ev["choices"]) EXPECT_NE(ch["finish_reason"], "abort");
  EXPECT_EQ(whole.status, 503) << whole.body;
  EXPECT_EQ(whole.j["error"]["code"], "shutting_down");
}

}  // namespace
}  // namespace kiln::server
