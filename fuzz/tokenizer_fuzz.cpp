// tokenizer.json loading and encoding (src/text/tokenizer*.cpp): the streaming vocab/merges
// reader, every normalizer, pre-tokenizer, model and decoder spec, added tokens, then encode and
// decode. Input: tokenizer.json, then optionally a NUL, text to encode, a NUL and
// tokenizer_config.json. The parts go to Tokenizer::from_json, which Tokenizer::load calls with
// the files' contents: no file is written or read for an input.
#include <cstdint>
#include <optional>

#include "core/error.h"
#include "fuzz_util.h"
#include "text/tokenizer.h"

using namespace moestream;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split_input(data, size, 3);
  const std::optional<std::string_view> config = parts.size() > 2 ? std::optional(parts[2]) : std::nullopt;

  MOESTREAM_FUZZ_GUARD(Error, {
    const auto tok = Tokenizer::from_json(parts[0], config, "fuzz");
    const std::string_view texts[] = {parts.size() > 1 ? parts[1] : std::string_view("Hello world! 123 <|im_start|>"),
                                      " \n\t  héllo  wörld\n\n", "<s>[INST] a b c [/INST]"};
    for (std::string_view text : texts) {
      MOESTREAM_FUZZ_GUARD(Error, {
        const std::vector<int32_t> ids = tok->encode(text);
        (void)tok->decode(ids);
        // Each push decodes the stream's window again (up to 64 ids), so streaming a whole 64 KB
        // text cost more than the rest of the input; 256 ids reach every state the window has.
        StreamDecoder stream(*tok);
        for (size_t i = 0; i < ids.size() && i < 256; ++i) (void)stream.push(ids[i]);
        (void)stream.flush();
      });
    }
    const int32_t n = tok->vocab_size();
    for (int32_t id : {0, 1, n / 2, n - 1, n}) {
      MOESTREAM_FUZZ_GUARD(Error, {
        (void)tok->piece(id);
        (void)tok->is_special(id);
        (void)tok->decode({id});
      });
    }
    (void)tok->bos_id();
    (void)tok->eos_id();
  });
  return 0;
}
