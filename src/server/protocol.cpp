#include "server/protocol.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fmt/format.h>
#include <limits>

#include "core/log.h"
#include "server/api_error.h"
#include "tokenizer/utf8.h"

namespace kiln::server {

namespace {

std::string json_type_name(const ojson& v) {
  switch (v.type()) {
    case ojson::value_t::null: return "null";
    case ojson::value_t::boolean: return "a boolean";
    case ojson::value_t::string: return "a string";
    case ojson::value_t::array: return "an array";
    case ojson::value_t::object: return "an object";
    case ojson::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

// Typed access to the fields of a request object; absent and null both mean "not given".
class Fields {
 public:
  explicit Fields(const ojson& obj) : obj_(obj) {}

  const ojson* get(const char* name) const {
    auto it = obj_.find(name);
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  std::optional<double> number(const char* name, double lo, double hi, bool lo_open = false) const {
    const ojson* v = get(name);
    if (!v) return std::nullopt;
    if (!v->is_number()) throw bad_param(name, fmt_msg(name, "must be a number", *v));
    double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo))
      throw bad_param(name, std::string("'") + name + "' must be " + (lo_open ? "greater than " : "at least ") +
                                num(lo) + " and at most " + num(hi) + ", got " + num(x));
    return x;
  }

  std::optional<int64_t> integer(const char* name, int64_t lo, int64_t hi) const {
    const ojson* v = get(name);
    if (!v) return std::nullopt;
    int64_t x;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        throw bad_param(name, std::string("'") + name + "' is too large");
      x = v->get<int64_t>();
    } else if (v->is_number_float() && std::isfinite(v->get<double>()) &&
               v->get<double>() == std::floor(v->get<double>()) && std::fabs(v->get<double>()) < 9e15) {
      x = static_cast<int64_t>(v->get<double>());  // 3.0 is accepted as 3, like pydantic
    } else {
      throw bad_param(name, fmt_msg(name, "must be an integer", *v));
    }
    if (x < lo || x > hi)
      throw bad_param(name, std::string("'") + name + "' must be between " + std::to_string(lo) + " and " +
                                std::to_string(hi) + ", got " + std::to_string(x));
    return x;
  }

  std::optional<bool> boolean(const char* name) const {
    const ojson* v = get(name);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) throw bad_param(name, fmt_msg(name, "must be a boolean", *v));
    return v->get<bool>();
  }

  std::optional<std::string> string(const char* name) const {
    const ojson* v = get(name);
    if (!v) return std::nullopt;
    if (!v->is_string()) throw bad_param(name, fmt_msg(name, "must be a string", *v));
    return v->get<std::string>();
  }

  static std::string fmt_msg(const char* name, const char* what, const ojson& v) {
    return std::string("'") + name + "' " + what + ", got " + json_type_name(v);
  }
  static std::string num(double x) {
    if (x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
    std::string s = std::to_string(x);
    while (s.size() > 1 && s.back() == '0') s.pop_back();
    return s;
  }

 private:
  const ojson& obj_;
};

// The request fields kiln implements. Any other field with a value is a 400 naming it: a client must not
// believe a setting took effect when it did not. (null counts as absent, as everywhere.)
constexpr std::string_view kCommonFields[] = {
    "model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "max_tokens", "max_completion_tokens", "min_tokens", "n", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "stream", "stream_options", "logprobs", "logit_bias",
    "user",  // an end-user id for the provider's records: nothing to act on
    "regex", "ebnf",  // SGLang's constrained decoding (server/structured_output.h)
};
constexpr std::string_view kChatFields[] = {
    "messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "separate_reasoning", "stream_reasoning", "add_generation_prompt", "chat_template_kwargs",
    "continue_final_message", "reasoning_effort",
};
constexpr std::string_view kCompletionFields[] = {"prompt", "echo", "suffix", "best_of", "response_format"};

// Fields common clients send that change nothing a server like kiln does (OpenAI's storage, billing, caching and
// abuse-tracking hints): accepted when they have the documented type, logged at debug, otherwise ignored. The
// second list is chat only (verbosity is a chat-model output hint).
constexpr std::pair<std::string_view, ojson::value_t> kIgnoredFields[] = {
    {"store", ojson::value_t::boolean},          {"metadata", ojson::value_t::object},
    {"service_tier", ojson::value_t::string},    {"prompt_cache_key", ojson::value_t::string},
    {"safety_identifier", ojson::value_t::string},
};
constexpr std::pair<std::string_view, ojson::value_t> kIgnoredChatFields[] = {
    {"verbosity", ojson::value_t::string},
};

// Whether `key` is an ignored field; a wrong type is still a 400.
bool ignored_field(const std::string& key, const ojson& value, bool is_chat) {
  auto check = [&](const auto& list) {
    for (const auto& [name, type] : list) {
      if (name != key) continue;
      if (value.type() != type)
        throw bad_param(key, "'" + key + "' must be " + (type == ojson::value_t::boolean ? "a boolean"
                                                         : type == ojson::value_t::object ? "an object"
                                                                                          : "a string") +
                                 ", got " + json_type_name(value));
      return true;
    }
    return false;
  };
  return check(kIgnoredFields) || (is_chat && check(kIgnoredChatFields));
}

void reject_unknown_fields(const ojson& body, bool is_chat) {
  std::string ignored;
  for (const auto& [key, value] : body.items()) {
    if (value.is_null()) continue;
    auto known = [&](const auto& list) { return std::find(std::begin(list), std::end(list), key) != std::end(list); };
    if (known(kCommonFields) || (is_chat ? known(kChatFields) : known(kCompletionFields))) continue;
    if (ignored_field(key, value, is_chat)) {
      ignored += (ignored.empty() ? "" : ", ") + key;
      continue;
    }
    throw ApiError(400,
                   "'" + key + "' is not supported by kiln's " + (is_chat ? "/v1/chat/completions" : "/v1/completions") +
                       " (it would have no effect); remove it from the request",
                   key, "unsupported_parameter");
  }
  if (!ignored.empty()) KILN_LOG_DEBUG("request fields accepted and ignored: {}", ignored);
}

// logit_bias: {"token id": bias in [-100, 100]} (OpenAI), added to the model's logits before sampling.
std::vector<std::pair<int32_t, float>> parse_logit_bias(const ojson& v, int64_t vocab_size) {
  if (!v.is_object())
    throw bad_param("logit_bias", "'logit_bias' must be an object mapping token ids to a bias, e.g. {\"42\": -100}");
  std::vector<std::pair<int32_t, float>> out;
  for (const auto& [key, bias] : v.items()) {
    char* end = nullptr;
    errno = 0;
    long long id = std::strtoll(key.c_str(), &end, 10);
    if (key.empty() || *end != '\0' || errno != 0 || id < 0 || id >= vocab_size)
      throw bad_param("logit_bias", "'logit_bias' keys must be token ids in [0, " + std::to_string(vocab_size) +
                                        "), got '" + key + "'");
    if (!bias.is_number() || !std::isfinite(bias.get<double>()) || bias.get<double>() < -100.0 ||
        bias.get<double>() > 100.0)
      throw bad_param("logit_bias", "'logit_bias' values must be numbers from -100 to 100 (token " + key + ")");
    out.emplace_back(static_cast<int32_t>(id), static_cast<float>(bias.get<double>()));
  }
  return out;
}

void parse_generation_fields(const ojson& body, const ProtocolLimits& limits, bool is_chat, GenerationFields& out) {
  reject_unknown_fields(body, is_chat);
  if (auto rf = body.find("response_format"); rf != body.end() && !rf->is_null()) {
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
      throw bad_param("response_format", "'response_format' must be an object with a 'type' (text, json_object or json_schema)");
    out.response_format = *rf;
  }
  Fields f(body);
  out.model = f.string("model");
  out.regex = f.string("regex");
  out.ebnf = f.string("ebnf");
  engine::SamplingParams& s = out.sampling;
  s = limits.default_sampling;
  if (auto v = f.number("temperature", 0.0, 2.0)) s.temperature = static_cast<float>(*v);
  if (auto v = f.number("top_p", 0.0, 1.0, /*lo_open=*/true)) s.top_p = static_cast<float>(*v);
  if (auto v = f.integer("top_k", -1, 1 << 30)) s.top_k = *v <= 0 ? 0 : static_cast<int>(*v);  // -1, 0: off
  if (auto v = f.number("min_p", 0.0, 1.0)) s.min_p = static_cast<float>(*v);
  if (auto v = f.number("presence_penalty", -2.0, 2.0)) s.presence_penalty = static_cast<float>(*v);
  if (auto v = f.number("frequency_penalty", -2.0, 2.0)) s.frequency_penalty = static_cast<float>(*v);
  if (auto v = f.number("repetition_penalty", 0.0, 2.0, /*lo_open=*/true)) s.repetition_penalty = static_cast<float>(*v);
  if (const ojson* lb = f.get("logit_bias")) s.logit_bias = parse_logit_bias(*lb, limits.vocab_size);
  if (const ojson* seed = f.get("seed")) {
    if (!seed->is_number_integer()) throw bad_param("seed", Fields::fmt_msg("seed", "must be an integer", *seed));
    s.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : static_cast<uint64_t>(seed->get<int64_t>());
  }

  std::optional<int64_t> max_tokens = f.integer("max_tokens", 1, INT32_MAX);
  if (auto mct = f.integer("max_completion_tokens", 1, INT32_MAX)) max_tokens = mct;
  out.max_tokens = max_tokens;
  if (auto mt = f.integer("min_tokens", 0, INT32_MAX)) {
    if (max_tokens && *mt > *max_tokens)
      throw bad_param("min_tokens", "'min_tokens' (" + std::to_string(*mt) + ") must not exceed 'max_tokens' (" +
                                        std::to_string(*max_tokens) + ")");
    out.min_tokens = *mt;
  }
  if (auto n = f.integer("n", 1, limits.max_n)) out.n = static_cast<int>(*n);

  if (const ojson* stop = f.get("stop")) {
    if (stop->is_string()) {
      out.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (static_cast<int>(stop->size()) > limits.max_stop_strings)
        throw bad_param("stop", "'stop' may hold at most " + std::to_string(limits.max_stop_strings) + " strings");
      for (const auto& x : *stop) {
        if (!x.is_string()) throw bad_param("stop", "'stop' must be a string or a list of strings");
        out.stop.push_back(x.get<std::string>());
      }
    } else {
      throw bad_param("stop", Fields::fmt_msg("stop", "must be a string or a list of strings", *stop));
    }
    for (const auto& x : out.stop)
      if (x.empty()) throw bad_param("stop", "'stop' strings must not be empty");
  }
  if (const ojson* ids = f.get("stop_token_ids")) {
    if (!ids->is_array()) throw bad_param("stop_token_ids", "'stop_token_ids' must be a list of token ids");
    for (const auto& x : *ids) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= limits.vocab_size)
        throw bad_param("stop_token_ids", "'stop_token_ids' must hold token ids in [0, " +
                                              std::to_string(limits.vocab_size) + ")");
      out.stop_token_ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
    }
  }
  out.ignore_eos = f.boolean("ignore_eos").value_or(false);
  out.skip_special_tokens = f.boolean("skip_special_tokens").value_or(true);
  out.stream = f.boolean("stream").value_or(false);
  if (const ojson* so = f.get("stream_options")) {
    if (!so->is_object()) throw bad_param("stream_options", "'stream_options' must be an object");
    Fields sf(*so);
    out.include_usage = sf.boolean("include_usage").value_or(false);
    out.continuous_usage_stats = sf.boolean("continuous_usage_stats").value_or(false);
    if (!out.stream) throw bad_param("stream_options", "'stream_options' is only allowed when 'stream' is true");
  }

  if (is_chat) {
    out.logprobs = f.boolean("logprobs").value_or(false);
    if (auto t = f.integer("top_logprobs", 0, limits.max_top_logprobs)) {
      if (*t > 0 && !out.logprobs)
        throw bad_param("top_logprobs", "'top_logprobs' needs 'logprobs' set to true");
      out.top_logprobs = static_cast<int>(*t);
    }
  } else {
    // Completions: logprobs is the number of alternatives (0..max) per token.
    const ojson* lp = f.get("logprobs");
    if (lp && lp->is_boolean()) {
      out.logprobs = lp->get<bool>();
    } else if (auto t = f.integer("logprobs", 0, limits.max_top_logprobs)) {
      out.logprobs = true;
      out.top_logprobs = static_cast<int>(*t);
    }
  }
}

// Message content: a string, null, or a list of parts: text parts (joined with newlines when there is no image) and
// image_url parts ({image_url: {url, detail}} or {image_url: url}); a message with images keeps its parts as the
// chat template's items ({type: text, text} and {type: image}) and its image references go to `images`.
ojson normalise_content(const ojson& content, size_t index, const std::string& role, std::vector<ImageRef>& images,
                        const ProtocolLimits& limits) {
  std::string where = "messages[" + std::to_string(index) + "].content";
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array())
    throw bad_param(where, "'" + where + "' must be a string or a list of content parts, got " + json_type_name(content));
  std::string text;
  ojson items = ojson::array();
  bool has_image = false;
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& part = content[i];
    const std::string w = where + "[" + std::to_string(i) + "]";
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      throw bad_param(where, "'" + where + "' parts must be objects with a 'type'");
    std::string type = part["type"].get<std::string>();
    if (type == "image_url") {
      if (limits.max_images <= 0)
        throw bad_param(w, "this model reads text only: image parts are not accepted (a model with a vision tower "
                           "reads them unless kiln serve runs with --limit-mm-per-prompt image=0)");
      if (role == "assistant" || role == "tool")
        throw bad_param(w, "image parts are accepted in user messages only");
      const ojson* u = part.contains("image_url") ? &part["image_url"] : nullptr;
      if (u && u->is_object()) u = u->contains("url") ? &(*u)["url"] : nullptr;
      if (!u || !u->is_string() || u->get<std::string>().empty())
        throw bad_param(w, "'" + w + "' needs 'image_url': {\"url\": \"data:image/png;base64,...\" or a URL}");
      if (static_cast<int>(images.size()) >= limits.max_images)
        throw bad_param(w, fmt::format("more than {} images in one request (the server's --limit-mm-per-prompt "
                                       "image={})", limits.max_images, limits.max_images));
      images.push_back({u->get<std::string>(), w});
      items.push_back({{"type", "image"}});
      has_image = true;
      continue;
    }
    if (type != "text")
      throw bad_param(where, "content parts of type '" + type + "' are not supported (use text or image_url)");
    if (!part.contains("text") || !part["text"].is_string())
      throw bad_param(where, "'" + where + "' text parts need a string 'text'");
    if (!text.empty()) text += "\n";
    text += part["text"].get<std::string>();
    items.push_back({{"type", "text"}, {"text", part["text"].get<std::string>()}});
  }
  if (has_image) return items;
  return text;
}

// A past tool call's arguments: a JSON object, as text (OpenAI) or as the object itself. The template needs the
// object (it renders each argument), so text that is not a JSON object is a 400 here, naming the message.
void check_tool_arguments(const ojson& function, const std::string& where) {
  auto it = function.find("arguments");
  if (it == function.end() || it->is_null() || it->is_object()) return;
  if (!it->is_string())
    throw bad_param(where, "'" + where + "' must be a JSON object encoded as a string, got " + json_type_name(*it));
  ojson parsed = ojson::parse(it->get<std::string>(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded())
    throw bad_param(where, "'" + where + "' is not valid JSON; send the call's arguments as a JSON object encoded as "
                           "a string, e.g. \"{\\\"city\\\": \\\"Paris\\\"}\"");
  if (!parsed.is_object())
    throw bad_param(where, "'" + where + "' must encode a JSON object, got " + json_type_name(parsed));
}

ojson validate_messages(const ojson& body, std::vector<ImageRef>& images, const ProtocolLimits& limits) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) throw bad_param("messages", "'messages' is required");
  if (!it->is_array()) throw bad_param("messages", "'messages' must be a list, got " + json_type_name(*it));
  if (it->empty()) throw bad_param("messages", "'messages' must not be empty");
  ojson out = ojson::array();
  for (size_t i = 0; i < it->size(); ++i) {
    const ojson& m = (*it)[i];
    std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw bad_param(where, "'" + where + "' must be an object, got " + json_type_name(m));
    auto role_it = m.find("role");
    if (role_it == m.end() || !role_it->is_string())
      throw bad_param(where + ".role", "'" + where + ".role' is required and must be a string");
    std::string role = role_it->get<std::string>();
    if (role != "system" && role != "developer" && role != "user" && role != "assistant" && role != "tool")
      throw bad_param(where + ".role", "unknown role '" + role + "' in " + where +
                                           " (use system, developer, user, assistant or tool)");
    ojson msg = m;
    auto content_it = m.find("content");
    bool has_tool_calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (content_it == m.end() || content_it->is_null()) {
      // Only an assistant turn (typically one that called tools) may come without content.
      if (role != "assistant") throw bad_param(where + ".content", "'" + where + ".content' is required");
      msg["content"] = "";
    } else {
      msg["content"] = normalise_content(*content_it, i, role, images, limits);
    }
    if (has_tool_calls) {
      const ojson& calls = m["tool_calls"];
      if (!calls.is_array()) throw bad_param(where + ".tool_calls", "'" + where + ".tool_calls' must be a list");
      for (size_t k = 0; k < calls.size(); ++k) {
        const ojson& c = calls[k];
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object() ||
            !c["function"].contains("name") || !c["function"]["name"].is_string())
          throw bad_param(where + ".tool_calls", "each tool call in '" + where +
                                                     ".tool_calls' needs function.name (a string)");
        check_tool_arguments(c["function"], where + ".tool_calls[" + std::to_string(k) + "].function.arguments");
      }
    }
    for (const char* key : {"name", "tool_call_id", "reasoning_content"})
      if (m.contains(key) && !m[key].is_null() && !m[key].is_string())
        throw bad_param(where + "." + key, "'" + where + "." + key + "' must be a string");
    // The template only understands "system"; "developer" is OpenAI's newer name for it.
    if (role == "developer") msg["role"] = "system";
    out.push_back(std::move(msg));
  }
  return out;
}

void validate_tools(const ojson& body, ChatRequest& out) {
  Fields f(body);
  if (const ojson* tools = f.get("tools")) {
    if (!tools->is_array()) throw bad_param("tools", "'tools' must be a list");
    for (size_t i = 0; i < tools->size(); ++i) {
      const ojson& t = (*tools)[i];
      std::string where = "tools[" + std::to_string(i) + "]";
      if (!t.is_object()) throw bad_param(where, "'" + where + "' must be an object");
      if (t.contains("type") && (!t["type"].is_string() || t["type"].get<std::string>() != "function"))
        throw bad_param(where + ".type", "only tools of type 'function' are supported");
      if (!t.contains("function") || !t["function"].is_object())
        throw bad_param(where + ".function", "'" + where + ".function' is required");
      const ojson& fn = t["function"];
      if (!fn.contains("name") || !fn["name"].is_string() || fn["name"].get<std::string>().empty())
        throw bad_param(where + ".function.name", "'" + where + ".function.name' must be a non-empty string");
      if (fn.contains("parameters") && !fn["parameters"].is_null() && !fn["parameters"].is_object())
        throw bad_param(where + ".function.parameters", "'" + where + ".function.parameters' must be an object");
    }
    if (!tools->empty()) out.tools = *tools;
  }
  if (const ojson* choice = f.get("tool_choice")) {
    if (choice->is_string()) {
      std::string c = choice->get<std::string>();
      if (c != "none" && c != "auto" && c != "required")
        throw bad_param("tool_choice", "'tool_choice' must be none, auto, required or a function");
      out.tool_choice_none = c == "none";
      out.tool_choice = *choice;
    } else if (choice->is_object()) {
      if (!choice->contains("function") || !(*choice)["function"].is_object() ||
          !(*choice)["function"].contains("name") || !(*choice)["function"]["name"].is_string())
        throw bad_param("tool_choice", "'tool_choice' object needs function.name");
      out.tool_choice = *choice;
    } else {
      throw bad_param("tool_choice", "'tool_choice' must be a string or an object");
    }
  }
}

}  // namespace

ojson parse_json_object(std::string_view body) {
  for (size_t i = 0; i < body.size();) {
    size_t n = tok::utf8::valid_sequence_length(body, i);
    if (n == 0)
      throw ApiError(400,
                     fmt::format("the request body is not valid UTF-8: byte 0x{:02X} at offset {} does not start or "
                                 "continue a UTF-8 sequence; send JSON text encoded as UTF-8",
                                 static_cast<unsigned char>(body[i]), i),
                     "", "invalid_json");
    i += n;
  }
  ojson j;
  try {
    j = ojson::parse(body);
  } catch (const ojson::parse_error& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 1, column 9: ...": keep the part after
    // the tag, which says where and why.
    std::string what = e.what();
    if (size_t tag = what.find("] "); tag != std::string::npos) what = what.substr(tag + 2);
    throw ApiError(400, "the request body is not valid JSON: " + what, "", "invalid_json");
  } catch (const ojson::out_of_range& e) {
    // A number beyond a double's range (1e999) is valid JSON text but no value kiln can hold.
    std::string what = e.what();
    if (size_t tag = what.find("] "); tag != std::string::npos) what = what.substr(tag + 2);
    throw ApiError(400, "the request body holds a number out of range: " + what + "; send numbers within +-1.8e308",
                   "", "invalid_json");
  }
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object", "", "invalid_json");
  return j;
}

ChatRequest parse_chat_request(std::string_view body_text, const ProtocolLimits& limits) {
  return parse_chat_body(parse_json_object(body_text), limits);
}

ChatRequest parse_chat_body(const ojson& body, const ProtocolLimits& limits) {
  ChatRequest r;
  ojson messages = validate_messages(body, r.images, limits);
  parse_generation_fields(body, limits, /*is_chat=*/true, r);
  validate_tools(body, r);
  Fields f(body);
  r.separate_reasoning = f.boolean("separate_reasoning").value_or(true);
  r.stream_reasoning = f.boolean("stream_reasoning").value_or(true);
  if (const ojson* ptc = f.get("parallel_tool_calls")) {
    if (!ptc->is_boolean()) throw bad_param("parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
    r.parallel_tool_calls = ptc->get<bool>();
  }
  r.template_input = ojson::object();
  r.template_input["messages"] = std::move(messages);
  if (!r.tools.is_null() && !r.tool_choice_none) r.template_input["tools"] = r.tools;
  const std::optional<bool> agp = f.boolean("add_generation_prompt");
  if (agp) r.template_input["add_generation_prompt"] = *agp;
  r.continue_final_message = f.boolean("continue_final_message").value_or(false);
  if (r.continue_final_message) {
    // The output continues the last assistant turn, so no new turn is opened (vLLM refuses both; absent means false).
    if (agp.value_or(false))
      throw bad_param("continue_final_message",
                      "'continue_final_message' and 'add_generation_prompt' cannot both be true; drop "
                      "add_generation_prompt (the last assistant message is continued, no new turn is opened)");
    const ojson& last = r.template_input["messages"].back();
    if (last["role"] != "assistant" || !last["content"].is_string() || last["content"].get<std::string>().empty())
      throw bad_param("continue_final_message",
                      "'continue_final_message' needs the last message to be an assistant message with text content "
                      "(the prefill to continue)");
    r.template_input["add_generation_prompt"] = false;
    r.template_input["continue_final_message"] = true;
  }
  if (const ojson* kw = f.get("chat_template_kwargs")) {
    if (!kw->is_object()) throw bad_param("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    if (kw->contains("enable_thinking") && !(*kw)["enable_thinking"].is_null()) {
      if (!(*kw)["enable_thinking"].is_boolean())
        throw bad_param("chat_template_kwargs", "'chat_template_kwargs.enable_thinking' must be a boolean");
      r.enable_thinking = (*kw)["enable_thinking"].get<bool>();
    }
    r.template_input["chat_template_kwargs"] = *kw;
  }
  // reasoning_effort (OpenAI): none / minimal turn thinking off, as the Responses API's reasoning.effort does; the
  // other levels leave the template's default (thinking on). An explicit chat_template_kwargs.enable_thinking wins.
  if (auto effort = f.string("reasoning_effort")) {
    static constexpr std::string_view kEfforts[] = {"none", "minimal", "low", "medium", "high", "xhigh"};
    if (std::find(std::begin(kEfforts), std::end(kEfforts), *effort) == std::end(kEfforts))
      throw bad_param("reasoning_effort", "'reasoning_effort' must be none, minimal, low, medium, high or xhigh, got '" +
                                              *effort + "'");
    if ((*effort == "none" || *effort == "minimal") && !r.enable_thinking) {
      r.enable_thinking = false;
      if (!r.template_input.contains("chat_template_kwargs")) r.template_input["chat_template_kwargs"] = ojson::object();
      r.template_input["chat_template_kwargs"]["enable_thinking"] = false;
    }
  }
  return r;
}

CompletionRequest parse_completion_request(std::string_view body_text, const ProtocolLimits& limits) {
  ojson body = parse_json_object(body_text);
  CompletionRequest r;
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) throw bad_param("prompt", "'prompt' is required");
  const ojson& p = *it;
  auto token_ids = [&](const ojson& list, const std::string& where) {
    if (list.empty()) throw bad_param("prompt", "'" + where + "' must not be empty");
    std::vector<int32_t> ids;
    for (const auto& x : list) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= limits.vocab_size)
        throw bad_param("prompt", "'" + where + "' token ids must be integers in [0, " +
                                      std::to_string(limits.vocab_size) + ")");
      ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
    }
    return ids;
  };
  auto text = [&](const ojson& s, const std::string& where) {
    if (s.get<std::string>().empty()) throw bad_param("prompt", "'" + where + "' must not be empty");
    return s.get<std::string>();
  };
  // A string, a list of token ids, or a list of prompts (strings or lists of token ids): one per choice group.
  if (p.is_string()) {
    r.prompts.push_back(text(p, "prompt"));
  } else if (p.is_array() && !p.empty() && (p[0].is_string() || p[0].is_array())) {
    for (size_t i = 0; i < p.size(); ++i) {
      std::string where = "prompt[" + std::to_string(i) + "]";
      if (p[i].is_string()) r.prompts.push_back(text(p[i], where));
      else if (p[i].is_array()) r.prompts.push_back(token_ids(p[i], where));
      else
        throw bad_param("prompt", "'" + where + "' must be a string or a list of token ids, got " +
                                      json_type_name(p[i]) + " (a list of prompts holds prompts only)");
    }
  } else if (p.is_array()) {
    r.prompts.push_back(token_ids(p, "prompt"));
  } else {
    throw bad_param("prompt", "'prompt' must be a string, a list of token ids or a list of prompts, got " +
                                  json_type_name(p));
  }
  parse_generation_fields(body, limits, /*is_chat=*/false, r);
  Fields f(body);
  r.echo = f.boolean("echo").value_or(false);
  if (auto suffix = f.string("suffix"); suffix && !suffix->empty())
    throw bad_param("suffix", "'suffix' is not supported");
  if (auto best_of = f.integer("best_of", 1, limits.max_n); best_of && *best_of != r.n)
    throw bad_param("best_of", "'best_of' is not supported (other than equal to n)");
  if (static_cast<int64_t>(r.prompts.size()) * r.n > limits.max_n)
    throw bad_param("prompt", fmt::format("{} prompts x n {} = {} choices; at most {} per request", r.prompts.size(), r.n,
                                          static_cast<int64_t>(r.prompts.size()) * r.n, limits.max_n));
  return r;
}

}  // namespace kiln::server
