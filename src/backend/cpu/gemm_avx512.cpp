// AVX-512 panel packing and micro-kernel (see gemm.h). Built with the target attribute, like
// quant_avx512.cpp; only called after kernels.cpp has checked the CPU.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <array>
#include <utility>

#include "backend/cpu/gemm.h"
#include "backend/cpu/transpose_avx512.h"

#define MS_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

namespace moestream::cpu::detail {

namespace {

constexpr int64_t kPanel = 32;  // floats per panel column
constexpr int kTokens = 8;      // most tokens per micro-kernel call (16 accumulators)

// Lanes j < n of 16 (n may exceed 16 or be negative).
MS_AVX512 inline __mmask16 first16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// MR panel vectors (16 rows each) times NT tokens over K (<= kBlockColumns) columns; the sums
// are stored in y, or added to it (add).
template <int MR, int NT>
MS_AVX512 void tile(const float* panel, int64_t K, const float* x, int64_t xs, float* y, int64_t ldy,
                    int64_t n, bool add) {
  const float* xt[NT];
  for (int t = 0; t < NT; ++t) xt[t] = x + t * xs;
  __m512 acc[NT][MR];
#pragma GCC unroll 16
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 2
    for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const float* p = panel + k * kPanel;
    __m512 w[MR];
#pragma GCC unroll 2
    for (int m = 0; m < MR; ++m) w[m] = _mm512_loadu_ps(p + 16 * m);
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
      const __m512 xb = _mm512_set1_ps(xt[t][k]);
#pragma GCC unroll 2
      for (int m = 0; m < MR; ++m) acc[t][m] = _mm512_fmadd_ps(w[m], xb, acc[t][m]);
    }
  }
  const auto mask0 = first16(n), mask1 = first16(n - 16);
#pragma GCC unroll 16
  for (int t = 0; t < NT; ++t) {
    float* yt = y + t * ldy;
    _mm512_mask_storeu_ps(yt, mask0, add ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask0, yt), acc[t][0]) : acc[t][0]);
    if constexpr (MR == 2)
      _mm512_mask_storeu_ps(yt + 16, mask1, add ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask1, yt + 16), acc[t][1]) : acc[t][1]);
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

MS_AVX512 void pack_rows_avx512(const float* rows, int64_t rs, int64_t n, int64_t K, float* dst,
                                int64_t ps) {
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t kn = std::min<int64_t>(16, K - k0);
    const __mmask16 km = first16(kn);
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = i < n ? _mm512_maskz_loadu_ps(km, rows + i * rs + k0) : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t c = 0; c < kn; ++c) _mm512_storeu_ps(dst + (k0 + c) * ps, r[c]);
  }
}

MS_AVX512 void panel_times_tokens_avx512(const float* panel, int64_t n, int64_t K, const float* x,
                                         int64_t xs, int64_t T, float* y, int64_t ldy, bool add) {
  const auto& tiles = n > 16 ? kTiles2 : kTiles1;
  // Token blocks of nearly equal size: 13 tokens run as 7 + 6 rather than 8 + 5.
  const int64_t blocks = (T + kTokens - 1) / kTokens;
  for (int64_t b = 0, t0 = 0; b < blocks; ++b) {
    const int64_t nt = (T - t0) / (blocks - b) + ((T - t0) % (blocks - b) != 0);
    tiles[size_t(nt - 1)](panel, K, x + t0 * xs, xs, y + t0 * ldy, ldy, n, add);
    t0 += nt;
  }
}

}  // namespace moestream::cpu::detail
