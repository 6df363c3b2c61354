// Group-wise affine quantization in MLX's format: naming, validation, quantizing float32 rows
// and dequantizing them again. The CPU kernels that multiply by such matrices live in
// src/backend/cpu/kernels.h.
//
// Layout of one row of `cols` elements, `bits` = b in {2, 3, 4, 6, 8}:
//   codes  cols * b / 32 uint32 words. Element i has the code q_i in bits [i*b, (i+1)*b) of the
//          row's little-endian bit stream (bit k of the stream is bit k % 32 of word k / 32).
//          For b = 2, 4, 8 a word holds 32 / b whole codes, element j of the word in bits
//          [j*b, (j+1)*b). For b = 3 and 6 codes straddle word (and byte) boundaries: MLX writes
//          them as packs of 3 bytes holding 8 codes (b = 3) or 4 codes (b = 6), code k of a pack
//          in bits [k*b, (k+1)*b) of the 24-bit little-endian pack, packs back to back. Since a
//          pack is exactly 24 bits this is the same bit stream, read as uint32 words on a
//          little-endian machine (MLX's wq array is uint32 over those bytes).
//   scales, biases  cols / group_size values each, of scale_dtype (BF16 or F16):
//          element i dequantizes to q_i * scales[i / group_size] + biases[i / group_size].
//
// quantize_affine reproduces MLX's CPU affine quantizer (mlx/backend/cpu/quantized.cpp):
// per group, with w_min / w_max its extremes and n = 2^b - 1,
//   scale = max((w_max - w_min) / n, 1e-7), negated unless |w_min| > |w_max|;
//   edge = the extreme of larger magnitude (w_min when |w_min| > |w_max|, else w_max);
//   q0 = rint(edge / scale); if q0 != 0 { scale = edge / q0; bias = edge } else bias = 0;
//   q_i = clamp(rint((w_i - bias) / scale), 0, n).
// So the extreme of larger magnitude is exact (code 0), the scale is negative when that extreme
// is the maximum, and when the group spans zero, zero falls on an integer code. Codes come from
// the float32 scale and bias; only the stored scale and bias are rounded to scale_dtype. With
// float32 input that holds BF16 (F16) weights and a BF16 (F16) scale_dtype, the result is the
// bits mlx.core.quantize writes for those weights. (MLX's Metal kernel differs in two details:
// round-half-away instead of rint, and w_max starts at 0 rather than -inf.)
//
// MXFP4 (QuantScheme::Mxfp4, gpt-oss's experts; OCP Microscaling spec v1.0, as transformers'
// integrations/mxfp4.py decodes it): 4-bit codes packed like the affine 4-bit format (element 2j
// in the low nibble of byte j), one E8M0 exponent byte e per group of 32. Code c is an E2M1
// float: sign = bit 3, magnitude FP4_VALUES[c & 7] = 0, 0.5, 1, 1.5, 2, 3, 4, 6; the element is
// magnitude * 2^(e - 127). Exponents above kMxfp4MaxExponent (252: scales beyond 2^125, where
// float32 overflows; 255 is NaN in the spec) are refused when a checkpoint is packed.
//
// The kernels compute MXFP4 as an affine format with the same group of 32: code c becomes the
// unsigned c' = 2 * fp4(c) + 12 (0..24, kMxfp4AffineCode), scale' = 2^(e - 128), bias' =
// -12 * scale'. Then c' * scale' + bias' = fp4(c) * 2^(e - 127) exactly (every product and sum
// is a small multiple of a power of two), so one fma per weight reproduces the exact value and
// the int8-activation path needs no signed-by-signed products.
//
// FP8 (QuantScheme::Fp8, DeepSeek-V3 / Kimi-K2; core/quant_format.h): one E4M3 byte per element and one
// float32 scale per group of group_size columns of a row (the last group may be partial). The
// checkpoint's block scales, one per weight_block_size [R, G] block, are repeated for each row of
// their block when a checkpoint is packed. An element is fp8 * scale, rounded once to float32:
// the value a float32 dequantization (transformers' reference) gives. The kernels compute with
// float32 activations only.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "core/quant_format.h"

namespace moestream {

// The one MXFP4 format.
inline constexpr QuantFormat kMxfp4Format{4, 32, DType::U8, QuantScheme::Mxfp4};

// Fails naming `what` unless bits is 2, 3, 4, 6 or 8, group_size 32, 64 or 128 and scale_dtype
// BF16 or F16 (affine), or f is kMxfp4Format.
void check_quant_format(const QuantFormat& f, std::string_view what);
// check_quant_format, and cols a positive multiple of the group size.
void check_quant_shape(const QuantFormat& f, int64_t cols, std::string_view what);

// "q<bits>[g<group_size>][-bf16|-f16]", e.g. "q4" (group 64, BF16 scales, MLX's default
// group), "q2g32", "q8g128-f16". Fails naming the spec if it is not one of those.
QuantFormat parse_quant_format(std::string_view spec);
// The canonical spelling of f: "q4g64", "q3g32-f16" (BF16 scales are not spelled out), "mxfp4".
std::string quant_format_name(const QuantFormat& f);

inline int64_t quant_words_per_row(const QuantFormat& f, int64_t cols) {
  return cols * f.bits / 32;
}
inline int64_t quant_groups_per_row(const QuantFormat& f, int64_t cols) {
  return (cols + f.group_size - 1) / f.group_size;  // only FP8 allows a partial last group
}

// Code of element i of a packed row, and writing one (the slot must hold zero bits).
uint32_t quant_code(const uint32_t* row, int64_t i, int bits);
void quant_put_code(uint32_t* row, int64_t i, int bits, uint32_t q);

// All codes of a packed row, one byte each (cols a multiple of 8).
void unpack_codes(const uint32_t* row, int64_t cols, int bits, uint8_t* codes);

// A stored scale or bias (raw bits of `dtype`, BF16 or F16) as float32, and back (nearest even).
float scale_to_f32(uint16_t v, DType dtype);
uint16_t scale_from_f32(float v, DType dtype);

struct QuantizeOptions {
  // Per group, also try clipping the range to r * [w_min, w_max] for r = 0.98, 0.96 .. 0.80
  // and keep the candidate with the least squared reconstruction error (with the stored,
  // rounded scale and bias). Ratio 1 is plain MLX rounding, so the error never grows. Meant
  // for 2-bit, where clipping an outlier usually pays; the result no longer matches MLX.
  bool clip_search = false;
};

// Quantizes w (rows, cols) float32: words (rows, quant_words_per_row), scales and biases
// (rows, quant_groups_per_row) as raw scale_dtype bits. `what` names the tensor in errors.
void quantize_affine(const float* w, int64_t rows, int64_t cols, const QuantFormat& f,
                     uint32_t* words, uint16_t* scales, uint16_t* biases,
                     const QuantizeOptions& options = {}, std::string_view what = "matrix");

// One packed row back to float32: out[i] = q_i * scale + bias (one float32 fma).
void dequantize_row(const QuantFormat& f, int64_t cols, const uint32_t* words,
                    const uint16_t* scales, const uint16_t* biases, float* out);

// ---- MXFP4 ----

// The E2M1 value of a 4-bit code.
float fp4_value(uint8_t code);
// 2^(e - 127) for an E8M0 byte (NaN for 255).
float e8m0_to_f32(uint8_t e);
// The affine view of MXFP4 the kernels use (see above): code -> 2 * fp4(code) + 12, and the
// table of scale' = 2^(e - 128) for every exponent byte (NaN for 255).
inline constexpr std::array<uint8_t, 16> kMxfp4AffineCode{12, 13, 14, 15, 16, 18, 20, 24,
                                                         12, 11, 10, 9,  8,  6,  4,  0};
inline constexpr float kMxfp4AffineBiasCodes = 12.0f;  // bias' = -12 * scale'
inline constexpr uint8_t kMxfp4MaxExponent = 252;      // beyond it bias' overflows float32;
                                                       // the SIMD kernels assume e <= it
const std::array<float, 256>& mxfp4_affine_scales();

// Quantizes w (rows, cols) float32, cols a multiple of 32: codes (rows, cols / 2) bytes and
// exponents (rows, cols / 32). Per group the exponent is the smallest that puts max|w| within
// 6 * 2^(e - 127) (no clipping; at most kMxfp4MaxExponent), each value rounds to the nearest E2M1 magnitude (ties to the
// smaller one), zero is +0. `what` names the tensor in errors (non-finite values).
void quantize_mxfp4(const float* w, int64_t rows, int64_t cols, uint8_t* codes, uint8_t* exponents,
                    std::string_view what = "matrix");

// One MXFP4 row back to float32 (exact).
void dequantize_mxfp4_row(int64_t cols, const uint8_t* codes, const uint8_t* exponents, float* out);

// ---- FP8 ----

// The value of an E4M3 "fn" byte (0x7f and 0xff are NaN), and all 256 of them.
float fp8_e4m3_to_f32(uint8_t v);
const std::array<float, 256>& fp8_e4m3_table();
// The FP8 format with groups of `group_size` columns.
inline QuantFormat fp8_format(int group_size) { return QuantFormat{8, group_size, DType::F32, QuantScheme::Fp8}; }
// One FP8 row to float32: out[i] = fp8(codes[i]) * scales[i / group_size].
void dequantize_fp8_row(int64_t cols, int group_size, const uint8_t* codes, const float* scales, float* out);

}  // namespace moestream
