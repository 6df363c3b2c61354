#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moestream {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

inline uint32_t epoch_of(uint64_t claim) { return uint32_t(claim >> 32); }

}  // namespace

ThreadPool::ThreadPool(int n_threads, int spin_micros) : spin_micros_(spin_micros) {
  if (n_threads <= 0) n_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunks(uint32_t epoch) {
  const Job& job = jobs_[epoch & 1];
  uint64_t c = claim_.load(std::memory_order_acquire);
  for (;;) {
    if (epoch_of(c) != epoch) return;
    const uint32_t i = uint32_t(c);
    constexpr auto relaxed = std::memory_order_relaxed;
    if (i >= job.chunks.load(relaxed)) return;  // read after the epoch was seen: this epoch's (see Job)
    const auto* fn = job.fn.load(relaxed);
    const size_t n = job.n.load(relaxed), chunk = job.chunk.load(relaxed);
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
    const size_t begin = size_t(i) * chunk;
    (*fn)(begin, std::min(n, begin + chunk));
    done_.fetch_add(1, std::memory_order_acq_rel);
    c = claim_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker_loop() {
  uint32_t seen = 0;
  for (;;) {
    // Poll for a new epoch for a while, then sleep until one is published.
    auto start = std::chrono::steady_clock::now();
    uint32_t epoch;
    for (int spins = 0;; ++spins) {
      if (stop_.load(std::memory_order_relaxed)) return;
      epoch = epoch_of(claim_.load(std::memory_order_acquire));
      if (epoch != seen) break;
      // Every 64 polls the core goes to whoever else wants it: with more threads than cores
      // (-t above the core count, a container's CPU quota) the polling must not starve them.
      if ((spins & 63) == 63) std::this_thread::yield();
      else cpu_relax();
      if ((spins & 255) == 255 &&
          std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_micros_)) {
        std::unique_lock lock(mu_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return stop_.load() || epoch_of(claim_.load()) != seen; });
        sleepers_.fetch_sub(1);
        start = std::chrono::steady_clock::now();
      }
    }
    seen = epoch;
    run_chunks(epoch);
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk) {
  if (n == 0) return;
  const size_t threads = size();
  if (threads == 1 || n <= min_chunk) {
    fn(0, n);
    return;
  }
  // A few chunks per thread balance uneven work.
  const size_t chunk =
      std::max(min_chunk, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
  const uint32_t epoch = ++epoch_ == 0 ? ++epoch_ : epoch_;  // 0 means "no job"
  Job& job = jobs_[epoch & 1];
  const uint32_t chunks = uint32_t((n + chunk - 1) / chunk);
  job.fn.store(&fn, std::memory_order_relaxed);
  job.n.store(n, std::memory_order_relaxed);
  job.chunk.store(chunk, std::memory_order_relaxed);
  job.chunks.store(chunks, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  claim_.store(uint64_t(epoch) << 32);  // publishes the job (sequentially consistent)
  if (sleepers_.load() > 0) {
    std::lock_guard lock(mu_);
    wake_.notify_all();
  }
  run_chunks(epoch);
  for (int spins = 1; done_.load(std::memory_order_acquire) < chunks; ++spins) {
    if ((spins & 63) == 0) std::this_thread::yield();
    else cpu_relax();
  }
}

}  // namespace moestream
