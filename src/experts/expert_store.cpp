// The expert cache: fixed-size slots (the largest expert of the pack, 4 KiB aligned), a table
// (layer, expert) -> slot, and an AsyncReader filling slots from the pack's expert files.
//
// Slot life: Free -> Loading (read in flight, pinned) -> Ready (pinned while the model computes
// with it; evictable once released). Checksums are verified on every read, on the reader thread,
// before the expert is handed out. A read ahead (prefetch) loads an expert of a later layer into
// an unpinned slot that no request waits for ("wanted" false) until a request asks for it.
#include "experts/expert_store.h"

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>

#include "core/error.h"
#include "core/files.h"
#include "backend/eviction.h"
#include "io/async_reader.h"
#include "io/pack.h"

namespace moestream {

namespace {

using clock_type = std::chrono::steady_clock;

// The bytes of each piece an expert is read in (ExpertStoreOptions::read_piece_bytes, or
// MOESTREAM_READ_CHUNK_KB when set), rounded up to 4 KiB as O_DIRECT needs; 0: whole. Pieces let a
// layer's two or three missing experts keep every reader thread and more of the disk's queue busy,
// and make the first expert complete sooner (docs/PERFORMANCE.md).
uint64_t read_piece_bytes(const ExpertStoreOptions& o) {
  const char* v = std::getenv("MOESTREAM_READ_CHUNK_KB");
  const uint64_t bytes = v && *v ? uint64_t(std::max(0L, std::atol(v))) * 1024 : o.read_piece_bytes;
  return (bytes + kPackAlignment - 1) / kPackAlignment * kPackAlignment;
}

// Slot memory comes from the backend (pinned host memory on CUDA) and goes back to it.
struct HostFree {
  Backend* backend = nullptr;
  void operator()(char* p) const { backend->free_host(p); }
};

struct HashFree {
  void operator()(XXH64_state_t* h) const { XXH64_freeState(h); }
};

// A read's tag: its slot and the piece of the expert it reads.
uint64_t read_tag(int slot, int piece) { return uint64_t(uint32_t(slot)) | uint64_t(piece) << 32; }

class StreamingExpertStore final : public ExpertStore {
 public:
  StreamingExpertStore(const PackManifest& pack, Backend& backend, const ExpertStoreOptions& o)
      : pack_(pack), backend_(backend), policy_(make_eviction_policy(o.policy)) {
    slot_bytes_ = pack.max_expert_size();
    uint64_t total = 0;
    for (const auto& layer : pack.layers) {
      total += layer.size();
      if (!layer.empty()) ++moe_layers_;
    }
    total_experts_ = total;
    lookahead_ = o.lookahead;
    lookahead_k_ = o.lookahead_k;
    ahead_pieces_ = std::max(0, o.lookahead_pieces);
    read_piece_ = read_piece_bytes(o);
    if (o.cache_mb < 0) {
      max_slots_ = size_t(total);
    } else {
      stats_.budget_bytes = uint64_t(o.cache_mb * 1e6);
      // At least one slot: a budget below one expert still runs, one expert at a time.
      max_slots_ = std::max<size_t>(1, size_t(stats_.budget_bytes / slot_bytes_));
    }
    where_.resize(pack.layers.size());
    use_.resize(pack.layers.size());
    guessed_.resize(pack.layers.size());
    for (size_t l = 0; l < pack.layers.size(); ++l) {
      where_[l].assign(pack.layers[l].size(), -1);
      use_[l].resize(pack.layers[l].size());
      guessed_[l].assign(pack.layers[l].size(), 0);
    }
    pin_hottest(o);
    std::vector<std::string> paths;
    for (const auto& f : pack.expert_files) paths.push_back(pack.dir + "/" + f);
    ReaderOptions ro;
    ro.method = parse_io_method(o.io);
    ro.direct = o.direct_io;
    ro.threads = o.io_threads;
    reader_ = make_async_reader(paths, ro, [this](const ReadDone& d) { on_read(d); });
    // On the CPU a cache that holds every expert reads them all (the GPU tier loads its own), when
    // they take at most 80% of the memory available now, as the CUDA tier's pinned copies do.
    if (o.warmup)
      read_warm(backend.name().rfind("cpu", 0) == 0 && max_slots_ >= total_experts_ &&
                double(pack.total_expert_bytes()) <= 0.8 * memory_available());
  }

  ~StreamingExpertStore() override {
    // Reads still in flight (after an error) must finish before the slots go away; no read ahead
    // starts meanwhile.
    std::unique_lock lock(mu_);
    closing_ = true;
    cv_.wait(lock, [&] { return outstanding_ == 0; });
    lock.unlock();
    reader_.reset();
  }

  void request(int layer, std::span<const int> experts) override {
    std::unique_lock lock(mu_);
    // The previous request was left part way (its caller failed while computing with an expert).
    if (remaining_ != 0 || held()) abandon(lock);
    if (layer < 0 || size_t(layer) >= pack_.layers.size() || pack_.layers[size_t(layer)].empty())
      fail("expert store: layer ", layer, " has no routed experts");
    layer_ = layer;
    ++tick_;
    remaining_ = experts.size();
    // Guesses of this layer not started in time: plain loads now.
    std::erase_if(prefetch_queue_, [&](const std::pair<int, int>& q) { return q.first == layer; });
    for (int e : experts) {
      if (e < 0 || size_t(e) >= where_[size_t(layer)].size())
        fail("expert store: layer ", layer, " has no expert ", e);
      ExpertUse& u = use_[size_t(layer)][size_t(e)];
      u.last_use = tick_;
      ++u.uses;
      char& guessed = guessed_[size_t(layer)][size_t(e)];
      if (guessed) ++stats_.predicted_right;
      guessed = 0;
      const int s = where_[size_t(layer)][size_t(e)];
      if (s >= 0 && slots_[size_t(s)].state == Slot::Ready) {
        Slot& slot = slots_[size_t(s)];
        ++slot.pins;
        ready_.push_back(s);
        ++stats_.hits;
        if (slot.read_ahead) ++stats_.prefetch_hits;
        slot.read_ahead = false;
      } else if (s >= 0 && slots_[size_t(s)].state == Slot::Loading && !slots_[size_t(s)].wanted) {
        // Read ahead, in flight or stopped part way: its other pieces start now, and on_read
        // hands it out.
        Slot& slot = slots_[size_t(s)];
        slot.pins = 1;
        slot.wanted = true;
        ahead_in_flight_ -= slot.in_flight;
        if (s == ahead_slot_) ahead_slot_ = -1;
        ++stats_.misses;
        if (slot.read_ahead) ++stats_.prefetch_hits;
        slot.read_ahead = false;
        issue_pieces(s, int(slot.piece_read.size()));
      } else {
        pending_.push_back(e);
        ++stats_.misses;
      }
    }
    for (auto& g : guessed_[size_t(layer)]) g = 0;  // guesses the layer did not choose
    stop_guess_of(layer);  // a guess of this layer it did not choose stops where it is
    start_loads();
  }

  bool lasting() const override { return !bounded(); }

  // The request's use counts and hit statistics are put back: a preload is not the model's use.
  void preload(int layer, std::span<const int> experts,
               const std::function<void(int, const MlpWeights&)>& seen) override {
    std::vector<ExpertUse> saved;
    uint64_t tick, hits, misses;
    {
      std::lock_guard lock(mu_);
      if (layer < 0 || size_t(layer) >= use_.size()) fail("expert store: layer ", layer, " has no routed experts");
      saved = use_[size_t(layer)];
      tick = tick_;
      hits = stats_.hits;
      misses = stats_.misses;
    }
    auto restore = [&] {
      std::lock_guard lock(mu_);
      use_[size_t(layer)] = saved;
      tick_ = tick;
      stats_.hits = hits;
      stats_.misses = misses;
    };
    try {
      ExpertStore::preload(layer, experts, seen);
    } catch (...) {
      restore();
      throw;
    }
    restore();
  }

  bool wants_prefetch() const override { return lookahead_ && bounded(); }
  bool bounded() const override { return max_slots_ < total_experts_; }

  // Ready slots only: a read in flight would make the request wait.
  void resident(int layer, std::span<char> out) const override {
    std::lock_guard lock(mu_);
    for (size_t e = 0; e < out.size(); ++e) {
      const int s = layer >= 0 && size_t(layer) < where_.size() && e < where_[size_t(layer)].size()
                        ? where_[size_t(layer)][e] : -1;
      out[e] = s >= 0 && slots_[size_t(s)].state == Slot::Ready;
    }
  }

  // Queued behind the current request's reads and any reads ahead; the oldest are dropped once
  // more are queued than the cache has slots (they would evict each other).
  void fetch_later(int layer, std::span<const int> experts) override {
    std::lock_guard lock(mu_);
    if (layer < 0 || size_t(layer) >= where_.size() || experts.empty()) return;
    ++stats_.fallbacks;
    stats_.fallback_skipped += experts.size();
    for (int e : experts)
      if (e >= 0 && size_t(e) < where_[size_t(layer)].size() && where_[size_t(layer)][size_t(e)] < 0)
        background_.push_back({layer, e});
    while (background_.size() > max_slots_) background_.pop_front();
    start_loads();
  }

  std::vector<std::vector<uint64_t>> usage() const override {
    std::lock_guard lock(mu_);
    std::vector<std::vector<uint64_t>> u(use_.size());
    for (size_t l = 0; l < use_.size(); ++l)
      for (const ExpertUse& e : use_[l]) u[l].push_back(e.uses);
    return u;
  }

  void prefetch(int layer, std::span<const int> experts) override {
    std::lock_guard lock(mu_);
    if (!lookahead_ || layer < 0 || size_t(layer) >= pack_.layers.size()) return;
    // This guess replaces the layer's earlier one (made from further back): the counts keep the
    // latest, and its reads not started yet give way to this guess's, queued by layer.
    for (char& g : guessed_[size_t(layer)]) {
      if (!g) continue;
      g = 0;
      --stats_.predicted;
      ++stats_.reguessed;
    }
    std::erase_if(prefetch_queue_, [&](const std::pair<int, int>& q) { return q.first == layer; });
    stop_guess_of(layer);
    auto at = std::find_if(prefetch_queue_.begin(), prefetch_queue_.end(),
                           [&](const std::pair<int, int>& q) { return q.first > layer; });
    int reads = 0;
    for (int e : experts) {
      if (e < 0 || size_t(e) >= where_[size_t(layer)].size()) continue;
      ++stats_.predicted;
      guessed_[size_t(layer)][size_t(e)] = 1;
      const int at_slot = where_[size_t(layer)][size_t(e)];
      if ((at_slot >= 0 && !resumable(at_slot)) || (lookahead_k_ > 0 && reads >= lookahead_k_))
        continue;
      at = std::next(prefetch_queue_.insert(at, {layer, e}));
      ++reads;
    }
    start_loads();  // behind the current request's reads, which start_loads starts first
  }

  bool next(int& expert, MlpWeights& weights) override {
    std::unique_lock lock(mu_);
    for (;;) {
      if (error_) {
        // The request is abandoned here, so the store is ready for the next one whatever the
        // caller does with the error.
        const std::string message = *error_;
        abandon(lock);
        fail(message);
      }
      if (!ready_.empty()) {
        const Slot& s = slots_[size_t(ready_.front())];
        ready_.pop_front();
        --remaining_;
        expert = s.expert;
        weights = s.weights;
        return true;
      }
      if (remaining_ == 0) return false;
      start_loads();
      if (outstanding_ == 0)
        fail("expert store: no slot free for layer ", layer_, " (release each expert before asking for the next)");
      auto t0 = clock_type::now();
      // Also woken by a read ahead finishing: its slot may be the one a pending load waits for.
      const uint64_t done = reads_done_;
      cv_.wait(lock, [&] { return error_ || !ready_.empty() || reads_done_ != done; });
      stats_.wait_seconds += std::chrono::duration<double>(clock_type::now() - t0).count();
    }
  }

  void release(int expert) override {
    std::lock_guard lock(mu_);
    const int s = where_[size_t(layer_)][size_t(expert)];
    if (s < 0 || slots_[size_t(s)].pins == 0) fail("expert store: release of expert ", expert, " that is not held");
    --slots_[size_t(s)].pins;
    start_loads();
  }

  ExpertStats stats() const override {
    std::lock_guard lock(mu_);
    ExpertStats s = stats_;
    s.cache_bytes = uint64_t(slots_.size()) * slot_bytes_;
    return s;
  }

 private:
  struct Slot {
    enum State { Free, Loading, Ready } state = Free;
    std::unique_ptr<char, HostFree> mem;
    int layer = -1, expert = -1;
    int pins = 0;
    bool wanted = false;      // Loading for the current request (else a read ahead)
    bool read_ahead = false;  // brought in by prefetch() and not asked for since
    bool hot = false;         // pinned by the profile: never evicted
    // This load's pieces (of piece_bytes each, the last one shorter): those read, and how many of
    // them, in order, the checksum has taken so far (one reader thread at a time, `hashing`).
    uint64_t piece_bytes = 0;
    std::vector<char> piece_read;
    int pieces_issued = 0;  // submitted to the reader so far (in order)
    int in_flight = 0;      // submitted and not yet returned
    int pieces_hashed = 0;
    bool hashing = false;
    std::unique_ptr<XXH64_state_t, HashFree> hash;
    uint64_t bytes_got = 0;   // bytes its pieces returned so far
    int read_errno = 0;       // the first failed piece's errno
    MlpWeights weights;  // views into mem, valid while Ready
  };

  // The profile's hottest experts, up to pin_share of the slots, marked in hot_ (a bounded
  // cache only: an unbounded one keeps everything anyway). At least one slot stays unpinned.
  void pin_hottest(const ExpertStoreOptions& o) {
    hot_.resize(pack_.layers.size());
    for (size_t l = 0; l < pack_.layers.size(); ++l) hot_[l].assign(pack_.layers[l].size(), 0);
    if (o.profile.empty() || o.cache_mb < 0) return;
    if (o.profile.size() != pack_.layers.size())
      fail("profile: ", o.profile.size(), " layers of counts, the model has ", pack_.layers.size());
    for (size_t l = 0; l < o.profile.size(); ++l)
      if (o.profile[l].size() != pack_.layers[l].size())
        fail("profile: layer ", l, " has ", o.profile[l].size(), " counts, the model ", pack_.layers[l].size(),
             " experts");
    size_t n = 0;
    hot_ = hottest_experts(o.profile, o.pin_share, max_slots_, n);
    stats_.pinned = n;
  }

  // Reads every pinned expert (`all`: every expert) now, layer by layer, through the usual
  // request protocol.
  void read_warm(bool all) {
    for (size_t l = 0; l < hot_.size(); ++l) {
      std::vector<int> ids;
      for (size_t e = 0; e < hot_[l].size(); ++e)
        if (all || hot_[l][e]) ids.push_back(int(e));
      if (ids.empty()) continue;
      request(int(l), ids);
      int e;
      MlpWeights w;
      while (next(e, w)) release(e);
    }
    std::lock_guard lock(mu_);
    for (auto& layer : use_)  // the warm-up is no use by the model
      for (ExpertUse& u : layer) u = ExpertUse{};
    stats_.hits = stats_.misses = 0;
  }

  bool held() const {
    for (const Slot& s : slots_)
      if (s.pins > 0) return true;
    return false;
  }

  // Drops the current request after a failure: waits for its reads still in flight, then unpins
  // every slot (pins only ever belong to the current request) and forgets what was not handed
  // out. Experts that were read correctly stay cached; a failed one left no trace.
  void abandon(std::unique_lock<std::mutex>& lock) {
    prefetch_queue_.clear();  // no read ahead starts while the reads in flight finish
    background_.clear();
    ahead_slot_ = -1;
    cv_.wait(lock, [&] { return outstanding_ == 0; });
    for (Slot& s : slots_) {
      s.pins = 0;
      s.wanted = false;
    }
    pending_.clear();
    ready_.clear();
    remaining_ = 0;
    error_.reset();
  }

  // Starts reads for pending experts while slots can be found, then, once all of them have
  // started, the reads ahead. Called with mu_ held.
  void start_loads() {
    while (!pending_.empty()) {
      const int s = acquire_slot();
      if (s < 0) {
        ahead_slot_ = -1;  // the read ahead stops, so that its slot can go to the request
        return;
      }
      const int e = pending_.front();
      pending_.pop_front();
      start_read(s, layer_, e, true);
    }
    if (ahead_pieces_ > 0) issue_ahead();
    else
      while (start_guess(true) >= 0) {
      }
    while (!background_.empty()) {
      const auto [layer, e] = background_.front();
      if (where_[size_t(layer)][size_t(e)] >= 0) {  // arrived meanwhile
        background_.pop_front();
        continue;
      }
      const int s = acquire_slot();
      if (s < 0) return;
      background_.pop_front();
      use_[size_t(layer)][size_t(e)].last_use = tick_;
      ++stats_.fallback_reads;
      start_read(s, layer, e, false, true);
      slots_[size_t(s)].read_ahead = false;  // not a lookahead guess
    }
  }

  // Reads ahead by pieces (ExpertStoreOptions::lookahead_pieces): while no read the model waits
  // for is in flight or waiting for a slot, up to ahead_pieces_ pieces of the likeliest guess
  // not in memory, then of the next. Called with mu_ held, also as each piece returns (on a
  // reader thread: `grow` false, no slot memory allocated there).
  void issue_ahead(bool grow = true) {
    while (!closing_ && pending_.empty() && in_flight_ == ahead_in_flight_ &&
           ahead_in_flight_ < ahead_pieces_) {
      if (ahead_slot_ < 0 || !unissued(slots_[size_t(ahead_slot_)]))
        ahead_slot_ = start_guess(grow);
      if (ahead_slot_ < 0) return;
      issue_pieces(ahead_slot_, slots_[size_t(ahead_slot_)].pieces_issued + 1);
    }
  }

  // The next queued guess not in memory, read in a slot of its own (every piece at once when
  // lookahead_pieces is 0, else as issue_ahead submits them); or the slot of one read part way
  // before and guessed again, to read on. -1: none queued, or no slot free (it stays queued).
  int start_guess(bool grow) {
    while (!prefetch_queue_.empty()) {
      const auto [layer, e] = prefetch_queue_.front();
      const int at = where_[size_t(layer)][size_t(e)];
      if (at >= 0) {  // arrived meanwhile, or read part way
        prefetch_queue_.pop_front();
        if (resumable(at)) return at;
        continue;
      }
      const int s = acquire_slot(grow);
      if (s < 0) return -1;
      prefetch_queue_.pop_front();
      // As recent as the request that made the guess, so the policy keeps it until it is used.
      use_[size_t(layer)][size_t(e)].last_use = tick_;
      ++stats_.prefetch_reads;
      start_read(s, layer, e, false, false);
      return s;
    }
    return -1;
  }

  // Submits the slot's pieces up to (not including) `upto`, in order.
  void issue_pieces(int s, int upto) {
    Slot& slot = slots_[size_t(s)];
    const PackedExpert& pe = pack_.expert(slot.layer, slot.expert);
    for (; slot.pieces_issued < upto; ++slot.pieces_issued) {
      const uint64_t at = uint64_t(slot.pieces_issued) * slot.piece_bytes;
      if (outstanding_ == 0) busy_since_ = clock_type::now();
      ++outstanding_;
      ++in_flight_;
      ++slot.in_flight;
      if (!slot.wanted) ++ahead_in_flight_;
      reader_->submit(pe.file, pe.offset + at, std::min(slot.piece_bytes, pe.size - at),
                      slot.mem.get() + at, read_tag(s, slot.pieces_issued));
    }
  }

  // `all`: every piece now (a read the model waits for, or ExpertStoreOptions::lookahead_pieces
  // 0); else issue_ahead submits them.
  void start_read(int s, int layer, int e, bool wanted, bool all = true) {
    Slot& slot = slots_[size_t(s)];
    slot.state = Slot::Loading;
    slot.layer = layer;
    slot.expert = e;
    slot.pins = wanted ? 1 : 0;
    slot.wanted = wanted;
    slot.read_ahead = !wanted;
    slot.hot = hot_[size_t(layer)][size_t(e)] != 0;
    where_[size_t(layer)][size_t(e)] = s;
    const PackedExpert& pe = pack_.expert(layer, e);
    const uint64_t piece = read_piece_ > 0 ? read_piece_ : std::max<uint64_t>(pe.size, 1);
    const int pieces = int((pe.size + piece - 1) / piece);
    slot.piece_bytes = piece;
    slot.piece_read.assign(size_t(pieces), 0);
    slot.pieces_issued = 0;
    slot.in_flight = 0;
    slot.pieces_hashed = 0;
    slot.hashing = false;
    XXH64_reset(slot.hash.get(), 0);
    slot.bytes_got = 0;
    slot.read_errno = 0;
    if (wanted || all || ahead_pieces_ == 0) issue_pieces(s, pieces);
  }

  // A read finished (mu_ held): the store's in-flight count and busy time.
  void read_finished() {
    if (--outstanding_ == 0)
      stats_.io_busy_seconds += std::chrono::duration<double>(clock_type::now() - busy_since_).count();
  }

  // A free slot, a new one while under the bound (`grow`: only on the model's thread, whose
  // calls report an allocation failure), or the cached expert of lowest priority.
  int acquire_slot(bool grow = true) {
    for (size_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].state == Slot::Free) return int(i);
    if (grow && slots_.size() < max_slots_) {
      Slot& s = slots_.emplace_back();
      s.mem = std::unique_ptr<char, HostFree>(static_cast<char*>(backend_.alloc_host(slot_bytes_)), HostFree{&backend_});
      if (!s.mem) fail("expert store: out of memory allocating a ", slot_bytes_, "-byte slot");
      s.hash.reset(XXH64_createState());
      if (!s.hash) fail("expert store: out of memory for a slot's checksum state");
      return int(slots_.size() - 1);
    }
    int victim = -1;
    double best = 0;
    const double ticks_per_token = std::max(1, moe_layers_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (stopped(int(i))) {  // a guess not chosen, read part way: the first to go
        victim = int(i);
        break;
      }
      if (s.state != Slot::Ready || s.pins > 0 || s.hot) continue;
      const double p = policy_->priority(use_[size_t(s.layer)][size_t(s.expert)], tick_, ticks_per_token);
      if (victim < 0 || p < best) {
        victim = int(i);
        best = p;
      }
    }
    if (victim >= 0) {
      Slot& s = slots_[size_t(victim)];
      where_[size_t(s.layer)][size_t(s.expert)] = -1;
      s.state = Slot::Free;
      if (s.read_ahead) {
        ++stats_.prefetch_wasted;
        stats_.bytes_wasted += s.bytes_got;
      }
      s.read_ahead = false;
    }
    return victim;
  }

  // issue_ahead stops reading the guess it reads when that guess is of `layer`.
  void stop_guess_of(int layer) {
    if (ahead_slot_ >= 0 && slots_[size_t(ahead_slot_)].layer == layer) ahead_slot_ = -1;
  }

  // A read ahead with pieces not yet submitted (only guesses read by pieces have them).
  static bool unissued(const Slot& s) {
    return s.state == Slot::Loading && !s.wanted && s.pieces_issued < int(s.piece_read.size());
  }

  // One that issue_ahead is not reading on (its guess was not chosen, or was replaced): a new
  // guess of it, or a request, reads on.
  bool resumable(int i) const { return i != ahead_slot_ && unissued(slots_[size_t(i)]); }

  // One of those with no piece in flight or being summed: its slot can be taken.
  bool stopped(int i) const {
    const Slot& s = slots_[size_t(i)];
    return resumable(i) && s.in_flight == 0 && !s.hashing;
  }

  // Whether slot i just stopped while a request waits for a slot (mu_ held): then next() must
  // look again, so it counts as a read done.
  bool frees_a_slot(int i) {
    if (pending_.empty() || !stopped(i)) return false;
    ++reads_done_;
    return true;
  }

  // Reader thread: a piece of a load is done. The checksum takes the pieces in order as they
  // arrive, on the thread of the piece that lets it go on (so that little of it is left once the
  // last piece is read); the thread that takes the last piece checks the sum, then hands the
  // expert to the compute side. A piece counts as in flight until the checksum has taken it.
  void on_read(const ReadDone& d) {
    const int s_index = int(uint32_t(d.tag)), piece = int(d.tag >> 32);
    Slot* slot_ptr;
    bool wake = false, sums = false;  // sums: this thread takes the checksum on
    {
      std::lock_guard lock(mu_);  // the deque's index may be growing; element addresses are stable
      slot_ptr = &slots_[size_t(s_index)];
      Slot& s = *slot_ptr;
      if (d.bytes < 0) {
        if (s.read_errno == 0) s.read_errno = int(-d.bytes);
      } else {
        s.bytes_got += uint64_t(d.bytes);
        stats_.bytes_read += uint64_t(d.bytes);
      }
      s.piece_read[size_t(piece)] = 1;
      --in_flight_;
      --s.in_flight;
      if (!s.wanted) --ahead_in_flight_;
      if (s.hashing || piece != s.pieces_hashed) {
        wake = frees_a_slot(s_index);  // the checksum takes it later
      } else {
        s.hashing = true;
        sums = true;
      }
      issue_ahead(
          false);  // after the checksum is claimed: a stopped slot may be taken for a new read
    }
    if (!sums) {
      if (wake) cv_.notify_all();
      return;
    }
    Slot& slot = *slot_ptr;  // pinned and Loading: only its hashing thread reads its memory
    const PackedExpert& pe = pack_.expert(slot.layer, slot.expert);
    const int pieces = int(slot.piece_read.size());
    for (;;) {
      const uint64_t at = uint64_t(slot.pieces_hashed) * slot.piece_bytes;
      XXH64_update(slot.hash.get(), slot.mem.get() + at, std::min(slot.piece_bytes, pe.size - at));
      if (slot.pieces_hashed + 1 == pieces) break;  // this thread finishes the load
      {
        std::lock_guard lock(mu_);
        ++slot.pieces_hashed;
        read_finished();
        if (slot.piece_read[size_t(slot.pieces_hashed)]) continue;
        slot.hashing = false;  // its thread goes on when it is read
        // Also wakes abandon() and the destructor, which wait for outstanding_ to reach 0.
        wake = frees_a_slot(s_index) || outstanding_ == 0;
      }
      if (wake) cv_.notify_all();
      return;
    }
    const std::string& file = pack_.expert_files[size_t(pe.file)];
    std::optional<std::string> err;
    if (slot.read_errno != 0) {
      err = file + ": read failed for layer " + std::to_string(slot.layer) + " expert " +
            std::to_string(slot.expert) + ": " + std::strerror(slot.read_errno);
    } else if (slot.bytes_got != pe.size) {
      err = file + ": short read for layer " + std::to_string(slot.layer) + " expert " +
            std::to_string(slot.expert) + " (" + std::to_string(slot.bytes_got) + " of " +
            std::to_string(pe.size) + " bytes; truncated file?)";
    } else if (XXH64_digest(slot.hash.get()) != pe.checksum) {
      err = file + ": checksum mismatch for layer " + std::to_string(slot.layer) + " expert " +
            std::to_string(slot.expert) + " (corrupted pack)";
    } else {
      slot.weights = views(pe, slot.mem.get());
    }
    {
      std::lock_guard lock(mu_);
      ++reads_done_;
      read_finished();
      if (err) {
        // A read ahead that failed is forgotten: the request that asks for it reads it again
        // and reports the error then.
        if (slot.wanted && !error_) error_ = *err;
        if (slot.read_ahead) stats_.bytes_wasted += slot.bytes_got;
        where_[size_t(slot.layer)][size_t(slot.expert)] = -1;
        slot.state = Slot::Free;
        slot.pins = 0;
        slot.read_ahead = false;
      } else {
        slot.state = Slot::Ready;
        if (slot.wanted) ready_.push_back(s_index);
      }
      slot.wanted = false;
    }
    cv_.notify_all();
  }

  static Matrix view(const PackedExpert& pe, const std::string& role, const char* base) {
    const PackedTensor& t = *pe.find(role);
    const std::vector<int64_t> shape = pe.logical_shape(role);
    Matrix m{role, t.dtype, base + t.offset, shape[0], shape[1]};
    if (t.bits) {
      m.quant = pe.quant_format(role);
      m.scales = base + pe.find(role + ".scales")->offset;
      const PackedTensor* biases = pe.find(role + ".biases");  // none for MXFP4
      m.biases = biases ? base + biases->offset : nullptr;
    }
    return m;
  }

  // A bias role (F32 [1, n], checked when the manifest loaded), or an empty vector when absent.
  static Vector bias(const PackedExpert& pe, const std::string& role, const char* base) {
    const PackedTensor* t = pe.find(role);
    if (!t) return {};
    return Vector{role, reinterpret_cast<const float*>(base + t->offset), t->shape[1]};
  }

  static MlpWeights views(const PackedExpert& pe, const char* base) {
    return MlpWeights{view(pe, "gate", base), view(pe, "up", base), view(pe, "down", base),
                      bias(pe, "gate_bias", base), bias(pe, "up_bias", base), bias(pe, "down_bias", base)};
  }

  const PackManifest& pack_;
  Backend& backend_;
  std::unique_ptr<EvictionPolicy> policy_;
  std::unique_ptr<AsyncReader> reader_;
  uint64_t slot_bytes_ = 0;
  size_t max_slots_ = 0;
  uint64_t total_experts_ = 0;
  bool lookahead_ = false;
  int lookahead_k_ = 0;  // reads ahead per guess (ExpertStoreOptions::lookahead_k)
  int ahead_pieces_ = 0;  // ExpertStoreOptions::lookahead_pieces
  int moe_layers_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Slot> slots_;                  // deque: growing keeps addresses stable
  std::vector<std::vector<int>> where_;     // [layer][expert] -> slot, -1 when not cached
  std::vector<std::vector<ExpertUse>> use_;
  uint64_t tick_ = 0;
  int layer_ = -1;
  size_t remaining_ = 0;                    // experts of the request not yet handed out
  std::deque<int> pending_;                 // experts of the request waiting for a slot
  std::deque<int> ready_;                   // slots ready to hand out
  std::deque<std::pair<int, int>> prefetch_queue_;  // guessed (layer, expert) not started yet, by layer
  std::deque<std::pair<int, int>> background_;  // (layer, expert) the miss fallback skipped, not started yet
  std::vector<std::vector<char>> guessed_;  // [layer][expert]: in the latest guess for the layer
  std::vector<std::vector<char>> hot_;      // [layer][expert]: pinned by the profile
  uint64_t read_piece_ = 0;                 // bytes an expert's reads take each; 0: whole
  int outstanding_ = 0;                     // pieces submitted and not yet summed
  int in_flight_ = 0;                       // pieces submitted and not yet returned
  int ahead_in_flight_ = 0;                 // of those, pieces of loads nobody waits for
  int ahead_slot_ = -1;                     // the read ahead issue_ahead is submitting
  bool closing_ = false;                    // the store is going away: nothing new starts
  uint64_t reads_done_ = 0;
  clock_type::time_point busy_since_;
  std::optional<std::string> error_;
  ExpertStats stats_;
};

}  // namespace

double default_expert_cache_mb(double cache_mb, double all_bytes, double available_bytes) {
  if (cache_mb >= 0 || available_bytes <= 0) return cache_mb;
  const double cap = 0.8 * available_bytes;
  return all_bytes <= cap ? -1.0 : cap / 1e6;
}

std::unique_ptr<ExpertStore> make_expert_store(const PackManifest& pack, Backend& backend,
                                               const ExpertStoreOptions& options) {
  return std::make_unique<StreamingExpertStore>(pack, backend, options);
}

}  // namespace moestream
