// Tensor-level conversions from a checkpoint's layout to the pack's (internal to write_pack):
// one expert tensor of a stacked or per-expert checkpoint tensor, dequantization to float32,
// the MXFP4 and FP8 source checks, and the split and transposition into [out, in] weights.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/pack.h"

namespace moestream::packer {

// One expert's tensor: a whole checkpoint tensor, or expert `index` of a stacked one.
struct ExpertSource {
  const TensorView* tensor = nullptr;
  int64_t index = -1;
  ExpertLayout layout = ExpertLayout::OutIn;

  // The expert's shape; dimensions after the second are flattened into it (MXFP4 blocks
  // [rows, cols / 32, 16] are [rows, cols / 2] bytes).
  std::vector<int64_t> shape() const;
  const char* data() const;
  uint64_t nbytes() const;
};

// The float32 values of a weight, dequantizing it when it is quantized (f.bits > 0).
std::vector<float> to_f32(const ExpertSource& w, const ExpertSource* scales, const ExpertSource* biases,
                          const QuantFormat& f);

// A gpt-oss MXFP4 expert weight: U8 codes [rows, cols / 2] and U8 exponents [rows, cols / 32]
// under quantization_config.quant_method "mxfp4"; exponents above kMxfp4MaxExponent (scales
// beyond float32's range, or NaN) are refused.
void check_mxfp4_source(const ExpertSource& w, const ExpertSource* scales, const ExpertSource* biases,
                        const std::string& method);

// The block scales (scale_inv) of a block-scaled FP8 weight (DeepSeek-V3 / Kimi-K2 checkpoints),
// checked against the weight's shape and repeated for each row of their block: F32
// [rows, ceil(cols / block[1])], the scales of QuantScheme::Fp8 (core/quant.h).
std::vector<float> fp8_row_scales(const TensorView& w, const TensorView& scale_inv, const std::vector<int64_t>& block);

// The FP8 weight w with its row scales, packed as it is: its codes must not hold NaN (0x7f, 0xff)
// and the column block must be a multiple of 32 (the kernels' unit).
void check_fp8_native(const TensorView& w, const std::vector<int64_t>& block);

// A block-scaled FP8 weight dequantized to `dtype` (F32: exact; BF16: rounded to nearest even):
// w[r][c] = fp8[r][c] * scale_inv[r / block[0]][c / block[1]], one float32 multiply.
std::vector<char> dequantize_fp8(const TensorView& w, const TensorView& scale_inv, const std::vector<int64_t>& block,
                                 DType dtype);

bool is_bias_role(const std::string& role);  // gate_bias, up_bias, down_bias, gate_up_bias

// An expert's tensors as the pack stores them: weights [out, in] (gate_up split into gate and up),
// biases as F32 [1, out]. Converted tensors live in `bytes` and `views`.
std::map<std::string, ExpertSource> to_pack_layout(const std::map<std::string, ExpertSource>& parts,
                                                   std::deque<std::vector<char>>& bytes,
                                                   std::deque<TensorView>& views);

}  // namespace moestream::packer
