// RequestFraming (src/server/request_framing.cpp): where a request ends, checked on messages framed by hand from
// RFC 9112 (section 6 message body length, section 7.1 chunked coding), fed whole and one byte at a time.
#include "server/request_framing.h"

#include <gtest/gtest.h>

#include <string>

namespace kiln::server {
namespace {

using State = RequestFraming::State;

// Feeds `data` one byte more at a time, as a trickling client would send it; the final state.
RequestFraming feed_bytewise(const std::string& data, FramingLimits limits = {}) {
  RequestFraming f(limits);
  for (size_t n = 1; n <= data.size(); ++n)
    if (f.feed(std::string_view(data).substr(0, n)) == State::kError) break;
  return f;
}

struct Case {
  const char* name;
  std::string request;        // the whole request
  std::string after;          // bytes of a next, pipelined request
};

class WholeRequests : public ::testing::TestWithParam<Case> {};

TEST_P(WholeRequests, EndWhereTheRequestEndsFedWholeOrBytewise) {
  const Case& c = GetParam();
  RequestFraming whole;
  EXPECT_EQ(whole.feed(c.request + c.after), State::kComplete);
  EXPECT_EQ(whole.request_bytes(), c.request.size());
  RequestFraming bytewise = feed_bytewise(c.request);
  EXPECT_EQ(bytewise.state(), State::kComplete);
  EXPECT_EQ(bytewise.request_bytes(), c.request.size());
  // One byte short is never complete.
  RequestFraming shorter;
  EXPECT_NE(shorter.feed(c.request.substr(0, c.request.size() - 1)), State::kComplete);
}

INSTANTIATE_TEST_SUITE_P(
    RequestFraming, WholeRequests,
    ::testing::Values(
        Case{"GetWithoutBody", "GET /health HTTP/1.1\r\nHost: x\r\n\r\n", "GET /metrics HTTP/1.1\r\n\r\n"},
        Case{"ContentLength", "POST /v1/completions HTTP/1.1\r\nContent-Length: 11\r\n\r\n{\"a\": true}",
             "GET / HTTP/1.1\r\n"},
        Case{"ContentLengthZero", "POST /x HTTP/1.1\r\ncontent-length:0\r\n\r\n", "junk"},
        Case{"BareLineFeeds", "GET / HTTP/1.0\nHost: x\n\n", ""},
        // RFC 9112 7.1: chunk-size [ chunk-ext ] CRLF chunk-data CRLF ... last-chunk trailer-section CRLF
        Case{"Chunked", "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\n5\r\npedia\r\n0\r\n\r\n",
             "GET / HTTP/1.1\r\n\r\n"},
        Case{"ChunkedWithExtensionsAndTrailer",
             "PUT /x HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\nA;name=value\r\n0123456789\r\n0\r\nX-Sum: 1\r\n\r\n",
             ""},
        Case{"ChunkedWinsOverContentLength",
             "POST /x HTTP/1.1\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", ""}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(RequestFraming, HeadersCompleteBeforeTheBodyAndTellItsLength) {
  RequestFraming f;
  const std::string head = "POST /v1/chat/completions?x=1 HTTP/1.1\r\nContent-Length: 5\r\n\r\n";
  EXPECT_EQ(f.feed(head.substr(0, 20)), State::kHeaders);
  EXPECT_EQ(f.feed(head + "ab"), State::kBody);
  EXPECT_TRUE(f.headers_complete());
  EXPECT_EQ(f.header_bytes(), head.size());
  EXPECT_EQ(f.announced_body_bytes(), 5u);
  EXPECT_EQ(f.method(), "POST");
  EXPECT_EQ(f.path(), "/v1/chat/completions");
  EXPECT_EQ(f.feed(head + "abcde"), State::kComplete);
}

TEST(RequestFraming, ExpectContinueLineIsLocated) {
  RequestFraming f;
  const std::string line = "Expect: 100-continue\r\n";
  const std::string req = "POST /x HTTP/1.1\r\nHost: x\r\n" + line + "Content-Length: 2\r\n\r\n";
  EXPECT_EQ(f.feed(req), State::kBody);
  ASSERT_TRUE(f.expects_continue());
  EXPECT_EQ(req.substr(f.expect_begin(), f.expect_end() - f.expect_begin()), line);
}

struct Refused {
  const char* name;
  std::string request;
  int status;
  const char* says;
};

class RefusedRequests : public ::testing::TestWithParam<Refused> {};

TEST_P(RefusedRequests, AreErrorsWithTheirStatus) {
  const Refused& r = GetParam();
  FramingLimits limits;
  limits.max_header_bytes = 256;
  limits.max_body_bytes = 100;
  for (const RequestFraming& f : {feed_bytewise(r.request, limits), [&] {
         RequestFraming w(limits);
         w.feed(r.request);
         return w;
       }()}) {
    ASSERT_EQ(f.state(), State::kError);
    EXPECT_EQ(f.error_status(), r.status);
    EXPECT_NE(f.error_message().find(r.says), std::string::npos) << f.error_message();
  }
}

INSTANTIATE_TEST_SUITE_P(
    RequestFraming, RefusedRequests,
    ::testing::Values(
        Refused{"PostWithoutLength", "POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 411, "Content-Length: 0"},
        Refused{"BodyOverTheLimit", "POST /x HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 413, "limit of 100 bytes"},
        Refused{"ChunksOverTheLimit",
                "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n" + std::string(64, 'a') + "\r\n40\r\n",
                413, "limit of 100 bytes"},
        Refused{"HeadersOverTheLimit", "GET / HTTP/1.1\r\nX: " + std::string(300, 'a') + "\r\n\r\n", 431, "256 bytes"},
        Refused{"ConflictingLengths", "POST /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400,
                "Content-Length"},
        Refused{"NegativeLength", "POST /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "Content-Length"},
        Refused{"OtherTransferCoding", "POST /x HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400,
                "not supported"},
        Refused{"BadChunkSize", "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "chunk size"},
        Refused{"NoCrlfAfterChunk", "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", 400,
                "CRLF"},
        Refused{"NoRequestLine", "hello\r\n\r\n", 400, "request line"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kiln::server
