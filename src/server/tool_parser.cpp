#include "server/tool_parser.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

namespace kiln::server {

namespace {
constexpr std::string_view kBlockOpen = "<tool_call>";
constexpr std::string_view kBlockClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
// s is a proper prefix of p (more text may complete it).
bool could_become(std::string_view s, std::string_view p) { return s.size() < p.size() && starts_with(p, s); }

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The schema "type" as one lowercase word: the first non-null entry of a type list.
std::string schema_type(const nlohmann::json& schema) {
  if (!schema.is_object()) return "";
  auto it = schema.find("type");
  if (it == schema.end()) {
    if (schema.contains("enum")) return "enum";
    return "";
  }
  if (it->is_string()) return lower(it->get<std::string>());
  if (it->is_array())
    for (const auto& t : *it)
      if (t.is_string() && t.get<std::string>() != "null") return lower(t.get<std::string>());
  return "";
}

bool parse_integer(std::string_view s, long long* out) {
  std::string t(strip(s));
  if (t.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(t.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool parse_number(std::string_view s, double* out) {
  std::string t(strip(s));
  if (t.empty()) return false;
  char* end = nullptr;
  double v = std::strtod(t.c_str(), &end);
  if (*end != '\0') return false;
  *out = v;
  return true;
}

}  // namespace

ToolCallParser::ToolCallParser(const nlohmann::json& tools, int max_calls)
    : tools_(tools.is_array() ? tools : nlohmann::json::array()), max_calls_(max_calls) {}

bool ToolCallParser::is_known_function(const std::string& name) const {
  if (tools_.empty()) return true;  // no list to check against
  for (const auto& tool : tools_) {
    if (!tool.is_object()) continue;
    auto fn = tool.find("function");
    if (fn == tool.end() || !fn->is_object()) continue;
    auto fname = fn->find("name");
    if (fname != fn->end() && fname->is_string() && fname->get<std::string>() == name) return true;
  }
  return false;
}

const nlohmann::json* ToolCallParser::property_schema(std::string_view name) const {
  for (const auto& tool : tools_) {
    if (!tool.is_object()) continue;
    auto fn = tool.find("function");
    if (fn == tool.end() || !fn->is_object()) continue;
    auto fname = fn->find("name");
    if (fname == fn->end() || !fname->is_string() || fname->get<std::string>() != function_name_) continue;
    auto params = fn->find("parameters");
    if (params == fn->end() || !params->is_object()) return nullptr;
    auto props = params->find("properties");
    const nlohmann::json& table = (props != params->end() && props->is_object()) ? *props : *params;
    auto p = table.find(std::string(name));
    return p == table.end() ? nullptr : &*p;
  }
  return nullptr;
}

nlohmann::json ToolCallParser::convert_value(std::string_view raw, const nlohmann::json& schema) {
  if (lower(strip(raw)) == "null") return nullptr;
  if (schema.is_null()) return std::string(raw);  // unknown parameter: keep the text
  std::string type = schema_type(schema);
  if (type.empty() || type == "string" || type == "str" || type == "text" || type == "enum" ||
      type == "varchar" || type == "char")
    return std::string(raw);
  if (type.rfind("int", 0) == 0 || type.rfind("uint", 0) == 0 || type.rfind("long", 0) == 0 ||
      type.rfind("short", 0) == 0 || type.rfind("unsigned", 0) == 0) {
    long long v;
    if (parse_integer(raw, &v)) return v;
    return std::string(raw);
  }
  if (type.rfind("num", 0) == 0 || type.rfind("float", 0) == 0 || type == "double") {
    std::string t(strip(raw));
    bool looks_float = t.find('.') != std::string::npos || t.find('e') != std::string::npos ||
                       t.find('E') != std::string::npos;
    long long iv;
    if (!looks_float && parse_integer(t, &iv)) return iv;
    double v;
    if (parse_number(t, &v)) return v;
    return std::string(raw);
  }
  if (type == "boolean" || type == "bool" || type == "binary") {
    std::string t = lower(strip(raw));
    if (t == "true") return true;
    if (t == "false") return false;
    return std::string(raw);
  }
  // object, array and anything else: JSON if it parses, else the text.
  auto v = nlohmann::json::parse(raw, nullptr, /*allow_exceptions=*/false);
  if (!v.is_discarded()) return v;
  return std::string(raw);
}

void ToolCallParser::emit_parameter(Delta& out, std::string_view name, std::string_view raw) {
  if (skipping_) return;
  // The value sits on its own lines: drop one newline on each side.
  if (!raw.empty() && raw.front() == '\n') raw.remove_prefix(1);
  if (!raw.empty() && raw.back() == '\n') raw.remove_suffix(1);
  const nlohmann::json* schema = property_schema(name);
  nlohmann::json value = convert_value(raw, schema ? *schema : nlohmann::json());
  std::string frag = num_params_ == 0 ? "{" : ", ";
  frag += nlohmann::json(std::string(name)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  frag += ": ";
  frag += value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  ++num_params_;
  out.calls.push_back({num_calls_ - 1, "", std::move(frag)});
}

void ToolCallParser::close_function(Delta& out) {
  if (!skipping_) out.calls.push_back({num_calls_ - 1, "", num_params_ == 0 ? "{}" : "}"});
  skipping_ = false;
  num_params_ = 0;
  function_name_.clear();
}

ToolCallParser::Delta ToolCallParser::push(std::string_view text) {
  Delta out;
  buf_.append(text);
  run(out, false);
  return out;
}

ToolCallParser::Delta ToolCallParser::finish() {
  Delta out;
  run(out, true);
  if (state_ == State::outside) out.content += content_trim_.flush();
  return out;
}

// Each step consumes what it can of buf_ in one state; true: call again (the state or the buffer moved on),
// false: wait for more text.
void ToolCallParser::run(Delta& out, bool at_end) {
  for (bool more = true; more;) {
    switch (state_) {
      case State::outside: more = step_outside(out, at_end); break;
      case State::in_block: more = step_in_block(out, at_end); break;
      case State::in_function: more = step_in_function(out, at_end); break;
    }
  }
}

bool ToolCallParser::step_outside(Delta& out, bool at_end) {
  size_t at = buf_.find(kBlockOpen);
  if (at != std::string::npos) {
    out.content += content_trim_.push(std::string_view(buf_).substr(0, at));
    content_trim_.drop_pending();
    buf_.erase(0, at + kBlockOpen.size());
    state_ = State::in_block;
    return true;
  }
  size_t keep = at_end ? 0 : partial_suffix(buf_, kBlockOpen);
  out.content += content_trim_.push(std::string_view(buf_).substr(0, buf_.size() - keep));
  buf_.erase(0, buf_.size() - keep);
  return false;
}

bool ToolCallParser::step_in_block(Delta& out, bool at_end) {
  std::string_view rest = lstrip(buf_);
  buf_.erase(0, buf_.size() - rest.size());
  if (buf_.empty()) return false;
  if (starts_with(buf_, kFunctionOpen)) {
    size_t gt = buf_.find('>');
    if (gt == std::string::npos) {
      if (at_end) buf_.clear();
      return false;
    }
    function_name_ = std::string(strip(std::string_view(buf_).substr(kFunctionOpen.size(), gt - kFunctionOpen.size())));
    num_params_ = 0;
    skipping_ = !is_known_function(function_name_) || (max_calls_ >= 0 && num_calls_ >= max_calls_);
    if (skipping_) {
      dropped_.push_back(function_name_);
    } else {
      ++num_calls_;
      out.calls.push_back({num_calls_ - 1, function_name_, ""});
    }
    buf_.erase(0, gt + 1);
    state_ = State::in_function;
    return true;
  }
  if (starts_with(buf_, kBlockClose)) {
    buf_.erase(0, kBlockClose.size());
    content_trim_.drop_leading();
    state_ = State::outside;
    return true;
  }
  if (!at_end && (could_become(buf_, kFunctionOpen) || could_become(buf_, kBlockClose))) return false;
  // Unexpected text inside a block: skip to the next tag.
  size_t lt = buf_.find('<', 1);
  if (lt == std::string::npos) {
    buf_.clear();
    return false;
  }
  buf_.erase(0, lt);
  return true;
}

bool ToolCallParser::step_in_function(Delta& out, bool at_end) {
  std::string_view rest = lstrip(buf_);
  buf_.erase(0, buf_.size() - rest.size());
  if (buf_.empty()) {
    if (at_end) close_function(out);
    if (at_end) state_ = State::in_block;
    return false;
  }
  if (starts_with(buf_, kParamOpen)) return step_parameter(out, at_end);
  if (starts_with(buf_, kFunctionClose)) {
    buf_.erase(0, kFunctionClose.size());
    close_function(out);
    state_ = State::in_block;
    return true;
  }
  if (starts_with(buf_, kBlockClose)) {  // </function> missing
    close_function(out);
    state_ = State::in_block;
    return true;
  }
  if (!at_end && (could_become(buf_, kParamOpen) || could_become(buf_, kFunctionClose) ||
                  could_become(buf_, kBlockClose)))
    return false;
  size_t lt = buf_.find('<', 1);
  if (lt == std::string::npos) {
    buf_.clear();
    if (at_end) {
      close_function(out);
      state_ = State::in_block;
    }
    return false;
  }
  buf_.erase(0, lt);
  return true;
}

// buf_ starts with "<parameter=": one whole parameter, or (at the end) what arrived of it.
bool ToolCallParser::step_parameter(Delta& out, bool at_end) {
  size_t gt = buf_.find('>');
  if (gt == std::string::npos) {
    if (at_end) {
      buf_.clear();
      close_function(out);
      state_ = State::in_block;
    }
    return false;
  }
  std::string_view name = strip(std::string_view(buf_).substr(kParamOpen.size(), gt - kParamOpen.size()));
  std::string_view value_and_rest = std::string_view(buf_).substr(gt + 1);
  // A value ends at </parameter>, or (malformed) at the next <parameter= or </function>.
  size_t end_param = value_and_rest.find(kParamClose);
  size_t next_param = value_and_rest.find(kParamOpen);
  size_t end_fn = value_and_rest.find(kFunctionClose);
  size_t end = std::min({end_param, next_param, end_fn});
  if (end == std::string::npos) {
    if (!at_end) return false;  // the value may go on
    size_t block_end = value_and_rest.find(kBlockClose);
    std::string_view value = value_and_rest.substr(0, block_end);
    // Cut off mid-tag (max_tokens): the start of a closing tag is not part of the value.
    static const std::vector<std::string> kTags = {std::string(kParamClose), std::string(kFunctionClose),
                                                   std::string(kBlockClose), std::string(kParamOpen)};
    value.remove_suffix(partial_suffix_any(value, kTags));
    emit_parameter(out, name, value);
    buf_.clear();
    close_function(out);
    state_ = State::in_block;
    return false;
  }
  std::string name_copy(name);
  std::string value(value_and_rest.substr(0, end));
  size_t consumed = gt + 1 + end + (end == end_param ? kParamClose.size() : 0);
  emit_parameter(out, name_copy, value);
  buf_.erase(0, consumed);
  return true;
}

}  // namespace kiln::server
