// The Anthropic Messages API (src/server/anthropic_api.cpp) on an in-process server over the echo runner (the
// "model" repeats the last user turn): content blocks, thinking, tool_use, stop reasons, usage arithmetic, the
// streamed event sequence, count_tokens and Anthropic-shaped errors. The translation itself is checked on
// parse_messages_request directly.
#include "server/anthropic_api.h"

#include <gtest/gtest.h>

#include "http_test_server.h"
#include "server/api_error.h"

namespace kiln::server {
namespace {

using namespace test;

json message_body(const std::string& user_text, json extra = json::object()) {
  json body = {{"model", "test-model"}, {"max_tokens", 400}, {"messages", {{{"role", "user"}, {"content", user_text}}}}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

json weather_tool() {
  return {{"name", "get_weather"},
          {"description", "Current weather"},
          {"input_schema",
           {{"type", "object"},
            {"properties", {{"city", {{"type", "string"}}}, {"days", {{"type", "integer"}}}}},
            {"required", {"city"}}}}};
}

const std::string kToolXml =
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "</function>\n</tool_call>";

ProtocolLimits limits() {
  ProtocolLimits l;
  l.vocab_size = 512;
  return l;
}

TEST(AnthropicApi, TranslatesBlocksToolsAndChoice) {
  ojson body = ojson::parse(R"({
    "model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "be brief"}],
    "messages": [
      {"role": "user", "content": [{"type": "text", "text": "weather?", "cache_control": {"type": "ephemeral"}}]},
      {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool", "signature": "x"},
                                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold", "is_error": true},
                                   {"type": "text", "text": "and tomorrow?"}]}],
    "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
    "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5, "metadata": {"user_id": "u"}})");
  MessagesRequest r = parse_messages_request(body, limits());
  const ojson& m = r.chat.template_input["messages"];
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0]["role"], "system");
  EXPECT_EQ(m[0]["content"], "be brief");
  EXPECT_EQ(m[1]["content"], "weather?");
  EXPECT_EQ(m[2]["reasoning_content"], "use the tool");
  EXPECT_EQ(m[2]["tool_calls"][0]["id"], "toolu_1");
  EXPECT_EQ(ojson::parse(m[2]["tool_calls"][0]["function"]["arguments"].get<std::string>())["city"], "Oslo");
  EXPECT_EQ(m[3]["role"], "tool");
  EXPECT_EQ(m[3]["tool_call_id"], "toolu_1");
  EXPECT_EQ(m[3]["content"], "Error: cold");
  EXPECT_EQ(m[4]["role"], "user");
  EXPECT_EQ(m[4]["content"], "and tomorrow?");
  EXPECT_EQ(r.chat.tool_choice, "required");  // any = OpenAI's required: the grammar forces a call
  EXPECT_FALSE(r.chat.parallel_tool_calls);
  EXPECT_EQ(r.chat.stop, std::vector<std::string>{"END"});
  EXPECT_FLOAT_EQ(r.chat.sampling.temperature, 0.5f);
  EXPECT_EQ(r.chat.sampling.top_k, 5);
  EXPECT_EQ(r.chat.max_tokens, 100);
  EXPECT_FALSE(r.thinking);
  EXPECT_EQ(r.chat.enable_thinking, false);  // off unless requested

  ojson named = ojson::parse(R"({"max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "f"},
      "thinking": {"type": "enabled", "budget_tokens": 5}})");
  MessagesRequest n = parse_messages_request(named, limits());
  EXPECT_EQ(n.chat.tool_choice["function"]["name"], "f");
  EXPECT_TRUE(n.thinking);
  EXPECT_EQ(n.thinking_budget, 5);
  EXPECT_EQ(n.chat.enable_thinking, true);
}

TEST(AnthropicApi, ImageBlocksBecomeImageParts) {
  ojson body = ojson::parse(R"({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [
      {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
      {"type": "text", "text": "what is it?"},
      {"type": "image", "source": {"type": "url", "url": "https://example.com/x.jpg"}}]}]})");
  MessagesRequest r = parse_messages_request(body, limits());
  const ojson& m = r.chat.template_input["messages"];
  ASSERT_EQ(m.size(), 1u);
  ASSERT_TRUE(m[0]["content"].is_array());
  EXPECT_EQ(m[0]["content"][0]["type"], "image");
  EXPECT_EQ(m[0]["content"][1]["text"], "what is it?");
  ASSERT_EQ(r.chat.images.size(), 2u);
  EXPECT_EQ(r.chat.images[0].url, "data:image/png;base64,iVBORw0KGgo=");
  EXPECT_EQ(r.chat.images[1].url, "https://example.com/x.jpg");
  ojson bad = ojson::parse(R"({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [
      {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]})");
  try {
    parse_messages_request(bad, limits());
    ADD_FAILURE() << "a file source was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "messages[0].content[0].source.type");
  }
}

TEST(AnthropicApi, ValidationNamesTheField) {
  auto param_of = [](const std::string& text, bool count_only = false) {
    try {
      parse_messages_request(ojson::parse(text), limits(), count_only);
    } catch (const ApiError& e) {
      return e.param;
    }
    return std::string("(none)");
  };
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": "x"}]})"), "max_tokens");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": "x"}]})", true), "(none)");  // count_tokens
  EXPECT_EQ(param_of(R"({"max_tokens": 5, "messages": []})"), "messages");
  EXPECT_EQ(param_of(R"({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]})"), "messages[0].role");
  EXPECT_EQ(param_of(R"({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]})"),
            "messages[0].content[0].source");  // an image block needs its source
  EXPECT_EQ(param_of(R"({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]})"),
            "temperature");
  EXPECT_EQ(param_of(R"({"max_tokens": 5, "tool_choice": {"type": "maybe"}, "messages": [{"role": "user", "content": "x"}]})"),
            "tool_choice.type");
  EXPECT_EQ(param_of(R"({"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 9},
                         "messages": [{"role": "user", "content": "x"}]})"),
            "thinking.budget_tokens");  // not below max_tokens
  EXPECT_EQ(param_of(R"({"max_tokens": 5, "top_a": 1, "messages": [{"role": "user", "content": "x"}]})"), "top_a");
  EXPECT_EQ(param_of(R"({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}],
                         "messages": [{"role": "user", "content": "x"}]})"),
            "tools[0].type");
}

TEST(AnthropicApi, TextAnswerUsageAndCountTokens) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/messages", message_body("Hello there."));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["type"], "message");
  EXPECT_EQ(r.j["role"], "assistant");
  EXPECT_EQ(r.j["id"].get<std::string>().rfind("msg_", 0), 0u);
  EXPECT_EQ(r.j["model"], "test-model");
  ASSERT_EQ(r.j["content"].size(), 1u);
  EXPECT_EQ(r.j["content"][0]["type"], "text");
  EXPECT_EQ(r.j["content"][0]["text"], "Hello there.");
  EXPECT_EQ(r.j["stop_reason"], "end_turn");
  EXPECT_TRUE(r.j["stop_sequence"].is_null());
  const json& u = r.j["usage"];
  EXPECT_EQ(u["output_tokens"], std::string("Hello there.").size() + 1);  // one byte a token, + end of turn
  Reply c = post(s, "/v1/messages/count_tokens", json{{"model", "test-model"}, {"messages", message_body("Hello there.")["messages"]}});
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(u["input_tokens"].get<int64_t>() + u["cache_read_input_tokens"].get<int64_t>(), c.j["input_tokens"]);
  // The same prompt again: its prefix comes from the cache, and input_tokens counts only the rest.
  Reply again = post(s, "/v1/messages", message_body("Hello there."));
  const json& u2 = again.j["usage"];
  EXPECT_GT(u2["cache_read_input_tokens"].get<int64_t>(), 0);
  EXPECT_EQ(u2["input_tokens"].get<int64_t>() + u2["cache_read_input_tokens"].get<int64_t>(), c.j["input_tokens"]);
}

TEST(AnthropicApi, ThinkingBlockThenText) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/messages",
                 message_body("Two and two.</think>\n\nFour.", {{"thinking", {{"type", "enabled"}, {"budget_tokens", 100}}}}));
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(r.j["content"].size(), 2u) << r.body;
  EXPECT_EQ(r.j["content"][0]["type"], "thinking");
  EXPECT_EQ(r.j["content"][0]["thinking"], "Two and two.");
  EXPECT_EQ(r.j["content"][1]["type"], "text");
  EXPECT_EQ(r.j["content"][1]["text"], "Four.");
}

TEST(AnthropicApi, ThinkingBudgetClosesTheBlockAndTheAnswerFollows) {
  TestServer& s = shared_server();
  // The model would think for 10 bytes; the budget of 5 tokens (bytes) closes the block after "abcde", and the
  // answer gets the rest of max_tokens (12 - 5 = 7 tokens).
  Reply r = post(s, "/v1/messages",
                 message_body("abcdefghij</think>\n\nDone.",
                              {{"max_tokens", 12}, {"thinking", {{"type", "enabled"}, {"budget_tokens", 5}}}}));
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(r.j["content"].size(), 2u) << r.body;
  EXPECT_EQ(r.j["content"][0]["type"], "thinking");
  EXPECT_EQ(r.j["content"][0]["thinking"], "abcde");
  EXPECT_EQ(r.j["content"][1]["type"], "text");
  EXPECT_EQ(r.j["stop_reason"], "max_tokens");
  EXPECT_EQ(r.j["usage"]["output_tokens"], 12);  // the closing "</think>" is the server's, not counted
  // Without a budget the same request thinks for all of its tokens.
  Reply free = post(s, "/v1/messages",
                    message_body("abcdefghij</think>\n\nDone.", {{"max_tokens", 10}, {"thinking", {{"type", "enabled"}}}}));
  EXPECT_EQ(free.j["content"][0]["thinking"], "abcdefghij");
  EXPECT_EQ(free.j["content"].size(), 1u) << free.body;
}

TEST(AnthropicApi, ToolUseStopSequenceAndMaxTokens) {
  TestServer& s = shared_server();
  Reply t = post(s, "/v1/messages", message_body(kToolXml, {{"tools", {weather_tool()}}}));
  ASSERT_EQ(t.status, 200) << t.body;
  EXPECT_EQ(t.j["stop_reason"], "tool_use");
  ASSERT_EQ(t.j["content"].size(), 1u) << t.body;
  const json& call = t.j["content"][0];
  EXPECT_EQ(call["type"], "tool_use");
  EXPECT_EQ(call["id"].get<std::string>().rfind("toolu_", 0), 0u);
  EXPECT_EQ(call["name"], "get_weather");
  EXPECT_EQ(call["input"], json({{"city", "Paris"}, {"days", 3}}));
  Reply st = post(s, "/v1/messages", message_body("abc STOP def", {{"stop_sequences", {"STOP"}}}));
  EXPECT_EQ(st.j["content"][0]["text"], "abc ");
  EXPECT_EQ(st.j["stop_reason"], "stop_sequence");
  EXPECT_EQ(st.j["stop_sequence"], "STOP");
  Reply mt = post(s, "/v1/messages", message_body("a long answer", {{"max_tokens", 3}}));
  EXPECT_EQ(mt.j["stop_reason"], "max_tokens");
  EXPECT_EQ(mt.j["content"][0]["text"], "a l");
  EXPECT_EQ(mt.j["usage"]["output_tokens"], 3);
}

TEST(AnthropicApi, StreamedEventSequence) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/messages",
                 message_body("Hmm.</think>\n\nSunny.\n\n" + kToolXml,
                              {{"stream", true}, {"tools", {weather_tool()}}, {"thinking", {{"type", "enabled"}}}}));
  ASSERT_EQ(r.status, 200) << r.body;
  auto events = named_sse_events(r.body);
  ASSERT_GE(events.size(), 8u) << r.body;
  std::vector<std::string> names;
  for (const auto& [name, data] : events) {
    EXPECT_EQ(data["type"], name) << "the data's type is the event name";
    if (name != "content_block_delta" || names.back() != "content_block_delta") names.push_back(name);
  }
  const std::vector<std::string> expected = {
      "message_start", "ping",
      "content_block_start", "content_block_delta", "content_block_stop",   // thinking
      "content_block_start", "content_block_delta", "content_block_stop",   // text
      "content_block_start", "content_block_delta", "content_block_stop",   // tool_use
      "message_delta", "message_stop"};
  EXPECT_EQ(names, expected) << r.body;
  // Block contents, merged per index.
  std::map<int, std::string> text;
  std::map<int, json> starts;
  for (const auto& [name, data] : events) {
    if (name == "content_block_start") starts[data["index"]] = data["content_block"];
    if (name != "content_block_delta") continue;
    const json& d = data["delta"];
    if (d["type"] == "thinking_delta") text[data["index"]] += d["thinking"].get<std::string>();
    if (d["type"] == "text_delta") text[data["index"]] += d["text"].get<std::string>();
    if (d["type"] == "input_json_delta") text[data["index"]] += d["partial_json"].get<std::string>();
  }
  EXPECT_EQ(starts[0]["type"], "thinking");
  EXPECT_EQ(text[0], "Hmm.");
  EXPECT_EQ(starts[1]["type"], "text");
  EXPECT_EQ(text[1], "Sunny.");  // the whitespace before the call is not text
  EXPECT_EQ(starts[2]["type"], "tool_use");
  EXPECT_EQ(starts[2]["name"], "get_weather");
  EXPECT_EQ(json::parse(text[2]), json({{"city", "Paris"}, {"days", 3}}));
  const json& start = events[0].second["message"];
  EXPECT_EQ(start["usage"]["output_tokens"], 0);
  const json& delta = events[events.size() - 2].second;
  EXPECT_EQ(delta["delta"]["stop_reason"], "tool_use");
  EXPECT_EQ(delta["usage"]["input_tokens"], start["usage"]["input_tokens"]);
  EXPECT_GT(delta["usage"]["output_tokens"].get<int64_t>(), 0);
}

TEST(AnthropicApi, ErrorsAreAnthropicShaped) {
  TestServer& s = shared_server();
  json no_max = message_body("x");
  no_max.erase("max_tokens");
  Reply e = post(s, "/v1/messages", no_max);
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.j["type"], "error");
  EXPECT_EQ(e.j["error"]["type"], "invalid_request_error");
  EXPECT_NE(e.j["error"]["message"].get<std::string>().find("max_tokens"), std::string::npos);
  Reply model = post(s, "/v1/messages", message_body("x", {{"model", "claude-opus"}}));
  EXPECT_EQ(model.status, 404);
  EXPECT_EQ(model.j["error"]["type"], "not_found_error");
  Reply bad_json = post(s, "/v1/messages", std::string("{nope"));
  EXPECT_EQ(bad_json.status, 400);
  EXPECT_EQ(bad_json.j["type"], "error");
  Reply route = post(s, "/v1/messages/batches", message_body("x"));
  EXPECT_EQ(route.status, 404);
  EXPECT_EQ(route.j["type"], "error");
  EXPECT_EQ(route.j["error"]["type"], "not_found_error");
}

TEST(AnthropicApi, XApiKeyAuthenticates) {
  ServerConfig cfg;
  cfg.api_key = "sekret";
  TestServer s(cfg);
  Reply no = post(s, "/v1/messages", message_body("hi"));
  EXPECT_EQ(no.status, 401);
  EXPECT_EQ(no.j["error"]["type"], "authentication_error");
  EXPECT_EQ(post(s, "/v1/messages", message_body("hi").dump(), {{"x-api-key", "wrong"}}).status, 401);
  EXPECT_EQ(post(s, "/v1/messages", message_body("hi").dump(), {{"x-api-key", "sekret"}}).status, 200);
}

}  // namespace
}  // namespace kiln::server
