#include "io/async_reader.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace moestream {

namespace {

struct Job {
  int file;
  uint64_t offset, size;
  void* dst;
  uint64_t tag;
};

std::vector<int> open_all(const std::vector<std::string>& paths, bool direct) {
  std::vector<int> fds;
  for (const auto& p : paths) {
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd < 0) {
      for (int f : fds) ::close(f);
      MS_CHECK_SYS(false, direct ? "open(O_DIRECT)" : "open", p);
    }
    fds.push_back(fd);
  }
  return fds;
}

// Reads the whole range, retrying short reads; stops at end of file.
int64_t pread_full(int fd, void* dst, uint64_t size, uint64_t offset) {
  uint64_t done = 0;
  while (done < size) {
    ssize_t n = ::pread(fd, static_cast<char*>(dst) + done, size - done, off_t(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;
    done += uint64_t(n);
  }
  return int64_t(done);
}

class PreadReader final : public AsyncReader {
 public:
  PreadReader(const std::vector<std::string>& paths, const ReaderOptions& o, ReadCallback cb)
      : fds_(open_all(paths, o.direct)), on_done_(std::move(cb)) {
    paths_ = paths;
    for (int i = 0; i < std::max(1, o.threads); ++i) threads_.emplace_back([this] { loop(); });
  }
  ~PreadReader() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    for (int fd : fds_) ::close(fd);
  }
  void submit(int file, uint64_t offset, uint64_t size, void* dst, uint64_t tag) override {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back({file, offset, size, dst, tag});
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      Job j;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        j = jobs_.front();
        jobs_.pop_front();
      }
      on_done_({j.tag, pread_full(fds_[size_t(j.file)], j.dst, j.size, j.offset)});
    }
  }
  std::vector<int> fds_;
  ReadCallback on_done_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
};

// One thread owns the ring: it moves submitted jobs onto the submission queue (up to `depth` in
// flight) and reaps completions, resubmitting the rest of a short read.
class UringReader final : public AsyncReader {
 public:
  UringReader(const std::vector<std::string>& paths, const ReaderOptions& o, ReadCallback cb)
      : fds_(open_all(paths, o.direct)), on_done_(std::move(cb)), depth_(std::max(1, o.threads)) {
    paths_ = paths;
    int rc = io_uring_queue_init(unsigned(depth_ * 2), &ring_, 0);
    if (rc < 0) {
      for (int fd : fds_) ::close(fd);
      fail("io_uring_queue_init failed: ", std::strerror(-rc), " (use --io pread)");
    }
    if (::pipe2(wake_, O_CLOEXEC) != 0) fail("pipe2 failed: ", std::strerror(errno));
    thread_ = std::thread([this] { loop(); });
  }
  ~UringReader() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    poke();
    thread_.join();
    io_uring_queue_exit(&ring_);
    ::close(wake_[0]);
    ::close(wake_[1]);
    for (int fd : fds_) ::close(fd);
  }
  void submit(int file, uint64_t offset, uint64_t size, void* dst, uint64_t tag) override {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back({file, offset, size, dst, tag});
    }
    poke();
  }

 private:
  struct InFlight {
    Job job;
    uint64_t done = 0;
  };
  static constexpr uint64_t kWakeTag = ~uint64_t(0);

  void poke() {
    char c = 1;
    while (::write(wake_[1], &c, 1) < 0 && errno == EINTR) {
    }
  }
  void arm_wake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    io_uring_prep_read(sqe, wake_[0], wake_buf_, sizeof wake_buf_, 0);
    io_uring_sqe_set_data64(sqe, kWakeTag);
  }
  void queue_read(InFlight* f) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    io_uring_prep_read(sqe, fds_[size_t(f->job.file)], static_cast<char*>(f->job.dst) + f->done,
                       unsigned(f->job.size - f->done), f->job.offset + f->done);
    io_uring_sqe_set_data(sqe, f);
  }
  void loop() {
    arm_wake();
    int in_flight = 0;
    for (;;) {
      {
        std::lock_guard lock(mu_);
        if (stop_ && in_flight == 0) return;
        while (!stop_ && in_flight < depth_ && !jobs_.empty()) {
          queue_read(new InFlight{jobs_.front()});
          jobs_.pop_front();
          ++in_flight;
        }
      }
      io_uring_submit(&ring_);
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) fail("io_uring_wait_cqe failed: ", std::strerror(-rc));
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (tag == kWakeTag) {
        arm_wake();
        continue;
      }
      auto* f = reinterpret_cast<InFlight*>(tag);
      if (res > 0 && f->done + uint64_t(res) < f->job.size) {
        f->done += uint64_t(res);  // short read: continue where it stopped
        queue_read(f);
        continue;
      }
      const int64_t bytes = res < 0 ? int64_t(res) : int64_t(f->done + uint64_t(res));
      on_done_({f->job.tag, bytes});
      delete f;
      --in_flight;
    }
  }

  std::vector<int> fds_;
  ReadCallback on_done_;
  int depth_;
  io_uring ring_{};
  int wake_[2] = {-1, -1};
  char wake_buf_[64];
  std::thread thread_;
  std::mutex mu_;
  std::deque<Job> jobs_;
  bool stop_ = false;
};

}  // namespace

std::unique_ptr<AsyncReader> make_async_reader(const std::vector<std::string>& paths,
                                               const ReaderOptions& options, ReadCallback on_done) {
  if (options.method == IoMethod::Uring)
    return std::make_unique<UringReader>(paths, options, std::move(on_done));
  return std::make_unique<PreadReader>(paths, options, std::move(on_done));
}

IoMethod parse_io_method(const std::string& name) {
  if (name == "pread") return IoMethod::Pread;
  if (name == "uring") return IoMethod::Uring;
  fail("--io: unknown method '", name, "' (expected pread or uring)");
}

}  // namespace moestream
