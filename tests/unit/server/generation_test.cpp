// The generation driver every generating route shares (src/server/generation.cpp): context checks, the output
// budget, queue-full answers, disconnects that free capacity, concurrent streams.
//
// Images through the HTTP server (src/server/generation.cpp place_images, protocol.cpp, the Messages and Responses
// translations) on kiln-tiny's tokenizer, chat template and CPU runner, with a stand-in vision encoder (zero
// embeddings: the server and engine paths are under test here, the tower itself in tests/unit/model). The token
// counts are worked out by hand from transformers' smart_resize and the Qwen3.5 template's placeholders.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <thread>

#include "../media/media_test_util.h"
#include "backend/cpu/cpu_backend.h"
#include "engine/engine.h"
#include "format/model_dir.h"
#include "forwarding_runner.h"
#include "http_test_server.h"
#include "media/image_processor.h"
#include "server/http_server.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {
namespace {

using namespace test;

TEST(Generation, MaxTokensDefaultsToTheRestOfTheContext) {
  TestServer& s = shared_server();
  json body = chat_body("hi");
  body["ignore_eos"] = true;
  body["max_tokens"] = 30;
  Reply r = post(s, "/v1/chat/completions", body);
  EXPECT_EQ(r.j["usage"]["completion_tokens"], 30);
  EXPECT_EQ(r.j["choices"][0]["finish_reason"], "length");
}

TEST(Generation, TooLongPromptGivesTheCounts) {
  TestServer& s = shared_server();
  Reply r = post(s, "/v1/chat/completions", chat_body(std::string(3000, 'x')));
  EXPECT_EQ(r.status, 400);
  std::string msg = r.j["error"]["message"];
  EXPECT_NE(msg.find("2048"), std::string::npos) << msg;
  EXPECT_NE(msg.find("30"), std::string::npos) << msg;
  EXPECT_EQ(r.j["error"]["code"], "context_length_exceeded");
  Reply r2 = post(s, "/v1/chat/completions", chat_body("short", {{"max_tokens", 5000}}));
  EXPECT_EQ(r2.status, 400);
  EXPECT_EQ(r2.j["error"]["param"], "max_tokens");
  EXPECT_NE(r2.j["error"]["message"].get<std::string>().find("2048"), std::string::npos);
}

TEST(Generation, QueueFullIs503WithRetryAfter) {
  ServerConfig cfg;
  cfg.max_running = 1;
  cfg.max_queued = 1;
  cfg.step_delay_us = 2000;
  TestServer s(cfg);
  // Long enough (1,000 steps of 2 ms) that the first request is still running when the last thread gets its answer,
  // even on a loaded 2-core machine.
  json slow = chat_body("x", {{"max_tokens", 1000}, {"ignore_eos", true}});
  std::vector<std::thread> threads;
  std::atomic<int> ok{0}, full{0};
  for (int i = 0; i < 6; ++i) {
    if (i == 1) std::this_thread::sleep_for(100ms);  // the first one is running by then
    threads.emplace_back([&] {
      Reply r = post(s, "/v1/chat/completions", slow);
      if (r.status == 200) ++ok;
      if (r.status == 503) {
        ++full;
        EXPECT_EQ(r.headers.count("Retry-After"), 1u);
        EXPECT_EQ(r.j["error"]["code"], "queue_full");
        // One running, one waiting: the message counts the waiting one only.
        EXPECT_NE(r.j["error"]["message"].get<std::string>().find("(1 waiting, limit 1)"), std::string::npos)
            << r.j["error"]["message"];
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 2);
  EXPECT_EQ(full.load(), 4);
  EXPECT_TRUE(wait_for_zero(s, "kiln:kv_pages_used"));
}

TEST(Generation, DisconnectsFreeCapacity) {
  ServerConfig cfg;
  cfg.step_delay_us = 3000;
  TestServer s(cfg);
  json long_gen = chat_body("x", {{"max_tokens", 1500}, {"ignore_eos", true}});
  // Streamed: read a little, then hang up.
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) {
    int fd = connect_to(s.port());
    ASSERT_GE(fd, 0);
    json b = long_gen;
    b["stream"] = true;
    send_request(fd, "/v1/chat/completions", b.dump());
    char buf[512];
    ASSERT_GT(recv(fd, buf, sizeof(buf), 0), 0);
    fds.push_back(fd);
  }
  // Non-streamed: hang up while it runs.
  for (int i = 0; i < 2; ++i) {
    int fd = connect_to(s.port());
    send_request(fd, "/v1/chat/completions", long_gen.dump());
    fds.push_back(fd);
  }
  // All five admitted (on a loaded machine the gate and the engine may take more than a moment).
  EXPECT_TRUE(wait_for_value(s, "kiln:num_running_reqs", 5, 3000ms)) << metric(s, "kiln:num_running_reqs");
  EXPECT_GT(metric(s, "kiln:kv_pages_used"), 0);
  for (int fd : fds) close(fd);
  EXPECT_TRUE(wait_for_zero(s, "kiln:kv_pages_used", 3000ms)) << "capacity leaked after disconnects";
  EXPECT_EQ(metric(s, "kiln:num_running_reqs"), 0);
  // Still answering.
  Reply r = post(s, "/v1/chat/completions", chat_body("a</think>b"));
  EXPECT_EQ(r.j["choices"][0]["message"]["content"], "b");
  for (int i = 0; i < 100 && s.http().active_requests() > 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(s.http().active_requests(), 0);
}

TEST(Generation, ManyConcurrentStreamsMatchAlone) {
  ServerConfig cfg;
  cfg.echo = false;  // hash model: each output depends on the whole sequence
  cfg.max_running = 8;
  TestServer s(cfg);
  std::vector<json> bodies;
  for (int i = 0; i < 40; ++i)
    bodies.push_back(chat_body("request " + std::to_string(i) + std::string(static_cast<size_t>(i * 7), '.'),
                               {{"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}}));
  std::vector<std::string> alone;
  for (const auto& b : bodies) alone.push_back(stream_chat(s, b).reasoning);
  std::vector<std::string> together(bodies.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < bodies.size(); ++i)
    threads.emplace_back([&, i] { together[i] = stream_chat(s, bodies[i]).reasoning; });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < bodies.size(); ++i) EXPECT_EQ(together[i], alone[i]) << i;
  EXPECT_TRUE(wait_for_zero(s, "kiln:kv_pages_used"));
}


// A shutdown whose timeout runs out aborts what still runs: a stream ends with an error event (503 shutting_down)
// and no [DONE]; a non-streamed request gets that error as its answer, not a 200 cut short.
TEST(Generation, ShutdownTimeoutEndsStreamsWithAnError) {
  ServerConfig cfg;
  cfg.step_delay_us = 3000;
  TestServer s(cfg);
  json long_gen = chat_body("x", {{"max_tokens", 1500}, {"ignore_eos", true}});
  Reply streamed, whole;
  std::thread a([&] {
    json b = long_gen;
    b["stream"] = true;
    streamed = post(s, "/v1/chat/completions", b);
  });
  std::thread w([&] { whole = post(s, "/v1/chat/completions", long_gen); });
  for (int i = 0; i < 200 && metric(s, "kiln:num_running_reqs") < 2; ++i) std::this_thread::sleep_for(10ms);
  s.http().set_draining();
  EXPECT_FALSE(s.engine().drain(std::chrono::milliseconds(50)));  // times out: the rest is aborted
  a.join();
  w.join();
  EXPECT_EQ(streamed.status, 200);  // the stream had begun
  bool done = true;
  std::vector<json> events = sse_events(streamed.body, &done);
  EXPECT_FALSE(done) << "a stream the shutdown cut short ended with [DONE]";
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["error"]["code"], "shutting_down") << events.back();
  for (const auto& ev : events)
    if (ev.contains("choices"))
      for (const auto& ch : ev["choices"]) EXPECT_NE(ch["finish_reason"], "abort");
  EXPECT_EQ(whole.status, 503) << whole.body;
  EXPECT_EQ(whole.j["error"]["code"], "shutting_down");
}

}  // namespace
}  // namespace kiln::server

namespace kiln::server {
namespace {

using json = nlohmann::json;
const std::string kTiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
constexpr int32_t kImagePad = 2060;  // kiln-tiny's <|image_pad|>

// kiln-tiny with a vision encoder that returns zeros for every image token.
class ZeroVision : public kiln::test::ForwardingRunner {
 public:
  using ForwardingRunner::ForwardingRunner;
  int vision_merge_size() const override { return 2; }
  std::vector<float> encode_image(std::span<const float>, int64_t t, int64_t h, int64_t w) override {
    ++encoded;
    return std::vector<float>(static_cast<size_t>(t * h * w / 4 * hidden), 0.0f);
  }
  std::atomic<int> encoded{0};
  int64_t hidden = 0;
};

std::string base64(const std::vector<uint8_t>& b) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < b.size(); i += 3) {
    const uint32_t n = (b[i] << 16) | (i + 1 < b.size() ? b[i + 1] << 8 : 0) | (i + 2 < b.size() ? b[i + 2] : 0);
    out += a[(n >> 18) & 63];
    out += a[(n >> 12) & 63];
    out += i + 1 < b.size() ? a[(n >> 6) & 63] : '=';
    out += i + 2 < b.size() ? a[n & 63] : '=';
  }
  return out;
}

std::string png_data(int width, int height) {
  media::test::PngSpec s;
  s.width = width;
  s.height = height;
  s.rows.resize(static_cast<size_t>(width * height * 3));
  for (size_t i = 0; i < s.rows.size(); ++i) s.rows[i] = static_cast<uint8_t>(i * 7);
  return base64(media::test::encode_png(s));
}

struct ImageServer {
  std::unique_ptr<tok::Tokenizer> tokenizer;
  std::unique_ptr<tmpl::ChatTemplate> chat_template;
  std::unique_ptr<media::ImageProcessor> processor;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<HttpServer> http;
  std::thread thread;
  ZeroVision* vision = nullptr;

  explicit ImageServer(bool with_images, int max_images = 4) {
    const format::ModelDir dir = format::ModelDir::open(kTiny);
    tokenizer = tok::Tokenizer::load_dir(kTiny);
    chat_template = tmpl::ChatTemplate::from_model_files(dir.read_text("chat_template.jinja"),
                                                        dir.read_text("tokenizer_config.json"));
    // Patch 16, merge 2 (factor 32), 1,024 to 16,384 pixels.
    processor = std::make_unique<media::ImageProcessor>(media::ImageProcessorConfig::parse(
        R"({"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
            "merge_size": 2, "size": {"shortest_edge": 1024, "longest_edge": 16384},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})",
        "test"));
    backend::LoadOptions lo;
    lo.max_context = 1024;
    lo.state_slots = 8;
    auto runner = std::make_unique<ZeroVision>(backend::load_cpu_model(dir, lo));
    runner->hidden = format::load_model_config(dir).hidden_size;
    vision = runner.get();
    engine::EngineOptions eo;
    eo.max_running_requests = 2;
    eo.eos_token_ids = {2050};
    engine = std::make_unique<engine::Engine>(std::move(runner), eo);
    engine->start();
    ServerOptions so;
    so.port = 0;
    so.served_model_name = "tiny";
    so.default_sampling.temperature = 0.0f;
    http = std::make_unique<HttpServer>(so);
    http->bind();
    thread = std::thread([this] { http->run(); });
    ModelContext mc;
    mc.engine = engine.get();
    mc.tokenizer = tokenizer.get();
    mc.chat_template = chat_template.get();
    if (with_images) {
      mc.image_processor = processor.get();
      mc.image_token_id = kImagePad;
      mc.max_images = max_images;
    }
    http->attach(mc);
  }
  ~ImageServer() {
    http->stop();
    thread.join();
    engine->stop();
  }
  std::pair<int, json> post(const std::string& path, const json& body) {
    httplib::Client c("127.0.0.1", http->port());
    c.set_read_timeout(60, 0);
    auto r = c.Post(path, body.dump(), "application/json");
    if (!r) return {0, json()};
    return {r->status, json::parse(r->body, nullptr, false)};
  }
};

json chat(std::vector<json> parts) {
  return {{"model", "tiny"}, {"max_tokens", 3}, {"messages", {{{"role", "user"}, {"content", parts}}}}};
}
json image_part(const std::string& b64) {
  return {{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64," + b64}}}};
}
const json kText = {{"type", "text"}, {"text", "describe"}};

TEST(ServerImages, ImageTokensAreCountedAndEveryApiAgrees) {
  ImageServer s(true);
  // Text only: the baseline prompt.
  auto [st0, text] = s.post("/v1/chat/completions",
                            {{"model", "tiny"}, {"max_tokens", 3}, {"messages", {{{"role", "user"}, {"content", "describe"}}}}});
  ASSERT_EQ(st0, 200) << text.dump();
  const int64_t T = text["usage"]["prompt_tokens"].get<int64_t>();
  // 64 wide x 32 high: smart_resize keeps 32 x 64 (multiples of 32, 2,048 pixels within [1,024, 16,384]): a grid of
  // 1 x 2 x 4 patches, 2 tokens after the 2 x 2 merge; the template adds <|vision_start|> and <|vision_end|>.
  const std::string small = png_data(64, 32);
  auto [st1, one] = s.post("/v1/chat/completions", chat({image_part(small), kText}));
  ASSERT_EQ(st1, 200) << one.dump();
  EXPECT_EQ(one["usage"]["prompt_tokens"].get<int64_t>(), T + 1 + 2 + 1);
  // 64 x 64: a 1 x 4 x 4 grid, 4 tokens; two images: both counted.
  const std::string square = png_data(64, 64);
  auto [st2, two] = s.post("/v1/chat/completions", chat({image_part(small), kText, image_part(square)}));
  ASSERT_EQ(st2, 200) << two.dump();
  EXPECT_EQ(two["usage"]["prompt_tokens"].get<int64_t>(), T + (1 + 2 + 1) + (1 + 4 + 1));
  EXPECT_GE(s.vision->encoded.load(), 3);
  // The Messages and Responses forms: the image adds the same 4 tokens to each API's own text-only prompt (their
  // templates' inputs differ from the chat body's, e.g. in thinking). Anthropic counts cache reads apart.
  auto anthropic_tokens = [&](bool with_image) {
    json content = json::array();
    if (with_image)
      content.push_back({{"type", "image"}, {"source", {{"type", "base64"}, {"media_type", "image/png"}, {"data", small}}}});
    content.push_back({{"type", "text"}, {"text", "describe"}});
    json body = {{"model", "tiny"}, {"max_tokens", 3}};
    body["messages"] = json::array({{{"role", "user"}, {"content", content}}});
    auto [st, r] = s.post("/v1/messages", body);
    EXPECT_EQ(st, 200) << r.dump();
    return r["usage"]["input_tokens"].get<int64_t>() + r["usage"]["cache_read_input_tokens"].get<int64_t>();
  };
  EXPECT_EQ(anthropic_tokens(true), anthropic_tokens(false) + 4);
  auto responses_tokens = [&](bool with_image) {
    json content = json::array();
    if (with_image) content.push_back({{"type", "input_image"}, {"image_url", "data:image/png;base64," + small}});
    content.push_back({{"type", "input_text"}, {"text", "describe"}});
    json body = {{"model", "tiny"}, {"max_output_tokens", 3}};
    body["input"] = json::array({{{"role", "user"}, {"content", content}}});
    auto [st, r] = s.post("/v1/responses", body);
    EXPECT_EQ(st, 200) << r.dump();
    return r["usage"]["input_tokens"].get<int64_t>();
  };
  EXPECT_EQ(responses_tokens(true), responses_tokens(false) + 4);
  // The same image content again: the prefix cache serves its tokens (keyed by the content hash).
  auto [st5, again] = s.post("/v1/chat/completions", chat({image_part(small), kText}));
  ASSERT_EQ(st5, 200);
  EXPECT_GT(again["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), 0) << again.dump();
}

TEST(ServerImages, BadImagesAre400sNamingThePart) {
  ImageServer s(true, 1);
  auto [st1, corrupt] = s.post("/v1/chat/completions",
                               chat({kText, {{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,iVBORw0KGgoAAAA"}}}}}));
  EXPECT_EQ(st1, 400);
  EXPECT_EQ(corrupt["error"]["param"], "messages[0].content[1]") << corrupt.dump();
  auto [st2, gif] = s.post("/v1/chat/completions",
                           chat({{{"type", "image_url"}, {"image_url", {{"url", "data:image/gif;base64,R0lGODlhAQABAAAAACw="}}}}}));
  EXPECT_EQ(st2, 400);
  EXPECT_NE(gif["error"]["message"].get<std::string>().find("GIF"), std::string::npos) << gif.dump();
  auto [st3, many] = s.post("/v1/chat/completions", chat({image_part(png_data(64, 32)), image_part(png_data(64, 32))}));
  EXPECT_EQ(st3, 400);
  EXPECT_NE(many["error"]["message"].get<std::string>().find("--limit-mm-per-prompt"), std::string::npos);
  auto [st4, file] = s.post("/v1/chat/completions",
                            chat({{{"type", "image_url"}, {"image_url", {{"url", "file:///etc/passwd"}}}}}));
  EXPECT_EQ(st4, 400);
  EXPECT_NE(file["error"]["message"].get<std::string>().find("--allowed-local-media-path"), std::string::npos)
      << file.dump();
  // The server still answers text afterwards.
  auto [st5, ok] = s.post("/v1/chat/completions", chat({kText}));
  EXPECT_EQ(st5, 200);
}

TEST(ServerImages, ATextOnlyModelRefusesImages) {
  ImageServer s(false);
  auto [st, r] = s.post("/v1/chat/completions", chat({image_part(png_data(64, 32)), kText}));
  EXPECT_EQ(st, 400);
  EXPECT_NE(r["error"]["message"].get<std::string>().find("text only"), std::string::npos) << r.dump();
}

}  // namespace
}  // namespace kiln::server
