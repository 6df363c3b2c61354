// Element types of stored tensors and the scalar conversions between them.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace moestream {

enum class DType : uint8_t {
  F64, F32, F16, BF16, F8_E4M3, F8_E5M2,  // floating point
  I64, I32, I16, I8, U64, U32, U16, U8, BOOL,
};

size_t dtype_size(DType t);          // bytes per element
std::string_view dtype_name(DType t);  // safetensors spelling: "BF16", "F32", "U32", ...
std::optional<DType> dtype_from_name(std::string_view safetensors_name);

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace moestream
