// The rendezvous of several nodes (backend/rendezvous.h) on localhost, each node a thread.
#include "backend/rendezvous.h"


#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>
#include <string>
#include <thread>

#include "core/error.h"
#include "net_util.h"

namespace kiln::backend {
namespace {

using namespace std::chrono_literals;
using ::testing::AllOf;
using ::testing::HasSubstr;

using kiln::testing::free_port;

std::vector<uint8_t> unique_id() {
  std::vector<uint8_t> id(128);
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(i * 7 + 3);
  return id;
}

// Runs one node on its own thread; the future holds its result or its error.
std::future<std::vector<uint8_t>> start_node(const std::string& addr, int rank, RendezvousHeader header,
                                             std::chrono::milliseconds timeout, std::vector<uint8_t> blob = {}) {
  return std::async(std::launch::async, [=] {
    RendezvousOptions o;
    o.addr = addr;
    o.node_rank = rank;
    o.timeout = timeout;
    return rendezvous(o, header, blob);
  });
}

std::string error_of(std::future<std::vector<uint8_t>>& f) {
  try {
    f.get();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

const RendezvousHeader kHeader{3, 8, "qwen3_5_moe: 60 layers"};

TEST(Rendezvous, ThreeNodesReceiveNodeZerosBlob) {
  const std::string addr = "127.0.0.1:" + std::to_string(free_port());
  // Nodes 1 and 2 start before node 0: they retry until it listens.
  auto n1 = start_node(addr, 1, kHeader, 20s);
  auto n2 = start_node(addr, 2, kHeader, 20s);
  std::this_thread::sleep_for(300ms);
  auto n0 = start_node(addr, 0, kHeader, 20s, unique_id());
  EXPECT_EQ(n0.get(), unique_id());
  EXPECT_EQ(n1.get(), unique_id());
  EXPECT_EQ(n2.get(), unique_id());
}

TEST(Rendezvous, HostNameWorks) {
  const std::string addr = "localhost:" + std::to_string(free_port());
  RendezvousHeader h{2, 2, "m"};
  auto n0 = start_node(addr, 0, h, 20s, {1, 2, 3});
  auto n1 = start_node(addr, 1, h, 20s);
  EXPECT_EQ(n1.get(), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(n0.get(), (std::vector<uint8_t>{1, 2, 3}));
}

// A connection that is not a kiln node (here an HTTP request) is dropped; the rendezvous goes on.
TEST(Rendezvous, AStrangerIsIgnored) {
  const int port = free_port();
  const std::string addr = "127.0.0.1:" + std::to_string(port);
  RendezvousHeader h{2, 2, "m"};
  auto n0 = start_node(addr, 0, h, 20s, unique_id());
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {  // until node 0 listens
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      ::close(fd);
      fd = -1;
      std::this_thread::sleep_for(20ms);
    }
  }
  ASSERT_GE(fd, 0);
  const char http[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_GT(::write(fd, http, sizeof(http) - 1), 0);
  auto n1 = start_node(addr, 1, h, 20s);
  EXPECT_EQ(n1.get(), unique_id());
  EXPECT_EQ(n0.get(), unique_id());
  ::close(fd);
}

TEST(Rendezvous, SingleNodeNeedsNoAddress) {
  RendezvousOptions o;
  EXPECT_EQ(rendezvous(o, RendezvousHeader{1, 4, "m"}, {9}), (std::vector<uint8_t>{9}));
}

TEST(Rendezvous, MismatchedHeaderFailsOnBothSidesWithBothNumbers) {
  const std::string addr = "127.0.0.1:" + std::to_string(free_port());
  RendezvousHeader h0{2, 8, "model A"};
  RendezvousHeader h1{2, 4, "model A"};
  auto n0 = start_node(addr, 0, h0, 20s, unique_id());
  auto n1 = start_node(addr, 1, h1, 20s);
  const std::string e0 = error_of(n0), e1 = error_of(n1);
  EXPECT_THAT(e0, AllOf(HasSubstr("node 0 has --nnodes 2 --tp-size 8"), HasSubstr("node 1 (127.0.0.1) has --nnodes 2 "
                                                                                  "--tp-size 4")));
  EXPECT_THAT(e1, AllOf(HasSubstr("refused node 1"), HasSubstr("--tp-size 8"), HasSubstr("--tp-size 4")));
}

TEST(Rendezvous, DifferentModelsDisagree) {
  const std::string addr = "127.0.0.1:" + std::to_string(free_port());
  auto n0 = start_node(addr, 0, RendezvousHeader{2, 2, "model A"}, 20s, unique_id());
  auto n1 = start_node(addr, 1, RendezvousHeader{2, 2, "model B"}, 20s);
  EXPECT_THAT(error_of(n0), AllOf(HasSubstr("'model A'"), HasSubstr("'model B'")));
  EXPECT_THAT(error_of(n1), HasSubstr("refused"));
}

TEST(Rendezvous, MissingNodeTimesOutNamingIt) {
  const std::string addr = "127.0.0.1:" + std::to_string(free_port());
  auto n0 = start_node(addr, 0, kHeader, 1500ms, unique_id());
  auto n1 = start_node(addr, 1, kHeader, 20s);
  // Node 2 never comes.
  const std::string e0 = error_of(n0);
  EXPECT_THAT(e0, AllOf(HasSubstr("node rank(s) 2 of 3 did not arrive within 1.5 s"), HasSubstr("--nnodes 3"),
                        HasSubstr("firewall")));
  // Node 1, which did arrive, hears why instead of waiting on.
  EXPECT_THAT(error_of(n1), AllOf(HasSubstr("refused node 1"), HasSubstr("did not arrive")));
}

TEST(Rendezvous, NodeZeroNeverComes) {
  const std::string addr = "127.0.0.1:" + std::to_string(free_port());
  auto n1 = start_node(addr, 1, kHeader, 800ms);
  EXPECT_THAT(error_of(n1), AllOf(HasSubstr("node 1 could not reach node 0 at " + addr + " within 0.8 s"),
                                  HasSubstr("Connection refused")));
}

TEST(Rendezvous, DuplicateAndOutOfRangeRanks) {
  const std::string addr = "127.0.0.1:" + std::to_string(free_port());
  auto n0 = start_node(addr, 0, kHeader, 20s, unique_id());
  auto a = start_node(addr, 1, kHeader, 20s);
  std::this_thread::sleep_for(300ms);
  auto b = start_node(addr, 1, kHeader, 20s);
  EXPECT_THAT(error_of(n0), HasSubstr("two nodes say --node-rank 1"));
  EXPECT_THAT(error_of(a), HasSubstr("refused"));
  EXPECT_THAT(error_of(b), HasSubstr("refused"));

  RendezvousOptions o;
  o.addr = addr;
  o.node_rank = 3;
  EXPECT_THAT([&] { rendezvous(o, kHeader, {}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("--node-rank 3 is outside 0..2")));
}

TEST(Rendezvous, BadAddresses) {
  for (const char* addr : {"", "10.0.0.1", ":5000", "host:", "host:abc", "host:70000", "host:0", "[::1]:5000"}) {
    EXPECT_THAT([&] { parse_dist_init_addr(addr); },
                ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("--dist-init-addr"), HasSubstr("expected host:port"))))
        << addr;
  }
  const HostPort hp = parse_dist_init_addr("node0.example:29500");
  EXPECT_EQ(hp.host, "node0.example");
  EXPECT_EQ(hp.port, 29500);
  // A name that does not resolve (.invalid never does) fails at once, not after the time-out.
  RendezvousOptions o;
  o.addr = "no-such-host.invalid:5000";
  o.node_rank = 1;
  o.timeout = 30s;
  EXPECT_THAT([&] { rendezvous(o, RendezvousHeader{2, 2, "m"}, {}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cannot resolve host 'no-such-host.invalid'")));
}

TEST(Rendezvous, PortInUse) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  sa.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(sa);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  RendezvousOptions o;
  o.addr = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  o.timeout = 2s;
  EXPECT_THAT([&] { rendezvous(o, RendezvousHeader{2, 2, "m"}, unique_id()); },
              ::testing::ThrowsMessage<Error>(HasSubstr("is already in use on node 0")));
  ::close(fd);
}

TEST(Rendezvous, FingerprintNamesTheShape) {
  format::ModelConfig c;
  c.model_type = "qwen3_5_moe";
  c.num_layers = 60;
  c.hidden_size = 4096;
  c.num_experts = 512;
  c.vocab_size = 248320;
  EXPECT_EQ(rendezvous_fingerprint(c), "qwen3_5_moe: 60 layers, hidden 4096, 512 experts, vocab 248320");
}

}  // namespace
}  // namespace kiln::backend
