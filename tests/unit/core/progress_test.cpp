// The weight-loading progress line: its text from given numbers and the counter's printing, with a hand-driven
// clock (no sleeps). Expected strings are worked out by hand from the numbers given.
#include "core/progress.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kiln {
namespace {

TEST(Progress, FormatsBytesRateAndEta) {
  // 10.5 GB in 1 s: 10.5 GB/s; 12.5 GB left / 10.5 GB/s = 1.19 s, shown rounded up.
  EXPECT_EQ(format_progress(10'500'000'000ull, 23'000'000'000ull, 1.0), "10.5 / 23.0 GB, 10.5 GB/s, ETA 2 s");
  // 4 GB in 2 s: 2 GB/s, 6 GB left: 3 s exactly.
  EXPECT_EQ(format_progress(4'000'000'000ull, 10'000'000'000ull, 2.0), "4.0 / 10.0 GB, 2.0 GB/s, ETA 3 s");
  EXPECT_EQ(format_progress(10'000'000'000ull, 10'000'000'000ull, 4.0), "10.0 / 10.0 GB, 2.5 GB/s, ETA 0 s");
}

TEST(Progress, NoRateBeforeAnyTimeOrBytes) {
  EXPECT_EQ(format_progress(0, 23'000'000'000ull, 0.0), "0.0 / 23.0 GB");
  EXPECT_EQ(format_progress(0, 23'000'000'000ull, 5.0), "0.0 / 23.0 GB");
  EXPECT_EQ(format_progress(1'000'000'000ull, 23'000'000'000ull, 0.0), "1.0 / 23.0 GB");
}

TEST(Progress, MegabytesForSmallLoads) {
  // 8 MB of 16 MB in 0.01 s: 800 MB/s, 8 MB left: 0.01 s, shown rounded up to 1 s.
  EXPECT_EQ(format_progress(8'000'000ull, 16'000'000ull, 0.01), "8.0 / 16.0 MB, 800 MB/s, ETA 1 s");
}

TEST(Progress, TotalNeverShownBelowDone) {
  EXPECT_EQ(format_progress(3'000'000'000ull, 2'000'000'000ull, 1.0), "3.0 / 3.0 GB, 3.0 GB/s, ETA 0 s");
}

TEST(Progress, FinalLine) {
  EXPECT_EQ(format_progress_done(23'000'000'000ull, 2.0), "23.0 GB in 2.0 s (11.5 GB/s)");
  EXPECT_EQ(format_progress_done(5'000'000ull, 0.0), "5.0 MB in 0.0 s");  // below 1 GB: MB
  EXPECT_EQ(format_progress_done(17'000'000ull, 0.5), "17.0 MB in 0.5 s (34 MB/s)");
}

struct Harness {
  double now = 100.0;
  std::vector<std::string> lines;
  ByteProgress p{[this] { return now; }, [this](const std::string& l) { lines.push_back(l); }, 1.0};
};

TEST(Progress, PrintsAtMostOncePerIntervalThenAFinalLine) {
  Harness h;
  h.p.begin(10'000'000'000ull, "loading weights");
  h.now = 100.5;
  h.p.add(1'000'000'000ull);  // half a second in: no line yet
  EXPECT_TRUE(h.lines.empty());
  h.now = 102.0;
  h.p.add(3'000'000'000ull);  // 4 GB after 2 s
  ASSERT_EQ(h.lines.size(), 1u);
  EXPECT_EQ(h.lines[0], "loading weights: 4.0 / 10.0 GB, 2.0 GB/s, ETA 3 s");
  h.now = 102.9;
  h.p.add(1'000'000'000ull);  // 0.9 s after the last line: none
  EXPECT_EQ(h.lines.size(), 1u);
  h.now = 104.0;
  h.p.add(5'000'000'000ull);
  ASSERT_EQ(h.lines.size(), 2u);
  EXPECT_EQ(h.lines[1], "loading weights: 10.0 / 10.0 GB, 2.5 GB/s, ETA 0 s");
  h.now = 105.0;
  h.p.end();
  ASSERT_EQ(h.lines.size(), 3u);
  EXPECT_EQ(h.lines[2], "loaded weights: 10.0 GB in 5.0 s (2.0 GB/s)");
  EXPECT_EQ(h.p.loaders(), 0);
  EXPECT_EQ(h.p.done(), 0u);  // reset for the next load
}

TEST(Progress, OneLineForSeveralLoadersAtOnce) {
  Harness h;
  h.p.begin(6'000'000'000ull, "loading weights");  // rank 0
  h.p.begin(4'000'000'000ull, "loading weights");  // rank 1
  EXPECT_EQ(h.p.total(), 10'000'000'000ull);
  h.now = 101.0;
  h.p.add(2'000'000'000ull);
  h.p.add(2'000'000'000ull);  // the same second: one line
  ASSERT_EQ(h.lines.size(), 1u);
  EXPECT_EQ(h.lines[0], "loading weights: 2.0 / 10.0 GB, 2.0 GB/s, ETA 4 s");
  h.p.add(6'000'000'000ull);
  h.now = 102.0;
  h.p.end();  // rank 0 done: rank 1 still loading, no final line
  EXPECT_EQ(h.lines.size(), 1u);
  h.now = 104.0;
  h.p.end();
  ASSERT_EQ(h.lines.size(), 2u);
  EXPECT_EQ(h.lines[1], "loaded weights: 10.0 GB in 4.0 s (2.5 GB/s)");
}

TEST(Progress, SilentWhenNothingIsCopied) {
  Harness h;  // the CPU backend: views in place, adds nothing
  h.p.begin(10'000'000'000ull, "loading weights");
  h.now = 110.0;
  h.p.end();
  EXPECT_TRUE(h.lines.empty());
}

TEST(Progress, NoFinalLineAfterAFailureAndAddsOutsideALoadAreIgnored) {
  Harness h;
  h.p.add(5'000'000'000ull);  // no loader in
  EXPECT_EQ(h.p.done(), 0u);
  h.p.begin(10'000'000'000ull, "loading weights");
  h.p.begin(10'000'000'000ull, "loading weights");
  h.p.add(1'000'000'000ull);
  h.p.end(false);
  h.p.end(true);
  EXPECT_TRUE(h.lines.empty());
  // The next load starts clean.
  h.p.begin(1'000'000'000ull, "loading random weights");
  h.now = 101.0;
  h.p.add(1'000'000'000ull);
  h.p.end();
  ASSERT_EQ(h.lines.size(), 2u);
  EXPECT_EQ(h.lines[0], "loading random weights: 1.0 / 1.0 GB, 1.0 GB/s, ETA 0 s");
  EXPECT_EQ(h.lines[1], "loaded random weights: 1.0 GB in 1.0 s (1.0 GB/s)");
}

}  // namespace
}  // namespace kiln
