#include "io/pack_pipeline.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>

#include "core/error.h"
#include "io/safetensors.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

namespace moestream::packer {

namespace {

// Large enough that one request keeps the disk busy a while, small enough that the readers
// share a group's tensors evenly.
constexpr uint64_t kChunkBytes = uint64_t(8) << 20;
// A chunk's read result (else 0 or an errno): the file ends before the chunk does.
constexpr int kTruncated = -1;
// Chunks read with pread go into transparent huge pages where the kernel has them: an O_DIRECT
// request into 4 KiB pages is split by the device's segment limit into many small ones (reading
// a cold file on 4 threads, 8 MiB a read: 1.1 GB/s into 4 KiB pages, 2.4 GB/s into huge pages,
// 0.5 s of system time instead of 1.5 s per 3.7 GB on the development machine).
constexpr uint64_t kHugePage = uint64_t(2) << 20;

uint64_t page_size() {
  static const uint64_t size = uint64_t(::sysconf(_SC_PAGESIZE));
  return size;
}

// p rounded down or up to a page: mappings start on a page, so these stay inside the mapping.
const char* page_down(const char* p) {
  return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) / page_size() * page_size());
}
const char* page_up(const char* p) { return page_down(p + page_size() - 1); }

// The file's size now (it may have been cut since it was mapped); the mapped size if fstat fails.
uint64_t size_now(const MappedFile& f) {
  struct stat st {};
  return ::fstat(f.fd(), &st) == 0 ? uint64_t(st.st_size) : f.size();
}

}  // namespace

SourceIo parse_source_io(const std::string& name) {
  if (name == "auto") return SourceIo::Auto;
  if (name == "direct") return SourceIo::Direct;
  if (name == "buffered") return SourceIo::Buffered;
  if (name == "mmap") return SourceIo::Mapped;
  fail("--read-io: '", name, "' is not auto, direct, buffered or mmap");
}

ReadAhead::ReadAhead(std::vector<std::vector<SourceRange>> groups, const ReadOptions& options)
    : groups_(std::move(groups)), options_(options), limit_(options.ahead_bytes) {
  const auto address = [](const SourceRange* r) { return reinterpret_cast<uintptr_t>(r->data); };
  const auto by_address = [&](const SourceRange* a, const SourceRange* b) { return address(a) < address(b); };
  // A page read with pread must belong to one group alone: ranges that share bytes (distinct
  // tensors never do) are all brought in through the mapping.
  bool pread = options_.io != SourceIo::Mapped;
  std::vector<const SourceRange*> all;
  for (const auto& group : groups_)
    for (const SourceRange& r : group)
      if (r.size) all.push_back(&r);
  std::sort(all.begin(), all.end(), by_address);
  for (size_t i = 1; i < all.size(); ++i)
    if (address(all[i]) < address(all[i - 1]) + all[i - 1]->size) pread = false;

  std::map<const MappedFile*, size_t> source_index;
  for (const SourceRange* r : all) {
    if (!source_index.emplace(r->file, sources_.size()).second) continue;
    Source& s = *sources_.emplace_back(std::make_unique<Source>());
    s.file = r->file;
    if (pread && (options_.io == SourceIo::Auto || options_.io == SourceIo::Direct)) {
      // The file as it was opened (its path may name another by now), with O_DIRECT.
      const std::string reopen = "/proc/self/fd/" + std::to_string(r->file->fd());
      s.direct_fd = ::open(reopen.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
      if (s.direct_fd < 0) refuse_direct(s);
    }
  }
  pending_.assign(groups_.size(), 0);
  errors_.resize(groups_.size());
  released_.assign(groups_.size(), false);
  for (size_t g = 0; g < groups_.size(); ++g) {
    group_chunks_.push_back(chunks_.size());
    // Ranges that follow one another in a file (an expert's tensors, a batch's experts) are read
    // as one span; only its first and last pages may hold another group's bytes.
    std::vector<const SourceRange*> ranges;
    for (const SourceRange& r : groups_[g])
      if (r.size) ranges.push_back(&r);
    std::sort(ranges.begin(), ranges.end(), by_address);
    for (size_t i = 0; i < ranges.size();) {
      const SourceRange* first = ranges[i];
      const char* end = first->data + first->size;
      while (++i < ranges.size() && ranges[i]->file == first->file && ranges[i]->data == end) end += ranges[i]->size;
      const size_t source = source_index.at(first->file);
      const char* begin = first->data;
      if (!pread || page_up(begin) >= page_down(end)) {
        add_chunks(g, source, page_down(begin), page_up(end), false);
        continue;
      }
      add_chunks(g, source, page_down(begin), page_up(begin), false);
      add_chunks(g, source, page_up(begin), page_down(end), true);
      add_chunks(g, source, page_down(end), page_up(end), false);
    }
    group_end_.push_back(chunks_.empty() ? 0 : chunks_.back().position + chunks_.back().size);
  }
  group_chunks_.push_back(chunks_.size());
  for (int i = 0; i < std::max(1, options_.threads); ++i) threads_.emplace_back([this] { loop(); });
}

// [begin, end) as chunks of 6 to 8 MiB (the last may be less) that, but for the first, start on
// a huge page.
void ReadAhead::add_chunks(size_t group, size_t source, const char* begin, const char* end, bool pread) {
  for (const char* at = begin; at < end;) {
    const uintptr_t next = (reinterpret_cast<uintptr_t>(at) + kChunkBytes) / kHugePage * kHugePage;
    const uint64_t n = std::min<uint64_t>(next - reinterpret_cast<uintptr_t>(at), uint64_t(end - at));
    const uint64_t position = chunks_.empty() ? 0 : chunks_.back().position + chunks_.back().size;
    chunks_.push_back({group, source, at, n, position, pread});
    ++pending_[group];
    at += n;
  }
}

ReadAhead::~ReadAhead() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_.notify_all();
  for (auto& t : threads_) t.join();
  // The mapping as it was found (chunks from next_ on were never read).
  for (size_t i = 0; i < next_; ++i)
    if (chunks_[i].pread && !released_[chunks_[i].group]) (void)map_file_back(chunks_[i]);
  for (const auto& s : sources_)
    if (s->direct_fd >= 0) ::close(s->direct_fd);
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

void ReadAhead::read_chunk(Chunk& c) {
  if (c.pread && options_.io == SourceIo::Auto && in_page_cache(c)) c.pread = false;
  const int err = c.pread ? pread_chunk(c) : populate_chunk(c);
  const std::string error = err ? read_error(c, err) : "";
  std::lock_guard lock(mu_);
  if (err && errors_[c.group].empty()) errors_[c.group] = error;
  read_ += c.size;
  in_flight_ += c.size;
  peak_ = std::max(peak_, in_flight_);
  if (--pending_[c.group] == 0) done_.notify_all();
}

// The error of a chunk's read, naming the first tensor of its group that the chunk covers (when
// the file was cut, the first of those it no longer holds whole).
std::string ReadAhead::read_error(const Chunk& c, int err) const {
  const MappedFile& f = *sources_[c.source]->file;
  const auto offset = [&](const char* p) { return uint64_t(p - reinterpret_cast<const char*>(f.data())); };
  const uint64_t file_size = size_now(f);
  const auto first_covered = [&](bool cut_only) {
    const SourceRange* first = nullptr;
    for (const SourceRange& r : groups_[c.group]) {
      const bool covered = r.file == &f && r.size > 0 && offset(r.data) < offset(c.begin) + c.size &&
                           offset(c.begin) < offset(r.data) + r.size;
      if (!covered) continue;
      if (cut_only && offset(r.data) + r.size <= file_size) continue;
      if (!first || r.data < first->data) first = &r;
    }
    return first;
  };
  const SourceRange* named = err == kTruncated ? first_covered(true) : nullptr;
  if (!named) named = first_covered(false);
  const std::string where = f.path() + ": tensor " + (named ? named->tensor : std::string("?"));
  return err == kTruncated ? where + ": the file ends before the tensor's bytes (was it truncated while packing?)"
                           : where + ": read failed: " + std::strerror(err);
}

// Whether the page cache holds every page of the chunk (mincore reports a file the process may not
// write as wholly resident: it is then mapped, as before --read-io).
bool ReadAhead::in_page_cache(const Chunk& c) const {
  std::vector<unsigned char> resident(c.size / page_size());
  if (::mincore(const_cast<char*>(c.begin), c.size, resident.data()) != 0) return false;
  return std::all_of(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) != 0; });
}

// Anonymous memory in place of the chunk's pages, and the file's bytes read into it: with
// O_DIRECT the whole request goes to the disk at once, and nothing stays in the page cache.
int ReadAhead::pread_chunk(const Chunk& c) {
  Source& s = *sources_[c.source];
  char* begin = const_cast<char*>(c.begin);
  if (::mmap(begin, c.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
    return errno;
  ::madvise(begin, c.size, MADV_HUGEPAGE);  // fails where the kernel has none: 4 KiB pages then
  const off_t offset = off_t(c.begin - reinterpret_cast<const char*>(s.file->data()));
  for (uint64_t got = 0; got < c.size;) {
    const bool direct = s.direct_fd >= 0 && !s.refused;
    const ssize_t n = ::pread(direct ? s.direct_fd : s.file->fd(), begin + got, c.size - got, offset + off_t(got));
    if (n > 0) {
      got += uint64_t(n);
      continue;
    }
    const int err = n < 0 ? errno : 0;
    if (err == EINTR) continue;
    // O_DIRECT reads a short last block at the end of the file, and refuses the unaligned read after it.
    if (n == 0 || size_now(*s.file) < uint64_t(offset) + c.size) return kTruncated;
    if (direct && err == EINVAL) {  // the filesystem refuses this O_DIRECT read: read through the page cache
      refuse_direct(s);
      continue;
    }
    return err;
  }
  return 0;
}

// Readahead for the whole chunk first (asynchronous: the requests go to the disk at once), then
// the pages mapped, which waits for them and fails where touching a page would raise SIGBUS.
int ReadAhead::populate_chunk(const Chunk& c) {
  char* begin = const_cast<char*>(c.begin);
  ::madvise(begin, c.size, MADV_WILLNEED);
  static std::atomic<bool> populate{true};  // kernels before 5.14 lack MADV_POPULATE_READ: touch each page
  int err = 0;
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
  return err == EFAULT ? kTruncated : err;
}

void ReadAhead::refuse_direct(Source& s) {
  s.refused = true;
  if (options_.verbose && !refusal_noted_.exchange(true))
    std::fprintf(stderr, "pack: %s: the filesystem refuses O_DIRECT reads; reading through the page cache\n",
                 s.file->path().c_str());
}

bool ReadAhead::map_file_back(const Chunk& c) {
  const MappedFile& f = *sources_[c.source]->file;
  const off_t offset = off_t(c.begin - reinterpret_cast<const char*>(f.data()));
  void* p = ::mmap(const_cast<char*>(c.begin), c.size, PROT_READ, MAP_PRIVATE | MAP_FIXED, f.fd(), offset);
  return p != MAP_FAILED;
}

void ReadAhead::wait(size_t group) {
  std::unique_lock lock(mu_);
  limit_ = std::max(limit_, group_end_.at(group) + options_.ahead_bytes);
  work_.notify_all();
  done_.wait(lock, [&] { return pending_[group] == 0; });
  if (!errors_[group].empty()) fail(errors_[group]);
}

void ReadAhead::release(size_t group) {
  uint64_t bytes = 0;
  for (size_t i = group_chunks_.at(group); i < group_chunks_.at(group + 1); ++i) {
    const Chunk& c = chunks_[i];
    if (!c.pread)
      ::madvise(const_cast<char*>(c.begin), c.size, MADV_DONTNEED);
    else
      MS_CHECK_SYS(map_file_back(c), "mmap", sources_[c.source]->file->path());
    bytes += c.size;
  }
  std::lock_guard lock(mu_);
  released_[group] = true;
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
