// Placeholder until the Jinja interpreter lands: keeps the public API linkable.
#include "template/chat_template.h"
#include "core/error.h"

namespace kiln::tmpl {
namespace jinja {
class Template {};
}  // namespace jinja

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token)
    : source_(std::move(source)), bos_token_(std::move(bos_token)), eos_token_(std::move(eos_token)) {}
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::unique_ptr<ChatTemplate> ChatTemplate::from_model_files(std::optional<std::string>, std::string_view) {
  fail("chat templates are not implemented yet");
}
std::string ChatTemplate::render(const nlohmann::ordered_json&) const {
  fail("chat templates are not implemented yet");
}
std::string ChatTemplate::render_json_text(std::string_view) const {
  fail("chat templates are not implemented yet");
}
bool ChatTemplate::injects_think() const { return false; }
bool ChatTemplate::prompt_ends_inside_think(std::string_view prompt) {
  auto open = prompt.rfind("<think>");
  auto close = prompt.rfind("</think>");
  return open != std::string_view::npos && (close == std::string_view::npos || open > close);
}
}  // namespace kiln::tmpl
