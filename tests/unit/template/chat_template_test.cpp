// ChatTemplate (src/template/chat_template.*): every chat template of tests/fixtures/templates/templates.json renders
// every conversation of conversations.json byte-identically to Python's jinja2 configured as Hugging Face configures
// it (tools/template_oracle.py, run here with python3), one named case per template and conversation; a
// conversation the oracle refuses (raise_exception, TypeError, ...) must make kiln throw kiln::Error too, with the
// template's message for raise_exception. These cases run the whole interpreter (src/template/jinja/) through
// ChatTemplate. Then the hand-checked behaviour the oracle does not pin down: the model-files loader, the request
// handling, think injection, concurrent renders, continue_final_message (assistant prefill: the expected prompts
// are written out by hand from transformers' rule for it (apply_chat_template: cut the rendered chat right after the
// last occurrence of the final message's text; keep the message's trailing whitespace only when the template kept
// it) applied to the small templates of those cases).
#include "template/chat_template.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "oracle_util.h"

namespace {

using kiln::tmpl::ChatTemplate;
using nlohmann::ordered_json;

const std::string kFixtures = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/templates";

std::string fixture(const std::string& name) { return kiln::testing::read_text_file(kFixtures + "/" + name); }

// ---- against jinja2

struct OracleCase {
  std::string name;      // the GoogleTest name
  std::string file;      // the template
  size_t conversation;   // index into conversations.json
};

void PrintTo(const OracleCase& c, std::ostream* os) { *os << c.name; }

std::vector<OracleCase> oracle_cases() {
  std::vector<OracleCase> cases;
  std::set<std::string> taken;
  const auto manifest = ordered_json::parse(fixture("templates.json"));
  const auto conversations = ordered_json::parse(fixture("conversations.json"));
  for (const auto& entry : manifest)
    for (size_t i = 0; i < conversations.size(); ++i) {
      const std::string file = entry["file"].get<std::string>();
      cases.push_back({kiln::testing::case_name(file + " " + conversations[i]["name"].get<std::string>(), taken),
                       file, i});
    }
  return cases;
}

// jinja2's renders of every template and conversation (one run of the oracle for the whole suite).
const nlohmann::json& oracle() {
  static const nlohmann::json out = [] {
    const std::string text = kiln::testing::run_command(
        "python3 '" + std::string(KILN_SOURCE_DIR) + "/tools/template_oracle.py' --manifest '" + kFixtures +
        "/templates.json' --conversations '" + kFixtures + "/conversations.json'");
    return text.empty() ? nlohmann::json() : nlohmann::json::parse(text);
  }();
  return out;
}

// First differing byte, with some context, for readable failures.
std::string describe_difference(const std::string& expected, const std::string& actual) {
  size_t i = 0;
  while (i < expected.size() && i < actual.size() && expected[i] == actual[i]) ++i;
  size_t from = i > 60 ? i - 60 : 0;
  return "first difference at byte " + std::to_string(i) + "\n  expected: ..." +
         nlohmann::json(expected.substr(from, 120)).dump() + "\n  actual:   ..." +
         nlohmann::json(actual.substr(from, 120)).dump();
}

class ChatTemplateOracle : public ::testing::TestWithParam<OracleCase> {};

TEST_P(ChatTemplateOracle, MatchesJinja2) {
  const OracleCase& c = GetParam();
  ASSERT_FALSE(oracle().is_null())
      << "tools/template_oracle.py failed: python3 with jinja2 is required (scripts/setup.sh installs "
         "python3-jinja2)";
  const auto manifest = ordered_json::parse(fixture("templates.json"));
  const auto conversations = ordered_json::parse(fixture("conversations.json"));
  ordered_json entry;
  for (const auto& e : manifest)
    if (e["file"] == c.file) entry = e;
  const ChatTemplate tmpl(fixture(c.file), entry.value("bos_token", ""), entry.value("eos_token", ""));
  const auto& rows = oracle().at(c.file);
  ASSERT_EQ(rows.size(), conversations.size());
  const auto& request = conversations[c.conversation]["request"];
  const auto& want = rows[c.conversation];
  if (want["ok"].get<bool>()) {
    std::string got;
    try {
      got = tmpl.render(request);
    } catch (const std::exception& e) {
      FAIL() << "kiln threw but jinja2 rendered: " << e.what();
    }
    const std::string expected = want["prompt"].get<std::string>();
    EXPECT_EQ(got, expected) << describe_difference(expected, got);
    return;
  }
  const std::string error = want["error"].get<std::string>();
  try {
    const std::string got = tmpl.render(request);
    ADD_FAILURE() << "jinja2 raised (" << error << ") but kiln rendered " << nlohmann::json(got.substr(0, 200)).dump();
  } catch (const kiln::Error& e) {
    const std::string prefix = "TemplateError: ";
    if (error.rfind(prefix, 0) == 0) EXPECT_EQ(std::string(e.what()), error.substr(prefix.size()));
  }
}

INSTANTIATE_TEST_SUITE_P(AllTemplatesAllConversations, ChatTemplateOracle, ::testing::ValuesIn(oracle_cases()),
                         [](const ::testing::TestParamInfo<OracleCase>& info) { return info.param.name; });

TEST(ChatTemplateOracleCorpus, HasEveryPairing) {
  // The corpus itself: at least 150 template x conversation pairs, and the oracle answered for each template.
  EXPECT_GE(oracle_cases().size(), 150u);
  ASSERT_FALSE(oracle().is_null());
  for (const auto& entry : ordered_json::parse(fixture("templates.json")))
    EXPECT_TRUE(oracle().contains(entry["file"].get<std::string>())) << entry["file"];
}

// ---- hand-checked

TEST(ChatTemplate, LoadsFromModelFiles) {
  auto from_jinja =
      ChatTemplate::from_model_files("J{{ bos_token }}", R"({"chat_template": "C", "bos_token": "<s>"})");
  EXPECT_EQ(from_jinja->render(ordered_json::parse(R"({"messages": []})")), "J<s>");
  auto from_config = ChatTemplate::from_model_files(std::nullopt, R"({"chat_template": "C{{ eos_token }}",
      "eos_token": {"content": "</s>", "lstrip": false}})");
  EXPECT_EQ(from_config->render(ordered_json::parse(R"({"messages": []})")), "C</s>");
  auto from_list = ChatTemplate::from_model_files(
      std::nullopt,
      R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})");
  EXPECT_EQ(from_list->render(ordered_json::parse(R"({"messages": []})")), "D");
  EXPECT_THROW(
      ChatTemplate::from_model_files(std::nullopt, R"({"chat_template": [{"name": "x", "template": "T"}]})"),
      kiln::Error);
  try {
    ChatTemplate::from_model_files(std::nullopt, R"({"eos_token": "</s>"})");
    FAIL();
  } catch (const kiln::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--chat-template"), std::string::npos);
  }
  EXPECT_THROW(ChatTemplate::from_model_files(std::nullopt, "{not json"), kiln::Error);
  // bos_token undefined when the tokenizer has none (HF leaves it out of the variables).
  EXPECT_EQ(ChatTemplate("{{ bos_token is defined }}").render(ordered_json::parse(R"({"messages": []})")),
            "False");
}

TEST(ChatTemplate, RequestHandling) {
  ChatTemplate t(
      "{{ add_generation_prompt }}|{{ tools }}|{{ enable_thinking }}|"
      "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments is mapping }}:"
      "{{ c.function.arguments }};{% endfor %}{% endfor %}");
  auto req = ordered_json::parse(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [
      {"type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\", \"n\": 2}"}},
      {"type": "function", "function": {"name": "g", "arguments": "not json"}},
      {"type": "function", "function": {"name": "h", "arguments": {"already": "object"}}}]}],
      "chat_template_kwargs": {"enable_thinking": false}})");
  EXPECT_EQ(t.render(req),
            "True|None|False|True:{'city': 'Paris', 'n': 2};False:not json;True:{'already': 'object'};");
  req["add_generation_prompt"] = false;
  req["tools"] = ordered_json::array();
  EXPECT_EQ(t.render(req).substr(0, 9), "False|[]|");

  EXPECT_THROW(t.render(ordered_json::parse(R"({"prompt": "x"})")), kiln::Error);
  EXPECT_THROW(t.render(ordered_json::parse(R"({"messages": [], "chat_template_kwargs": {"messages": []}})")),
               kiln::Error);
  EXPECT_THROW(t.render(ordered_json::parse(R"({"messages": [], "add_generation_prompt": "yes"})")),
               kiln::Error);
  EXPECT_THROW(t.render_json_text("{\"messages\": ["), kiln::Error);
  EXPECT_EQ(t.render_json_text(R"({"messages": []})"), "True|None||");
}

TEST(ChatTemplate, ThinkInjection) {
  ChatTemplate qwen35(fixture("Qwen3.5-4B.jinja"), "", "<|im_end|>");
  ChatTemplate qwen3(fixture("Qwen-Qwen3-0.6B.jinja"), "", "<|im_end|>");
  EXPECT_TRUE(qwen35.injects_think());
  EXPECT_FALSE(qwen3.injects_think());
  auto off = ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}})");
  std::string prompt = qwen35.render(off);
  EXPECT_EQ(prompt, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_FALSE(ChatTemplate::prompt_ends_inside_think(prompt));
  EXPECT_TRUE(ChatTemplate::prompt_ends_inside_think("<think>\nold</think>\nx<think>\n"));
  EXPECT_FALSE(ChatTemplate::prompt_ends_inside_think("plain"));
}

TEST(ChatTemplate, SglangToolShape) {
  auto tools = ordered_json::parse(R"([{"type": "function", "function": {"name": "f", "parameters":
      {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}}},
      {"type": "function", "function": {"description": "D", "name": "g", "strict": true}}])");
  ChatTemplate t("{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}");
  ordered_json req = {{"messages", ordered_json::array()}, {"tools", ChatTemplate::sglang_tools(tools)}};
  EXPECT_EQ(t.render(req),
            "{\"description\": null, \"name\": \"f\", \"parameters\": {\"type\": \"object\", \"properties\": "
            "{\"z\": {\"type\": \"string\"}, \"a\": {\"type\": \"integer\"}}}, \"strict\": false}\n"
            "{\"description\": \"D\", \"name\": \"g\", \"parameters\": null, \"strict\": true}\n");
  EXPECT_THROW(ChatTemplate::sglang_tools(ordered_json::parse(R"([{"type": "function"}])")), kiln::Error);
}

TEST(ChatTemplate, ConcurrentRendersAgree) {
  ChatTemplate t(fixture("Qwen3.5-4B.jinja"), "", "<|im_end|>");
  auto req = ordered_json::parse(R"({"messages": [{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w",
       "arguments": "{\"city\": \"Oslo\"}"}}]}, {"role": "tool", "content": "cold"}],
      "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]})");
  const std::string expected = t.render(req);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      for (int k = 0; k < 50; ++k)
        if (t.render(req) != expected) ++mismatches[i];
    });
  for (auto& th : threads) th.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(ChatTemplate, ReferencePromptQwen35) {
  // REFERENCE.md section 4: turns are <|im_start|>{role}\n...<|im_end|>\n, generation prompt opens <think>.
  ChatTemplate t(fixture("Qwen3.5-4B.jinja"), "", "<|im_end|>");
  EXPECT_EQ(
      t.render(ordered_json::parse(R"({"messages": [{"role": "system", "content": "S"},
                                                        {"role": "user", "content": "U"}]})")),
      "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n");
  EXPECT_THROW(t.render(ordered_json::parse(R"({"messages": [{"role": "system", "content": "S"}]})")),
               kiln::Error);
}

// continue_final_message (assistant prefill).

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
  EXPECT_THROW(ChatTemplate(kChatml).render(both), kiln::Error);
  // A template that drops the assistant's text leaves nothing to continue.
  ChatTemplate drops("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}");
  try {
    drops.render(prefill("Q", "Answer"));
    ADD_FAILURE() << "no error";
  } catch (const kiln::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not appear in the rendered prompt"), std::string::npos) << e.what();
  }
}

}  // namespace
