// Choosing the next token from logits: greedy, or temperature sampling after repetition penalty,
// presence / frequency penalties and logit bias (OpenAI's), top-k, top-p (nucleus) and min-p
// filtering, with a seeded generator so runs repeat exactly.
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
  // The repetition penalty looks at the last repeat_last_n tokens of the context: -1 all of it (as
  // transformers and vLLM), 0 none (llama.cpp's repeat_last_n, whose default is 64).
  int repeat_last_n = -1;
  // OpenAI's: logit -= frequency_penalty * count + presence_penalty * (count > 0), where count is
  // how often the token was generated so far (the prompt does not count). In [-2, 2].
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<std::pair<int32_t, float>> logit_bias;  // token id -> added to its logit, [-100, 100]
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // context: the tokens so far (for the repetition penalty); generated: those of them the model
  // generated (for the presence and frequency penalties). The penalties and the bias apply to the
  // logits before the temperature, in that order. logits may be modified. Throws Error when a
  // logit is NaN or +inf, or all are -inf (see check_logits).
  int32_t sample(std::span<float> logits, std::span<const int32_t> context,
                 std::span<const int32_t> generated = {});
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // reused between calls
  std::vector<char> seen_;
  std::vector<int32_t> counts_;
};

// Throws Error "logits contain NaN at token id 5 (of 151936): ..." when a logit is NaN or +inf,
// and when there are none or all are -inf (masked). One pass over the vocabulary.
void check_logits(std::span<const float> logits);

// The greedy choice (the lowest id of the largest logit) after check_logits.
int32_t greedy_choice(std::span<const float> logits);

// True when params choose greedily with nothing that changes the logits first (no penalties, no
// bias): the choice is then greedy_choice of the model's logits.
bool plain_greedy(const SamplingParams& params);

// Throws Error naming the parameter when a value is out of range (temperature < 0, top_p not in
// (0, 1], min_p not in [0, 1], repetition_penalty <= 0, repeat_last_n < -1, top_k < 0, presence or frequency penalty
// not in [-2, 2], a logit_bias value not in [-100, 100] or a negative token id).
void validate(const SamplingParams& params);

}  // namespace moestream
