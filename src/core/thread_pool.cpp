#include "core/thread_pool.h"

#include <algorithm>

namespace moestream {

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunks() {
  for (;;) {
    size_t begin;
    {
      std::lock_guard lock(mu_);
      if (next_ >= n_) return;
      begin = next_;
      next_ = std::min(n_, next_ + chunk_);
    }
    (*job_)(begin, std::min(n_, begin + chunk_));
  }
}

void ThreadPool::worker_loop(int) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++busy_;
    }
    run_chunks();
    {
      std::lock_guard lock(mu_);
      if (--busy_ == 0) done_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn,
                              size_t min_chunk) {
  if (n == 0) return;
  size_t threads = size();
  if (threads == 1 || n <= min_chunk) {
    fn(0, n);
    return;
  }
  // A few chunks per thread balance uneven work without much locking.
  size_t chunk = std::max(min_chunk, (n + threads * 4 - 1) / (threads * 4));
  {
    std::lock_guard lock(mu_);
    job_ = &fn;
    n_ = n;
    chunk_ = chunk;
    next_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  run_chunks();
  std::unique_lock lock(mu_);
  done_.wait(lock, [&] { return busy_ == 0 && next_ >= n_; });
  job_ = nullptr;
}

}  // namespace moestream
