// Chat templates: renders an OpenAI-style chat request into a prompt string with the model's Jinja
// chat template, byte-identical to what Hugging Face transformers' apply_chat_template produces
// (same Jinja environment settings: trim_blocks, lstrip_blocks, loop controls, HF's tojson,
// raise_exception, strftime_now). The Jinja interpreter behind it lives in src/template/jinja/.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace kiln::tmpl {

namespace jinja {
class Template;
}

class ChatTemplate {
 public:
  // source: the Jinja text. bos/eos token strings are exposed to the template as bos_token/eos_token.
  // Throws kiln::Error (with line:column) when the template does not parse.
  ChatTemplate(std::string source, std::string bos_token = "", std::string eos_token = "");
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // From a model folder's contents: chat_template.jinja text if present, else tokenizer_config.json's
  // `chat_template` (string, or list of {name, template}: take "default"). bos/eos come from
  // tokenizer_config.json's bos_token/eos_token (string or {"content": ...}). Error if no template.
  static std::unique_ptr<ChatTemplate> from_model_files(std::optional<std::string> chat_template_jinja,
                                                        std::string_view tokenizer_config_json);

  // Renders an OpenAI-style chat request: request["messages"] (required), optional "tools",
  // "add_generation_prompt" (default true), "chat_template_kwargs" (object: each key becomes a
  // template variable, e.g. enable_thinking). Tool-call `arguments` given as a JSON string are parsed
  // into an object (kept as the raw string when not valid JSON), as SGLang/vLLM do.
  // Throws kiln::Error for a bad request or when the template calls raise_exception(msg) (the
  // message is the template's).
  std::string render(const nlohmann::json& request) const;

  // Whether the generation prompt of this template starts with "<think>" (renders a tiny request
  // with default kwargs and looks at what add_generation_prompt appends).
  bool injects_think() const;

  const std::string& source() const;
  const std::string& bos_token() const;
  const std::string& eos_token() const;

 private:
  std::string source_;
  std::string bos_token_;
  std::string eos_token_;
  std::unique_ptr<jinja::Template> compiled_;
};

}  // namespace kiln::tmpl
