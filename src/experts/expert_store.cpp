#include "experts/expert_store.h"

#include "core/error.h"
#include "io/safetensors.h"

namespace moestream {

namespace {

class ResidentExpertStore final : public ExpertStore {
 public:
  ResidentExpertStore(std::vector<std::vector<MlpWeights>> experts, int n_experts)
      : experts_(std::move(experts)), n_experts_(n_experts) {}

  int n_layers() const override { return int(experts_.size()); }
  int n_experts() const override { return n_experts_; }

  void fetch(int layer, std::span<const int> ids, std::vector<MlpWeights>& out) override {
    const auto& layer_experts = experts_.at(layer);
    if (layer_experts.empty()) fail("layer ", layer, " has no routed experts");
    out.clear();
    for (int e : ids) {
      if (e < 0 || e >= n_experts_) fail("layer ", layer, ": expert ", e, " out of range");
      out.push_back(layer_experts[e]);
    }
  }

 private:
  std::vector<std::vector<MlpWeights>> experts_;  // [layer][expert]; empty for dense layers
  int n_experts_;
};

}  // namespace

std::unique_ptr<ExpertStore> make_resident_expert_store(const WeightSet& weights, Backend& backend,
                                                        const std::vector<bool>& moe_layers,
                                                        int n_experts, int64_t hidden,
                                                        int64_t intermediate,
                                                        const ExpertNaming& names) {
  std::vector<std::vector<MlpWeights>> experts(moe_layers.size());
  for (size_t l = 0; l < moe_layers.size(); ++l) {
    if (!moe_layers[l]) continue;
    for (int e = 0; e < n_experts; ++e) {
      ExpertNames n = names(int(l), e);
      const TensorView& gate = weights.get(n.gate);
      const TensorView& up = weights.get(n.up);
      const TensorView& down = weights.get(n.down);
      check_shape(gate, {intermediate, hidden});
      check_shape(up, {intermediate, hidden});
      check_shape(down, {hidden, intermediate});
      experts[l].push_back(MlpWeights{backend.load_matrix(gate), backend.load_matrix(up),
                                      backend.load_matrix(down)});
    }
  }
  return std::make_unique<ResidentExpertStore>(std::move(experts), n_experts);
}

}  // namespace moestream
