// write_pack's pipeline (internal to it): the source read ahead of the conversion, the converted
// batches written on a thread of their own, so that reading, converting and writing overlap, and
// the progress line.
//
// ReadAhead: the source is memory-mapped and the converters read each tensor where the mapping
// puts it, so a page not yet in memory would stall the converting thread on the disk. Reader
// threads bring the bytes of the next units of work into memory while the pool converts the
// current unit, and report a read that fails (a source file truncated after it was opened) as an
// Error naming file and tensor instead of the SIGBUS that touching the page would raise.
//
// How they read (SourceIo): by default a reader puts anonymous memory (huge pages where the kernel
// has them) in place of the whole pages of a span of the source (a unit's ranges that follow one
// another in a file) and preads the file into it with O_DIRECT: each request of 6 to 8 MiB goes to
// the disk whole, and `threads` of them are in flight. Faulting the mapping in instead
// (SourceIo::Mapped, the only way before) reads what MADV_WILLNEED leaves out (all but the
// device's readahead or largest request) in readahead windows (read_ahead_kb, often 128 KiB), one
// at a time per faulting thread. Under SourceIo::Auto a chunk whose pages the page cache already
// holds (a checkpoint just written, or packed a moment ago through the page cache) is mapped from
// it rather than read from the disk again. A span's first and last pages, which it may share with
// another unit's tensors, are brought in through the mapping. release() puts the file's mapping
// back over the pages, which frees the memory.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moestream {
class MappedFile;
}

namespace moestream::packer {

// Bytes of one source tensor (or an expert's slice of one) inside its file's mapping.
struct SourceRange {
  const char* data = nullptr;
  uint64_t size = 0;
  const MappedFile* file = nullptr;  // the mapping data points into
  std::string tensor;                // for errors
};

// How the readers bring a range's bytes into memory (pack --read-io).
enum class SourceIo {
  Auto,      // Mapped for chunks the page cache holds, else Direct
  Direct,    // preads with O_DIRECT into the range's pages (Buffered for a file whose filesystem refuses it)
  Buffered,  // preads through the page cache into the range's pages
  Mapped,    // the mapping's pages read by the kernel's readahead (madvise WILLNEED, then POPULATE_READ)
};
SourceIo parse_source_io(const std::string& name);  // auto | direct | buffered | mmap; Error naming --read-io

struct ReadOptions {
  uint64_t ahead_bytes = 0;  // readers stay at most this far past the end of the group last waited
                             // for (0: a group is read only once it is waited for)
  int threads = 16;          // reads in flight, each of up to 8 MiB
  SourceIo io = SourceIo::Auto;
  bool verbose = false;      // a file whose filesystem refuses O_DIRECT is named on stderr
};

class ReadAhead {
 public:
  // groups: the ranges each unit of work reads, in the order the units are consumed.
  ReadAhead(std::vector<std::vector<SourceRange>> groups, const ReadOptions& options);
  ~ReadAhead();  // puts the file's mapping back over pages read but not released
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  // Returns once the group's bytes are in memory; Error naming the file and tensor of a read that
  // failed. Groups are waited for in order.
  void wait(size_t group);
  // After wait(group): the group's pages leave this process's memory (the file's mapping is back
  // over them), so that resident memory stays bounded by what is in flight.
  void release(size_t group);
  // Bytes the readers brought in, and the peak of brought-in minus released (for tests).
  uint64_t read_bytes() const;
  uint64_t peak_in_flight() const;

 private:
  // A source file and the descriptor its O_DIRECT reads go through.
  struct Source {
    const MappedFile* file = nullptr;
    int direct_fd = -1;                // -1: reads go through the page cache
    std::atomic<bool> refused{false};  // O_DIRECT failed on this file's filesystem
  };
  struct Chunk {
    size_t group, source;  // source: index in sources_
    const char* begin;  // page aligned
    uint64_t size;      // whole pages
    uint64_t position;  // bytes of every chunk before it
    bool pread;         // read with pread into anonymous pages, else through the mapping (set
                        // by the reader under SourceIo::Auto when the page cache holds the chunk)
  };
  void add_chunks(size_t group, size_t source, const char* begin, const char* end, bool pread);
  void loop();
  void read_chunk(Chunk& c);
  bool in_page_cache(const Chunk& c) const;
  int pread_chunk(const Chunk& c);     // 0, kTruncated or an errno
  int populate_chunk(const Chunk& c);  // the same
  std::string read_error(const Chunk& c, int err) const;
  void refuse_direct(Source& s);       // reads of s go through the page cache from now on
  bool map_file_back(const Chunk& c);  // false (errno set) when mmap fails

  std::vector<std::vector<SourceRange>> groups_;
  ReadOptions options_;
  std::vector<std::unique_ptr<Source>> sources_;
  std::vector<Chunk> chunks_;
  std::vector<size_t> group_chunks_;   // index of each group's first chunk, then chunks_.size()
  std::vector<uint64_t> group_end_;    // position after the group's last chunk
  std::vector<size_t> pending_;        // chunks of each group not yet read
  std::vector<bool> released_;
  std::vector<std::string> errors_;    // per group: the first failed read's message
  uint64_t limit_ = 0;                 // chunks starting before limit_ may be read
  size_t next_ = 0;                    // the next chunk to hand out
  uint64_t in_flight_ = 0, peak_ = 0, read_ = 0;
  bool stop_ = false;
  std::atomic<bool> refusal_noted_{false};
  mutable std::mutex mu_;
  std::condition_variable work_, done_;
  std::vector<std::thread> threads_;
};

// Runs jobs in the order they are pushed, on one thread, while the caller prepares the next: at
// most one job waits, so memory stays bounded. A job's exception is rethrown by the next push()
// or by finish(); after one, the jobs left are dropped.
class SerialWriter {
 public:
  SerialWriter();
  ~SerialWriter();  // drops the jobs not started, waits for the one running
  SerialWriter(const SerialWriter&) = delete;
  SerialWriter& operator=(const SerialWriter&) = delete;

  void push(std::function<void()> job);  // blocks while a job waits
  void finish();                         // blocks until every job ran

 private:
  void loop();
  std::deque<std::function<void()>> queue_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::thread thread_;  // last: starts once the rest is built
};

// Progress on stderr: done/total bytes, rate and ETA; a bar redrawn five times a second on a
// terminal, else (a log, a pipe) one line every five seconds and one at the end. The rate is shown
// once half a second has passed (before that it would be a quotient of two tiny numbers).
class Progress {
 public:
  Progress(bool enabled, uint64_t total);
  // Bytes a resumed pack kept: done, but not counted in the rate.
  void skip(uint64_t bytes);
  void add(uint64_t bytes);  // from any thread

 private:
  std::mutex mu_;
  bool on_, tty_;
  uint64_t total_, done_ = 0, skipped_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_ = start_;
};

}  // namespace moestream::packer
