// Each endpoint's request body read into what generation needs, with every 400 a request can get
// before the model runs (the prompt rendered, encoded and fitted to the context included). The
// handlers call these, and so do the fuzz targets (fuzz/openai_*_fuzz.cpp,
// anthropic_messages_fuzz.cpp), so fuzzing covers what a request does up to the model.
#pragma once

#include <string>

#include "server/api.h"

namespace moestream {

// The oldest turns left out so that a conversation fits the context (server/context_shift.h):
// how many of the request's messages, 0 when none. Answers say so in the Moestream-Context-Shift
// header and a "context_shift" member of the body.
constexpr const char* kShiftHeader = "Moestream-Context-Shift";
struct ShiftNote {
  int dropped_messages = 0;
  int64_t ctx = 0;
  ojson json() const { return {{"dropped_messages", dropped_messages}, {"ctx", ctx}}; }
};

// /v1/chat/completions
struct ChatRequest {
  GenerateOptions options;  // prompt, sampling, stop, constraints, tool flags, max_tokens, logprobs
  bool stream = false, include_usage = false;
  bool logprobs = false;
  int n = 1;           // choices
  std::string user;    // shown in the request's log line
  std::string prompt;  // rendered
  ShiftNote shift;
};
ChatRequest parse_chat_request(const ServedModel& m, const ojson& body, int64_t ctx);

// /v1/completions (no context shift: a raw prompt has no turns to leave out; too long is a 400)
struct CompletionRequest {
  GenerateOptions options;
  bool stream = false, include_usage = false;
  int n = 1;
  std::string user;
};
CompletionRequest parse_completion_request(const ServedModel& m, const ojson& body, int64_t ctx);

// /v1/messages
struct MessagesRequest {
  GenerateOptions options;
  bool stream = false;
  std::string prompt;
  ShiftNote shift;
};
MessagesRequest parse_messages_request(const ServedModel& m, const ojson& body, int64_t ctx);
// /v1/messages/count_tokens: the prompt's tokens, the whole conversation (counting shifts nothing).
int64_t parse_count_tokens_request(const ServedModel& m, const ojson& body);

// The JSON error bodies the two APIs answer an ApiError with.
ojson openai_error_body(const std::string& message, const std::string& type, const std::string& param, ojson code);
ojson anthropic_error_body(const std::string& type, const std::string& message);

// Context shift: prompt and o.prompt hold the conversation (`messages`) rendered and encoded; when
// they leave less room than the reply needs in ctx (`requested` max_tokens, else
// shift_reply_room), the oldest turns are left out and both are replaced by the rendering of the
// fewest that fit. origin: as ContextShift takes it. A prompt that cannot fit even then is left
// for resolve_max_tokens to refuse.
void shift_to_fit(const ServedModel& m, const ojson& messages, const std::vector<size_t>& origin, const ojson& tools,
                  const ojson& kwargs, int64_t ctx, std::optional<int64_t> requested, std::string& prompt,
                  GenerateOptions& o, ShiftNote& shift);

}  // namespace moestream
