// CPU inner kernels: products of stored weight rows (F32, BF16, F16, MLX-style affine quantized,
// MXFP4 or block-scaled FP8, see core/quant.h) with float32 activations.
//
// Each kernel exists at three levels, picked at run time from what the CPU offers:
//   Scalar  plain C++; the reference the others are tested against.
//   Avx2    AVX2 + FMA + F16C.
//   Avx512  AVX-512 F/BW/DQ/VL with VNNI and VBMI (Ice Lake, Sapphire Rapids, Zen 4 and
//           later; older AVX-512 parts run Avx2).
// The best level is the default; MOESTREAM_KERNELS=scalar|avx2|avx512 in the environment or
// set_kernel_level() lower it (for tests and benchmarks). Asking for a level the CPU lacks fails.
//
// A linear layer runs as prepare_input once per call, then matmul_rows on disjoint row ranges,
// possibly from several threads. For quantized weights the activations take one of two paths:
//   precise = true   float32 activations; each weight is dequantized (q * scale + bias, one
//                    fma, bit-identical at every level) and multiplied in float32.
//   precise = false  activations quantized to int8 per block of 32 (scale dx = max|x| / 127,
//                    round half to even); per block an exact integer dot product isum with the
//                    weight codes, then
//                    y = sum_g scale_g * sum_(b in g) dx_b * isum_b + sum_g bias_g * sum_(i in g) x^_i.
//                    The only approximation is x^ (the int8 activations) in place of x: about
//                    0.5% relative error on random data.
// Plain F32/BF16/F16 weights and FP8 weights always take float32 activations (FP8: each weight
// is fp8 * scale, one float32 multiply, then multiplied in float32).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "backend/backend.h"

namespace moestream::cpu {

enum class KernelLevel : uint8_t { Scalar, Avx2, Avx512 };

std::string_view kernel_level_name(KernelLevel level);   // "scalar", "avx2", "avx512"
KernelLevel best_kernel_level();                         // the best this CPU supports
bool kernel_level_supported(KernelLevel level);
KernelLevel kernel_level();                              // the level in use
void set_kernel_level(KernelLevel level);                // fails if the CPU lacks it

float dot_f32(const float* a, const float* b, int64_t n);
// dot(W[row, :], x), float32 throughout, for W in any stored format.
float dot_row(const Matrix& w, int64_t row, const float* x);
// W[row, :] converted (dequantized) to float32.
void row_to_f32(const Matrix& w, int64_t row, float* dst);
// y += a * x
void axpy(float a, const float* x, float* y, int64_t n);

// Activations prepared once per linear call for the weight's format and the kernel level.
// Plain weights read x as it is. Quantized weights read copies padded with zeros to a multiple
// of 64 columns per token, in the element order the level's unpacking produces (a permutation
// inside each block of 32, so block scales are unaffected; see quant_kernels.h).
struct PreparedInput {
  const float* x = nullptr;  // [T, cols] float32 as given
  int64_t T = 0, cols = 0;
  bool precise = true;
  KernelLevel level = KernelLevel::Scalar;  // layout below is for this level
  int bits = 0, group_size = 0;  // weight format the layout is for (bits 0: plain weights)
  int64_t stride = 0;          // padded columns per token in xf / q
  int64_t group_stride = 0;    // weight groups per token in group_sum (padded to 16)
  std::vector<float> xf;       // precise: [T, stride] float32 activations
  std::vector<int8_t> q;       // int8: [T, stride] int8 activations
  std::vector<float> q_scale;  // int8: [T, stride / 4] scale of each 4-element lane's block
  std::vector<float> group_sum;  // int8: [T, group_stride] sum of x^ over each weight group
};
void prepare_input(const Matrix& w, const float* x, int64_t T, bool precise, PreparedInput& in);

// y[t * ldy + r] = dot(W[r, :], x[t, :]) for rows r in [r0, r1) and every token t.
// For T = 1 a level may compute a few rows together (AVX-512: four), each with its own sums in
// its own order: a row's value does not depend on the range it is computed in.
// For T > 1 each weight row is unpacked once and reused for all tokens. The SIMD levels then run
// a small GEMM (gemm.h), which sums in another order than T = 1 does, so a token's outputs can
// differ in the last bits between a batch and a single-token call (the weights and activations
// multiplied are the same):
//   float path  per 128 columns one product chain per output in column order; the blocks' sums
//               added in order.
//   int8 path   (AVX-512) per block of 32 the exact integer sum times dx, added in order per
//               group; per group that sum times the scale, then bias * sum(x^), added in order.
void matmul_rows(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                 int64_t r1);

}  // namespace moestream::cpu
