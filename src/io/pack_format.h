// Details of the pack layout that the manifest reader, the writer and verify share
// (docs/FORMATS.md); the public types are in io/pack.h.
#pragma once

#include <cstdint>
#include <string>

namespace moestream::pack_format {

constexpr int kVersion = 1;                // the manifest's "version"
constexpr uint64_t kTensorAlignment = 64;  // tensors inside an expert block

inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Checksums are written as 16 lowercase hex digits.
std::string hex64(uint64_t v);
uint64_t parse_hex64(const std::string& s, const std::string& where);

}  // namespace moestream::pack_format
