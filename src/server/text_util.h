// Small string helpers shared by the incremental text parsers.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace kiln::server {

inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
std::string_view lstrip(std::string_view s);
std::string_view rstrip(std::string_view s);
std::string_view strip(std::string_view s);
// Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none): the part to
// hold back because the next chunk might complete the tag.
size_t partial_suffix(std::string_view text, std::string_view tag);
size_t partial_suffix_any(std::string_view text, const std::vector<std::string>& tags);

// Removes whitespace around the pieces of one text stream that is cut into segments: drops the
// leading whitespace of a segment when asked (drop_leading) and holds back trailing whitespace until
// more text shows it is not trailing. Used so that a streamed text and the same text parsed at once
// give the same result.
class WhitespaceTrimmer {
 public:
  // Text that follows; returns what can be shown now.
  std::string push(std::string_view text);
  // The next push starts a segment whose leading whitespace is dropped.
  void drop_leading() { drop_leading_ = true; }
  // Forgets held trailing whitespace (the segment ended: it was trailing).
  void drop_pending() { pending_.clear(); }
  // Returns held trailing whitespace (the stream ended without a segment end).
  std::string flush();
  bool started() const { return started_; }

 private:
  std::string pending_;
  bool drop_leading_ = false;
  bool started_ = false;
};

}  // namespace kiln::server
