// Launchers of the element-wise and normalization kernels (elementwise.cu). Device pointers;
// work goes on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/split_rows.cuh"

namespace moestream::cuda {

// out = RMSNorm over groups of `group` consecutive values of x (n values), times w[i % group].
void rmsnorm(const float* x, const float* w, float eps, int64_t n, int64_t group, float* out, cudaStream_t s);
// The threads per block of the RMSNorm kernels for groups of `group` values (which fixes the order
// of the sum of squares: the fused kernels that norm use the same).
int rmsnorm_threads(int64_t group);
// x += y; out = RMSNorm of each row of x (rows x cols) times w: as add() then rmsnorm(), bit for bit.
// With `split` (areas for rows x cols), out is also split for the tensor-core products, in q4's
// column order when `interleaved`: split_tokens(out, ...)'s values (cols as add_rmsnorm_splits
// allows).
void add_rmsnorm(float* x, const float* y, const float* w, float eps, int64_t rows, int64_t cols, float* out,
                 cudaStream_t s, const SplitRows* split = nullptr, bool interleaved = false);
bool add_rmsnorm_splits(int64_t cols);
void add(float* x, const float* y, int64_t n, cudaStream_t s);
void clamp(float* x, float limit, int64_t n, cudaStream_t s);
// dst[t, to.offset + g * to.stride + i] = src[t, from.offset + g * from.stride + i]
void copy_columns(const Buffer& src, ColumnBlocks from, Buffer& dst, ColumnBlocks to, int64_t width,
                  int64_t blocks, cudaStream_t s);
// y[t, i] *= sigmoid(gate[t, i % gate_cols])
void sigmoid_gate(float* y, int64_t rows, int64_t cols, const float* gate, int64_t gate_cols, cudaStream_t s);
// out[t, i] += y[t, i] * sigmoid(gate[t]) (gate (rows, 1)): sigmoid_gate then add, in one launch.
void sigmoid_gate_add(float* out, const float* y, const float* gate, int64_t rows, int64_t cols, cudaStream_t s);
// g[i] = act(g[i] (+ gate_bias), u[i] (+ up_bias)) over rows x cols (SwiGLU or gpt-oss's clamped form).
void expert_activation(float* g, const float* u, int64_t rows, int64_t cols, const float* gate_bias,
                       const float* up_bias, const MoeParams& p, cudaStream_t s);

// ids[r] = the lowest column of row r's largest value (x: rows x cols), -1 where the row holds a
// NaN or +inf or only -inf (Backend::greedy_rows). `work`: greedy_work_ints(rows, cols) ints.
void greedy_rows(const float* x, int64_t rows, int64_t cols, int32_t* ids, int32_t* work, cudaStream_t s);
int64_t greedy_work_ints(int64_t rows, int64_t cols);

}  // namespace moestream::cuda
