// Private to the CPU kernels: the table of functions each SIMD level provides, the element order
// its unpacked weight codes come in, and accessors for the parts of a stored row.
// kernels.cpp picks a table and prepares activations; quant_scalar.cpp, quant_avx2.cpp and
// quant_avx512.cpp implement one table each.
#pragma once

#include <cstdint>

#include "backend/cpu/kernels.h"
#include "core/quant.h"

namespace moestream::cpu::detail {

using MatmulFn = void (*)(const Matrix& w, const PreparedInput& in, float* y, int64_t ldy,
                          int64_t r0, int64_t r1);

struct LevelKernels {
  float (*dot_f32)(const float* a, const float* b, int64_t n);
  void (*axpy)(float a, const float* x, float* y, int64_t n);
  MatmulFn matmul_plain;           // F32 / BF16 / F16 weights, float activations (in.x)
  MatmulFn matmul_quant_precise;   // quantized weights, float activations (in.xf)
  MatmulFn matmul_quant_int8;      // quantized weights, int8 activations (in.q ...)
  // One token's activations x[0, cols) (cols a multiple of 32) to int8 per block of 32, in the
  // level's code order for `bits`-bit weights: q[cols], lane_scale[cols / 4] (each 4-element
  // lane gets its block's scale max|x| / 127), and adds each block's scale * sum(q) to
  // group_sum[block * 32 / group_size]. Every level computes the same values: scale = amax / 127,
  // q = round-half-even(x * (127 / amax)); a block holding Inf or NaN gets q = 0, scale NaN.
  void (*quantize_activations)(const float* x, int64_t cols, int group_size, int bits, int8_t* q,
                               float* lane_scale, float* group_sum);
};

const LevelKernels& scalar_kernels();
const LevelKernels& avx2_kernels();
const LevelKernels& avx512_kernels();

// Where element e (0..31) of a block of 32 lands in a level's unpacked codes, which is where
// prepare_input puts the activation that multiplies it.
//   Natural  e -> e.
//   Nibbles  (AVX2, 4-bit) low nibbles of the block's 16 bytes, then high nibbles:
//            e -> e / 2 + 16 * (e % 2).
//   Crumbs   (AVX2, 2-bit) the 8 bytes shifted by 0, 2, 4, 6 bits in turn:
//            e -> 8 * (e % 4) + e / 4.
//   Halves   (AVX-512 float path, 4-bit) each 16 codes are 8 bytes broadcast to every qword;
//            dword 2j shifts the low 4 bytes, dword 2j+1 the high 4 bytes, by 4j:
//            e -> e / 16 * 16 + 2 * (e % 8) + e % 16 / 8.
enum class CodeOrder : uint8_t { Natural, Nibbles, Crumbs, Halves };
inline CodeOrder code_order(KernelLevel level, int bits, bool precise) {
  if (level == KernelLevel::Avx512) return precise && bits == 4 ? CodeOrder::Halves : CodeOrder::Natural;
  if (level != KernelLevel::Avx2) return CodeOrder::Natural;
  if (bits == 4) return CodeOrder::Nibbles;
  if (bits == 2) return CodeOrder::Crumbs;
  return CodeOrder::Natural;
}
inline int position_in_block(CodeOrder order, int e) {
  switch (order) {
    case CodeOrder::Nibbles: return e / 2 + 16 * (e % 2);
    case CodeOrder::Crumbs: return 8 * (e % 4) + e / 4;
    case CodeOrder::Halves: return e / 16 * 16 + 2 * (e % 8) + e % 16 / 8;
    default: return e;
  }
}

// Parts of row r of a quantized matrix (see core/quant.h for the layout). Code bytes are read
// straight from the uint32 words, which assumes a little-endian CPU (x86-64). MXFP4 rows have
// the 4-bit code layout, one exponent byte per group (row_exponents) and no biases; the kernels
// run them as affine 4-bit groups of 32 through the table in core/quant.h (kMxfp4AffineCode).
inline int64_t row_code_bytes(const Matrix& w) { return w.cols * w.quant.bits / 8; }
inline const uint8_t* row_codes(const Matrix& w, int64_t r) {
  return static_cast<const uint8_t*>(w.data) + r * row_code_bytes(w);
}
inline int64_t row_groups(const Matrix& w) { return quant_groups_per_row(w.quant, w.cols); }
inline const uint16_t* row_scales(const Matrix& w, int64_t r) {
  return static_cast<const uint16_t*>(w.scales) + r * row_groups(w);
}
inline const uint16_t* row_biases(const Matrix& w, int64_t r) {
  return static_cast<const uint16_t*>(w.biases) + r * row_groups(w);
}
inline bool is_mxfp4(const Matrix& w) { return w.quant.scheme == QuantScheme::Mxfp4; }
inline const uint8_t* row_exponents(const Matrix& w, int64_t r) {
  return static_cast<const uint8_t*>(w.scales) + r * row_groups(w);
}
// FP8 rows (dtype F8_E4M3): one code byte per column and float32 scales per group. The kernels
// treat them like plain rows (float32 activations, QuantLoops::matmul_plain).
inline bool is_fp8(const Matrix& w) { return w.quant.scheme == QuantScheme::Fp8; }
inline const uint8_t* row_fp8_codes(const Matrix& w, int64_t r) {
  return static_cast<const uint8_t*>(w.data) + r * w.cols;
}
inline const float* row_fp8_scales(const Matrix& w, int64_t r) {
  return static_cast<const float*>(w.scales) + r * row_groups(w);
}

// Single-token products stream each row once. The hardware prefetchers alone left them at about
// 70% of the DRAM read bandwidth on the 2-core development machine (Sapphire Rapids VM); asking
// for the row that starts about 4 KB ahead brought them to about 90%.
constexpr int64_t kPrefetchBytes = 4096;
inline int64_t prefetch_rows_ahead(int64_t row_bytes) {
  return (kPrefetchBytes + row_bytes - 1) / row_bytes;
}
inline void prefetch_bytes(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(c + o);
  __builtin_prefetch(c + n - 1);
}
// Row r of a quantized matrix: codes, scales and biases.
inline void prefetch_quant_row(const Matrix& w, int64_t r) {
  prefetch_bytes(row_codes(w, r), row_code_bytes(w));
  if (is_mxfp4(w)) {
    prefetch_bytes(row_exponents(w, r), row_groups(w));
    return;
  }
  prefetch_bytes(row_scales(w, r), row_groups(w) * 2);
  prefetch_bytes(row_biases(w, r), row_groups(w) * 2);
}
// The scales and biases (MXFP4: exponents) of rows r .. r + m - 1 of a quantized matrix whose
// groups are GS columns (contiguous rows: one range each).
template <int GS, bool MX>
inline void prefetch_quant_sides(const Matrix& w, int64_t r, int64_t m) {
  const int64_t groups = w.cols / GS;
  if (MX) {
    prefetch_bytes(static_cast<const uint8_t*>(w.scales) + r * groups, m * groups);
    return;
  }
  prefetch_bytes(static_cast<const uint16_t*>(w.scales) + r * groups, m * groups * 2);
  prefetch_bytes(static_cast<const uint16_t*>(w.biases) + r * groups, m * groups * 2);
}
// Row r of a plain matrix.
inline void prefetch_plain_row(const Matrix& w, int64_t r) {
  const int64_t bytes = w.cols * int64_t(dtype_size(w.dtype));
  prefetch_bytes(static_cast<const char*>(w.data) + r * bytes, bytes);
  if (is_fp8(w)) prefetch_bytes(row_fp8_scales(w, r), row_groups(w) * 4);
}

}  // namespace moestream::cpu::detail
