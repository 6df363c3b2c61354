// Launchers of the linear-layer kernels (linear.cu): GEMV for a few tokens, dequantized tiles
// through cuBLAS for more, and embedding rows. Pointers are device memory; work goes on `stream`.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"

namespace moestream::cuda {

// Tokens up to which linear() runs the GEMV kernel (weights read once per 4 tokens); above it
// a dequantized tile of the matrix goes through cuBLAS SGEMM.
constexpr int64_t kGemvMaxTokens = 8;

// Device scratch of the GEMM path, grown to the largest tile seen.
struct GemmScratch {
  cublasHandle_t handle = nullptr;
  float* tile = nullptr;
  size_t tile_floats = 0;
  ~GemmScratch();
};

// out[t, :] (row stride ldo) = x[t, :] (row stride ldx) @ W^T (+ bias[r]) for t < T.
void linear(const Matrix& w, const float* x, int64_t ldx, int64_t T, const float* bias, float* out,
            int64_t ldo, GemmScratch& scratch, cudaStream_t stream);

// out[t, :] = row tokens[t] of table, as float32 (tokens already checked against table.rows).
void embed(const Matrix& table, const int32_t* tokens, int64_t T, float* out, cudaStream_t stream);

}  // namespace moestream::cuda
