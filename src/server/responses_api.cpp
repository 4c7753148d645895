#include "server/responses_api.h"

#include <string_view>

#include "engine/engine.h"
#include "server/api_error.h"
#include "server/body_fields.h"
#include "server/generation.h"
#include "server/server_state.h"

namespace kiln::server {

using json = nlohmann::json;

namespace {

constexpr std::string_view kResponsesFields[] = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "text", "reasoning", "stream", "store", "previous_response_id",
    // accepted and ignored: records for the provider, or hints with nothing for kiln to act on
    "metadata", "user", "include", "prompt_cache_key", "safety_identifier", "service_tier", "truncation",
};

// Message content: a string or a list of text parts (input_text, output_text, text), joined with newlines.
std::string content_text(const ojson& content, const std::string& where) {
  return joined_text(content, where, "a list of content parts", [](const ojson& part, const std::string& w) {
    const std::string type = part.is_object() ? part.value("type", "") : "";
    if (type != "input_text" && type != "output_text" && type != "text")
      throw bad_param(w, "content parts of type '" + type + "' are not supported (this model reads text only)");
    return string_field(part, "text", w);
  });
}

// A message's content with input_image parts: chat content parts (text, image_url) for protocol.h to read. Null when
// the content has no image (content_text then joins its text).
ojson content_parts_with_images(const ojson& content, const std::string& where) {
  if (!content.is_array()) return nullptr;
  bool any = false;
  for (const ojson& part : content) any = any || (part.is_object() && part.value("type", "") == "input_image");
  if (!any) return nullptr;
  ojson parts = ojson::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& part = content[i];
    const std::string w = item_path(where, i);
    const std::string type = part.is_object() ? part.value("type", "") : "";
    if (type == "input_image") {
      if (part.contains("file_id") && !part["file_id"].is_null())
        throw bad_param(w + ".file_id", "input_image by file_id is not supported (kiln has no Files API); send "
                                        "'image_url' with a data URL or an image URL");
      parts.push_back({{"type", "image_url"}, {"image_url", {{"url", string_field(part, "image_url", w)}}}});
    } else if (type == "input_text" || type == "output_text" || type == "text") {
      parts.push_back({{"type", "text"}, {"text", string_field(part, "text", w)}});
    } else {
      throw bad_param(w, "content parts of type '" + type + "' are not supported (use input_text or input_image)");
    }
  }
  return parts;
}

// Appends to the last message when it is an assistant turn still open for more (reasoning, calls), else a new one.
ojson& assistant_turn(ojson& msgs) {
  if (msgs.empty() || msgs.back()["role"] != "assistant") msgs.push_back({{"role", "assistant"}, {"content", ""}});
  return msgs.back();
}

void add_item(const ojson& item, const std::string& w, ojson& msgs) {
  if (!item.is_object()) throw bad_param(w, "'" + w + "' must be an object");
  const std::string type = item.value("type", item.contains("role") ? "message" : "");
  if (type == "message") {
    std::string role = string_field(item, "role", w);
    if (role == "developer") role = "system";
    if (role != "user" && role != "assistant" && role != "system")
      throw bad_param(w + ".role", "'" + w + ".role' must be user, assistant, system or developer");
    const ojson content = item.contains("content") ? item["content"] : ojson("");
    if (ojson parts = content_parts_with_images(content, w + ".content"); !parts.is_null()) {
      if (role != "user") throw bad_param(w + ".content", "input_image parts are accepted in user messages only");
      msgs.push_back({{"role", role}, {"content", std::move(parts)}});
      return;
    }
    std::string text = content_text(content, w + ".content");
    ojson& last = msgs.empty() ? msgs : msgs.back();
    // An assistant message after its reasoning item is the same turn.
    if (role == "assistant" && !msgs.empty() && last["role"] == "assistant" && last["content"] == "" &&
        !last.contains("tool_calls"))
      last["content"] = text;
    else
      msgs.push_back({{"role", role}, {"content", text}});
  } else if (type == "function_call") {
    ojson& turn = assistant_turn(msgs);
    if (!turn.contains("tool_calls")) turn["tool_calls"] = ojson::array();
    turn["tool_calls"].push_back({{"id", string_field(item, "call_id", w)},
                                  {"type", "function"},
                                  {"function", {{"name", string_field(item, "name", w)}, {"arguments", string_field(item, "arguments", w)}}}});
  } else if (type == "function_call_output") {
    const ojson& output = item.contains("output") ? item["output"] : ojson("");
    msgs.push_back({{"role", "tool"}, {"tool_call_id", string_field(item, "call_id", w)},
                    {"content", content_text(output, w + ".output")}});
  } else if (type == "reasoning") {
    std::string text;
    for (const char* key : {"content", "summary"})
      if (item.contains(key) && item[key].is_array() && text.empty())
        for (const auto& part : item[key])
          if (part.is_object() && part.contains("text") && part["text"].is_string()) text += part["text"].get<std::string>();
    msgs.push_back({{"role", "assistant"}, {"content", ""}, {"reasoning_content", text}});
  } else {
    throw bad_param(w + ".type", "input items of type '" + type +
                                     "' are not supported (use message, function_call, function_call_output or reasoning)");
  }
}

ojson input_messages(const ojson& body) {
  ojson msgs = ojson::array();
  auto it = body.find("input");
  if (it == body.end() || it->is_null()) throw bad_param("input", "'input' is required: a string or a list of items");
  if (it->is_string()) {
    msgs.push_back({{"role", "user"}, {"content", *it}});
  } else if (it->is_array()) {
    for (size_t i = 0; i < it->size(); ++i) add_item((*it)[i], item_path("input", i), msgs);
  } else {
    throw bad_param("input", "'input' must be a string or a list of items");
  }
  return msgs;
}

ojson chat_tools(const ojson& tools) {
  return chat_function_tools(tools, [](const ojson& t, const std::string& w) {
    if (!t.is_object() || t.value("type", "") != "function")
      throw bad_param(w + ".type", "only tools of type 'function' are supported");
    ojson fn = {{"name", string_field(t, "name", w)}};
    for (const char* key : {"description", "parameters", "strict"})
      if (t.contains(key) && !t[key].is_null()) fn[key] = t[key];
    return fn;
  });
}

ojson chat_tool_choice(const ojson& c) {
  if (c.is_string()) return c;  // auto, none, required (checked by protocol.h)
  if (c.is_object() && c.value("type", "") == "function")
    return {{"type", "function"}, {"function", {{"name", string_field(c, "name", "tool_choice")}}}};
  throw bad_param("tool_choice", "'tool_choice' must be auto, none, required or {type: function, name}");
}

// text.format -> response_format.
ojson chat_response_format(const ojson& text) {
  if (!text.is_object()) throw bad_param("text", "'text' must be an object");
  auto f = text.find("format");
  if (f == text.end() || f->is_null()) return nullptr;
  const std::string type = f->is_object() ? f->value("type", "") : "";
  if (type == "text") return nullptr;
  if (type == "json_object") return {{"type", "json_object"}};
  if (type != "json_schema") throw bad_param("text.format", "'text.format.type' must be text, json_object or json_schema");
  ojson schema = {{"name", f->value("name", "response")}};
  if (!f->contains("schema")) throw bad_param("text.format.schema", "'text.format.schema' is required");
  schema["schema"] = (*f)["schema"];
  if (f->contains("strict")) schema["strict"] = (*f)["strict"];
  return {{"type", "json_schema"}, {"json_schema", schema}};
}

// The request fields a response object repeats (OpenAI's defaults where absent).
json echo_fields(const ojson& body) {
  json e = {{"instructions", nullptr}, {"max_output_tokens", nullptr}, {"parallel_tool_calls", true},
            {"temperature", nullptr},  {"top_p", nullptr},             {"tool_choice", "auto"},
            {"tools", json::array()},  {"text", {{"format", {{"type", "text"}}}}},
            {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}}, {"metadata", json::object()},
            {"truncation", "disabled"}};
  for (auto& [key, value] : e.items())
    if (body.contains(key) && !body[key].is_null()) value = json::parse(body[key].dump());
  return e;
}

}  // namespace

ResponsesRequest parse_responses_request(const ojson& body, const ProtocolLimits& limits, const ojson& previous) {
  check_known_fields(body, kResponsesFields, "/v1/responses");
  ResponsesRequest out;
  out.conversation = previous.is_array() ? previous : ojson::array();
  for (auto& m : input_messages(body)) out.conversation.push_back(std::move(m));
  ojson chat = ojson::object();
  if (body.contains("model")) chat["model"] = body["model"];
  ojson messages = ojson::array();
  if (auto ins = body.find("instructions"); ins != body.end() && !ins->is_null()) {
    if (!ins->is_string()) throw bad_param("instructions", "'instructions' must be a string");
    messages.push_back({{"role", "system"}, {"content", *ins}});
  }
  for (const auto& m : out.conversation) messages.push_back(m);
  chat["messages"] = messages;
  if (auto m = body.find("max_output_tokens"); m != body.end()) chat["max_tokens"] = *m;
  for (const char* key : {"temperature", "top_p", "stream", "parallel_tool_calls"})
    if (body.contains(key)) chat[key] = body[key];
  if (auto t = body.find("tools"); t != body.end() && !t->is_null()) chat["tools"] = chat_tools(*t);
  if (auto c = body.find("tool_choice"); c != body.end() && !c->is_null()) chat["tool_choice"] = chat_tool_choice(*c);
  if (auto t = body.find("text"); t != body.end() && !t->is_null()) chat["response_format"] = chat_response_format(*t);
  if (auto r = body.find("reasoning"); r != body.end() && r->is_object() && r->contains("effort")) {
    const ojson& effort = (*r)["effort"];
    if (effort == "none" || effort == "minimal") chat["chat_template_kwargs"] = {{"enable_thinking", false}};
  }
  if (auto s = body.find("store"); s != body.end() && !s->is_null()) {
    if (!s->is_boolean()) throw bad_param("store", "'store' must be a boolean");
    out.store = s->get<bool>();
  }
  if (auto p = body.find("previous_response_id"); p != body.end() && !p->is_null())
    out.previous_response_id = p->get<std::string>();
  out.echo = echo_fields(body);
  try {
    out.chat = parse_chat_body(chat, limits);
  } catch (const ApiError& e) {
    // Name the Responses field where the chat one differs.
    if (e.param == "max_tokens") throw ApiError(e.status, e.what(), "max_output_tokens", e.code, e.type);
    throw;
  }
  return out;
}

// --- rendering ---

namespace {

json reasoning_item(const std::string& id, const std::string& text) {
  return {{"id", id}, {"type", "reasoning"}, {"summary", json::array()},
          {"content", json::array({{{"type", "reasoning_text"}, {"text", text}}})}};
}

json output_text_part(const std::string& text) {
  return {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}, {"logprobs", json::array()}};
}

json message_item(const std::string& id, const std::string& text, const char* status) {
  return {{"id", id}, {"type", "message"}, {"status", status}, {"role", "assistant"},
          {"content", json::array({output_text_part(text)})}};
}

json call_item(const std::string& id, const std::string& call_id, const std::string& name, const std::string& args,
               const char* status) {
  return {{"id", id}, {"type", "function_call"}, {"status", status}, {"call_id", call_id}, {"name", name},
          {"arguments", args}};
}

}  // namespace

json ResponsesJob::responses_usage() const {
  const int64_t out = completion_tokens();
  return {{"input_tokens", prompt_tokens},
          {"input_tokens_details", {{"cached_tokens", cached_tokens}}},
          {"output_tokens", out},
          {"output_tokens_details", {{"reasoning_tokens", choices.at(0).reasoning_tokens()}}},
          {"total_tokens", prompt_tokens + out}};
}

const char* ResponsesJob::status_word() const {
  const ChoiceOutput& c = choices.at(0);
  if (!c.finished()) return "in_progress";
  switch (c.engine_reason()) {
    case engine::FinishReason::error:
    case engine::FinishReason::abort: return "failed";  // abort: a shutdown that timed out, never "completed"
    case engine::FinishReason::length: return "incomplete";
    default: return "completed";
  }
}

json ResponsesJob::response_object(json output) const {
  const ChoiceOutput& c = choices.at(0);
  json r = echo;
  r["id"] = id;
  r["object"] = "response";
  r["created_at"] = created;
  r["model"] = model_name;
  r["output"] = std::move(output);
  r["previous_response_id"] = previous_response_id ? json(*previous_response_id) : json(nullptr);
  r["store"] = store != nullptr;
  r["error"] = nullptr;
  r["incomplete_details"] = nullptr;
  r["usage"] = nullptr;
  r["status"] = status_word();
  if (c.finished()) {
    if (c.engine_reason() == engine::FinishReason::error)
      r["error"] = {{"code", "server_error"}, {"message", "generation failed: " + c.error()}};
    else if (c.engine_reason() == engine::FinishReason::abort)
      r["error"] = {{"code", "server_shutting_down"}, {"message", shutdown_abort_error().what()}};
    else if (c.engine_reason() == engine::FinishReason::length)
      r["incomplete_details"] = {{"reason", "max_output_tokens"}};
    r["usage"] = responses_usage();
  }
  return r;
}

void ResponsesJob::keep(const json& response) {
  if (!store) return;
  const Accum& a = acc.at(0);
  ojson turn = {{"role", "assistant"}, {"content", a.content}};
  if (!a.reasoning.empty()) turn["reasoning_content"] = a.reasoning;
  if (!a.calls.empty()) {
    turn["tool_calls"] = ojson::array();
    for (const auto& call : a.calls)
      turn["tool_calls"].push_back(
          {{"id", call.id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
  }
  ResponseStore::Entry e{conversation, response};
  e.conversation.push_back(std::move(turn));
  store->put(id, std::move(e));
}

json ResponsesJob::final_response() {
  const Accum& a = acc.at(0);
  json output = json::array();
  // The last item of a response that did not complete (max_output_tokens, a shutdown) is incomplete; items before
  // it ended on their own.
  const bool completed = std::string_view(status_word()) == "completed";
  if (!a.reasoning.empty()) output.push_back(reasoning_item("rs_" + random_hex(24), a.reasoning));
  if (a.content.find_first_not_of(" \t\r\n") != std::string::npos)
    output.push_back(message_item("msg_" + random_hex(24), a.content, completed || !a.calls.empty() ? "completed"
                                                                                                    : "incomplete"));
  for (size_t k = 0; k < a.calls.size(); ++k) {
    const auto& call = a.calls[k];
    const bool last = k + 1 == a.calls.size();
    output.push_back(call_item("fc_" + random_hex(24), call.id, call.name, call.arguments,
                               completed || !last ? "completed" : "incomplete"));
  }
  json r = response_object(std::move(output));
  keep(r);
  return r;
}

std::string ResponsesJob::event(const std::string& type, json data) {
  data["type"] = type;
  data["sequence_number"] = sequence_++;
  return "event: " + type + "\ndata: " + dump_json(data) + "\n\n";
}

std::string ResponsesJob::stream_prologue() {
  json r = response_object(json::array());
  std::string out = event("response.created", {{"response", r}});  // two statements: sequence numbers in order
  return out + event("response.in_progress", {{"response", r}});
}

std::string ResponsesJob::block_event(const BlockEvent& e) {
  const size_t i = static_cast<size_t>(e.index);
  const json where = {{"output_index", e.index}};
  if (e.op == BlockEvent::open) {
    if (e.kind == BlockKind::reasoning) items_.push_back(reasoning_item("rs_" + random_hex(24), ""));
    else if (e.kind == BlockKind::text) items_.push_back(message_item("msg_" + random_hex(24), "", "in_progress"));
    else items_.push_back(call_item("fc_" + random_hex(24), acc[0].calls.at(e.tool_index).id, e.name, "", "in_progress"));
    texts_.emplace_back();
    json added = items_[i];
    if (e.kind != BlockKind::tool_call) added["content"] = json::array();
    std::string out = event("response.output_item.added", {{"output_index", e.index}, {"item", added}});
    if (e.kind != BlockKind::tool_call)
      out += event("response.content_part.added", {{"item_id", items_[i]["id"]}, {"output_index", e.index},
                                                   {"content_index", 0}, {"part", items_[i]["content"][0]}});
    return out;
  }
  const json item_id = items_.at(i)["id"];
  if (e.op == BlockEvent::append) {
    texts_[i] += e.text;
    if (e.kind == BlockKind::tool_call)
      return event("response.function_call_arguments.delta", {{"item_id", item_id}, {"output_index", e.index}, {"delta", e.text}});
    json d = {{"item_id", item_id}, {"output_index", e.index}, {"content_index", 0}, {"delta", e.text}};
    if (e.kind == BlockKind::text) d["logprobs"] = json::array();
    return event(e.kind == BlockKind::text ? "response.output_text.delta" : "response.reasoning_text.delta", d);
  }
  // close
  json& item = items_[i];
  std::string out;
  if (e.kind == BlockKind::tool_call) {
    item["arguments"] = texts_[i];
    item["status"] = closing_status_;
    out += event("response.function_call_arguments.done",
                 {{"item_id", item_id}, {"output_index", e.index}, {"name", item["name"]}, {"arguments", texts_[i]}});
  } else {
    item["content"][0]["text"] = texts_[i];
    if (e.kind == BlockKind::text) item["status"] = closing_status_;
    const char* done = e.kind == BlockKind::text ? "response.output_text.done" : "response.reasoning_text.done";
    out += event(done, {{"item_id", item_id}, {"output_index", e.index}, {"content_index", 0}, {"text", texts_[i]}});
    out += event("response.content_part.done", {{"item_id", item_id}, {"output_index", e.index}, {"content_index", 0},
                                                {"part", item["content"][0]}});
  }
  return out + event("response.output_item.done", {{"output_index", e.index}, {"item", item}});
}

std::string ResponsesJob::finish_events() {
  std::string out;
  // The blocks still open end with the response: complete only if it is.
  if (std::string_view(status_word()) != "completed") closing_status_ = "incomplete";
  for (const auto& e : blocks_.finish()) out += block_event(e);
  json r = response_object(json(items_));
  const std::string status = r["status"];
  if (status == "failed") this->status = 500;
  else keep(r);
  const char* type = status == "completed" ? "response.completed"
                     : status == "incomplete" ? "response.incomplete"
                                              : "response.failed";
  return out + event(type, {{"response", r}});
}

std::string ResponsesJob::stream_events(std::vector<ChoiceDelta>& deltas) {
  ChoiceDelta& d = deltas.at(0);
  acc[0].reasoning += d.reasoning;  // the stored conversation needs the whole text
  acc[0].content += d.content;
  std::string out;
  for (const auto& e : blocks_.push(d)) out += block_event(e);
  if (choices[0].finished() && !done) {
    done = true;
    out += finish_events();
  }
  return out;
}

// --- route ---

namespace {

void handle_responses(ServerState& s, const httplib::Request& req, httplib::Response& res) {
  s.require_generation();
  ojson body = parse_json_object(req.body);
  ojson previous;
  if (auto p = body.find("previous_response_id"); p != body.end() && !p->is_null()) {
    if (!p->is_string()) throw bad_param("previous_response_id", "'previous_response_id' must be a string");
    auto entry = s.responses.get(p->get<std::string>());
    if (!entry)
      throw ApiError(404,
                     "previous response '" + p->get<std::string>() +
                         "' is not stored here (never stored, store was false, or it expired or was evicted: "
                         "the store keeps " + std::to_string(s.responses.options().max_entries) + " responses for " +
                         std::to_string(s.responses.options().max_age_s) + " s); send the whole conversation as input",
                     "previous_response_id", "previous_response_not_found");
    previous = std::move(entry->conversation);
  }
  ResponsesRequest rr = parse_responses_request(body, s.limits, previous);
  s.check_model_name(rr.chat.model);
  PreparedChat p = prepare_chat(s, rr.chat, "input");
  auto job = std::make_shared<ResponsesJob>();
  job->chat = true;
  init_job(s, *job, "resp_", "/v1/responses", rr.chat);
  job->store = rr.store && s.responses.options().max_entries > 0 ? &s.responses : nullptr;
  job->conversation = std::move(rr.conversation);
  job->echo = std::move(rr.echo);
  job->previous_response_id = rr.previous_response_id;
  job->images = std::move(p.images);
  run_generation(s, req, res, job, {p.prompt}, p.choice, "input");
}

}  // namespace

void add_responses_routes(Routes& routes, ServerState& state) {
  routes.post("/v1/responses", [&state](const auto& q, auto& r) { handle_responses(state, q, r); });
}

}  // namespace kiln::server
