// The pack manifest reader (PackManifest::load in src/io/pack.cpp): moestream-pack.json in a
// temporary directory whose expert files experts/layer-0..7.bin exist as 64 MiB sparse files, so
// that manifests get past the file checks to the per-expert and per-tensor validation. The input
// is the manifest.
#include <fcntl.h>
#include <sys/stat.h>

#include <cstdint>

#include "core/error.h"
#include "fuzz_util.h"
#include "io/pack.h"

using namespace moestream;

namespace {

struct PackDir {
  fuzz::TempDir dir;
  PackDir() {
    mkdir(dir.file("experts").c_str(), 0755);
    for (int l = 0; l < 8; ++l) {
      const int fd = open(dir.file("experts/layer-" + std::to_string(l) + ".bin").c_str(), O_CREAT | O_WRONLY, 0644);
      if (fd < 0 || ftruncate(fd, 64 << 20) != 0) std::abort();
      close(fd);
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const PackDir pack;
  const fuzz::TempDir& dir = pack.dir;
  fuzz::write_file(dir.file(kPackManifestName), std::string_view(reinterpret_cast<const char*>(data), size));
  MOESTREAM_FUZZ_GUARD(Error, {
    const PackManifest m = PackManifest::load(dir.path());
    // What the expert store and the loaders ask of a loaded manifest.
    (void)m.total_expert_bytes();
    (void)m.max_expert_size();
    for (size_t l = 0; l < m.layers.size(); ++l)
      for (size_t e = 0; e < m.layers[l].size(); ++e) {
        const PackedExpert& x = m.expert(int(l), int(e));
        for (const char* role : {"gate", "up", "down"}) {
          MOESTREAM_FUZZ_GUARD(Error, (void)x.logical_shape(role));
          MOESTREAM_FUZZ_GUARD(Error, (void)x.quant_format(role));
        }
      }
  });
  return 0;
}
