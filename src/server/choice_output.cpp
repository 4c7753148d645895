#include "server/choice_output.h"

namespace kiln::server {

ChoiceOutput::ChoiceOutput(const tok::Tokenizer& tokenizer, ChoiceOptions options)
    : tokenizer_(tokenizer),
      opts_(std::move(options)),
      decoder_(tokenizer, opts_.skip_special_tokens),
      stops_(opts_.stop) {
  if (opts_.parse_reasoning) reasoning_.emplace(opts_.start_in_reasoning);
  if (opts_.parse_tool_calls) tools_.emplace(opts_.tools, opts_.max_tool_calls);
}

bool ChoiceOutput::take_cancel_request() {
  bool c = cancel_pending_;
  cancel_pending_ = false;
  return c;
}

void ChoiceOutput::pass_to_tools(std::string_view text, ChoiceDelta& delta) {
  if (text.empty()) return;
  if (!tools_) {
    delta.content.append(text);
    return;
  }
  auto d = tools_->push(text);
  delta.content += d.content;
  for (auto& c : d.calls) delta.tool_calls.push_back(std::move(c));
}

void ChoiceOutput::feed(std::string_view text, ChoiceDelta& delta) {
  if (stop_matched_ || text.empty()) return;
  auto r = stops_.push(text);
  if (reasoning_) {
    auto d = reasoning_->push(r.text);
    delta.reasoning += d.reasoning;
    pass_to_tools(d.content, delta);
  } else {
    pass_to_tools(r.text, delta);
  }
  if (r.stopped) {
    stop_matched_ = true;
    cancel_pending_ = true;
    matched_stop_ = r.matched;
    reason_ = engine::FinishReason::stop;
    finish_parsers(delta);
  }
}

void ChoiceOutput::finish_parsers(ChoiceDelta& delta) {
  if (finished_) return;
  if (!stop_matched_) {
    std::string held = stops_.flush();
    if (reasoning_) {
      auto d = reasoning_->push(held);
      delta.reasoning += d.reasoning;
      pass_to_tools(d.content, delta);
    } else {
      pass_to_tools(held, delta);
    }
  }
  if (reasoning_) {
    auto d = reasoning_->finish();
    delta.reasoning += d.reasoning;
    pass_to_tools(d.content, delta);
  }
  if (tools_) {
    auto d = tools_->finish();
    delta.content += d.content;
    for (auto& c : d.calls) delta.tool_calls.push_back(std::move(c));
  }
  finished_ = true;
}

void ChoiceOutput::on_event(const engine::TokenEvent& ev, ChoiceDelta& delta) {
  if (finished_) return;  // e.g. tokens that raced with a stop-string cancel
  if (ev.token >= 0) {
    ++completion_tokens_;
    // A reasoning token: generated inside the think block, or the one that opened or closed it.
    bool was_reasoning = reasoning_ && reasoning_->in_reasoning();
    if (opts_.want_logprobs) delta.logprobs.push_back({ev.token, ev.logprob, ev.top});
    if (!ev.is_stop_token) {
      std::string text;
      try {
        text = decoder_.push(ev.token);
      } catch (const std::exception&) {
        // An id the model has but the tokenizer lacks (padded embedding rows): no text.
      }
      feed(text, delta);
    }
    if (was_reasoning || (reasoning_ && reasoning_->in_reasoning())) ++reasoning_tokens_;
  }
  if (ev.finished && !finished_) {
    reason_ = ev.finish_reason;
    if (ev.is_stop_token) matched_stop_ = ev.token;
    if (ev.finish_reason == engine::FinishReason::error) error_ = ev.error;
    feed(decoder_.flush(), delta);
    finish_parsers(delta);
  }
}

void ChoiceOutput::fail(const std::string& message, ChoiceDelta& delta) {
  if (finished_) return;
  reason_ = engine::FinishReason::error;
  error_ = message;
  finish_parsers(delta);
}

nlohmann::json ChoiceOutput::finish_reason_json() const {
  if (!finished_) return nullptr;
  switch (reason_) {
    case engine::FinishReason::stop:
      return num_tool_calls() > 0 ? "tool_calls" : "stop";
    case engine::FinishReason::length: return "length";
    case engine::FinishReason::abort: return "abort";
    case engine::FinishReason::error: return "error";
    case engine::FinishReason::none: break;
  }
  return nullptr;
}

}  // namespace kiln::server
