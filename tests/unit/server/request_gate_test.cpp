// RequestGate (src/server/request_gate.cpp) over socket pairs: a connection goes on only once its whole request
// (headers and body) has arrived; slow headers, slow bodies and too-slow uploads are answered 408; the connection
// limits answer 503 / 429 or make room; a kept-alive connection comes back and waits without a worker.
#include "server/request_gate.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kiln::server {
namespace {

using namespace std::chrono_literals;

// The connections the gate handed on, in order.
struct Handed {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<GateConnection>> conns;
  void add(std::unique_ptr<GateConnection> c) {
    std::lock_guard<std::mutex> lock(mu);
    conns.push_back(std::move(c));
    cv.notify_all();
  }
  bool wait_for(size_t n, std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return conns.size() >= n; });
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return conns.size();
  }
  std::unique_ptr<GateConnection> take(size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    return std::move(conns.at(i));
  }
  ~Handed() {
    for (auto& c : conns)
      if (c) close(c->fd);
  }
};

// (client end, server end) of a connected stream socket pair.
std::pair<int, int> connection() {
  int sv[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  return {sv[0], sv[1]};
}

void send_text(int fd, const std::string& s) { ASSERT_EQ(send(fd, s.data(), s.size(), MSG_NOSIGNAL), ssize_t(s.size())); }

// Everything the gate wrote to the client until it closed (or `limit` passed).
std::string read_all(int fd, int limit_s = 3) {
  timeval tv{limit_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buf[1024];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  return out;
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

struct GateUnderTest {
  Handed handed;
  RequestGate gate;
  explicit GateUnderTest(RequestGateOptions o = {})
      : gate(o, [this](std::unique_ptr<GateConnection> c) { handed.add(std::move(c)); }) {}
};

TEST(RequestGate, TheWholeRequestIsHandedOnWithItsBytesAndNothingEarlier) {
  GateUnderTest t;
  auto [client, server] = connection();
  t.gate.admit(server);
  const std::string head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n";
  send_text(client, head + "01234");
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(t.handed.size(), 0u) << "handed on before the body arrived";
  const std::string next = "GET /health HTTP/1.1\r\n";  // a pipelined next request, not yet whole
  send_text(client, "56789" + next);
  ASSERT_TRUE(t.handed.wait_for(1, 2s));
  auto c = t.handed.take(0);
  EXPECT_EQ(c->fd, server);
  EXPECT_EQ(c->request_bytes, head.size() + 10);
  EXPECT_EQ(c->bytes, head + "0123456789" + next);
  EXPECT_FALSE(c->priority);
  EXPECT_EQ(t.gate.open_connections(), 1);
  EXPECT_EQ(t.gate.buffered_bytes(), c->bytes.size());
  // Answered and kept alive: back in the gate, the rest of the next request makes it whole.
  t.gate.resume(std::move(c));
  send_text(client, "\r\n");
  ASSERT_TRUE(t.handed.wait_for(2, 2s));
  auto again = t.handed.take(1);
  EXPECT_EQ(again->bytes, next + "\r\n");
  EXPECT_TRUE(again->priority) << "GET /health goes to the health workers";
  EXPECT_EQ(again->served, 1);
  t.gate.close(std::move(again));
  EXPECT_EQ(t.gate.open_connections(), 0);
  EXPECT_EQ(t.gate.buffered_bytes(), 0u);
  close(client);
}

TEST(RequestGate, SilentConnectionIsAnswered408AtTheHeaderDeadline) {
  RequestGateOptions o;
  o.header_timeout_ms = 200;
  GateUnderTest t(o);
  auto [client, server] = connection();
  const auto start = std::chrono::steady_clock::now();
  t.gate.admit(server);
  send_text(client, "POST /v1/chat/completions HTTP/1.1\r\n");  // and nothing more
  const std::string answer = read_all(client);
  EXPECT_EQ(answer.rfind("HTTP/1.1 408 Request Timeout\r\n", 0), 0u) << answer;
  EXPECT_NE(answer.find("headers did not arrive within 200 ms"), std::string::npos) << answer;
  EXPECT_GE(ms_since(start), 190.0);
  EXPECT_LT(ms_since(start), 2000.0);
  EXPECT_EQ(t.handed.size(), 0u);
  EXPECT_EQ(t.gate.open_connections(), 0);
  close(client);
}

TEST(RequestGate, ABodyTricklingPastTheRequestDeadlineIs408) {
  RequestGateOptions o;
  o.request_timeout_ms = 500;
  o.min_upload_rate_bytes_s = 0;
  GateUnderTest t(o);
  auto [client, server] = connection();
  const auto start = std::chrono::steady_clock::now();
  t.gate.admit(server);
  send_text(client, "POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n");
  std::thread trickle([fd = client] {  // one byte every 50 ms, until the gate closes
    for (int i = 0; i < 40; ++i) {
      if (send(fd, "x", 1, MSG_NOSIGNAL) != 1) return;
      std::this_thread::sleep_for(50ms);
    }
  });
  const std::string answer = read_all(client);
  trickle.join();
  EXPECT_EQ(answer.rfind("HTTP/1.1 408", 0), 0u) << answer;
  EXPECT_NE(answer.find("(headers and body) did not arrive within 500 ms"), std::string::npos) << answer;
  EXPECT_GE(ms_since(start), 490.0);
  EXPECT_EQ(t.handed.size(), 0u);
  close(client);
}

TEST(RequestGate, AnUploadBelowTheMinimumRateIs408AfterTheGrace) {
  RequestGateOptions o;
  o.rate_grace_ms = 200;
  o.min_upload_rate_bytes_s = 1000;  // the 60 header bytes cover 60 ms past the grace
  GateUnderTest t(o);
  auto [client, server] = connection();
  const auto start = std::chrono::steady_clock::now();
  t.gate.admit(server);
  send_text(client, "POST /v1/completions HTTP/1.1\r\nContent-Length: 1000\r\n\r\nabc");
  const std::string answer = read_all(client);
  const double waited = ms_since(start);
  EXPECT_EQ(answer.rfind("HTTP/1.1 408", 0), 0u) << answer;
  EXPECT_NE(answer.find("below the minimum of 1000 bytes/s"), std::string::npos) << answer;
  EXPECT_GE(waited, 250.0);  // grace + what the bytes sent pay for
  EXPECT_LT(waited, 1500.0);
  close(client);
}

TEST(RequestGate, BodyWithoutLengthIs411AndTooLargeIs413) {
  RequestGateOptions o;
  o.max_body_bytes = 1000;
  GateUnderTest t(o);
  auto [c1, s1] = connection();
  t.gate.admit(s1);
  send_text(c1, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string answer = read_all(c1);
  EXPECT_EQ(answer.rfind("HTTP/1.1 411 Length Required\r\n", 0), 0u) << answer;
  EXPECT_NE(answer.find("POST /v1/completions"), std::string::npos) << answer;
  auto [c2, s2] = connection();
  t.gate.admit(s2);
  send_text(c2, "POST /v1/completions HTTP/1.1\r\nContent-Length: 1001\r\n\r\n");
  answer = read_all(c2);
  EXPECT_EQ(answer.rfind("HTTP/1.1 413", 0), 0u) << answer;
  EXPECT_NE(answer.find("limit of 1000 bytes"), std::string::npos) << answer;
  EXPECT_EQ(t.handed.size(), 0u);
  close(c1);
  close(c2);
}

// A gate answer to a request whose headers arrived carries what the routes would add: CORS for an allowed Origin and
// the client's X-Request-Id (sanitised); an origin not allowed gets no CORS headers.
TEST(RequestGate, AnswersCarryCorsAndTheRequestId) {
  RequestGateOptions o;
  o.max_body_bytes = 1000;
  o.allowed_origins = {"https://app.example"};
  GateUnderTest t(o);
  auto [c1, s1] = connection();
  t.gate.admit(s1);
  send_text(c1, "POST /v1/completions HTTP/1.1\r\norigin: https://app.example\r\nX-REQUEST-ID: ab c/1<>\r\n"
                "Content-Length: 1001\r\n\r\n");
  std::string answer = read_all(c1);
  EXPECT_EQ(answer.rfind("HTTP/1.1 413", 0), 0u) << answer;
  EXPECT_NE(answer.find("\r\nAccess-Control-Allow-Origin: https://app.example\r\n"), std::string::npos) << answer;
  EXPECT_NE(answer.find("\r\nVary: Origin\r\n"), std::string::npos) << answer;
  EXPECT_NE(answer.find("\r\nX-Request-Id: abc/1\r\n"), std::string::npos) << answer;
  auto [c2, s2] = connection();
  t.gate.admit(s2);
  send_text(c2, "POST /v1/completions HTTP/1.1\r\nOrigin: https://evil.example\r\n\r\n");
  answer = read_all(c2);
  EXPECT_EQ(answer.rfind("HTTP/1.1 411", 0), 0u) << answer;
  EXPECT_EQ(answer.find("Access-Control"), std::string::npos) << answer;
  EXPECT_EQ(answer.find("X-Request-Id"), std::string::npos) << answer;
  close(c1);
  close(c2);
}

TEST(RequestGate, ChunkedBodyGoesOnOnceItsLastChunkArrives) {
  GateUnderTest t;
  auto [client, server] = connection();
  t.gate.admit(server);
  send_text(client, "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\n");
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(t.handed.size(), 0u);
  send_text(client, "0\r\n\r\n");
  ASSERT_TRUE(t.handed.wait_for(1, 2s));
  close(client);
}

TEST(RequestGate, ExpectContinueIsAnsweredAndDroppedFromTheRequest) {
  GateUnderTest t;
  auto [client, server] = connection();
  t.gate.admit(server);
  send_text(client, "POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n");
  char buf[64];
  timeval tv{2, 0};
  setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ssize_t n = recv(client, buf, sizeof(buf), 0);
  ASSERT_GT(n, 0);
  EXPECT_EQ(std::string(buf, static_cast<size_t>(n)), "HTTP/1.1 100 Continue\r\n\r\n");
  send_text(client, "ok");
  ASSERT_TRUE(t.handed.wait_for(1, 2s));
  auto c = t.handed.take(0);
  EXPECT_EQ(c->bytes, "POST /x HTTP/1.1\r\nContent-Length: 2\r\n\r\nok");
  EXPECT_EQ(c->request_bytes, c->bytes.size());
  t.gate.close(std::move(c));
  close(client);
}

TEST(RequestGate, AtTheConnectionLimitTheLongestWaitingMakesRoomElse503) {
  RequestGateOptions o;
  o.max_connections = 2;
  GateUnderTest t(o);
  std::vector<std::pair<int, int>> conns;
  for (int i = 0; i < 3; ++i) {
    conns.push_back(connection());
    t.gate.admit(conns.back().second);
    std::this_thread::sleep_for(50ms);  // admitted in this order
  }
  const std::string oldest = read_all(conns[0].first);
  EXPECT_EQ(oldest.rfind("HTTP/1.1 408", 0), 0u) << oldest;
  EXPECT_NE(oldest.find("connection limit"), std::string::npos) << oldest;
  // The two younger ones send their requests and go to workers: nothing waits, so a fourth is refused.
  send_text(conns[1].first, "GET / HTTP/1.1\r\n\r\n");
  send_text(conns[2].first, "GET / HTTP/1.1\r\n\r\n");
  ASSERT_TRUE(t.handed.wait_for(2, 2s));
  auto [c4, s4] = connection();
  t.gate.admit(s4);
  const std::string refused = read_all(c4);
  EXPECT_EQ(refused.rfind("HTTP/1.1 503 Service Unavailable\r\n", 0), 0u) << refused;
  EXPECT_NE(refused.find("Retry-After: 1\r\n"), std::string::npos) << refused;
  EXPECT_NE(refused.find("2 connections open"), std::string::npos) << refused;
  // One ends: room again.
  t.gate.close(t.handed.take(0));
  auto [c5, s5] = connection();
  t.gate.admit(s5);
  send_text(c5, "GET / HTTP/1.1\r\n\r\n");
  EXPECT_TRUE(t.handed.wait_for(3, 2s));
  for (auto& c : conns) close(c.first);
  close(c4);
  close(c5);
}

TEST(RequestGate, BeyondThePerClientLimitANewConnectionIs429) {
  RequestGateOptions o;
  o.max_connections_per_client = 2;  // socket pairs all have the same (empty) address
  GateUnderTest t(o);
  auto [c1, s1] = connection();
  auto [c2, s2] = connection();
  auto [c3, s3] = connection();
  t.gate.admit(s1);
  t.gate.admit(s2);
  t.gate.admit(s3);
  const std::string refused = read_all(c3);
  EXPECT_EQ(refused.rfind("HTTP/1.1 429 Too Many Requests\r\n", 0), 0u) << refused;
  EXPECT_NE(refused.find("Retry-After: 1\r\n"), std::string::npos) << refused;
  EXPECT_NE(refused.find("the limit is 2 per client address"), std::string::npos) << refused;
  EXPECT_EQ(t.gate.open_connections(), 2);
  close(c1);
  close(c2);
  close(c3);
}

TEST(RequestGate, AnIdleKeptAliveConnectionIsClosedSilentlyAfterTheKeepAliveTimeout) {
  RequestGateOptions o;
  o.keep_alive_timeout_ms = 300;
  o.header_timeout_ms = 100;  // does not apply to an idle connection
  GateUnderTest t(o);
  auto [client, server] = connection();
  t.gate.admit(server);
  send_text(client, "GET / HTTP/1.1\r\n\r\n");
  ASSERT_TRUE(t.handed.wait_for(1, 2s));
  const auto start = std::chrono::steady_clock::now();
  t.gate.resume(t.handed.take(0));
  EXPECT_EQ(read_all(client), "");
  EXPECT_GE(ms_since(start), 290.0);
  EXPECT_EQ(t.gate.open_connections(), 0);
  close(client);
}

TEST(RequestGate, StopClosesHeldConnections) {
  Handed handed;
  auto gate = std::make_unique<RequestGate>(RequestGateOptions{},
                                            [&](std::unique_ptr<GateConnection> c) { handed.add(std::move(c)); });
  auto [client, server] = connection();
  gate->admit(server);
  std::this_thread::sleep_for(50ms);
  gate->stop();
  gate->stop();  // idempotent
  EXPECT_EQ(read_all(client), "");  // closed without an answer
  EXPECT_EQ(handed.size(), 0u);
  close(client);
}

}  // namespace
}  // namespace kiln::server
