// Incremental parser for a text/event-stream (Server-Sent Events) body, as OpenAI-compatible servers
// stream completions: "data: {...}\n\n" events ending with "data: [DONE]".
//
// Bytes arrive in arbitrary pieces: a line, an event, even a UTF-8 character may be split between
// two reads. Lines end in "\n", "\r\n" or "\r"; an empty line ends an event; "data:" lines are joined
// with "\n" (one space after the colon is dropped); comments (":...") and other fields (event:, id:,
// retry:) are ignored.
#pragma once
#include <functional>
#include <string>
#include <string_view>

namespace kiln::clients {

class SseParser {
 public:
  // Called with the data of each complete event; returns false to stop parsing.
  using EventFn = std::function<bool(std::string_view data)>;

  // Feeds the next piece of the body. Returns false once on_event has returned false.
  bool feed(std::string_view bytes, const EventFn& on_event);
  // At the end of the body: an event cut off before its blank line is still delivered (servers that
  // omit the final blank line exist). Returns false if on_event returned false.
  bool finish(const EventFn& on_event);

  // Bytes seen so far (for diagnostics).
  size_t bytes_seen() const { return bytes_seen_; }

 private:
  bool end_line(const EventFn& on_event);

  std::string line_;  // the current, incomplete line
  std::string data_;  // data lines of the current event, joined with '\n'
  bool has_data_ = false;
  bool after_cr_ = false;  // the last byte was '\r': a '\n' right after it ends the same line
  size_t bytes_seen_ = 0;
};

}  // namespace kiln::clients
