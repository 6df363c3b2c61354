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

}  // namespace moestream::pack_format
