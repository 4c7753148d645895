// SSE parsing: the same events must come out however the body is cut into pieces.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "clients/sse.h"

namespace kiln::clients {
namespace {

std::vector<std::string> parse_in_pieces(const std::string& body, const std::vector<size_t>& cuts) {
  SseParser parser;
  std::vector<std::string> events;
  auto on_event = [&](std::string_view data) {
    events.emplace_back(data);
    return true;
  };
  size_t from = 0;
  for (size_t cut : cuts) {
    EXPECT_TRUE(parser.feed(std::string_view(body).substr(from, cut - from), on_event));
    from = cut;
  }
  EXPECT_TRUE(parser.feed(std::string_view(body).substr(from), on_event));
  EXPECT_TRUE(parser.finish(on_event));
  return events;
}

TEST(SseParser, SplitsEventsOnBlankLines) {
  std::string body = "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
  EXPECT_EQ(parse_in_pieces(body, {}), (std::vector<std::string>{"{\"a\":1}", "{\"b\":2}", "[DONE]"}));
}

TEST(SseParser, EveryCutPositionGivesTheSameEvents) {
  // CRLF and LF line ends, a comment, an id field, no space after "data:", a multi-line event and a
  // UTF-8 character (3 bytes) that a cut can split.
  std::string body =
      ": keep-alive\r\n\r\n"
      "id: 7\r\ndata: {\"t\":\"\xe2\x82\xac\"}\r\n\r\n"
      "data:{\"x\":2}\n\n"
      "event: message\ndata: line one\ndata: line two\n\n"
      "data: [DONE]\n\n";
  const std::vector<std::string> expected = {"{\"t\":\"\xe2\x82\xac\"}", "{\"x\":2}", "line one\nline two", "[DONE]"};
  for (size_t cut = 0; cut <= body.size(); ++cut) EXPECT_EQ(parse_in_pieces(body, {cut}), expected) << "cut at " << cut;
  for (size_t a = 0; a <= body.size(); a += 3)
    for (size_t b = a; b <= body.size(); b += 5) EXPECT_EQ(parse_in_pieces(body, {a, b}), expected);
  // One byte at a time.
  std::vector<size_t> every_byte;
  for (size_t i = 1; i < body.size(); ++i) every_byte.push_back(i);
  EXPECT_EQ(parse_in_pieces(body, every_byte), expected);
}

TEST(SseParser, CrLfSplitBetweenPiecesIsOneLineEnd) {
  // "\r" at the end of one piece and "\n" at the start of the next must not make an empty line
  // (which would end the event early).
  std::string body = "data: a\r\ndata: b\r\n\r\n";
  EXPECT_EQ(parse_in_pieces(body, {8}), std::vector<std::string>{"a\nb"});
  // Old-Mac "\r" only line ends.
  EXPECT_EQ(parse_in_pieces("data: x\r\rdata: y\r\r", {}), (std::vector<std::string>{"x", "y"}));
}

TEST(SseParser, EventWithoutFinalBlankLineIsDeliveredAtFinish) {
  EXPECT_EQ(parse_in_pieces("data: {\"a\":1}\n\ndata: [DONE]", {}), (std::vector<std::string>{"{\"a\":1}", "[DONE]"}));
  EXPECT_EQ(parse_in_pieces("data: [DONE]\n", {}), std::vector<std::string>{"[DONE]"});
}

TEST(SseParser, IgnoresEventsWithoutData) {
  EXPECT_TRUE(parse_in_pieces(": comment\n\nevent: ping\n\nretry: 10\n\n", {}).empty());
  // "data" with no colon is a data line with an empty value.
  EXPECT_EQ(parse_in_pieces("data\n\n", {}), std::vector<std::string>{""});
}

TEST(SseParser, StopsWhenTheCallbackSaysSo) {
  SseParser parser;
  int seen = 0;
  auto on_event = [&](std::string_view) { return ++seen < 2; };
  EXPECT_FALSE(parser.feed("data: 1\n\ndata: 2\n\ndata: 3\n\n", on_event));
  EXPECT_EQ(seen, 2);
}

}  // namespace
}  // namespace kiln::clients
