// OpenAI response rendering (src/server/response.cpp) without a server: engine events fed into a GenerationJob
// over the byte-level test tokenizer (one token per byte), then the SSE chunks, the non-streamed body and usage.
#include "server/response.h"

#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <string>

#include "tokenizer/tokenizer.h"

namespace kiln::server {
namespace {

using json = nlohmann::json;

const tok::Tokenizer& byte_tokenizer() {
  static auto t = tok::Tokenizer::load_dir(std::string(KILN_SOURCE_DIR) + "/tests/fixtures/reference/byte_tokenizer");
  return *t;
}

constexpr int32_t kImEnd = 511;  // <|im_end|>, the byte tokenizer's end of turn

// A chat job with `n` choices that start inside a think block, like a Qwen3.5 prompt.
std::shared_ptr<GenerationJob> chat_job(int n, bool stream, bool include_usage = false) {
  auto job = std::make_shared<GenerationJob>();
  job->chat = true;
  job->id = "chatcmpl-test";
  job->created = 1700000000;
  job->model_name = "m";
  job->fields.stream = stream;
  job->fields.include_usage = include_usage;
  job->prompt_tokens = 12;
  job->tokenizer = &byte_tokenizer();
  ChoiceOptions co;
  co.parse_reasoning = true;
  co.start_in_reasoning = true;
  for (int i = 0; i < n; ++i) job->choices.emplace_back(byte_tokenizer(), co);
  job->acc.resize(static_cast<size_t>(n));
  job->channel = std::make_shared<engine::RequestChannel>(n);
  return job;
}

// Engine events writing `text` byte by byte on choice `index`, then the end-of-turn token.
std::vector<engine::TokenEvent> events_for(int index, const std::string& text, int64_t cached = 0) {
  std::vector<engine::TokenEvent> out;
  for (unsigned char c : text) {
    engine::TokenEvent ev;
    ev.index = index;
    ev.token = c;
    ev.cached_tokens = cached;
    out.push_back(ev);
  }
  engine::TokenEvent end;
  end.index = index;
  end.token = kImEnd;
  end.is_stop_token = true;
  end.finished = true;
  end.finish_reason = engine::FinishReason::stop;
  out.push_back(end);
  return out;
}

std::vector<json> data_events(const std::string& sse, bool* done) {
  std::vector<json> out;
  *done = false;
  std::istringstream in(sse);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("data: ", 0) != 0) continue;
    if (line == "data: [DONE]") *done = true;
    else out.push_back(json::parse(line.substr(6)));
  }
  return out;
}

TEST(Response, NonStreamedBodySplitsReasoningAndCountsUsage) {
  auto job = chat_job(1, false);
  job->accumulate_text(job->absorb(events_for(0, "hmm</think>\n\nYes.", /*cached=*/8)));
  ASSERT_TRUE(job->all_finished());
  json body = job->final_response();
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["id"], "chatcmpl-test");
  const json& c = body["choices"][0];
  EXPECT_EQ(c["message"]["reasoning_content"], "hmm");
  EXPECT_EQ(c["message"]["content"], "Yes.");
  EXPECT_TRUE(c["message"]["tool_calls"].is_null());
  EXPECT_EQ(c["finish_reason"], "stop");
  EXPECT_EQ(c["matched_stop"], kImEnd);
  const json& u = body["usage"];
  const int64_t generated = std::string("hmm</think>\n\nYes.").size() + 1;  // + the end-of-turn token
  EXPECT_EQ(u["completion_tokens"], generated);
  EXPECT_EQ(u["prompt_tokens"], 12);
  EXPECT_EQ(u["total_tokens"], 12 + generated);
  EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], 8);
  EXPECT_EQ(u["completion_tokens_details"]["reasoning_tokens"], std::string("hmm</think>").size());
}

TEST(Response, StreamedChunksRoleFirstFinishThenUsageThenDone) {
  auto job = chat_job(2, true, /*include_usage=*/true);
  std::string sse = job->stream_prologue();
  auto d0 = job->absorb(events_for(0, "a</think>b"));
  sse += job->stream_events(d0);
  EXPECT_FALSE(job->done) << "choice 1 is still running";
  auto d1 = job->absorb(events_for(1, "c</think>d"));
  sse += job->stream_events(d1);
  EXPECT_TRUE(job->done);
  bool done = false;
  std::vector<json> chunks = data_events(sse, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(chunks.size(), 7u);
  // The prologue: one role chunk per choice.
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(chunks[i]["choices"][0]["index"], i);
    EXPECT_EQ(chunks[i]["choices"][0]["delta"]["role"], "assistant");
  }
  std::string reasoning[2], content[2];
  int finishes = 0;
  for (size_t k = 2; k + 1 < chunks.size(); ++k) {
    EXPECT_EQ(chunks[k]["object"], "chat.completion.chunk");
    EXPECT_TRUE(chunks[k]["usage"].is_null()) << "usage only in the last chunk";
    const json& ch = chunks[k]["choices"][0];
    int i = ch["index"];
    reasoning[i] += ch["delta"].value("reasoning_content", "");
    content[i] += ch["delta"].value("content", "");
    if (!ch["finish_reason"].is_null()) ++finishes;
  }
  EXPECT_EQ(reasoning[0], "a");
  EXPECT_EQ(content[0], "b");
  EXPECT_EQ(reasoning[1], "c");
  EXPECT_EQ(content[1], "d");
  EXPECT_EQ(finishes, 2);
  const json& last = chunks.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_EQ(last["usage"]["completion_tokens"], 2 * (std::string("a</think>b").size() + 1));
}

TEST(Response, EngineErrorStreamsAnErrorEvent) {
  auto job = chat_job(1, true);
  engine::TokenEvent ev;
  ev.finished = true;
  ev.finish_reason = engine::FinishReason::error;
  ev.error = "device lost";
  auto d = job->absorb({ev});
  bool done = false;
  std::vector<json> chunks = data_events(job->stream_events(d), &done);
  EXPECT_TRUE(done);
  ASSERT_FALSE(chunks.empty());
  EXPECT_EQ(chunks[0]["error"]["message"], "generation failed: device lost");
  EXPECT_EQ(job->status, 500);
}

TEST(Response, HelpersDumpInvalidUtf8AndMakeRandomIds) {
  EXPECT_EQ(dump_json(json("a\xff")), "\"a\xEF\xBF\xBD\"");  // replaced, not thrown
  const std::string a = random_hex(24), b = random_hex(24);
  EXPECT_EQ(a.size(), 24u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, b);
  EXPECT_GT(unix_now(), 1700000000);
}

}  // namespace
}  // namespace kiln::server
