#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
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

// Back-to-back jobs of different sizes and chunkings, with workers that have gone to sleep in
// between (a pause longer than the spin) and some that have not: every index once, every time.
TEST(ThreadPool, JobsAfterSleepAndSpinEachRunOnce) {
  ThreadPool pool(8);
  std::vector<std::atomic<int>> hits(5000);
  for (int rep = 0; rep < 300; ++rep) {
    const size_t n = 1 + size_t(rep * 37) % hits.size(), min_chunk = 1 + size_t(rep % 5) * 50;
    for (size_t i = 0; i < n; ++i) hits[i] = 0;
    pool.parallel_for(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) hits[i]++;
    }, min_chunk);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << rep << " " << n << " " << i;
    if (rep % 50 == 0) std::this_thread::sleep_for(std::chrono::microseconds(3 * ThreadPool::kSpinMicros));
  }
}

// The pool can be destroyed while its workers sleep or spin.
TEST(ThreadPool, DestroyedWhileIdle) {
  for (int sleep_us : {0, 3 * ThreadPool::kSpinMicros}) {
    ThreadPool pool(4);
    std::atomic<int> sum{0};
    pool.parallel_for(100, [&](size_t b, size_t e) { sum += int(e - b); });
    EXPECT_EQ(sum.load(), 100);
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
  }
}

}  // namespace
}  // namespace moestream
