#include "text/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/error.h"

namespace moestream {

void validate(const SamplingParams& p) {
  if (!(p.temperature >= 0)) fail("temperature must be >= 0, got ", p.temperature);
  if (p.top_k < 0) fail("top_k must be >= 0, got ", p.top_k);
  if (!(p.top_p > 0 && p.top_p <= 1)) fail("top_p must be in (0, 1], got ", p.top_p);
  if (!(p.min_p >= 0 && p.min_p <= 1)) fail("min_p must be in [0, 1], got ", p.min_p);
  if (!(p.repetition_penalty > 0))
    fail("repetition_penalty must be > 0, got ", p.repetition_penalty);
  if (p.repeat_last_n < -1) fail("repeat_last_n must be >= -1, got ", p.repeat_last_n);
  if (!(p.presence_penalty >= -2 && p.presence_penalty <= 2))
    fail("presence_penalty must be in [-2, 2], got ", p.presence_penalty);
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2))
    fail("frequency_penalty must be in [-2, 2], got ", p.frequency_penalty);
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0) fail("logit_bias: token id ", id, " is negative");
    if (!(bias >= -100 && bias <= 100)) fail("logit_bias for token ", id, " must be in [-100, 100], got ", bias);
  }
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  validate(params);
}

void check_logits(std::span<const float> logits) {
  if (logits.empty()) fail("sampler: the logits are empty");
  // -inf is fine (a masked token); NaN and +inf mean the model's numbers broke, and comparing
  // them would silently choose token 0. One pass on the bits, which vectorizes (about 30 us for
  // 152k logits, 4x faster than float compares); the search for the culprit runs only on failure.
  uint32_t broken = 0, all_masked = 1;
  for (float x : logits) {
    const uint32_t b = std::bit_cast<uint32_t>(x);
    const uint32_t minus_inf = b == 0xFF800000u;
    broken |= uint32_t((b & 0x7F800000u) == 0x7F800000u) & (minus_inf ^ 1u);  // exponent all ones
    all_masked &= minus_inf;
  }
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (broken) {
    for (size_t i = 0; i < logits.size(); ++i)
      if (!(logits[i] < kInf))
        fail("logits contain ", std::isnan(logits[i]) ? "NaN" : "Inf", " at token id ", i, " (of ",
             logits.size(), "): the model produced invalid numbers");
  }
  if (all_masked) fail("all logits are -inf (of ", logits.size(), "): no token can be sampled");
}

int32_t greedy_choice(std::span<const float> logits) {
  check_logits(logits);
  return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

bool plain_greedy(const SamplingParams& p) {
  return p.temperature <= 0 && p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f &&
         p.frequency_penalty == 0.0f && p.logit_bias.empty();
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> context,
                        std::span<const int32_t> generated) {
  check_logits(logits);
  const int32_t n = int32_t(logits.size());
  if (params_.repetition_penalty != 1.0f) {
    // Each distinct token of the context's last repeat_last_n is penalized once, as transformers
    // does over the whole context.
    const float pen = params_.repetition_penalty;
    const size_t last = params_.repeat_last_n < 0 ? context.size()
                                                  : std::min(context.size(), size_t(params_.repeat_last_n));
    seen_.assign(size_t(n), 0);
    for (int32_t id : context.last(last)) {
      if (id < 0 || id >= n || seen_[size_t(id)]) continue;
      seen_[size_t(id)] = 1;
      float& l = logits[size_t(id)];
      l = l > 0 ? l / pen : l * pen;
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    counts_.assign(size_t(n), 0);
    for (int32_t id : generated)
      if (id >= 0 && id < n) ++counts_[size_t(id)];
    for (int32_t id : generated) {
      if (id < 0 || id >= n || counts_[size_t(id)] == 0) continue;
      logits[size_t(id)] -= params_.frequency_penalty * float(counts_[size_t(id)]) + params_.presence_penalty;
      counts_[size_t(id)] = 0;  // once per distinct token
    }
  }
  // -100 bans a token in practice; a masked (-inf) token stays masked whatever its bias.
  for (const auto& [id, bias] : params_.logit_bias)
    if (id < n) logits[size_t(id)] += bias;
  if (params_.temperature <= 0) {
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }

  auto& c = candidates_;
  c.resize(size_t(n));
  for (int32_t i = 0; i < n; ++i) c[size_t(i)] = {logits[size_t(i)] / params_.temperature, i};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = c.size();
  if (params_.top_k > 0 && size_t(params_.top_k) < keep) {
    keep = size_t(params_.top_k);
    std::partial_sort(c.begin(), c.begin() + long(keep), c.end(), by_logit);
  } else {
    std::sort(c.begin(), c.end(), by_logit);
  }
  // Softmax over the kept candidates (sorted, most likely first).
  const float mx = c[0].first;
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) sum += (c[i].first = std::exp(c[i].first - mx));
  for (size_t i = 0; i < keep; ++i) c[i].first = float(c[i].first / sum);
  if (params_.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < keep; ++i) {
      cum += c[i].first;
      if (cum >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (params_.min_p > 0) {
    const float floor = params_.min_p * c[0].first;
    size_t i = 1;
    while (i < keep && c[i].first >= floor) ++i;
    keep = i;
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += c[i].first;
  double r = std::uniform_real_distribution<double>(0.0, total)(rng_);
  for (size_t i = 0; i < keep; ++i) {
    r -= c[i].first;
    if (r < 0) return c[i].second;
  }
  return c[keep - 1].second;
}

}  // namespace moestream
