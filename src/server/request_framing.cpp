#include "server/request_framing.h"

#include <algorithm>
#include <cctype>

namespace kiln::server {

namespace {

constexpr size_t kMaxChunkLineBytes = 4096;  // a chunk-size line with its extensions, or one trailer line

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// The end of the header section: just past the first empty line (CRLF CRLF, or bare LF as lenient parsers accept),
// searching from `from`; npos when it has not arrived.
size_t find_head_end(std::string_view data, size_t from) {
  for (size_t i = data.find('\n', from); i != std::string_view::npos; i = data.find('\n', i + 1)) {
    if (i + 1 < data.size() && data[i + 1] == '\n') return i + 2;
    if (i + 2 < data.size() && data[i + 1] == '\r' && data[i + 2] == '\n') return i + 3;
  }
  return std::string_view::npos;
}

// A decimal Content-Length; false when it is not one.
bool parse_length(std::string_view s, uint64_t* out) {
  if (s.empty() || s.size() > 19) return false;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = v;
  return true;
}

}  // namespace

RequestFraming::State RequestFraming::fail(int status, std::string message) {
  state_ = State::kError;
  error_status_ = status;
  error_message_ = std::move(message);
  return state_;
}

RequestFraming::State RequestFraming::feed(std::string_view data) {
  if (state_ == State::kHeaders) {
    // The blank line may straddle the previous search's end: resume a few bytes back.
    size_t end = find_head_end(data, scanned_ >= 3 ? scanned_ - 3 : 0);
    if (end == std::string_view::npos) {
      scanned_ = data.size();
      if (data.size() > limits_.max_header_bytes)
        return fail(431, "the request headers are larger than the limit of " +
                             std::to_string(limits_.max_header_bytes) + " bytes");
      return state_;
    }
    if (end > limits_.max_header_bytes)
      return fail(431, "the request headers are larger than the limit of " + std::to_string(limits_.max_header_bytes) +
                           " bytes");
    header_end_ = end;
    if (parse_headers(data.substr(0, end)) == State::kError) return state_;
    state_ = State::kBody;
    pos_ = header_end_;
  }
  if (state_ != State::kBody) return state_;
  if (chunked_) return feed_chunked(data);
  if (data.size() >= header_end_ + content_length_) {
    request_end_ = header_end_ + content_length_;
    state_ = State::kComplete;
  }
  return state_;
}

RequestFraming::State RequestFraming::parse_headers(std::string_view head) {
  size_t line_end = head.find('\n');
  std::string_view request_line = trim(head.substr(0, line_end));
  const size_t sp1 = request_line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : request_line.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos || sp1 == 0)
    return fail(400, "malformed request line (expected 'METHOD /path HTTP/1.1')");
  method_ = std::string(request_line.substr(0, sp1));
  std::string_view target = request_line.substr(sp1 + 1, sp2 - sp1 - 1);
  path_ = std::string(target.substr(0, target.find('?')));

  bool has_length = false, has_transfer_encoding = false;
  uint64_t length = 0;
  while (line_end != std::string_view::npos && line_end + 1 < head.size()) {
    const size_t start = line_end + 1;
    line_end = head.find('\n', start);
    std::string_view line = head.substr(start, line_end == std::string_view::npos ? std::string_view::npos
                                                                                  : line_end - start);
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;  // the blank line (or junk the parser will refuse)
    std::string_view name = line.substr(0, colon);
    std::string_view value = trim(line.substr(colon + 1));
    if (iequals(name, "content-length")) {
      uint64_t v = 0;
      if (!parse_length(value, &v) || (has_length && v != length))
        return fail(400, "invalid Content-Length '" + std::string(value) + "'");
      has_length = true;
      length = v;
    } else if (iequals(name, "transfer-encoding")) {
      if (!iequals(value, "chunked"))
        return fail(400, "Transfer-Encoding '" + std::string(value) +
                             "' is not supported (send Content-Length, or Transfer-Encoding: chunked)");
      has_transfer_encoding = true;
    } else if (iequals(name, "expect") && iequals(value, "100-continue")) {
      expect_begin_ = start;
      expect_end_ = line_end == std::string_view::npos ? head.size() : line_end + 1;
    }
  }
  if (has_transfer_encoding) {
    chunked_ = true;  // chunked wins over Content-Length (RFC 9112 section 6.3)
    return state_;
  }
  if (has_length) {
    if (length > limits_.max_body_bytes)
      return fail(413, "the request body is larger than the limit of " + std::to_string(limits_.max_body_bytes) +
                           " bytes");
    content_length_ = static_cast<size_t>(length);
    return state_;
  }
  if (method_ == "POST" || method_ == "PUT" || method_ == "PATCH")
    return fail(411, method_ + " " + std::string(target) +
                         ": the request has neither Content-Length nor chunked Transfer-Encoding; send "
                         "Content-Length: 0 for an empty body");
  return state_;  // no body
}

RequestFraming::State RequestFraming::feed_chunked(std::string_view data) {
  for (;;) {
    if (chunk_ == Chunk::kData) {
      if (data.size() - pos_ < chunk_left_ + 2) return state_;
      const size_t end = pos_ + static_cast<size_t>(chunk_left_);
      if (data[end] != '\r' || data[end + 1] != '\n') return fail(400, "malformed chunked body (no CRLF after a chunk)");
      pos_ = end + 2;
      chunk_ = Chunk::kSizeLine;
      continue;
    }
    const size_t nl = data.find('\n', pos_);
    if (nl == std::string_view::npos) {
      if (data.size() - pos_ > kMaxChunkLineBytes) return fail(400, "malformed chunked body (a line too long)");
      return state_;
    }
    std::string_view line = trim(data.substr(pos_, nl - pos_));
    pos_ = nl + 1;
    if (chunk_ == Chunk::kTrailers) {
      if (line.empty()) {
        request_end_ = pos_;
        state_ = State::kComplete;
        return state_;
      }
      if (pos_ - header_end_ > limits_.max_body_bytes + limits_.max_header_bytes)
        return fail(400, "malformed chunked body (trailers too long)");
      continue;
    }
    std::string_view hex = line.substr(0, std::min(line.find(';'), line.size()));
    hex = trim(hex);
    if (hex.empty() || hex.size() > 15) return fail(400, "malformed chunked body (bad chunk size)");
    uint64_t size = 0;
    for (char c : hex) {
      const int d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                    : (c >= 'a' && c <= 'f')                     ? c - 'a' + 10
                    : (c >= 'A' && c <= 'F')                     ? c - 'A' + 10
                                                                 : -1;
      if (d < 0) return fail(400, "malformed chunked body (bad chunk size)");
      size = size * 16 + static_cast<uint64_t>(d);
    }
    if (body_bytes_ + size > limits_.max_body_bytes)
      return fail(413, "the request body is larger than the limit of " + std::to_string(limits_.max_body_bytes) +
                           " bytes");
    body_bytes_ += size;
    if (size == 0) {
      chunk_ = Chunk::kTrailers;
    } else {
      chunk_left_ = size;
      chunk_ = Chunk::kData;
    }
  }
}

}  // namespace kiln::server
