// A fixed pool of worker threads for data-parallel loops on the compute path. parallel_for splits
// [0, n) into contiguous chunks, runs them on the workers and the calling thread, and returns when
// all are done. No allocation and no lock per call: a job is published with one atomic store,
// chunks are claimed with compare-and-swap, and workers spin briefly (kSpinMicros) between jobs
// before they sleep, so the back-to-back small jobs of a decode step do not pay a wake-up each
// (with 16 threads a condition-variable wake of every worker cost more than a GEMV of an expert).
// One caller at a time; fn must not call parallel_for on the same pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moestream {

class ThreadPool {
 public:
  // n_threads <= 0: one per hardware thread; spin_micros: how long a worker polls for the next
  // job before it sleeps.
  explicit ThreadPool(int n_threads, int spin_micros = kSpinMicros);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // fn(begin, end) over chunks of [0, n); chunks are at least min_chunk long.
  void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t min_chunk = 1);

  // parallel_for cuts a loop into about this many chunks a thread (fewer when min_chunk is larger).
  static constexpr size_t kChunksPerThread = 4;
  // A min_chunk for elementwise loops over items of `values` floats each: at least 64K values a
  // chunk, so a decode step's few rows stay on the calling thread and only prompt batches split.
  static size_t elementwise_chunk(int64_t values) {
    return size_t(std::max<int64_t>(1, 65536 / std::max<int64_t>(1, values)));
  }
  // How long a worker polls for the next job before it sleeps, by default.
  static constexpr int kSpinMicros = 200;

 private:
  // A job, in one of two slots by the parity of its epoch: a worker that read an epoch's slot and
  // then claims a chunk of that epoch (the claim checks it) ran that epoch's job.
  // Atomic fields (relaxed; ordered by claim_) so that a worker reading a slot the caller is
  // refilling for a later epoch only reads values it then discards.
  struct Job {
    std::atomic<const std::function<void(size_t, size_t)>*> fn{nullptr};
    std::atomic<size_t> n{0}, chunk{1};
    std::atomic<uint32_t> chunks{0};
  };

  void worker_loop();
  // Claims and runs chunks of `epoch` until none are left (or a later epoch is published).
  void run_chunks(uint32_t epoch);

  std::vector<std::thread> workers_;
  int spin_micros_ = kSpinMicros;
  Job jobs_[2];
  // (epoch << 32) | the next chunk to claim; epoch 0 is "no job yet".
  std::atomic<uint64_t> claim_{0};
  std::atomic<uint32_t> done_{0};  // chunks of the current epoch finished
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  uint32_t epoch_ = 0;
  std::mutex mu_;
  std::condition_variable wake_;
};

}  // namespace moestream
