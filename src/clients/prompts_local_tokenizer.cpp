// TokenCounter over kiln's own tokenizer (a model folder's tokenizer.json), for servers without /tokenize.
#include <vector>

#include "clients/prompts.h"
#include "tokenizer/tokenizer.h"

namespace kiln::clients {

namespace {

class LocalTokenCounter final : public TokenCounter {
 public:
  explicit LocalTokenCounter(const std::string& dir) : dir_(dir), tokenizer_(tok::Tokenizer::load_dir(dir)) {}

  std::vector<int64_t> tokenize(const std::string& text) override {
    auto ids = tokenizer_->encode(text, /*parse_special=*/false);
    return {ids.begin(), ids.end()};
  }

  std::string detokenize(const std::vector<int64_t>& ids) override {
    std::vector<int32_t> narrow(ids.begin(), ids.end());
    return tokenizer_->decode(narrow, /*skip_special=*/false);
  }

  std::string describe() const override { return "the tokenizer in " + dir_; }

 private:
  std::string dir_;
  std::unique_ptr<tok::Tokenizer> tokenizer_;
};

}  // namespace

std::unique_ptr<TokenCounter> make_local_token_counter(const std::string& tokenizer_dir) {
  return std::make_unique<LocalTokenCounter>(tokenizer_dir);
}

}  // namespace kiln::clients
