#include "backend/kv_cache.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/quant.h"

namespace moestream {

const char* kv_type_name(KvType t) {
  switch (t) {
    case KvType::F32: return "f32";
    case KvType::BF16: return "bf16";
    case KvType::F16: return "f16";
    case KvType::Fp8: return "fp8";
    case KvType::Q8: return "q8";
  }
  return "?";
}

bool parse_kv_type(const std::string& s, KvType& out) {
  for (KvType t : {KvType::F32, KvType::BF16, KvType::F16, KvType::Fp8, KvType::Q8})
    if (s == kv_type_name(t)) {
      out = t;
      return true;
    }
  return false;
}

int64_t kv_row_words(KvType t, int64_t cols, int64_t heads) {
  if (cols == 0) return 0;
  switch (t) {
    case KvType::F32: return cols;
    case KvType::BF16:
    case KvType::F16: return (cols + 1) / 2;
    case KvType::Fp8:
    case KvType::Q8: return heads + (cols + 3) / 4;
  }
  return cols;
}

bool kv_can_truncate(const KvCacheSpec& s, int64_t rows, int64_t n, int64_t n_past) {
  if (n < 0 || n > n_past) return false;
  // Position j's row is reused by j + window; position n reads back to n - window + 1, whose
  // row survives while n + 1 > n_past - 1. Before the ring wraps every position has its own row.
  return s.window <= 0 || !s.ring || n_past <= rows || n >= n_past - 1;
}

uint8_t f32_to_fp8_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (!(a < 448.0f)) return sign | 0x7E;  // 448, the largest finite value
  // Steps of 2^-9 below 2^-6 (subnormals), else 3 mantissa bits: a step of 2^(e - 3).
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  const int step_exp = std::max(e - 1, -6) - 3;
  const float units = std::nearbyint(std::ldexp(a, -step_exp));  // round half to even
  const float q = std::ldexp(units, step_exp);
  if (q >= 448.0f) return sign | 0x7E;
  if (q < 0.015625f) return sign | uint8_t(units);  // subnormal: man = q / 2^-9, or 8 = 2^-6 exactly
  int qe;
  const float f = std::frexp(q, &qe);  // q = f * 2^qe
  const int exp = qe - 1 + 7, man = int(f * 16.0f) - 8;
  return sign | uint8_t(exp << 3) | uint8_t(man);
}

void kv_store_row(KvType t, const float* row, int64_t cols, int64_t heads, float* dst) {
  switch (t) {
    case KvType::F32: std::memcpy(dst, row, size_t(cols) * sizeof(float)); return;
    case KvType::BF16:
    case KvType::F16: {
      auto* out = reinterpret_cast<uint16_t*>(dst);
      // f16 saturates at +-65504 rather than overflow to an infinity that would poison every score.
      for (int64_t i = 0; i < cols; ++i)
        out[i] = t == KvType::BF16 ? f32_to_bf16(row[i]) : f32_to_f16(std::clamp(row[i], -65504.0f, 65504.0f));
      if (cols % 2) out[cols] = 0;
      return;
    }
    case KvType::Fp8:
    case KvType::Q8: {
      const int64_t width = cols / heads;
      auto* codes = reinterpret_cast<uint8_t*>(dst + heads);
      for (int64_t h = 0; h < heads; ++h) {
        float amax = 0;
        for (int64_t i = h * width; i < (h + 1) * width; ++i) amax = std::max(amax, std::fabs(row[i]));
        const float scale = amax > 0 ? amax / (t == KvType::Fp8 ? 448.0f : 127.0f) : 1.0f;
        dst[h] = scale;
        for (int64_t i = h * width; i < (h + 1) * width; ++i) {
          const float x = row[i] / scale;
          codes[i] = t == KvType::Fp8 ? f32_to_fp8_e4m3(x)
                                      : uint8_t(int8_t(std::clamp(std::nearbyint(x), -127.0f, 127.0f)));
        }
      }
      for (int64_t i = cols; i < (cols + 3) / 4 * 4; ++i) codes[i] = 0;
      return;
    }
  }
}

void kv_load(KvType t, const float* packed, int64_t cols, int64_t heads, int64_t c0, int64_t n, float* out) {
  switch (t) {
    case KvType::F32: std::memcpy(out, packed + c0, size_t(n) * sizeof(float)); return;
    case KvType::BF16: {
      const auto* in = reinterpret_cast<const uint16_t*>(packed) + c0;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
      return;
    }
    case KvType::F16: {
      // The compiler's half-precision conversion (one instruction a vector with F16C), exact as
      // f16_to_f32.
      const auto* in = reinterpret_cast<const uint16_t*>(packed) + c0;
      for (int64_t i = 0; i < n; ++i) out[i] = float(std::bit_cast<_Float16>(in[i]));
      return;
    }
    case KvType::Fp8: {
      const float scale = packed[c0 / (cols / heads)];
      const uint8_t* codes = reinterpret_cast<const uint8_t*>(packed + heads) + c0;
      const std::array<float, 256>& table = fp8_e4m3_table();
      for (int64_t i = 0; i < n; ++i) out[i] = table[codes[i]] * scale;
      return;
    }
    case KvType::Q8: {
      const float scale = packed[c0 / (cols / heads)];
      const auto* codes = reinterpret_cast<const int8_t*>(packed + heads) + c0;
      for (int64_t i = 0; i < n; ++i) out[i] = float(codes[i]) * scale;
      return;
    }
  }
}

}  // namespace moestream
