// Device-side reading of weight matrices in every stored format, shared by the linear and MoE
// kernels: the format tag, packs of 32 elements decoded from 16-byte loads, single elements for
// the dequantizers, and the GEMV tile (one warp, kRowsPerWarp rows, up to kTokens activation
// rows staged in shared memory).
#pragma once

#include <cstdint>
#include <utility>

#include "backend/backend.h"
#include "backend/cuda/common.cuh"

namespace moestream::cuda {

// Weight formats as template tags. Plain element types; MLX affine-quantized bits with BF16 or
// F16 scales and biases (value = q * scale + bias); MXFP4 (4-bit E2M1 codes packed like affine
// 4-bit, one E8M0 exponent byte per 32); FP8 (one E4M3 byte per weight, one float32 scale per
// group of G columns, the last group of a row possibly partial). The quantized kinds multiply
// the 32 code values of a pack by their group's scale; only affine adds a bias.
enum Kind : int { kF32 = 0, kBF16 = 1, kF16 = 2, kQ2 = 12, kQ3 = 13, kQ4 = 14, kQ6 = 16, kQ8 = 18, kMxfp4 = 20, kFp8 = 21 };
constexpr bool is_quant(int kind) { return kind >= 10; }
constexpr bool is_affine(int kind) { return kind >= 10 && kind < kMxfp4; }
constexpr int bits_of(int kind) { return kind == kMxfp4 ? 4 : kind == kFp8 ? 8 : kind - 10; }

// One matrix (rows, cols) in device memory, as the kernels read it.
struct WeightRef {
  const void* data = nullptr;
  const void* scales = nullptr;      // quantized: [rows, groups_per_row]; BF16/F16, E8M0 bytes or F32
  const uint16_t* biases = nullptr;  // affine: like scales; otherwise null
  int64_t rows = 0, cols = 0;
  int64_t groups_per_row = 0;  // ceil(cols / group_size)
  int group_size = 0;
  int group_shift = -1;  // log2(group_size) when a power of two (every format but some FP8), else -1
};

// The format of a host-side Matrix: kind and whether scales are F16 (affine only). Fails naming
// the matrix on anything the CUDA kernels do not read.
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
    case kMxfp4: return f.template operator()<kMxfp4, false>();
    case kFp8: return f.template operator()<kFp8, false>();
  }
  fail("cuda: unknown weight format tag ", t.kind);
}

template <bool F16>
__device__ __forceinline__ float scale_value(uint16_t v) {
  if constexpr (F16) return f16_bits_to_f32(v);
  else return bf16_bits_to_f32(v);
}

// Twice the E2M1 value of an MXFP4 code: magnitudes 0, 1, 2, 3, 4, 6, 8, 12 for codes 0..7 (one
// nibble each in 0xC8643210), bit 3 the sign. The half goes into the scale (mxfp4_scale), so the
// code values are small integers, like affine codes.
__device__ __forceinline__ float mxfp4_twice_value(uint32_t code) {
  const float m = float((0xC8643210u >> ((code & 7) * 4)) & 0xf);
  return code & 8 ? -m : m;
}
// 2^(e - 128) for an E8M0 exponent byte (e <= kMxfp4MaxExponent, checked when packed): with
// mxfp4_twice_value, fp4(c) * 2^(e - 127) exactly. e = 0 and 1 give subnormal floats.
__device__ __forceinline__ float mxfp4_scale(uint32_t e) {
  return e >= 2 ? __uint_as_float((e - 1) << 23) : __uint_as_float(0x200000u << e);
}
// An E4M3 "fn" byte as float32, exactly: exponent and mantissa moved to float32's top bits, then
// scaled by 2^(127 - 7) (so exponent 0 lands on m * 2^-9, a subnormal times 2^120), sign OR-ed in.
__device__ __forceinline__ float fp8_e4m3_value(uint32_t b) {
  const float m = __uint_as_float((b & 0x7f) << 20) * 0x1p120f;
  return __uint_as_float(__float_as_uint(m) | ((b & 0x80) << 24));
}

// A step of a pack's sum of x (which multiplies the affine bias): four values, added in this order
// wherever the sum is taken (staged by stage_x, or by the single-token tile), so all agree bit for bit.
__device__ __forceinline__ float quad_sum(float4 v) { return (v.x + v.y) + (v.z + v.w); }

// Shared-memory layout of an activation row: 4 floats of padding after every 32, so the lanes of
// a warp (each on its own pack of 32) read float4s from distinct banks.
__host__ __device__ __forceinline__ int64_t padded(int64_t i) { return i + (i >> 5) * 4; }
__host__ __device__ __forceinline__ int64_t padded_cols(int64_t cols) { return ((cols + 31) >> 5) * 36; }

// The value of a B-bit code of a packed (affine or MXFP4) format, before the group's scale.
template <int KIND>
__device__ __forceinline__ float code_value(uint32_t code) {
  if constexpr (KIND == kMxfp4) return mxfp4_twice_value(code);
  else return float(code);
}

// The B words (32 * B bits) of one pack of a packed format, with the widest loads its alignment
// allows.
template <int B>
__device__ __forceinline__ void load_words(const uint32_t* words, uint32_t (&w)[B]) {
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
}

// (w & MASK) | BITS in one instruction (a lop3 whose table is (a & b) | c): written as two
// operations the compiler emits two, since an instruction takes one immediate (ncu's SASS counts of
// the expert kernels: 257 logic instructions a line where 128 do; docs/PERFORMANCE.md, session 41).
template <uint32_t MASK, uint32_t BITS>
__device__ __forceinline__ uint32_t masked_or(uint32_t w) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "n"(MASK), "n"(BITS));
  return r;
}

// The B-bit code at bits [S, S + B) of w as a float, exactly, in two instructions and without a
// conversion: with 2^23's exponent OR-ed in, the bits read 2^23 + code * 2^S (S + B <= 23 keeps
// the code in the mantissa), and that times 2^-S, minus 2^(23 - S), is the code.
template <int B, int S>
__device__ __forceinline__ float code_in_mantissa(uint32_t w) {
  static_assert(S + B <= 23, "the code must lie within the mantissa");
  const float f = __uint_as_float(masked_or<((1u << B) - 1u) << S, 0x4B000000u>(w));
  return fmaf(f, 1.0f / float(1u << S), -float(1u << (23 - S)));
}

// Value I of the pack in words w (decode_codes' I-th; a kernel may decode a pack's codes where it
// uses them, not all 32 at once). IN_MANTISSA: 2-, 4- and 8-bit codes through code_in_mantissa,
// the same values: the codes of a word that end within its low 23 bits in place, the others from
// the word shifted right by 12 (16 for bytes), which brings them there (q2: codes 0-10 in place;
// q4: nibbles 0-4; q8: bytes 0-1).
template <int KIND, bool IN_MANTISSA, int I>
__device__ __forceinline__ float code_at(const uint32_t (&w)[bits_of(KIND)]) {
  constexpr int B = bits_of(KIND);
  if constexpr (IN_MANTISSA && (KIND == kQ2 || KIND == kQ4 || KIND == kQ8)) {
    constexpr int per = 32 / B, k = I / per, bit = B * (I % per), shift = B == 8 ? 16 : 12;
    if constexpr (bit + B <= 23) return code_in_mantissa<B, bit>(w[k]);
    else return code_in_mantissa<B, bit - shift>(w[k] >> shift);
  } else {
    constexpr int bit = I * B, k = bit >> 5, sh = bit & 31;
    uint32_t v = w[k] >> sh;
    if constexpr (sh + B > 32) v |= w[k + 1] << (32 - sh);
    return code_value<KIND>(v & ((1u << B) - 1u));
  }
}

// The 32 code values of one pack of a packed format from its B words (code_at's). IN_MANTISSA pays
// where each decoded value is used once (one row of x: +3-9% one-token decode on an H200); where
// the values serve two rows of x, ptxas spilled them (the 8-stream expert kernels took 2.7x as
// long), so the others convert.
template <int KIND, bool IN_MANTISSA = false>
__device__ __forceinline__ void decode_codes(const uint32_t (&w)[bits_of(KIND)], float (&q)[32]) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((q[I] = code_at<KIND, IN_MANTISSA, I>(w)), ...);
  }(std::make_integer_sequence<int, 32>{});
}

// The 32 code values of one pack of a packed format, from B words = 32 * B bits.
template <int KIND, bool IN_MANTISSA = false>
__device__ __forceinline__ void load_codes(const uint32_t* words, float (&q)[32]) {
  uint32_t w[bits_of(KIND)];
  load_words<bits_of(KIND)>(words, w);
  decode_codes<KIND, IN_MANTISSA>(w, q);
}

// 32 FP8 bytes as 8 words, decoded.
__device__ __forceinline__ void decode_fp8_words(const uint32_t (&u)[8], float (&q)[32]) {
#pragma unroll
  for (int k = 0; k < 32; ++k) q[k] = fp8_e4m3_value((u[k / 4] >> (8 * (k % 4))) & 0xff);
}

// FP8 bytes p[0..32): two 16-byte loads when `vec`, else one by one (only `n` < 32 valid at a
// row's tail; the rest read as 0, never as whatever follows the row).
__device__ __forceinline__ void load_fp8(const uint8_t* p, bool vec, int n, float (&q)[32]) {
  if (vec) {
    uint32_t u[8];
    load_words<8>(reinterpret_cast<const uint32_t*>(p), u);
    decode_fp8_words(u, q);
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) q[i] = i < n ? fp8_e4m3_value(p[i]) : 0.0f;
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

// The 32 values of pack p (columns [32p, 32p + 32)) of `row`, before the group's scale and bias.
// `vec`: cols is a multiple of 32 (16-byte loads for the byte and plain formats; the packed
// formats always have whole packs).
template <int KIND>
__device__ __forceinline__ void load_pack(const WeightRef& w, int64_t row, int64_t p, bool vec, float (&q)[32]) {
  const int n = int(w.cols - p * 32 < 32 ? w.cols - p * 32 : 32);
  if constexpr (KIND == kFp8) {
    load_fp8(static_cast<const uint8_t*>(w.data) + row * w.cols + p * 32, vec, n, q);
  } else if constexpr (is_quant(KIND)) {
    constexpr int B = bits_of(KIND);
    load_codes<KIND>(static_cast<const uint32_t*>(w.data) + row * (w.cols * B / 32) + p * B, q);
  } else {
    load_plain<KIND>(w.data, row * w.cols + p * 32, vec, n, q);
  }
}

// A quantized pack as loaded, not yet decoded (so that a kernel can issue the loads of its next
// step before it computes the current one): the words of the codes and the raw bits of the
// group's scale and (affine) bias. Whole packs only (cols a multiple of 32).
template <int KIND>
struct RawQuantPack {
  static constexpr int kWords = KIND == kFp8 ? 8 : bits_of(KIND);
  uint32_t words[kWords];
  uint32_t scale, bias;
};

// The group of column col within its row (I: int or int64_t, the column's own type).
template <class I>
__device__ __forceinline__ I group_in_row(const WeightRef& w, I col) {
  return w.group_shift >= 0 ? col >> w.group_shift : col / w.group_size;
}
// Index of the scale (and bias) of element (row, col). A pack of 32 never straddles two groups
// (group sizes are multiples of 32).
__device__ __forceinline__ int64_t group_index(const WeightRef& w, int64_t row, int64_t col) {
  return row * w.groups_per_row + group_in_row(w, col);
}

template <int KIND, bool SF16>
__device__ __forceinline__ float group_scale(const WeightRef& w, int64_t g) {
  if constexpr (KIND == kMxfp4) return mxfp4_scale(static_cast<const uint8_t*>(w.scales)[g]);
  else if constexpr (KIND == kFp8) return static_cast<const float*>(w.scales)[g];
  else return scale_value<SF16>(static_cast<const uint16_t*>(w.scales)[g]);
}

// The code values of a raw pack and its group's scale and bias (0 unless affine): what
// load_pack and group_scale give for the same pack.
template <int KIND, bool SF16>
__device__ __forceinline__ void decode_raw_pack(const RawQuantPack<KIND>& r, float (&q)[32], float& scale, float& bias) {
  if constexpr (KIND == kFp8) decode_fp8_words(r.words, q);
  else decode_codes<KIND>(r.words, q);
  if constexpr (KIND == kMxfp4) scale = mxfp4_scale(r.scale);
  else if constexpr (KIND == kFp8) scale = __uint_as_float(r.scale);
  else scale = scale_value<SF16>(uint16_t(r.scale));
  bias = is_affine(KIND) ? scale_value<SF16>(uint16_t(r.bias)) : 0.0f;
}

// Element (r, c) of w as float32: the dequantizers (GEMM tiles, embedding rows).
template <int KIND, bool SF16>
__device__ __forceinline__ float weight_at(const WeightRef& w, int64_t r, int64_t c) {
  if constexpr (KIND == kF32) {
    return static_cast<const float*>(w.data)[r * w.cols + c];
  } else if constexpr (KIND == kBF16 || KIND == kF16) {
    const uint16_t h = static_cast<const uint16_t*>(w.data)[r * w.cols + c];
    return KIND == kBF16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
  } else {
    const int64_t g = group_index(w, r, c);
    float q;
    if constexpr (KIND == kFp8) {
      q = fp8_e4m3_value(static_cast<const uint8_t*>(w.data)[r * w.cols + c]);
    } else {
      constexpr int B = bits_of(KIND);
      const uint32_t* row = static_cast<const uint32_t*>(w.data) + r * (w.cols * B / 32);
      const int64_t bit = c * B, k = bit >> 5;
      const int s = int(bit & 31);
      uint32_t code = row[k] >> s;
      if (s + B > 32) code |= row[k + 1] << (32 - s);
      q = code_value<KIND>(code & ((1u << B) - 1));
    }
    if constexpr (is_affine(KIND)) return fmaf(q, group_scale<KIND, SF16>(w, g), scale_value<SF16>(w.biases[g]));
    else return q * group_scale<KIND, SF16>(w, g);
  }
}

__device__ __forceinline__ __half to_half_saturated(float v) {
  return __float2half_rn(fminf(fmaxf(v, -65504.0f), 65504.0f));  // NaN stays NaN
}

// Rows [r0, r0 + n) of w as FP16 (saturating) into dst [n, w.cols], w.cols a multiple of 8: a
// grid-stride loop over the x dimension, 8 columns (one 16-byte store) per step, so that a warp's
// stores are contiguous. (Decoding a whole pack of 32 per thread, as the GEMV does, measured
// slower: 1177 against 1429 tok/s of pp512 on the H100, its stores 64 bytes apart.)
template <int KIND, bool SF16>
__device__ __forceinline__ void dequant_rows_f16(const WeightRef& w, int64_t r0, int64_t n, __half* __restrict__ dst) {
  const int64_t per_row = w.cols / 8, total = n * per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * 8;
    __align__(16) __half h[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = to_half_saturated(weight_at<KIND, SF16>(w, r0 + r, c + j));
    *reinterpret_cast<uint4*>(dst + r * w.cols + c) = *reinterpret_cast<const uint4*>(h);
  }
}

constexpr int kRowsPerWarp = 2;
constexpr int kTokens = 4;        // activation rows per pass (the expert kernels; linear's GEMV takes up to 8)
constexpr int kWideTokens = 8;    // linear's GEMV for 5 to 8 tokens (batched decode steps)
constexpr int kGemvWarps = 8;     // warps per block
constexpr int kGemvRows = kRowsPerWarp * kGemvWarps;  // rows per block

// Stages nt rows of x (row t at x_row(t)) into shared memory: xs [nt][padded_cols], and for
// quantized formats xsum [nt][packs] (the sum of each pack of 32, which multiplies the bias).
template <class RowPtr>
__device__ __forceinline__ void stage_x(RowPtr x_row, int nt, int64_t cols, float* xs, float* xsum, bool sums) {
  const int64_t cp = padded_cols(cols), packs = (cols + 31) >> 5;
  for (int t = 0; t < nt; ++t) {
    const float* x = x_row(t);
    if ((cols & 31) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {  // whole packs: 16-byte copies
      for (int64_t i = threadIdx.x; i < cols / 4; i += blockDim.x)
        *reinterpret_cast<float4*>(xs + t * cp + padded(4 * i)) = reinterpret_cast<const float4*>(x)[i];
    } else {
      for (int64_t i = threadIdx.x; i < packs * 32; i += blockDim.x) xs[t * cp + padded(i)] = i < cols ? x[i] : 0.0f;
    }
  }
  __syncthreads();
  if (sums) {  // summed as gemv_warp would sum the pack (zeros past cols), bit for bit
    for (int64_t j = threadIdx.x; j < nt * packs; j += blockDim.x) {
      const int t = int(j / packs);
      const int64_t p = j % packs;
      const float4* v = reinterpret_cast<const float4*>(xs + t * cp + p * 36);
      float s = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        s += quad_sum(v[i]);
      }
      xsum[j] = s;
    }
    __syncthreads();
  }
}

// acc[r][t] = row (row0 + r) of w . x_t for the rows this warp owns (rows past w.rows give 0).
// xs/xsum as stage_x left them (xsum, the packs' sums of x, staged for affine kinds); all lanes
// of the warp return the full sums.
// NT: the most tokens one pass takes (the size of acc); each token's sum is the same for any NT.
template <int KIND, bool SF16, int NT = kTokens>
__device__ __forceinline__ void gemv_warp(const WeightRef& w, int64_t row0, const float* xs, const float* xsum,
                                          int nt, float (&acc)[kRowsPerWarp][NT]) {
  const int lane = threadIdx.x & 31;
  const int64_t cols = w.cols, cp = padded_cols(cols), packs = (cols + 31) >> 5;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
  const bool vec = (cols & 31) == 0;
  for (int64_t p = lane; p < packs; p += 32) {
    float q[kRowsPerWarp][32];
    float scale[kRowsPerWarp], bias[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t row = row0 + r < w.rows ? row0 + r : w.rows - 1;  // past the end: recompute the last row, unused
      load_pack<KIND>(w, row, p, vec, q[r]);
      if constexpr (is_quant(KIND)) {
        const int64_t g = group_index(w, row, p * 32);
        scale[r] = group_scale<KIND, SF16>(w, g);
        if constexpr (is_affine(KIND)) bias[r] = scale_value<SF16>(w.biases[g]);
      }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= nt) break;
      const float* xv = xs + t * cp + p * 36;
      float d[kRowsPerWarp];
      const float sx = is_affine(KIND) ? xsum[t * packs + p] : 0.0f;  // multiplies the affine bias
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) d[r] = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 x4 = reinterpret_cast<const float4*>(xv)[j];
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
        if constexpr (is_affine(KIND)) acc[r][t] += fmaf(scale[r], d[r], bias[r] * sx);
        else if constexpr (is_quant(KIND)) acc[r][t] = fmaf(scale[r], d[r], acc[r][t]);
        else acc[r][t] += d[r];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < nt) acc[r][t] = warp_sum(acc[r][t]);
}

// Shared memory one GEMV block may use (the device's opt-in limit, read once; linear.cu).
size_t max_gemv_smem();

// Shared memory a GEMV block needs for nt staged rows of `cols`.
inline size_t gemv_smem_bytes(int64_t cols, int nt) {
  return size_t(nt) * size_t(padded_cols(cols) + ((cols + 31) >> 5)) * sizeof(float);
}

}  // namespace moestream::cuda
