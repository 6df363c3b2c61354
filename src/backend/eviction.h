// Eviction policies for expert caches (the ExpertStore's host slots, the CUDA tier's VRAM slots):
// which unpinned cached expert gives up its slot. Each cached expert is described by when it was
// last used and how often it has been used (counted since the start, also across evictions); the
// lowest priority is evicted.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moestream {

struct ExpertUse {
  uint64_t last_use = 0;  // request tick of the last use
  uint64_t uses = 0;      // number of requests that included the expert
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  // Higher keeps; `now` is the current request tick, ticks_per_token the MoE layers per token.
  virtual double priority(const ExpertUse& use, uint64_t now, double ticks_per_token) const = 0;
};

// lru: most recent use; lfu: use count (recency breaks ties);
// lcp: uses * 0.25^(age_in_tokens / 128), mlx-moe's frequency-times-recency rule.
std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& name);

// The experts a usage profile (counts[layer][expert]) pins in a cache of `slots` slots: its
// hottest (count > 0, ties in layer then expert order), at most share * slots of them and never
// every slot. Marks [layer][expert] shaped as the profile; `pinned` gets how many.
std::vector<std::vector<char>> hottest_experts(const std::vector<std::vector<double>>& profile, double share,
                                               size_t slots, size_t& pinned);

}  // namespace moestream
