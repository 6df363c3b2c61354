// Encoding and decoding arbitrary text with a real tokenizer: the Qwen3 tokenizer scripts/setup
// fetches into .cache/tokenizer-qwen3 (ByteLevel BPE with the GPT-4-style Split regex, 151k
// merges, special tokens), or $MOESTREAM_FUZZ_TOKENIZER (a directory). Input: the text; invalid
// UTF-8 must be an Error, not a crash. Then the ids are decoded, in one piece and streamed.
#include <cstdint>

#include "core/error.h"
#include "fuzz_util.h"
#include "text/tokenizer.h"

using namespace moestream;

namespace {

const Tokenizer& tokenizer() {
  static const std::unique_ptr<Tokenizer> tok = [] {
    std::string dir = fuzz::source_dir() + "/.cache/tokenizer-qwen3";
    if (const char* env = std::getenv("MOESTREAM_FUZZ_TOKENIZER")) dir = env;
    try {
      return Tokenizer::load(dir);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fuzz: %s (run scripts/setup, or set MOESTREAM_FUZZ_TOKENIZER)\n", e.what());
      std::abort();
    }
  }();
  return *tok;
}

}  // namespace

// Loading the 151k-token vocabulary takes seconds under ASan: done here, outside libFuzzer's
// per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)tokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Tokenizer* tok = &tokenizer();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  MOESTREAM_FUZZ_GUARD(Error, {
    const std::vector<int32_t> ids = tok->encode(text);
    const std::string back = tok->decode(ids);
    StreamDecoder stream(*tok);
    std::string streamed;
    for (int32_t id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    (void)back;
  });
  return 0;
}
