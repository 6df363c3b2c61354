#include "io/expert_tiers.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"

namespace moestream {

std::vector<std::vector<double>> read_usage_profile(const std::string& path) {
  const std::optional<std::string> text = try_read_file(path);
  if (!text) fail(path, ": cannot read the profile");
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("counts") || !j["counts"].is_array())
    fail(path, ": not a usage profile (a JSON object with counts[layer][expert])");
  std::vector<std::vector<double>> counts;
  for (const auto& layer : j["counts"]) {
    if (!layer.is_array()) fail(path, ": counts[", counts.size(), "] is not an array");
    std::vector<double>& row = counts.emplace_back();
    for (const auto& c : layer) {
      if (!c.is_number() || c.get<double>() < 0) fail(path, ": counts[", counts.size() - 1, "] holds a value that is not a count");
      row.push_back(c.get<double>());
    }
  }
  return counts;
}

std::vector<std::vector<int>> tier_bits(const std::vector<std::vector<double>>& counts, double hot_share,
                                        int hot_bits, int cold_bits) {
  if (!(hot_share >= 0 && hot_share <= 1)) fail("--hot-share: ", hot_share, " is not between 0 and 1");
  std::vector<std::vector<int>> bits;
  for (const std::vector<double>& layer : counts) {
    std::vector<int>& row = bits.emplace_back(layer.size(), cold_bits);
    std::vector<int> order(layer.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return layer[size_t(a)] > layer[size_t(b)]; });
    const size_t hot = size_t(std::ceil(hot_share * double(layer.size()) - 1e-9));
    for (size_t i = 0; i < hot; ++i) row[size_t(order[i])] = hot_bits;
  }
  return bits;
}

}  // namespace moestream
