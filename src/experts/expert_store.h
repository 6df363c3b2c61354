// ExpertStore: the only path from model code to routed-expert weights, over a pack's expert
// files with a bounded cache. It implements the request / next / release contract the backends
// call (backend/expert_provider.h); the model hands it to Backend::moe and reads its statistics.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/expert_provider.h"

namespace moestream {

struct PackManifest;

struct ExpertStoreOptions {
  double cache_mb = -1;        // memory for expert weights in MB (1e6 bytes); < 0: unbounded
  std::string policy = "lcp";  // eviction: lru | lfu | lcp (lcp measured best: docs/PERFORMANCE.md)
  std::string io = "pread";    // pread | uring
  bool direct_io = false;      // O_DIRECT reads into aligned buffers
  int io_threads = 4;          // reads in flight
  // An expert is read in pieces of this many bytes (a 4 KiB multiple; 0: whole), all submitted at
  // once. MOESTREAM_READ_CHUNK_KB overrides it, for measurements.
  uint64_t read_piece_bytes = 512 * 1024;
  bool lookahead = false;  // accept prefetch() (the backend's guesses of the next layer's experts)
  // Reads ahead per guess: the guess's N most likely experts that are not in memory (0: all of
  // them). The guess itself is the layer's top k (less what the backend holds itself).
  int lookahead_k = 0;
  // Layers guessed ahead: each MoE call guesses the next D MoE layers' experts from its input; a
  // layer's later guess (from nearer) replaces its earlier one.
  int lookahead_depth = 1;
  // Pieces of reads ahead in flight at a time, started only while no read the model waits for is
  // in flight, one guessed expert at a time (likeliest first): reads ahead then fill the disk's
  // gaps between layers instead of sharing its rate with the layer's own reads. A guess the layer
  // does not choose stops where it is (kept, part read, until evicted or asked for). 0: every
  // piece of every guess at once, behind the layer's own reads.
  int lookahead_pieces = 2;
  // A usage profile: profile[layer][expert] counts (e.g. --profile-out of an earlier run). With a
  // bounded cache its hottest experts, up to pin_share of the slots, are never evicted once read;
  // `warmup` reads them when the store is made, before the first token (on the CPU backend with a
  // cache that holds every expert: every expert, if they take at most 80% of the memory available).
  std::vector<std::vector<double>> profile;
  double pin_share = 0.5;
  bool warmup = false;
  // Lossy routing over what is resident, applied by the model on CPU decode steps with a cache
  // that cannot hold every expert (MoeParams has the rules): a miss computes with the token's
  // resident experts only (--miss-fallback); resident experts rank with +cache_bias (--cache-bias).
  bool miss_fallback = false;
  float cache_bias = 0.0f;
};

struct ExpertStats {
  uint64_t hits = 0, misses = 0;  // experts found in the cache / read from disk
  uint64_t bytes_read = 0;        // from the pack's expert files
  double io_busy_seconds = 0;     // wall time with at least one read in flight
  double wait_seconds = 0;        // time compute spent waiting for a read
  uint64_t cache_bytes = 0;       // memory held for expert slots (allocated so far)
  uint64_t budget_bytes = 0;      // the configured bound (0 = unbounded)
  // Lookahead (prefetch): experts guessed (each layer's latest guess), how many of them the layer
  // then chose, reads started for guesses not in memory, guesses read ahead that the layer then
  // asked for, and guesses read ahead but evicted before any use (their bytes were wasted).
  // reguessed: guesses a later guess of the same layer replaced (--lookahead-depth above 1).
  uint64_t predicted = 0, predicted_right = 0, reguessed = 0;
  uint64_t prefetch_reads = 0, prefetch_hits = 0, prefetch_wasted = 0;
  uint64_t bytes_wasted = 0;  // bytes read ahead, then evicted before any use
  uint64_t pinned = 0;  // experts the profile pins (read or not yet)
  // Miss fallback: layer steps that computed without some chosen experts, the experts so skipped,
  // and the background reads started for them (fetch_later).
  uint64_t fallbacks = 0, fallback_skipped = 0, fallback_reads = 0;
  double hit_rate() const { return hits + misses ? double(hits) / double(hits + misses) : 0; }
  double read_gb_per_s() const { return io_busy_seconds > 0 ? bytes_read / io_busy_seconds / 1e9 : 0; }
};

class ExpertStore : public ExpertProvider {
 public:
  virtual ExpertStats stats() const = 0;
  // Whether the cache cannot hold every expert (the lossy routing options act only then).
  virtual bool bounded() const = 0;
  // How often each (layer, expert) was requested so far: usage()[layer][expert].
  virtual std::vector<std::vector<uint64_t>> usage() const = 0;
};

// The expert cache's budget in MB (1e6 bytes) for a pack whose experts take `all_bytes` as the
// cache holds them (one slot each): `cache_mb` when given (>= 0); when not, unbounded (-1) while
// they fit in 80% of `available_bytes` (the memory available when the model loads), else that
// 80%, so that a model whose experts are larger than the machine streams them instead of growing
// past the memory (the share --warmup and the CUDA tier's pinned copies also keep to).
// available_bytes <= 0 (unknown): unbounded.
double default_expert_cache_mb(double cache_mb, double all_bytes, double available_bytes);

// The store over a pack's expert files, with a cache bounded by options.cache_mb.
std::unique_ptr<ExpertStore> make_expert_store(const PackManifest& pack, Backend& backend,
                                               const ExpertStoreOptions& options);

}  // namespace moestream
