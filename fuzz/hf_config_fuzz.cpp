// config.json (src/io/hf_config.cpp) and each architecture's reading of it (the XConfig::from of
// src/models/*.cpp, which runs before the loader opens the pack). Input: config.json, optionally
// followed by a NUL and generation_config.json.
#include <cstdint>

#include "core/error.h"
#include "fuzz_util.h"
#include "io/hf_config.h"
#include "models/blocks.h"
#include "models/registry.h"

using namespace moestream;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::TempDir dir;
  const auto parts = fuzz::split_input(data, size, 2);
  fuzz::write_file(dir.file("config.json"), parts[0]);
  if (parts.size() > 1) fuzz::write_file(dir.file("generation_config.json"), parts[1]);
  else std::remove(dir.file("generation_config.json").c_str());

  MOESTREAM_FUZZ_GUARD(Error, {
    const HfConfig config = HfConfig::load(dir.file("config.json"));
    // The generic getters on the fields the loaders read (each may throw on its own).
    for (const char* f : {"vocab_size", "hidden_size", "num_hidden_layers", "num_experts", "head_dim",
                          "num_key_value_heads", "max_position_embeddings", "sliding_window"})
      MOESTREAM_FUZZ_GUARD(Error, (void)config.text().get_int(f, 0));
    for (const char* f : {"rms_norm_eps", "routed_scaling_factor"})
      MOESTREAM_FUZZ_GUARD(Error, (void)config.get_double(f, 1.0));
    MOESTREAM_FUZZ_GUARD(Error, (void)config.get_int_list("eos_token_id"));
    MOESTREAM_FUZZ_GUARD(Error, (void)config.get_string_list("layer_types"));
    MOESTREAM_FUZZ_GUARD(Error, (void)config.torch_dtype());
    for (const char* lt : {"", "full_attention", "sliding_attention"})
      MOESTREAM_FUZZ_GUARD(Error, (void)config.text().rope(lt));
    MOESTREAM_FUZZ_GUARD(Error, (void)quantization_lookup(config));
    MOESTREAM_FUZZ_GUARD(Error, (void)load_generation_defaults(dir.path(), config));
    // The architecture's own checks; with no pack in the directory the loader stops at
    // PackManifest::load (an Error) once the configuration has been read and checked.
    const Architecture& arch = find_architecture(config.model_type(), config.path());
    ModelOptions options;
    options.threads = 1;
    arch.load(dir.path(), config, options);
  });
  return 0;
}
