// AVX2 + FMA + F16C kernels. Every function carries the target attribute, so this file builds
// for a baseline x86-64 too; kernels.cpp only calls it after checking the CPU.
//
// Quantized rows are unpacked one block of 32 codes at a time into a ymm of bytes:
//   8 bits  the 32 bytes as they are;
//   4 bits  the block's 16 bytes in both halves, the upper half shifted right by 4, & 0x0f
//           (CodeOrder::Nibbles);
//   2 bits  the 8 bytes in all four quarters, shifted right by 0, 2, 4, 6, & 0x03
//           (CodeOrder::Crumbs);
//   3, 6    8 codes per b bytes. Each code is cut from the 16-bit window starting at the byte
//           that holds its first bit (pshufb), shifted into the high byte by a multiply with
//           2^(8 - bit offset), and the high bytes packed back to bytes: natural order.
// The int8 path multiplies codes (u8) by activations (s8) with maddubs + madd. 8-bit codes
// would overflow maddubs's int16 pairs, so they are used as q - 128 (signed) and the lost
// 128 * sum(x^) is added back through the group bias (bias + 128 * scale).
// MXFP4 runs as 4-bit affine groups of 32 (core/quant.h): the unpacked nibbles go through a
// pshufb with kMxfp4AffineCode, and each group's exponent gives scale' and bias'.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/quant_loops.h"
#include "core/quant.h"

#define MS_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))

namespace moestream::cpu::detail {

namespace {

MS_AVX2 inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

MS_AVX2 inline __m256 load_bf16(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
MS_AVX2 inline __m256 load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
MS_AVX2 inline __m256 load_half(const uint16_t* p, DType dt) {
  return dt == DType::F16 ? load_f16(p) : load_bf16(p);
}
// n (<= 8) stored scales or biases as floats, zeros after them.
MS_AVX2 inline __m256 load_half_n(const uint16_t* p, int64_t n, DType dt) {
  if (n >= 8) return load_half(p, dt);
  alignas(16) uint16_t tmp[8] = {};
  std::memcpy(tmp, p, size_t(n) * 2);
  return load_half(tmp, dt);
}

// ---- plain weights --------------------------------------------------------------------------

MS_AVX2 float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8)
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
  float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

MS_AVX2 void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

MS_AVX2 float dot_half(const uint16_t* w, const float* x, int64_t n, DType dt) {
  int64_t i = 0;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  if (dt == DType::BF16) {
    for (; i + 16 <= n; i += 16) {
      a0 = _mm256_fmadd_ps(load_bf16(w + i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(load_bf16(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      a0 = _mm256_fmadd_ps(load_f16(w + i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(load_f16(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load_half(w + i, dt), _mm256_loadu_ps(x + i), a0);
  float sum = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) sum += (dt == DType::BF16 ? bf16_to_f32(w[i]) : f16_to_f32(w[i])) * x[i];
  return sum;
}

// 16 FP8 E4M3 codes at p times s / 256 as floats (two halves of 8). Each code becomes the FP16
// number with the same sign, exponent and mantissa bits ((c & 0x7f) << 7, the sign moved to bit
// 15): that is the FP8 value * 2^-8 exactly, subnormals included (FP8 bias 7, FP16 bias 15), and
// F16C widens it exactly. With s = scale * 256 (exact) the product is fp8 * scale rounded once.
MS_AVX2 inline void load_fp8x16(const uint8_t* p, __m256 s, __m256& lo, __m256& hi) {
  __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
  t = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));  // sign: bit 14 -> 15
  lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(t)), s);
  hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(t, 1)), s);
}

// Lanes j < n (n <= 8) set, for masked loads and stores.
MS_AVX2 inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Row r of an FP8 matrix as weights fp8 * scale, 16 at a time: f(i, n, lo, hi) for
// i = 0, 16, ... with columns [i, i + n) in lo (the first 8) and hi, zeros after them.
template <class F>
MS_AVX2 inline void for_each_fp8(const Matrix& w, int64_t r, F&& f) {
  const uint8_t* codes = row_fp8_codes(w, r);
  const float* scales = row_fp8_scales(w, r);
  const int64_t n = w.cols, gs = w.quant.group_size;
  for (int64_t g0 = 0; g0 < n; g0 += gs) {
    const __m256 s = _mm256_set1_ps(scales[g0 / gs] * 256.0f);
    const int64_t end = std::min(n, g0 + gs);
    for (int64_t i = g0; i < end; i += 16) {
      __m256 lo, hi;
      if (end - i >= 16) {
        load_fp8x16(codes + i, s, lo, hi);
        f(i, int64_t(16), lo, hi);
      } else {
        alignas(16) uint8_t tail[16] = {};
        std::memcpy(tail, codes + i, size_t(end - i));
        load_fp8x16(tail, s, lo, hi);
        f(i, end - i, lo, hi);
      }
    }
  }
}

MS_AVX2 float dot_fp8_row(const Matrix& w, int64_t r, const float* x) {
  const uint8_t* codes = row_fp8_codes(w, r);
  const float* scales = row_fp8_scales(w, r);
  const int64_t n = w.cols, gs = w.quant.group_size;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t g0 = 0;
  for (; g0 + gs <= n; g0 += gs) {  // whole groups: straight 16-column steps
    const __m256 s = _mm256_set1_ps(scales[g0 / gs] * 256.0f);
    for (int64_t i = g0; i < g0 + gs; i += 16) {
      __m256 lo, hi;
      load_fp8x16(codes + i, s, lo, hi);
      a0 = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + i + 8), a1);
    }
  }
  if (g0 < n) {  // a partial last group
    const __m256 s = _mm256_set1_ps(scales[g0 / gs] * 256.0f);
    for (int64_t i = g0; i < n; i += 16) {
      const int64_t m = std::min<int64_t>(16, n - i);
      alignas(16) uint8_t c[16] = {};
      std::memcpy(c, codes + i, size_t(m));
      __m256 lo, hi;
      load_fp8x16(c, s, lo, hi);
      a0 = _mm256_fmadd_ps(lo, _mm256_maskload_ps(x + i, first_lanes(m)), a0);
      if (m > 8) a1 = _mm256_fmadd_ps(hi, _mm256_maskload_ps(x + i + 8, first_lanes(m - 8)), a1);
    }
  }
  return hsum(_mm256_add_ps(a0, a1));
}

MS_AVX2 float dot_plain_row(const Matrix& w, int64_t r, const float* x) {
  if (is_fp8(w)) return dot_fp8_row(w, r, x);
  if (w.dtype == DType::F32)
    return dot_f32(static_cast<const float*>(w.data) + r * w.cols, x, w.cols);
  return dot_half(static_cast<const uint16_t*>(w.data) + r * w.cols, x, w.cols, w.dtype);
}

MS_AVX2 void plain_row_to_f32(const Matrix& w, int64_t r, float* dst) {
  const int64_t n = w.cols;
  if (is_fp8(w)) {
    for_each_fp8(w, r, [&](int64_t i, int64_t m, __m256 lo, __m256 hi) MS_AVX2 {
      if (m == 16) {
        _mm256_storeu_ps(dst + i, lo);
        _mm256_storeu_ps(dst + i + 8, hi);
        return;
      }
      _mm256_maskstore_ps(dst + i, first_lanes(m), lo);
      if (m > 8) _mm256_maskstore_ps(dst + i + 8, first_lanes(m - 8), hi);
    });
    return;
  }
  if (w.dtype == DType::F32) {
    std::memcpy(dst, static_cast<const float*>(w.data) + r * n, size_t(n) * 4);
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(w.data) + r * n;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_half(src + i, w.dtype));
  for (; i < n; ++i) dst[i] = w.dtype == DType::BF16 ? bf16_to_f32(src[i]) : f16_to_f32(src[i]);
}

// ---- quantized weights ----------------------------------------------------------------------

// pshufb selectors and multipliers for 3- and 6-bit codes (see the file comment). Word j of a
// 128-bit lane takes bytes lo, lo + 1 with lo = j * b / 8 (plus b for the second group of 8),
// and is multiplied by 2^(8 - j * b % 8).
struct Straddle {
  alignas(32) int8_t first[32], second[32];
  alignas(32) int16_t mul[16];
};
constexpr Straddle make_straddle(int b) {
  Straddle s{};
  for (int lane = 0; lane < 2; ++lane)
    for (int j = 0; j < 8; ++j) {
      const int lo = j * b / 8;
      s.first[lane * 16 + 2 * j] = int8_t(lo);
      s.first[lane * 16 + 2 * j + 1] = int8_t(lo + 1);
      s.second[lane * 16 + 2 * j] = int8_t(lo + b);
      s.second[lane * 16 + 2 * j + 1] = int8_t(lo + b + 1);
      s.mul[lane * 8 + j] = int16_t(1 << (8 - j * b % 8));
    }
  return s;
}
constexpr Straddle kStraddle3 = make_straddle(3);
constexpr Straddle kStraddle6 = make_straddle(6);

// 32 codes from the packed block at p. For BITS 3 and 6, 32 bytes at p must be readable.
template <int BITS>
MS_AVX2 inline __m256i unpack32(const uint8_t* p) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else if constexpr (BITS == 4) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v = _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
  } else if constexpr (BITS == 2) {
    int64_t bytes;
    std::memcpy(&bytes, p, 8);
    __m256i v = _mm256_srlv_epi64(_mm256_set1_epi64x(bytes), _mm256_setr_epi64x(0, 2, 4, 6));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x03));
  } else {
    static_assert(BITS == 3 || BITS == 6);
    const Straddle& s = BITS == 3 ? kStraddle3 : kStraddle6;
    const __m256i src = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * BITS)), 1);
    const __m256i mul = _mm256_load_si256(reinterpret_cast<const __m256i*>(s.mul));
    __m256i a = _mm256_shuffle_epi8(src, _mm256_load_si256(reinterpret_cast<const __m256i*>(s.first)));
    __m256i b = _mm256_shuffle_epi8(src, _mm256_load_si256(reinterpret_cast<const __m256i*>(s.second)));
    a = _mm256_srli_epi16(_mm256_mullo_epi16(a, mul), 8);
    b = _mm256_srli_epi16(_mm256_mullo_epi16(b, mul), 8);
    return _mm256_and_si256(_mm256_packus_epi16(a, b), _mm256_set1_epi8((1 << BITS) - 1));
  }
}

// MXFP4 nibbles to their affine codes (core/quant.h), the table in both 128-bit lanes.
alignas(32) constexpr uint8_t kMxfp4Table[32] = {
    kMxfp4AffineCode[0],  kMxfp4AffineCode[1],  kMxfp4AffineCode[2],  kMxfp4AffineCode[3],
    kMxfp4AffineCode[4],  kMxfp4AffineCode[5],  kMxfp4AffineCode[6],  kMxfp4AffineCode[7],
    kMxfp4AffineCode[8],  kMxfp4AffineCode[9],  kMxfp4AffineCode[10], kMxfp4AffineCode[11],
    kMxfp4AffineCode[12], kMxfp4AffineCode[13], kMxfp4AffineCode[14], kMxfp4AffineCode[15],
    kMxfp4AffineCode[0],  kMxfp4AffineCode[1],  kMxfp4AffineCode[2],  kMxfp4AffineCode[3],
    kMxfp4AffineCode[4],  kMxfp4AffineCode[5],  kMxfp4AffineCode[6],  kMxfp4AffineCode[7],
    kMxfp4AffineCode[8],  kMxfp4AffineCode[9],  kMxfp4AffineCode[10], kMxfp4AffineCode[11],
    kMxfp4AffineCode[12], kMxfp4AffineCode[13], kMxfp4AffineCode[14], kMxfp4AffineCode[15]};

// 32 codes of a block, as the affine kernels read them: MXFP4 nibbles translated.
template <int BITS, bool MX>
MS_AVX2 inline __m256i codes32(const uint8_t* p) {
  if constexpr (MX) {
    static_assert(BITS == 4);
    return _mm256_shuffle_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(kMxfp4Table)),
                               unpack32<4>(p));
  } else {
    return unpack32<BITS>(p);
  }
}

// Scales and biases of one row's groups as floats, up to eight at a time: stored halves
// (affine), or the E8M0 exponents as MXFP4's scale' and bias' (core/quant.h).
template <bool MX>
struct RowGroups {
  const void* scales;
  const void* biases;
  DType dt;
  MS_AVX2 RowGroups(const Matrix& w, int64_t r)
      : scales(MX ? static_cast<const void*>(row_exponents(w, r)) : row_scales(w, r)),
        biases(MX ? nullptr : row_biases(w, r)),
        dt(w.quant.scale_dtype) {}
  // Groups g0 .. g0 + n (n <= 8); zeros after them.
  MS_AVX2 void load(int64_t g0, int64_t n, __m256& s, __m256& b) const {
    if constexpr (MX) {
      int64_t bytes = 0;
      std::memcpy(&bytes, static_cast<const uint8_t*>(scales) + g0, size_t(std::min<int64_t>(n, 8)));
      // scale' = 2^(e - 128) built from its bits: exponent field e - 1, or for e < 2 the
      // subnormal 1 << (21 + e). Lanes past n are zero.
      const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
      const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_add_epi32(e, _mm256_set1_epi32(21)));
      const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
      const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      s = _mm256_castsi256_ps(_mm256_and_si256(_mm256_blendv_epi8(normal, subnormal, tiny), valid));
      b = _mm256_mul_ps(s, _mm256_set1_ps(-kMxfp4AffineBiasCodes));
    } else {
      s = load_half_n(static_cast<const uint16_t*>(scales) + g0, n, dt);
      b = load_half_n(static_cast<const uint16_t*>(biases) + g0, n, dt);
    }
  }
};

// Reads the packed blocks of one row; for 3 and 6 bits the last block comes from a zero-padded
// copy, since unpack32 reads past the block it decodes.
template <int BITS, bool MX = false>
struct PackedRow {
  static constexpr int kBlockBytes = 4 * BITS;
  static constexpr bool kPadLast = BITS == 3 || BITS == 6;
  const uint8_t* p;
  int64_t last;
  alignas(32) uint8_t tail[32];
  MS_AVX2 PackedRow(const uint8_t* row, int64_t blocks) : p(row), last(blocks - 1) {
    if constexpr (kPadLast) {
      std::memset(tail, 0, sizeof tail);
      std::memcpy(tail, row + last * kBlockBytes, kBlockBytes);
    }
  }
  MS_AVX2 __m256i block(int64_t b) const {
    if constexpr (kPadLast)
      if (b == last) return unpack32<BITS>(tail);
    return codes32<BITS, MX>(p + b * kBlockBytes);
  }
};

// Codes already unpacked to bytes (a row reused for several tokens).
struct UnpackedRow {
  const uint8_t* p;
  MS_AVX2 __m256i block(int64_t b) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * 32));
  }
};

// Eight int32 sums of 4 products each: codes (u8) times activations (s8).
template <int BITS>
MS_AVX2 inline __m256i dot_u8s8(__m256i codes, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 8) {
    const __m256i w = _mm256_xor_si256(codes, _mm256_set1_epi8(char(0x80)));  // q - 128
    return _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
  }
}

// The int8 dot product of one row with one token. Two accumulators alternate between groups so
// that the chain of fmas into them does not bound the loop.
template <int BITS, int GS, bool MX, class Row>
MS_AVX2 float dot_int8(const Row& row, const RowGroups<MX>& params, int64_t cols, const TokenInt8& x) {
  constexpr int kBlocks = GS / 32;  // per group
  const int64_t groups = cols / GS;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc_bias = _mm256_setzero_ps();
  alignas(32) float sf[8];
  // Sum over group g of codes * x^, as 8 float partial sums.
  auto group_sum = [&](int64_t g) MS_AVX2 {
    __m256 sum = _mm256_setzero_ps();
    for (int64_t blk = g * kBlocks; blk < (g + 1) * kBlocks; ++blk) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + blk * 32));
      const __m256i isum = dot_u8s8<BITS>(row.block(blk), xq);
      sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_loadu_ps(x.lane_scale + blk * 8), sum);
    }
    return sum;
  };
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t n = std::min<int64_t>(8, groups - g0);
    __m256 s, b;
    params.load(g0, n, s, b);
    if constexpr (BITS == 8) b = _mm256_fmadd_ps(s, _mm256_set1_ps(128.0f), b);
    acc_bias = _mm256_fmadd_ps(b, _mm256_loadu_ps(x.group_sum + g0), acc_bias);
    _mm256_store_ps(sf, s);
    int64_t k = 0;
    for (; k + 2 <= n; k += 2) {
      const __m256 a = group_sum(g0 + k), c = group_sum(g0 + k + 1);
      acc0 = _mm256_fmadd_ps(a, _mm256_set1_ps(sf[k]), acc0);
      acc1 = _mm256_fmadd_ps(c, _mm256_set1_ps(sf[k + 1]), acc1);
    }
    if (k < n) acc0 = _mm256_fmadd_ps(group_sum(g0 + k), _mm256_set1_ps(sf[k]), acc0);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), acc_bias));
}

// Calls f(s, b, codes, k) for every block of 32 codes of a row: the block's group scale and
// bias broadcast, its codes, and its index.
template <int BITS, int GS, bool MX, class F>
MS_AVX2 inline void for_each_block(const Matrix& w, int64_t r, F&& f) {
  constexpr int kBlocksPerGroup = GS / 32;
  const int64_t groups = w.cols / GS;
  const PackedRow<BITS, MX> row(row_codes(w, r), w.cols / 32);
  const RowGroups<MX> params(w, r);
  alignas(32) float sf[8], bf[8];
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t n = std::min<int64_t>(8, groups - g0);
    __m256 s8, b8;
    params.load(g0, n, s8, b8);
    _mm256_store_ps(sf, s8);
    _mm256_store_ps(bf, b8);
    for (int64_t k = 0; k < n; ++k) {
      const __m256 s = _mm256_set1_ps(sf[k]), b = _mm256_set1_ps(bf[k]);
      const int64_t first = (g0 + k) * kBlocksPerGroup;
      for (int64_t blk = first; blk < first + kBlocksPerGroup; ++blk) f(s, b, row.block(blk), blk);
    }
  }
}

// The 32 codes of a ymm as four ymm of floats (codes 0-7, 8-15, 16-23, 24-31).
MS_AVX2 inline void codes_to_f32(__m256i c, __m256 out[4]) {
  const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

// Byte shuffles from natural order to the Nibbles and Crumbs orders (quant_kernels.h): a pshufb
// inside each 128-bit lane, then a dword permutation across lanes.
//   Nibbles: each lane to [even elements, odd elements], then qwords 0, 2, 1, 3.
//   Crumbs:  each lane to dwords j = 0..3 holding its elements 4k + j, then dwords
//            0, 4, 1, 5, 2, 6, 3, 7 (position 8j + k).
alignas(32) constexpr int8_t kNibbleShuffle[32] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                   0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};
alignas(32) constexpr int8_t kCrumbShuffle[32] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                                  0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

MS_AVX2 void quantize_activations(const float* x, int64_t cols, int group_size, int bits,
                                  int8_t* q, float* lane_scale, float* group_sum) {
  const CodeOrder order = code_order(KernelLevel::Avx2, bits, false);
  const __m256 sign = _mm256_set1_ps(-0.0f), fmax = _mm256_set1_ps(3.40282347e38f);
  const __m256i lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    int finite = 0xff;
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 a = _mm256_andnot_ps(sign, v[i]);
      amax = _mm256_max_ps(amax, a);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, fmax, _CMP_LE_OQ));  // false for NaN, Inf
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float am = _mm_cvtss_f32(m);
    const bool ok = finite == 0xff;
    const float dx = ok ? am / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const __m256 inv = _mm256_set1_ps(ok && am > 0 ? 127.0f / am : 0.0f);
    __m256i iv[4];
    for (int i = 0; i < 4; ++i) {
      iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round half to even
      iv[i] = _mm256_max_epi32(_mm256_min_epi32(iv[i], _mm256_set1_epi32(127)),
                               _mm256_set1_epi32(-127));
      if (!ok) iv[i] = _mm256_setzero_si256();
    }
    // packs interleave 128-bit lanes: the dword permutation restores element order.
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                        _mm256_packs_epi32(iv[2], iv[3]));
    packed = _mm256_permutevar8x32_epi32(packed, lanes);
    if (order == CodeOrder::Nibbles) {
      packed = _mm256_shuffle_epi8(packed, _mm256_load_si256(reinterpret_cast<const __m256i*>(kNibbleShuffle)));
      packed = _mm256_permute4x64_epi64(packed, 0xd8);  // qwords 0, 2, 1, 3
    } else if (order == CodeOrder::Crumbs) {
      packed = _mm256_shuffle_epi8(packed, _mm256_load_si256(reinterpret_cast<const __m256i*>(kCrumbShuffle)));
      packed = _mm256_permutevar8x32_epi32(packed, lanes);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), packed);
    const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    _mm256_storeu_ps(lane_scale + b * 8, _mm256_set1_ps(dx));
    group_sum[b * 32 / group_size] += dx * float(_mm_cvtsi128_si32(s4));
  }
}

// The row steps QuantLoops runs (quant_loops.h).
struct Avx2 {
  // The level's functions of the same names (above).
  static constexpr auto dot_f32 = &detail::dot_f32;
  static constexpr auto axpy = &detail::axpy;
  static constexpr auto quantize_activations = &detail::quantize_activations;
  static constexpr int64_t kPanelRows = 16, kPackRows = 8;
  static constexpr auto pack_rows = &pack_rows_avx2;
  static constexpr auto panel_times_tokens = &panel_times_tokens_avx2;
  static constexpr auto dot_plain_row = &detail::dot_plain_row;
  static constexpr auto plain_row_to_f32 = &detail::plain_row_to_f32;

  template <int BITS, int GS, bool MX>
  MS_AVX2 static float dot_int8_row(const Matrix& w, int64_t r, const TokenInt8& x) {
    return dot_int8<BITS, GS, MX>(PackedRow<BITS, MX>(row_codes(w, r), w.cols / 32), RowGroups<MX>(w, r),
                                  w.cols, x);
  }
  static int64_t unpacked_bytes(int64_t cols) { return cols; }
  template <int BITS, bool MX>
  MS_AVX2 static void unpack_row(const Matrix& w, int64_t r, uint8_t* codes) {
    const PackedRow<BITS, MX> packed(row_codes(w, r), w.cols / 32);
    for (int64_t b = 0; b < w.cols / 32; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * 32), packed.block(b));
  }
  // One token: row by row (dot_precise_row, dot_int8_row).
  static constexpr int64_t kOneTokenRows = 1;
  static constexpr bool precise_rows(int) { return false; }
  static constexpr bool int8_rows() { return false; }
  // Several tokens on the int8 path: each row unpacked once, then one dot product per token.
  static constexpr int64_t kInt8Rows = 1, kInt8MinTokens = 0;
  template <int BITS, int GS, bool MX>
  static void int8_rows_times_tokens(const Matrix&, int64_t, int64_t, const PreparedInput&, float*, int64_t) {}
  template <int BITS, int GS, bool MX>
  MS_AVX2 static float dot_int8_unpacked(const Matrix& w, int64_t r, const uint8_t* codes, const TokenInt8& x) {
    return dot_int8<BITS, GS, MX>(UnpackedRow{codes}, RowGroups<MX>(w, r), w.cols, x);
  }

  template <int BITS, int GS, bool MX>
  MS_AVX2 static float dot_precise_row(const Matrix& w, int64_t r, const float* x) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for_each_block<BITS, GS, MX>(w, r, [&](__m256 s, __m256 b, __m256i c, int64_t blk) MS_AVX2 {
      __m256 q[4];
      codes_to_f32(c, q);
      for (int i = 0; i < 4; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_fmadd_ps(q[i], s, b), _mm256_loadu_ps(x + blk * 32 + 8 * i), acc[i]);
    });
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  }
  static int64_t dequantized_stride(const Matrix& w, const PreparedInput&) { return w.cols; }
  // Rows are dequantized one by one, then transposed into panels.
  static constexpr bool panel_dequantizes(int) { return false; }
  template <int BITS, int GS, bool MX>
  static void panel_groups(const Matrix&, int64_t, int64_t, int) {}
  template <int BITS, int GS, bool MX>
  static void dequantize_panel(const Matrix&, int64_t, int64_t, int, int64_t, int64_t, float*, int64_t) {}
  template <int BITS, int GS, bool MX>
  MS_AVX2 static void dequantize_row(const Matrix& w, int64_t r, float* out) {
    for_each_block<BITS, GS, MX>(w, r, [&](__m256 s, __m256 b, __m256i c, int64_t blk) MS_AVX2 {
      __m256 q[4];
      codes_to_f32(c, q);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + blk * 32 + 8 * i, _mm256_fmadd_ps(q[i], s, b));
    });
  }
};

}  // namespace

const LevelKernels& avx2_kernels() { return QuantLoops<Avx2>::table(); }

}  // namespace moestream::cpu::detail
