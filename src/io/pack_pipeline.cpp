#include "io/pack_pipeline.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/error.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

namespace moestream::packer {

namespace {

// Large enough that the readahead request keeps the disk's queue full, small enough that the
// readers share a group's tensors evenly.
constexpr uint64_t kChunkBytes = uint64_t(8) << 20;

uint64_t page_size() {
  static const uint64_t size = uint64_t(::sysconf(_SC_PAGESIZE));
  return size;
}

// The whole pages under [data, data + size): mappings start on a page, so these stay inside it.
std::pair<const char*, uint64_t> page_span(const char* data, uint64_t size) {
  const uint64_t page = page_size(), at = reinterpret_cast<uintptr_t>(data);
  const uint64_t begin = at / page * page, end = (at + size + page - 1) / page * page;
  return {reinterpret_cast<const char*>(begin), end - begin};
}

}  // namespace

ReadAhead::ReadAhead(std::vector<std::vector<SourceRange>> groups, uint64_t ahead_bytes, int threads)
    : groups_(std::move(groups)), ahead_(ahead_bytes), limit_(ahead_bytes) {
  uint64_t position = 0;
  pending_.assign(groups_.size(), 0);
  errors_.resize(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (size_t r = 0; r < groups_[g].size(); ++r) {
      const SourceRange& range = groups_[g][r];
      if (range.size == 0) continue;
      const auto [begin, size] = page_span(range.data, range.size);
      for (uint64_t at = 0; at < size; at += kChunkBytes) {
        const uint64_t n = std::min(kChunkBytes, size - at);
        chunks_.push_back({g, r, begin + at, n, position});
        position += n;
        ++pending_[g];
      }
    }
    group_end_.push_back(position);
  }
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { loop(); });
}

ReadAhead::~ReadAhead() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (auto& t : threads_) t.join();
}

void ReadAhead::loop() {
  for (;;) {
    size_t c;
    {
      std::unique_lock lock(mu_);
      work_.wait(lock, [&] { return stop_ || (next_ < chunks_.size() && chunks_[next_].position < limit_); });
      if (stop_) return;
      c = next_++;
    }
    read_chunk(chunks_[c]);
  }
}

// Readahead for the whole chunk first (asynchronous: the requests go to the disk at once), then
// the pages mapped, which waits for them and fails where touching a page would raise SIGBUS.
void ReadAhead::read_chunk(const Chunk& c) {
  char* begin = const_cast<char*>(c.begin);
  ::madvise(begin, c.size, MADV_WILLNEED);
  int err = 0;
  static std::atomic<bool> populate{true};  // kernels before 5.14 lack MADV_POPULATE_READ: touch each page
  bool touch = !populate;
  while (!touch && ::madvise(begin, c.size, MADV_POPULATE_READ) != 0) {
    if (errno == EINTR || errno == EAGAIN) continue;
    if (errno == EINVAL) touch = true, populate = false;
    else err = errno;
    break;
  }
  if (touch) {
    uint64_t sum = 0;
    for (uint64_t at = 0; at < c.size; at += page_size()) sum += uint64_t(*static_cast<volatile const char*>(begin + at));
    (void)sum;
  }
  std::lock_guard lock(mu_);
  if (err && errors_[c.group].empty()) {
    const SourceRange& r = groups_[c.group][c.range];
    errors_[c.group] = err == EFAULT ? r.file + ": tensor " + r.tensor +
                                           ": the file ends before the tensor's bytes (was it truncated while packing?)"
                                     : r.file + ": tensor " + r.tensor + ": read failed: " + std::strerror(err);
  }
  read_ += c.size;
  in_flight_ += c.size;
  peak_ = std::max(peak_, in_flight_);
  if (--pending_[c.group] == 0) done_.notify_all();
}

void ReadAhead::wait(size_t group) {
  std::unique_lock lock(mu_);
  limit_ = std::max(limit_, group_end_.at(group) + ahead_);
  work_.notify_all();
  done_.wait(lock, [&] { return pending_[group] == 0; });
  if (!errors_[group].empty()) fail(errors_[group]);
}

void ReadAhead::release(size_t group) {
  uint64_t bytes = 0;
  for (const SourceRange& r : groups_.at(group)) {
    if (r.size == 0) continue;
    const auto [begin, size] = page_span(r.data, r.size);
    ::madvise(const_cast<char*>(begin), size, MADV_DONTNEED);
    bytes += size;
  }
  std::lock_guard lock(mu_);
  in_flight_ -= std::min(in_flight_, bytes);
}

uint64_t ReadAhead::read_bytes() const {
  std::lock_guard lock(mu_);
  return read_;
}

uint64_t ReadAhead::peak_in_flight() const {
  std::lock_guard lock(mu_);
  return peak_;
}

SerialWriter::SerialWriter() : thread_([this] { loop(); }) {}

SerialWriter::~SerialWriter() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void SerialWriter::push(std::function<void()> job) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() || error_; });
  if (error_) std::rethrow_exception(error_);
  queue_.push_back(std::move(job));
  cv_.notify_all();
}

void SerialWriter::finish() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return (queue_.empty() && !busy_) || error_; });
  if (error_) std::rethrow_exception(error_);
}

void SerialWriter::loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !error_); });
      if (stop_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    cv_.notify_all();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(mu_);
      busy_ = false;
      if (error) {
        error_ = error;
        queue_.clear();
      }
    }
    cv_.notify_all();
  }
}

Progress::Progress(bool enabled, uint64_t total) : on_(enabled), tty_(isatty(2)), total_(total) {}

void Progress::skip(uint64_t bytes) {
  std::lock_guard lock(mu_);
  done_ += bytes;
  skipped_ += bytes;
}

void Progress::add(uint64_t bytes) {
  std::lock_guard lock(mu_);
  done_ += bytes;
  if (!on_) return;
  const auto now = std::chrono::steady_clock::now();
  const bool finished = done_ >= total_;
  if (now - last_ < (tty_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(5000)) && !finished) return;
  last_ = now;
  const double s = std::chrono::duration<double>(now - start_).count();
  char rate_text[48] = "   --- MB/s ETA    ?";
  if (s >= 0.5) {
    const double rate = (done_ - skipped_) / s, eta = rate > 0 ? (total_ - done_) / rate : 0;
    std::snprintf(rate_text, sizeof rate_text, "%6.1f MB/s ETA %4.0fs", rate / 1e6, eta);
  }
  const double pct = total_ ? 100.0 * double(done_) / double(total_) : 100.0;
  if (tty_) {
    const int width = 30, filled = total_ ? int(width * double(done_) / double(total_)) : width;
    std::fprintf(stderr, "\rpacking [%.*s%*s] %5.1f%% %.2f/%.2f GB %s", filled, "##############################",
                 width - filled, "", pct, done_ / 1e9, total_ / 1e9, rate_text);
    if (finished) std::fprintf(stderr, "\n");
  } else {
    std::fprintf(stderr, "packing: %5.1f%% %.2f/%.2f GB %s\n", pct, done_ / 1e9, total_ / 1e9, rate_text);
  }
}

}  // namespace moestream::packer
