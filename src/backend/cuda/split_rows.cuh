// Activations split for the exact tensor-core kernels (expert_exact_mma.cu, gemv_mma.cu): each row
// scaled by a power of two that puts its largest finite magnitude in [2^14, 2^15) and split into
// two FP16 halves, hi = fp16(x) and lo = fp16(x - hi), with each pack of 32's float32 sum of the
// scaled row. split_kernel (expert_exact_mma.cu) writes them.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moestream::cuda {

struct SplitRows {
  __half* hi = nullptr;  // [rows, cols], columns in the weight format's order within each 8
  __half* lo = nullptr;
  float* sum = nullptr;  // [rows, sum_stride]: each pack's float32 sum of the scaled row; 0 past the packs
  float* inv = nullptr;  // [rows]: 2^-s, the inverse of the row's scaling
  int64_t cols = 0, sum_stride = 0;
};

// SplitRows for `rows` rows of `cols`, in four areas from get(slot, bytes).
template <class Get>
SplitRows split_buffers(Get get, int first_slot, int64_t rows, int64_t cols) {
  SplitRows r;
  r.cols = cols;
  r.sum_stride = (cols / 32 + 1) / 2 * 2;  // even: a step's two sums are one 8-byte copy
  r.hi = static_cast<__half*>(get(first_slot, size_t(rows * cols) * sizeof(__half)));
  r.lo = static_cast<__half*>(get(first_slot + 1, size_t(rows * cols) * sizeof(__half)));
  r.sum = static_cast<float*>(get(first_slot + 2, size_t(rows * r.sum_stride) * sizeof(float)));
  r.inv = static_cast<float*>(get(first_slot + 3, size_t(rows) * sizeof(float)));
  return r;
}

// The T rows of x (row stride ldx, a multiple of 4; x 16-byte aligned; out.cols a multiple of 32)
// split into out, columns within each 8 in q4's decode order when `interleaved` (0, 4, 1, 5, 2, 6,
// 3, 7), else in order. Launched to overlap the kernel before it (launch() in common.cuh).
void split_tokens(const float* x, int64_t ldx, int64_t T, bool interleaved, const SplitRows& out, cudaStream_t s);

}  // namespace moestream::cuda
