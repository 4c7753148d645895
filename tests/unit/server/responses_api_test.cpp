// The OpenAI Responses API (src/server/responses_api.cpp) on an in-process server over the echo runner: output
// items, usage arithmetic, function-call round trips by items and by previous_response_id, the store's 404, the
// streamed event sequence; and the translation on parse_responses_request directly.
#include "server/responses_api.h"

#include <gtest/gtest.h>

#include "http_test_server.h"
#include "server/api_error.h"

namespace kiln::server {
namespace {

using namespace test;

json responses_body(json input, json extra = json::object()) {
  json body = {{"model", "test-model"}, {"input", std::move(input)}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

json weather_tool() {
  return {{"type", "function"},
          {"name", "get_weather"},
          {"parameters",
           {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}, {"required", {"city"}}}}};
}

const std::string kToolXml =
    "Need weather.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>";

ProtocolLimits limits() {
  ProtocolLimits l;
  l.vocab_size = 512;
  return l;
}

TEST(ResponsesApi, TranslatesItemsInstructionsAndFormat) {
  ojson body = ojson::parse(R"({
    "model": "m", "instructions": "be brief", "max_output_tokens": 50, "store": false,
    "input": [
      {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
      {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "call it"}]},
      {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
      {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
      {"type": "message", "role": "developer", "content": "answer in French"}],
    "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": true}],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
    "reasoning": {"effort": "none"}, "metadata": {"k": "v"}, "prompt_cache_key": "x"})");
  ojson previous = ojson::array({{{"role", "user"}, {"content", "earlier"}}});
  ResponsesRequest r = parse_responses_request(body, limits(), previous);
  const ojson& m = r.chat.template_input["messages"];
  ASSERT_EQ(m.size(), 6u) << m.dump();
  EXPECT_EQ(m[0]["role"], "system");
  EXPECT_EQ(m[0]["content"], "be brief");
  EXPECT_EQ(m[1]["content"], "earlier");  // the previous response's conversation comes first
  EXPECT_EQ(m[2]["content"], "weather?");
  EXPECT_EQ(m[3]["role"], "assistant");  // reasoning and the call are one assistant turn
  EXPECT_EQ(m[3]["reasoning_content"], "call it");
  EXPECT_EQ(m[3]["tool_calls"][0]["id"], "call_1");
  EXPECT_EQ(m[4]["role"], "tool");
  EXPECT_EQ(m[4]["content"], "cold");
  EXPECT_EQ(m[5]["role"], "system");
  // The stored conversation leaves the instructions out.
  ASSERT_EQ(r.conversation.size(), 5u);
  EXPECT_EQ(r.conversation[0]["content"], "earlier");
  EXPECT_FALSE(r.store);
  EXPECT_EQ(r.chat.max_tokens, 50);
  EXPECT_EQ(r.chat.tool_choice["function"]["name"], "get_weather");
  EXPECT_EQ(r.chat.response_format["type"], "json_schema");
  EXPECT_EQ(r.chat.response_format["json_schema"]["name"], "w");
  EXPECT_EQ(r.chat.enable_thinking, false);
  EXPECT_EQ(r.echo["instructions"], "be brief");
  EXPECT_EQ(r.echo["max_output_tokens"], 50);
}

TEST(ResponsesApi, InputImagesBecomeImageParts) {
  ojson body = ojson::parse(R"({"model": "m", "input": [{"role": "user", "content": [
      {"type": "input_text", "text": "describe"},
      {"type": "input_image", "image_url": "data:image/jpeg;base64,/9j/", "detail": "auto"}]}]})");
  ResponsesRequest r = parse_responses_request(body, limits(), nullptr);
  const ojson& m = r.chat.template_input["messages"];
  ASSERT_TRUE(m.back()["content"].is_array());
  EXPECT_EQ(m.back()["content"][1]["type"], "image");
  ASSERT_EQ(r.chat.images.size(), 1u);
  EXPECT_EQ(r.chat.images[0].url, "data:image/jpeg;base64,/9j/");
  ojson by_file = ojson::parse(R"({"model": "m", "input": [{"role": "user", "content": [
      {"type": "input_image", "file_id": "file-1"}]}]})");
  try {
    parse_responses_request(by_file, limits(), nullptr);
    ADD_FAILURE() << "an input_image by file_id was accepted";
  } catch (const ApiError& e) {
    EXPECT_NE(std::string(e.what()).find("file_id"), std::string::npos) << e.what();
  }
}

TEST(ResponsesApi, ValidationNamesTheField) {
  auto param_of = [](const std::string& text) {
    try {
      parse_responses_request(ojson::parse(text), limits(), nullptr);
    } catch (const ApiError& e) {
      return e.param;
    }
    return std::string("(none)");
  };
  EXPECT_EQ(param_of(R"({})"), "input");
  EXPECT_EQ(param_of(R"({"input": "x"})"), "(none)");
  EXPECT_EQ(param_of(R"({"input": [{"type": "item_reference", "id": "x"}]})"), "input[0].type");
  EXPECT_EQ(param_of(R"({"input": [{"role": "user", "content": [{"type": "input_image"}]}]})"), "input[0].content[0].image_url");
  EXPECT_EQ(param_of(R"({"input": "x", "tools": [{"type": "web_search"}]})"), "tools[0].type");
  EXPECT_EQ(param_of(R"({"input": "x", "max_output_tokens": 0})"), "max_output_tokens");
  EXPECT_EQ(param_of(R"({"input": "x", "background": true})"), "background");
  EXPECT_EQ(param_of(R"({"input": "x", "text": {"format": {"type": "xml"}}})"), "text.format");
}

TEST(ResponsesApi, ReasoningAndMessageItemsWithUsage) {
  TestServer& s = shared_server();
  const std::string said = "Let me see.</think>\n\nIt is blue.";
  Reply r = post(s, "/v1/responses", responses_body(said, {{"instructions", "Answer."}}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["object"], "response");
  EXPECT_EQ(r.j["id"].get<std::string>().rfind("resp_", 0), 0u);
  EXPECT_EQ(r.j["status"], "completed");
  EXPECT_EQ(r.j["instructions"], "Answer.");
  const json& out = r.j["output"];
  ASSERT_EQ(out.size(), 2u) << r.body;
  EXPECT_EQ(out[0]["type"], "reasoning");
  EXPECT_EQ(out[0]["content"][0]["text"], "Let me see.");
  EXPECT_EQ(out[1]["type"], "message");
  EXPECT_EQ(out[1]["role"], "assistant");
  EXPECT_EQ(out[1]["content"][0]["type"], "output_text");
  EXPECT_EQ(out[1]["content"][0]["text"], "It is blue.");
  const json& u = r.j["usage"];
  EXPECT_EQ(u["output_tokens"], said.size() + 1);
  EXPECT_EQ(u["output_tokens_details"]["reasoning_tokens"], said.find("</think>") + 8);
  EXPECT_EQ(u["total_tokens"], u["input_tokens"].get<int64_t>() + u["output_tokens"].get<int64_t>());
  EXPECT_LE(u["input_tokens_details"]["cached_tokens"].get<int64_t>(), u["input_tokens"].get<int64_t>());
  Reply m = post(s, "/v1/responses", responses_body("word", {{"max_output_tokens", 2}}));
  EXPECT_EQ(m.j["status"], "incomplete");
  EXPECT_EQ(m.j["incomplete_details"]["reason"], "max_output_tokens");
  // A message cut by max_output_tokens is an incomplete item, not a completed one (as the completed response's
  // message above is).
  Reply cut = post(s, "/v1/responses", responses_body("</think>\n\nSunny and warm all day.", {{"max_output_tokens", 14}}));
  EXPECT_EQ(cut.j["status"], "incomplete");
  const json& items = cut.j["output"];
  ASSERT_FALSE(items.empty()) << cut.body;
  EXPECT_EQ(items.back()["type"], "message") << cut.body;
  EXPECT_EQ(items.back()["status"], "incomplete") << cut.body;
  EXPECT_EQ(out[1]["status"], "completed");
}

// Streamed, the same: the cut message's output_item.done says incomplete, and so does the final response's item.
TEST(ResponsesApi, StreamedIncompleteMessageIsAnIncompleteItem) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/responses",
                 responses_body("</think>\n\nSunny and warm all day.", {{"stream", true}, {"max_output_tokens", 14}}));
  ASSERT_EQ(r.status, 200) << r.body;
  auto events = named_sse_events(r.body);
  ASSERT_FALSE(events.empty());
  json message_done;
  for (const auto& [name, data] : events)
    if (name == "response.output_item.done" && data["item"]["type"] == "message") message_done = data["item"];
  ASSERT_FALSE(message_done.is_null()) << r.body;
  EXPECT_EQ(message_done["status"], "incomplete") << r.body;
  EXPECT_EQ(events.back().first, "response.incomplete");
  const json& done = events.back().second["response"];
  ASSERT_FALSE(done["output"].empty()) << r.body;
  EXPECT_EQ(done["output"].back()["type"], "message");
  EXPECT_EQ(done["output"].back()["status"], "incomplete");
}

TEST(ResponsesApi, FunctionCallRoundTripByPreviousResponseId) {
  TestServer& s = shared_server();
  Reply first = post(s, "/v1/responses", responses_body(kToolXml, {{"tools", {weather_tool()}}}));
  ASSERT_EQ(first.status, 200) << first.body;
  const json& out = first.j["output"];
  ASSERT_EQ(out.size(), 2u) << first.body;
  EXPECT_EQ(out[1]["type"], "function_call");
  EXPECT_EQ(out[1]["name"], "get_weather");
  EXPECT_EQ(json::parse(out[1]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  const std::string call_id = out[1]["call_id"];
  EXPECT_EQ(call_id.rfind("call_", 0), 0u);
  // The tool's output goes back by call_id on top of the stored conversation; the echo model repeats the last
  // turn, which the template renders as the tool response.
  Reply second = post(s, "/v1/responses",
                       responses_body(json::array({{{"type", "function_call_output"}, {"call_id", call_id}, {"output", "22 C"}}}),
                                      {{"previous_response_id", first.j["id"]}, {"tools", {weather_tool()}}}));
  ASSERT_EQ(second.status, 200) << second.body;
  EXPECT_EQ(second.j["previous_response_id"], first.j["id"]);
  std::string text;
  for (const auto& item : second.j["output"])
    if (item["type"] == "message") text += item["content"][0]["text"].get<std::string>();
  for (const auto& item : second.j["output"])
    if (item["type"] == "reasoning") text += item["content"][0]["text"].get<std::string>();
  EXPECT_NE(text.find("22 C"), std::string::npos) << second.body;
  // The stored prompt grew by the first answer: more input tokens than the first request.
  EXPECT_GT(second.j["usage"]["input_tokens"].get<int64_t>(), first.j["usage"]["input_tokens"].get<int64_t>());
  Reply unknown = post(s, "/v1/responses", responses_body("x", {{"previous_response_id", "resp_nope"}}));
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(unknown.j["error"]["code"], "previous_response_not_found");
  EXPECT_EQ(unknown.j["error"]["param"], "previous_response_id");
  Reply unstored = post(s, "/v1/responses", responses_body("x", {{"store", false}}));
  EXPECT_EQ(unstored.j["store"], false);
  Reply after = post(s, "/v1/responses", responses_body("y", {{"previous_response_id", unstored.j["id"]}}));
  EXPECT_EQ(after.status, 404);
}

TEST(ResponsesApi, StreamedEventSequence) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/responses", responses_body("Hmm.</think>\n\nSunny.", {{"stream", true}}));
  ASSERT_EQ(r.status, 200) << r.body;
  auto events = named_sse_events(r.body);
  std::vector<std::string> names;
  int64_t seq = 0;
  for (const auto& [name, data] : events) {
    EXPECT_EQ(data["type"], name);
    EXPECT_EQ(data["sequence_number"], seq++);
    if (names.empty() || name != names.back() || name.find(".delta") == std::string::npos) names.push_back(name);
  }
  const std::vector<std::string> expected = {
      "response.created", "response.in_progress",
      "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
      "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
      "response.output_item.added", "response.content_part.added", "response.output_text.delta",
      "response.output_text.done", "response.content_part.done", "response.output_item.done",
      "response.completed"};
  EXPECT_EQ(names, expected) << r.body;
  const json& done = events.back().second["response"];
  EXPECT_EQ(done["status"], "completed");
  ASSERT_EQ(done["output"].size(), 2u);
  EXPECT_EQ(done["output"][0]["content"][0]["text"], "Hmm.");
  EXPECT_EQ(done["output"][1]["content"][0]["text"], "Sunny.");
  // Item ids agree between the added events and the final response.
  EXPECT_EQ(events[2].second["item"]["id"], done["output"][0]["id"]);
  EXPECT_EQ(done["usage"]["output_tokens"], std::string("Hmm.</think>\n\nSunny.").size() + 1);
  // The streamed response is stored too.
  Reply next = post(s, "/v1/responses", responses_body("again", {{"previous_response_id", done["id"]}}));
  EXPECT_EQ(next.status, 200) << next.body;
}

}  // namespace
}  // namespace kiln::server
