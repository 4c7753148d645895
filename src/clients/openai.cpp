#include "clients/openai.h"

#include <chrono>

#include "clients/sse.h"

namespace kiln::clients {

namespace {

void add_sampling(nlohmann::json& body, const GenerationParams& params) {
  body["max_tokens"] = params.max_tokens;
  body["temperature"] = params.temperature;
  if (params.ignore_eos) body["ignore_eos"] = true;
  if (params.seed) body["seed"] = *params.seed;
  if (params.skip_special_tokens) body["skip_special_tokens"] = *params.skip_special_tokens;
  body["stream"] = params.stream;
  if (params.stream) body["stream_options"] = {{"include_usage", true}};
}

std::string short_text(std::string_view text, size_t max_chars = 120) {
  std::string out(text.substr(0, max_chars));
  for (char& c : out)
    if (c == '\n' || c == '\r') c = ' ';
  if (text.size() > max_chars) out += "...";
  return out;
}

// Appends a string field of `object` to `out`; returns true when it carried text.
bool append_text(const nlohmann::json& object, const char* field, std::string& out) {
  auto it = object.find(field);
  if (it == object.end() || !it->is_string()) return false;
  const auto& text = it->get_ref<const std::string&>();
  out += text;
  return !text.empty();
}

void read_usage(const nlohmann::json& root, Generation& generation) {
  auto usage = root.find("usage");
  if (usage == root.end() || !usage->is_object()) return;
  if (usage->contains("prompt_tokens") && (*usage)["prompt_tokens"].is_number_integer())
    generation.prompt_tokens = (*usage)["prompt_tokens"].get<int64_t>();
  if (usage->contains("completion_tokens") && (*usage)["completion_tokens"].is_number_integer())
    generation.completion_tokens = (*usage)["completion_tokens"].get<int64_t>();
  auto details = usage->find("prompt_tokens_details");
  if (details != usage->end() && details->is_object() && details->contains("cached_tokens") &&
      (*details)["cached_tokens"].is_number_integer())
    generation.cached_tokens = (*details)["cached_tokens"].get<int64_t>();
}

// The server's error object inside a 200 response or a stream chunk, if any.
std::optional<std::string> embedded_error(const nlohmann::json& root) {
  auto it = root.find("error");
  if (it == root.end() || it->is_null()) return std::nullopt;
  if (it->is_object() && it->contains("message") && (*it)["message"].is_string())
    return (*it)["message"].get<std::string>();
  return it->dump();
}

}  // namespace

nlohmann::json chat_request(const std::string& model, const std::string& user_message, const GenerationParams& params) {
  nlohmann::json body = {{"model", model},
                         {"messages", nlohmann::json::array({{{"role", "user"}, {"content", user_message}}})}};
  add_sampling(body, params);
  if (params.enable_thinking) body["chat_template_kwargs"] = {{"enable_thinking", *params.enable_thinking}};
  return body;
}

nlohmann::json completion_request(const std::string& model, const std::string& prompt, const GenerationParams& params) {
  nlohmann::json body = {{"model", model}, {"prompt", prompt}};
  add_sampling(body, params);
  return body;
}

Generation parse_generation_response(const std::string& body) {
  Generation generation;
  auto root = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    generation.error = "the response is not a JSON object: " + short_text(body);
    return generation;
  }
  if (auto error = embedded_error(root)) {
    generation.error = "the server returned an error: " + short_text(*error, 300);
    return generation;
  }
  auto choices = root.find("choices");
  if (choices == root.end() || !choices->is_array() || choices->empty() || !(*choices)[0].is_object()) {
    generation.error = "the response has no choices[0]: " + short_text(body);
    return generation;
  }
  const auto& choice = (*choices)[0];
  if (auto message = choice.find("message"); message != choice.end() && message->is_object()) {
    auto content = message->find("content");
    generation.content_null = content == message->end() || content->is_null();
    append_text(*message, "content", generation.content);
    if (append_text(*message, "reasoning_content", generation.reasoning)) generation.reasoning_field = "reasoning_content";
    if (append_text(*message, "reasoning", generation.reasoning)) generation.reasoning_field = "reasoning";
  } else {
    append_text(choice, "text", generation.content);
  }
  if (auto finish = choice.find("finish_reason"); finish != choice.end() && finish->is_string())
    generation.finish_reason = finish->get<std::string>();
  read_usage(root, generation);
  generation.ok = true;
  return generation;
}

bool StreamAccumulator::add_event(std::string_view data, double seconds) {
  if (failed_) return false;
  if (data == "[DONE]") {
    generation_.saw_done = true;
    return true;
  }
  auto root = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    generation_.error = "a streamed chunk is not a JSON object: " + short_text(data);
    failed_ = true;
    return false;
  }
  if (auto error = embedded_error(root)) {
    generation_.error = "the stream reported an error: " + short_text(*error, 300);
    failed_ = true;
    return false;
  }
  read_usage(root, generation_);
  auto choices = root.find("choices");
  if (choices == root.end() || !choices->is_array() || choices->empty()) return true;  // e.g. the usage chunk
  const auto& choice = (*choices)[0];
  if (!choice.is_object()) return true;
  bool carried_text = false;
  if (auto delta = choice.find("delta"); delta != choice.end() && delta->is_object()) {
    carried_text |= append_text(*delta, "content", generation_.content);
    if (append_text(*delta, "reasoning_content", generation_.reasoning)) {
      generation_.reasoning_field = "reasoning_content";
      carried_text = true;
    }
    if (append_text(*delta, "reasoning", generation_.reasoning)) {
      generation_.reasoning_field = "reasoning";
      carried_text = true;
    }
  } else {
    carried_text |= append_text(choice, "text", generation_.content);
  }
  if (carried_text) generation_.token_times_s.push_back(seconds);
  if (auto finish = choice.find("finish_reason"); finish != choice.end() && finish->is_string())
    generation_.finish_reason = finish->get<std::string>();
  return true;
}

Generation StreamAccumulator::finish(double e2e_s) {
  generation_.e2e_s = e2e_s;
  if (!failed_) {
    if (!generation_.saw_done && generation_.finish_reason.empty())
      generation_.error = "the stream ended without a finish_reason or data: [DONE] (cut off?)";
    else
      generation_.ok = true;
  }
  return std::move(generation_);
}

Generation run_generation(HttpClient& client, const std::string& path, const nlohmann::json& body) {
  bool streamed = body.value("stream", false);
  auto start = std::chrono::steady_clock::now();
  auto seconds_since_start = [start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  if (!streamed) {
    HttpResponse response = client.post_json(path, body);
    if (!response.ok()) {
      Generation failed;
      failed.error = response.describe_failure();
      return failed;
    }
    Generation generation = parse_generation_response(response.body);
    generation.e2e_s = seconds_since_start();
    return generation;
  }

  SseParser parser;
  StreamAccumulator accumulator;
  std::string head;  // the first bytes, to explain a body that was not an event stream
  size_t events = 0;
  auto on_event = [&](std::string_view data) {
    ++events;
    return accumulator.add_event(data, seconds_since_start());
  };
  HttpResponse response = client.post_json_streamed(path, body, [&](std::string_view bytes) {
    if (head.size() < 200) head.append(bytes.substr(0, 200 - head.size()));
    return parser.feed(bytes, on_event);
  });
  if (response.ok()) parser.finish(on_event);
  Generation generation = accumulator.finish(seconds_since_start());
  if (!response.ok()) {
    generation.ok = false;
    generation.error = response.describe_failure();
  } else if (events == 0) {
    generation.ok = false;
    generation.error = head.empty() ? "the server sent an empty body to a streamed request"
                                    : "the response is not an event stream (data: lines): " + short_text(head);
  }
  return generation;
}

std::string discover_model_name(HttpClient& client) {
  HttpResponse response = client.get("/v1/models");
  if (response.ok()) {
    auto root = nlohmann::json::parse(response.body, nullptr, false);
    if (root.is_object() && root.contains("data") && root["data"].is_array() && !root["data"].empty()) {
      const auto& first = root["data"][0];
      if (first.is_object() && first.contains("id") && first["id"].is_string()) return first["id"].get<std::string>();
    }
  }
  return "default";
}

}  // namespace kiln::clients
