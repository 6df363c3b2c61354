// tokenizer.json loading and encoding (src/text/tokenizer*.cpp): the streaming vocab/merges
// reader, every normalizer, pre-tokenizer, model and decoder spec, added tokens, then encode and
// decode. Input: tokenizer.json, then optionally a NUL, text to encode, a NUL and
// tokenizer_config.json. Tokenizer::load only reads a directory, so the parts are written to
// files in a temporary one (on /dev/shm).
#include <cstdint>

#include "core/error.h"
#include "fuzz_util.h"
#include "text/tokenizer.h"

using namespace moestream;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::TempDir dir;
  const auto parts = fuzz::split_input(data, size, 3);
  fuzz::write_file(dir.file("tokenizer.json"), parts[0]);
  if (parts.size() > 2) fuzz::write_file(dir.file("tokenizer_config.json"), parts[2]);
  else std::remove(dir.file("tokenizer_config.json").c_str());

  MOESTREAM_FUZZ_GUARD(Error, {
    const auto tok = Tokenizer::load(dir.path());
    const std::string_view texts[] = {parts.size() > 1 ? parts[1] : std::string_view("Hello world! 123 <|im_start|>"),
                                      " \n\t  héllo  wörld\n\n", "<s>[INST] a b c [/INST]"};
    for (std::string_view text : texts) {
      MOESTREAM_FUZZ_GUARD(Error, {
        const std::vector<int32_t> ids = tok->encode(text);
        (void)tok->decode(ids);
        StreamDecoder stream(*tok);
        for (int32_t id : ids) (void)stream.push(id);
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
