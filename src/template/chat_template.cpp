#include "template/chat_template.h"

#include <algorithm>

#include "core/error.h"
#include "template/jinja/template.h"

namespace kiln::tmpl {

namespace {

using nlohmann::ordered_json;

std::string token_string(const nlohmann::json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string())
    return j["content"].get<std::string>();
  return "";
}

// Assistant tool calls carry `arguments` as a JSON string in the OpenAI API; templates expect a
// mapping (HF's convention, applied by SGLang and vLLM before rendering).
ordered_json normalize_messages(const ordered_json& messages) {
  ordered_json out = messages;
  for (auto& message : out) {
    if (!message.is_object()) fail("request.messages: every message must be a JSON object");
    auto it = message.find("tool_calls");
    if (it == message.end() || !it->is_array()) continue;
    for (auto& call : *it) {
      if (!call.is_object()) continue;
      auto fn = call.find("function");
      if (fn == call.end() || !fn->is_object()) continue;
      auto args = fn->find("arguments");
      if (args == fn->end() || !args->is_string()) continue;
      try {
        *args = ordered_json::parse(args->get<std::string>());
      } catch (const ordered_json::parse_error&) {
        // not JSON: the template sees the raw string
      }
    }
  }
  return out;
}

std::string_view strip(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// continue_final_message (transformers' apply_chat_template): the prompt ends where the last message's text does,
// so whatever the template writes after it (the end of turn) is cut and generation continues the message. The
// text is found from the end; trailing whitespace of the message is kept when the template kept it.
std::string cut_after_final_message(std::string rendered, const ordered_json& messages) {
  if (messages.empty() || !messages.back().is_object()) fail("continue_final_message needs a final message");
  const ordered_json& last = messages.back();
  auto content = last.find("content");
  std::string text;
  if (content != last.end() && content->is_string()) {
    text = content->get<std::string>();
  } else if (content != last.end() && content->is_array()) {
    for (auto it = content->rbegin(); it != content->rend() && text.empty(); ++it)
      if (it->is_object() && it->contains("text") && (*it)["text"].is_string()) text = (*it)["text"].get<std::string>();
  }
  const std::string_view stripped = strip(text);
  const size_t at = stripped.empty() ? std::string::npos : rendered.rfind(stripped);
  if (at == std::string::npos)
    fail("continue_final_message: the final message's text does not appear in the rendered prompt (the chat "
         "template drops or rewrites it), so it cannot be continued");
  std::string_view left_stripped(text);
  left_stripped.remove_prefix(std::min(left_stripped.size(), left_stripped.find_first_not_of(" \t\n\r\f\v")));
  if (rendered.compare(at, left_stripped.size(), text) == 0)
    rendered.resize(at + left_stripped.size());
  else
    rendered.resize(at + stripped.size());
  return rendered;
}

}  // namespace

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token)
    : source_(std::move(source)),
      bos_token_(std::move(bos_token)),
      eos_token_(std::move(eos_token)),
      compiled_(std::make_unique<jinja::Template>(source_)) {}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::unique_ptr<ChatTemplate> ChatTemplate::from_model_files(std::optional<std::string> chat_template_jinja,
                                                             std::string_view tokenizer_config_json) {
  nlohmann::json config = nlohmann::json::object();
  if (!tokenizer_config_json.empty()) {
    try {
      config = nlohmann::json::parse(tokenizer_config_json);
    } catch (const nlohmann::json::parse_error& e) {
      fail("tokenizer_config.json is not valid JSON ({})", e.what());
    }
    if (!config.is_object()) fail("tokenizer_config.json must hold a JSON object");
  }
  std::string bos = config.contains("bos_token") ? token_string(config["bos_token"]) : "";
  std::string eos = config.contains("eos_token") ? token_string(config["eos_token"]) : "";
  if (chat_template_jinja) return std::make_unique<ChatTemplate>(std::move(*chat_template_jinja), bos, eos);
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null())
    fail(
        "the model has no chat template: no chat_template.jinja and no chat_template in "
        "tokenizer_config.json "
        "(pass one with --chat-template FILE)");
  if (it->is_string()) return std::make_unique<ChatTemplate>(it->get<std::string>(), bos, eos);
  if (it->is_array()) {
    for (const auto& entry : *it) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string())
        return std::make_unique<ChatTemplate>(entry["template"].get<std::string>(), bos, eos);
    }
    fail("tokenizer_config.json: chat_template is a list without a \"default\" entry");
  }
  fail("tokenizer_config.json: chat_template must be a string or a list of {{name, template}}");
}

std::string ChatTemplate::render(const ordered_json& request) const {
  if (!request.is_object()) fail("chat request must be a JSON object");
  auto messages = request.find("messages");
  if (messages == request.end() || !messages->is_array())
    fail("chat request: \"messages\" (a list of messages) is required");

  std::unordered_map<std::string, jinja::Value> vars;
  vars["messages"] = jinja::Value::from_json(normalize_messages(*messages));
  auto tools = request.find("tools");
  vars["tools"] =
      (tools == request.end() || tools->is_null()) ? jinja::Value::none() : jinja::Value::from_json(*tools);
  vars["documents"] = jinja::Value::none();
  bool continue_final_message = false;
  if (auto cfm = request.find("continue_final_message"); cfm != request.end() && !cfm->is_null()) {
    if (!cfm->is_boolean()) fail("chat request: \"continue_final_message\" must be true or false");
    continue_final_message = cfm->get<bool>();
  }
  bool add_generation_prompt = !continue_final_message;  // default: a new assistant turn, unless continuing one
  if (auto agp = request.find("add_generation_prompt"); agp != request.end() && !agp->is_null()) {
    if (!agp->is_boolean()) fail("chat request: \"add_generation_prompt\" must be true or false");
    add_generation_prompt = agp->get<bool>();
  }
  vars["add_generation_prompt"] = jinja::Value(add_generation_prompt);
  if (!bos_token_.empty()) vars["bos_token"] = jinja::Value(bos_token_);
  if (!eos_token_.empty()) vars["eos_token"] = jinja::Value(eos_token_);
  if (auto kw = request.find("chat_template_kwargs"); kw != request.end() && !kw->is_null()) {
    if (!kw->is_object()) fail("chat request: \"chat_template_kwargs\" must be a JSON object");
    for (const auto& [key, value] : kw->items()) {
      if (key == "messages" || key == "tools" || key == "documents" || key == "add_generation_prompt")
        fail("chat_template_kwargs may not set \"{}\" (pass it as a request field)", key);
      vars[key] = jinja::Value::from_json(value);
    }
  }
  if (continue_final_message && add_generation_prompt)
    fail("chat request: continue_final_message and add_generation_prompt cannot both be true");
  std::string rendered = compiled_->render(vars);
  return continue_final_message ? cut_after_final_message(std::move(rendered), *messages) : rendered;
}

std::string ChatTemplate::render_json_text(std::string_view request_json) const {
  ordered_json request;
  try {
    request = ordered_json::parse(request_json);
  } catch (const ordered_json::parse_error& e) {
    fail("chat request is not valid JSON ({})", e.what());
  }
  return render(request);
}

ordered_json ChatTemplate::sglang_tools(const ordered_json& openai_tools) {
  if (!openai_tools.is_array()) fail("request.tools must be a list of tools");
  ordered_json out = ordered_json::array();
  for (const auto& tool : openai_tools) {
    if (!tool.is_object() || !tool.contains("function") || !tool["function"].is_object())
      fail("request.tools: every tool must be {{\"type\": \"function\", \"function\": {{...}}}}");
    const auto& fn = tool["function"];
    if (!fn.contains("name") || !fn["name"].is_string())
      fail("request.tools: every function needs a \"name\"");
    ordered_json flat = ordered_json::object();
    flat["description"] = fn.contains("description") ? fn["description"] : ordered_json(nullptr);
    flat["name"] = fn["name"];
    flat["parameters"] = fn.contains("parameters") ? fn["parameters"] : ordered_json(nullptr);
    flat["strict"] = fn.contains("strict") && fn["strict"].is_boolean() ? fn["strict"] : ordered_json(false);
    out.push_back(std::move(flat));
  }
  return out;
}

bool ChatTemplate::injects_think() const {
  ordered_json request = {{"messages", ordered_json::array({{{"role", "user"}, {"content", "hi"}}})},
                          {"add_generation_prompt", true}};
  std::string prompt;
  try {
    prompt = render(request);
  } catch (const kiln::Error&) {
    return false;
  }
  while (!prompt.empty() && (prompt.back() == '\n' || prompt.back() == ' ')) prompt.pop_back();
  return prompt.size() >= 7 && prompt.compare(prompt.size() - 7, 7, "<think>") == 0;
}

bool ChatTemplate::prompt_ends_inside_think(std::string_view prompt) {
  auto open = prompt.rfind("<think>");
  auto close = prompt.rfind("</think>");
  return open != std::string_view::npos && (close == std::string_view::npos || open > close);
}

}  // namespace kiln::tmpl
