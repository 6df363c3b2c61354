// A fixed pool of worker threads for data-parallel loops on the compute path. parallel_for splits
// [0, n) into contiguous chunks, runs them on the workers and the calling thread, and returns when
// all are done. No allocation per call.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moestream {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);  // n_threads <= 0: one per hardware thread
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // fn(begin, end) over chunks of [0, n); chunks are at least min_chunk long.
  void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk = 1);

 private:
  void worker_loop(int index);
  void run_chunks();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t n_ = 0, chunk_ = 1, next_ = 0;
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace moestream
