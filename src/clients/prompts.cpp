#include "clients/prompts.h"

#include <iterator>

#include "core/error.h"

namespace kiln::clients {

namespace {

// Common English words: each is usually one token (with its leading space) in BPE vocabularies, and
// random sequences of them tokenize stably.
constexpr const char* kWords[] = {
    "time",    "year",    "people",  "way",     "day",     "man",     "thing",   "woman",   "life",    "child",
    "world",   "school",  "state",   "family",  "student", "group",   "country", "problem", "hand",    "part",
    "place",   "case",    "week",    "company", "system",  "program", "question", "work",   "number",  "night",
    "point",   "home",    "water",   "room",    "mother",  "area",    "money",   "story",   "fact",    "month",
    "lot",     "right",   "study",   "book",    "eye",     "job",     "word",    "business", "issue",  "side",
    "kind",    "head",    "house",   "service", "friend",  "father",  "power",   "hour",    "game",    "line",
    "end",     "member",  "law",     "car",     "city",    "name",    "team",    "minute",  "idea",    "kid",
    "body",    "back",    "parent",  "face",    "others",  "level",   "office",  "door",    "health",  "person",
    "art",     "war",     "history", "party",   "result",  "change",  "morning", "reason",  "research", "girl",
    "guy",     "moment",  "air",     "teacher", "force",   "order",   "open",    "green",   "small",   "large",
    "river",   "stone",   "light",   "music",   "paper",   "market",  "garden",  "window",  "summer",  "winter",
    "bridge",  "forest",  "island",  "letter",  "table",   "chair",   "train",   "road",    "field",   "animal",
    "make",    "take",    "find",    "give",    "tell",    "work",    "call",    "try",     "ask",     "need",
    "feel",    "become",  "leave",   "put",     "mean",    "keep",    "let",     "begin",   "seem",    "help",
    "talk",    "turn",    "start",   "show",    "hear",    "play",    "run",     "move",    "like",    "live",
    "believe", "hold",    "bring",   "happen",  "write",   "provide", "sit",     "stand",   "lose",    "pay",
    "meet",    "include", "continue", "set",    "learn",   "lead",    "read",    "grow",    "walk",    "win",
    "good",    "new",     "first",   "last",    "long",    "great",   "little",  "own",     "other",   "old",
    "big",     "high",    "different", "early", "young",   "important", "few",   "public",  "bad",     "same",
    "able",    "quiet",   "bright",  "cold",    "warm",    "simple",  "strong",  "clear",   "free",    "full"};

std::vector<int64_t> parse_token_ids(const nlohmann::json& tokens) {
  std::vector<int64_t> ids;
  for (const auto& t : tokens) {
    if (t.is_number_integer()) ids.push_back(t.get<int64_t>());
    else if (t.is_object() && t.contains("id") && t["id"].is_number_integer()) ids.push_back(t["id"].get<int64_t>());
    else fail("the server's /tokenize answer holds a token that is not an integer id: {}", t.dump());
  }
  return ids;
}

class ServerTokenCounter final : public TokenCounter {
 public:
  ServerTokenCounter(const ServerAddress& address, std::string model) : client_(address), model_(std::move(model)) {
    std::string last_failure;
    for (const char* prefix : {"", "/v1"}) {
      HttpResponse response = client_.post_json(std::string(prefix) + "/tokenize", tokenize_body("hello world"));
      if (response.ok()) {
        prefix_ = prefix;
        return;
      }
      last_failure = response.describe_failure();
      if (!response.transport_error.empty()) break;
    }
    fail("the server at {} cannot tokenize (POST /tokenize and /v1/tokenize: {}), so prompt tokens cannot be "
         "counted: pass --tokenizer DIR (a folder with the model's tokenizer.json)",
         address.display(), last_failure);
  }

  std::vector<int64_t> tokenize(const std::string& text) override {
    HttpResponse response = client_.post_json(prefix_ + "/tokenize", tokenize_body(text));
    if (!response.ok()) fail("POST {}/tokenize failed: {}", prefix_, response.describe_failure());
    auto root = nlohmann::json::parse(response.body, nullptr, false);
    if (!root.is_object() || !root.contains("tokens") || !root["tokens"].is_array())
      fail("POST {}/tokenize: expected {{\"tokens\": [...]}} but got: {}", prefix_, response.body.substr(0, 200));
    return parse_token_ids(root["tokens"]);
  }

  std::string detokenize(const std::vector<int64_t>& ids) override {
    HttpResponse response =
        client_.post_json(prefix_ + "/detokenize", {{"model", model_}, {"tokens", ids}});
    if (!response.ok()) fail("POST {}/detokenize failed: {}", prefix_, response.describe_failure());
    auto root = nlohmann::json::parse(response.body, nullptr, false);
    if (root.is_object())
      for (const char* field : {"text", "prompt", "content"})
        if (root.contains(field) && root[field].is_string()) return root[field].get<std::string>();
    fail("POST {}/detokenize: expected {{\"text\": ...}} but got: {}", prefix_, response.body.substr(0, 200));
  }

  std::string describe() const override { return "the server's " + prefix_ + "/tokenize"; }

 private:
  nlohmann::json tokenize_body(const std::string& text) const {
    return {{"model", model_}, {"text", text}, {"prompt", text}, {"content", text}, {"add_special_tokens", false}};
  }

  HttpClient client_;
  std::string model_;
  std::string prefix_;
};

}  // namespace

std::unique_ptr<TokenCounter> make_server_token_counter(const ServerAddress& address, const std::string& model) {
  return std::make_unique<ServerTokenCounter>(address, model);
}

std::string random_words(std::mt19937_64& rng, size_t n_words) {
  std::uniform_int_distribution<size_t> pick(0, std::size(kWords) - 1);
  std::string text;
  for (size_t i = 0; i < n_words; ++i) {
    if (i) text += ' ';
    text += kWords[pick(rng)];
  }
  return text;
}

std::string prompt_of_exact_length(TokenCounter& counter, size_t n_tokens, std::mt19937_64& rng) {
  if (n_tokens == 0) fail("--input-len must be at least 1");
  std::vector<int64_t> ids = counter.tokenize(random_words(rng, n_tokens + 8));
  constexpr int kAttempts = 40;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    if (ids.size() < n_tokens) {
      const size_t n_words = n_tokens - ids.size() + 4;
      auto more = counter.tokenize(ids.empty() ? random_words(rng, n_words) : " " + random_words(rng, n_words));
      if (more.empty()) fail("{} returned no tokens for plain English words", counter.describe());
      ids.insert(ids.end(), more.begin(), more.end());
      continue;
    }
    ids.resize(n_tokens);
    std::string text = counter.detokenize(ids);
    std::vector<int64_t> again = counter.tokenize(text);
    if (again.size() == n_tokens) return text;
    ids = std::move(again);
    // Merges across the cut can make the count oscillate: after a few tries, re-grow from a shorter prefix.
    if (ids.size() > n_tokens && attempt >= 4) ids.resize(n_tokens - std::min<size_t>(n_tokens, 1 + attempt % 4));
  }
  fail("could not build a prompt of exactly {} tokens with {} after {} attempts (does it tokenize and detokenize "
       "consistently?)",
       n_tokens, counter.describe(), kAttempts);
}

}  // namespace kiln::clients
