// Stop strings: checked on the whole text and cut into pieces everywhere; the results must agree and
// match the expected values written from the definition.
#include <gtest/gtest.h>

#include "server/stop_strings.h"
#include "split_points.h"

namespace kiln::server {
namespace {

struct StopOutcome {
  std::string text;
  bool stopped;
};

StopOutcome run_stop(const std::vector<std::string>& stops, const std::vector<std::string>& pieces,
                     std::vector<std::string>* shown = nullptr) {
  StopStringMatcher m(stops);
  StopOutcome o{"", false};
  for (const auto& p : pieces) {
    auto r = m.push(p);
    if (shown) shown->push_back(r.text);
    o.text += r.text;
    if (r.stopped) {
      o.stopped = true;
      return o;
    }
  }
  o.text += m.flush();
  return o;
}

TEST(StopStrings, CutsBeforeTheFirstMatchAtAnySplit) {
  struct Case {
    std::vector<std::string> stops;
    std::string text;
    std::string expect;
    bool stopped;
  };
  std::vector<Case> cases = {
      {{"STOP"}, "hello STOP world", "hello ", true},
      {{"STOP"}, "hello STO", "hello STO", false},
      {{"\n\n"}, "line one\nline two\n\nrest", "line one\nline two", true},
      {{"ab", "b"}, "xxab", "xx", true},           // earliest match wins
      {{"abc", "ab"}, "--abc", "--", true},
      {{"aab"}, "aaab", "a", true},                // overlapping prefix
      {{"é!"}, "caf\xc3\xa9 ok caf\xc3\xa9!", "caf\xc3\xa9 ok caf", true},
      {{}, "nothing to stop", "nothing to stop", false},
  };
  for (const auto& c : cases)
    for (const auto& pieces : splits_of(c.text)) {
      auto o = run_stop(c.stops, pieces);
      EXPECT_EQ(o.text, c.expect) << c.text;
      EXPECT_EQ(o.stopped, c.stopped) << c.text;
    }
}

TEST(StopStrings, NeverShowsAPartialStopString) {
  std::vector<std::string> shown;
  run_stop({"</answer>"}, {"The result </ans", "wer> and more"}, &shown);
  ASSERT_EQ(shown.size(), 2u);
  EXPECT_EQ(shown[0], "The result ");
  EXPECT_EQ(shown[1], "");
  shown.clear();
  auto o = run_stop({"</answer>"}, {"a </an", "d b"}, &shown);
  EXPECT_EQ(shown[0], "a ");
  EXPECT_EQ(o.text, "a </and b");
}

}  // namespace
}  // namespace kiln::server
