#include "core/quant.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"

namespace moestream {

namespace {

bool valid_bits(int b) { return b == 2 || b == 3 || b == 4 || b == 6 || b == 8; }
bool valid_group(int g) { return g == 32 || g == 64 || g == 128; }

// Scale and bias of one group as MLX computes them from its extremes (see quant.h).
struct Affine {
  float scale, bias;
};
Affine mlx_affine(float w_min, float w_max, float n_bins) {
  const bool min_is_edge = std::abs(w_min) > std::abs(w_max);
  float scale = std::max((w_max - w_min) / n_bins, 1e-7f);
  if (!min_is_edge) scale = -scale;
  const float edge = min_is_edge ? w_min : w_max;
  const float q0 = std::rint(edge / scale);
  if (q0 == 0) return {scale, 0.0f};
  return {edge / q0, edge};
}

uint32_t code_of(float w, Affine a, float n_bins) {
  const float q = std::rint((w - a.bias) / a.scale);
  // NaN weights become code 0 rather than undefined behaviour in the cast.
  return q > 0 ? uint32_t(std::min(q, n_bins)) : 0u;
}

// Squared error of reconstructing w[0, n) from codes under a with stored (rounded) scale/bias.
double reconstruction_error(const float* w, int n, Affine a, float n_bins, DType dt) {
  const float s = scale_to_f32(scale_from_f32(a.scale, dt), dt);
  const float b = scale_to_f32(scale_from_f32(a.bias, dt), dt);
  double err = 0;
  for (int i = 0; i < n; ++i) {
    const double d = double(std::fma(float(code_of(w[i], a, n_bins)), s, b)) - double(w[i]);
    err += d * d;
  }
  return err;
}

}  // namespace

void check_quant_format(const QuantFormat& f, std::string_view what) {
  if (f.scheme == QuantScheme::Mxfp4) {
    if (f != kMxfp4Format)
      fail(what, ": MXFP4 needs 4-bit codes in groups of 32 with U8 exponents, found ", f.bits,
           "-bit groups of ", f.group_size, " with ", dtype_name(f.scale_dtype), " scales");
    return;
  }
  if (f.scheme == QuantScheme::Fp8) {
    if (f.bits != 8 || f.group_size < 32 || f.group_size % 32 || f.scale_dtype != DType::F32)
      fail(what, ": FP8 needs 8-bit codes in groups of a multiple of 32 columns with F32 scales, found ", f.bits,
           "-bit groups of ", f.group_size, " with ", dtype_name(f.scale_dtype), " scales");
    return;
  }
  if (!valid_bits(f.bits))
    fail(what, ": quantization bits ", f.bits, " not supported (2, 3, 4, 6 or 8)");
  if (!valid_group(f.group_size))
    fail(what, ": quantization group size ", f.group_size, " not supported (32, 64 or 128)");
  if (f.scale_dtype != DType::BF16 && f.scale_dtype != DType::F16)
    fail(what, ": quantization scale dtype ", dtype_name(f.scale_dtype),
         " not supported (BF16 or F16)");
}

void check_quant_shape(const QuantFormat& f, int64_t cols, std::string_view what) {
  check_quant_format(f, what);
  if (f.scheme == QuantScheme::Fp8) {
    if (cols <= 0) fail(what, ": ", cols, " columns (FP8 needs at least one)");
    return;
  }
  if (cols <= 0 || cols % f.group_size != 0)
    fail(what, ": ", cols, " columns is not a positive multiple of the quantization group size ",
         f.group_size);
}

QuantFormat parse_quant_format(std::string_view spec) {
  auto bad = [&]() {
    fail("quantization format '", spec,
         "' not understood: expected q<bits>[g<group>][-bf16|-f16], bits 2, 3, 4, 6 or 8, "
         "group 32, 64 or 128 (e.g. q4, q2g32, q8g128-f16)");
  };
  auto number = [&](std::string_view& s) {
    int v = 0;
    size_t n = 0;
    while (n < s.size() && n < 4 && s[n] >= '0' && s[n] <= '9') v = v * 10 + (s[n++] - '0');
    if (n == 0) bad();
    s.remove_prefix(n);
    return v;
  };
  std::string_view s = spec;
  if (s.empty() || s[0] != 'q') bad();
  s.remove_prefix(1);
  QuantFormat f;
  f.bits = number(s);
  f.group_size = 64;
  if (!s.empty() && s[0] == 'g') {
    s.remove_prefix(1);
    f.group_size = number(s);
  }
  if (s == "-f16") {
    f.scale_dtype = DType::F16;
  } else if (s == "-bf16" || s.empty()) {
    f.scale_dtype = DType::BF16;
  } else {
    bad();
  }
  if (!valid_bits(f.bits) || !valid_group(f.group_size)) bad();
  return f;
}

std::string quant_format_name(const QuantFormat& f) {
  if (f.scheme == QuantScheme::Mxfp4) return "mxfp4";
  if (f.scheme == QuantScheme::Fp8) return "fp8g" + std::to_string(f.group_size);
  std::string s = "q" + std::to_string(f.bits) + "g" + std::to_string(f.group_size);
  if (f.scale_dtype == DType::F16) s += "-f16";
  return s;
}

uint32_t quant_code(const uint32_t* row, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int64_t word = bit / 32;
  const int off = int(bit % 32);
  uint64_t v = row[word] >> off;
  if (off + bits > 32) v |= uint64_t(row[word + 1]) << (32 - off);
  return uint32_t(v) & ((1u << bits) - 1);
}

void quant_put_code(uint32_t* row, int64_t i, int bits, uint32_t q) {
  const int64_t bit = i * bits;
  const int64_t word = bit / 32;
  const int off = int(bit % 32);
  row[word] |= q << off;
  if (off + bits > 32) row[word + 1] |= q >> (32 - off);
}

namespace {
// 8 codes fill BITS whole bytes of the stream; the words' bytes are the stream on a
// little-endian machine.
template <int BITS>
void unpack_codes_of(const uint8_t* bytes, int64_t cols, uint8_t* codes) {
  static_assert(std::endian::native == std::endian::little);
  constexpr uint64_t mask = (1u << BITS) - 1;
  for (int64_t p = 0; p < cols / 8; ++p) {
    uint64_t v = 0;
    std::memcpy(&v, bytes + p * BITS, BITS);
    for (int j = 0; j < 8; ++j) codes[p * 8 + j] = uint8_t((v >> (j * BITS)) & mask);
  }
}
}  // namespace

void unpack_codes(const uint32_t* row, int64_t cols, int bits, uint8_t* codes) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  switch (bits) {
    case 2: return unpack_codes_of<2>(bytes, cols, codes);
    case 3: return unpack_codes_of<3>(bytes, cols, codes);
    case 4: return unpack_codes_of<4>(bytes, cols, codes);
    case 6: return unpack_codes_of<6>(bytes, cols, codes);
    case 8: return unpack_codes_of<8>(bytes, cols, codes);
    default: fail("unpack_codes: ", bits, "-bit codes are not supported");
  }
}

float scale_to_f32(uint16_t v, DType dtype) {
  return dtype == DType::F16 ? f16_to_f32(v) : bf16_to_f32(v);
}
uint16_t scale_from_f32(float v, DType dtype) {
  return dtype == DType::F16 ? f32_to_f16(v) : f32_to_bf16(v);
}

void quantize_affine(const float* w, int64_t rows, int64_t cols, const QuantFormat& f,
                     uint32_t* words, uint16_t* scales, uint16_t* biases,
                     const QuantizeOptions& options, std::string_view what) {
  check_quant_shape(f, cols, what);
  const float n_bins = float((1 << f.bits) - 1);
  const int gs = f.group_size;
  const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* row = words + r * wpr;
    std::fill(row, row + wpr, 0u);
    for (int64_t g = 0; g < gpr; ++g) {
      const float* x = w + r * cols + g * gs;
      float w_min = std::numeric_limits<float>::infinity(), w_max = -w_min;
      for (int i = 0; i < gs; ++i) {
        w_min = std::min(w_min, x[i]);
        w_max = std::max(w_max, x[i]);
      }
      Affine a = mlx_affine(w_min, w_max, n_bins);
      if (options.clip_search) {
        double best = reconstruction_error(x, gs, a, n_bins, f.scale_dtype);
        for (int step = 1; step <= 10; ++step) {
          const float ratio = 1.0f - 0.02f * float(step);
          const Affine c = mlx_affine(ratio * w_min, ratio * w_max, n_bins);
          const double err = reconstruction_error(x, gs, c, n_bins, f.scale_dtype);
          if (err < best) {
            best = err;
            a = c;
          }
        }
      }
      for (int i = 0; i < gs; ++i) quant_put_code(row, g * gs + i, f.bits, code_of(x[i], a, n_bins));
      scales[r * gpr + g] = scale_from_f32(a.scale, f.scale_dtype);
      biases[r * gpr + g] = scale_from_f32(a.bias, f.scale_dtype);
    }
  }
}

void dequantize_row(const QuantFormat& f, int64_t cols, const uint32_t* words,
                    const uint16_t* scales, const uint16_t* biases, float* out) {
  const int64_t gpr = quant_groups_per_row(f, cols);
  uint8_t codes[128];
  for (int64_t g = 0; g < gpr; ++g) {
    const float s = scale_to_f32(scales[g], f.scale_dtype);
    const float b = scale_to_f32(biases[g], f.scale_dtype);
    // A group starts on a byte boundary: group_size * bits is a multiple of 8.
    unpack_codes(reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(words) +
                                                   g * f.group_size * f.bits / 8),
                 f.group_size, f.bits, codes);
    for (int i = 0; i < f.group_size; ++i)
      out[g * f.group_size + i] = std::fma(float(codes[i]), s, b);
  }
}

// ---- MXFP4 ----

namespace {
constexpr float kFp4Magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
}  // namespace

float fp4_value(uint8_t code) {
  const float m = kFp4Magnitude[code & 7];
  return code & 8 ? -m : m;
}

float e8m0_to_f32(uint8_t e) {
  if (e == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, int(e) - 127);
}

const std::array<float, 256>& mxfp4_affine_scales() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int e = 0; e < 256; ++e) t[size_t(e)] = e == 255 ? e8m0_to_f32(255) : std::ldexp(1.0f, e - 128);
    return t;
  }();
  return table;
}

void quantize_mxfp4(const float* w, int64_t rows, int64_t cols, uint8_t* codes, uint8_t* exponents,
                    std::string_view what) {
  check_quant_shape(kMxfp4Format, cols, what);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < cols / 32; ++g) {
      const float* x = w + r * cols + g * 32;
      float amax = 0;
      for (int i = 0; i < 32; ++i) {
        if (!std::isfinite(x[i])) fail(what, ": row ", r, " holds a non-finite value");
        amax = std::max(amax, std::abs(x[i]));
      }
      // Smallest e with amax <= 6 * 2^(e - 127), within the E8M0 range 0..254.
      int e = 0;
      if (amax > 0) {
        e = int(std::ceil(std::log2(double(amax) / 6.0))) + 127;
        if (e > 0 && double(amax) <= 6.0 * std::ldexp(1.0, e - 1 - 127)) --e;  // log2 rounding
        e = std::clamp(e, 0, int(kMxfp4MaxExponent));
      }
      const double scale = std::ldexp(1.0, e - 127);
      uint8_t* out = codes + r * cols / 2 + g * 16;
      for (int i = 0; i < 32; ++i) {
        const double v = double(x[i]) / scale;
        int best = 0;
        for (int m = 1; m < 8; ++m)
          if (std::abs(std::abs(v) - kFp4Magnitude[m]) < std::abs(std::abs(v) - kFp4Magnitude[best])) best = m;
        const uint8_t c = uint8_t(best == 0 ? 0 : best | (v < 0 ? 8 : 0));
        if (i % 2 == 0) {
          out[i / 2] = c;
        } else {
          out[i / 2] = uint8_t(out[i / 2] | (c << 4));
        }
      }
      exponents[r * cols / 32 + g] = uint8_t(e);
    }
  }
}

void dequantize_mxfp4_row(int64_t cols, const uint8_t* codes, const uint8_t* exponents, float* out) {
  for (int64_t g = 0; g < cols / 32; ++g) {
    const float s = e8m0_to_f32(exponents[g]);
    for (int i = 0; i < 32; ++i) {
      const uint8_t byte = codes[g * 16 + i / 2];
      out[g * 32 + i] = fp4_value(i % 2 ? uint8_t(byte >> 4) : uint8_t(byte & 15)) * s;
    }
  }
}

}  // namespace moestream

namespace moestream {

float fp8_e4m3_to_f32(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 15, man = v & 7;
  float mag;
  if (exp == 15 && man == 7) {
    mag = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    mag = std::ldexp(float(man), -9);  // subnormal: man / 8 * 2^-6
  } else {
    mag = std::ldexp(float(8 + man), exp - 10);  // (1 + man / 8) * 2^(exp - 7)
  }
  return sign ? -mag : mag;
}

const std::array<float, 256>& fp8_e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = fp8_e4m3_to_f32(uint8_t(i));
    return t;
  }();
  return table;
}

void dequantize_fp8_row(int64_t cols, int group_size, const uint8_t* codes, const float* scales, float* out) {
  const std::array<float, 256>& table = fp8_e4m3_table();
  for (int64_t i = 0; i < cols; ++i) out[i] = table[codes[i]] * scales[i / group_size];
}

}  // namespace moestream
