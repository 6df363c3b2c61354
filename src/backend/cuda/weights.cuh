// Device-side reading of weight matrices in every stored format, shared by the linear and MoE
// kernels: the format tag, packs of 32 elements decoded from 16-byte loads, and the GEMV tile
// (one warp, kRowsPerWarp rows, up to kTokens activation rows staged in shared memory).
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/common.cuh"

namespace moestream::cuda {

// Weight formats as template tags: plain element types, or affine-quantized bits with BF16 or
// F16 scales.
enum Kind : int { kF32 = 0, kBF16 = 1, kF16 = 2, kQ2 = 12, kQ3 = 13, kQ4 = 14, kQ6 = 16, kQ8 = 18 };
constexpr bool is_quant(int kind) { return kind >= 10; }
constexpr int bits_of(int kind) { return kind - 10; }

// One matrix (rows, cols) in device memory, as the kernels read it.
struct WeightRef {
  const void* data = nullptr;
  const uint16_t* scales = nullptr;  // quantized: [rows, cols / group]
  const uint16_t* biases = nullptr;
  int64_t rows = 0, cols = 0;
  int group_shift = 0;  // log2(group size)
};

// The format of a host-side Matrix: kind and whether scales are F16. Fails naming the matrix
// on anything the CUDA kernels do not read.
struct FormatTag {
  int kind = kF32;
  bool scale_f16 = false;
  bool operator==(const FormatTag&) const = default;
};
FormatTag format_of(const Matrix& m);
WeightRef weight_ref(const Matrix& m);

// Calls f.template operator()<KIND, SCALE_F16>() for the tag.
template <class F>
void dispatch_format(FormatTag t, F&& f) {
  switch (t.kind) {
    case kF32: return f.template operator()<kF32, false>();
    case kBF16: return f.template operator()<kBF16, false>();
    case kF16: return f.template operator()<kF16, false>();
#define MS_QUANT_CASE(K) \
    case K: return t.scale_f16 ? f.template operator()<K, true>() : f.template operator()<K, false>();
    MS_QUANT_CASE(kQ2)
    MS_QUANT_CASE(kQ3)
    MS_QUANT_CASE(kQ4)
    MS_QUANT_CASE(kQ6)
    MS_QUANT_CASE(kQ8)
#undef MS_QUANT_CASE
  }
  fail("cuda: unknown weight format tag ", t.kind);
}

template <bool F16>
__device__ __forceinline__ float scale_value(uint16_t v) {
  if constexpr (F16) return f16_bits_to_f32(v);
  else return bf16_bits_to_f32(v);
}

// Shared-memory layout of an activation row: 4 floats of padding after every 32, so the lanes of
// a warp (each on its own pack of 32) read float4s from distinct banks.
__host__ __device__ __forceinline__ int64_t padded(int64_t i) { return i + (i >> 5) * 4; }
__host__ __device__ __forceinline__ int64_t padded_cols(int64_t cols) { return ((cols + 31) >> 5) * 36; }

// The 32 codes of pack `p` of row `r` (quantized), from B words = 32 * B bits.
template <int B>
__device__ __forceinline__ void load_codes(const uint32_t* words, float (&q)[32]) {
  uint32_t w[B];
  if constexpr (B == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(words);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (B == 8) {
    const uint4 v0 = reinterpret_cast<const uint4*>(words)[0], v1 = reinterpret_cast<const uint4*>(words)[1];
    w[0] = v0.x; w[1] = v0.y; w[2] = v0.z; w[3] = v0.w; w[4] = v1.x; w[5] = v1.y; w[6] = v1.z; w[7] = v1.w;
  } else if constexpr (B == 2 || B == 6) {  // 8-byte aligned: rows of cols * B / 32 words, B even
#pragma unroll
    for (int j = 0; j < B / 2; ++j) {
      const uint2 v = reinterpret_cast<const uint2*>(words)[j];
      w[2 * j] = v.x; w[2 * j + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < B; ++j) w[j] = words[j];
  }
  constexpr uint32_t mask = (1u << B) - 1;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int bit = i * B, k = bit >> 5, s = bit & 31;
    uint32_t v = w[k] >> s;
    if (s + B > 32) v |= w[k + 1] << (32 - s);
    q[i] = float(v & mask);
  }
}

// Plain rows: 32 elements from 4 (16-bit) or 8 (f32) 16-byte loads when `vec`, else one by one
// (only `n` < 32 valid at a row's tail).
template <int KIND>
__device__ __forceinline__ void load_plain(const void* data, int64_t index, bool vec, int n, float (&q)[32]) {
  if constexpr (KIND == kF32) {
    const float* p = static_cast<const float*>(data) + index;
    if (vec) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 v = reinterpret_cast<const float4*>(p)[j];
        q[4 * j] = v.x; q[4 * j + 1] = v.y; q[4 * j + 2] = v.z; q[4 * j + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) q[i] = i < n ? p[i] : 0.0f;
    }
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(data) + index;
    uint16_t h[32];
    if (vec) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 v = reinterpret_cast<const uint4*>(p)[j];
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          h[8 * j + 2 * k] = uint16_t(u[k] & 0xffff);
          h[8 * j + 2 * k + 1] = uint16_t(u[k] >> 16);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) h[i] = i < n ? p[i] : uint16_t(0);
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) q[i] = KIND == kBF16 ? bf16_bits_to_f32(h[i]) : f16_bits_to_f32(h[i]);
  }
}

constexpr int kRowsPerWarp = 2;
constexpr int kTokens = 4;        // activation rows per pass
constexpr int kGemvWarps = 8;     // warps per block
constexpr int kGemvRows = kRowsPerWarp * kGemvWarps;  // rows per block

// Stages nt rows of x (row t at x_row(t)) into shared memory: xs [nt][padded_cols], and for
// quantized formats xsum [nt][packs] (the sum of each pack of 32, which multiplies the bias).
template <class RowPtr>
__device__ __forceinline__ void stage_x(RowPtr x_row, int nt, int64_t cols, float* xs, float* xsum, bool sums) {
  const int64_t cp = padded_cols(cols), packs = (cols + 31) >> 5;
  for (int t = 0; t < nt; ++t) {
    const float* x = x_row(t);
    for (int64_t i = threadIdx.x; i < packs * 32; i += blockDim.x) xs[t * cp + padded(i)] = i < cols ? x[i] : 0.0f;
  }
  __syncthreads();
  if (sums) {
    for (int64_t j = threadIdx.x; j < nt * packs; j += blockDim.x) {
      const int t = int(j / packs);
      const int64_t p = j % packs;
      const float* v = xs + t * cp + p * 36;
      float s = 0;
      const int n = int(cols - p * 32 < 32 ? cols - p * 32 : 32);
      for (int i = 0; i < n; ++i) s += v[i];
      xsum[j] = s;
    }
    __syncthreads();
  }
}

// acc[r][t] = row (row0 + r) of w . x_t for the rows this warp owns (rows past w.rows give 0).
// xs/xsum as stage_x left them; all lanes of the warp return the full sums.
template <int KIND, bool SF16>
__device__ __forceinline__ void gemv_warp(const WeightRef& w, int64_t row0, const float* xs, const float* xsum,
                                          int nt, float (&acc)[kRowsPerWarp][kTokens]) {
  const int lane = threadIdx.x & 31;
  const int64_t cols = w.cols, cp = padded_cols(cols), packs = (cols + 31) >> 5;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < kTokens; ++t) acc[r][t] = 0.0f;
  const bool vec = (cols & 31) == 0;
  for (int64_t p = lane; p < packs; p += 32) {
    float q[kRowsPerWarp][32];
    float scale[kRowsPerWarp], bias[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t row = row0 + r < w.rows ? row0 + r : w.rows - 1;  // past the end: recompute the last row, unused
      if constexpr (is_quant(KIND)) {
        constexpr int B = bits_of(KIND);
        const uint32_t* words = static_cast<const uint32_t*>(w.data) + row * (cols * B / 32) + p * B;
        load_codes<B>(words, q[r]);
        const int64_t g = row * (cols >> w.group_shift) + ((p * 32) >> w.group_shift);
        scale[r] = scale_value<SF16>(w.scales[g]);
        bias[r] = scale_value<SF16>(w.biases[g]);
      } else {
        load_plain<KIND>(w.data, row * cols + p * 32, vec, int(cols - p * 32 < 32 ? cols - p * 32 : 32), q[r]);
      }
    }
#pragma unroll
    for (int t = 0; t < kTokens; ++t) {
      if (t >= nt) break;
      const float* xv = xs + t * cp + p * 36;
      float d[kRowsPerWarp];
      float sx = 0.0f;  // sum of this pack of x: multiplies the bias
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) d[r] = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 x4 = reinterpret_cast<const float4*>(xv)[j];
        if constexpr (is_quant(KIND)) sx += (x4.x + x4.y) + (x4.z + x4.w);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r) {
          d[r] = fmaf(q[r][4 * j], x4.x, d[r]);
          d[r] = fmaf(q[r][4 * j + 1], x4.y, d[r]);
          d[r] = fmaf(q[r][4 * j + 2], x4.z, d[r]);
          d[r] = fmaf(q[r][4 * j + 3], x4.w, d[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if constexpr (is_quant(KIND)) acc[r][t] += fmaf(scale[r], d[r], bias[r] * sx);
        else acc[r][t] += d[r];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < kTokens; ++t)
      if (t < nt) acc[r][t] = warp_sum(acc[r][t]);
}

// Shared memory one GEMV block may use (the device's opt-in limit, read once; linear.cu).
size_t max_gemv_smem();

// Shared memory a GEMV block needs for nt staged rows of `cols`.
inline size_t gemv_smem_bytes(int64_t cols, int nt) {
  return size_t(nt) * size_t(padded_cols(cols) + ((cols + 31) >> 5)) * sizeof(float);
}

}  // namespace moestream::cuda
