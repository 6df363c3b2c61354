#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace moestream {
namespace {

TEST(ThreadPool, EveryIndexExactlyOnceAcrossManyCalls) {
  ThreadPool pool(4);
  for (size_t n : {0u, 1u, 7u, 1000u, 12345u}) {
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_for(n, [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) hits[i]++;
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << n << " " << i;
    }
  }
}

}  // namespace
}  // namespace moestream
