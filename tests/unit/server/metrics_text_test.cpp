// render_metrics (src/server/metrics_text.cpp): engine gauges, HTTP counts, label escaping; and per-GPU figures in
// /get_server_info and /metrics: a fake runner that says it holds two GPU ranks (the dummy
// runner underneath, so the engine runs), and the CPU-style runner that reports none.
#include <gtest/gtest.h>
#include <httplib.h>

#include <cstring>
#include <memory>
#include <sstream>
#include <thread>

#include "engine/dummy_runner.h"
#include "engine/engine.h"
#include "server/http_server.h"
#include "server/metrics_text.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {
namespace {

using json = nlohmann::json;

std::vector<model::DeviceMemory> two_gpus() {
  model::DeviceMemory a;
  a.rank = 0;
  a.device = 2;
  a.name = "NVIDIA H200";
  a.weight_bytes = 118'640'000'000;
  a.kv_bytes = 7'000'000'000;
  a.state_bytes = 3'100'000'000;
  a.scratch_bytes = 900'000'000;
  a.total_bytes = 150'754'820'096;
  model::DeviceMemory b = a;
  b.rank = 1;
  b.device = 3;
  b.weight_bytes = 118'000'000'001;
  b.name = "NVIDIA \"H200\"";  // a label value that needs escaping
  return {a, b};
}

class FakeGpuRunner : public engine::DummyRunner {
 public:
  FakeGpuRunner(Options o, std::vector<model::DeviceMemory> devices) : DummyRunner(o), devices_(std::move(devices)) {}
  std::vector<model::DeviceMemory> device_memory() const override { return devices_; }

 private:
  std::vector<model::DeviceMemory> devices_;
};

class Server {
 public:
  explicit Server(std::vector<model::DeviceMemory> devices) {
    tokenizer_ = tok::Tokenizer::load_dir(std::string(KILN_SOURCE_DIR) + "/tests/fixtures/reference/byte_tokenizer");
    engine::DummyRunner::Options d;
    d.vocab = 512;
    engine::EngineOptions eo;
    eo.max_running_requests = 4;
    eo.chunked_prefill_size = 64;
    engine_ = std::make_unique<engine::Engine>(std::make_unique<FakeGpuRunner>(d, std::move(devices)), eo);
    engine_->start();
    ServerOptions so;
    so.port = 0;
    so.served_model_name = "m";
    server_ = std::make_unique<HttpServer>(so);
    server_->bind();
    thread_ = std::thread([this] { server_->run(); });
    server_->attach({engine_.get(), tokenizer_.get(), nullptr});
  }
  ~Server() {
    server_->stop();
    thread_.join();
    engine_->stop();
  }
  std::string get(const std::string& path) {
    httplib::Client c("127.0.0.1", server_->port());
    auto r = c.Get(path.c_str());
    EXPECT_TRUE(r) << path;
    if (!r) return "";
    EXPECT_EQ(r->status, 200) << path;
    return r->body;
  }

 private:
  std::unique_ptr<tok::Tokenizer> tokenizer_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
};

// The value of the metric line that starts with `series` (name and labels), or -1.
double metric_value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return -1;
}

TEST(MetricsText, EngineGaugesAndHttpCountsAreRendered) {
  engine::EngineMetricsSnapshot m;
  m.num_running = 3;
  m.num_waiting = 5;
  m.kv_pages_used = 25;
  m.kv_pages_total = 100;
  HttpCounts http;
  http.requests[{"/v1/chat/completions", 200}] = 7;
  http.requests[{"/v1/models", 404}] = 2;
  const std::string text = render_metrics(m, http, "my \"model\"");
  const std::string model = "model_name=\"my \\\"model\\\"\"";  // quotes escaped in the label value
  EXPECT_EQ(metric_value(text, "kiln:num_running_reqs{" + model + "}"), 3.0) << text;
  EXPECT_EQ(metric_value(text, "kiln:num_queue_reqs{" + model + "}"), 5.0);
  EXPECT_EQ(metric_value(text, "kiln:kv_cache_usage_ratio{" + model + "}"), 0.25);
  EXPECT_EQ(metric_value(text, "kiln:http_requests_total{" + model + ",endpoint=\"/v1/chat/completions\",status=\"200\"}"),
            7.0);
  EXPECT_EQ(metric_value(text, "kiln:http_requests_total{" + model + ",endpoint=\"/v1/models\",status=\"404\"}"), 2.0);
  // Every sample line belongs to a metric declared by a TYPE line before it.
  std::istringstream in(text);
  std::string line, declared;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) declared += " " + line.substr(7, line.find(' ', 7) - 7) + " ";
    else if (!line.empty() && line[0] != '#') {
      std::string name = line.substr(0, line.find_first_of("{ "));
      for (const char* suffix : {"_bucket", "_sum", "_count"})
        if (declared.find(" " + name + " ") == std::string::npos && name.size() > std::strlen(suffix) &&
            name.compare(name.size() - std::strlen(suffix), std::string::npos, suffix) == 0)
          name.resize(name.size() - std::strlen(suffix));
      EXPECT_NE(declared.find(" " + name + " "), std::string::npos) << "undeclared: " << line;
    }
  }
}

TEST(MetricsText, ServerInfoListsEveryGpuRank) {
  Server s(two_gpus());
  const json info = json::parse(s.get("/get_server_info"));
  ASSERT_TRUE(info["gpus"].is_array());
  ASSERT_EQ(info["gpus"].size(), 2u);
  const json& g0 = info["gpus"][0];
  EXPECT_EQ(g0["rank"], 0);
  EXPECT_EQ(g0["gpu"], 2);
  EXPECT_EQ(g0["name"], "NVIDIA H200");
  EXPECT_EQ(g0["weight_bytes"], 118'640'000'000);
  EXPECT_EQ(g0["kv_cache_bytes"], 7'000'000'000);
  EXPECT_EQ(g0["state_bytes"], 3'100'000'000);
  EXPECT_EQ(g0["scratch_bytes"], 900'000'000);
  EXPECT_EQ(g0["total_bytes"], 150'754'820'096);
  EXPECT_EQ(info["gpus"][1]["rank"], 1);
  EXPECT_EQ(info["gpus"][1]["gpu"], 3);
  EXPECT_EQ(info["gpus"][1]["weight_bytes"], 118'000'000'001);
}

TEST(MetricsText, MetricsHaveGaugesPerGpuAndRank) {
  Server s(two_gpus());
  const std::string m = s.get("/metrics");
  EXPECT_EQ(metric_value(m, "kiln:gpu_weight_bytes{model_name=\"m\",gpu=\"2\",rank=\"0\"}"), 118'640'000'000.0);
  EXPECT_EQ(metric_value(m, "kiln:gpu_weight_bytes{model_name=\"m\",gpu=\"3\",rank=\"1\"}"), 118'000'000'001.0);
  EXPECT_EQ(metric_value(m, "kiln:gpu_kv_cache_bytes{model_name=\"m\",gpu=\"3\",rank=\"1\"}"), 7'000'000'000.0);
  EXPECT_EQ(metric_value(m, "kiln:gpu_state_bytes{model_name=\"m\",gpu=\"2\",rank=\"0\"}"), 3'100'000'000.0);
  EXPECT_EQ(metric_value(m, "kiln:gpu_scratch_bytes{model_name=\"m\",gpu=\"2\",rank=\"0\"}"), 900'000'000.0);
  EXPECT_EQ(metric_value(m, "kiln:gpu_total_bytes{model_name=\"m\",gpu=\"3\",rank=\"1\"}"), 150'754'820'096.0);
  EXPECT_EQ(metric_value(m, "kiln:gpu_info{model_name=\"m\",gpu=\"3\",rank=\"1\",name=\"NVIDIA \\\"H200\\\"\"}"), 1.0);
  // One HELP / TYPE per metric, not per series.
  size_t helps = 0;
  for (size_t at = m.find("# TYPE kiln:gpu_weight_bytes gauge"); at != std::string::npos;
       at = m.find("# TYPE kiln:gpu_weight_bytes gauge", at + 1))
    ++helps;
  EXPECT_EQ(helps, 1u);
}

TEST(MetricsText, CpuRunnerReportsNoGpus) {
  Server s({});
  const json info = json::parse(s.get("/get_server_info"));
  ASSERT_TRUE(info["gpus"].is_array());
  EXPECT_TRUE(info["gpus"].empty());
  EXPECT_EQ(s.get("/metrics").find("kiln:gpu_"), std::string::npos);
  // render_metrics without devices (its default) writes no per-GPU series either.
  EXPECT_EQ(render_metrics({}, {}, "m").find("kiln:gpu_"), std::string::npos);
}

}  // namespace
}  // namespace kiln::server
