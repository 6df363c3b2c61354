// POST /v1/chat/completions request bodies, up to the model: parse_body and parse_chat_request
// (the common fields, logprobs, messages and tools as templates expect them, tool_choice with the
// grammar of a forced or strict call, response_format, chat_template_kwargs, the prompt rendered
// with a real chat template and encoded, the context shift, max_tokens). Input: the body. An
// ApiError (HTTP 400) is the expected answer to a bad body, and its JSON error body is made as
// the handler makes it.
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
    (void)parse_chat_request(fixture.for_input(size), body, fuzz::ApiFixture::kCtx);
  } catch (const ApiError& e) {
    (void)openai_error_body(e.what(), "invalid_request_error", e.param, nullptr).dump();  // as the handler's catch does
  } catch (const std::exception& e) {
    fuzz::foreign_exception(e);  // the server would answer 400 (a JSON type error) or 500
  }
  return 0;
}
