// write_pack's pipeline (internal to it): the source read ahead of the conversion, the converted
// batches written on a thread of their own, so that reading, converting and writing overlap, and
// the progress line.
//
// ReadAhead: the source is memory-mapped, so a page not yet in memory stalls the converting
// thread on the disk. A few reader threads bring the bytes of the next units of work into the
// mapping (large readahead requests, then the pages mapped) while the pool converts the current
// unit, and report a read that fails (a source file truncated after it was opened) as an Error
// naming file and tensor instead of the SIGBUS that touching the page would raise.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moestream::packer {

// Bytes of one source tensor (or an expert's slice of one) inside its file's mapping.
struct SourceRange {
  const char* data = nullptr;
  uint64_t size = 0;
  std::string file, tensor;  // for errors
};

class ReadAhead {
 public:
  // groups: the ranges each unit of work reads, in the order the units are consumed. Readers
  // stay at most `ahead_bytes` past the end of the group last waited for (0: a group is read
  // only once it is waited for).
  ReadAhead(std::vector<std::vector<SourceRange>> groups, uint64_t ahead_bytes, int threads);
  ~ReadAhead();
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;

  // Returns once the group's bytes are in memory; Error naming the file and tensor of a read that
  // failed. Groups are waited for in order.
  void wait(size_t group);
  // The group's pages leave this process's mappings (the page cache keeps them for whoever reads
  // them next), so that resident memory stays bounded by what is in flight.
  void release(size_t group);
  // Bytes the readers brought in, and the peak of brought-in minus released (for tests).
  uint64_t read_bytes() const;
  uint64_t peak_in_flight() const;

 private:
  struct Chunk {
    size_t group, range;
    const char* begin;  // page aligned
    uint64_t size;
    uint64_t position;  // bytes of every chunk before it
  };
  void loop();
  void read_chunk(const Chunk& c);

  std::vector<std::vector<SourceRange>> groups_;
  std::vector<Chunk> chunks_;
  std::vector<uint64_t> group_end_;    // position after the group's last chunk
  std::vector<size_t> pending_;        // chunks of each group not yet read
  std::vector<std::string> errors_;    // per group: the first failed read's message
  uint64_t ahead_ = 0, limit_ = 0;     // chunks starting before limit_ may be read
  size_t next_ = 0;                    // the next chunk to hand out
  uint64_t in_flight_ = 0, peak_ = 0, read_ = 0;
  bool stop_ = false;
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
