// POST /v1/messages (Anthropic) request bodies, up to the model: parse_body and
// parse_messages_request (max_tokens, sampling, stop_sequences, messages with text, thinking,
// tool_use and tool_result blocks and the system prompt as templates expect them, tools,
// tool_choice with a forced call's grammar, thinking, the prompt rendered with a real chat
// template and encoded, the context shift, max_tokens; count_tokens' parsing is the same
// but for the fields it takes). Input: the body; an ApiError (HTTP 400) is the expected answer.
#include "api_fuzz.h"
#include "server/requests.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)moestream::fuzz::ApiFixture::get();  // loading is not part of an input's time
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moestream;
  fuzz::ApiFixture& fixture = fuzz::ApiFixture::get();
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const ojson body = parse_body(text);
    (void)parse_messages_request(fixture.for_input(size), body, fuzz::ApiFixture::kCtx);
  } catch (const ApiError& e) {
    (void)anthropic_error_body("invalid_request_error", e.what()).dump();  // as the handler's catch does
  } catch (const std::exception& e) {
    fuzz::foreign_exception(e);  // the server would answer 400 (a JSON type error) or 500
  }
  return 0;
}
