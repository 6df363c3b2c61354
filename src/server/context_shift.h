// Context shift: when a conversation outgrows the context, the oldest turns after the system
// prompt are left out and the rest is rendered again (serve's chat endpoints, moestream chat).
//
// A turn here is an exchange: a user message and everything after it up to the next user
// message (the assistant's reply, its tool calls and their results), so a tool call is never
// separated from its result and what follows the system prompt still starts with a user message,
// as templates that check roles alternate require. The leading system messages and the last
// exchange (the latest user message and what follows it) are always kept.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <vector>

namespace moestream {

// Room for the reply that a shift makes when the request gives no max_tokens: a quarter of the
// context, at most this many tokens.
constexpr int64_t kShiftReplyTokens = 256;
inline int64_t shift_reply_room(int64_t ctx) { return std::min<int64_t>(kShiftReplyTokens, ctx / 4); }

class ContextShift {
 public:
  // messages: the conversation as the template takes it. origin[i]: the request message that
  // messages[i] came from (a request message may become several, e.g. Anthropic's tool results);
  // empty: one each. A message starts an exchange when it has role "user" and is the first of its
  // request message.
  explicit ContextShift(const nlohmann::ordered_json& messages, std::vector<size_t> origin = {});
  // How many exchanges can be left out.
  int droppable() const { return int(cuts_.size()) - 1; }
  // The conversation without its `k` oldest exchanges.
  nlohmann::ordered_json kept(int k) const;
  // How many request messages those k exchanges hold.
  int dropped_messages(int k) const;

 private:
  const nlohmann::ordered_json& messages_;
  std::vector<size_t> origin_;
  std::vector<size_t> cuts_;  // cuts_[k]: the first message kept after the system prompt when k are dropped
  size_t system_end_ = 0;     // messages [0, system_end_) are the system prompt
};

// The fewest exchanges to leave out, in [0, n], for which fits(k) holds; n when none does.
// fits must be monotone (true from some k on), as a prompt's length is in what it holds; a binary
// search, so a long conversation is rendered a few times, not once per exchange.
int fewest_to_drop(int n, const std::function<bool(int)>& fits);

}  // namespace moestream
