// POST /v1/completions request bodies, up to the prompt's tokens: parse_body, the common fields,
// the prompt (a string, a list of one string, or token ids) encoded with a real tokenizer,
// echo/suffix, max_tokens. Input: the body; an ApiError (HTTP 400) is the expected answer.
#include "api_fuzz.h"
#include "server/openai_api.cpp"  // NOLINT: the handler's helpers live in its unnamed namespace

namespace moestream {
namespace {

// completions() up to resolve_max_tokens (which needs the engine); the tokenizer's vocabulary
// stands in for the model's.
void completion_request(ServedModel& m, const std::string& text) {
  const ojson body = parse_body(text);
  Common c = common_fields(m, body);
  if (!body.contains("prompt") || body["prompt"].is_null()) throw ApiError(400, "prompt", "'prompt' is required");
  const ojson& p = body["prompt"];
  const int64_t vocab_size = m.tokenizer->vocab_size();
  if (p.is_string()) {
    c.options.prompt = m.encode_text(p.get<std::string>());
  } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
    c.options.prompt = m.encode_text(p[0].get<std::string>());
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    for (const auto& t : p) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab_size)
        throw ApiError(400, "prompt", "'prompt' token ids must be integers in [0, " + std::to_string(vocab_size) + ")");
      c.options.prompt.push_back(int32_t(t.get<int64_t>()));
    }
  } else {
    throw ApiError(400, "prompt", "'prompt' must be a string, a list of one string, or a list of token ids");
  }
  if (c.options.prompt.empty()) throw ApiError(400, "prompt", "'prompt' is empty");
  if (field::boolean(body, "echo", false)) throw ApiError(400, "echo", "'echo' is not supported");
  if (body.contains("suffix") && !body["suffix"].is_null()) throw ApiError(400, "suffix", "'suffix' is not supported");
  std::string param;
  (void)requested_max_tokens(body, param);
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
    completion_request(fixture.for_input(size), text);
  } catch (const ApiError& e) {
    (void)error_body(e.what(), "invalid_request_error", e.param, nullptr).dump();  // as guarded() does
  } catch (const std::exception& e) {
    fuzz::foreign_exception(e);  // the server would answer 500
  }
  return 0;
}
