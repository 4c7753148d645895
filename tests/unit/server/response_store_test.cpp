// ResponseStore (src/server/response_store.cpp): bounded by count, total size and age, oldest evicted first.
#include "server/response_store.h"

#include <gtest/gtest.h>

#include <string>

namespace kiln::server {
namespace {

using namespace std::chrono_literals;
using Clock = ResponseStore::Clock;

ResponseStore::Entry entry(const std::string& text) {
  ResponseStore::Entry e;
  e.conversation = nlohmann::ordered_json::array({{{"role", "user"}, {"content", text}}});
  e.response = {{"id", text}};
  return e;
}

TEST(ResponseStore, KeepsAndReturnsEntries) {
  ResponseStore store;
  ASSERT_TRUE(store.put("resp_a", entry("hello")));
  auto got = store.get("resp_a");
  ASSERT_TRUE(got);
  EXPECT_EQ(got->conversation[0]["content"], "hello");
  EXPECT_EQ(got->response["id"], "hello");
  EXPECT_FALSE(store.get("resp_b"));
  EXPECT_EQ(store.size(), 1u);
}

TEST(ResponseStore, CountLimitEvictsTheOldest) {
  ResponseStore store({/*max_entries=*/2, /*max_bytes=*/1 << 20, /*max_age_s=*/3600});
  const auto t0 = Clock::now();
  store.put("a", entry("1"), t0);
  store.put("b", entry("2"), t0 + 1s);
  store.put("c", entry("3"), t0 + 2s);
  EXPECT_FALSE(store.get("a", t0 + 2s));
  EXPECT_TRUE(store.get("b", t0 + 2s));
  EXPECT_TRUE(store.get("c", t0 + 2s));
  EXPECT_EQ(store.size(), 2u);
}

TEST(ResponseStore, ByteLimitEvictsTheOldestAndRefusesTooLarge) {
  const size_t one = entry(std::string(100, 'x')).conversation.dump().size() + entry(std::string(100, 'x')).response.dump().size() + 1;
  ResponseStore store({/*max_entries=*/100, /*max_bytes=*/2 * one + 10, /*max_age_s=*/3600});
  const auto t0 = Clock::now();
  store.put("a", entry(std::string(100, 'x')), t0);
  store.put("b", entry(std::string(100, 'y')), t0);
  EXPECT_EQ(store.bytes(), 2 * one);
  store.put("c", entry(std::string(100, 'z')), t0);
  EXPECT_FALSE(store.get("a", t0));
  EXPECT_TRUE(store.get("c", t0));
  EXPECT_LE(store.bytes(), 2 * one + 10);
  EXPECT_FALSE(store.put("huge", entry(std::string(1000, 'h')), t0));
  EXPECT_FALSE(store.get("huge", t0));
}

TEST(ResponseStore, EntriesExpire) {
  ResponseStore store({/*max_entries=*/10, /*max_bytes=*/1 << 20, /*max_age_s=*/60});
  const auto t0 = Clock::now();
  store.put("a", entry("1"), t0);
  store.put("b", entry("2"), t0 + 30s);
  EXPECT_TRUE(store.get("a", t0 + 59s));
  EXPECT_FALSE(store.get("a", t0 + 60s));
  EXPECT_TRUE(store.get("b", t0 + 60s));
  EXPECT_FALSE(store.get("b", t0 + 90s));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(store.bytes(), 0u);
}

TEST(ResponseStore, ReplacingAnIdKeepsOneEntryAndZeroMeansOff) {
  ResponseStore store;
  store.put("a", entry("1"));
  store.put("a", entry("22"));
  EXPECT_EQ(store.size(), 1u);
  EXPECT_EQ(store.get("a")->conversation[0]["content"], "22");
  ResponseStore off({/*max_entries=*/0, /*max_bytes=*/1 << 20, /*max_age_s=*/60});
  EXPECT_FALSE(off.put("a", entry("1")));
  EXPECT_FALSE(off.get("a"));
}

}  // namespace
}  // namespace kiln::server
