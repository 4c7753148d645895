// Where one HTTP/1.1 request ends in the bytes a connection has sent so far (RFC 9112 message framing): the end of
// the header section, then a body of Content-Length bytes or a chunked body (chunk sizes, extensions, trailers).
// The request gate uses it to know when a whole request has arrived; the worker's HTTP parser (cpp-httplib) then
// reads exactly these bytes. Only the framing is parsed: the request line's method and path, Content-Length,
// Transfer-Encoding and Expect. Incremental: feed() is given the connection's buffer, grown, on every call, and
// resumes where it stopped. Requests it cannot frame are errors with the status to answer (400, 411, 413, 431).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::server {

struct FramingLimits {
  size_t max_header_bytes = 65536;      // request line + headers + blank line (beyond: 431)
  size_t max_body_bytes = 32u << 20;    // Content-Length, or the sum of the chunk sizes (beyond: 413)
};

class RequestFraming {
 public:
  enum class State { kHeaders, kBody, kComplete, kError };

  explicit RequestFraming(FramingLimits limits = {}) : limits_(limits) {}

  // data: every byte of this request received so far (it starts at the request line), the same prefix as before.
  State feed(std::string_view data);

  State state() const { return state_; }
  bool headers_complete() const { return state_ == State::kBody || state_ == State::kComplete; }
  size_t header_bytes() const { return header_end_; }    // once the blank line arrived (also after a refused header)
  size_t request_bytes() const { return request_end_; }  // once kComplete: the request is data[0, request_bytes())
  // The body still to come, as far as the headers tell (Content-Length bodies; 0 for chunked ones).
  size_t announced_body_bytes() const { return content_length_; }
  const std::string& method() const { return method_; }
  const std::string& path() const { return path_; }  // the request target without its query
  // "Expect: 100-continue" was sent; the line is data[expect_begin, expect_end) (to answer it and drop it).
  bool expects_continue() const { return expect_end_ > expect_begin_; }
  size_t expect_begin() const { return expect_begin_; }
  size_t expect_end() const { return expect_end_; }
  // Once kError: the HTTP status to answer and why.
  int error_status() const { return error_status_; }
  const std::string& error_message() const { return error_message_; }

 private:
  enum class Chunk { kSizeLine, kData, kTrailers };
  State fail(int status, std::string message);
  State parse_headers(std::string_view head);
  State feed_chunked(std::string_view data);

  FramingLimits limits_;
  State state_ = State::kHeaders;
  size_t scanned_ = 0;  // header bytes searched for the blank line so far
  size_t header_end_ = 0, request_end_ = 0;
  std::string method_, path_;
  bool chunked_ = false;
  size_t content_length_ = 0;
  size_t expect_begin_ = 0, expect_end_ = 0;
  // Chunked body: where the next piece starts, the data left in the current chunk, the body bytes so far.
  Chunk chunk_ = Chunk::kSizeLine;
  size_t pos_ = 0;
  uint64_t chunk_left_ = 0, body_bytes_ = 0;
  int error_status_ = 0;
  std::string error_message_;
};

}  // namespace kiln::server
