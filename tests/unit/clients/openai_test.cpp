// Parsing what OpenAI-compatible servers answer, in SGLang's and vLLM's shapes.
#include <gtest/gtest.h>

#include "clients/http.h"
#include "clients/openai.h"
#include "core/error.h"

namespace kiln::clients {
namespace {

TEST(ParseResponse, SglangChatWithReasoningContent) {
  Generation g = parse_generation_response(R"({"id":"x","choices":[{"index":0,"message":{"role":"assistant",
      "content":"323","reasoning_content":"17*19 ...","tool_calls":null},"finish_reason":"stop"}],
      "usage":{"prompt_tokens":12,"completion_tokens":40,"total_tokens":52}})");
  ASSERT_TRUE(g.ok) << g.error;
  EXPECT_EQ(g.content, "323");
  EXPECT_EQ(g.reasoning, "17*19 ...");
  EXPECT_EQ(g.reasoning_field, "reasoning_content");
  EXPECT_EQ(g.finish_reason, "stop");
  EXPECT_EQ(g.prompt_tokens, 12);
  EXPECT_EQ(g.completion_tokens, 40);
}

TEST(ParseResponse, CachedTokensFromPromptTokensDetails) {
  Generation g = parse_generation_response(R"({"choices":[{"text":"a","finish_reason":"length"}],
      "usage":{"prompt_tokens":1058,"completion_tokens":32,"prompt_tokens_details":{"cached_tokens":496}}})");
  ASSERT_TRUE(g.ok) << g.error;
  EXPECT_EQ(g.cached_tokens, 496);
  Generation none = parse_generation_response(R"({"choices":[{"text":"a"}],"usage":{"prompt_tokens":3,
      "completion_tokens":1,"prompt_tokens_details":null}})");
  ASSERT_TRUE(none.ok) << none.error;
  EXPECT_FALSE(none.cached_tokens.has_value());
}

TEST(ParseResponse, VllmReasoningFieldAndNullContent) {
  Generation g = parse_generation_response(
      R"({"choices":[{"message":{"role":"assistant","content":null,"reasoning":"thinking..."},"finish_reason":"length"}]})");
  ASSERT_TRUE(g.ok);
  EXPECT_TRUE(g.content_null);
  EXPECT_EQ(g.content, "");
  EXPECT_EQ(g.reasoning, "thinking...");
  EXPECT_EQ(g.reasoning_field, "reasoning");
  EXPECT_FALSE(g.completion_tokens.has_value());
}

TEST(ParseResponse, CompletionsTextAndNulEscapes) {
  Generation g = parse_generation_response(R"({"choices":[{"text":"!!\u0000!!","finish_reason":"length"}]})");
  ASSERT_TRUE(g.ok);
  EXPECT_EQ(g.content, std::string("!!\0!!", 5));
}

TEST(ParseResponse, ErrorsSayWhat) {
  Generation bad_json = parse_generation_response("<html>oops</html>");
  EXPECT_FALSE(bad_json.ok);
  EXPECT_NE(bad_json.error.find("not a JSON object"), std::string::npos);
  Generation error = parse_generation_response(R"({"error":{"message":"model is loading","code":503}})");
  EXPECT_FALSE(error.ok);
  EXPECT_NE(error.error.find("model is loading"), std::string::npos);
  Generation no_choices = parse_generation_response(R"({"choices":[]})");
  EXPECT_FALSE(no_choices.ok);
}

TEST(StreamAccumulator, ReassemblesDeltasAndTimesTextChunks) {
  StreamAccumulator acc;
  EXPECT_TRUE(acc.add_event(R"({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})", 0.01));
  EXPECT_TRUE(acc.add_event(R"({"choices":[{"delta":{"reasoning_content":"17*19"},"finish_reason":null}]})", 0.10));
  EXPECT_TRUE(acc.add_event(R"({"choices":[{"delta":{"reasoning_content":" = 323"}}]})", 0.12));
  EXPECT_TRUE(acc.add_event(R"({"choices":[{"delta":{"content":"\n\n323"}}]})", 0.15));
  EXPECT_TRUE(acc.add_event(R"({"choices":[{"delta":{},"finish_reason":"stop"}]})", 0.16));
  EXPECT_TRUE(acc.add_event(R"({"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}})", 0.17));
  EXPECT_TRUE(acc.add_event("[DONE]", 0.17));
  Generation g = acc.finish(0.18);
  ASSERT_TRUE(g.ok) << g.error;
  EXPECT_EQ(g.reasoning, "17*19 = 323");
  EXPECT_EQ(g.content, "\n\n323");
  EXPECT_EQ(g.finish_reason, "stop");
  EXPECT_EQ(g.completion_tokens, 3);
  EXPECT_TRUE(g.saw_done);
  // The role chunk and the empty final delta carry no text: three timed chunks.
  EXPECT_EQ(g.token_times_s, (std::vector<double>{0.10, 0.12, 0.15}));
  EXPECT_DOUBLE_EQ(g.e2e_s, 0.18);
}

TEST(StreamAccumulator, VllmReasoningDeltas) {
  StreamAccumulator acc;
  acc.add_event(R"({"choices":[{"delta":{"reasoning":"hmm"}}]})", 0.1);
  acc.add_event(R"({"choices":[{"text":"ignored for chat","delta":{"content":"ok"},"finish_reason":"stop"}]})", 0.2);
  Generation g = acc.finish(0.3);
  ASSERT_TRUE(g.ok);  // a finish_reason without [DONE] is accepted
  EXPECT_EQ(g.reasoning_field, "reasoning");
  EXPECT_EQ(g.content, "ok");
}

TEST(StreamAccumulator, ErrorChunksBadJsonAndCutStreamsFail) {
  StreamAccumulator error;
  EXPECT_FALSE(error.add_event(R"({"error":{"message":"out of memory"}})", 0.1));
  Generation e = error.finish(0.1);
  EXPECT_FALSE(e.ok);
  EXPECT_NE(e.error.find("out of memory"), std::string::npos);

  StreamAccumulator bad;
  EXPECT_FALSE(bad.add_event("{not json", 0.1));
  EXPECT_FALSE(bad.finish(0.1).ok);

  StreamAccumulator cut;
  cut.add_event(R"({"choices":[{"delta":{"content":"par"}}]})", 0.1);
  Generation c = cut.finish(0.2);
  EXPECT_FALSE(c.ok);
  EXPECT_NE(c.error.find("without a finish_reason"), std::string::npos);
}

TEST(Requests, ChatAndCompletionBodies) {
  GenerationParams p;
  p.max_tokens = 512;
  p.enable_thinking = false;
  p.ignore_eos = true;
  p.stream = true;
  auto chat = chat_request("m", "hi", p);
  EXPECT_EQ(chat["messages"][0]["content"], "hi");
  EXPECT_EQ(chat["chat_template_kwargs"]["enable_thinking"], false);
  EXPECT_EQ(chat["ignore_eos"], true);
  EXPECT_EQ(chat["stream_options"]["include_usage"], true);
  EXPECT_EQ(chat["temperature"], 0.0);
  auto plain = completion_request("m", "prompt", GenerationParams{});
  EXPECT_EQ(plain["prompt"], "prompt");
  EXPECT_FALSE(plain.contains("ignore_eos"));
  EXPECT_FALSE(plain.contains("stream_options"));
  EXPECT_FALSE(plain.contains("chat_template_kwargs"));
}

TEST(ServerUrl, ParsesAndNormalises) {
  auto a = parse_server_url("http://127.0.0.1:30000", "", 10);
  EXPECT_EQ(a.base_url, "http://127.0.0.1:30000");
  EXPECT_EQ(a.path_prefix, "");
  auto b = parse_server_url("https://host:8000/v1/", "key", 10);
  EXPECT_EQ(b.base_url, "https://host:8000");
  EXPECT_EQ(b.path_prefix, "");
  EXPECT_EQ(b.api_key, "key");
  auto c = parse_server_url("http://proxy/llm/v1", "", 10);
  EXPECT_EQ(c.path_prefix, "/llm");
  EXPECT_THROW(parse_server_url("127.0.0.1:30000", "", 10), Error);
  EXPECT_THROW(parse_server_url("http://", "", 10), Error);
  EXPECT_THROW(parse_server_url("http://h:1", "", 0), Error);
}

TEST(HttpResponse, DescribesFailuresInOneLine) {
  HttpResponse openai{.status = 400, .body = R"({"error":{"message":"bad\nthing","type":"x"}})"};
  EXPECT_EQ(openai.describe_failure(), "HTTP 400: bad thing");
  HttpResponse fastapi{.status = 422, .body = R"({"detail":"field required"})"};
  EXPECT_EQ(fastapi.describe_failure(), "HTTP 422: field required");
  HttpResponse plain{.status = 502, .body = "Bad Gateway"};
  EXPECT_EQ(plain.describe_failure(), "HTTP 502: Bad Gateway");
  HttpResponse transport{.transport_error = "cannot connect"};
  EXPECT_EQ(transport.describe_failure(), "cannot connect");
}

TEST(Unreachable, OneClearLine) {
  // Port 1 on localhost: nothing listens there.
  HttpClient client(parse_server_url("http://127.0.0.1:1", "", 5));
  try {
    require_reachable(client);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("cannot reach the server at http://127.0.0.1:1"), std::string::npos) << what;
    EXPECT_NE(what.find("--url"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace kiln::clients
