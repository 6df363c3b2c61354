// A 16 x 16 transposition of floats in zmm registers, for the AVX-512 files (gemm_avx512.cpp,
// quant_avx512.cpp). Include after <immintrin.h>; it carries its own target attribute.
#pragma once

namespace moestream::cpu::detail {

// r[i] (row i, 16 columns) -> r[c] (column c, 16 rows).
__attribute__((target("avx512f,avx512dq"))) inline void transpose16(__m512 r[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane, rows 2i and 2i+1 interleaved
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + c], lane l: rows 4i .. 4i+3 at column 4l + c
    const __m512d lo0 = _mm512_castps_pd(a[4 * i]), lo1 = _mm512_castps_pd(a[4 * i + 2]);
    const __m512d hi0 = _mm512_castps_pd(a[4 * i + 1]), hi1 = _mm512_castps_pd(a[4 * i + 3]);
    b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo1));
    b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo1));
    b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi0, hi1));
    b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi0, hi1));
  }
  for (int c = 0; c < 4; ++c) {  // a 4x4 transpose of 128-bit lanes
    const __m512 u0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x44);
    const __m512 u1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xee);
    const __m512 u2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x44);
    const __m512 u3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xee);
    r[c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(u0, u2, 0xdd);
    r[8 + c] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(u1, u3, 0xdd);
  }
}

}  // namespace moestream::cpu::detail
