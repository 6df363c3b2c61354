// CPU inner kernels: dot products of a stored weight row with float32 activations.
// AVX2+FMA when the compiler targets it, a scalar loop otherwise; both sum in float32.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace moestream::cpu {

float dot_f32(const float* a, const float* b, int64_t n);
// dot(W[row, :], x) for W in its stored format (f32, bf16, f16).
float dot_row(const Matrix& w, int64_t row, const float* x);
// W[row, :] converted to float32.
void row_to_f32(const Matrix& w, int64_t row, float* dst);
// y += a * x
void axpy(float a, const float* x, float* y, int64_t n);

// Activations prepared once per linear call for the weight's format: float32 as they are, or
// (default path, quantized weights) quantized per group for integer dot products.
struct PreparedInput {
  const float* x = nullptr;  // [T, cols] float32
  int64_t T = 0, cols = 0;
  bool precise = true;
  std::vector<int8_t> q;       // int8 activations when !precise (format-specific layout)
  std::vector<float> q_scale;  // their per-group scales
};
void prepare_input(const Matrix& w, const float* x, int64_t T, bool precise, PreparedInput& in);

// y[t * ldy + r] = dot(W[r, :], x[t, :]) for rows r in [r0, r1) and every token t.
void matmul_rows(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                 int64_t r1);

}  // namespace moestream::cpu
