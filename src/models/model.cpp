// Model's default batched step: each item through forward in turn.
#include "models/model.h"

#include "core/error.h"
#include "text/sampler.h"

namespace moestream {

void Model::forward_batch(std::span<const SequenceBatch> items) {
  std::vector<float> last;
  for (const SequenceBatch& it : items) {
    if (!it.greedy) {
      forward(it.tokens, *it.state, it.logits);
      continue;
    }
    if (!it.logits.empty()) fail("forward: an item asks for logits and a greedy token; give one");
    last.resize(size_t(info().vocab_size));
    forward(it.tokens, *it.state, last);
    if (!it.tokens.empty()) *it.greedy = greedy_choice(last);
  }
}

}  // namespace moestream
