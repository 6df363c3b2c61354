#include "models/generate.h"

#include <algorithm>
#include <chrono>

#include "backend/backend.h"
#include "core/error.h"

namespace moestream {

GenerationResult generate(Model& model, const std::vector<int32_t>& prompt, int max_tokens,
                          Sampler& sampler, const std::function<bool(int32_t)>& on_token) {
  if (prompt.empty()) fail("the prompt is empty: give at least one token");
  if (max_tokens < 0) fail("the number of tokens to generate must be >= 0, got ", max_tokens);
  using clock = std::chrono::steady_clock;
  const auto& info = model.info();
  GenerationResult r;
  r.prompt_tokens = int64_t(prompt.size());
  auto state = model.new_sequence(int64_t(prompt.size()) + max_tokens);
  std::vector<float> logits(size_t(info.vocab_size));
  std::vector<int32_t> context = prompt;
  context.reserve(prompt.size() + size_t(max_tokens));

  // Plain greedy choices are made where the logits are (on a GPU only the id comes back).
  const bool greedy = plain_greedy(sampler.params());
  int32_t greedy_id = -1;
  auto forward = [&](std::span<const int32_t> tokens) {
    if (!greedy) return model.forward(tokens, *state, logits);
    const SequenceBatch item{tokens, state.get(), {}, &greedy_id};
    model.forward_batch(std::span(&item, 1));
  };

  auto t0 = clock::now();
  forward(prompt);
  auto t1 = clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  for (int i = 0; i < max_tokens; ++i) {
    int32_t next = greedy_id;
    if (!greedy) {
      ScopedTimer timer(model.backend().times().sampling);
      next = sampler.sample(logits, context);
    }
    if (std::find(info.eos_token_ids.begin(), info.eos_token_ids.end(), next) !=
        info.eos_token_ids.end()) {
      r.stopped_on_eos = true;
      break;
    }
    r.tokens.push_back(next);
    context.push_back(next);
    if (!on_token(next) || i + 1 == max_tokens) break;
    forward(std::span<const int32_t>(&next, 1));
  }
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return r;
}

}  // namespace moestream
