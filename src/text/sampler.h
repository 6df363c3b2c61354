// Choosing the next token from logits: greedy, or temperature sampling after repetition penalty,
// top-k, top-p (nucleus) and min-p filtering, with a seeded generator so runs repeat exactly.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace moestream {

struct SamplingParams {
  float temperature = 0.0f;        // <= 0: greedy (argmax, first index on ties)
  int top_k = 0;                   // keep the k most likely tokens; 0 = all
  float top_p = 1.0f;              // keep the smallest set whose probability reaches top_p
  float min_p = 0.0f;              // drop tokens below min_p * p(most likely)
  float repetition_penalty = 1.0f; // > 1 discourages tokens already in the context (as transformers)
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // context: the tokens so far (for the repetition penalty). logits may be modified. Throws
  // Error when a logit is NaN or +inf, or all are -inf (see check_logits).
  int32_t sample(std::span<float> logits, std::span<const int32_t> context);
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // reused between calls
  std::vector<char> seen_;
};

// Throws Error "logits contain NaN at token id 5 (of 151936): ..." when a logit is NaN or +inf,
// and when there are none or all are -inf (masked). One pass over the vocabulary.
void check_logits(std::span<const float> logits);

// Throws Error naming the parameter when a value is out of range (temperature < 0, top_p not in
// (0, 1], min_p not in [0, 1], repetition_penalty <= 0, top_k < 0).
void validate(const SamplingParams& params);

}  // namespace moestream
