#include "server/anthropic_api.h"

#include "core/log.h"
#include "engine/engine.h"
#include "server/api_error.h"
#include "server/body_fields.h"
#include "server/generation.h"
#include "server/server_state.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

using json = nlohmann::json;

namespace {

constexpr std::string_view kMessagesFields[] = {
    "model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
    "tools", "tool_choice", "thinking",
    "metadata", "service_tier",  // accepted and ignored: nothing for kiln to act on
};

std::string where_of(size_t message, size_t block) {
  return item_path(item_path("messages", message) + ".content", block);
}

// Text of a string or a list of text blocks (system, tool_result content), joined with newlines.
std::string text_of(const ojson& v, const std::string& where) {
  return joined_text(v, where, "a list of text blocks", [](const ojson& block, const std::string& w) {
    if (!block.is_object() || block.value("type", "") != "text")
      throw bad_param(w, "'" + w + "' must be a text block (this model reads text only)");
    return string_field(block, "text", w);
  });
}

// An Anthropic image block's source as an image URL: {type: base64, media_type, data} -> a data URL, {type: url, url}.
std::string image_block_url(const ojson& block, const std::string& w) {
  if (!block.contains("source") || !block["source"].is_object())
    throw bad_param(w + ".source", "'" + w + ".source' is required: {type: base64, media_type, data} or {type: url, url}");
  const ojson& src = block["source"];
  const std::string type = string_field(src, "type", w + ".source");
  if (type == "base64")
    return "data:" + string_field(src, "media_type", w + ".source") + ";base64," + string_field(src, "data", w + ".source");
  if (type == "url") return string_field(src, "url", w + ".source");
  throw bad_param(w + ".source.type", "image sources of type '" + type + "' are not supported (use base64 or url)");
}

// One Anthropic user message -> tool messages (its tool_result blocks) then a user message (its text and image
// blocks: one string when it has no image, else chat content parts).
void add_user_message(const ojson& content, size_t m, ojson& out) {
  if (content.is_string()) {
    out.push_back({{"role", "user"}, {"content", content}});
    return;
  }
  std::string text;
  ojson parts = ojson::array();
  bool has_text = false, has_image = false;
  for (size_t b = 0; b < content.size(); ++b) {
    const ojson& block = content[b];
    const std::string w = where_of(m, b);
    const std::string type = block.value("type", "");
    if (type == "text") {
      const std::string t = string_field(block, "text", w);
      text += (has_text ? "\n" : "") + t;
      parts.push_back({{"type", "text"}, {"text", t}});
      has_text = true;
    } else if (type == "image") {
      parts.push_back({{"type", "image_url"}, {"image_url", {{"url", image_block_url(block, w)}}}});
      has_image = true;
    } else if (type == "tool_result") {
      const std::string id = string_field(block, "tool_use_id", w);
      std::string result = block.contains("content") ? text_of(block["content"], w + ".content") : "";
      if (block.value("is_error", false)) result = "Error: " + result;
      out.push_back({{"role", "tool"}, {"tool_call_id", id}, {"content", result}});
    } else {
      throw bad_param(w, "content blocks of type '" + type + "' are not supported in user messages (use text, image "
                         "or tool_result)");
    }
  }
  if (has_image) out.push_back({{"role", "user"}, {"content", std::move(parts)}});
  else if (has_text) out.push_back({{"role", "user"}, {"content", text}});
}

// One Anthropic assistant message -> an assistant message with content, reasoning_content and tool_calls.
void add_assistant_message(const ojson& content, size_t m, ojson& out) {
  ojson msg = {{"role", "assistant"}, {"content", ""}};
  if (content.is_string()) {
    msg["content"] = content;
    out.push_back(std::move(msg));
    return;
  }
  std::string text, reasoning;
  ojson calls = ojson::array();
  for (size_t b = 0; b < content.size(); ++b) {
    const ojson& block = content[b];
    const std::string w = where_of(m, b);
    const std::string type = block.value("type", "");
    if (type == "text") {
      text += string_field(block, "text", w);
    } else if (type == "thinking") {
      reasoning += string_field(block, "thinking", w);
    } else if (type == "redacted_thinking") {
      continue;  // another model's encrypted reasoning: nothing this one can read
    } else if (type == "tool_use") {
      const ojson& input = typed_field(block, "input", w, &ojson::is_object, "an object");
      calls.push_back({{"id", typed_field(block, "id", w, &ojson::is_string, "a string")},
                       {"type", "function"},
                       {"function",
                        {{"name", typed_field(block, "name", w, &ojson::is_string, "a string")}, {"arguments", input.dump()}}}});
    } else {
      throw bad_param(w, "content blocks of type '" + type + "' are not supported in assistant messages");
    }
  }
  msg["content"] = text;
  if (!reasoning.empty()) msg["reasoning_content"] = reasoning;
  if (!calls.empty()) msg["tool_calls"] = calls;
  out.push_back(std::move(msg));
}

ojson chat_messages(const ojson& body) {
  ojson out = ojson::array();
  if (auto sys = body.find("system"); sys != body.end() && !sys->is_null())
    out.push_back({{"role", "system"}, {"content", text_of(*sys, "system")}});
  auto it = body.find("messages");
  if (it == body.end() || !it->is_array() || it->empty())
    throw bad_param("messages", "'messages' is required: a non-empty list of {role, content}");
  for (size_t m = 0; m < it->size(); ++m) {
    const ojson& msg = (*it)[m];
    const std::string w = item_path("messages", m);
    if (!msg.is_object()) throw bad_param(w, "'" + w + "' must be an object");
    const std::string role = msg.value("role", "");
    auto content = msg.find("content");
    if (content == msg.end() || !(content->is_string() || content->is_array()))
      throw bad_param(w + ".content", "'" + w + ".content' must be a string or a list of content blocks");
    if (role == "user") add_user_message(*content, m, out);
    else if (role == "assistant") add_assistant_message(*content, m, out);
    else throw bad_param(w + ".role", "'" + w + ".role' must be user or assistant (system goes in 'system')");
  }
  return out;
}

ojson chat_tools(const ojson& tools) {
  return chat_function_tools(tools, [](const ojson& t, const std::string& w) {
    if (!t.is_object()) throw bad_param(w, "'" + w + "' must be an object");
    if (t.contains("type") && t["type"] != "custom")
      throw bad_param(w + ".type", "only client tools {name, description, input_schema} are supported; '" +
                                       t["type"].dump() + "' is a server tool");
    ojson fn = {{"name", typed_field(t, "name", w, &ojson::is_string, "a string")}};
    if (t.contains("description")) fn["description"] = t["description"];
    fn["parameters"] = typed_field(t, "input_schema", w, &ojson::is_object, "an object (a JSON schema)");
    return fn;
  });
}

// tool_choice -> (OpenAI tool_choice, parallel_tool_calls).
void chat_tool_choice(const ojson& choice, ojson& chat) {
  if (!choice.is_object() || !choice.contains("type") || !choice["type"].is_string())
    throw bad_param("tool_choice", "'tool_choice' must be an object {type: auto | any | tool | none}");
  const std::string type = choice["type"].get<std::string>();
  if (type == "auto") chat["tool_choice"] = "auto";
  else if (type == "any") chat["tool_choice"] = "required";
  else if (type == "none") chat["tool_choice"] = "none";
  else if (type == "tool")
    chat["tool_choice"] = {{"type", "function"},
                           {"function", {{"name", typed_field(choice, "name", "tool_choice", &ojson::is_string, "a string")}}}};
  else throw bad_param("tool_choice.type", "'tool_choice.type' must be auto, any, tool or none");
  if (auto d = choice.find("disable_parallel_tool_use"); d != choice.end() && d->is_boolean() && d->get<bool>())
    chat["parallel_tool_calls"] = false;
}

// thinking -> (on, budget); the chat template's enable_thinking follows.
void parse_thinking(const ojson& body, MessagesRequest& out) {
  auto it = body.find("thinking");
  if (it == body.end() || it->is_null()) return;
  if (!it->is_object() || !it->contains("type")) throw bad_param("thinking", "'thinking' must be {type: enabled | disabled}");
  const ojson& type = (*it)["type"];
  if (type == "disabled") return;
  if (type != "enabled") throw bad_param("thinking.type", "'thinking.type' must be enabled or disabled");
  out.thinking = true;
  if (auto b = it->find("budget_tokens"); b != it->end() && !b->is_null()) {
    if (!b->is_number_integer() || b->get<int64_t>() < 1)
      throw bad_param("thinking.budget_tokens", "'thinking.budget_tokens' must be a positive integer");
    out.thinking_budget = b->get<int64_t>();
  }
}

}  // namespace

MessagesRequest parse_messages_request(const ojson& body, const ProtocolLimits& limits, bool count_only) {
  check_known_fields(body, kMessagesFields, "/v1/messages");
  MessagesRequest out;
  ojson chat = ojson::object();
  if (body.contains("model")) chat["model"] = body["model"];
  chat["messages"] = chat_messages(body);
  if (!count_only) {
    auto mt = body.find("max_tokens");
    if (mt == body.end() || !mt->is_number_integer() || mt->get<int64_t>() < 1)
      throw bad_param("max_tokens", "'max_tokens' is required: a positive integer");
    chat["max_tokens"] = *mt;
  }
  if (auto t = body.find("temperature"); t != body.end() && !t->is_null()) {
    if (!t->is_number() || t->get<double>() < 0.0 || t->get<double>() > 1.0)
      throw bad_param("temperature", "'temperature' must be a number from 0 to 1");
    chat["temperature"] = *t;
  }
  for (const char* key : {"top_p", "top_k", "stream"})
    if (body.contains(key)) chat[key] = body[key];
  if (auto s = body.find("stop_sequences"); s != body.end() && !s->is_null()) chat["stop"] = *s;
  if (auto t = body.find("tools"); t != body.end() && !t->is_null()) chat["tools"] = chat_tools(*t);
  if (auto c = body.find("tool_choice"); c != body.end() && !c->is_null()) chat_tool_choice(*c, chat);
  parse_thinking(body, out);
  if (out.thinking_budget && chat.contains("max_tokens") && *out.thinking_budget >= chat["max_tokens"].get<int64_t>())
    throw bad_param("thinking.budget_tokens", "'thinking.budget_tokens' must be less than 'max_tokens'");
  chat["chat_template_kwargs"] = {{"enable_thinking", out.thinking}};
  out.chat = parse_chat_body(chat, limits);
  return out;
}

// --- rendering ---

std::string AnthropicJob::event(const char* name, const json& data) const {
  return std::string("event: ") + name + "\ndata: " + dump_json(data) + "\n\n";
}

json AnthropicJob::anthropic_usage() const {
  return {{"input_tokens", prompt_tokens - cached_tokens},
          {"output_tokens", completion_tokens()},
          {"cache_read_input_tokens", cached_tokens},
          {"cache_creation_input_tokens", 0}};
}

std::string AnthropicJob::stop_reason() const {
  const ChoiceOutput& c = choices.at(0);
  if (c.num_tool_calls() > 0) return "tool_use";
  switch (c.engine_reason()) {
    case engine::FinishReason::length: return "max_tokens";
    case engine::FinishReason::stop: return c.matched_stop_json().is_string() ? "stop_sequence" : "end_turn";
    default: return "end_turn";
  }
}

json AnthropicJob::stop_sequence() const {
  json m = choices.at(0).matched_stop_json();
  return m.is_string() ? m : json(nullptr);
}

std::string AnthropicJob::stream_prologue() { return ""; }  // message_start waits for the cache figures

std::string AnthropicJob::message_start() {
  message_started_ = true;
  json msg = {{"id", id},           {"type", "message"},       {"role", "assistant"},
              {"model", model_name}, {"content", json::array()}, {"stop_reason", nullptr},
              {"stop_sequence", nullptr}, {"usage", anthropic_usage()}};
  msg["usage"]["output_tokens"] = 0;
  return event("message_start", {{"type", "message_start"}, {"message", msg}}) + event("ping", {{"type", "ping"}});
}

std::string AnthropicJob::block_event(const BlockEvent& e) {
  if (e.op == BlockEvent::close) return event("content_block_stop", {{"type", "content_block_stop"}, {"index", e.index}});
  if (e.op == BlockEvent::open) {
    json block;
    if (e.kind == BlockKind::reasoning) block = {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}};
    else if (e.kind == BlockKind::text) block = {{"type", "text"}, {"text", ""}};
    else block = {{"type", "tool_use"}, {"id", acc[0].calls.at(e.tool_index).id}, {"name", e.name}, {"input", json::object()}};
    return event("content_block_start", {{"type", "content_block_start"}, {"index", e.index}, {"content_block", block}});
  }
  json delta;
  if (e.kind == BlockKind::reasoning) delta = {{"type", "thinking_delta"}, {"thinking", e.text}};
  else if (e.kind == BlockKind::text) delta = {{"type", "text_delta"}, {"text", e.text}};
  else delta = {{"type", "input_json_delta"}, {"partial_json", e.text}};
  return event("content_block_delta", {{"type", "content_block_delta"}, {"index", e.index}, {"delta", delta}});
}

std::string AnthropicJob::finish_events() {
  std::string out;
  for (const auto& e : blocks_.finish()) out += block_event(e);
  const ChoiceOutput& c = choices[0];
  if (c.engine_reason() == engine::FinishReason::error) {
    status = 500;
    return out + event("error", anthropic_error_json(500, "generation failed: " + c.error()));
  }
  if (c.engine_reason() == engine::FinishReason::abort) {  // a shutdown that timed out: an error, never end_turn
    status = 503;
    return out + event("error", anthropic_error_json(503, shutdown_abort_error().what()));
  }
  json usage = anthropic_usage();
  out += event("message_delta", {{"type", "message_delta"},
                                 {"delta", {{"stop_reason", stop_reason()}, {"stop_sequence", stop_sequence()}}},
                                 {"usage", usage}});
  return out + event("message_stop", {{"type", "message_stop"}});
}

std::string AnthropicJob::stream_events(std::vector<ChoiceDelta>& deltas) {
  std::string out;
  if (!message_started_) out += message_start();
  for (const auto& e : blocks_.push(deltas.at(0))) out += block_event(e);
  if (choices[0].finished() && !done) {
    done = true;
    out += finish_events();
  }
  return out;
}

json AnthropicJob::final_response() {
  const Accum& a = acc.at(0);
  json content = json::array();
  if (!a.reasoning.empty()) content.push_back({{"type", "thinking"}, {"thinking", a.reasoning}, {"signature", ""}});
  if (a.content.find_first_not_of(" \t\r\n") != std::string::npos)
    content.push_back({{"type", "text"}, {"text", a.content}});
  for (const auto& call : a.calls) {
    json input = json::parse(call.arguments.empty() ? "{}" : call.arguments, nullptr, false);
    content.push_back({{"type", "tool_use"},
                       {"id", call.id},
                       {"name", call.name},
                       {"input", input.is_discarded() ? json::object() : input}});
  }
  return {{"id", id},
          {"type", "message"},
          {"role", "assistant"},
          {"model", model_name},
          {"content", content},
          {"stop_reason", stop_reason()},
          {"stop_sequence", stop_sequence()},
          {"usage", anthropic_usage()}};
}

// --- routes ---

namespace {

void handle_messages(ServerState& s, const httplib::Request& req, httplib::Response& res) {
  s.require_generation();
  MessagesRequest mr = parse_messages_request(parse_json_object(req.body), s.limits);
  s.check_model_name(mr.chat.model);
  PreparedChat p = prepare_chat(s, mr.chat);
  auto job = std::make_shared<AnthropicJob>();
  job->chat = true;
  init_job(s, *job, "msg_", "/v1/messages", mr.chat);
  if (mr.thinking_budget && p.choice.start_in_reasoning) job->reasoning_budget = *mr.thinking_budget;
  job->images = std::move(p.images);
  run_generation(s, req, res, job, {p.prompt}, p.choice, "messages");
}

void handle_count_tokens(ServerState& s, const httplib::Request& req, httplib::Response& res) {
  s.require_model();
  MessagesRequest mr = parse_messages_request(parse_json_object(req.body), s.limits, /*count_only=*/true);
  s.check_model_name(mr.chat.model);
  PreparedChat p = prepare_chat(s, mr.chat);
  send_json(res, 200, {{"input_tokens", p.prompt.size()}});
}

}  // namespace

void add_anthropic_routes(Routes& routes, ServerState& state) {
  routes.post("/v1/messages", [&state](const auto& q, auto& r) { handle_messages(state, q, r); },
              ErrorStyle::anthropic);
  routes.post("/v1/messages/count_tokens", [&state](const auto& q, auto& r) { handle_count_tokens(state, q, r); },
              ErrorStyle::anthropic);
}

}  // namespace kiln::server
