#include "clients/sse.h"

namespace kiln::clients {

bool SseParser::feed(std::string_view bytes, const EventFn& on_event) {
  bytes_seen_ += bytes.size();
  for (char c : bytes) {
    if (after_cr_) {
      after_cr_ = false;
      if (c == '\n') continue;  // the "\n" of a "\r\n" already ended this line
    }
    if (c == '\r' || c == '\n') {
      after_cr_ = c == '\r';
      if (!end_line(on_event)) return false;
    } else {
      line_ += c;
    }
  }
  return true;
}

bool SseParser::finish(const EventFn& on_event) {
  after_cr_ = false;
  if (!line_.empty() && !end_line(on_event)) return false;
  if (has_data_) {
    has_data_ = false;
    std::string data = std::move(data_);
    data_.clear();
    return on_event(data);
  }
  return true;
}

bool SseParser::end_line(const EventFn& on_event) {
  if (line_.empty()) {  // blank line: dispatch the event
    if (!has_data_) return true;
    has_data_ = false;
    std::string data = std::move(data_);
    data_.clear();
    return on_event(data);
  }
  std::string_view line = line_;
  size_t colon = line.find(':');
  std::string_view field = line.substr(0, colon);
  std::string_view value;
  if (colon != std::string_view::npos) {
    value = line.substr(colon + 1);
    if (value.starts_with(' ')) value.remove_prefix(1);
  }
  // Comments (":" keep-alives, colon == 0) and fields other than data are ignored.
  if (colon != 0 && field == "data") {
    if (has_data_) data_ += '\n';
    data_ += value;
    has_data_ = true;
  }
  line_.clear();
  return true;
}

}  // namespace kiln::clients
