// Products of many float rows with several tokens (the T > 1 float path of quant_loops.h), as a
// small GEMM: rows are converted to float32 a few at a time (dequantized, or widened from
// BF16/F16/FP8), transposed into a panel, and multiplied by an outer-product micro-kernel.
//
//   panel   kPanelRows rows of K floats stored column by column: panel[k * kPanelRows + j] is
//           row j's value at column k. A column is one or two vector registers.
//   kernel  per column k, the panel's vector(s) times each token's x[t][k] broadcast, into one
//           accumulator per (vector, token): up to 16 (AVX-512) or 12 (AVX2) independent fma
//           chains, no horizontal sums, every output row of a token in one vector store.
//
// Panels are filled and multiplied kBlockColumns columns at a time: a block (16 KB for AVX-512)
// stays in L1 while every block of tokens passes over it, so the kernel is bound by the fma units
// rather than by loads, and filling it writes to L1.
//
// Summation order: output (row, token) sums its products of one block of columns in column order
// in one lane, and the blocks' sums are added to it in order (y = b0, y += b1, ...). That differs
// from the single-token kernels (several interleaved lanes, then a tree), so results may differ
// from them in the last bits; the values multiplied are the same.
#pragma once

#include <cstdint>

namespace moestream::cpu::detail {

constexpr int64_t kBlockColumns = 128;

// AVX-512: panels of 32 rows (two zmm per column), packed 16 rows at a time.
//   pack_rows_avx512: n (<= 16) float rows (row stride rs) at columns [0, K) into lanes
//     [0, 16) of the panel at dst (stride ps floats per column); lanes n..15 become zeros.
//   panel_times_tokens_avx512: y[t * ldy + j] = sum_k panel[k * 32 + j] * x[t * xs + k], k < K
//     (<= kBlockColumns), for rows j < n (<= 32) and tokens t < T; with add, y[...] += that sum.
void pack_rows_avx512(const float* rows, int64_t rs, int64_t n, int64_t K, float* dst, int64_t ps);
void panel_times_tokens_avx512(const float* panel, int64_t n, int64_t K, const float* x, int64_t xs,
                               int64_t T, float* y, int64_t ldy, bool add);

// AVX2: panels of 16 rows (two ymm per column), packed 8 rows at a time; the same contracts.
void pack_rows_avx2(const float* rows, int64_t rs, int64_t n, int64_t K, float* dst, int64_t ps);
void panel_times_tokens_avx2(const float* panel, int64_t n, int64_t K, const float* x, int64_t xs,
                             int64_t T, float* y, int64_t ldy, bool add);

}  // namespace moestream::cpu::detail
