// Asynchronous reads of byte ranges from a fixed set of files, for the expert store: a pool of
// threads doing pread, or one io_uring ring, with O_DIRECT optional. Completions are reported
// through a callback on a reader thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace moestream {

enum class IoMethod { Pread, Uring };

struct ReaderOptions {
  IoMethod method = IoMethod::Pread;
  bool direct = false;  // O_DIRECT: offsets, sizes and buffers must be 4 KiB aligned
  int threads = 4;      // pread threads / maximum reads in flight on the ring
};

struct ReadDone {
  uint64_t tag = 0;
  int64_t bytes = 0;  // bytes read, or -errno on failure
};

class AsyncReader {
 public:
  virtual ~AsyncReader() = default;
  // Reads `size` bytes at `offset` of files[file] into dst; on_done(tag, bytes) runs when done.
  virtual void submit(int file, uint64_t offset, uint64_t size, void* dst, uint64_t tag) = 0;
  const std::vector<std::string>& paths() const { return paths_; }

 protected:
  std::vector<std::string> paths_;
};

using ReadCallback = std::function<void(const ReadDone&)>;

// Opens every file (Error naming the file on failure).
std::unique_ptr<AsyncReader> make_async_reader(const std::vector<std::string>& paths,
                                               const ReaderOptions& options, ReadCallback on_done);

IoMethod parse_io_method(const std::string& name);  // "pread" | "uring"

}  // namespace moestream
