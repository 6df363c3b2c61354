// The safetensors reader (src/io/safetensors.cpp): header length, JSON header, dtypes, shapes,
// offsets and overlaps, from a memfd the reader maps like a file. The input is a whole file.
#include <cstdint>

#include "core/error.h"
#include "fuzz_util.h"
#include "io/safetensors.h"

using namespace moestream;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::MemFile file;
  const std::string& path = file.set(data, size);
  MOESTREAM_FUZZ_GUARD(Error, {
    auto st = SafetensorsFile::open(path);
    // Touch every tensor's first and last byte: the reader promised they lie inside the mapping.
    uint64_t sum = 0;
    for (const auto& [name, t] : st->tensors()) {
      sum += uint64_t(t.numel());  // what every consumer computes first
      const size_t n = t.nbytes;
      if (n) sum += static_cast<const uint8_t*>(t.data)[0] + static_cast<const uint8_t*>(t.data)[n - 1];
    }
    for (const auto& [k, v] : st->metadata()) sum += k.size() + v.size();
    (void)sum;
  });
  return 0;
}
