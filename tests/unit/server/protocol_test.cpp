// Request parsing and validation (src/server/protocol.cpp): OpenAI chat and completion bodies into kiln requests,
// every wrong value a 400 naming its parameter.
#include "server/protocol.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "server/api_error.h"

namespace kiln::server {
namespace {

ProtocolLimits limits() {
  ProtocolLimits l;
  l.vocab_size = 1000;
  l.default_sampling.temperature = 0.6f;
  l.default_sampling.top_k = 20;
  return l;
}

// The ApiError a call throws (status 0 when it throws none).
ApiError error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "no error");
}

ApiError chat_error(const std::string& body) { return error_of([&] { parse_chat_request(body, limits()); }); }

TEST(Protocol, JsonBodyErrorsSayWhere) {
  ApiError utf8 = error_of([] { parse_json_object("{\"a\": \"\xff\"}"); });
  EXPECT_EQ(utf8.status, 400);
  EXPECT_NE(std::string(utf8.what()).find("byte 0xFF at offset 7"), std::string::npos) << utf8.what();
  ApiError syntax = error_of([] { parse_json_object("{\"a\": }"); });
  EXPECT_EQ(syntax.code, "invalid_json");
  EXPECT_NE(std::string(syntax.what()).find("column 7"), std::string::npos) << syntax.what();
  EXPECT_EQ(error_of([] { parse_json_object("[1]"); }).status, 400);
  EXPECT_EQ(parse_json_object("{\"b\": 2, \"a\": 1}").begin().key(), "b");  // order kept
}

TEST(Protocol, ChatMessagesAreNormalisedForTheTemplate) {
  ChatRequest r = parse_chat_request(R"({"messages": [
      {"role": "developer", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
      {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "42"}]})",
                                     limits());
  const ojson& m = r.template_input["messages"];
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0]["role"], "system");  // developer is the template's system
  EXPECT_EQ(m[1]["content"], "one\ntwo");
  EXPECT_EQ(m[2]["content"], "");  // an assistant turn without content
  EXPECT_EQ(m[3]["tool_call_id"], "c1");
}

TEST(Protocol, ChatMessageErrorsNameTheMessage) {
  EXPECT_EQ(chat_error(R"({})").param, "messages");
  EXPECT_EQ(chat_error(R"({"messages": []})").param, "messages");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "robot", "content": "x"}]})").param, "messages[0].role");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user"}]})").param, "messages[0].content");
  ApiError image = chat_error(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})");
  EXPECT_NE(std::string(image.what()).find("image_url"), std::string::npos);
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]})").param,
            "messages[0].tool_calls");
}

TEST(Protocol, ImagePartsBecomeTemplateItemsAndReferences) {
  ChatRequest r = parse_chat_request(R"({"messages": [
      {"role": "system", "content": "look"},
      {"role": "user", "content": [{"type": "text", "text": "compare"},
                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
                                   {"type": "image_url", "image_url": "https://example.com/b.png"}]},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})",
                                     limits());
  const ojson& m = r.template_input["messages"];
  // The parts stay items for the template (which writes the vision placeholders), text parts unjoined.
  ASSERT_TRUE(m[1]["content"].is_array());
  EXPECT_EQ(m[1]["content"].size(), 3u);
  EXPECT_EQ(m[1]["content"][0]["text"], "compare");
  EXPECT_EQ(m[1]["content"][1]["type"], "image");
  EXPECT_EQ(m[1]["content"][2]["type"], "image");
  EXPECT_EQ(m[2]["content"], "a\nb");  // no image: joined as before
  ASSERT_EQ(r.images.size(), 2u);
  EXPECT_EQ(r.images[0].url, "data:image/png;base64,AAAA");
  EXPECT_EQ(r.images[0].where, "messages[1].content[1]");
  EXPECT_EQ(r.images[1].url, "https://example.com/b.png");
  // Limits, roles, shapes.
  ProtocolLimits one = limits();
  one.max_images = 1;
  const std::string two = R"({"messages": [{"role": "user", "content": [
      {"type": "image_url", "image_url": {"url": "a"}}, {"type": "image_url", "image_url": {"url": "b"}}]}]})";
  ApiError over = error_of([&] { parse_chat_request(two, one); });
  EXPECT_EQ(over.param, "messages[0].content[1]");
  EXPECT_NE(std::string(over.what()).find("--limit-mm-per-prompt"), std::string::npos) << over.what();
  ProtocolLimits none = limits();
  none.max_images = 0;
  ApiError text_only = error_of([&] { parse_chat_request(two, none); });
  EXPECT_NE(std::string(text_only.what()).find("text only"), std::string::npos) << text_only.what();
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "a"}}]}]})")
                .param,
            "messages[0].content[0]");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]})")
                .status,
            400);
}

TEST(Protocol, SamplingDefaultsAndRanges) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  ChatRequest d = parse_chat_request("{" + msgs + "}", limits());
  EXPECT_FLOAT_EQ(d.sampling.temperature, 0.6f);  // the model's default
  EXPECT_EQ(d.sampling.top_k, 20);
  EXPECT_FALSE(d.max_tokens.has_value());
  ChatRequest r = parse_chat_request(
      "{" + msgs + R"(, "temperature": 0, "top_k": -1, "max_tokens": 10, "max_completion_tokens": 7, "seed": 5,
      "stop": "END", "logit_bias": {"3": -100}})",
      limits());
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.top_k, 0);  // -1 is off
  EXPECT_EQ(r.max_tokens, 7);      // max_completion_tokens wins
  EXPECT_EQ(r.sampling.seed, 5u);
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  ASSERT_EQ(r.sampling.logit_bias.size(), 1u);
  EXPECT_EQ(r.sampling.logit_bias[0].first, 3);
  EXPECT_FLOAT_EQ(r.sampling.logit_bias[0].second, -100.0f);
  EXPECT_EQ(chat_error("{" + msgs + R"(, "temperature": 2.5})").param, "temperature");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "top_p": 0})").param, "top_p");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "max_tokens": 0})").param, "max_tokens");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "logit_bias": {"1000": 1}})").param, "logit_bias");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "stop": [""]})").param, "stop");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "stream_options": {"include_usage": true}})").param, "stream_options");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "top_logprobs": 3})").param, "top_logprobs");
  ApiError unknown = chat_error("{" + msgs + R"(, "frobnicate": 1})");
  EXPECT_EQ(unknown.code, "unsupported_parameter");
  EXPECT_EQ(unknown.param, "frobnicate");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "frobnicate": null})").status, 0);  // null is absent
}

TEST(Protocol, ToolsAndToolChoice) {
  const std::string base = R"("messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])";
  ChatRequest none = parse_chat_request("{" + base + R"(, "tool_choice": "none"})", limits());
  EXPECT_TRUE(none.tool_choice_none);
  EXPECT_FALSE(none.template_input.contains("tools"));  // the model is not shown tools it may not call
  ChatRequest named = parse_chat_request(
      "{" + base + R"(, "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": false})",
      limits());
  EXPECT_EQ(named.tool_choice["function"]["name"], "f");
  EXPECT_FALSE(named.parallel_tool_calls);
  EXPECT_TRUE(named.template_input.contains("tools"));
  EXPECT_EQ(chat_error("{" + base + R"(, "tool_choice": "sometimes"})").param, "tool_choice");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]})").param,
            "tools[0].type");
}

TEST(Protocol, ChatTemplateKwargs) {
  ChatRequest r = parse_chat_request(
      R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": false}})",
      limits());
  EXPECT_EQ(r.enable_thinking, false);
  EXPECT_EQ(r.template_input["chat_template_kwargs"]["enable_thinking"], false);
  EXPECT_EQ(
      chat_error(R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": 1}})")
          .param,
      "chat_template_kwargs");
}

TEST(Protocol, CompletionPrompts) {
  CompletionRequest text = parse_completion_request(R"({"prompt": "hello", "echo": true, "logprobs": 2})", limits());
  ASSERT_EQ(text.prompts.size(), 1u);
  EXPECT_EQ(std::get<std::string>(text.prompts[0]), "hello");
  EXPECT_TRUE(text.echo);
  EXPECT_TRUE(text.logprobs);
  EXPECT_EQ(text.top_logprobs, 2);  // completions: logprobs is the number of alternatives
  CompletionRequest ids = parse_completion_request(R"({"prompt": [1, 2, 3]})", limits());
  EXPECT_EQ(std::get<std::vector<int32_t>>(ids.prompts[0]), (std::vector<int32_t>{1, 2, 3}));
  CompletionRequest many = parse_completion_request(R"({"prompt": ["a", [4]], "n": 2})", limits());
  EXPECT_EQ(many.prompts.size(), 2u);
  EXPECT_EQ(many.n, 2);
  auto err = [](const std::string& body) { return error_of([&] { parse_completion_request(body, limits()); }); };
  EXPECT_EQ(err(R"({})").param, "prompt");
  EXPECT_EQ(err(R"({"prompt": [1000]})").param, "prompt");  // past the vocabulary
  EXPECT_EQ(err(R"({"prompt": ""})").param, "prompt");
  EXPECT_EQ(err(R"({"prompt": "a", "best_of": 3})").param, "best_of");
  EXPECT_EQ(err(R"({"prompt": "a", "messages": []})").param, "messages");  // a chat field
  ApiError too_many = err(R"({"prompt": ["a", "b", "c"], "n": 30})");
  EXPECT_NE(std::string(too_many.what()).find("90 choices"), std::string::npos) << too_many.what();
}


// Issue 29: fields the official SDKs and agent clients send that change nothing here are accepted (a wrong type is
// still a 400); completions take the ones that are not chat-specific.
TEST(Protocol, HarmlessClientFieldsAreAccepted) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  EXPECT_EQ(chat_error("{" + msgs + R"(, "store": false, "metadata": {"team": "a"}, "service_tier": "auto",
      "prompt_cache_key": "k1", "safety_identifier": "u-7", "verbosity": "low", "reasoning_effort": "high"})")
                .status,
            0);
  EXPECT_EQ(chat_error("{" + msgs + R"(, "store": "yes"})").param, "store");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "metadata": [1]})").param, "metadata");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "reasoning_effort": "extreme"})").param, "reasoning_effort");
  auto completion_error = [](const std::string& body) {
    return error_of([&] { parse_completion_request(body, limits()); });
  };
  EXPECT_EQ(completion_error(R"({"prompt": "x", "store": true, "metadata": {}, "service_tier": "default",
      "prompt_cache_key": "k", "safety_identifier": "s"})")
                .status,
            0);
  // verbosity and reasoning_effort are chat settings: a completion that sends them is told so.
  EXPECT_EQ(completion_error(R"({"prompt": "x", "verbosity": "low"})").code, "unsupported_parameter");
}

TEST(Protocol, ReasoningEffortNoneOrMinimalTurnsThinkingOff) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  for (const char* effort : {"none", "minimal"}) {
    ChatRequest r = parse_chat_request("{" + msgs + R"(, "reasoning_effort": ")" + effort + "\"}", limits());
    EXPECT_EQ(r.enable_thinking, false) << effort;
    EXPECT_EQ(r.template_input["chat_template_kwargs"]["enable_thinking"], false) << effort;
  }
  ChatRequest high = parse_chat_request("{" + msgs + R"(, "reasoning_effort": "high"})", limits());
  EXPECT_FALSE(high.enable_thinking.has_value());
  EXPECT_FALSE(high.template_input.contains("chat_template_kwargs"));
  // An explicit enable_thinking wins over the effort.
  ChatRequest both = parse_chat_request(
      "{" + msgs + R"(, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": true}})", limits());
  EXPECT_EQ(both.enable_thinking, true);
  EXPECT_EQ(both.template_input["chat_template_kwargs"]["enable_thinking"], true);
}

TEST(Protocol, MinTokens) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  EXPECT_EQ(parse_chat_request("{" + msgs + R"(, "min_tokens": 5, "max_tokens": 9})", limits()).min_tokens, 5);
  EXPECT_EQ(parse_chat_request("{" + msgs + "}", limits()).min_tokens, 0);
  EXPECT_EQ(parse_completion_request(R"({"prompt": "x", "min_tokens": 3})", limits()).min_tokens, 3);
  EXPECT_EQ(chat_error("{" + msgs + R"(, "min_tokens": 10, "max_tokens": 9})").param, "min_tokens");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "min_tokens": -1})").param, "min_tokens");
}

TEST(Protocol, ContinueFinalMessage) {
  const std::string prefill = R"("messages": [{"role": "user", "content": "x"},
      {"role": "assistant", "content": "The answer is"}])";
  ChatRequest r = parse_chat_request("{" + prefill + R"(, "continue_final_message": true})", limits());
  EXPECT_TRUE(r.continue_final_message);
  EXPECT_EQ(r.template_input["continue_final_message"], true);
  EXPECT_EQ(r.template_input["add_generation_prompt"], false);
  EXPECT_EQ(parse_chat_request("{" + prefill + R"(, "continue_final_message": true, "add_generation_prompt": false})",
                               limits())
                .template_input["add_generation_prompt"],
            false);
  EXPECT_EQ(chat_error("{" + prefill + R"(, "continue_final_message": true, "add_generation_prompt": true})").param,
            "continue_final_message");
  // The last message must be an assistant turn with text to continue.
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true})").param,
            "continue_final_message");
}

TEST(Protocol, NumberOutOfRangeIs400) {
  ApiError e = error_of([] { parse_json_object(R"({"temperature": 1e999})"); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_NE(std::string(e.what()).find("1e999"), std::string::npos) << e.what();
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1e400})").status, 400);
}

TEST(Protocol, ToolCallArgumentsMustBeAJsonObject) {
  auto with_args = [](const std::string& args) {
    return R"({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": )" + args + "}}]}]}";
  };
  EXPECT_EQ(chat_error(with_args(R"("{\"city\": \"Paris\"}")")).status, 0);
  EXPECT_EQ(chat_error(with_args(R"({"city": "Paris"})")).status, 0);  // the object itself
  ApiError text = chat_error(with_args(R"("city=Paris")"));
  EXPECT_EQ(text.status, 400);
  EXPECT_EQ(text.param, "messages[1].tool_calls[1].function.arguments");
  EXPECT_NE(std::string(text.what()).find("messages[1]"), std::string::npos) << text.what();
  EXPECT_EQ(chat_error(with_args(R"("[1, 2]")")).param, "messages[1].tool_calls[1].function.arguments");
  EXPECT_EQ(chat_error(with_args("42")).param, "messages[1].tool_calls[1].function.arguments");
}

TEST(Protocol, TokenIdsBeyondTheTokenizerAreRefused) {
  // The server sets vocab_size to the tokenizer's ids (http_server.cpp); every id-taking field checks it.
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  EXPECT_EQ(chat_error("{" + msgs + R"(, "logit_bias": {"999": 1}})").status, 0);
  EXPECT_EQ(chat_error("{" + msgs + R"(, "logit_bias": {"1000": 1}})").param, "logit_bias");
  EXPECT_EQ(chat_error("{" + msgs + R"(, "stop_token_ids": [1000]})").param, "stop_token_ids");
  EXPECT_EQ(error_of([] { parse_completion_request(R"({"prompt": [1, 1000]})", limits()); }).param, "prompt");
}

}  // namespace
}  // namespace kiln::server
