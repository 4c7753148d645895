// kiln bench's dataset mode (--dataset-path): the three file layouts, the prompt each endpoint sends, errors that
// name the problem, and whole runs against an in-process stub server that records every request it gets.
#include <gtest/gtest.h>
#include <httplib.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "clients/bench.h"
#include "core/error.h"

namespace kiln::clients {
namespace {

using json = nlohmann::json;

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const kiln::Error& e) {
    return e.what();
  }
  return "(no kiln::Error thrown)";
}

#define EXPECT_ERROR_HAS(expr, text)                                   \
  do {                                                                 \
    const std::string msg_ = error_of([&] { (void)(expr); });          \
    EXPECT_NE(msg_.find(text), std::string::npos) << "error: " << msg_; \
  } while (0)

// A fresh folder for one test's files.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("kiln_bench_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string write(const std::string& name, const std::string& text) const {
    std::string file = (path_ / name).string();
    std::ofstream(file, std::ios::binary) << text;
    return file;
  }

 private:
  std::filesystem::path path_;
};

// Three items: token ids + text, text only, messages (thinking off) + a max_tokens of its own.
const json kItems = json::parse(R"([
  {"id": "a", "mode": "direct", "prompt": "<|im_start|>user\nhi<|im_end|>\n", "prompt_ids": [5, 6, 7, 8],
   "messages": [{"role": "user", "content": "hi"}]},
  {"id": "b", "prompt": "one two three"},
  {"id": "c", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 3"}],
   "enable_thinking": false, "prompt": "four five", "max_tokens": 3}
])");

void expect_three_items(const std::vector<DatasetItem>& items) {
  ASSERT_EQ(items.size(), 3u);
  ASSERT_TRUE(items[0].prompt_ids);
  EXPECT_EQ(*items[0].prompt_ids, (std::vector<int64_t>{5, 6, 7, 8}));
  EXPECT_EQ(items[0].prompt, "<|im_start|>user\nhi<|im_end|>\n");
  EXPECT_EQ(items[0].messages, kItems[0]["messages"]);
  EXPECT_FALSE(items[0].max_tokens);
  EXPECT_FALSE(items[1].prompt_ids);
  EXPECT_EQ(items[1].prompt, "one two three");
  EXPECT_TRUE(items[1].messages.is_null());
  EXPECT_EQ(items[2].messages, kItems[2]["messages"]);
  EXPECT_EQ(items[2].enable_thinking, false);
  EXPECT_EQ(items[2].max_tokens, 3u);
}

TEST(DatasetLayouts, ObjectWithItems) {
  auto items = parse_dataset(json{{"description", "x"}, {"items", kItems}}.dump(2), "d.json");
  expect_three_items(items);
  EXPECT_EQ(items[1].where, "items[1]");
}

TEST(DatasetLayouts, TopLevelArray) {
  auto items = parse_dataset(kItems.dump(), "d.json");
  expect_three_items(items);
  EXPECT_EQ(items[2].where, "[2]");
}

TEST(DatasetLayouts, JsonlWithBlankLines) {
  std::string text = kItems[0].dump() + "\n\n" + kItems[1].dump() + "\r\n" + kItems[2].dump();  // no final newline
  auto items = parse_dataset(text, "d.jsonl");
  expect_three_items(items);
  EXPECT_EQ(items[2].where, "line 4");
  // One line is one item.
  EXPECT_EQ(parse_dataset(kItems[1].dump() + "\n", "one.jsonl").size(), 1u);
}

// The repository's kiln-tiny evaluation set, read through load_dataset, agrees with the file as plain JSON.
TEST(DatasetLayouts, TinyEvalPrompts) {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/tools/tiny/eval_prompts.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const json root = json::parse(in);
  auto items = load_dataset(path);
  ASSERT_EQ(items.size(), root["items"].size());
  for (size_t i : {size_t{0}, items.size() - 1}) {
    ASSERT_TRUE(items[i].prompt_ids);
    EXPECT_EQ(*items[i].prompt_ids, root["items"][i]["prompt_ids"].get<std::vector<int64_t>>());
    EXPECT_EQ(items[i].enable_thinking, root["items"][i]["enable_thinking"].get<bool>());
  }
}

TEST(DatasetErrors, EmptyOrNotJson) {
  EXPECT_ERROR_HAS(parse_dataset("", "e.json"), "e.json is empty");
  EXPECT_ERROR_HAS(parse_dataset(" \n\t\n", "e.json"), "e.json is empty");
  EXPECT_ERROR_HAS(parse_dataset("[{\"prompt\": \"x\"}", "bad.json"), "bad.json is not valid JSON");
  EXPECT_ERROR_HAS(parse_dataset("{\"prompt\": \"x\"}\n{\"prompt\": ", "bad.jsonl"), "bad.jsonl line 2 is not valid JSON");
  EXPECT_ERROR_HAS(parse_dataset("42", "n.json"), "n.json holds a JSON number");
  EXPECT_ERROR_HAS(parse_dataset("[]", "z.json"), "z.json holds no items");
  EXPECT_ERROR_HAS(parse_dataset("{\n  \"data\": [{\"prompt\": \"x\"}]\n}", "o.json"),
                   "o.json is a JSON object without an \"items\" array");
  EXPECT_ERROR_HAS(parse_dataset("{\"items\": []}", "z.json"), "z.json holds no items");
  EXPECT_ERROR_HAS(parse_dataset("{\"items\": {\"prompt\": \"x\"}}", "i.json"), "\"items\" is not an array");
  EXPECT_ERROR_HAS(load_dataset("/nonexistent/kiln/dataset.json"), "cannot open --dataset-path /nonexistent/kiln");
}

TEST(DatasetErrors, ItemWithoutPromptNamesItsIndexAndTheFields) {
  json items = kItems;
  items[1] = {{"id", "b"}, {"question", "what?"}};
  const std::string msg = error_of([&] { parse_dataset(json{{"items", items}}.dump(), "d.json"); });
  EXPECT_NE(msg.find("d.json: items[1] has none of \"prompt_ids\", \"prompt\", \"messages\""), std::string::npos)
      << msg;
  EXPECT_ERROR_HAS(parse_dataset("{\"prompt\": \"x\"}\n{\"text\": \"y\"}\n", "d.jsonl"), "d.jsonl: line 2 has none of");
  EXPECT_ERROR_HAS(parse_dataset("[\"just text\"]", "d.json"), "d.json: [0] is not a JSON object");
  // null counts as absent.
  EXPECT_ERROR_HAS(parse_dataset("[{\"prompt\": null}]", "d.json"), "[0] has none of");
}

TEST(DatasetErrors, FieldsOfTheWrongType) {
  EXPECT_ERROR_HAS(parse_dataset("[{\"prompt_ids\": [1, \"2\"]}]", "d.json"), "\"prompt_ids\" holds \"2\"");
  EXPECT_ERROR_HAS(parse_dataset("[{\"prompt_ids\": [1, -2]}]", "d.json"), "\"prompt_ids\" holds -2");
  EXPECT_ERROR_HAS(parse_dataset("[{\"prompt_ids\": []}]", "d.json"), "\"prompt_ids\" must be a non-empty array");
  EXPECT_ERROR_HAS(parse_dataset("[{\"prompt\": 7}]", "d.json"), "\"prompt\" must be a string (got number)");
  EXPECT_ERROR_HAS(parse_dataset("[{\"messages\": \"hi\"}]", "d.json"), "\"messages\" must be a non-empty array");
  EXPECT_ERROR_HAS(parse_dataset("[{\"messages\": [{\"content\": \"hi\"}]}]", "d.json"), "\"messages\" must be");
  EXPECT_ERROR_HAS(parse_dataset("[{\"prompt\": \"x\", \"max_tokens\": 0}]", "d.json"),
                   "[0]: \"max_tokens\" must be a positive integer (got 0)");
  EXPECT_ERROR_HAS(parse_dataset("[{\"prompt\": \"x\", \"enable_thinking\": \"yes\"}]", "d.json"),
                   "\"enable_thinking\" must be true or false");
}

BenchOptions dataset_options(BenchEndpoint endpoint, const std::string& path = "d.json") {
  BenchOptions o;
  o.endpoint = endpoint;
  o.dataset_path = path;
  o.output_len = 64;
  return o;
}

TEST(DatasetPrompt, CompletionsSendsTokenIdsElseText) {
  auto items = parse_dataset(kItems.dump(), "d.json");
  const BenchOptions o = dataset_options(BenchEndpoint::completions);
  BenchPrompt a = dataset_prompt(items[0], o);  // has prompt_ids and prompt: the ids
  EXPECT_EQ(a.prompt_ids, (std::vector<int64_t>{5, 6, 7, 8}));
  EXPECT_EQ(a.input_tokens, 4u);
  EXPECT_EQ(a.max_tokens, 64u);
  BenchPrompt b = dataset_prompt(items[1], o);  // text only
  EXPECT_TRUE(b.prompt_ids.empty());
  EXPECT_EQ(b.text, "one two three");
  EXPECT_EQ(b.input_tokens, 0u);  // counted by the caller
  BenchPrompt c = dataset_prompt(items[2], o);  // messages + prompt: the prompt; its own max_tokens
  EXPECT_EQ(c.text, "four five");
  EXPECT_TRUE(c.messages.is_null());
  EXPECT_EQ(c.max_tokens, 3u);
  auto chat_only = parse_dataset("[{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}]", "m.json");
  EXPECT_ERROR_HAS(dataset_prompt(chat_only[0], o), "d.json: [0] has neither \"prompt_ids\" nor \"prompt\"");
  EXPECT_ERROR_HAS(dataset_prompt(chat_only[0], o), "pass --endpoint chat");
}

TEST(DatasetPrompt, ChatSendsMessagesElseTextAsOneUserMessage) {
  auto items = parse_dataset(kItems.dump(), "d.json");
  const BenchOptions o = dataset_options(BenchEndpoint::chat);
  BenchPrompt a = dataset_prompt(items[0], o);
  EXPECT_EQ(a.messages, kItems[0]["messages"]);
  EXPECT_TRUE(a.prompt_ids.empty());
  EXPECT_FALSE(a.enable_thinking);
  BenchPrompt b = dataset_prompt(items[1], o);
  EXPECT_TRUE(b.messages.is_null());
  EXPECT_EQ(b.text, "one two three");
  BenchPrompt c = dataset_prompt(items[2], o);
  EXPECT_EQ(c.messages, kItems[2]["messages"]);
  EXPECT_EQ(c.enable_thinking, false);
  EXPECT_EQ(c.max_tokens, 3u);
  auto ids_only = parse_dataset("[{\"prompt_ids\": [1, 2]}]", "i.json");
  EXPECT_ERROR_HAS(dataset_prompt(ids_only[0], o), "[0] has neither \"messages\" nor \"prompt\"");
  EXPECT_ERROR_HAS(dataset_prompt(ids_only[0], o), "pass --endpoint completions");
}

TEST(DatasetSelection, FirstNInFileOrderOrShuffledBySeed) {
  json many = json::array();
  for (int i = 0; i < 10; ++i) many.push_back({{"prompt", "p" + std::to_string(i)}});
  auto items = parse_dataset(many.dump(), "d.json");
  BenchOptions o = dataset_options(BenchEndpoint::completions);
  EXPECT_EQ(select_dataset_items(items, o).size(), 10u);  // default: all
  o.num_prompts = 4;
  auto first = select_dataset_items(items, o);
  ASSERT_EQ(first.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(first[i].prompt, "p" + std::to_string(i));
  o.num_prompts = 11;
  EXPECT_ERROR_HAS(select_dataset_items(items, o), "--num-prompts 11 is more than the 10 items of d.json");

  o.num_prompts.reset();
  o.dataset_shuffle = true;
  auto shuffled = select_dataset_items(items, o);
  auto again = select_dataset_items(items, o);
  std::vector<std::string> order, order_again, sorted;
  for (auto& it : shuffled) order.push_back(*it.prompt);
  for (auto& it : again) order_again.push_back(*it.prompt);
  EXPECT_EQ(order, order_again);  // the seed decides
  sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(sorted[i], "p" + std::to_string(i));  // a permutation
  std::vector<std::string> file_order(sorted);
  EXPECT_NE(order, file_order);
  o.seed = 2;
  std::vector<std::string> other;
  for (auto& it : select_dataset_items(items, o)) other.push_back(*it.prompt);
  EXPECT_NE(order, other);
}

TEST(DatasetRefusals, MultiTurnAndMixedLoad) {
  BenchOptions o = dataset_options(BenchEndpoint::completions);
  o.long_input_len = 4096;
  o.long_every = 4;
  EXPECT_ERROR_HAS(run_bench(o, stdout), "--long-input-len / --long-every and --dataset-path do not go together");
  o.long_input_len = o.long_every = 0;
  o.multi_turn = 3;
  EXPECT_ERROR_HAS(run_multi_turn_bench(o, stdout), "--multi-turn and --dataset-path do not go together");
}

// An OpenAI-compatible stub that records every generation request. Tokens are space-separated words. An answer
// is min(max_tokens, 6) tokens, or max_tokens under ignore_eos, streamed two tokens to a chunk (as a server whose
// speculative decoding accepts drafts does), so only usage counts them right. usage leaves prompt_tokens out, so
// input totals are kiln bench's own counts. Each generation adds to the spec counters of /metrics: 4 drafted,
// 3 accepted, 2 verify steps covering 6 tokens (accept length 3).
class StubServer {
 public:
  StubServer() {
    server_.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(R"({"object": "list", "data": [{"id": "stub-model"}]})", "application/json");
    });
    server_.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
      json body = json::parse(req.body);
      res.set_content(json{{"tokens", encode(body["text"].get<std::string>())}}.dump(), "application/json");
    });
    server_.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
      json body = json::parse(req.body);
      res.set_content(json{{"text", decode(body["tokens"].get<std::vector<int64_t>>())}}.dump(), "application/json");
    });
    server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      const int n = generations_.load();
      std::string text = "# TYPE kiln:spec_draft_tokens_total counter\n";
      text += "kiln:spec_draft_tokens_total{model_name=\"stub-model\"} " + std::to_string(4 * n) + "\n";
      text += "kiln:spec_accepted_tokens_total{model_name=\"stub-model\"} " + std::to_string(3 * n) + "\n";
      text += "kiln:spec_accept_length_count{model_name=\"stub-model\"} " + std::to_string(2 * n) + "\n";
      text += "kiln:spec_accept_length_sum{model_name=\"stub-model\"} " + std::to_string(6 * n) + "\n";
      text += "kiln:spec_step_draft_length_count{model_name=\"stub-model\"} " + std::to_string(3 * n) + "\n";
      text += "kiln:spec_step_draft_length_sum{model_name=\"stub-model\"} " + std::to_string(5 * n) + "\n";
      res.set_content(text, "text/plain");
    });
    for (const char* path : {"/v1/completions", "/v1/chat/completions"})
      server_.Post(path, [this](const httplib::Request& req, httplib::Response& res) { generate(req, res); });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ~StubServer() {
    server_.stop();
    thread_.join();
  }
  ServerAddress address() const {
    ServerAddress a;
    a.base_url = "http://127.0.0.1:" + std::to_string(port_);
    a.timeout_s = 10;
    return a;
  }
  std::vector<json> requests() {
    std::lock_guard lock(mutex_);
    return requests_;
  }

 private:
  std::vector<int64_t> encode(const std::string& text) {
    std::lock_guard lock(mutex_);
    std::vector<int64_t> ids;
    std::istringstream in(text);
    for (std::string word; in >> word;) {
      auto it = std::find(words_.begin(), words_.end(), word);
      if (it == words_.end()) it = words_.insert(words_.end(), word);
      ids.push_back(it - words_.begin());
    }
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) {
    std::lock_guard lock(mutex_);
    std::string text;
    for (int64_t id : ids) text += (text.empty() ? "" : " ") + words_.at(static_cast<size_t>(id));
    return text;
  }

  void generate(const httplib::Request& req, httplib::Response& res) {
    json body = json::parse(req.body);
    {
      std::lock_guard lock(mutex_);
      requests_.push_back(body);
    }
    ++generations_;
    const bool chat = body.contains("messages");
    const int max_tokens = body["max_tokens"].get<int>();
    const int n = body.value("ignore_eos", false) ? max_tokens : std::min(max_tokens, 6);
    std::string sse;
    auto event = [&](const json& choice) {
      sse += "data: " + json{{"id", "s"}, {"choices", json::array({choice})}}.dump() + "\n\n";
    };
    for (int i = 0; i < n; i += 2) {
      const std::string text = i + 1 < n ? " w w" : " w";
      event(chat ? json{{"index", 0}, {"delta", {{"content", text}}}} : json{{"index", 0}, {"text", text}});
    }
    event(chat ? json{{"index", 0}, {"delta", json::object()}, {"finish_reason", "stop"}}
               : json{{"index", 0}, {"text", ""}, {"finish_reason", "stop"}});
    sse += "data: " + json{{"id", "s"}, {"choices", json::array()}, {"usage", {{"completion_tokens", n}}}}.dump() +
           "\n\n";
    sse += "data: [DONE]\n\n";
    res.set_content(sse, "text/event-stream");
  }

  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  std::mutex mutex_;
  std::vector<json> requests_;
  std::vector<std::string> words_;
  std::atomic<int> generations_{0};
};

// Runs the benchmark with its report text captured.
BenchReport run_captured(const BenchOptions& options, std::string* text) {
  char* buffer = nullptr;
  size_t size = 0;
  std::FILE* out = open_memstream(&buffer, &size);
  BenchReport report;
  try {
    report = run_bench(options, out);
  } catch (...) {
    std::fclose(out);
    std::free(buffer);
    throw;
  }
  std::fclose(out);
  *text = std::string(buffer, size);
  std::free(buffer);
  return report;
}

// The value of the first report row named `name` (the text after the name and its padding).
std::string row_value(const std::string& text, const std::string& name) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(name, 0) == 0) return line.substr(line.find_first_not_of(' ', name.size()));
  return "(no row " + name + ")";
}

TEST(DatasetRun, CompletionsNaturalLengthsGreedyUsageCounts) {
  StubServer stub;
  TempDir dir;
  BenchOptions o = dataset_options(BenchEndpoint::completions, dir.write("eval.json", json{{"items", kItems}}.dump()));
  o.server = stub.address();
  o.progress = false;
  o.max_concurrency = {1, 2};
  std::string text;
  BenchReport report = run_captured(o, &text);
  ASSERT_TRUE(report.passed) << report.failure << "\n" << text;

  // The warm-up (the first item, at most 16 tokens), then the three items at each of the two levels.
  auto requests = stub.requests();
  ASSERT_EQ(requests.size(), 7u);
  EXPECT_EQ(requests[0]["prompt"], json({5, 6, 7, 8}));
  EXPECT_EQ(requests[0]["max_tokens"], 16);
  for (const auto& r : requests) {
    EXPECT_FALSE(r.contains("ignore_eos")) << r.dump();
    EXPECT_EQ(r["temperature"], 0.0);
    EXPECT_EQ(r["stream"], true);
    EXPECT_EQ(r["model"], "stub-model");
  }
  // Each level sends the three items (in any order): prompt -> max_tokens.
  const std::map<std::string, int> expected = {
      {json({5, 6, 7, 8}).dump(), 64}, {json("one two three").dump(), 64}, {json("four five").dump(), 3}};
  for (size_t level = 0; level < 2; ++level) {
    std::map<std::string, int> sent;
    for (size_t i = 1 + 3 * level; i < 4 + 3 * level; ++i)
      sent[requests[i]["prompt"].dump()] = requests[i]["max_tokens"].get<int>();
    EXPECT_EQ(sent, expected) << "level " << level;
  }

  ASSERT_EQ(report.levels.size(), 2u);
  for (const auto& level : report.levels) {
    EXPECT_EQ(level.num_prompts, 3u);
    EXPECT_EQ(level.metrics.completed, 3u);
    EXPECT_EQ(level.metrics.total_output_tokens, 6 + 6 + 3);  // usage; the chunks would say 3 + 3 + 2
    EXPECT_EQ(level.metrics.output_tokens_from_usage, 3u);
    EXPECT_EQ(level.metrics.total_input_tokens, 4 + 3 + 2);  // prompt_ids' length + the words of the two texts
    EXPECT_EQ(level.short_outputs, 0u);
  }
  EXPECT_NE(text.find("dataset " + o.dataset_path + ": 3 prompts, natural output lengths (at most 64 tokens), greedy"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("input tokens counted by the length of prompt_ids and the server's /tokenize"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("ignore_eos"), std::string::npos) << text;  // no "fewer tokens than" note
  EXPECT_EQ(row_value(text, "Mean output tokens per request:"), "5.0") << text;  // (6 + 6 + 3) / 3
  // The accept length from the server's /metrics, per level: 3 requests x (6 tokens / 2 verify steps).
  EXPECT_EQ(row_value(text, "Mean accept length (spec):"),
            "3.00 (6 verify steps; 9 of 12 draft tokens accepted, 75.0%; server /metrics)")
      << text;
  // The draft length the server chose per step: 3 requests x (5 drafts over 3 steps).
  EXPECT_EQ(row_value(text, "Mean draft length per step (spec):"), "1.67 (9 steps with decoding sequences)") << text;
  EXPECT_NE(text.find("Summary: completions endpoint, dataset " + o.dataset_path + " (3 prompts)"), std::string::npos)
      << text;

  const json j = report.to_json();
  EXPECT_EQ(j["mode"], "dataset");
  EXPECT_EQ(j["dataset"]["path"], o.dataset_path);
  EXPECT_EQ(j["dataset"]["num_prompts"], 3);
  EXPECT_EQ(j["dataset"]["shuffled"], false);
  EXPECT_EQ(j["ignore_eos"], false);
  EXPECT_EQ(j["temperature"], 0.0);
  EXPECT_TRUE(j["input_len"].is_null());
  EXPECT_EQ(j["levels"][0]["total_output_tokens"], 15);
  EXPECT_EQ(j["levels"][0]["output_tokens_counted_from"], "usage");
}

TEST(DatasetRun, ChatMessagesTemperatureAndNumPrompts) {
  StubServer stub;
  TempDir dir;
  std::string jsonl;
  for (const auto& item : kItems) jsonl += item.dump() + "\n";
  BenchOptions o = dataset_options(BenchEndpoint::chat, dir.write("eval.jsonl", jsonl));
  o.server = stub.address();
  o.progress = false;
  o.max_concurrency = {1};
  o.num_prompts = 2;  // the first two items
  o.temperature = 0.5;
  std::string text;
  BenchReport report = run_captured(o, &text);
  ASSERT_TRUE(report.passed) << report.failure << "\n" << text;
  auto requests = stub.requests();
  ASSERT_EQ(requests.size(), 3u);  // the warm-up + 2
  for (const auto& r : requests) {
    EXPECT_FALSE(r.contains("ignore_eos")) << r.dump();
    EXPECT_EQ(r["temperature"], 0.5);
    EXPECT_FALSE(r.contains("chat_template_kwargs")) << r.dump();  // neither item says enable_thinking
  }
  EXPECT_EQ(requests[0]["messages"], kItems[0]["messages"]);
  std::set<std::string> sent = {requests[1]["messages"].dump(), requests[2]["messages"].dump()};
  EXPECT_EQ(sent, (std::set<std::string>{json::parse(R"([{"role": "user", "content": "hi"}])").dump(),
                                         json::parse(R"([{"role": "user", "content": "one two three"}])").dump()}));
  EXPECT_EQ(report.levels.at(0).metrics.total_input_tokens, 1 + 3);  // the message contents' words
  EXPECT_NE(text.find("2 prompts, natural output lengths (at most 64 tokens), temperature 0.5"), std::string::npos)
      << text;

  // The third item sends its messages with enable_thinking, and its own max_tokens.
  o.num_prompts.reset();
  report = run_captured(o, &text);
  ASSERT_TRUE(report.passed) << report.failure;
  bool seen = false;
  for (const auto& r : stub.requests())
    if (r["messages"] == kItems[2]["messages"]) {
      seen = true;
      EXPECT_EQ(r["chat_template_kwargs"], json({{"enable_thinking", false}}));
      EXPECT_EQ(r["max_tokens"], 3);
    }
  EXPECT_TRUE(seen);
}

TEST(DatasetRun, UnusableItemOrTooManyPromptsFailBeforeAnyRequest) {
  StubServer stub;
  TempDir dir;
  BenchOptions o = dataset_options(BenchEndpoint::chat, dir.write("ids.json", R"([{"prompt_ids": [1, 2, 3]}])"));
  o.server = stub.address();
  o.progress = false;
  std::string text;
  EXPECT_ERROR_HAS(run_captured(o, &text), "ids.json: [0] has neither \"messages\" nor \"prompt\"");
  o.endpoint = BenchEndpoint::completions;
  o.num_prompts = 5;
  EXPECT_ERROR_HAS(run_captured(o, &text), "--num-prompts 5 is more than the 1 items of");
  EXPECT_TRUE(stub.requests().empty());
  // The file is read before the server is asked anything: its error comes first even with no server.
  o.server.base_url = "http://127.0.0.1:1";
  o.dataset_path = dir.write("empty.json", "\n");
  EXPECT_ERROR_HAS(run_captured(o, &text), "empty.json is empty");
}

// Random prompts keep ignore_eos and exact lengths.
TEST(RandomRun, StillIgnoreEosWithExactLengths) {
  StubServer stub;
  BenchOptions o;
  o.server = stub.address();
  o.progress = false;
  o.input_len = 12;
  o.output_len = 9;
  o.num_prompts = 3;
  o.max_concurrency = {2};
  std::string text;
  BenchReport report = run_captured(o, &text);
  ASSERT_TRUE(report.passed) << report.failure << "\n" << text;
  auto requests = stub.requests();
  ASSERT_EQ(requests.size(), 4u);
  for (const auto& r : requests) {
    EXPECT_EQ(r["ignore_eos"], true);
    EXPECT_TRUE(r["prompt"].is_string());
  }
  EXPECT_EQ(report.levels.at(0).metrics.total_output_tokens, 3 * 9);
  EXPECT_EQ(report.levels.at(0).metrics.total_input_tokens, 3 * 12);
  EXPECT_NE(text.find("random prompts of exactly 12 tokens"), std::string::npos) << text;
  EXPECT_EQ(report.to_json()["mode"], "random");
}

}  // namespace
}  // namespace kiln::clients
