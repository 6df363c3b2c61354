#include "backend/cpu/kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MS_AVX2 1
#endif

#include "core/error.h"

namespace moestream::cpu {

namespace {

#ifdef MS_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
inline __m256 load_bf16(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline __m256 load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

float dot_bf16(const uint16_t* w, const float* x, int64_t n) {
  int64_t i = 0;
  float sum = 0;
#ifdef MS_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(load_bf16(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load_bf16(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load_bf16(w + i), _mm256_loadu_ps(x + i), a0);
  sum = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) sum += bf16_to_f32(w[i]) * x[i];
  return sum;
}

float dot_f16(const uint16_t* w, const float* x, int64_t n) {
  int64_t i = 0;
  float sum = 0;
#ifdef MS_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(load_f16(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load_f16(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load_f16(w + i), _mm256_loadu_ps(x + i), a0);
  sum = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) sum += f16_to_f32(w[i]) * x[i];
  return sum;
}

}  // namespace

float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0;
#ifdef MS_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8)
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
  sum = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

float dot_row(const Matrix& w, int64_t row, const float* x) {
  switch (w.dtype) {
    case DType::F32:
      return dot_f32(static_cast<const float*>(w.data) + row * w.cols, x, w.cols);
    case DType::BF16:
      return dot_bf16(static_cast<const uint16_t*>(w.data) + row * w.cols, x, w.cols);
    case DType::F16:
      return dot_f16(static_cast<const uint16_t*>(w.data) + row * w.cols, x, w.cols);
    default:
      fail("weight ", w.name, ": dtype ", dtype_name(w.dtype), " has no CPU kernel");
  }
}

void row_to_f32(const Matrix& w, int64_t row, float* dst) {
  const int64_t n = w.cols;
  switch (w.dtype) {
    case DType::F32: {
      const float* src = static_cast<const float*>(w.data) + row * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
      return;
    }
    case DType::BF16: {
      const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
      return;
    }
    case DType::F16: {
      const uint16_t* src = static_cast<const uint16_t*>(w.data) + row * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
      return;
    }
    default:
      fail("weight ", w.name, ": dtype ", dtype_name(w.dtype), " has no CPU kernel");
  }
}

void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void prepare_input(const Matrix& w, const float* x, int64_t T, bool precise, PreparedInput& in) {
  in.x = x;
  in.T = T;
  in.cols = w.cols;
  in.precise = precise;
}

void matmul_rows(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy, int64_t r0,
                 int64_t r1) {
  if (in.T == 1) {
    for (int64_t r = r0; r < r1; ++r) y[r] = dot_row(w, r, in.x);
    return;
  }
  // Each weight row is converted once and reused for every token.
  thread_local std::vector<float> row;
  row.resize(size_t(w.cols));
  for (int64_t r = r0; r < r1; ++r) {
    row_to_f32(w, r, row.data());
    for (int64_t t = 0; t < in.T; ++t) y[t * ldy + r] = dot_f32(row.data(), in.x + t * in.cols, w.cols);
  }
}

}  // namespace moestream::cpu
