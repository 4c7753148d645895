// model::NodeLink over TCP (backend/tcp_node_link.h), on a connected socket pair: frames of every size arrive whole
// and in order, a message of another type than expected names both, a clean close between messages is "stopped"
// (false), close() wakes a waiting receive on this side and breaks the other, and bytes that are not a kiln frame
// are refused.
#include "backend/tcp_node_link.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "core/error.h"

namespace kiln::backend {
namespace {

using namespace std::chrono_literals;
using model::wire::Message;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Node 0 and node 1 of a two-node group over a socket pair.
struct Pair {
  std::unique_ptr<TcpNodeLink> node0, node1;
};
Pair linked_pair() {
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  std::vector<tcp::Fd> zero(2), one(1);
  zero[1] = tcp::Fd(fds[0]);
  one[0] = tcp::Fd(fds[1]);
  return {std::make_unique<TcpNodeLink>(2, 0, std::move(zero)), std::make_unique<TcpNodeLink>(2, 1, std::move(one))};
}

TEST(TcpNodeLink, MessagesArriveWholeAndInOrder) {
  Pair p = linked_pair();
  // 4 MiB: far more than a socket buffer, so the writer and the reader must interleave.
  std::vector<uint8_t> big(4 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 31 + 7);
  std::thread sender([&] {
    p.node1->send(0, Message::capacity, big.data(), big.size());
    p.node1->send(0, Message::reply, nullptr, 0);
  });
  EXPECT_EQ(p.node0->receive(1, Message::capacity, 10s), big);
  Message type{};
  std::vector<uint8_t> payload{1, 2};
  ASSERT_TRUE(p.node0->receive_any(1, type, payload, 10s));
  EXPECT_EQ(type, Message::reply);
  EXPECT_TRUE(payload.empty());
  sender.join();
}

TEST(TcpNodeLink, UnexpectedTypeNamesBoth) {
  Pair p = linked_pair();
  p.node0->send(1, Message::stop, nullptr, 0);
  EXPECT_THAT([&] { p.node1->receive(0, Message::step, 5s); },
              ThrowsMessage<Error>(AllOf(HasSubstr("a stop message where a step message was due"),
                                         HasSubstr("out of step"))));
}

TEST(TcpNodeLink, CleanCloseBetweenMessagesIsNotAnError) {
  Pair p = linked_pair();
  p.node0.reset();  // node 0 exits: its socket closes
  Message type{};
  std::vector<uint8_t> payload;
  EXPECT_FALSE(p.node1->receive_any(0, type, payload, 5s));
  EXPECT_THAT([&] { p.node1->receive(0, Message::step, 5s); },
              ThrowsMessage<Error>(HasSubstr("closed the connection")));
}

TEST(TcpNodeLink, TimeOutNamesTheWait) {
  Pair p = linked_pair();
  EXPECT_THAT([&] { p.node1->receive(0, Message::step, 200ms); },
              ThrowsMessage<Error>(HasSubstr("timed out after 0.2 s")));
}

TEST(TcpNodeLink, CloseWakesAWaitingReceiveAndBreaksThePeer) {
  Pair p = linked_pair();
  std::string here;
  std::thread waiter([&] {
    try {
      p.node1->receive(0, Message::step);  // no time-out: only close() ends it
    } catch (const Error& e) {
      here = e.what();
    }
  });
  std::this_thread::sleep_for(100ms);
  p.node1->close();
  waiter.join();
  EXPECT_THAT(here, HasSubstr("closed after a failure"));
  EXPECT_TRUE(p.node1->closed());
  EXPECT_THAT([&] { p.node1->send(0, Message::reply, nullptr, 0); },
              ThrowsMessage<Error>(HasSubstr("restart every node")));
  // Node 0 sees the connection end.
  Message type{};
  std::vector<uint8_t> payload;
  EXPECT_FALSE(p.node0->receive_any(1, type, payload, 5s));
}

TEST(TcpNodeLink, BytesThatAreNotAFrameAreRefused) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  std::vector<tcp::Fd> zero(2);
  zero[1] = tcp::Fd(fds[0]);
  TcpNodeLink node0(2, 0, std::move(zero));
  const char http[] = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::write(fds[1], http, sizeof(http) - 1), static_cast<ssize_t>(sizeof(http) - 1));
  EXPECT_THAT([&] { node0.receive(1, Message::step, 5s); },
              ThrowsMessage<Error>(AllOf(HasSubstr("receiving from node 1"), HasSubstr("unknown message type 0x47"))));
  ::close(fds[1]);
}

TEST(TcpNodeLink, OnlyPeersOfTheStar) {
  Pair p = linked_pair();
  EXPECT_THAT([&] { p.node1->send(1, Message::step, nullptr, 0); },
              ThrowsMessage<Error>(HasSubstr("not a peer of this node")));
  EXPECT_THAT([&] { p.node0->send(0, Message::step, nullptr, 0); },
              ThrowsMessage<Error>(HasSubstr("not a peer of this node")));
}

}  // namespace
}  // namespace kiln::backend
