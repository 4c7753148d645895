// The id pool behind KV pages and state slots: all-or-nothing allocation, and freeing an id not in use is a bug.
#include "engine/kv_pool.h"

#include <gtest/gtest.h>

namespace kiln::engine {
namespace {

TEST(IdPool, AllOrNothingAndDoubleFreeIsABug) {
  IdPool pool(3);
  std::vector<int32_t> a;
  EXPECT_FALSE(pool.allocate(4, a));
  EXPECT_TRUE(a.empty());
  EXPECT_TRUE(pool.allocate(2, a));
  EXPECT_EQ(pool.num_free(), 1);
  pool.free(a);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_THROW(pool.free(a), std::exception);
}

}  // namespace
}  // namespace kiln::engine
