#include "server/text_util.h"

namespace kiln::server {

std::string_view lstrip(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && is_space(s[i])) ++i;
  return s.substr(i);
}

std::string_view rstrip(std::string_view s) {
  size_t n = s.size();
  while (n > 0 && is_space(s[n - 1])) --n;
  return s.substr(0, n);
}

std::string_view strip(std::string_view s) { return rstrip(lstrip(s)); }

size_t partial_suffix(std::string_view text, std::string_view tag) {
  size_t max = std::min(text.size(), tag.size() - 1);
  for (size_t k = max; k > 0; --k)
    if (text.substr(text.size() - k) == tag.substr(0, k)) return k;
  return 0;
}

size_t partial_suffix_any(std::string_view text, const std::vector<std::string>& tags) {
  size_t best = 0;
  for (const auto& t : tags) best = std::max(best, partial_suffix(text, t));
  return best;
}

std::string WhitespaceTrimmer::push(std::string_view text) {
  if (drop_leading_) {
    text = lstrip(text);
    if (text.empty()) return {};
    drop_leading_ = false;
  }
  if (text.empty()) return {};
  std::string_view body = rstrip(text);
  if (body.empty()) {  // all whitespace: hold it
    pending_.append(text);
    return {};
  }
  std::string out = std::move(pending_);
  out.append(body);
  pending_.assign(text.substr(body.size()));
  started_ = true;
  return out;
}

std::string WhitespaceTrimmer::flush() {
  std::string out = std::move(pending_);
  pending_.clear();
  return out;
}

}  // namespace kiln::server
