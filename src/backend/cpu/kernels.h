// CPU inner kernels: dot products of a stored weight row with float32 activations.
// AVX2+FMA when the compiler targets it, a scalar loop otherwise; both sum in float32.
#pragma once

#include <cstdint>

#include "backend/backend.h"

namespace moestream::cpu {

float dot_f32(const float* a, const float* b, int64_t n);
// dot(W[row, :], x) for W in its stored format (f32, bf16, f16).
float dot_row(const Matrix& w, int64_t row, const float* x);
// W[row, :] converted to float32.
void row_to_f32(const Matrix& w, int64_t row, float* dst);
// y += a * x
void axpy(float a, const float* x, float* y, int64_t n);

}  // namespace moestream::cpu
