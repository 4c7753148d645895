#include "server/response.h"

#include <cmath>
#include <random>

#include "core/log.h"
#include "engine/engine.h"
#include "engine/grammar/token_mask.h"
#include "server/api_error.h"

namespace kiln::server {

using json = nlohmann::json;

namespace {

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// JSON has no infinities: a -inf logprob (a token the sampler had ruled out) becomes a large negative.
double finite_logprob(float lp) { return std::isfinite(lp) ? lp : -9999.0; }

}  // namespace

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string random_hex(size_t n) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += digits[rng() & 15];
  return s;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

ApiError shutdown_abort_error() {
  return ApiError(503,
                  "the server shut down before this request finished (its shutdown timeout ran out); the output is "
                  "incomplete: retry the request",
                  "", "shutting_down", "server_error");
}

GenerationJob::~GenerationJob() {
  if (channel) channel->cancel();  // no reader left: the engine may drop whatever still runs
  if (active) active->fetch_sub(1);
}

std::string GenerationJob::sse(const json& j) const { return "data: " + dump_json(j) + "\n\n"; }

bool GenerationJob::probe_due() {
  auto now = Clock::now();
  if (now - last_probe < kWaitSlice) return false;
  last_probe = now;
  return true;
}

bool GenerationJob::all_finished() const {
  for (const auto& c : choices)
    if (!c.finished()) return false;
  return true;
}

std::vector<ChoiceDelta> GenerationJob::absorb(const std::vector<engine::TokenEvent>& events) {
  std::vector<ChoiceDelta> deltas(choices.size());
  for (const auto& ev : events) {
    if (ev.index < 0 || ev.index >= static_cast<int>(choices.size())) continue;
    if (!got_first_token && ev.token >= 0) {
      got_first_token = true;
      first_token = Clock::now();
      queue_ms = ev.queue_ms;
      cached_tokens = ev.cached_tokens;
    }
    ChoiceOutput& c = choices[ev.index];
    if (reasoning_budget >= 0 && ev.token >= 0 && !ev.is_stop_token) generated.push_back(ev.token);
    c.on_event(ev, deltas[ev.index]);
    if (c.take_cancel_request()) channel->cancel_sequence(ev.index, /*as_stop=*/true);
    if (budget_due()) {
      close_reasoning(deltas[0]);
      break;  // the rest of the events are the stopped sequence's
    }
  }
  for (size_t i = 0; i < deltas.size(); ++i) {
    Accum& a = acc[i];
    for (auto& lp : deltas[i].logprobs) a.logprobs.push_back(std::move(lp));
    deltas[i].logprobs.clear();
    for (const auto& piece : deltas[i].tool_calls) {
      if (piece.index >= static_cast<int>(a.calls.size()))
        a.calls.push_back({call_id_prefix + random_hex(24), piece.name, ""});
      a.calls[piece.index].arguments += piece.arguments;
    }
  }
  return deltas;
}

bool GenerationJob::budget_due() const {
  if (reasoning_budget < 0 || budget_spent || !engine || choices.size() != 1) return false;
  const ChoiceOutput& c = choices[0];
  return !c.finished() && c.in_reasoning() && c.reasoning_tokens() >= reasoning_budget;
}

void GenerationJob::close_reasoning(ChoiceDelta& delta) {
  budget_spent = true;
  channel->cancel();
  engine::GenerateRequest r = submitted;
  r.id += "-answer";
  r.prompt.insert(r.prompt.end(), generated.begin(), generated.end());
  const std::vector<int32_t> close_ids = tokenizer->encode(think_close, /*parse_special=*/true);
  r.prompt.insert(r.prompt.end(), close_ids.begin(), close_ids.end());
  r.max_tokens -= static_cast<int64_t>(generated.size());
  if (r.constraint) {  // the answer's grammar starts at once: "</think>" is in the prompt now
    auto c = std::make_shared<grammar::Constraint>(*r.constraint);
    c->start_after_token = -1;
    r.constraint = c;
  }
  choices[0].inject_text(think_close, delta);
  engine::SubmitResult sr = r.max_tokens > 0 ? engine->submit({r}) : engine::SubmitResult{};
  if (r.max_tokens > 0 && sr.status == engine::SubmitStatus::ok) {
    channel = sr.channel;
    return;
  }
  // No room left for an answer, or the engine refused the continuation: the choice ends here.
  engine::TokenEvent end;
  end.finished = true;
  end.finish_reason = r.max_tokens > 0 ? engine::FinishReason::error : engine::FinishReason::length;
  end.error = "the answer after the thinking budget was not accepted: " + sr.message;
  choices[0].on_event(end, delta);
}

json GenerationJob::usage() const {
  int64_t reasoning = 0;
  for (const auto& c : choices) reasoning += c.reasoning_tokens();
  int64_t completion = completion_tokens();
  json u = {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion},
            {"total_tokens", prompt_tokens + completion},
            {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
  if (chat) u["completion_tokens_details"] = {{"reasoning_tokens", reasoning}};
  return u;
}

std::string GenerationJob::token_text(int32_t id) const {
  try {
    return tokenizer->decode(std::span<const int32_t>(&id, 1), false);
  } catch (const std::exception&) {
    return "";
  }
}

json GenerationJob::bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

json GenerationJob::chat_logprobs(const std::vector<LogprobEntry>& entries) const {
  json content = json::array();
  for (const auto& e : entries) {
    std::string t = token_text(e.token);
    json top = json::array();
    for (const auto& alt : e.top) {
      std::string at = token_text(alt.token);
      top.push_back({{"token", at}, {"logprob", finite_logprob(alt.logprob)}, {"bytes", bytes_of(at)}});
    }
    content.push_back(
        {{"token", t}, {"logprob", finite_logprob(e.logprob)}, {"bytes", bytes_of(t)}, {"top_logprobs", top}});
  }
  return json{{"content", content}};
}

json GenerationJob::completion_logprobs(const std::vector<LogprobEntry>& entries, int64_t* text_offset) const {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (const auto& e : entries) {
    std::string t = token_text(e.token);
    tokens.push_back(t);
    lps.push_back(finite_logprob(e.logprob));
    if (fields.top_logprobs > 0) {
      json top = json::object();
      for (const auto& alt : e.top) top[token_text(alt.token)] = finite_logprob(alt.logprob);
      tops.push_back(top);
    } else {
      tops.push_back(nullptr);
    }
    offsets.push_back(*text_offset);
    *text_offset += static_cast<int64_t>(t.size());
  }
  return json{{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json GenerationJob::chunk_base() const {
  json j = {{"id", id},
            {"object", chat ? "chat.completion.chunk" : "text_completion"},
            {"created", created},
            {"model", model_name}};
  return j;
}

json GenerationJob::with_usage(json chunk) const {
  if (fields.continuous_usage_stats) chunk["usage"] = usage();
  else if (fields.include_usage) chunk["usage"] = nullptr;
  return chunk;
}

std::string GenerationJob::chat_chunk(int index, json delta, json finish_reason, json matched_stop,
                                      bool attach_logprobs) {
  json choice = {{"index", index}, {"delta", std::move(delta)}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
  if (!matched_stop.is_null()) choice["matched_stop"] = matched_stop;
  if (attach_logprobs && fields.logprobs && !acc[index].logprobs.empty()) {
    choice["logprobs"] = chat_logprobs(acc[index].logprobs);
    acc[index].logprobs.clear();
  }
  json chunk = chunk_base();
  chunk["choices"] = json::array({choice});
  return sse(with_usage(chunk));
}

std::string GenerationJob::completion_chunk(int index, const std::string& text, json finish_reason,
                                            json matched_stop) {
  json choice = {{"index", index}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
  if (!matched_stop.is_null()) choice["matched_stop"] = matched_stop;
  if (fields.logprobs && !acc[index].logprobs.empty()) {
    choice["logprobs"] = completion_logprobs(acc[index].logprobs, &acc[index].text_offset);
    acc[index].logprobs.clear();
  }
  json chunk = chunk_base();
  chunk["choices"] = json::array({choice});
  return sse(with_usage(chunk));
}

std::string GenerationJob::stream_prologue() {
  std::string out;
  for (int i = 0; i < static_cast<int>(choices.size()); ++i) {
    if (chat) {
      out += chat_chunk(i, json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr, false);
    } else if (!echo_of(i).empty()) {
      acc[i].text_offset = static_cast<int64_t>(echo_of(i).size());
      out += completion_chunk(i, echo_of(i), nullptr, nullptr);
    }
  }
  return out;
}

std::string GenerationJob::stream_events(std::vector<ChoiceDelta>& deltas) {
  std::string out;
  for (int i = 0; i < static_cast<int>(deltas.size()); ++i) {
    ChoiceDelta& d = deltas[i];
    ChoiceOutput& c = choices[i];
    Accum& a = acc[i];
    if (chat) {
      if (!stream_reasoning) {
        // Reasoning is held until it ends: the answer (or a tool call) starts, or the choice finishes.
        a.held_reasoning += d.reasoning;
        d.reasoning.clear();
        if (!a.held_reasoning.empty() && (!d.content.empty() || !d.tool_calls.empty() || c.finished()))
          d.reasoning.swap(a.held_reasoning);
      }
      if (!d.reasoning.empty()) out += chat_chunk(i, json{{"reasoning_content", d.reasoning}}, nullptr, nullptr, true);
      if (!d.content.empty()) out += chat_chunk(i, json{{"content", d.content}}, nullptr, nullptr, true);
      if (!d.tool_calls.empty()) {
        json calls = json::array();
        for (const auto& p : d.tool_calls) {
          if (!calls.empty() && calls.back()["index"] == p.index && p.name.empty()) {
            calls.back()["function"]["arguments"] =
                calls.back()["function"]["arguments"].get<std::string>() + p.arguments;
            continue;
          }
          json entry = {{"index", p.index}};
          if (!p.name.empty()) {
            entry["id"] = a.calls[p.index].id;
            entry["type"] = "function";
            entry["function"] = {{"name", p.name}, {"arguments", p.arguments}};
          } else {
            entry["function"] = {{"arguments", p.arguments}};
          }
          calls.push_back(entry);
        }
        out += chat_chunk(i, json{{"tool_calls", calls}}, nullptr, nullptr, true);
      }
    } else if (!d.content.empty()) {
      out += completion_chunk(i, d.content, nullptr, nullptr);
    }
    if (c.finished() && !a.finish_sent) {
      a.finish_sent = true;
      if (c.engine_reason() == engine::FinishReason::error) {
        out += sse(json::parse(error_body(500, "generation failed: " + c.error())));
        status = 500;
        continue;
      }
      if (c.engine_reason() == engine::FinishReason::abort) {
        // The server stopped the sequence: a shutdown that timed out (a client that left reads nothing). The
        // stream ends with an error event and no [DONE], so no client takes the cut-off text for a whole answer.
        out += sse(json::parse(error_body(shutdown_abort_error())));
        status = 503;
        done = true;
        return out;
      }
      if (chat)
        out += chat_chunk(i, json::object(), c.finish_reason_json(), c.matched_stop_json(), true);
      else
        out += completion_chunk(i, "", c.finish_reason_json(), c.matched_stop_json());
    }
  }
  if (all_finished() && !done) {
    done = true;
    if (fields.include_usage) {
      json chunk = chunk_base();
      chunk["choices"] = json::array();
      chunk["usage"] = usage();
      out += sse(chunk);
    }
    out += "data: [DONE]\n\n";
  }
  return out;
}

json GenerationJob::final_response() {
  json out_choices = json::array();
  for (int i = 0; i < static_cast<int>(choices.size()); ++i) {
    ChoiceOutput& c = choices[i];
    Accum& a = acc[i];
    json choice = {{"index", i}};
    if (chat) {
      json msg = {{"role", "assistant"},
                  {"content", a.content.empty() ? json(nullptr) : json(a.content)},
                  {"reasoning_content", a.reasoning.empty() ? json(nullptr) : json(a.reasoning)}};
      if (!a.calls.empty()) {
        json calls = json::array();
        for (size_t k = 0; k < a.calls.size(); ++k)
          calls.push_back({{"id", a.calls[k].id},
                           {"index", k},
                           {"type", "function"},
                           {"function", {{"name", a.calls[k].name}, {"arguments", a.calls[k].arguments}}}});
        msg["tool_calls"] = calls;
      } else {
        msg["tool_calls"] = nullptr;
      }
      choice["message"] = msg;
      choice["logprobs"] = fields.logprobs ? chat_logprobs(a.logprobs) : json(nullptr);
    } else {
      const std::string& echo_text = echo_of(i);
      std::string text = echo_text + a.content;
      choice["text"] = text;
      int64_t offset = static_cast<int64_t>(echo_text.size());
      choice["logprobs"] = fields.logprobs ? completion_logprobs(a.logprobs, &offset) : json(nullptr);
    }
    choice["finish_reason"] = c.finish_reason_json();
    choice["matched_stop"] = c.matched_stop_json();
    out_choices.push_back(choice);
  }
  json body = {{"id", id},
               {"object", chat ? "chat.completion" : "text_completion"},
               {"created", created},
               {"model", model_name},
               {"choices", out_choices},
               {"usage", usage()}};
  return body;
}

void GenerationJob::accumulate_text(const std::vector<ChoiceDelta>& deltas) {
  for (size_t i = 0; i < deltas.size(); ++i) {
    acc[i].reasoning += deltas[i].reasoning;
    acc[i].content += deltas[i].content;
  }
}

const std::string& GenerationJob::echo_of(size_t choice) const {
  static const std::string kNone;
  return choice < echo_texts.size() ? echo_texts[choice] : kNone;
}

std::string GenerationJob::finish_summary() const {
  std::string s;
  for (const auto& c : choices) {
    if (!s.empty()) s += ",";
    json r = c.finish_reason_json();
    s += r.is_null() ? "none" : r.get<std::string>();
  }
  return s;
}

// " dropped_tool_calls=a,b" when the tool-call parser dropped calls (unknown function, parallel_tool_calls false).
std::string GenerationJob::dropped_tool_calls() const {
  std::string names;
  for (const auto& c : choices)
    for (const auto& n : c.dropped_tool_calls()) names += (names.empty() ? "" : ",") + n;
  return names.empty() ? "" : " dropped_tool_calls=" + names;
}

void GenerationJob::log_line() const {
  auto now = Clock::now();
  KILN_LOG_INFO(
      "request id={} endpoint={} status={} stream={} n={} prompt_tokens={} output_tokens={} ttft_ms={:.1f} "
      "queue_ms={:.1f} latency_ms={:.1f} finish={}{}{}{}",
      request_id.empty() ? id : request_id, endpoint, status, fields.stream ? 1 : 0, choices.size(), prompt_tokens, completion_tokens(),
      got_first_token ? ms_between(start, first_token) : -1.0, queue_ms, ms_between(start, now),
      finish_summary(), client_gone ? " client_gone=1" : "", dropped_tool_calls(),
      !request_id.empty() && request_id != id ? " response_id=" + id : std::string());
}
}  // namespace kiln::server
