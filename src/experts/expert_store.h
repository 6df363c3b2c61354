// ExpertStore: the only path from model code to routed-expert weights. An expert is addressed by
// (layer, expert); the model asks for the experts a layer needs and never learns whether they
// came from a resident mapping, a RAM cache or disk.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace moestream {

class WeightSet;

class ExpertStore {
 public:
  virtual ~ExpertStore() = default;
  virtual int n_layers() const = 0;
  virtual int n_experts() const = 0;
  // Makes `experts` of `layer` available, in the same order. The views stay valid until the next
  // fetch call (a streaming store reuses the memory then).
  virtual void fetch(int layer, std::span<const int> experts, std::vector<MlpWeights>& out) = 0;
};

// Tensor names of one expert's gate/up/down weights in a checkpoint.
struct ExpertNames {
  std::string gate, up, down;
};
// Returns the names for (layer, expert); layers without routed experts are not asked.
using ExpertNaming = std::function<ExpertNames(int layer, int expert)>;

// All experts resident: views into the memory-mapped checkpoint, checked once at load.
// moe_layers[l] is false for dense layers (never fetched).
std::unique_ptr<ExpertStore> make_resident_expert_store(const WeightSet& weights, Backend& backend,
                                                        const std::vector<bool>& moe_layers,
                                                        int n_experts, int64_t hidden,
                                                        int64_t intermediate,
                                                        const ExpertNaming& names);

}  // namespace moestream
