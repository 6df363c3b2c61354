// The generation loop of `moestream run` and `demo`: prefill the prompt, then sample and decode
// one token at a time until max_tokens or an end-of-sequence id. (The server interleaves many
// sequences in its own loop, src/server/engine.cpp.)
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "models/model.h"
#include "text/sampler.h"

namespace moestream {

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated ids (the eos id that stopped it excluded)
  bool stopped_on_eos = false;
  int64_t prompt_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;  // decode: from the first sampled token on
  double prefill_tok_per_s() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0; }
  double decode_tok_per_s() const {
    // Each generated token after the first needed one decode forward pass.
    return decode_seconds > 0 && tokens.size() > 1 ? double(tokens.size() - 1) / decode_seconds : 0;
  }
};

// on_token(id) is called for each generated token as soon as it is sampled; return false to stop.
GenerationResult generate(Model& model, const std::vector<int32_t>& prompt, int max_tokens,
                          Sampler& sampler, const std::function<bool(int32_t)>& on_token);

}  // namespace moestream
