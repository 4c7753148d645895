// The listener (src/server/listening_server.cpp): idle streams, garbage, slow-header and slow-body clients, idle
// keep-alive connections and bodiless POSTs never starve real requests or /health; keep-alive and pipelining work
// through the gate; /health is answered while every worker is busy.
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "http_test_server.h"
#include "server/listening_server.h"

namespace kiln::server {
namespace {

using namespace test;

TEST(ListeningServer, ManyIdleStreamsDoNotStarveOtherClients) {
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

TEST(ListeningServer, GarbageAndTruncatedRequestsDoNotHurt) {
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

TEST(ListeningServer, SlowHeaderClientsDoNotStarveRealRequests) {
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

TEST(ListeningServer, PostWithoutBodyLengthAnswersAtOnce) {
  TestServer& s = shared_server();
  double taken = 0;
  std::string out = raw_exchange(s.port(), "POST /health HTTP/1.1\r\nHost: x\r\n\r\n", &taken);
  EXPECT_EQ(out.rfind("HTTP/1.1 411", 0), 0u) << out;
  EXPECT_NE(out.find("Content-Length: 0"), std::string::npos) << out;
  EXPECT_LT(taken, 2.0);
}

TEST(ListeningServer, SlowBodyClientsDoNotStarveRealRequests) {
  TestServer s;  // 96 HTTP workers
  std::vector<int> fds;
  for (int i = 0; i < 250; ++i) {  // headers, then a few bytes of a 1000-byte body, then nothing
    int fd = connect_to(s.port());
    ASSERT_GE(fd, 0);
    std::string head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mess";
    send(fd, head.data(), head.size(), MSG_NOSIGNAL);
    fds.push_back(fd);
  }
  std::this_thread::sleep_for(300ms);
  for (int i = 0; i < 3; ++i) {
    auto start = std::chrono::steady_clock::now();
    Reply r = post(s, "/v1/chat/completions", chat_body("r</think>ok"));
    EXPECT_EQ(r.status, 200);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "a real request waited behind slow uploads";
    EXPECT_EQ(get(s, "/health").status, 200);
  }
  for (int fd : fds) close(fd);
}

TEST(ListeningServer, IdleKeepAliveConnectionsHoldNoWorker) {
  TestServer s;  // 96 HTTP workers, keep-alive timeout 5 s
  std::vector<int> fds;
  for (int i = 0; i < 300; ++i) {  // one request each, answered, then the connection stays open and silent
    int fd = connect_to(s.port());
    ASSERT_GE(fd, 0);
    const std::string req = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    fds.push_back(fd);
  }
  char buf[4096];
  for (int fd : fds) {  // every one answered: none waits for a worker held by another's keep-alive
    timeval tv{3, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ssize_t n = recv(fd, buf, sizeof(buf) - 1, 0);
    ASSERT_GT(n, 0);
    buf[n] = 0;
    EXPECT_EQ(std::string(buf).rfind("HTTP/1.1 200 OK", 0), 0u);
  }
  auto start = std::chrono::steady_clock::now();
  Reply r = post(s, "/v1/chat/completions", chat_body("r</think>ok"));
  EXPECT_EQ(r.status, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s) << "a request waited behind idle keep-alive connections";
  for (int fd : fds) close(fd);
}

TEST(ListeningServer, PipelinedRequestsOnOneConnectionAreAnsweredInOrder) {
  TestServer& s = shared_server();
  const std::string body = chat_body("p</think>first").dump();
  std::string two = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body +
                    "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  int fd = connect_to(s.port());
  ASSERT_GE(fd, 0);
  send(fd, two.data(), two.size(), MSG_NOSIGNAL);
  timeval tv{3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t first = out.find("HTTP/1.1 200 OK");
  const size_t second = out.find("HTTP/1.1 200 OK", first + 1);
  ASSERT_NE(second, std::string::npos) << out;
  EXPECT_NE(out.substr(0, second).find("\"first\""), std::string::npos) << out;
  EXPECT_NE(out.substr(second).find("Connection: close"), std::string::npos) << out;
}

// A bare ListeningServer with two workers and a route that blocks until released.
struct BlockingServer {
  ListeningServer svr;
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  int port = 0;
  std::thread thread;
  explicit BlockingServer(ServerOptions o) {
    o.http_threads = 2;
    svr.configure(o);
    svr.Get("/block", [this](const httplib::Request&, httplib::Response& res) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, 10s, [&] { return release; });
      res.set_content("done", "text/plain");
    });
    svr.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("", "text/plain"); });
    port = svr.bind_to_any_port("127.0.0.1");
    thread = std::thread([this] { svr.listen_after_bind(); });
  }
  ~BlockingServer() {
    {
      std::lock_guard<std::mutex> lock(mu);
      release = true;
    }
    cv.notify_all();
    svr.stop();
    thread.join();
    svr.stop_gate();
  }
};

TEST(ListeningServer, HealthIsAnsweredWhileEveryWorkerIsBusy) {
  BlockingServer b(ServerOptions{});
  std::vector<std::thread> blocked;
  for (int i = 0; i < 4; ++i)  // two hold both workers, two wait in their queue
    blocked.emplace_back([&] { raw_exchange(b.port, "GET /block HTTP/1.1\r\nHost: x\r\n\r\n"); });
  std::this_thread::sleep_for(300ms);
  double taken = 0;
  const std::string out = raw_exchange(b.port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &taken);
  EXPECT_EQ(out.rfind("HTTP/1.1 200 OK", 0), 0u) << out;
  EXPECT_LT(taken, 1.0);
  {
    std::lock_guard<std::mutex> lock(b.mu);
    b.release = true;
  }
  b.cv.notify_all();
  for (auto& t : blocked) t.join();
}

TEST(ListeningServer, ConnectionsBeyondThePerClientLimitAre429) {
  ServerOptions o;
  o.max_connections_per_client = 3;
  BlockingServer b(o);
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) fds.push_back(connect_to(b.port));
  std::this_thread::sleep_for(100ms);
  const std::string out = raw_exchange(b.port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(out.rfind("HTTP/1.1 429 Too Many Requests", 0), 0u) << out;
  EXPECT_NE(out.find("127.0.0.1"), std::string::npos) << out;
  close(fds[0]);
  std::this_thread::sleep_for(100ms);  // the gate notices the close
  const std::string again = raw_exchange(b.port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(again.rfind("HTTP/1.1 200 OK", 0), 0u) << again;
  for (size_t i = 1; i < fds.size(); ++i) close(fds[i]);
}

}  // namespace
}  // namespace kiln::server
