// AVX-512 kernels (F, BW, DQ, VL, VNNI, VBMI). Every function carries the target attribute, so
// this file builds for any x86-64; kernels.cpp only calls it after checking the CPU.
//
// Quantized rows are unpacked 64 codes at a time, the same way for every bit width b:
// a masked load of the chunk's 8 * b bytes; vpermb gives qword k the b bytes that hold codes
// 8k .. 8k+7; vpmultishiftqb pulls byte j of each qword from bit offset j * b; & (2^b - 1).
// Codes stay in natural order. The int8 path multiplies them (u8) with the activations (s8)
// by vpdpbusd, which sums four products into int32 without intermediate saturation. The float
// path dequantizes 2- and 4-bit codes by table lookup instead (see dequant_table).
// MXFP4 runs as 4-bit affine groups of 32 (core/quant.h): unpacked nibbles go through a vpshufb
// with kMxfp4AffineCode (int8 path) or index a table of the group's exact values (float path).

// GCC 12's AVX-512 headers initialise "undefined" vectors from themselves, which its own
// -Wuninitialized then reports wherever such an intrinsic is inlined (GCC bug 105593, fixed in
// 13). The pragma has to precede the header for the warnings to be attributed to it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/quant_loops.h"
#include "backend/cpu/transpose_avx512.h"
#include "core/quant.h"

#define MS_AVX512                                                                         \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,avx2,fma," \
                        "f16c,bmi,bmi2")))

namespace moestream::cpu::detail {

namespace {

MS_AVX512 inline __m512 load_bf16(const uint16_t* p) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
MS_AVX512 inline __m512 load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// The first n (<= 16) values at p (BF16 or F16) as floats, zeros after them.
MS_AVX512 inline __m512 load_half_n(const uint16_t* p, int64_t n, DType dt) {
  const __m256i v = _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p);
  if (dt == DType::F16) return _mm512_cvtph_ps(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
MS_AVX512 inline __m512 load_half(const uint16_t* p, DType dt) {
  return dt == DType::F16 ? load_f16(p) : load_bf16(p);
}

// ---- plain weights --------------------------------------------------------------------------

MS_AVX512 float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), a3);
  }
  for (; i + 16 <= n; i += 16)
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

MS_AVX512 void axpy(float a, const float* x, float* y, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(
        y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

MS_AVX512 float dot_half(const uint16_t* w, const float* x, int64_t n, DType dt) {
  int64_t i = 0;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  if (dt == DType::BF16) {
    for (; i + 32 <= n; i += 32) {
      a0 = _mm512_fmadd_ps(load_bf16(w + i), _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(load_bf16(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    }
  } else {
    for (; i + 32 <= n; i += 32) {
      a0 = _mm512_fmadd_ps(load_f16(w + i), _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(load_f16(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
    }
  }
  for (; i < n; i += 16) {
    const int64_t left = std::min<int64_t>(16, n - i);
    const __mmask16 m = __mmask16((1u << left) - 1);
    a0 = _mm512_fmadd_ps(load_half_n(w + i, left, dt), _mm512_maskz_loadu_ps(m, x + i), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// The first n (<= 32) FP8 E4M3 codes at p times s / 256 as floats, zeros after them (two halves
// of 16). Each code becomes the FP16 number with the same sign, exponent and mantissa bits
// ((c & 0x7f) << 7, the sign moved to bit 15): that is the FP8 value * 2^-8 exactly, subnormals
// included (FP8 bias 7, FP16 bias 15), widened exactly. With s = scale * 256 (exact) the product
// is fp8 * scale rounded once.
MS_AVX512 inline void load_fp8x32(const uint8_t* p, int64_t n, __m512 s, __m512& lo, __m512& hi) {
  const __m256i c = _mm256_maskz_loadu_epi8(n >= 32 ? ~__mmask32(0) : __mmask32((1u << n) - 1), p);
  __m512i t = _mm512_slli_epi16(_mm512_cvtepu8_epi16(c), 7);
  t = _mm512_add_epi16(t, _mm512_and_si512(t, _mm512_set1_epi16(0x4000)));  // sign: bit 14 -> 15
  lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(t)), s);
  hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(t, 1)), s);
}

// Row r of an FP8 matrix as weights fp8 * scale, 32 at a time: f(i, n, lo, hi) for
// i = 0, 32, ... with columns [i, i + n) in lo (the first 16) and hi, zeros after them.
template <class F>
MS_AVX512 inline void for_each_fp8(const Matrix& w, int64_t r, F&& f) {
  const uint8_t* codes = row_fp8_codes(w, r);
  const float* scales = row_fp8_scales(w, r);
  const int64_t n = w.cols, gs = w.quant.group_size;
  for (int64_t g0 = 0; g0 < n; g0 += gs) {
    const __m512 s = _mm512_set1_ps(scales[g0 / gs] * 256.0f);
    const int64_t end = std::min(n, g0 + gs);
    for (int64_t i = g0; i < end; i += 32) {
      const int64_t left = std::min<int64_t>(32, end - i);
      __m512 lo, hi;
      load_fp8x32(codes + i, left, s, lo, hi);
      f(i, left, lo, hi);
    }
  }
}

// Lanes j < n of 16 (n may exceed 16 or be negative).
MS_AVX512 inline __mmask16 first16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

MS_AVX512 float dot_fp8_row(const Matrix& w, int64_t r, const float* x) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for_each_fp8(w, r, [&](int64_t i, int64_t n, __m512 lo, __m512 hi) MS_AVX512 {
    if (n == 32) {
      a0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + i + 16), a1);
      return;
    }
    a0 = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(first16(n), x + i), a0);
    a1 = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(first16(n - 16), x + i + 16), a1);
  });
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

MS_AVX512 void plain_row_to_f32(const Matrix& w, int64_t r, float* dst) {
  const int64_t n = w.cols;
  if (is_fp8(w)) {
    for_each_fp8(w, r, [&](int64_t i, int64_t m, __m512 lo, __m512 hi) MS_AVX512 {
      _mm512_mask_storeu_ps(dst + i, first16(m), lo);
      _mm512_mask_storeu_ps(dst + i + 16, first16(m - 16), hi);
    });
    return;
  }
  if (w.dtype == DType::F32) {
    std::memcpy(dst, static_cast<const float*>(w.data) + r * n, size_t(n) * 4);
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(w.data) + r * n;
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t left = std::min<int64_t>(16, n - i);
    _mm512_mask_storeu_ps(dst + i, __mmask16((1u << left) - 1), load_half_n(src + i, left, w.dtype));
  }
}

MS_AVX512 float dot_plain_row(const Matrix& w, int64_t r, const float* x) {
  if (is_fp8(w)) return dot_fp8_row(w, r, x);
  if (w.dtype == DType::F32) return dot_f32(static_cast<const float*>(w.data) + r * w.cols, x, w.cols);
  return dot_half(static_cast<const uint16_t*>(w.data) + r * w.cols, x, w.cols, w.dtype);
}

// ---- quantized weights ----------------------------------------------------------------------

// vpermb and vpmultishiftqb controls for b-bit codes (see the file comment).
struct Spread {
  alignas(64) uint8_t perm[64];
  alignas(64) uint8_t shift[64];
};
constexpr Spread make_spread(int b) {
  Spread s{};
  for (int k = 0; k < 8; ++k)
    for (int j = 0; j < 8; ++j) {
      s.perm[8 * k + j] = uint8_t(std::min(63, k * b + j));
      s.shift[8 * k + j] = uint8_t(j * b);
    }
  return s;
}
constexpr Spread kSpread[9] = {{}, {}, make_spread(2), make_spread(3), make_spread(4),
                               {}, make_spread(6), {}, make_spread(8)};

template <int BITS>
MS_AVX512 inline __m512i unpack64(const uint8_t* p, __mmask64 bytes) {
  const __m512i v = _mm512_maskz_loadu_epi8(bytes, p);
  if constexpr (BITS == 8) {
    return v;
  } else {
    const Spread& s = kSpread[BITS];
    const __m512i spread =
        _mm512_permutexvar_epi8(_mm512_load_si512(reinterpret_cast<const __m512i*>(s.perm)), v);
    const __m512i codes = _mm512_multishift_epi64_epi8(
        _mm512_load_si512(reinterpret_cast<const __m512i*>(s.shift)), spread);
    return _mm512_and_si512(codes, _mm512_set1_epi8(char((1 << BITS) - 1)));
  }
}

// MXFP4 nibbles to their affine codes (core/quant.h), the table in every 128-bit lane.
struct Mxfp4Table {
  alignas(64) uint8_t code[64];
};
constexpr Mxfp4Table make_mxfp4_table() {
  Mxfp4Table t{};
  for (int i = 0; i < 64; ++i) t.code[i] = kMxfp4AffineCode[size_t(i % 16)];
  return t;
}
constexpr Mxfp4Table kMxfp4Table = make_mxfp4_table();

// Scales and biases of one row's groups as floats, up to 16 at a time: stored halves (affine),
// or the E8M0 exponents as MXFP4's scale' and bias' (core/quant.h).
template <bool MX>
struct RowGroups {
  const void* scales;
  const void* biases;
  DType dt;
  MS_AVX512 RowGroups(const Matrix& w, int64_t r)
      : scales(MX ? static_cast<const void*>(row_exponents(w, r)) : row_scales(w, r)),
        biases(MX ? nullptr : row_biases(w, r)),
        dt(w.quant.scale_dtype) {}
  // The same, with the row's group count given (no division).
  MS_AVX512 RowGroups(const Matrix& w, int64_t r, int64_t groups)
      : scales(MX ? static_cast<const void*>(static_cast<const uint8_t*>(w.scales) + r * groups)
                  : static_cast<const uint16_t*>(w.scales) + r * groups),
        biases(MX ? nullptr : static_cast<const uint16_t*>(w.biases) + r * groups),
        dt(w.quant.scale_dtype) {}
  // Groups g0 .. g0 + n (n <= 16); zeros after them.
  MS_AVX512 void load(int64_t g0, int64_t n, __m512& s, __m512& b) const {
    if constexpr (MX) {
      const __mmask16 m = __mmask16((1u << n) - 1);
      // scale' = 2^(e - 128), exact (subnormal for e < 2); lanes past n are zero.
      const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, static_cast<const uint8_t*>(scales) + g0));
      s = _mm512_maskz_scalef_ps(m, _mm512_set1_ps(1.0f), _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128))));
      b = _mm512_mul_ps(s, _mm512_set1_ps(-kMxfp4AffineBiasCodes));
    } else {
      s = load_half_n(static_cast<const uint16_t*>(scales) + g0, n, dt);
      b = load_half_n(static_cast<const uint16_t*>(biases) + g0, n, dt);
    }
  }
};

// Chunks of 64 codes of one packed row. When cols is an odd multiple of 32 the row ends in a
// half chunk of 32 codes, read with half(); the rest of it reads as zeros (MXFP4: as code 12,
// which the half chunk's zero activations cancel).
template <int BITS, bool MX = false>
struct PackedRow {
  static constexpr int kChunkBytes = 8 * BITS;
  static constexpr __mmask64 kFull = BITS == 8 ? ~__mmask64(0) : (__mmask64(1) << kChunkBytes) - 1;
  static constexpr __mmask64 kHalf = (__mmask64(1) << (kChunkBytes / 2)) - 1;
  const uint8_t* p;
  MS_AVX512 static __m512i codes(__m512i c) {
    if constexpr (MX)
      return _mm512_shuffle_epi8(_mm512_load_si512(reinterpret_cast<const __m512i*>(kMxfp4Table.code)), c);
    return c;
  }
  MS_AVX512 __m512i chunk(int64_t c) const { return codes(unpack64<BITS>(p + c * kChunkBytes, kFull)); }
  MS_AVX512 __m512i half(int64_t c) const { return codes(unpack64<BITS>(p + c * kChunkBytes, kHalf)); }
};

// Codes already unpacked to bytes, padded to a multiple of 64 (a row reused for many tokens).
struct UnpackedRow {
  const uint8_t* p;
  MS_AVX512 __m512i chunk(int64_t c) const {
    return _mm512_loadu_si512(reinterpret_cast<const __m512i*>(p + c * 64));
  }
  MS_AVX512 __m512i half(int64_t c) const { return chunk(c); }
};

// Chunk c's share (of `chunks`) of the `lines` cache lines at next, prefetched: the one-token
// kernels ask for the next rows' codes a few lines a chunk, since asked for all at once they
// would fill the core's line fill buffers and stall the loads.
inline void prefetch_share(const uint8_t* next, int64_t lines, int64_t c, int64_t chunks) {
  for (int64_t l = c * lines / chunks; l < (c + 1) * lines / chunks; ++l) __builtin_prefetch(next + l * 64);
}

// Token x's int8 activations of chunk c and their lanes' scales.
struct ChunkX {
  __m512i q;
  __m512 scale;
  MS_AVX512 ChunkX(const TokenInt8& x, int64_t c)
      : q(_mm512_loadu_si512(reinterpret_cast<const __m512i*>(x.q + c * 64))),
        scale(_mm512_loadu_ps(x.lane_scale + c * 16)) {}
};

// sum over the 4 codes of each int32 lane of codes * x^, as floats: 16 partial sums of a chunk;
// chunk_sum_add adds them to `to` in the same fma (written out, so that no inlining decides
// whether the compiler contracts a multiply and an add).
MS_AVX512 inline __m512 chunk_sum(__m512i codes, const ChunkX& x) {
  const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x.q);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(isum), x.scale);
}
MS_AVX512 inline __m512 chunk_sum_add(__m512i codes, const ChunkX& x, __m512 to) {
  const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, x.q);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), x.scale, to);
}

// The int8 dot products of R rows with one token: y[j] for row[j] and its groups params[j]. Two
// accumulators a row alternate between groups (or chunks) so that the chain of fmas into them
// does not bound the loop. The rows share the activations' loads and run interleaved, each with
// its own sums in the same order as alone (R = 1). The codes at next (next_lines cache lines) are
// prefetched along the way (prefetch_share).
template <int BITS, int GS, bool MX, int R, class Row>
MS_AVX512 void dot_int8_rows(const Row* row, const RowGroups<MX>* params, int64_t cols, const TokenInt8& x,
                             float* y, const uint8_t* next = nullptr, int64_t next_lines = 0) {
  const int64_t groups = cols / GS, chunks = (cols + 63) / 64;
  const auto prefetch = [&](int64_t c) { prefetch_share(next, next_lines, c, chunks); };
  __m512 acc0[R], acc1[R], acc_bias[R];
  for (int j = 0; j < R; ++j) acc0[j] = acc1[j] = acc_bias[j] = _mm512_setzero_ps();
  alignas(64) float sf[R][16];
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, groups - g0);
    __m512 s[R];
    const __m512 group_sum = _mm512_loadu_ps(x.group_sum + g0);
    for (int j = 0; j < R; ++j) {
      __m512 b;
      params[j].load(g0, n, s[j], b);
      acc_bias[j] = _mm512_fmadd_ps(b, group_sum, acc_bias[j]);
    }
    if constexpr (GS == 32) {
      // A chunk spans two groups: lanes 0-7 (codes 0-31) and lanes 8-15 (codes 32-63); `pick`
      // spreads their two scales over those lanes.
      __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const __m512i two = _mm512_set1_epi32(2);
      const int64_t end = g0 / 2 + n / 2;
      int64_t c = g0 / 2;
      for (; c + 2 <= end; c += 2) {
        prefetch(c);
        prefetch(c + 1);
        const ChunkX x0(x, c), x1(x, c + 1);
        const __m512i pick1 = _mm512_add_epi32(pick, two);
#pragma GCC unroll 8
        for (int j = 0; j < R; ++j) {
          const __m512 f0 = chunk_sum(row[j].chunk(c), x0);
          const __m512 f1 = chunk_sum(row[j].chunk(c + 1), x1);
          acc0[j] = _mm512_fmadd_ps(f0, _mm512_permutexvar_ps(pick, s[j]), acc0[j]);
          acc1[j] = _mm512_fmadd_ps(f1, _mm512_permutexvar_ps(pick1, s[j]), acc1[j]);
        }
        pick = _mm512_add_epi32(pick1, two);
      }
      if (c < end) {
        prefetch(c);
        const ChunkX xc(x, c);
        for (int j = 0; j < R; ++j)
          acc0[j] = _mm512_fmadd_ps(chunk_sum(row[j].chunk(c), xc), _mm512_permutexvar_ps(pick, s[j]), acc0[j]);
        pick = _mm512_add_epi32(pick, two);
        ++c;
      }
      if (n % 2) {  // the row's last group, alone in a half chunk
        prefetch(c);
        const ChunkX xc(x, c);
        for (int j = 0; j < R; ++j)
          acc1[j] = _mm512_fmadd_ps(chunk_sum(row[j].half(c), xc), _mm512_permutexvar_ps(pick, s[j]), acc1[j]);
      }
    } else {
      constexpr int kChunks = GS / 64;  // per group
      for (int j = 0; j < R; ++j) _mm512_store_ps(sf[j], s[j]);
      // Group g's sums of every row: its chunks' sums added in order.
      const auto group_sums = [&](int64_t g, __m512* sum) MS_AVX512 {
        for (int i = 0; i < kChunks; ++i) {
          const int64_t c = g * kChunks + i;
          prefetch(c);
          const ChunkX xc(x, c);
#pragma GCC unroll 8
          for (int j = 0; j < R; ++j)
            sum[j] = i == 0 ? chunk_sum(row[j].chunk(c), xc) : chunk_sum_add(row[j].chunk(c), xc, sum[j]);
        }
      };
      int64_t k = 0;
      __m512 a[R], b[R];
      for (; k + 2 <= n; k += 2) {
        group_sums(g0 + k, a);
        group_sums(g0 + k + 1, b);
        for (int j = 0; j < R; ++j) {
          acc0[j] = _mm512_fmadd_ps(a[j], _mm512_set1_ps(sf[j][k]), acc0[j]);
          acc1[j] = _mm512_fmadd_ps(b[j], _mm512_set1_ps(sf[j][k + 1]), acc1[j]);
        }
      }
      if (k < n) {
        group_sums(g0 + k, a);
        for (int j = 0; j < R; ++j) acc0[j] = _mm512_fmadd_ps(a[j], _mm512_set1_ps(sf[j][k]), acc0[j]);
      }
    }
  }
  for (int j = 0; j < R; ++j)
    y[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[j], acc1[j]), acc_bias[j]));
}

// The int8 dot product of one row with one token.
template <int BITS, int GS, bool MX, class Row>
MS_AVX512 float dot_int8(const Row& row, const RowGroups<MX>& params, int64_t cols, const TokenInt8& x) {
  float y;
  dot_int8_rows<BITS, GS, MX, 1>(&row, &params, cols, x, &y);
  return y;
}

// vpermb controls that spread codes 16 i .. 16 i + 15 of a chunk over the low bytes of 16
// dwords (the other bytes are zeroed by the kDwordLow mask).
struct Widen {
  alignas(64) uint8_t idx[4][64];
};
constexpr Widen make_widen() {
  Widen w{};
  for (int i = 0; i < 4; ++i)
    for (int d = 0; d < 16; ++d) w.idx[i][4 * d] = uint8_t(16 * i + d);
  return w;
}
constexpr Widen kWiden = make_widen();
constexpr __mmask64 kDwordLow = 0x1111111111111111ull;

template <int I>
MS_AVX512 inline __m512 quarter_f32(__m512i codes) {
  const __m512i idx = _mm512_load_si512(reinterpret_cast<const __m512i*>(kWiden.idx[I]));
  return _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(kDwordLow, idx, codes));
}

// 2- and 4-bit codes are dequantized by table lookup: vpermps indexes a zmm holding
// q * scale + bias for q = 0..15 (computed with the same fma as elsewhere, so the floats are
// identical), using only the low 4 bits of each dword. The codes reach those bits by a
// broadcast load and per-dword shifts (CodeOrder::Halves for 4 bits, natural for 2), with no
// byte shuffles.
// MXFP4 tables hold c' * scale' + bias' for the affine codes c' of the 16 nibbles, which is the
// exact value of each.
template <int BITS, bool MX>
MS_AVX512 inline __m512 dequant_table(float scale, float bias) {
  const __m512 q =
      MX ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
               _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Table.code))))
      : BITS == 2 ? _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)
                  : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(q, _mm512_set1_ps(scale), _mm512_set1_ps(bias));
}
// Table indices of codes 16 i .. 16 i + 15 of the chunk at p (their low 4 bits).
template <int BITS>
MS_AVX512 inline __m512i table_index(const uint8_t* p, int i) {
  if constexpr (BITS == 4) {
    int64_t v;
    std::memcpy(&v, p + 8 * i, 8);
    return _mm512_srlv_epi32(_mm512_set1_epi64(v), _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16,
                                                                       16, 20, 20, 24, 24, 28, 28));
  } else {
    int32_t v;
    std::memcpy(&v, p + 4 * i, 4);
    return _mm512_srlv_epi32(_mm512_set1_epi32(v), _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16,
                                                                       18, 20, 22, 24, 26, 28, 30));
  }
}

// Calls f(w0, w1, w2, w3, c) for every chunk c of row r, w_i the dequantized floats of codes
// 16 i .. 16 i + 15 of the chunk (in the precise code order). Past the end of a half chunk
// they are zeros.
template <int BITS, int GS, bool MX, class F>
MS_AVX512 inline void for_each_dequantized(const Matrix& w, int64_t r, F&& f) {
  const RowGroups<MX> params(w, r);
  const int64_t groups = w.cols / GS;
  const PackedRow<BITS, MX> row{row_codes(w, r)};
  alignas(64) float sf[16], bf[16];
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, groups - g0);
    __m512 s16, b16;
    params.load(g0, n, s16, b16);
    _mm512_store_ps(sf, s16);
    _mm512_store_ps(bf, b16);
    const int64_t c_end = ((g0 + n) * GS + 63) / 64;
    for (int64_t c = g0 * GS / 64; c < c_end; ++c) {
      // Group (within the batch) of the codes 16 i .. of chunk c.
      auto k = [&](int i) { return (c * 64 + 16 * i) / GS - g0; };
      if constexpr (BITS == 2 || BITS == 4) {
        const uint8_t* p = row.p + c * 8 * BITS;
        const __m512 t0 = dequant_table<BITS, MX>(sf[k(0)], bf[k(0)]);
        const __m512 t2 = GS == 32 ? dequant_table<BITS, MX>(sf[k(2)], bf[k(2)]) : t0;
        const __m512 w0 = _mm512_permutexvar_ps(table_index<BITS>(p, 0), t0);
        const __m512 w1 = _mm512_permutexvar_ps(table_index<BITS>(p, 1), t0);
        if (c < w.cols / 64) {
          f(w0, w1, _mm512_permutexvar_ps(table_index<BITS>(p, 2), t2),
            _mm512_permutexvar_ps(table_index<BITS>(p, 3), t2), c);
        } else {
          f(w0, w1, _mm512_setzero_ps(), _mm512_setzero_ps(), c);
        }
      } else {
        const __m512i codes = c < w.cols / 64 ? row.chunk(c) : row.half(c);
        auto deq = [&](__m512 q, int i) MS_AVX512 {
          return _mm512_fmadd_ps(q, _mm512_set1_ps(sf[k(i)]), _mm512_set1_ps(bf[k(i)]));
        };
        f(deq(quarter_f32<0>(codes), 0), deq(quarter_f32<1>(codes), 1),
          deq(quarter_f32<2>(codes), 2), deq(quarter_f32<3>(codes), 3), c);
      }
    }
  }
}

// Rows r .. r + R - 1 of a 2- or 4-bit matrix times one token: y[j] is row r + j's product,
// computed exactly as dot_precise_row computes it (the same tables, lanes, accumulators and
// order of operations), with the rows interleaved chunk by chunk. The rows share the loads of the
// activations and the set-up of a call, and their independent chains overlap, which a single
// row's loop (about 13 operations a chunk on two ports, then its reduction) leaves idle.
// The codes at next (next_lines cache lines) are prefetched along the way (prefetch_share).
template <int BITS, int GS, bool MX, int R>
MS_AVX512 void dot_precise_rows(const Matrix& w, int64_t r, const float* x, float* y, const uint8_t* next,
                                int64_t next_lines) {
  static_assert(BITS == 2 || BITS == 4);
  const int64_t groups = w.cols / GS, full = w.cols / 64, row_bytes = w.cols * BITS / 8;
  const int64_t chunks = (w.cols + 63) / 64;
  const uint8_t* codes = static_cast<const uint8_t*>(w.data) + r * row_bytes;
  __m512 acc[R][4];
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_setzero_ps();
  alignas(64) float sf[R][16], bf[R][16];
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, groups - g0);
    for (int j = 0; j < R; ++j) {
      __m512 s16, b16;
      RowGroups<MX>(w, r + j, groups).load(g0, n, s16, b16);
      _mm512_store_ps(sf[j], s16);
      _mm512_store_ps(bf[j], b16);
    }
    const int64_t c_end = ((g0 + n) * GS + 63) / 64;
    for (int64_t c = g0 * GS / 64; c < c_end; ++c) {
      prefetch_share(next, next_lines, c, chunks);
      auto k = [&](int i) { return (c * 64 + 16 * i) / GS - g0; };
      const float* xc = x + c * 64;
      const __m512 x0 = _mm512_loadu_ps(xc), x1 = _mm512_loadu_ps(xc + 16);
      const __m512 x2 = _mm512_loadu_ps(xc + 32), x3 = _mm512_loadu_ps(xc + 48);
#pragma GCC unroll 8
      for (int j = 0; j < R; ++j) {
        const uint8_t* p = codes + j * row_bytes + c * 8 * BITS;
        const __m512 t0 = dequant_table<BITS, MX>(sf[j][k(0)], bf[j][k(0)]);
        const __m512 t2 = GS == 32 ? dequant_table<BITS, MX>(sf[j][k(2)], bf[j][k(2)]) : t0;
        acc[j][0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(table_index<BITS>(p, 0), t0), x0, acc[j][0]);
        acc[j][1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(table_index<BITS>(p, 1), t0), x1, acc[j][1]);
        if (c < full) {
          acc[j][2] = _mm512_fmadd_ps(_mm512_permutexvar_ps(table_index<BITS>(p, 2), t2), x2, acc[j][2]);
          acc[j][3] = _mm512_fmadd_ps(_mm512_permutexvar_ps(table_index<BITS>(p, 3), t2), x3, acc[j][3]);
        } else {
          acc[j][2] = _mm512_fmadd_ps(_mm512_setzero_ps(), x2, acc[j][2]);
          acc[j][3] = _mm512_fmadd_ps(_mm512_setzero_ps(), x3, acc[j][3]);
        }
      }
    }
  }
  for (int j = 0; j < R; ++j)
    y[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]), _mm512_add_ps(acc[j][2], acc[j][3])));
}

// Scales and biases of rows r .. r + m (m <= 16) for groups [0, n): grid[g * 32 + j] and
// grid[g * 32 + 16 + j] for row r + j (zeros for j >= m), exactly as RowGroups gives them.
// Also prefetches the scales and biases of rows r + ahead .. r + ahead + 15, which the caller
// reaches next (rows' groups are contiguous, so that is one range each).
template <bool MX>
MS_AVX512 void group_grid(const Matrix& w, int64_t r, int64_t m, int64_t n, float* grid, int64_t ahead) {
  const int64_t next = std::clamp<int64_t>(w.rows - r - ahead, 0, 16);
  if (next > 0) {
    if constexpr (MX) {
      prefetch_bytes(row_exponents(w, r + ahead), next * n);
    } else {
      prefetch_bytes(row_scales(w, r + ahead), next * n * 2);
      prefetch_bytes(row_biases(w, r + ahead), next * n * 2);
    }
  }
  for (int64_t g0 = 0; g0 < n; g0 += 16) {
    const int64_t k = std::min<int64_t>(16, n - g0);
    __m512 s[16], b[16];
    for (int64_t j = 0; j < 16; ++j) {
      s[j] = b[j] = _mm512_setzero_ps();
      if (j < m) RowGroups<MX>(w, r + j).load(g0, k, s[j], b[j]);
    }
    transpose16(s);
    transpose16(b);
    for (int64_t g = 0; g < k; ++g) {
      _mm512_storeu_ps(grid + (g0 + g) * 32, s[g]);
      _mm512_storeu_ps(grid + (g0 + g) * 32 + 16, b[g]);
    }
  }
}

// Rows r .. r + m (m <= 16) of a 2-, 4- or 8-bit matrix at columns [k0, k0 + kn) (multiples of 16,
// or kn reaching the row's end) dequantized straight into lanes 0..15 of a panel block (gemm.h):
// dst[(position(k) - k0) * ps + j] = row r + j's value at element k, in the precise code order
// (CodeOrder::Halves for 4 bits); lanes m..15 are zeros. grid holds the rows' scales and biases
// (group_grid). Each run of 16 code words (one zmm per row) is transposed so that a zmm holds
// one word of all 16 rows; each code then takes a shift, a mask and the same q * scale + bias
// fma as for_each_dequantized (MXFP4: its affine code looked up first), so the values are bit
// for bit those of dequantize_row.
template <int BITS, int GS, bool MX>
MS_AVX512 void dequantize_panel(const Matrix& w, int64_t r, int64_t m, const float* grid, int64_t k0,
                                int64_t kn, float* dst, int64_t ps) {
  static_assert(BITS == 2 || BITS == 4 || BITS == 8);
  constexpr int kCodes = 32 / BITS;  // per word
  const __m512 mx_codes = _mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Table.code))));
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  const int64_t row_words = row_code_bytes(w) / 4;
  const uint32_t* base = reinterpret_cast<const uint32_t*>(row_codes(w, r));
  const int64_t words = (k0 + kn) / kCodes;
  // The rows' codes of the next block (or the first of the next panel, 32 rows on), which the
  // hardware prefetcher is slow to find across 16 rows read side by side.
  const int64_t block_bytes = kn * BITS / 8;
  for (int64_t j = 0; j < m; ++j) {
    const uint8_t* next = k0 + kn < w.cols ? row_codes(w, r + j) + (k0 + kn) * BITS / 8
                          : r + 32 + j < w.rows ? row_codes(w, r + 32 + j) : nullptr;
    if (next) prefetch_bytes(next, block_bytes);
  }
  for (int64_t w0 = k0 / kCodes; w0 < words; w0 += 16) {
    const __mmask16 wm = __mmask16(words - w0 >= 16 ? 0xffff : (1u << (words - w0)) - 1);
    __m512 v[16];
    for (int64_t j = 0; j < 16; ++j)
      v[j] = j < m ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(wm, base + j * row_words + w0))
                   : _mm512_setzero_ps();
    transpose16(v);
    for (int64_t i = 0; i < std::min<int64_t>(16, words - w0); ++i) {
      const int64_t word = w0 + i, g = word * kCodes / GS;
      const __m512 s = _mm512_loadu_ps(grid + g * 32), b = _mm512_loadu_ps(grid + g * 32 + 16);
      __m512i c = _mm512_castps_si512(v[i]);
#pragma GCC unroll 16
      for (int e = 0; e < kCodes; ++e) {
        const __m512i q = _mm512_and_si512(c, mask);
        c = _mm512_srli_epi32(c, BITS);
        const __m512 qf = MX ? _mm512_permutexvar_ps(q, mx_codes) : _mm512_cvtepi32_ps(q);
        // Element word * kCodes + e; 4 bits: its place in CodeOrder::Halves.
        const int64_t pos = BITS == 4 ? word / 2 * 16 + 2 * e + word % 2 : word * kCodes + e;
        _mm512_storeu_ps(dst + (pos - k0) * ps, _mm512_fmadd_ps(qf, s, b));
      }
    }
  }
}

// The int8 path for several tokens, 16 rows at a time (rows r .. r + m, m <= 16): the rows' codes
// are unpacked and transposed once so that each dword lane holds 4 codes of one row; vpdpbusd
// then multiplies 16 rows by 4 activation bytes of one token (broadcast), into one int32
// accumulator per token. Per block of 32 codes and token, isum * dx is added in float; per group,
// that sum times the rows' scales plus the rows' biases times the token's group sum of x^
// (the formula of kernels.h, summed in this order).
template <int BITS, int GS, bool MX>
MS_AVX512 void int8_rows_times_tokens(const Matrix& w, int64_t r, int64_t m, const PreparedInput& in,
                                      float* y, int64_t ldy) {
  constexpr int kTok = 8;
  const int64_t chunks = (w.cols + 63) / 64, groups = w.cols / GS;
  // codes[chunk * 16 + i]: codes 4i .. 4i+3 of the chunk of each row, one dword lane per row.
  thread_local std::vector<uint8_t> buffer;
  thread_local std::vector<float> grid;
  buffer.resize(size_t(chunks * 1024 + 64));
  grid.resize(size_t(groups * 32));
  __m512i* codes = reinterpret_cast<__m512i*>(buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64);
  group_grid<MX>(w, r, m, groups, grid.data(), 16);
  // The next 16 rows' codes are prefetched while these are multiplied, a share per group: read
  // side by side, 16 rows at a time, they defeat the hardware prefetcher.
  const int64_t row_lines = (row_code_bytes(w) + 63) / 64;
  const int64_t next_lines = std::clamp<int64_t>(w.rows - r - 16, 0, 16) * row_lines;
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 v[16];
    for (int64_t j = 0; j < 16; ++j) {
      const PackedRow<BITS, MX> row{row_codes(w, r + std::min(j, m - 1))};
      v[j] = _mm512_castsi512_ps(c < w.cols / 64 ? row.chunk(c) : row.half(c));
    }
    transpose16(v);
    for (int i = 0; i < 16; ++i) _mm512_store_si512(codes + c * 16 + i, _mm512_castps_si512(v[i]));
  }
  const __mmask16 rows = __mmask16(m >= 16 ? 0xffff : (1u << m) - 1);
  for (int64_t t0 = 0; t0 < in.T; t0 += kTok) {
    const int nt = int(std::min<int64_t>(kTok, in.T - t0));
    TokenInt8 x[kTok];
    for (int t = 0; t < nt; ++t) x[t] = token_int8(in, t0 + t);
    __m512 acc[kTok], fs[kTok];
    __m512i is[kTok];
    for (int t = 0; t < kTok; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (t0 == 0)
        for (int64_t l = g * next_lines / groups; l < (g + 1) * next_lines / groups; ++l)
          __builtin_prefetch(row_codes(w, r + 16 + l / row_lines) + l % row_lines * 64);
      for (int t = 0; t < kTok; ++t) fs[t] = _mm512_setzero_ps();
      for (int64_t b = g * GS / 32; b < (g + 1) * GS / 32; ++b) {
        for (int t = 0; t < kTok; ++t) is[t] = _mm512_setzero_si512();
        const __m512i* cb = codes + b / 2 * 16 + b % 2 * 8;
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m512i cv = _mm512_load_si512(cb + i);
#pragma GCC unroll 8
          for (int t = 0; t < kTok; ++t) {
            if (t >= nt) break;
            int32_t xq;
            std::memcpy(&xq, x[t].q + b * 32 + 4 * i, 4);
            is[t] = _mm512_dpbusd_epi32(is[t], cv, _mm512_set1_epi32(xq));
          }
        }
#pragma GCC unroll 8
        for (int t = 0; t < kTok; ++t) {
          if (t >= nt) break;
          fs[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[t]), _mm512_set1_ps(x[t].lane_scale[b * 8]), fs[t]);
        }
      }
      const __m512 sg = _mm512_loadu_ps(grid.data() + g * 32), bg = _mm512_loadu_ps(grid.data() + g * 32 + 16);
#pragma GCC unroll 8
      for (int t = 0; t < kTok; ++t) {
        if (t >= nt) break;
        acc[t] = _mm512_fmadd_ps(fs[t], sg, acc[t]);
        acc[t] = _mm512_fmadd_ps(bg, _mm512_set1_ps(x[t].group_sum[g]), acc[t]);
      }
    }
    for (int t = 0; t < nt; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + r, rows, acc[t]);
  }
}

// A token's activations to int8 per block of 32 (see LevelKernels::quantize_activations).
MS_AVX512 void quantize_activations(const float* x, int64_t cols, int group_size, int bits,
                                    int8_t* q, float* lane_scale, float* group_sum) {
  const __m512 fmax = _mm512_set1_ps(3.40282347e38f);
  for (int64_t b = 0; b < cols / 32; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
    const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
    const bool ok = (_mm512_cmp_ps_mask(a0, fmax, _CMP_LE_OQ) &
                     _mm512_cmp_ps_mask(a1, fmax, _CMP_LE_OQ)) == 0xffff;  // no NaN or Inf
    const float am = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    const float dx = ok ? am / 127.0f : std::numeric_limits<float>::quiet_NaN();
    const __m512 inv = _mm512_set1_ps(ok && am > 0 ? 127.0f / am : 0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i i0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), hi), lo);
    __m512i i1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), hi), lo);
    if (!ok) i0 = i1 = _mm512_setzero_si512();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 32 + 16), _mm512_cvtepi32_epi8(i1));
    _mm256_storeu_ps(lane_scale + b * 8, _mm256_set1_ps(dx));
    group_sum[b * 32 / group_size] += dx * float(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
  }
}

// The row steps QuantLoops runs (quant_loops.h).
struct Avx512 {
  // The level's functions of the same names (above).
  static constexpr auto dot_f32 = &detail::dot_f32;
  static constexpr auto axpy = &detail::axpy;
  static constexpr auto quantize_activations = &detail::quantize_activations;
  static constexpr int64_t kPanelRows = 32, kPackRows = 16;
  static constexpr auto pack_rows = &pack_rows_avx512;
  static constexpr auto panel_times_tokens = &panel_times_tokens_avx512;
  static constexpr auto dot_plain_row = &detail::dot_plain_row;
  static constexpr auto plain_row_to_f32 = &detail::plain_row_to_f32;

  template <int BITS, int GS, bool MX>
  MS_AVX512 static float dot_int8_row(const Matrix& w, int64_t r, const TokenInt8& x) {
    return dot_int8<BITS, GS, MX>(PackedRow<BITS, MX>{row_codes(w, r)}, RowGroups<MX>(w, r), w.cols, x);
  }
  // Whole chunks of 64 codes; a row ending in a half chunk has its second half zero (MXFP4: 12).
  static int64_t unpacked_bytes(int64_t cols) { return (cols + 63) / 64 * 64; }
  template <int BITS, bool MX>
  MS_AVX512 static void unpack_row(const Matrix& w, int64_t r, uint8_t* codes) {
    const PackedRow<BITS, MX> packed{row_codes(w, r)};
    for (int64_t c = 0; c < (w.cols + 63) / 64; ++c)
      _mm512_storeu_si512(reinterpret_cast<__m512i*>(codes + c * 64), c < w.cols / 64 ? packed.chunk(c) : packed.half(c));
  }
  // Several tokens on the int8 path: 16 rows at a time (int8_rows_times_tokens) from
  // kInt8MinTokens tokens on. Below, each row is unpacked once and multiplied token by token: on
  // cold q4 expert matrices that was as fast at 3 and 4 tokens (both about the rate one core
  // reads memory at) and 1.5x as fast at 2.
  static constexpr int64_t kInt8Rows = 16, kInt8MinTokens = 4;
  template <int BITS, int GS, bool MX>
  MS_AVX512 static void int8_rows_times_tokens(const Matrix& w, int64_t r, int64_t m, const PreparedInput& in,
                                               float* y, int64_t ldy) {
    detail::int8_rows_times_tokens<BITS, GS, MX>(w, r, m, in, y, ldy);
  }
  template <int BITS, int GS, bool MX>
  MS_AVX512 static float dot_int8_unpacked(const Matrix& w, int64_t r, const uint8_t* codes, const TokenInt8& x) {
    return dot_int8<BITS, GS, MX>(UnpackedRow{codes}, RowGroups<MX>(w, r), w.cols, x);
  }

  template <int BITS, int GS, bool MX>
  MS_AVX512 static float dot_precise_row(const Matrix& w, int64_t r, const float* x) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for_each_dequantized<BITS, GS, MX>(w, r, [&](__m512 w0, __m512 w1, __m512 w2, __m512 w3, int64_t c) MS_AVX512 {
      const float* xc = x + c * 64;
      a0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xc), a0);
      a1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xc + 16), a1);
      a2 = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xc + 32), a2);
      a3 = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xc + 48), a3);
    });
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
  // One token: kOneTokenRows rows at a time, on the float path for 2- and 4-bit rows
  // (dot_precise_rows), on the int8 path for every width (dot_int8_rows).
  static constexpr int64_t kOneTokenRows = 4;
  static constexpr bool precise_rows(int bits) { return bits == 2 || bits == 4; }
  static constexpr bool int8_rows() { return true; }
  template <int BITS, int GS, bool MX>
  MS_AVX512 static void dot_precise_rows(const Matrix& w, int64_t r, int64_t m, const float* x, float* y,
                                         const uint8_t* next, int64_t next_lines) {
    if (m == kOneTokenRows) return detail::dot_precise_rows<BITS, GS, MX, kOneTokenRows>(w, r, x, y, next, next_lines);
    for (int64_t j = 0; j < m; ++j) detail::dot_precise_rows<BITS, GS, MX, 1>(w, r + j, x, y + j, next, 0);
  }
  template <int BITS, int GS, bool MX>
  MS_AVX512 static void dot_int8_rows(const Matrix& w, int64_t r, int64_t m, const TokenInt8& x, float* y,
                                      const uint8_t* next, int64_t next_lines) {
    static_assert(kOneTokenRows == 4);
    const int64_t groups = w.cols / GS, bytes = row_code_bytes(w);
    const uint8_t* codes = static_cast<const uint8_t*>(w.data) + r * bytes;
    if (m == kOneTokenRows) {
      const PackedRow<BITS, MX> rows[4] = {{codes}, {codes + bytes}, {codes + 2 * bytes}, {codes + 3 * bytes}};
      const RowGroups<MX> params[4] = {{w, r, groups}, {w, r + 1, groups}, {w, r + 2, groups}, {w, r + 3, groups}};
      return detail::dot_int8_rows<BITS, GS, MX, 4>(rows, params, w.cols, x, y, next, next_lines);
    }
    for (int64_t j = 0; j < m; ++j) y[j] = dot_int8_row<BITS, GS, MX>(w, r + j, x);
  }
  // Rows of whole chunks, as the padded activations.
  static int64_t dequantized_stride(const Matrix&, const PreparedInput& in) { return in.stride; }
  // 2-, 4- and 8-bit codes sit whole in their words and are dequantized straight into panels:
  // panel_groups(w, r, m, slot) once per 16 rows, then dequantize_panel per block of columns.
  static constexpr bool panel_dequantizes(int bits) { return bits == 2 || bits == 4 || bits == 8; }
  static float* grid(int slot, int64_t groups) {
    thread_local std::vector<float> g[2];
    g[slot].resize(size_t(groups * 32));
    return g[slot].data();
  }
  template <int BITS, int GS, bool MX>
  MS_AVX512 static void panel_groups(const Matrix& w, int64_t r, int64_t m, int slot) {
    group_grid<MX>(w, r, m, w.cols / GS, grid(slot, w.cols / GS), 2 * kPackRows);
  }
  template <int BITS, int GS, bool MX>
  MS_AVX512 static void dequantize_panel(const Matrix& w, int64_t r, int64_t m, int slot, int64_t k0, int64_t kn,
                                         float* dst, int64_t ps) {
    if constexpr (panel_dequantizes(BITS))
      detail::dequantize_panel<BITS, GS, MX>(w, r, m, grid(slot, w.cols / GS), k0, kn, dst, ps);
  }
  template <int BITS, int GS, bool MX>
  MS_AVX512 static void dequantize_row(const Matrix& w, int64_t r, float* out) {
    for_each_dequantized<BITS, GS, MX>(w, r, [&](__m512 w0, __m512 w1, __m512 w2, __m512 w3, int64_t c) MS_AVX512 {
      _mm512_storeu_ps(out + c * 64, w0);
      _mm512_storeu_ps(out + c * 64 + 16, w1);
      _mm512_storeu_ps(out + c * 64 + 32, w2);
      _mm512_storeu_ps(out + c * 64 + 48, w3);
    });
  }
};

}  // namespace

const LevelKernels& avx512_kernels() { return QuantLoops<Avx512>::table(); }

}  // namespace moestream::cpu::detail
