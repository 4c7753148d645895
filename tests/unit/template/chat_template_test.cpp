// Chat-template rendering options of src/template/chat_template.cpp: continue_final_message (assistant prefill).
// The expected prompts are written out by hand from transformers' rule for continue_final_message
// (apply_chat_template: cut the rendered chat right after the last occurrence of the final message's text; keep
// the message's trailing whitespace only when the template kept it) applied to the small templates below.
#include "template/chat_template.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace kiln::tmpl {
namespace {

using nlohmann::ordered_json;

const char* kChatml =
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
// The same, but the template trims every message (as many do).
const char* kChatmlTrim =
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content | trim) + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

ordered_json prefill(const std::string& user, const std::string& assistant) {
  return ordered_json{{"messages",
                       {{{"role", "user"}, {"content", user}}, {{"role", "assistant"}, {"content", assistant}}}},
                      {"continue_final_message", true}};
}

TEST(ChatTemplate, ContinueFinalMessageEndsAtTheText) {
  ChatTemplate t(kChatml);
  EXPECT_EQ(t.render(prefill("Say it.", "The answer is")),
            "<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\nThe answer is");
  // add_generation_prompt false given explicitly: the same.
  ordered_json r = prefill("Say it.", "The answer is");
  r["add_generation_prompt"] = false;
  EXPECT_EQ(t.render(r), "<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\nThe answer is");
  // Without the option the turn is closed.
  r["continue_final_message"] = false;
  EXPECT_EQ(t.render(r), "<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\nThe answer is<|im_end|>\n");
}

TEST(ChatTemplate, ContinueFinalMessageTrailingWhitespace) {
  // Kept by the template: kept.
  EXPECT_EQ(ChatTemplate(kChatml).render(prefill("Q", "A: ")), "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA: ");
  // Trimmed by the template: the prompt ends at the trimmed text.
  EXPECT_EQ(ChatTemplate(kChatmlTrim).render(prefill("Q", "A: ")),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA:");
}

TEST(ChatTemplate, ContinueFinalMessageFindsTheLastOccurrence) {
  EXPECT_EQ(ChatTemplate(kChatml).render(prefill("ok", "ok")), "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\nok");
}

TEST(ChatTemplate, ContinueFinalMessageErrors) {
  ordered_json both = prefill("Q", "A");
  both["add_generation_prompt"] = true;
  EXPECT_THROW(ChatTemplate(kChatml).render(both), Error);
  // A template that drops the assistant's text leaves nothing to continue.
  ChatTemplate drops("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}");
  try {
    drops.render(prefill("Q", "Answer"));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not appear in the rendered prompt"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln::tmpl
