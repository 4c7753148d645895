// Chat templates: renders an OpenAI-style chat request into a prompt string with the model's Jinja
// chat template, byte-identical to Hugging Face transformers' apply_chat_template (same Jinja
// environment: trim_blocks, lstrip_blocks, loop controls, HF's tojson, raise_exception,
// strftime_now, {% generation %}). The Jinja interpreter behind it lives in src/template/jinja/.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

// Rendering is const and thread-safe: one ChatTemplate can serve concurrent requests. A render is
// bounded (call depth, steps, output size; see jinja::RenderLimits) and never crashes on a bad template
// or request: every failure is a kiln::Error.
namespace kiln::tmpl {

namespace jinja {
class Template;
}

class ChatTemplate {
 public:
  // source: the Jinja text. bos/eos token strings are exposed to the template as bos_token/eos_token
  // (an empty string leaves the variable undefined, as HF does for a tokenizer without that token).
  // Throws kiln::Error with line:column when the template does not parse.
  ChatTemplate(std::string source, std::string bos_token = "", std::string eos_token = "");
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // From a model folder's contents: chat_template.jinja text if present, else tokenizer_config.json's
  // `chat_template` (string, or list of {name, template}: take "default"). bos/eos come from
  // tokenizer_config.json's bos_token/eos_token (string or {"content": ...}). Error if no template.
  static std::unique_ptr<ChatTemplate> from_model_files(std::optional<std::string> chat_template_jinja,
                                                        std::string_view tokenizer_config_json);

  // Renders an OpenAI-style chat request: request["messages"] (required), optional "tools" (passed
  // as given; absent/null -> none), "add_generation_prompt" (default true), "chat_template_kwargs"
  // (object: each key becomes a template variable, e.g. enable_thinking). Tool-call `arguments` given
  // as a JSON string are parsed (kept as the raw string when not valid JSON), as SGLang/vLLM do.
  // Takes ordered_json because key order is visible in the prompt (tool schemas go through tojson,
  // Python dicts keep insertion order); parse requests with nlohmann::ordered_json::parse.
  // "continue_final_message": true (with add_generation_prompt false) renders the last message without what the
  // template writes after its text (its end of turn), so generation continues it: transformers' rule, the text
  // found from the end of the prompt (an error when the template drops or rewrites it).
  // Throws kiln::Error for a bad request, a template runtime error (with line:column), or when the
  // template calls raise_exception(msg) (then the message is exactly the template's msg).
  std::string render(const nlohmann::ordered_json& request) const;
  // Same, from the request's JSON text.
  std::string render_json_text(std::string_view request_json) const;

  // SGLang hands chat templates the tools in its own shape: the `function` object of each OpenAI tool
  // as its pydantic model dumps it, {"description", "name", "parameters", "strict"} in that order
  // (description/parameters null and strict false when absent). Current SGLang keeps the OpenAI
  // {"type", "function"} wrapping only for templates that read `tool.function` (Qwen3-Coder does,
  // Qwen3.5 does not), so a Qwen3.5 prompt under SGLang shows this flat shape through `tool | tojson`.
  // Use it on request["tools"] to reproduce SGLang's prompts exactly.
  static nlohmann::ordered_json sglang_tools(const nlohmann::ordered_json& openai_tools);

  // Whether this template's generation prompt (default kwargs) leaves the model inside a think block,
  // i.e. the prompt ends with "<think>" (trailing whitespace ignored), as Qwen3.5's does.
  bool injects_think() const;
  // The same question for an already rendered prompt: the last "<think>" comes after the last
  // "</think>". Use this per request (enable_thinking=false closes the block).
  static bool prompt_ends_inside_think(std::string_view rendered_prompt);

  const std::string& source() const { return source_; }
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }

 private:
  std::string source_;
  std::string bos_token_;
  std::string eos_token_;
  std::unique_ptr<jinja::Template> compiled_;
};

}  // namespace kiln::tmpl
