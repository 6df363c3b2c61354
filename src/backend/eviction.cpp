#include "backend/eviction.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moestream {

namespace {

class Lru final : public EvictionPolicy {
 public:
  double priority(const ExpertUse& u, uint64_t, double) const override { return double(u.last_use); }
};

class Lfu final : public EvictionPolicy {
 public:
  double priority(const ExpertUse& u, uint64_t now, double) const override {
    // Recency only breaks ties between equal counts: it adds less than one use.
    return double(u.uses) + double(u.last_use) / (double(now) + 1.0);
  }
};

class Lcp final : public EvictionPolicy {
 public:
  double priority(const ExpertUse& u, uint64_t now, double ticks_per_token) const override {
    const double age_tokens = double(now - u.last_use) / ticks_per_token;
    return double(u.uses) * std::pow(0.25, age_tokens / 128.0);
  }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_eviction_policy(const std::string& name) {
  if (name == "lru") return std::make_unique<Lru>();
  if (name == "lfu") return std::make_unique<Lfu>();
  if (name == "lcp") return std::make_unique<Lcp>();
  fail("--cache-policy: unknown policy '", name, "' (expected lru, lfu or lcp)");
}

std::vector<std::vector<char>> hottest_experts(const std::vector<std::vector<double>>& profile, double share,
                                               size_t slots, size_t& pinned) {
  struct Hot {
    double count;
    int layer, expert;
  };
  std::vector<Hot> all;
  std::vector<std::vector<char>> hot(profile.size());
  for (size_t l = 0; l < profile.size(); ++l) {
    hot[l].assign(profile[l].size(), 0);
    for (size_t e = 0; e < profile[l].size(); ++e)
      if (profile[l][e] > 0) all.push_back({profile[l][e], int(l), int(e)});
  }
  std::stable_sort(all.begin(), all.end(), [](const Hot& a, const Hot& b) { return a.count > b.count; });
  pinned = std::min({all.size(), size_t(std::clamp(share, 0.0, 1.0) * double(slots)), slots > 0 ? slots - 1 : 0});
  for (size_t i = 0; i < pinned; ++i) hot[size_t(all[i].layer)][size_t(all[i].expert)] = 1;
  return hot;
}

}  // namespace moestream
