// Sequence states of recent requests, keyed by the tokens they hold, so that a request sharing a
// prefix with an earlier one (the next turn of a conversation, the same system prompt) prefills
// only what is new. Attention-only models can reuse any shared prefix (the state is truncated);
// models with recurrent state (DeltaNet) only a whole cached sequence that the prompt extends.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <vector>

#include "models/model.h"

namespace moestream {

class PrefixCache {
 public:
  explicit PrefixCache(int max_entries) : max_entries_(max_entries) {}

  // Makes `state` hold the longest usable cached prefix of `prompt`, leaving at least one prompt
  // token to process (its logits are needed), and returns that prefix's length; 0 (state reset)
  // when nothing is usable.
  int64_t restore(std::span<const int32_t> prompt, SequenceState& state);

  // Keeps a copy of `state`, which holds `tokens`. Entries that are prefixes of `tokens` are
  // superseded and dropped; the least recently used entry goes when the cache is full.
  void store(std::span<const int32_t> tokens, const SequenceState& state);

  // KV memory the cached states hold: held_bytes() beyond what each holds with no position
  // (the fixed recurrent states of hybrid models are not KV memory).
  int64_t kv_bytes() const;
  // Drops the least recently used entry; false when there is none.
  bool drop_oldest();

  struct Stats {
    int entries = 0;
    int64_t lookups = 0, hits = 0, reused_tokens = 0;
  };
  Stats stats() const;

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    std::unique_ptr<SequenceState> state;
  };
  int max_entries_;
  std::list<Entry> entries_;  // most recently used first
  Stats stats_;
};

}  // namespace moestream
