// Where a backend's moe() gets routed-expert weights: the request / next / release contract.
// Both backends call it; src/experts implements it (ExpertStore, over a pack's expert files), so
// the backends never depend on how experts are cached or read. An expert is addressed by
// (layer, expert); the caller never learns whether it came from a cache or from disk.
//
// Protocol for one MoE layer:
//   experts.request(layer, ids);               // hits are ready at once; misses go to I/O together
//   while (experts.next(e, weights)) { compute(e, weights); experts.release(e); }
// next() hands out experts as they become ready (cached ones first, so compute overlaps the reads
// still in flight). Releasing before the next call lets a cache smaller than the layer's set of
// experts cycle its slots. An expert's weights stay valid until it is released.
#pragma once

#include <functional>
#include <span>

#include "backend/backend.h"

namespace moestream {

class ExpertProvider {
 public:
  virtual ~ExpertProvider() = default;
  // Starts the request for `experts` of `layer`.
  virtual void request(int layer, std::span<const int> experts) = 0;
  // The next ready expert of the current request; false once all were handed out. Throws Error
  // naming layer and expert on a failed read or a checksum mismatch.
  virtual bool next(int& expert, MlpWeights& weights) = 0;
  // The caller is done with `expert`'s weights.
  virtual void release(int expert) = 0;

  // For the lossy routing options (MoeParams::cache_bias, miss_fallback). resident() sets
  // out[e] to 1 for each expert of `layer` whose weights are in memory now (a request for it
  // would not wait for a read), else 0; fetch_later() names experts the routing skipped for not
  // being resident, to be read in the background for later tokens. A provider that never
  // misses keeps these defaults.
  virtual void resident(int layer, std::span<char> out) const {
    (void)layer;
    for (char& r : out) r = 1;
  }
  virtual void fetch_later(int layer, std::span<const int> experts) {
    (void)layer;
    (void)experts;
  }

  // Lookahead. wants_prefetch(): whether guesses of a later layer's experts can help (a bounded
  // cache that reads ahead). prefetch(): a guess of the experts `layer` will request next, the
  // likeliest first; reads for those not in memory (the provider may read only the likeliest of
  // them) start once every read of the current request has started (at once between requests),
  // nearer layers first, into slots the eviction policy frees; a guess replaces the layer's
  // previous one. Guesses never fail a request: a failed read ahead is forgotten and retried
  // when asked for.
  virtual bool wants_prefetch() const { return false; }
  virtual void prefetch(int layer, std::span<const int> experts) {
    (void)layer;
    (void)experts;
  }

  // Whether every expert handed out stays at its address, unchanged, for the provider's life (a
  // cache that never evicts), in memory from Backend::alloc_host. A backend may then keep the
  // weights' addresses and read them in place later without asking again.
  virtual bool lasting() const { return false; }
  // Shows `seen` the weights of each of `experts` of `layer` (read now where needed), as a
  // request would, but without counting them as the model's use: for a backend that keeps a
  // lasting provider's addresses. Call it between requests.
  virtual void preload(int layer, std::span<const int> experts, const std::function<void(int, const MlpWeights&)>& seen) {
    request(layer, experts);
    int e;
    MlpWeights w;
    while (next(e, w)) {
      seen(e, w);
      release(e);
    }
  }
};

}  // namespace moestream
