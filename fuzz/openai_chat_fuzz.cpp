// POST /v1/chat/completions request bodies, up to the prompt's tokens: parse_body, the common
// fields (sampling, stop, stream, n, logprobs, response_format), messages and tools as templates
// expect them, tool_choice, chat_template_kwargs, the prompt rendered with a real chat template
// and encoded, max_tokens. Input: the body. An ApiError (HTTP 400) is the expected answer to a bad
// body, and its JSON error body is made as the handler makes it.
#include "api_fuzz.h"
#include "server/openai_api.cpp"  // NOLINT: the handler's helpers live in its unnamed namespace

namespace moestream {
namespace {

// chat_completions() up to resolve_max_tokens (which needs the engine).
void chat_request(ServedModel& m, const std::string& text) {
  const ojson body = parse_body(text);
  Common c = common_fields(m, body);
  ojson messages = template_messages(body);
  ojson tools = request_tools(body);
  bool parse_tools = !tools.is_null();
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const ojson& tc = body["tool_choice"];
    if (tc.is_string()) {
      const std::string s = tc.get<std::string>();
      if (s != "none" && s != "auto" && s != "required")
        throw ApiError(400, "tool_choice", "'tool_choice' must be none, auto, required or a function");
      if (s == "none") tools = nullptr, parse_tools = false;
    } else if (!tc.is_object()) {
      throw ApiError(400, "tool_choice", "'tool_choice' must be a string or an object");
    }
  }
  ojson kwargs = ojson::object();
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    if (!body["chat_template_kwargs"].is_object())
      throw ApiError(400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
    kwargs = body["chat_template_kwargs"];
  }
  if (body.contains("reasoning_effort")) kwargs["reasoning_effort"] = field::string(body, "reasoning_effort", "medium");

  const std::string prompt = render_chat(m, messages, tools, kwargs);
  c.options.prompt = m.encode_chat(prompt);
  std::string param;
  (void)requested_max_tokens(body, param);
  (void)parse_tools;
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
    chat_request(fixture.for_input(size), text);
  } catch (const ApiError& e) {
    (void)error_body(e.what(), "invalid_request_error", e.param, nullptr).dump();  // as guarded() does
  } catch (const std::exception& e) {
    fuzz::foreign_exception(e);  // the server would answer 500
  }
  return 0;
}
