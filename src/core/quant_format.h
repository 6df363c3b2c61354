// What a quantized weight format is: the scheme that turns codes into values and its parameters.
// Below the backends (backend.h's Matrix carries one) and the pack format (io/pack.h records one
// per tensor); core/quant.h holds the arithmetic on it.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace moestream {

// How the codes of a quantized matrix become values (core/quant.h has the details).
enum class QuantScheme : uint8_t {
  // MLX's group-wise affine format: for each group of group_size consecutive input elements a
  // scale and a bias (scale_dtype), value = q * scale + bias, q unsigned of `bits` bits.
  Affine,
  // OCP microscaling FP4 as gpt-oss publishes its experts: bits 4, group_size 32, scale_dtype
  // U8. Each code is an FP4 E2M1 value (bit 3 the sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
  // for codes 0..7) and each group of 32 has one E8M0 exponent byte e: value = fp4 * 2^(e - 127).
  // No biases.
  Mxfp4,
  // Block-scaled FP8 as DeepSeek-V3 / Kimi-K2 publish their weights: bits 8, group_size G (the
  // checkpoint's weight_block_size[1], a multiple of 32), scale_dtype F32. Each code is an E4M3
  // "fn" byte (sign bit 7, exponent bits 3-6 with bias 7, mantissa bits 0-2; exponent 0 is
  // subnormal, 0x7f / 0xff are NaN and never stored) and each group of G columns of a row has one
  // float32 scale: value = fp8 * scale. Unlike the other schemes the last group of a row may be
  // partial (cols need not be a multiple of G or of 32). No biases.
  Fp8,
};

// A quantized format; bits == 0 means not quantized. Both schemes pack codes little-endian:
// element i of a row in bits [i * bits, (i + 1) * bits) of the row's bit stream, so for 4 bits
// element 2j is the low nibble of byte j and element 2j + 1 its high nibble.
struct QuantFormat {
  int bits = 0;              // 2, 3, 4, 6, 8 (Mxfp4: 4, Fp8: 8)
  int group_size = 0;        // 32, 64, 128 (Mxfp4: 32, Fp8: a multiple of 32)
  DType scale_dtype = DType::BF16;  // BF16 or F16 (Mxfp4: U8, the E8M0 exponent; Fp8: F32)
  QuantScheme scheme = QuantScheme::Affine;
  bool operator==(const QuantFormat&) const = default;
};

}  // namespace moestream
