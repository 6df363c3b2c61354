// pack --tiered: the most used experts of each layer at more bits than the rest, from a usage
// profile (the JSON that --profile-out and `moestream profile` write: counts[layer][expert]).
#pragma once

#include <string>
#include <vector>

namespace moestream {

// counts[layer][expert] of the profile at `path`; an Error naming the file and what is wrong.
std::vector<std::vector<double>> read_usage_profile(const std::string& path);

// Bits per expert: in each layer the ceil(hot_share * experts) most used (ties: the lower id) get
// hot_bits, the others cold_bits. Layers without counts stay empty. hot_share in [0, 1].
std::vector<std::vector<int>> tier_bits(const std::vector<std::vector<double>>& counts, double hot_share,
                                        int hot_bits, int cold_bits);

}  // namespace moestream
