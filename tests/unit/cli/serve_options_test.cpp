// kiln serve's option builders (cli/serve_options.h): flags + what startup found -> the server's, the engine's and the
// loader's options and the startup summary, with no model loaded and no port opened.
#include "cli/serve_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/error.h"

namespace kiln::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

format::ModelConfig config_with(int64_t max_position_embeddings) {
  format::ModelConfig c;
  c.model_type = "qwen3_5_moe";
  c.architecture = "Qwen3_5MoeForConditionalGeneration";
  c.max_position_embeddings = max_position_embeddings;
  c.vocab_size = 1000;
  return c;
}

ServeContext context(const std::string& device) {
  ServeContext c;
  c.device = device;
  c.model_path = "/models/m";
  c.prefill.step_tokens = 2048;
  c.prefill.pass_tokens = 512;
  c.prefill.reason = "auto: test";
  c.slots_per_request = 3;
  return c;
}

TEST(CheckServeArgs, KvCacheDtypeAndBadFlags) {
  ServeArgs a;
  EXPECT_EQ(check_serve_args(a), DType::BF16);
  a.kv_cache_dtype = "bf16";
  EXPECT_EQ(check_serve_args(a), DType::BF16);
  a.kv_cache_dtype = "fp8_e4m3";
  EXPECT_EQ(check_serve_args(a), DType::F8_E4M3);
  a.kv_cache_dtype = "fp8";
  EXPECT_THAT([&] { check_serve_args(a); }, ThrowsMessage<Error>(HasSubstr("unknown --kv-cache-dtype 'fp8'")));
  a = {};
  a.port = 70000;
  EXPECT_THAT([&] { check_serve_args(a); }, ThrowsMessage<Error>(HasSubstr("--port must be 0..65535 (got 70000)")));
  a = {};
  a.max_request_bytes = 100;
  EXPECT_THAT([&] { check_serve_args(a); }, ThrowsMessage<Error>(HasSubstr("--max-request-bytes must be at least 1024")));
  a = {};
  a.dummy_runner = "random";
  EXPECT_THAT([&] { check_serve_args(a); }, ThrowsMessage<Error>(HasSubstr("unknown --dummy-runner 'random'")));
  a = {};
  a.context_length = -1;
  EXPECT_THAT([&] { check_serve_args(a); }, ThrowsMessage<Error>(HasSubstr("--context-length must be positive")));
}

TEST(CheckServeArgs, LogFormatAndAllowedOrigins) {
  ServeArgs a;
  EXPECT_EQ(serve_log_format(a), LogFormat::text);
  a.log_format = "json";
  EXPECT_EQ(serve_log_format(a), LogFormat::json);
  a.log_format = "xml";
  EXPECT_THAT([&] { check_serve_args(a); }, ThrowsMessage<Error>(HasSubstr("unknown --log-format 'xml'")));
  a = {};
  a.allowed_origins = "app.example.com";
  EXPECT_THAT([&] { check_serve_args(a); },
              ThrowsMessage<Error>(HasSubstr("--allowed-origins: 'app.example.com' is not an origin")));
}

TEST(ParseAllowedOrigins, ListStarSpacesAndTrailingSlashes) {
  EXPECT_EQ(parse_allowed_origins(""), std::vector<std::string>{});
  EXPECT_EQ(parse_allowed_origins("*"), std::vector<std::string>{"*"});
  EXPECT_EQ(parse_allowed_origins(" https://app.example.com/ , http://localhost:5173,"),
            (std::vector<std::string>{"https://app.example.com", "http://localhost:5173"}));
}

TEST(CheckServeArgsAgainstModel, ContextLengthAtMostMaxPositionEmbeddings) {
  ServeArgs a;
  check_serve_args_against_model(a, config_with(4096));  // the model's length
  a.context_length = 4096;
  check_serve_args_against_model(a, config_with(4096));
  a.context_length = 4097;
  EXPECT_THAT([&] { check_serve_args_against_model(a, config_with(4096)); },
              ThrowsMessage<Error>(HasSubstr("--context-length 4097 is more than the model's max_position_embeddings "
                                             "(4096); use at most 4096")));
}

TEST(BuildServerOptions, NamesLimitsAndTheFlagsEcho) {
  ServeArgs a;
  a.port = 8080;
  a.api_key = "k";
  a.max_running_requests = 10;
  a.max_queued_requests = 20;
  const server::ServerOptions so = build_server_options(a, context("cpu"), config_with(4096));
  EXPECT_EQ(so.port, 8080);
  EXPECT_EQ(so.api_key, "k");
  EXPECT_EQ(so.served_model_name, "/models/m");  // the model path when --served-model-name is not given
  EXPECT_EQ(so.tokenizer_path, "/models/m");
  EXPECT_EQ(so.model_type, "qwen3_5_moe");
  EXPECT_EQ(so.architectures, std::vector<std::string>{"Qwen3_5MoeForConditionalGeneration"});
  EXPECT_EQ(so.http_threads, 10 + 20 + 32);
  EXPECT_EQ(so.server_args["api_key_set"], true);
  EXPECT_EQ(so.server_args["device"], "cpu");
  EXPECT_EQ(so.server_args["chunked_prefill_size"], 2048);
  EXPECT_EQ(so.server_args["max_pass_tokens"], 512);
  EXPECT_TRUE(so.allowed_origins.empty());
  EXPECT_EQ(so.server_args["log_format"], "text");
  EXPECT_EQ(so.request_timeout_s, 60);  // the HTTP front's defaults
  EXPECT_EQ(so.min_upload_rate_bytes_s, 500);
  EXPECT_EQ(so.max_connections, 0);
  EXPECT_EQ(so.max_connections_per_client, 0);
  a.served_model_name = "qwen";
  a.allowed_origins = "https://a.example,*";
  a.log_format = "json";
  a.http_front = {30, 0, 100, 4};
  a.max_running_requests = 0;  // the plan's: 256 counted for the threads
  a.max_queued_requests = 5000;
  a.dummy_runner = "echo";
  const server::ServerOptions s2 = build_server_options(a, context("cpu"), config_with(4096));
  EXPECT_EQ(s2.served_model_name, "qwen");
  EXPECT_EQ(s2.http_threads, 2048);  // capped
  EXPECT_EQ(s2.server_args["device"], "dummy-echo");
  EXPECT_EQ(s2.allowed_origins, (std::vector<std::string>{"https://a.example", "*"}));
  EXPECT_EQ(s2.server_args["allowed_origins"], nlohmann::json({"https://a.example", "*"}));
  EXPECT_EQ(s2.server_args["log_format"], "json");
  EXPECT_EQ(s2.request_timeout_s, 30);
  EXPECT_EQ(s2.min_upload_rate_bytes_s, 0);
  EXPECT_EQ(s2.max_connections, 100);
  EXPECT_EQ(s2.max_connections_per_client, 4);
}

TEST(CollectEosIds, UnionOfConfigChatTurnEndsAndTheTokenizersEos) {
  const std::map<std::string, int32_t> vocab = {{"<|im_end|>", 7}, {"<|endoftext|>", 5}, {"</s>", 9}};
  auto id = [&](const std::string& t) {
    auto it = vocab.find(t);
    return it == vocab.end() ? -1 : it->second;
  };
  EXPECT_EQ(collect_eos_ids({9, 5}, id, std::string("</s>")), (std::vector<int32_t>{5, 7, 9}));
  EXPECT_EQ(collect_eos_ids({}, [](const std::string&) { return -1; }, std::nullopt), std::vector<int32_t>{});
  EXPECT_EQ(collect_eos_ids({3}, [](const std::string&) { return -1; }, std::string("<eos>")),
            std::vector<int32_t>{3});
}

TEST(BuildEngineOptions, FromTheFlags) {
  ServeArgs a;
  a.max_running_requests = 12;
  a.disable_radix_cache = true;
  a.context_length = 1000;
  const engine::EngineOptions eo = build_engine_options(a, context("cpu"), {2, 3});
  EXPECT_EQ(eo.max_running_requests, 12);
  EXPECT_EQ(eo.max_queued_requests, 256);
  EXPECT_EQ(eo.chunked_prefill_size, 2048);
  EXPECT_EQ(eo.context_length, 1000);
  EXPECT_FALSE(eo.enable_prefix_cache);
  EXPECT_EQ(eo.eos_token_ids, (std::vector<int32_t>{2, 3}));
}

// CPU: a context per running request, at most 256k tokens, at least one context; pages of 16 tokens rounded up.
TEST(CpuKvPages, AContextPerRunningRequestWithinTheCap) {
  EXPECT_EQ(cpu_kv_pages(32, 0, 4096, 16), 32 * 4096 / 16);
  EXPECT_EQ(cpu_kv_pages(32, 0, 262144, 16), 262144 / 16);          // 32 contexts > 256k: the cap
  EXPECT_EQ(cpu_kv_pages(1, 0, 1000000, 16), 1000000 / 16);         // one context above the cap: still one
  EXPECT_EQ(cpu_kv_pages(4, 1000, 4096, 16), (4 * 1000 + 15) / 16);  // --context-length
  EXPECT_EQ(cpu_kv_pages(4, 10000, 4096, 16), 4 * 4096 / 16);       // never above the model's
  EXPECT_EQ(cpu_kv_pages(1, 17, 4096, 16), 2);
}

TEST(BuildLoadOptions, CpuSizesItsOwnPoolCudaLeavesItToThePlan) {
  ServeArgs a;
  a.threads = 3;
  a.parallel.tp_size = 2;
  a.gpu.disable_cuda_graph = true;
  const backend::LoadOptions cpu = build_load_options(a, context("cpu"), config_with(4096), DType::F8_E4M3);
  EXPECT_EQ(cpu.kv_dtype, DType::F8_E4M3);
  EXPECT_EQ(cpu.threads, 3);
  EXPECT_EQ(cpu.slots_per_request, 3);
  EXPECT_EQ(cpu.prefill_chunk, 512);
  EXPECT_EQ(cpu.state_slots, kCpuDefaultRunning * 3);
  EXPECT_EQ(cpu.kv_pages, cpu_kv_pages(kCpuDefaultRunning, 0, 4096, 16));
  EXPECT_EQ(cpu.parallel.tp_size, 2);
  EXPECT_FALSE(cpu.gpu.cuda_graphs);
  const backend::LoadOptions cuda = build_load_options(a, context("cuda"), config_with(4096), DType::BF16);
  EXPECT_EQ(cuda.state_slots, 0);  // the memory plan chooses
  EXPECT_EQ(cuda.kv_pages, 0);
  a.max_running_requests = 8;
  a.max_total_tokens = 1000;
  const backend::LoadOptions set = build_load_options(a, context("cuda"), config_with(4096), DType::BF16);
  EXPECT_EQ(set.state_slots, 24);
  EXPECT_EQ(set.kv_pages, (1000 + 15) / 16);
  EXPECT_EQ(build_load_options(a, context("cpu"), config_with(4096), DType::BF16).kv_pages, (1000 + 15) / 16);
}

TEST(DefaultSampling, FromGenerationConfig) {
  std::string desc;
  engine::SamplingParams s = default_sampling(R"({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true})",
                                              &desc);
  EXPECT_FLOAT_EQ(s.temperature, 0.6f);
  EXPECT_FLOAT_EQ(s.top_p, 0.95f);
  EXPECT_EQ(s.top_k, 20);
  EXPECT_EQ(desc, "temperature 0.6, top_p 0.95, top_k 20");
  const engine::SamplingParams openai;
  desc.clear();
  s = default_sampling("", &desc);
  EXPECT_FLOAT_EQ(s.temperature, openai.temperature);
  EXPECT_EQ(desc, "");
  s = default_sampling("not json", &desc);
  EXPECT_FLOAT_EQ(s.top_p, openai.top_p);
  EXPECT_EQ(default_sampling(R"({"top_k": -1})", &desc).top_k, 0);
}

TEST(BuildDummyRunnerOptions, SizesAsACpuLaunchAndEchoIds) {
  ServeArgs a;
  a.dummy_runner = "echo";
  DummyTokens t;
  t.vocab = 2000;
  t.turn_start = 1;
  t.turn_end = 2;
  t.newline = 3;
  engine::DummyRunner::Options d = build_dummy_runner_options(a, context("cpu"), config_with(1024), t);
  EXPECT_TRUE(d.echo);
  EXPECT_EQ(d.turn_end, 2);
  EXPECT_EQ(d.vocab, 2000);  // the larger of the model's and the tokenizer's
  EXPECT_EQ(d.capacity.max_context, 1024);
  EXPECT_EQ(d.capacity.state_slots, kCpuDefaultRunning * 3);
  EXPECT_EQ(d.capacity.kv_pages, kCpuDefaultRunning * (1024 / 16));
  a.dummy_runner = "hash";
  a.context_length = 100;
  a.max_total_tokens = 33;
  d = build_dummy_runner_options(a, context("cpu"), config_with(0), t);
  EXPECT_FALSE(d.echo);
  EXPECT_EQ(d.capacity.max_context, 100);
  EXPECT_EQ(d.capacity.kv_pages, 3);
}

TEST(StartupSummary, SaysWhatStartupChose) {
  ServeSummary s;
  s.model = "/models/m";
  s.model_type = "qwen3_5_moe";
  s.architecture = "Qwen3_5MoeForConditionalGeneration";
  s.vocab_size = 1000;
  s.eos_token_ids = {5, 7};
  s.context_length = 4096;
  s.capacity.kv_pages = 10;
  s.capacity.page_size = 16;
  s.capacity.kv_bytes_per_token = 1024;  // 160 tokens x 1 KiB = 160 KiB
  s.capacity.state_slots = 4;
  s.capacity.state_bytes_per_slot = 1 << 20;
  s.kv_cache_dtype = "auto";
  s.max_running = 8;
  s.max_queued = 256;
  s.prefill.step_tokens = 2048;
  s.prefill.pass_tokens = 512;
  s.prefill.reason = "auto: the CPU backend";
  s.runner = "cpu runner";
  s.host = "127.0.0.1";
  s.port = 30000;
  s.served_model_name = "m";
  const std::string text = startup_summary(s);
  EXPECT_THAT(text, HasSubstr("  model:     /models/m (qwen3_5_moe, Qwen3_5MoeForConditionalGeneration)\n"));
  EXPECT_THAT(text, HasSubstr("  tokenizer: 1000 tokens; eos ids 5 7\n"));
  EXPECT_THAT(text, HasSubstr("  template:  none (chat completions disabled)\n"));
  EXPECT_THAT(text, HasSubstr("  KV cache:  10 pages x 16 tokens = 160 tokens, max_total_num_tokens (bf16, 160.0 KiB); "
                              "4 state slots (4.0 MiB)\n"));
  EXPECT_THAT(text, HasSubstr("  prefill:   steps of at most 2048 tokens, decodes + prompt chunks (auto: the CPU "
                              "backend); forward passes of at most 512 tokens"));
  EXPECT_THAT(text, HasSubstr("  sampling:  defaults OpenAI's (temperature 1, top_p 1)\n"));
  EXPECT_THAT(text, HasSubstr("  api key:   none (open)\n"));
  EXPECT_THAT(text, HasSubstr("ready: http://127.0.0.1:30000 (model \"m\")\n"));
  EXPECT_EQ(text.find("weights:"), std::string::npos);
  EXPECT_EQ(text.find("nccl:"), std::string::npos);
  s.dummy_runner = "hash";
  s.nccl = {{"NCCL_NVLS_ENABLE", "0", true, "off here"}, {"NCCL_OTHER", "1", false, ""}};
  s.template_source = "chat_template.jinja";
  s.api_key = true;
  const std::string t2 = startup_summary(s);
  EXPECT_THAT(t2, HasSubstr("  weights:   none (--dummy-runner hash, for testing)\n"));
  EXPECT_THAT(t2, HasSubstr("  template:  chat_template.jinja\n"));
  EXPECT_THAT(t2, HasSubstr("  nccl:      NCCL_NVLS_ENABLE=0 (set by kiln: off here)\n"));
  EXPECT_THAT(t2, HasSubstr("  nccl:      NCCL_OTHER=1 (yours, kept)\n"));
  EXPECT_THAT(t2, HasSubstr("  api key:   required (Authorization: Bearer ...)\n"));
}

TEST(HumanBytes, BinaryUnits) {
  EXPECT_EQ(human_bytes(0), "0.0 B");
  EXPECT_EQ(human_bytes(1536), "1.5 KiB");
  EXPECT_EQ(human_bytes(3.0 * 1024 * 1024 * 1024), "3.0 GiB");
}


TEST(ServeOptions, ImageLimitFlag) {
  EXPECT_EQ(parse_image_limit("image=16"), 16);
  EXPECT_EQ(parse_image_limit("image=0"), 0);
  EXPECT_EQ(parse_image_limit("{\"image\": 3}"), 3);
  EXPECT_EQ(parse_image_limit("{ \"image\" : 2 }"), 2);
  for (const char* bad : {"video=1", "{\"video\": 1}", "image=-1", "image=x", "image=", "3", "{\"image\": 1.5}",
                          "image=5000"})
    EXPECT_THROW(parse_image_limit(bad), Error) << bad;
  ServeArgs a;
  a.max_image_bytes = 0;
  EXPECT_THROW(build_media_options(a), Error);
  a = ServeArgs{};
  a.allowed_local_media_path = "/srv/images";
  a.allow_image_url_fetch = true;
  const media::MediaOptions m = build_media_options(a);
  EXPECT_EQ(m.allowed_local_path, "/srv/images");
  EXPECT_TRUE(m.allow_url_fetch);
}

}  // namespace
}  // namespace kiln::cli
