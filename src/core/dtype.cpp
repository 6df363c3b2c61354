#include "core/dtype.h"

#include <array>

namespace moestream {

namespace {
struct DTypeInfo {
  DType type;
  std::string_view name;
  size_t size;
};
constexpr std::array<DTypeInfo, 15> kTypes = {{
    {DType::F64, "F64", 8},     {DType::F32, "F32", 4},         {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2},   {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::I64, "I64", 8},     {DType::I32, "I32", 4},         {DType::I16, "I16", 2},
    {DType::I8, "I8", 1},       {DType::U64, "U64", 8},         {DType::U32, "U32", 4},
    {DType::U16, "U16", 2},     {DType::U8, "U8", 1},           {DType::BOOL, "BOOL", 1},
}};
}  // namespace

size_t dtype_size(DType t) { return kTypes[size_t(t)].size; }
std::string_view dtype_name(DType t) { return kTypes[size_t(t)].name; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& info : kTypes)
    if (info.name == name) return info.type;
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;               // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;              // overflow to inf
  if (abs < 0x38800000u) {                                    // subnormal or zero in f16
    if (abs < 0x33000000u) return sign;                       // rounds to zero
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    // f16 subnormal = m * 2^-24 and the float = mant * 2^(e - 150), so m = mant >> (126 - e).
    int shift = 126 - int(abs >> 23);                         // 14..24
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1))) ++half;
    return sign | uint16_t(half);
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);             // round to nearest even
  return sign | uint16_t((r - 0x38000000u) >> 13);
}

}  // namespace moestream
