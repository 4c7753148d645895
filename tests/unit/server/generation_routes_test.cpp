// /v1/chat/completions and /v1/completions (src/server/generation_routes.cpp) on an in-process server over the
// echo runner: the OpenAI wire format, reasoning and tool-call parsing, stop strings, logprobs, validation.
#include <gtest/gtest.h>

#include "http_test_server.h"

namespace kiln::server {
namespace {

using namespace test;

TEST(GenerationRoutes, ChatThinkingSplitsReasoning) {
  TestServer& s = shared_server();
  std::string said = "First, 2+2.\nIt is 4.\n</think>\n\nThe answer is 4.";
  Reply r = post(s, "/v1/chat/completions", chat_body(said));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& msg = r.j["choices"][0]["message"];
  EXPECT_EQ(msg["role"], "assistant");
  EXPECT_EQ(msg["reasoning_content"], "First, 2+2.\nIt is 4.");
  EXPECT_EQ(msg["content"], "The answer is 4.");
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r.j["object"], "chat.completion");
  EXPECT_EQ(r.j["model"], "test-model");
  // Byte tokens: every byte of the echoed text is a token, plus the <|im_end|> that stops it.
  EXPECT_EQ(r.j["usage"]["completion_tokens"], static_cast<int>(said.size()) + 1);
  // Reasoning tokens: the bytes up to and including the closing tag.
  EXPECT_EQ(r.j["usage"]["completion_tokens_details"]["reasoning_tokens"],
            static_cast<int>(said.find("</think>") + 8));
  int prompt = r.j["usage"]["prompt_tokens"];
  EXPECT_EQ(r.j["usage"]["total_tokens"], prompt + static_cast<int>(said.size()) + 1);
  // Streamed: the same text.
  StreamedChat st = stream_chat(s, chat_body(said));
  EXPECT_EQ(st.role, "assistant");
  EXPECT_EQ(st.reasoning, "First, 2+2.\nIt is 4.");
  EXPECT_EQ(st.content, "The answer is 4.");
  EXPECT_EQ(st.finish_reason, "stop");
  EXPECT_TRUE(st.done);
  EXPECT_TRUE(st.usage.is_null());
}

TEST(GenerationRoutes, ChatStopsBeforeThinkCloseIsAllReasoning) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body("still thinking about it", {{"max_tokens", 10}}));
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.j["choices"][0]["message"]["reasoning_content"], "still thin");
  EXPECT_TRUE(r.j["choices"][0]["message"]["content"].is_null());
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "length");
}

TEST(GenerationRoutes, ChatThinkingOffIsAllContent) {
  TestServer& s = shared_server();
  json kw = {{"chat_template_kwargs", {{"enable_thinking", false}}}};
  Reply r = post(s, "/v1/chat/completions", chat_body("Plain answer.", kw));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "Plain answer.");
  EXPECT_TRUE(r.j["choices"][0]["message"]["reasoning_content"].is_null());
  EXPECT_EQ(r.j["usage"]["completion_tokens_details"]["reasoning_tokens"], 0);
  StreamedChat st = stream_chat(s, chat_body("Plain answer.", kw));
  EXPECT_EQ(st.content, "Plain answer.");
  EXPECT_EQ(st.reasoning, "");
}

TEST(GenerationRoutes, SeparateReasoningFalseGivesRawText) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body("hmm\n</think>\n\nyes", {{"separate_reasoning", false}}));
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "hmm\n</think>\n\nyes");
  EXPECT_TRUE(r.j["choices"][0]["message"]["reasoning_content"].is_null());
}

TEST(GenerationRoutes, StreamUsageChunk) {
  TestServer& s = shared_server();
  StreamedChat st =
      stream_chat(s, chat_body("x</think>ok", {{"stream_options", {{"include_usage", true}}}}));
  ASSERT_TRUE(st.usage.is_object());
  EXPECT_EQ(st.usage["completion_tokens"], 12);
  EXPECT_EQ(st.usage["total_tokens"], st.usage["prompt_tokens"].get<int>() + 12);
  EXPECT_EQ(st.usage["completion_tokens_details"]["reasoning_tokens"], 9);
  EXPECT_TRUE(st.done);
}

json weather_tools() {
  return json::parse(R"([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
    "metric": {"type": "boolean"}}, "required": ["city"]}}}])");
}

const char* kToolCallText =
    "Need weather.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n"
    "</tool_call>";

TEST(GenerationRoutes, ToolCallsNonStreamed) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body(kToolCallText, {{"tools", weather_tools()}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& c = r.j["choices"][0];
  EXPECT_EQ(c["finish_reason"], "tool_calls");
  EXPECT_EQ(c["message"]["reasoning_content"], "Need weather.");
  EXPECT_EQ(c["message"]["content"], "Checking.");
  ASSERT_EQ(c["message"]["tool_calls"].size(), 1u);
  const json& call = c["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(call["function"]["name"], "get_weather");
  json args = json::parse(call["function"]["arguments"].get<std::string>());
  EXPECT_EQ(args, json::parse(R"({"city": "Paris", "days": 3, "metric": true})"));
}

TEST(GenerationRoutes, ToolCallsStreamed) {
  TestServer& s = shared_server();
  StreamedChat st = stream_chat(s, chat_body(kToolCallText, {{"tools", weather_tools()}}));
  EXPECT_EQ(st.finish_reason, "tool_calls");
  EXPECT_EQ(st.content, "Checking.");
  ASSERT_EQ(st.tool_calls.size(), 1u);
  EXPECT_EQ(st.tool_calls[0]["name"], "get_weather");
  EXPECT_EQ(st.tool_calls[0]["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(json::parse(st.tool_calls[0]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris", "days": 3, "metric": true})"));
}

TEST(GenerationRoutes, WithoutToolsTheXmlIsContent) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body(kToolCallText));
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(r.j["choices"][0]["message"]["tool_calls"].is_null());
  EXPECT_NE(r.j["choices"][0]["message"]["content"].get<std::string>().find("<tool_call>"), std::string::npos);
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
}

TEST(GenerationRoutes, StopStringsNeverLeak) {
  TestServer& s = shared_server();
  json body = chat_body("r</think>alpha beta END gamma", {{"stop", {"END", "zzz"}}});
  Reply r = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "alpha beta ");
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r.j["choices"][0]["matched_stop"], "END");
  body["stream"] = true;
  Reply sr = post(s, "/v1/chat/completions", body);
  bool done;
  std::string content;
  for (const auto& ev : sse_events(sr.body, &done))
    for (const auto& ch : ev["choices"])
      if (ch["delta"].contains("content")) {
        std::string piece = ch["delta"]["content"];
        EXPECT_EQ(piece.find('E'), std::string::npos) << "partial stop string streamed: " << piece;
        content += piece;
      }
  EXPECT_EQ(content, "alpha beta ");
  EXPECT_TRUE(done);
}

TEST(GenerationRoutes, CompletionsPlainEchoLogprobsAndN) {
  TestServer& s = shared_server();
  // Raw prompt: the echo model repeats what follows the last "<|im_start|>...\n" line.
  std::string prompt = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n";
  Reply r = post(s, "/v1/completions", json{{"model", "test-model"}, {"prompt", prompt}, {"max_tokens", 20}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["object"], "text_completion");
  EXPECT_EQ(r.j["choices"][0]["text"], "hello");
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r.j["usage"]["prompt_tokens"], 24);
  EXPECT_FALSE(r.j["usage"].contains("completion_tokens_details"));
  // Token ids as the prompt; echo; logprobs; n = 2.
  Reply t = post(s, "/tokenize", json{{"prompt", prompt}});
  Reply r2 = post(s, "/v1/completions",
                  json{{"prompt", t.j["tokens"]}, {"max_tokens", 3}, {"logprobs", 2}, {"n", 2}, {"temperature", 0.5}});
  ASSERT_EQ(r2.status, 200) << r2.body;
  ASSERT_EQ(r2.j["choices"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const json& c = r2.j["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["text"], "hel");
    EXPECT_EQ(c["finish_reason"], "length");
    EXPECT_EQ(c["logprobs"]["tokens"], json({"h", "e", "l"}));
    EXPECT_EQ(c["logprobs"]["text_offset"], json({0, 1, 2}));
    ASSERT_EQ(c["logprobs"]["top_logprobs"].size(), 3u);
    EXPECT_EQ(c["logprobs"]["top_logprobs"][0].size(), 2u);
  }
  EXPECT_EQ(r2.j["usage"]["completion_tokens"], 6);
  Reply e = post(s, "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 2}, {"echo", true}});
  EXPECT_EQ(e.j["choices"][0]["text"], prompt + "he");
  // Streamed completions.
  Reply st = post(s, "/v1/completions", json{{"prompt", prompt}, {"max_tokens", 50}, {"stream", true}});
  bool done;
  std::string text;
  std::string finish;
  for (const auto& ev : sse_events(st.body, &done))
    for (const auto& ch : ev["choices"]) {
      text += ch["text"].get<std::string>();
      if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
    }
  EXPECT_EQ(text, "hello");
  EXPECT_EQ(finish, "stop");
  EXPECT_TRUE(done);
}

TEST(GenerationRoutes, ChatLogprobs) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body("ab", {{"logprobs", true}, {"top_logprobs", 3}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& lp = r.j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 3u);  // a, b, <|im_end|>
  EXPECT_EQ(lp[0]["token"], "a");
  EXPECT_EQ(lp[0]["bytes"], json({97}));
  EXPECT_EQ(lp[0]["top_logprobs"].size(), 3u);
  EXPECT_EQ(lp[0]["top_logprobs"][0]["token"], "a");
  EXPECT_LE(lp[0]["logprob"].get<double>(), 0.0);
}

TEST(GenerationRoutes, ValidationErrorsNameTheParameter) {
  TestServer& s = shared_server();
  struct Case {
    std::string body;
    int status;
    std::string param;  // "" = null
  };
  json ok = chat_body("hi");
  auto with = [&](const char* key, json v) {
    json b = ok;
    b[key] = v;
    return b.dump();
  };
  std::vector<Case> cases = {
      {"{not json", 400, ""},
      {"[1,2]", 400, ""},
      {"", 400, ""},
      {R"({"model": "test-model"})", 400, "messages"},
      {R"({"messages": []})", 400, "messages"},
      {R"({"messages": "hi"})", 400, "messages"},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", 400, "messages[0].role"},
      {R"({"messages": [{"content": "x"}]})", 400, "messages[0].role"},
      {R"({"messages": [{"role": "user"}]})", 400, "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": 5}]})", 400, "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", 400, "messages[0].content[0]"},
      {with("temperature", 3), 400, "temperature"},
      {with("temperature", "hot"), 400, "temperature"},
      {with("top_p", 0), 400, "top_p"},
      {with("top_p", 1.5), 400, "top_p"},
      {with("top_k", -5), 400, "top_k"},
      {with("min_p", 2), 400, "min_p"},
      {with("presence_penalty", 3), 400, "presence_penalty"},
      {with("frequency_penalty", -2.5), 400, "frequency_penalty"},
      {with("repetition_penalty", 0), 400, "repetition_penalty"},
      {with("max_tokens", 0), 400, "max_tokens"},
      {with("max_tokens", 1.5), 400, "max_tokens"},
      {with("max_completion_tokens", -1), 400, "max_completion_tokens"},
      {with("n", 0), 400, "n"},
      {with("n", 1000), 400, "n"},
      {with("seed", "x"), 400, "seed"},
      {with("stop", 5), 400, "stop"},
      {with("stop", json::array({"a", 1})), 400, "stop"},
      {with("stop", json::array({""})), 400, "stop"},
      {with("stream", "yes"), 400, "stream"},
      {with("top_logprobs", 5), 400, "top_logprobs"},
      {with("logprobs", 1), 400, "logprobs"},
      {with("tools", "x"), 400, "tools"},
      {with("tools", json::parse(R"([{"type": "function", "function": {}}])")), 400, "tools[0].function.name"},
      {with("tool_choice", "sometimes"), 400, "tool_choice"},
      {with("stop_token_ids", json::array({99999})), 400, "stop_token_ids"},
      {with("chat_template_kwargs", json::parse(R"({"enable_thinking": "no"})")), 400, "chat_template_kwargs"},
      {with("response_format", json::parse(R"({"type": "json_schema"})")), 400, "response_format"},
      {with("stream_options", json::parse(R"({"include_usage": true})")), 400, "stream_options"},
  };
  for (const auto& c : cases) {
    Reply r = post(s, "/v1/chat/completions", c.body);
    EXPECT_EQ(r.status, c.status) << c.body << " -> " << r.body;
    ASSERT_TRUE(r.j.is_object()) << c.body << " -> " << r.body;
    ASSERT_TRUE(r.j.contains("error")) << r.body;
    const json& e = r.j["error"];
    EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty());
    EXPECT_EQ(e["type"], "invalid_request_error");
    if (c.param.empty())
      EXPECT_TRUE(e["param"].is_null()) << c.body << " -> " << r.body;
    else
      EXPECT_EQ(e["param"], c.param) << c.body << " -> " << r.body;
    EXPECT_TRUE(e.contains("code"));
  }
  // Completions.
  EXPECT_EQ(post(s, "/v1/completions", std::string(R"({"max_tokens": 3})")).j["error"]["param"], "prompt");
  EXPECT_EQ(post(s, "/v1/completions", std::string(R"({"prompt": ""})")).status, 400);
  EXPECT_EQ(post(s, "/v1/completions", std::string(R"({"prompt": [1, 99999]})")).j["error"]["param"], "prompt");
  EXPECT_EQ(post(s, "/v1/completions", std::string(R"({"prompt": "x", "logprobs": 50})")).j["error"]["param"], "logprobs");
  // Still fine afterwards.
  EXPECT_EQ(post(s, "/v1/chat/completions", ok).status, 200);
}

TEST(GenerationRoutes, UnknownModelIs404) {
  TestServer& s = shared_server();
  json b = chat_body("hi");
  b["model"] = "gpt-17";
  Reply r = post(s, "/v1/chat/completions", b);
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.j["error"]["code"], "model_not_found");
  EXPECT_EQ(r.j["error"]["param"], "model");
  b["model"] = "/models/test";  // the model path is accepted as a name too
  EXPECT_EQ(post(s, "/v1/chat/completions", b).status, 200);
  EXPECT_EQ(get(s, "/v1/models/gpt-17").status, 404);
  EXPECT_EQ(get(s, "/v1/models/test-model").status, 200);
}

int64_t finished_metric(TestServer& s, const std::string& reason) {
  Reply r = get(s, "/metrics");
  std::istringstream in(r.body);
  std::string line;
  const std::string label = "finish_reason=\"" + reason + "\"}";
  while (std::getline(in, line))
    if (line.rfind("kiln:requests_finished_total{", 0) == 0 && line.find(label) != std::string::npos)
      return std::stoll(line.substr(line.rfind(' ') + 1));
  return 0;
}

TEST(GenerationRoutes, UnimplementedFieldsAreRejectedNullIsAbsent) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body("hi", {{"prediction", {{"type", "content"}, {"content", "x"}}}}));
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.j["error"]["param"], "prediction");
  EXPECT_EQ(r.j["error"]["code"], "unsupported_parameter");
  Reply c = post(s, "/v1/completions", json{{"prompt", "x"}, {"functions", json::array({1})}});
  EXPECT_EQ(c.status, 400);
  EXPECT_EQ(c.j["error"]["param"], "functions");
  // Chat-only fields are unknown to completions.
  EXPECT_EQ(post(s, "/v1/completions", json{{"prompt", "x"}, {"tools", json::array()}}).status, 400);
  // null means "not given"; user is accepted (nothing to act on).
  EXPECT_EQ(post(s, "/v1/chat/completions", chat_body("hi", {{"prediction", nullptr}, {"user", "u1"}})).status, 200);
}

TEST(GenerationRoutes, LogitBiasChangesTheTokens) {
  ServerConfig cfg;
  cfg.echo = false;  // hash logits in [0, 10): a bias of 100 decides every token
  TestServer s(cfg);
  json body = {{"prompt", "Once"}, {"max_tokens", 5}, {"temperature", 0}};
  Reply plain = post(s, "/v1/completions", body);
  ASSERT_EQ(plain.status, 200) << plain.body;
  body["logit_bias"] = {{"90", 100}};  // 'Z'
  Reply z = post(s, "/v1/completions", body);
  ASSERT_EQ(z.status, 200) << z.body;
  EXPECT_EQ(z.j["choices"][0]["text"], "ZZZZZ");
  for (json bad : {json{{"abc", 1}}, json{{"999999", 1}}, json{{"5", 101}}, json(json::array({1}))}) {
    body["logit_bias"] = bad;
    Reply r = post(s, "/v1/completions", body);
    EXPECT_EQ(r.status, 400) << bad.dump();
    EXPECT_EQ(r.j["error"]["param"], "logit_bias");
  }
}

const char* kTwoCallsText =
    "r</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
    "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n"
    "</tool_call>";

TEST(GenerationRoutes, ParallelToolCallsFalseKeepsTheFirstCall) {
  TestServer& s = shared_server();
  Reply both = post(s, "/v1/chat/completions", chat_body(kTwoCallsText, {{"tools", weather_tools()}}));
  ASSERT_EQ(both.status, 200) << both.body;
  EXPECT_EQ(both.j["choices"][0]["message"]["tool_calls"].size(), 2u);
  json body = chat_body(kTwoCallsText, {{"tools", weather_tools()}, {"parallel_tool_calls", false}});
  Reply one = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(one.j["choices"][0]["message"]["tool_calls"].size(), 1u) << one.body;
  EXPECT_EQ(json::parse(one.j["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(one.j["choices"][0]["finish_reason"], "tool_calls");
  StreamedChat st = stream_chat(s, body);
  EXPECT_EQ(st.tool_calls.size(), 1u);
}

TEST(GenerationRoutes, CallsOfUnknownFunctionsAreDropped) {
  TestServer& s = shared_server();
  const char* text =
      "r</think>\n\nOk.\n<tool_call>\n<function=delete_everything>\n<parameter=really>\nyes\n</parameter>\n"
      "</function>\n</tool_call>";
  Reply r = post(s, "/v1/chat/completions", chat_body(text, {{"tools", weather_tools()}}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.j["choices"][0]["message"]["tool_calls"].is_null()) << r.body;
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "Ok.");
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "stop");
}

TEST(GenerationRoutes, ToolCallCutByMaxTokensLeaksNoTagFragment) {
  TestServer& s = shared_server();
  // The byte tokenizer: one token per byte, so max_tokens cuts the text at a byte: right inside "</parameter>".
  const std::string answer = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</";
  const std::string text = "r</think>\n\n" + answer + "parameter>\n</function>\n</tool_call>";
  Reply r = post(s, "/v1/chat/completions",
                 chat_body(text, {{"tools", weather_tools()}, {"max_tokens", 11 + static_cast<int>(answer.size())}}));
  ASSERT_EQ(r.status, 200) << r.body;
  const json& c = r.j["choices"][0];
  EXPECT_EQ(c["finish_reason"], "length");
  ASSERT_EQ(c["message"]["tool_calls"].size(), 1u) << r.body;
  EXPECT_EQ(json::parse(c["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris"})"));
}

TEST(GenerationRoutes, StreamReasoningFalseSendsReasoningInOnePiece) {
  TestServer& s = shared_server();
  json body = chat_body("think think think</think>\n\nanswer", {{"stream", true}, {"stream_reasoning", false}});
  Reply r = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200);
  bool done;
  int reasoning_chunks = 0;
  std::string reasoning, content;
  bool content_before_reasoning = false;
  for (const auto& ev : sse_events(r.body, &done))
    for (const auto& ch : ev["choices"]) {
      if (ch["delta"].contains("reasoning_content")) {
        ++reasoning_chunks;
        reasoning += ch["delta"]["reasoning_content"].get<std::string>();
      }
      if (ch["delta"].contains("content") && !ch["delta"]["content"].get<std::string>().empty()) {
        if (reasoning_chunks == 0) content_before_reasoning = true;
        content += ch["delta"]["content"].get<std::string>();
      }
    }
  EXPECT_EQ(reasoning_chunks, 1);
  EXPECT_EQ(reasoning, "think think think");
  EXPECT_EQ(content, "answer");
  EXPECT_FALSE(content_before_reasoning);
  // Streamed as usual: the same reasoning.
  body["stream_reasoning"] = true;
  StreamedChat st = stream_chat(s, body);
  EXPECT_EQ(st.reasoning, "think think think");
  EXPECT_EQ(st.content, "answer");
}

TEST(GenerationRoutes, StopStringFinishesCountAsStopInMetrics) {
  TestServer s;
  for (int i = 0; i < 3; ++i) {
    Reply r = post(s, "/v1/chat/completions", chat_body("r</think>alpha END beta gamma delta", {{"stop", "END"}}));
    ASSERT_EQ(r.j["choices"][0]["finish_reason"], "stop");
  }
  // The engine learns of the stop at its next step: wait for it.
  for (int i = 0; i < 100 && finished_metric(s, "stop") < 3; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(finished_metric(s, "stop"), 3);
  EXPECT_EQ(finished_metric(s, "abort"), 0);
}

TEST(GenerationRoutes, InvalidUtf8AndJsonSayWhere) {
  TestServer& s = shared_server();
  Reply u = post(s, "/v1/chat/completions", std::string("{\"model\": \"x\xff\"}"));
  EXPECT_EQ(u.status, 400);
  std::string m = u.j["error"]["message"];
  EXPECT_NE(m.find("not valid UTF-8"), std::string::npos) << m;
  EXPECT_NE(m.find("0xFF at offset 12"), std::string::npos) << m;
  Reply j = post(s, "/v1/chat/completions", std::string("{\"model\": }"));
  std::string jm = j.j["error"]["message"];
  EXPECT_NE(jm.find("not valid JSON"), std::string::npos) << jm;
  EXPECT_NE(jm.find("column 11"), std::string::npos) << jm;
}

TEST(GenerationRoutes, CompletionsTakeAListOfPrompts) {
  ServerConfig cfg;
  cfg.echo = false;
  TestServer s(cfg);
  json one_a = {{"prompt", "alpha"}, {"max_tokens", 6}, {"temperature", 0}};
  json one_b = {{"prompt", "beta"}, {"max_tokens", 6}, {"temperature", 0}};
  std::string a = post(s, "/v1/completions", one_a).j["choices"][0]["text"];
  std::string b = post(s, "/v1/completions", one_b).j["choices"][0]["text"];
  Reply r = post(s, "/v1/completions", json{{"prompt", {"alpha", "beta"}}, {"n", 2}, {"max_tokens", 6},
                                            {"temperature", 0}, {"echo", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(r.j["choices"].size(), 4u);
  // OpenAI's order: n choices per prompt, prompts in order.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r.j["choices"][i]["index"], i);
  EXPECT_EQ(r.j["choices"][0]["text"], "alpha" + a);
  EXPECT_EQ(r.j["choices"][1]["text"], "alpha" + a);
  EXPECT_EQ(r.j["choices"][2]["text"], "beta" + b);
  EXPECT_EQ(r.j["choices"][3]["text"], "beta" + b);
  EXPECT_EQ(r.j["usage"]["prompt_tokens"], 9);  // 5 + 4 bytes, each prompt once
  // Token-id prompts in a list, and what is not allowed.
  Reply ids = post(s, "/v1/completions", json{{"prompt", {{97, 108}, {98}}}, {"max_tokens", 2}});
  EXPECT_EQ(ids.status, 200) << ids.body;
  EXPECT_EQ(ids.j["choices"].size(), 2u);
  EXPECT_EQ(post(s, "/v1/completions", json{{"prompt", {"a", 5}}}).status, 400);
  EXPECT_EQ(post(s, "/v1/completions", json{{"prompt", {"a", ""}}}).status, 400);
  Reply many = post(s, "/v1/completions", json{{"prompt", std::vector<std::string>(33, "x")}, {"n", 2}});
  EXPECT_EQ(many.status, 400);
  EXPECT_NE(many.j["error"]["message"].get<std::string>().find("66 choices"), std::string::npos);
}


// What the official SDKs and agent clients send besides the sampling fields (issue 29): accepted, no effect but
// reasoning_effort none / minimal, which turns thinking off (the echo model's text is then all content).
TEST(GenerationRoutes, HarmlessClientFieldsAreAccepted) {
  TestServer& s = shared_server();
  json extra = {{"store", false},           {"metadata", {{"k", "v"}}},     {"service_tier", "auto"},
                {"prompt_cache_key", "p1"}, {"safety_identifier", "hash1"}, {"verbosity", "low"},
                {"reasoning_effort", "minimal"}};
  Reply r = post(s, "/v1/chat/completions", chat_body("Plain answer.", extra));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "Plain answer.");
  EXPECT_TRUE(r.j["choices"][0]["message"]["reasoning_content"].is_null());
  // reasoning_effort high keeps the template's default (thinking on: no </think>, all reasoning).
  Reply high = post(s, "/v1/chat/completions", chat_body("Plain answer.", {{"reasoning_effort", "high"}}));
  EXPECT_EQ(high.j["choices"][0]["message"]["reasoning_content"], "Plain answer.");
  Reply c = post(s, "/v1/completions",
                 json{{"prompt", "x"}, {"max_tokens", 2}, {"store", true}, {"metadata", json::object()},
                      {"service_tier", "default"}, {"prompt_cache_key", "p"}, {"safety_identifier", "s"}});
  EXPECT_EQ(c.status, 200) << c.body;
}

// min_tokens: the echo model ends its turn after the echoed text; the end-of-turn token is masked until min_tokens
// tokens are out (the hash logits choose the tokens in between), then it ends the output as before.
TEST(GenerationRoutes, MinTokensHoldsTheEndOfTurnBack) {
  TestServer& s = shared_server();
  json off = {{"chat_template_kwargs", {{"enable_thinking", false}}}};
  Reply plain = post(s, "/v1/chat/completions", chat_body("hi", off));
  ASSERT_EQ(plain.status, 200) << plain.body;
  EXPECT_EQ(plain.j["usage"]["completion_tokens"], 3);  // "h", "i", <|im_end|>
  json with_min = off;
  with_min["min_tokens"] = 6;
  Reply held = post(s, "/v1/chat/completions", chat_body("hi", with_min));
  ASSERT_EQ(held.status, 200) << held.body;
  EXPECT_EQ(held.j["usage"]["completion_tokens"], 7);  // 6 tokens, then <|im_end|>
  EXPECT_EQ(held.j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(held.j["choices"][0]["message"]["content"].get<std::string>().rfind("hi", 0), 0u);
  // Streamed, the same count; completions take it too.
  with_min["stream"] = true;
  with_min["stream_options"] = {{"include_usage", true}};
  EXPECT_EQ(stream_chat(s, chat_body("hi", with_min)).usage["completion_tokens"], 7);
  std::string prompt = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n";
  Reply c = post(s, "/v1/completions", json{{"prompt", prompt}, {"min_tokens", 8}, {"max_tokens", 20}});
  EXPECT_EQ(c.j["usage"]["completion_tokens"], 9);  // 5 echoed, 3 more, then <|im_end|>
  EXPECT_EQ(post(s, "/v1/chat/completions", chat_body("hi", {{"min_tokens", 9}, {"max_tokens", 3}})).status, 400);
}

// continue_final_message: the prompt ends inside the assistant's turn. The Qwen3.5 template closes a final assistant
// message with "<|im_end|>\n" (two tokens in the byte tokenizer), which the continued prompt leaves out.
TEST(GenerationRoutes, ContinueFinalMessage) {
  TestServer& s = shared_server();
  json messages = {{{"role", "user"}, {"content", "Say it."}}, {{"role", "assistant"}, {"content", "The answer is"}}};
  json base = {{"messages", messages}, {"max_tokens", 1}, {"add_generation_prompt", false}};
  Reply closed = post(s, "/v1/chat/completions", base);
  ASSERT_EQ(closed.status, 200) << closed.body;
  json cont = base;
  cont["continue_final_message"] = true;
  Reply open = post(s, "/v1/chat/completions", cont);
  ASSERT_EQ(open.status, 200) << open.body;
  EXPECT_EQ(open.j["usage"]["prompt_tokens"].get<int>(), closed.j["usage"]["prompt_tokens"].get<int>() - 2);
  cont.erase("add_generation_prompt");  // absent: false with continue_final_message
  EXPECT_EQ(post(s, "/v1/chat/completions", cont).j["usage"]["prompt_tokens"], open.j["usage"]["prompt_tokens"]);
  cont["add_generation_prompt"] = true;
  Reply both = post(s, "/v1/chat/completions", cont);
  EXPECT_EQ(both.status, 400);
  EXPECT_EQ(both.j["error"]["param"], "continue_final_message");
}

TEST(GenerationRoutes, OverflowingNumberIs400) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions",
                 std::string(R"({"messages": [{"role": "user", "content": "x"}], "temperature": 1e999})"));
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(r.j["error"]["code"], "invalid_json");
  Reply a = post(s, "/v1/messages",
                 std::string(R"({"model": "m", "max_tokens": 1e999, "messages": [{"role": "user", "content": "x"}]})"));
  EXPECT_EQ(a.status, 400) << a.body;
}

TEST(GenerationRoutes, NonJsonToolArgumentsNameTheMessage) {
  TestServer& s = shared_server();
  json messages = {{{"role", "user"}, {"content", "weather?"}},
                   {{"role", "assistant"},
                    {"content", nullptr},
                    {"tool_calls",
                     {{{"id", "c1"}, {"type", "function"},
                       {"function", {{"name", "get_weather"}, {"arguments", "city: Paris"}}}}}}},
                   {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "sunny"}}};
  Reply r = post(s, "/v1/chat/completions", json{{"messages", messages}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.j["error"]["param"], "messages[1].tool_calls[0].function.arguments");
  EXPECT_EQ(r.j["error"]["message"].get<std::string>().find("chat template"), std::string::npos) << r.body;
}

// The embedding has rows past the tokenizer's ids (vocab 600, tokenizer 512): those ids are padding (empty tokens),
// refused wherever a request names token ids.
TEST(GenerationRoutes, PaddingTokenIdsAreRefused) {
  ServerConfig cfg;
  cfg.vocab = 600;
  TestServer s(cfg);
  Reply bias = post(s, "/v1/chat/completions", chat_body("hi", {{"logit_bias", {{"550", 5}}}}));
  EXPECT_EQ(bias.status, 400);
  EXPECT_EQ(bias.j["error"]["param"], "logit_bias");
  EXPECT_NE(bias.j["error"]["message"].get<std::string>().find("[0, 512)"), std::string::npos) << bias.body;
  Reply prompt = post(s, "/v1/completions", json{{"prompt", {104, 105, 550}}, {"max_tokens", 1}});
  EXPECT_EQ(prompt.status, 400);
  EXPECT_EQ(prompt.j["error"]["param"], "prompt");
  EXPECT_EQ(post(s, "/v1/chat/completions", chat_body("hi", {{"stop_token_ids", {511, 599}}})).status, 400);
  EXPECT_EQ(post(s, "/v1/completions", json{{"prompt", {104, 105, 511}}, {"max_tokens", 1}}).status, 200);
}

}  // namespace
}  // namespace kiln::server
