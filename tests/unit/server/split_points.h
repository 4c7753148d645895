// Test helper of the incremental text parsers: every way to cut a text in two, plus random many-piece
// cuts. A parser fed any of them must give the result it gives for the whole text.
#pragma once
#include <random>
#include <string>
#include <vector>

namespace kiln::server {

inline std::vector<std::vector<std::string>> splits_of(const std::string& text) {
  std::vector<std::vector<std::string>> out;
  out.push_back({text});
  for (size_t i = 0; i <= text.size(); ++i) out.push_back({text.substr(0, i), text.substr(i)});
  std::mt19937 rng(1234);
  for (int r = 0; r < 30; ++r) {
    std::vector<std::string> pieces;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t n = 1 + rng() % 4;
      pieces.push_back(text.substr(pos, n));
      pos += n;
    }
    out.push_back(pieces);
  }
  // One byte at a time.
  std::vector<std::string> bytes;
  for (char c : text) bytes.push_back(std::string(1, c));
  out.push_back(bytes);
  return out;
}

}  // namespace kiln::server
