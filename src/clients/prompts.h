// Random benchmark prompts of an exact token length (the "random" dataset of sglang.bench_serving /
// vllm bench serve), counted by the server's own tokenizer (POST /tokenize + /detokenize) or by
// kiln's tokenizer reading the model's tokenizer.json (--tokenizer DIR).
#pragma once
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "clients/http.h"

namespace kiln::clients {

class TokenCounter {
 public:
  virtual ~TokenCounter() = default;
  // Tokens of a raw prompt, without special tokens a server would add (BOS).
  virtual std::vector<int64_t> tokenize(const std::string& text) = 0;
  virtual std::string detokenize(const std::vector<int64_t>& ids) = 0;
  virtual std::string describe() const = 0;  // "server /tokenize", "tokenizer.json in DIR"
};

// The server's tokenizer: POST /tokenize (else /v1/tokenize) and the matching /detokenize. The body
// carries the text as "text" (kiln), "prompt" (SGLang, vLLM) and "content" (llama-server); the answer's
// "tokens" is read, and the text back from "text", "prompt" or "content". Throws kiln::Error when
// the server has neither endpoint (and says to pass --tokenizer).
std::unique_ptr<TokenCounter> make_server_token_counter(const ServerAddress& address, const std::string& model);
// kiln's tokenizer on DIR/tokenizer.json (kiln::tok::Tokenizer::load_dir).
std::unique_ptr<TokenCounter> make_local_token_counter(const std::string& tokenizer_dir);

// n_words random common English words separated by spaces.
std::string random_words(std::mt19937_64& rng, size_t n_words);

// Random words whose tokenization is exactly n_tokens long, also after a detokenize/tokenize round
// trip. Throws kiln::Error if that cannot be reached.
std::string prompt_of_exact_length(TokenCounter& counter, size_t n_tokens, std::mt19937_64& rng);

}  // namespace kiln::clients
