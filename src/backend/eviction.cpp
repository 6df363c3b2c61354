#include "backend/eviction.h"

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

}  // namespace moestream
