// HeaderGate (src/server/header_gate.cpp) over socket pairs: a connection goes on only once its request headers
// are complete; a silent one is answered 408 at the deadline; a body without a length is 411; beyond the waiting
// limit the oldest waiting connection is closed.
#include "server/header_gate.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kiln::server {
namespace {

using namespace std::chrono_literals;

// The fds the gate handed on, in order.
struct Handed {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> fds;
  void add(int fd) {
    std::lock_guard<std::mutex> lock(mu);
    fds.push_back(fd);
    cv.notify_all();
  }
  bool wait_for(size_t n, std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return fds.size() >= n; });
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return fds.size();
  }
  ~Handed() {
    for (int fd : fds) close(fd);
  }
};

// (client end, server end) of a connected stream socket pair.
std::pair<int, int> connection() {
  int sv[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  return {sv[0], sv[1]};
}

void send_text(int fd, const std::string& s) { ASSERT_EQ(send(fd, s.data(), s.size(), MSG_NOSIGNAL), ssize_t(s.size())); }

// Everything the gate wrote to the client until it closed (or 3 s passed).
std::string read_all(int fd) {
  timeval tv{3, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  char buf[1024];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
  return out;
}

TEST(HeaderGate, CompleteHeadersAreHandedOnWithTheirBytesUnread) {
  Handed handed;
  HeaderGate gate({}, [&](int fd) { handed.add(fd); });
  auto [client, server] = connection();
  gate.admit(server);
  send_text(client, "GET /health HTTP/1.1\r\nHost: x\r\n");
  std::this_thread::sleep_for(150ms);
  EXPECT_EQ(handed.size(), 0u) << "handed on before the headers ended";
  send_text(client, "\r\n");
  ASSERT_TRUE(handed.wait_for(1, 2s));
  EXPECT_EQ(handed.fds[0], server);
  // The gate only peeked: the worker reads the whole request.
  char buf[64];
  ssize_t n = recv(server, buf, sizeof(buf), MSG_DONTWAIT);
  ASSERT_GT(n, 0);
  EXPECT_EQ(std::string(buf, static_cast<size_t>(n)).rfind("GET /health HTTP/1.1\r\n", 0), 0u);
  close(client);
  gate.stop();
}

TEST(HeaderGate, SilentConnectionIsAnswered408AtTheDeadline) {
  Handed handed;
  HeaderGateOptions o;
  o.timeout_ms = 200;
  HeaderGate gate(o, [&](int fd) { handed.add(fd); });
  auto [client, server] = connection();
  const auto start = std::chrono::steady_clock::now();
  gate.admit(server);
  send_text(client, "POST /v1/chat/completions HTTP/1.1\r\n");  // and nothing more
  const std::string answer = read_all(client);
  const double waited_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(answer.rfind("HTTP/1.1 408 Request Timeout\r\n", 0), 0u) << answer;
  EXPECT_NE(answer.find("within 200 ms"), std::string::npos) << answer;
  EXPECT_GE(waited_ms, 190.0);
  EXPECT_LT(waited_ms, 2000.0);
  EXPECT_EQ(handed.size(), 0u);
  close(client);
}

TEST(HeaderGate, BodyWithoutLengthIs411AndChunkedGoesOn) {
  Handed handed;
  HeaderGate gate({}, [&](int fd) { handed.add(fd); });
  auto [c1, s1] = connection();
  gate.admit(s1);
  send_text(c1, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string answer = read_all(c1);
  EXPECT_EQ(answer.rfind("HTTP/1.1 411 Length Required\r\n", 0), 0u) << answer;
  EXPECT_NE(answer.find("POST /v1/completions"), std::string::npos) << answer;
  auto [c2, s2] = connection();
  gate.admit(s2);
  send_text(c2, "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
  ASSERT_TRUE(handed.wait_for(1, 2s));
  EXPECT_EQ(handed.fds[0], s2);
  close(c1);
  close(c2);
  gate.stop();
}

TEST(HeaderGate, BeyondTheLimitTheOldestWaitingConnectionIsClosed) {
  Handed handed;
  HeaderGateOptions o;
  o.max_waiting = 2;
  HeaderGate gate(o, [&](int fd) { handed.add(fd); });
  std::vector<std::pair<int, int>> conns;
  for (int i = 0; i < 3; ++i) {
    conns.push_back(connection());
    gate.admit(conns.back().second);
    std::this_thread::sleep_for(50ms);  // admitted in this order
  }
  const std::string oldest = read_all(conns[0].first);
  EXPECT_EQ(oldest.rfind("HTTP/1.1 408", 0), 0u) << oldest;
  EXPECT_NE(oldest.find("waited longest"), std::string::npos) << oldest;
  // The two younger ones still wait: their headers complete and they are handed on.
  send_text(conns[1].first, "GET / HTTP/1.1\r\n\r\n");
  send_text(conns[2].first, "GET / HTTP/1.1\r\n\r\n");
  ASSERT_TRUE(handed.wait_for(2, 2s));
  for (auto& c : conns) close(c.first);
  gate.stop();
}

TEST(HeaderGate, StopClosesWaitingConnections) {
  Handed handed;
  auto gate = std::make_unique<HeaderGate>(HeaderGateOptions{}, [&](int fd) { handed.add(fd); });
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
