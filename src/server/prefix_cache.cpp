#include "server/prefix_cache.h"

#include <algorithm>

namespace moestream {

namespace {

int64_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return int64_t(i);
}

}  // namespace

int64_t PrefixCache::restore(std::span<const int32_t> prompt, SequenceState& state) {
  ++stats_.lookups;
  const int64_t limit = int64_t(prompt.size()) - 1;  // keep one token to compute logits from
  auto best = entries_.end();
  int64_t best_len = 0;
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    const int64_t held = int64_t(it->tokens.size());
    int64_t usable = std::min(common_prefix(it->tokens, prompt), limit);
    // A recurrent state cannot be rolled back: only the whole cached sequence is usable.
    if (usable < held && !it->state->can_truncate(usable)) usable = 0;
    if (usable > best_len) best = it, best_len = usable;
  }
  if (best == entries_.end()) {
    state.truncate(0);
    return 0;
  }
  state.restore_prefix(*best->state, best_len);
  entries_.splice(entries_.begin(), entries_, best);
  ++stats_.hits;
  stats_.reused_tokens += best_len;
  return best_len;
}

void PrefixCache::store(std::span<const int32_t> tokens, const SequenceState& state) {
  if (max_entries_ <= 0 || tokens.empty()) return;
  // Entries that this sequence extends are superseded.
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->tokens.size() <= tokens.size() && common_prefix(it->tokens, tokens) == int64_t(it->tokens.size()))
      it = entries_.erase(it);
    else
      ++it;
  }
  if (int(entries_.size()) >= max_entries_) entries_.pop_back();
  // A snapshot holds only what was computed. Sealed, it is never written again, so the states
  // restored from it may share its KV memory instead of copying it (SequenceState::seal).
  std::unique_ptr<SequenceState> snapshot = state.clone(state.n_past);
  snapshot->seal();
  entries_.push_front(Entry{std::vector<int32_t>(tokens.begin(), tokens.end()), std::move(snapshot)});
}

int64_t PrefixCache::kv_bytes() const {
  int64_t n = 0;
  for (const Entry& e : entries_) n += e.state->held_bytes() - e.state->bytes_at(0);
  return n;
}

bool PrefixCache::drop_oldest() {
  if (entries_.empty()) return false;
  entries_.pop_back();
  return true;
}

PrefixCache::Stats PrefixCache::stats() const {
  Stats s = stats_;
  s.entries = int(entries_.size());
  return s;
}

}  // namespace moestream
