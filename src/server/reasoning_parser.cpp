#include "server/reasoning_parser.h"

#include <algorithm>

namespace kiln::server {

namespace {
constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kToolCallOpen = "<tool_call>";
}  // namespace

ReasoningParser::ReasoningParser(bool start_in_reasoning)
    : state_(start_in_reasoning ? State::reasoning : State::start) {
  reasoning_trim_.drop_leading();
}

ReasoningParser::Delta ReasoningParser::push(std::string_view text) {
  Delta out;
  buf_.append(text);
  run(out, false);
  return out;
}

ReasoningParser::Delta ReasoningParser::finish() {
  Delta out;
  run(out, true);
  return out;
}

void ReasoningParser::run(Delta& out, bool at_end) {
  for (;;) {
    switch (state_) {
      case State::start: {
        std::string_view rest = lstrip(buf_);
        if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
          buf_.erase(0, buf_.size() - rest.size() + kThinkOpen.size());
          state_ = State::reasoning;
          continue;
        }
        // Still possibly "<think>" coming: wait (unless the stream ended).
        if (!at_end && kThinkOpen.substr(0, rest.size()) == rest) return;
        state_ = State::content;
        continue;
      }
      case State::reasoning: {
        size_t close = buf_.find(kThinkClose);
        size_t tool = buf_.find(kToolCallOpen);
        if (close != std::string::npos || tool != std::string::npos) {
          bool by_tool = tool != std::string::npos && (close == std::string::npos || tool < close);
          size_t at = by_tool ? tool : close;
          out.reasoning += reasoning_trim_.push(std::string_view(buf_).substr(0, at));
          reasoning_trim_.drop_pending();
          buf_.erase(0, by_tool ? at : at + kThinkClose.size());
          state_ = State::content_after_think;
          continue;
        }
        size_t keep = at_end ? 0 : std::max(partial_suffix(buf_, kThinkClose), partial_suffix(buf_, kToolCallOpen));
        out.reasoning += reasoning_trim_.push(std::string_view(buf_).substr(0, buf_.size() - keep));
        buf_.erase(0, buf_.size() - keep);
        if (at_end) reasoning_trim_.drop_pending();
        return;
      }
      case State::content_after_think: {
        if (!content_started_) {
          std::string_view rest = lstrip(buf_);
          if (rest.empty()) {
            buf_.clear();
            return;
          }
          buf_.erase(0, buf_.size() - rest.size());
          content_started_ = true;
        }
        out.content += buf_;
        buf_.clear();
        return;
      }
      case State::content:
        out.content += buf_;
        buf_.clear();
        return;
    }
  }
}

ReasoningParser::Delta ReasoningParser::parse(std::string_view text, bool start_in_reasoning) {
  ReasoningParser p(start_in_reasoning);
  Delta a = p.push(text);
  Delta b = p.finish();
  a.reasoning += b.reasoning;
  a.content += b.content;
  return a;
}

}  // namespace kiln::server
