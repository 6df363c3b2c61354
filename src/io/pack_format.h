// Details of the pack layout that the manifest reader, the writer and verify share
// (docs/FORMATS.md); the public types are in io/pack.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "core/tensor.h"

namespace moestream::pack_format {

constexpr int kVersion = 2;                // the manifest's "version"
constexpr int kUncheckedVersion = 1;       // still read: no checksums but the experts' (FORMATS.md)
constexpr uint64_t kTensorAlignment = 64;  // tensors inside an expert block

inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// The journal of completed files in a pack's temporary directory (pack_resume.cpp): a line
// naming what was packed, then one per file (JSON lines); removed before the rename into place.
constexpr const char* kJournalName = "pack-journal.jsonl";
// Whether `path` is named as a temporary directory of the pack `out` (`OUT.tmp-PID`, or GPTQ
// calibration's `OUT.calib.tmp-PID`), in the same directory.
bool is_temporary_of(const std::string& path, const std::string& out);

// `OUT/` as `OUT`: its temporary directory is `OUT.tmp-<pid>` beside it, not inside it.
inline std::string without_trailing_slashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

// Checksums are written as 16 lowercase hex digits.
std::string hex64(uint64_t v);
uint64_t parse_hex64(const std::string& s, const std::string& where);

// The manifest's "manifest_xxh64": xxh64 of its compact JSON (keys sorted) without that member,
// so that an edit of any value is seen and a change of whitespace is not.
uint64_t manifest_checksum(const nlohmann::json& manifest);
// xxh64 of a safetensors file's length field and header (dtypes, shapes and offsets).
uint64_t safetensors_header_checksum(const std::string& path);
// The "weights_xxh3" of each tensor: xxh3-64 of its bytes. Loading a model hashes every resident
// byte, so the tensors are hashed in parallel and with xxh3, about twice as fast as xxh64.
std::vector<uint64_t> tensor_checksums(const std::vector<const TensorView*>& tensors);
// The manifest's "weights_header_xxh64" and "weights_xxh3" of the safetensors file at `path`.
nlohmann::json weight_checksums(const std::string& path);

}  // namespace moestream::pack_format
