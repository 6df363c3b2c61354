// Activations split for the exact tensor-core kernels (expert_exact_mma.cu, gemv_mma.cu): each row
// scaled by a power of two that puts its largest finite magnitude in [2^14, 2^15) and split into
// two FP16 halves, hi = fp16(x) and lo = fp16(x - hi), with each pack of 32's float32 sum of the
// scaled row. split_kernel (expert_exact_mma.cu) writes them, and so does the RMSNorm before a
// batched step's products (elementwise.cu, NormSplit below), with the same functions.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#include "backend/cuda/mma.cuh"
#endif

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

#ifdef __CUDACC__  // linear.h, which host code includes, takes NormSplit only

// The power of two s such that mx * 2^s, a row's largest magnitude, lies in [2^14, 2^15); 0 when
// mx is zero, infinite or NaN (such rows go through unscaled).
__device__ __forceinline__ int split_shift(float mx) {
  if (!(mx > 0.0f && mx <= 3.4e38f)) return 0;
  int e;
  frexpf(mx, &e);  // mx = f * 2^e, f in [0.5, 1)
  return min(max(15 - e, -126), 126);
}

// The q4 decode turns a word of 8 codes into FP16 pairs of columns (i, i + 4); the activations are
// laid out the same way, so each product still pairs a code with its column. Position of column c
// (0..7) of each 8 in SplitRows.
__device__ __forceinline__ int slot_of(int c, bool interleaved) { return interleaved ? 2 * (c & 3) + (c >> 2) : c; }

// Columns [c8, c8 + 8) of row r (v0, v1: the row's values there) times `up` (2^split_shift) into
// out, and the sum of their pack of 32 from the 4 threads that hold it (4 consecutive lanes, all in
// `lanes`, the warp's lanes calling). Row r's inv and its sums past the packs are the caller's.
template <bool INTERLEAVED>
__device__ __forceinline__ void split_eight(float4 v0, float4 v1, float up, int64_t r, int64_t c8,
                                            const SplitRows& out, unsigned lanes) {
  const float v[8] = {v0.x * up, v0.y * up, v0.z * up, v0.w * up, v1.x * up, v1.y * up, v1.z * up, v1.w * up};
  __align__(16) __half hi[8], lo[8];
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __half h = __float2half_rn(v[i]);
    const int at = slot_of(i, INTERLEAVED);
    hi[at] = h;
    lo[at] = __float2half_rn(v[i] - __half2float(h));
    s += v[i];
  }
  *reinterpret_cast<uint4*>(out.hi + r * out.cols + c8) = *reinterpret_cast<const uint4*>(hi);
  *reinterpret_cast<uint4*>(out.lo + r * out.cols + c8) = *reinterpret_cast<const uint4*>(lo);
  s += __shfl_xor_sync(lanes, s, 1);
  s += __shfl_xor_sync(lanes, s, 2);
  if ((c8 / 8) % 4 == 0) out.sum[r * out.sum_stride + c8 / 32] = s;
}

// split_eight over row r's columns (cols a multiple of 32; x: the row), 8 a thread: every thread
// of the block calls it, so that each round's calling lanes are known to the warp.
template <bool INTERLEAVED>
__device__ __forceinline__ void split_row(const float* x, int64_t cols, float up, int64_t r, const SplitRows& out) {
  for (int64_t base = 0; base < cols; base += 8 * int64_t(blockDim.x)) {
    const int64_t c8 = base + 8 * int64_t(threadIdx.x);
    const unsigned lanes = __ballot_sync(0xffffffffu, c8 < cols);
    if (c8 < cols)
      split_eight<INTERLEAVED>(*reinterpret_cast<const float4*>(x + c8), *reinterpret_cast<const float4*>(x + c8 + 4),
                               up, r, c8, out, lanes);
  }
}

#endif  // __CUDACC__

// x split by the kernel that wrote it: the RMSNorm of a step of 2 to kGemvMaxTokens rows
// (CudaBackend::add_rmsnorm), for the operation right after it, whose few-token products take it
// instead of splitting x again (the same values: split_eight and split_shift over the same row).
// The backend drops it when any operation ends.
struct NormSplit {
  const float* x = nullptr;  // the rows split, [T, rows.cols] one after the other
  int64_t T = 0;
  bool interleaved = false;
  SplitRows rows;
  const void* norm = nullptr;  // the norm's weights, which name where it was made
  bool asked = false;          // a product asked for these rows split ...
  bool asked_interleaved = false;  // ... in this order

  // The split of T rows of x (row stride ldx, `cols` columns) in the order asked, or null.
  const SplitRows* find(const float* px, int64_t ldx, int64_t t, int64_t cols, bool want_interleaved) {
    if (!x || px != x || t != T || cols != rows.cols || ldx != cols) return nullptr;
    asked = true;
    asked_interleaved = want_interleaved;
    return want_interleaved == interleaved ? &rows : nullptr;
  }
};

// The T rows of x (row stride ldx, a multiple of 4; x 16-byte aligned; out.cols a multiple of 32)
// split into out, columns within each 8 in q4's decode order when `interleaved` (0, 4, 1, 5, 2, 6,
// 3, 7), else in order. Launched to overlap the kernel before it (launch() in common.cuh).
void split_tokens(const float* x, int64_t ldx, int64_t T, bool interleaved, const SplitRows& out, cudaStream_t s);

}  // namespace moestream::cuda
