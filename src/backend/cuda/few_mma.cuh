// The lane-decoded operands of the few-token tensor-core kernels (gemv_mma.cu for the linears,
// expert_few_mma.cu for the experts): each lane loads its own codes of a k-block and decodes them
// straight into its m16n8k16 A fragments, with no shared memory. The product sums over its 16
// columns in any order, so the columns a fragment position stands for are chosen to suit the
// loads: lane (g, j) (g = lane / 4, j = lane % 4) holds rows g and g + 8 and, of each k-block (one
// group's columns), the j-th quarter: a q4 word of 8 codes decodes into the pairs (0, 4), (1, 5),
// (2, 6), (3, 7), a q8 word of 4 into (0, 1), (2, 3), and the B fragment of token g takes x at the
// same columns (x split in that order by split_rows.cuh, so each lane's x of a k-block is
// contiguous). A k-block never straddles a group, so its products are summed, then scaled once.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/mma.cuh"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

// Whether q4 takes k-blocks of 64 columns (two words a lane): its groups and its width multiples
// of 64; else 32.
inline bool wide_k_blocks(int group_shift, int64_t cols) { return group_shift >= 6 && cols % 64 == 0; }

// What one lane reads of a k-block: WORDS 32-bit words a row (q4 with groups of a multiple of 64
// columns: two words, a k-block of 64 columns; else one, 32 columns; q8: two words, 32 columns).
template <int KIND, bool WIDE>
struct Layout {
  static constexpr int kWords = KIND == kQ8 || WIDE ? 2 : 1;
  static constexpr int kCodes = (KIND == kQ8 ? 4 : 8) * kWords;  // a lane's columns of a k-block
  static constexpr int kCols = 4 * kCodes;                         // a k-block
  static constexpr int kPairs = kCodes / 2;
  static constexpr int kSteps = kCodes / 4;                        // m16n8k16 products a k-block
};

// One row's k-block as loaded: its words, the group's scale and bias bits.
template <int WORDS>
struct RawBlock {
  uint32_t words[WORDS];
  uint16_t scale, bias;
};

// (1024 + 16 c) / 16 - 64 = c, exactly (one rounding of an exact result).
__device__ __forceinline__ uint32_t sixteenth_minus_64(uint32_t h2) {
  const __half2 sixteenth = __halves2half2(__ushort_as_half(0x2C00), __ushort_as_half(0x2C00));
  const __half2 minus_64 = __halves2half2(__ushort_as_half(0xD400), __ushort_as_half(0xD400));
  const __half2 v = __hfma2(*reinterpret_cast<const __half2*>(&h2), sixteenth, minus_64);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A lane's codes of one row as FP16 pairs: a q4 word's nibbles (0, 4), (1, 5), (2, 6), (3, 7) (the
// code placed in the mantissa of 1024, or 16 times it, then 1024 taken away), a q8 word's bytes
// (0, 1), (2, 3).
template <int KIND, int WORDS>
__device__ __forceinline__ void code_pairs(const uint32_t (&w)[WORDS],
                                           uint32_t (&h)[KIND == kQ8 ? 2 * WORDS : 4 * WORDS]) {
#pragma unroll
  for (int i = 0; i < WORDS; ++i) {
    if constexpr (KIND == kQ4) {
      const uint32_t hi = w[i] >> 8;
      h[4 * i + 0] = minus_1024(masked_or<0x000F000Fu, 0x64006400u>(w[i]));
      h[4 * i + 1] = sixteenth_minus_64(masked_or<0x00F000F0u, 0x64006400u>(w[i]));
      h[4 * i + 2] = minus_1024(masked_or<0x000F000Fu, 0x64006400u>(hi));
      h[4 * i + 3] = sixteenth_minus_64(masked_or<0x00F000F0u, 0x64006400u>(hi));
    } else {
      h[2 * i + 0] = minus_1024(__byte_perm(w[i], 0x64646464u, 0x4140));
      h[2 * i + 1] = minus_1024(__byte_perm(w[i], 0x64646464u, 0x4342));
    }
  }
}

// One lane's pointers into one matrix row: its words, the row's scales and biases.
struct RowPtrs {
  const uint32_t* words;
  const uint16_t *scales, *biases;
};

template <int WORDS>
__device__ __forceinline__ void load_block(const RowPtrs& p, int kb, int col, const WeightRef& w, RawBlock<WORDS>& r) {
  const uint32_t* words = p.words + kb * 4 * WORDS;
  if constexpr (WORDS == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(words);
    r.words[0] = v.x;
    r.words[1] = v.y;
  } else {
    r.words[0] = *words;
  }
  const int group = col >> w.group_shift;  // a power of two (few_mma_for, experts_few_lanes_for)
  r.scale = p.scales[group];
  r.bias = p.biases[group];
}

// What a lane multiplies its codes by: token g's split x at its columns (null: no token g, zeros),
// and the pack sums of tokens 2j and 2j + 1 (rows of SplitRows::sum), whose accumulators it holds.
struct FewB {
  const __half* hi;
  const __half* lo;
  const float* sum0;
  const float* sum1;
};

// A lane's B operands of k-block kb: token g's x at its columns, as the B fragments want them
// (zeros without a token g), and the k-block's sums of x of tokens 2j and 2j + 1 (they multiply
// the bias).
template <int KIND, bool WIDE>
struct XBlock {
  using L = Layout<KIND, WIDE>;
  uint32_t hi[L::kPairs] = {}, lo[L::kPairs] = {};
  float sx0, sx1;

  __device__ __forceinline__ void load(const FewB& b, int kb) {
    if (b.hi) {
#pragma unroll
      for (int q = 0; q < L::kPairs / 4; ++q) {
        const uint4 vh = reinterpret_cast<const uint4*>(b.hi + kb * L::kCols)[q];
        const uint4 vl = reinterpret_cast<const uint4*>(b.lo + kb * L::kCols)[q];
        hi[4 * q] = vh.x; hi[4 * q + 1] = vh.y; hi[4 * q + 2] = vh.z; hi[4 * q + 3] = vh.w;
        lo[4 * q] = vl.x; lo[4 * q + 1] = vl.y; lo[4 * q + 2] = vl.z; lo[4 * q + 3] = vl.w;
      }
    }
    if constexpr (L::kCols == 64) {
      const float2 s0 = *reinterpret_cast<const float2*>(b.sum0 + 2 * kb);
      const float2 s1 = *reinterpret_cast<const float2*>(b.sum1 + 2 * kb);
      sx0 = s0.x + s0.y;
      sx1 = s1.x + s1.y;
    } else {
      sx0 = b.sum0[kb];
      sx1 = b.sum1[kb];
    }
  }
};


// acc += one k-block's products for this lane: codes ha (row g) and hb (row g + 8) against x, each
// row's sums scaled by its group's scale, with its bias times the k-block's sum of x (acc as the
// m16n8 accumulator holds it: rows g (0, 1) and g + 8 (2, 3), tokens 2j (0, 2) and 2j + 1 (1, 3)).
template <int KIND, bool WIDE>
__device__ __forceinline__ void add_block(const uint32_t (&ha)[Layout<KIND, WIDE>::kPairs],
                                          const uint32_t (&hb)[Layout<KIND, WIDE>::kPairs], const XBlock<KIND, WIDE>& x,
                                          const float (&scale)[2], const float (&bias)[2], float (&acc)[4]) {
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int s = 0; s < Layout<KIND, WIDE>::kSteps; ++s) {
    const uint32_t fa[4] = {ha[2 * s], hb[2 * s], ha[2 * s + 1], hb[2 * s + 1]};
    mma16816(c, fa, x.hi[2 * s], x.hi[2 * s + 1]);
    mma16816(c, fa, x.lo[2 * s], x.lo[2 * s + 1]);
  }
  acc[0] += fmaf(c[0], scale[0], bias[0] * x.sx0);
  acc[1] += fmaf(c[1], scale[0], bias[0] * x.sx1);
  acc[2] += fmaf(c[2], scale[1], bias[1] * x.sx0);
  acc[3] += fmaf(c[3], scale[1], bias[1] * x.sx1);
}

}  // namespace moestream::cuda
