// POST /v1/messages (Anthropic) request bodies, up to the prompt's tokens: parse_body,
// max_tokens, sampling, stop_sequences, messages (text, tool_use and tool_result blocks) and the
// system prompt as templates expect them, tools, tool_choice, thinking, the prompt rendered with
// a real chat template and encoded. Input: the body; an ApiError (HTTP 400) is the expected answer.
#include "api_fuzz.h"
#include "server/anthropic_api.cpp"  // NOLINT: the handler's helpers live in its unnamed namespace

namespace moestream {
namespace {

// messages() up to resolve_max_tokens (which needs the engine).
void messages_request(ServedModel& m, const std::string& text) {
  const ojson body = parse_body(text);
  if (!body.contains("max_tokens")) throw ApiError(400, "max_tokens", "'max_tokens' is required");
  (void)field::integer(body, "max_tokens", 0, 1, INT32_MAX);
  GenerateOptions o;
  o.sampling = request_sampling(m, body, 1.0);
  o.stop = field::string_or_list(body, "stop_sequences", 16);
  (void)field::boolean(body, "stream", false);
  ojson messages = template_messages(body);
  ojson tools = request_tools(body);
  if (body.contains("tool_choice") && body["tool_choice"].is_object() && body["tool_choice"].value("type", "") == "none")
    tools = nullptr;
  ojson kwargs = ojson::object();
  if (body.contains("thinking") && body["thinking"].is_object())
    kwargs["enable_thinking"] = body["thinking"].value("type", "") == "enabled";
  const std::string prompt = render_chat(m, messages, tools, kwargs);
  o.prompt = m.encode_chat(prompt);
  (void)prompt_opens_reasoning(prompt);
}

}  // namespace
}  // namespace moestream

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)moestream::fuzz::ApiFixture::get();  // loading is not part of an input's time
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moestream;
  fuzz::ApiFixture& fixture = fuzz::ApiFixture::get();
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    messages_request(fixture.for_input(size), text);
  } catch (const ApiError& e) {
    (void)error_body("invalid_request_error", e.what()).dump();  // as the handler's catch does
  } catch (const std::exception& e) {
    fuzz::foreign_exception(e);  // the server would answer 500
  }
  return 0;
}
