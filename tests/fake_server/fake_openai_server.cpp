// A deliberately broken OpenAI-compatible server for testing `kiln smoke` and `kiln bench`.
//
//   kiln-fake-openai-server --mode MODE [--port 0] [--first-token-delay-ms MS] [--token-delay-ms MS]
//                           [--no-usage] [--no-tokenize] [--fail-every N] [--context-length N]
//
// Prints "PORT <n>" on its first stdout line once listening (--port 0 picks a free port).
// Modes:
//   good              right answers: "OK"; 323 without reasoning when thinking is off; reasoning + 323
//                     when thinking is on (the default, as Qwen3.5); streams what it answers unstreamed;
//                     deterministic
//   garbage           "!!!!!!" and NUL bytes
//   leak              thinking mode: the reasoning, wrapped in <think> tags, sits in content
//   repeat            long outputs (the math reasoning, paragraphs, stories) loop one word
//   no-reasoning      thinking mode answers without reasoning
//   wrong             324 instead of 323
//   nondeterministic  long outputs and reasoning differ from request to request
// Options: --no-usage leaves usage out of streams; --no-tokenize has no /tokenize; --fail-every N
// answers every Nth generation request with HTTP 500; --context-length N rejects prompt + max_tokens
// above N with HTTP 400 (as vLLM and SGLang do).
//
// Tokens are words (a leading space + letters/digits) or single other characters; /tokenize and
// usage count them the same way, so prompt lengths can be checked exactly.
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

using nlohmann::json;

namespace {

struct Config {
  std::string mode = "good";
  int port = 0;
  int first_token_delay_ms = 0;
  int token_delay_ms = 0;
  bool usage = true;
  bool tokenize = true;
  int fail_every = 0;
  int context_length = 0;  // 0: no limit
};

Config g_config;
std::atomic<long> g_generation_requests{0};
const char* kModelName = "fake-model";

const char* kWords[] = {"amber",  "basalt", "cedar",  "delta",  "ember",  "fjord",  "granite", "harbor", "indigo",
                        "juniper", "kelp",  "lagoon", "meadow", "nectar", "orchid", "pebble",  "quartz", "reef",
                        "saffron", "tide",  "umber",  "violet", "willow", "xenon",  "yarrow",  "zephyr", "anchor",
                        "beacon", "cliff",  "dune",   "estuary", "ferry", "gull",   "heron",   "inlet",  "jetty",
                        "keel",   "lantern", "mast",  "north",  "oar",    "pier",   "quay",    "rope",   "sail",
                        "tern",   "under",  "vessel", "wave",   "yonder"};

// Tokens: a word with at most one leading space, or one other byte.
std::vector<std::string> split_tokens(const std::string& text) {
  std::vector<std::string> tokens;
  auto is_word = [](unsigned char c) { return std::isalnum(c) != 0; };
  size_t i = 0;
  while (i < text.size()) {
    size_t start = i;
    if (text[i] == ' ' && i + 1 < text.size() && is_word(text[i + 1])) ++i;
    if (is_word(text[i])) {
      while (i < text.size() && is_word(text[i])) ++i;
    } else {
      ++i;
    }
    tokens.push_back(text.substr(start, i - start));
  }
  return tokens;
}

class Vocabulary {
 public:
  std::vector<int64_t> encode(const std::string& text) {
    std::lock_guard lock(mutex_);
    std::vector<int64_t> ids;
    for (auto& piece : split_tokens(text)) {
      auto [it, inserted] = ids_.try_emplace(piece, static_cast<int64_t>(pieces_.size()));
      if (inserted) pieces_.push_back(piece);
      ids.push_back(it->second);
    }
    return ids;
  }
  bool decode(const std::vector<int64_t>& ids, std::string* out) {
    std::lock_guard lock(mutex_);
    for (int64_t id : ids) {
      if (id < 0 || id >= static_cast<int64_t>(pieces_.size())) return false;
      *out += pieces_[id];
    }
    return true;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<std::string> pieces_;
};
Vocabulary g_vocab;

std::string random_words(std::mt19937& rng, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (i) out += ' ';
    out += kWords[rng() % std::size(kWords)];
  }
  return out;
}

std::string repeated(const std::string& word, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += (i ? " " : "") + word;
  return out;
}

std::string nondeterministic_word() {
  static std::random_device device;
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  return std::string(kWords[device() % std::size(kWords)]) + std::to_string(device() % 1000);
}

struct Answer {
  std::string reasoning;
  std::string content;
  std::string finish_reason = "stop";
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  std::vector<std::pair<bool, std::string>> tokens;  // (is_reasoning, text) in streaming order
};

const char* kParagraph =
    "The number zero has a long history. Babylonian scribes used a placeholder sign in their positional "
    "numbers, and Maya astronomers wrote a shell glyph for an empty place. Indian mathematicians such as "
    "Brahmagupta in the seventh century treated zero as a number with its own rules for addition and "
    "subtraction. Through Arabic scholars the idea reached Europe, where Fibonacci promoted the new numerals "
    "in 1202. Today zero underlies algebra, calculus and the binary arithmetic of every computer.";

Answer make_answer(const std::string& prompt, bool thinking, int max_tokens, bool ignore_eos) {
  const std::string& mode = g_config.mode;
  Answer a;
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>{}(prompt)));
  bool is_long = false;
  if (prompt.find("Reply with just OK") != std::string::npos) {
    a.reasoning = "The user asks me to reply with just OK, so the answer is OK.";
    a.content = "OK";
  } else if (prompt.find("17 x 19") != std::string::npos) {
    a.reasoning = "17 x 19 = 17 x 20 - 17 = 340 - 17 = 323. Let me double-check: 19 x 17 = 190 + 133 = 323.";
    a.content = "17 x 19 = 323.";
    if (mode == "repeat") a.reasoning = "Let me compute. " + repeated("wait", 60);
  } else if (prompt.find("history of the number zero") != std::string::npos) {
    a.reasoning = "The user wants one paragraph about the history of zero.";
    a.content = kParagraph;
    is_long = true;
  } else {
    a.reasoning = "The user wants a long text.";
    a.content = "Once upon a time " + random_words(rng, 24);
    is_long = true;
  }
  // ignore_eos: keep generating after the natural end, as real servers do.
  if (ignore_eos) {
    size_t have = split_tokens(a.content).size() + (thinking ? split_tokens(a.reasoning).size() : 0);
    if (static_cast<size_t>(max_tokens) > have) a.content += " " + random_words(rng, max_tokens - have);
  }
  if (mode == "repeat" && is_long) a.content = repeated("zero", std::max(60, max_tokens));
  if (mode == "nondeterministic") {
    if (is_long) a.content = nondeterministic_word() + " " + a.content;
    a.reasoning = nondeterministic_word() + " " + a.reasoning;
  }
  if (mode == "wrong") {
    for (std::string* s : {&a.reasoning, &a.content})
      for (size_t at = s->find("323"); at != std::string::npos; at = s->find("323", at)) s->replace(at, 3, "324");
  }
  if (mode == "garbage") {
    a.content = std::string("!!!!!!") + std::string(3, '\0') + "!!!!!!";
    if (ignore_eos) a.content = std::string(max_tokens, '!');
    a.reasoning = std::string(4, '\0');
  }
  if (!thinking || mode == "no-reasoning") a.reasoning.clear();
  if (mode == "leak" && thinking) {
    a.content = "<think>\n" + a.reasoning + "\n</think>\n\n" + a.content;
    a.reasoning.clear();
  }

  for (auto& t : split_tokens(a.reasoning)) a.tokens.emplace_back(true, t);
  for (auto& t : split_tokens(a.content)) a.tokens.emplace_back(false, t);
  if (static_cast<int>(a.tokens.size()) > max_tokens) {
    a.tokens.resize(std::max(max_tokens, 0));
    a.finish_reason = "length";
    a.reasoning.clear();
    a.content.clear();
    for (auto& [is_reasoning, text] : a.tokens) (is_reasoning ? a.reasoning : a.content) += text;
  }
  a.completion_tokens = static_cast<int64_t>(a.tokens.size());
  a.prompt_tokens = static_cast<int64_t>(g_vocab.encode(prompt).size());
  return a;
}

void send_error(httplib::Response& res, int status, const std::string& message) {
  json body = {{"error", {{"message", message}, {"type", "invalid_request_error"}, {"code", status}}}};
  res.status = status;
  res.set_content(body.dump(), "application/json");
}

void sleep_ms(int ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

void handle_generation(const httplib::Request& req, httplib::Response& res, bool chat) {
  json body = json::parse(req.body, nullptr, false);
  if (!body.is_object()) return send_error(res, 400, "body is not JSON");
  if (g_config.fail_every > 0 && ++g_generation_requests % g_config.fail_every == 0)
    return send_error(res, 500, "fake server: injected failure (--fail-every)");
  if (body.value("model", "") != kModelName)
    return send_error(res, 404, "The model `" + body.value("model", "") + "` does not exist.");
  std::string prompt;
  bool thinking = false;
  if (chat) {
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
      return send_error(res, 400, "messages is required");
    prompt = body["messages"].back().value("content", "");
    thinking = true;  // Qwen3.5 thinks unless told not to
    if (body.contains("chat_template_kwargs") && body["chat_template_kwargs"].contains("enable_thinking"))
      thinking = body["chat_template_kwargs"]["enable_thinking"].get<bool>();
  } else {
    prompt = body.value("prompt", "");
  }
  const int max_tokens = body.value("max_tokens", 256);
  const bool ignore_eos = body.value("ignore_eos", false);
  const bool stream = body.value("stream", false);
  const bool include_usage =
      g_config.usage && body.contains("stream_options") && body["stream_options"].value("include_usage", false);
  if (g_config.context_length > 0) {
    auto prompt_tokens = static_cast<int>(g_vocab.encode(prompt).size());
    if (prompt_tokens + max_tokens > g_config.context_length)
      return send_error(res, 400, "This model's maximum context length is " + std::to_string(g_config.context_length) +
                                      " tokens. However, you requested " + std::to_string(prompt_tokens + max_tokens) +
                                      " tokens.");
  }
  auto answer = std::make_shared<Answer>(make_answer(prompt, thinking, max_tokens, ignore_eos));
  json usage = {{"prompt_tokens", answer->prompt_tokens},
                {"completion_tokens", answer->completion_tokens},
                {"total_tokens", answer->prompt_tokens + answer->completion_tokens}};
  auto null_if_empty = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };

  if (!stream) {
    sleep_ms(g_config.first_token_delay_ms + g_config.token_delay_ms * static_cast<int>(answer->tokens.size()));
    json choice = {{"index", 0}, {"finish_reason", answer->finish_reason}};
    if (chat)
      choice["message"] = {{"role", "assistant"},
                           {"content", answer->content},
                           {"reasoning_content", null_if_empty(answer->reasoning)}};
    else
      choice["text"] = answer->content;
    json out = {{"id", "fake-1"}, {"object", chat ? "chat.completion" : "text_completion"}, {"model", kModelName},
                {"choices", json::array({choice})}};
    if (g_config.usage) out["usage"] = usage;
    res.set_content(out.dump(), "application/json");
    return;
  }

  res.set_chunked_content_provider(
      "text/event-stream", [answer, chat, include_usage, usage](size_t, httplib::DataSink& sink) {
        std::mt19937 split_rng(7);
        // Each event goes out in two writes split at a random byte: clients must reassemble.
        auto send_event = [&](const json& chunk) {
          std::string event = "data: " + chunk.dump() + "\n\n";
          size_t cut = 1 + split_rng() % (event.size() - 1);
          return sink.write(event.data(), cut) && sink.write(event.data() + cut, event.size() - cut);
        };
        auto chunk_of = [&](json choice) {
          return json{{"id", "fake-1"}, {"object", chat ? "chat.completion.chunk" : "text_completion"},
                      {"model", kModelName}, {"choices", json::array({choice})}};
        };
        if (chat && !send_event(chunk_of({{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}})))
          return false;
        sleep_ms(g_config.first_token_delay_ms);
        for (size_t i = 0; i < answer->tokens.size(); ++i) {
          if (i) sleep_ms(g_config.token_delay_ms);
          const auto& [is_reasoning, text] = answer->tokens[i];
          json choice = {{"index", 0}, {"finish_reason", nullptr}};
          if (chat)
            choice["delta"] = {{is_reasoning ? "reasoning_content" : "content", text}};
          else
            choice["text"] = text;
          if (!send_event(chunk_of(choice))) return false;
        }
        json last = {{"index", 0}, {"finish_reason", answer->finish_reason}};
        if (chat) last["delta"] = json::object();
        else last["text"] = "";
        if (!send_event(chunk_of(last))) return false;
        if (include_usage) {
          json usage_chunk = {{"id", "fake-1"}, {"model", kModelName}, {"choices", json::array()}, {"usage", usage}};
          if (!send_event(usage_chunk)) return false;
        }
        std::string done = "data: [DONE]\n\n";
        sink.write(done.data(), done.size());
        sink.done();
        return true;
      });
}

int parse_int(const char* flag, const char* value) {
  char* end = nullptr;
  long v = std::strtol(value, &end, 10);
  if (!*value || *end || v < 0) {
    std::fprintf(stderr, "fake server: %s needs a non-negative integer, got '%s'\n", flag, value);
    std::exit(2);
  }
  return static_cast<int>(v);
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fake server: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--mode") g_config.mode = value();
    else if (arg == "--port") g_config.port = parse_int("--port", value());
    else if (arg == "--first-token-delay-ms") g_config.first_token_delay_ms = parse_int("--first-token-delay-ms", value());
    else if (arg == "--token-delay-ms") g_config.token_delay_ms = parse_int("--token-delay-ms", value());
    else if (arg == "--fail-every") g_config.fail_every = parse_int("--fail-every", value());
    else if (arg == "--context-length") g_config.context_length = parse_int("--context-length", value());
    else if (arg == "--no-usage") g_config.usage = false;
    else if (arg == "--no-tokenize") g_config.tokenize = false;
    else {
      std::fprintf(stderr, "fake server: unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  static const char* kModes[] = {"good", "garbage", "leak", "repeat", "no-reasoning", "wrong", "nondeterministic"};
  if (std::find(std::begin(kModes), std::end(kModes), g_config.mode) == std::end(kModes)) {
    std::fprintf(stderr, "fake server: unknown --mode %s\n", g_config.mode.c_str());
    return 2;
  }

  httplib::Server server;
  server.new_task_queue = [] { return new httplib::ThreadPool(64); };
  server.set_tcp_nodelay(true);
  server.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  server.Get("/get_model_info", [](const httplib::Request&, httplib::Response& res) {
    json info = {{"model_path", "fake/kiln-fake-model"}, {"tokenizer_path", "fake/kiln-fake-model"},
                 {"is_generation", true}, {"model_type", "fake"}, {"architectures", {"FakeForCausalLM"}}};
    res.set_content(info.dump(), "application/json");
  });
  server.Get("/v1/models", [](const httplib::Request&, httplib::Response& res) {
    json models = {{"object", "list"}, {"data", {{{"id", kModelName}, {"object", "model"}, {"owned_by", "kiln-tests"}}}}};
    res.set_content(models.dump(), "application/json");
  });
  server.Post("/v1/chat/completions",
              [](const httplib::Request& req, httplib::Response& res) { handle_generation(req, res, true); });
  server.Post("/v1/completions",
              [](const httplib::Request& req, httplib::Response& res) { handle_generation(req, res, false); });
  if (g_config.tokenize) {
    server.Post("/tokenize", [](const httplib::Request& req, httplib::Response& res) {
      json body = json::parse(req.body, nullptr, false);
      if (!body.is_object() || !body.contains("text") || !body["text"].is_string())
        return send_error(res, 400, "text is required");
      res.set_content(json{{"tokens", g_vocab.encode(body["text"].get<std::string>())}}.dump(), "application/json");
    });
    server.Post("/detokenize", [](const httplib::Request& req, httplib::Response& res) {
      json body = json::parse(req.body, nullptr, false);
      std::string text;
      if (!body.is_object() || !body.contains("tokens") || !g_vocab.decode(body["tokens"].get<std::vector<int64_t>>(), &text))
        return send_error(res, 400, "tokens must be known token ids");
      res.set_content(json{{"text", text}}.dump(), "application/json");
    });
  }

  int port = g_config.port == 0 ? server.bind_to_any_port("127.0.0.1") : (server.bind_to_port("127.0.0.1", g_config.port) ? g_config.port : -1);
  if (port <= 0) {
    std::fprintf(stderr, "fake server: cannot listen on 127.0.0.1:%d\n", g_config.port);
    return 1;
  }
  std::printf("PORT %d\n", port);
  std::fflush(stdout);
  return server.listen_after_bind() ? 0 : 1;
}
