#include "server/stop_strings.h"

#include <algorithm>

#include "server/text_util.h"

namespace kiln::server {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  stops_.erase(std::remove_if(stops_.begin(), stops_.end(), [](const std::string& s) { return s.empty(); }),
               stops_.end());
}

StopStringMatcher::Result StopStringMatcher::push(std::string_view text) {
  Result r;
  if (stopped_) return r;
  if (stops_.empty()) {
    r.text.assign(text);
    return r;
  }
  held_.append(text);
  // The earliest match wins; among matches at the same place, the longest.
  size_t best = std::string::npos;
  const std::string* best_stop = nullptr;
  for (const auto& s : stops_) {
    size_t pos = held_.find(s);
    if (pos == std::string::npos) continue;
    if (pos < best || (pos == best && s.size() > best_stop->size())) {
      best = pos;
      best_stop = &s;
    }
  }
  if (best_stop) {
    r.text = held_.substr(0, best);
    r.stopped = true;
    r.matched = *best_stop;
    stopped_ = true;
    held_.clear();
    return r;
  }
  size_t keep = partial_suffix_any(held_, stops_);
  r.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return r;
}

std::string StopStringMatcher::flush() {
  std::string out = std::move(held_);
  held_.clear();
  return stopped_ ? std::string() : out;
}

}  // namespace kiln::server
