// Stop strings over streamed text: the text is cut before the first stop string, and text that could
// still become a stop string is held back, so a stream never shows part of one.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace kiln::server {

class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops);

  struct Result {
    std::string text;     // safe to show
    bool stopped = false;  // a stop string matched: `text` ends right before it; ignore later input
    std::string matched;
  };
  Result push(std::string_view text);
  // End of stream without a match: the held-back text.
  std::string flush();
  bool stopped() const { return stopped_; }
  bool empty() const { return stops_.empty(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace kiln::server
