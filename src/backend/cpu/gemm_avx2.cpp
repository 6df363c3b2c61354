// AVX2 panel packing and micro-kernel (see gemm.h). Built with the target attribute, like
// quant_avx2.cpp; only called after kernels.cpp has checked the CPU.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>

#include "backend/cpu/gemm.h"

#define MS_AVX2 __attribute__((target("avx2,fma")))

namespace moestream::cpu::detail {

namespace {

constexpr int64_t kPanel = 16;  // floats per panel column
constexpr int kTokens = 6;      // most tokens per micro-kernel call (12 accumulators)

// Lanes j < n of 8 as a mask vector for maskload / maskstore.
MS_AVX2 inline __m256i first8(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::clamp<int64_t>(n, 0, 8))), lane);
}

// r[i] (row i, 8 columns) -> r[c] (column c, 8 rows).
MS_AVX2 inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // s[4i + c], lane l: rows 4i .. 4i+3 at column 4l + c
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
  }
}

// MR panel vectors (8 rows each) times NT tokens over K (<= kBlockColumns) columns; the sums
// are stored in y, or added to it (add).
template <int MR, int NT>
MS_AVX2 void tile(const float* panel, int64_t K, const float* x, int64_t xs, float* y, int64_t ldy,
                  int64_t n, bool add) {
  const float* xt[NT];
  for (int t = 0; t < NT; ++t) xt[t] = x + t * xs;
  __m256 acc[NT][MR];
#pragma GCC unroll 16
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 2
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * kPanel;
    __m256 w[MR];
#pragma GCC unroll 2
    for (int m = 0; m < MR; ++m) w[m] = _mm256_loadu_ps(p + 8 * m);
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
      const __m256 xb = _mm256_broadcast_ss(xt[t] + k);
#pragma GCC unroll 2
      for (int m = 0; m < MR; ++m) acc[t][m] = _mm256_fmadd_ps(w[m], xb, acc[t][m]);
    }
  }
  const auto mask0 = first8(n), mask1 = first8(n - 8);
#pragma GCC unroll 16
  for (int t = 0; t < NT; ++t) {
    float* yt = y + t * ldy;
    _mm256_maskstore_ps(yt, mask0, add ? _mm256_add_ps(_mm256_maskload_ps(yt, mask0), acc[t][0]) : acc[t][0]);
    if constexpr (MR == 2)
      _mm256_maskstore_ps(yt + 8, mask1, add ? _mm256_add_ps(_mm256_maskload_ps(yt + 8, mask1), acc[t][1]) : acc[t][1]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, bool);
template <int MR, size_t... NT>
constexpr std::array<TileFn, sizeof...(NT)> tiles(std::index_sequence<NT...>) {
  return {&tile<MR, int(NT) + 1>...};
}
constexpr auto kTiles1 = tiles<1>(std::make_index_sequence<kTokens>());
constexpr auto kTiles2 = tiles<2>(std::make_index_sequence<kTokens>());

}  // namespace

MS_AVX2 void pack_rows_avx2(const float* rows, int64_t rs, int64_t n, int64_t K, float* dst, int64_t ps) {
  for (int64_t k0 = 0; k0 < K; k0 += 8) {
    const int64_t kn = std::min<int64_t>(8, K - k0);
    const __m256i km = first8(kn);
    __m256 r[8];
    for (int i = 0; i < 8; ++i)
      r[i] = i < n ? _mm256_maskload_ps(rows + i * rs + k0, km) : _mm256_setzero_ps();
    transpose8(r);
    for (int64_t c = 0; c < kn; ++c) _mm256_storeu_ps(dst + (k0 + c) * ps, r[c]);
  }
}

MS_AVX2 void panel_times_tokens_avx2(const float* panel, int64_t n, int64_t K, const float* x,
                                     int64_t xs, int64_t T, float* y, int64_t ldy, bool add) {
  const auto& tiles = n > 8 ? kTiles2 : kTiles1;
  // Token blocks of nearly equal size: 7 tokens run as 4 + 3 rather than 6 + 1.
  const int64_t blocks = (T + kTokens - 1) / kTokens;
  for (int64_t b = 0, t0 = 0; b < blocks; ++b) {
    const int64_t nt = (T - t0) / (blocks - b) + ((T - t0) % (blocks - b) != 0);
    tiles[size_t(nt - 1)](panel, K, x + t0 * xs, xs, y + t0 * ldy, ldy, n, add);
    t0 += nt;
  }
}

}  // namespace moestream::cpu::detail
