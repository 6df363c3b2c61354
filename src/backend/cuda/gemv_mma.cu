// Quantized linear layers of 2 to kGemvMaxTokens tokens (a batched decode step) on the tensor
// cores, to float32 accuracy as the exact prefill kernels (expert_exact_mma.cu): the codes, exact
// in FP16, times the tokens' x split into two FP16 halves (split_rows.cuh), the groups' scales and
// biases applied in float32. The GEMV of several tokens on the CUDA cores issues one FMA per code
// and token and was bound by issuing them (docs/PERFORMANCE.md, session 23); here one m16n8k16
// product covers 16 rows x 16 columns x 8 tokens.
//
// No shared memory for the operands: each thread loads its own codes and decodes them straight
// into the A fragments. The product sums over its 16 columns in any order, so the columns a
// fragment position stands for are chosen to suit the loads: lane (g, j) (g = lane / 4, j = lane %
// 4) holds rows g and g + 8 and, of each k-block (one group's columns), the j-th quarter: a q4 word
// of 8 codes decodes into the pairs (0, 4), (1, 5), (2, 6), (3, 7), a q8 word of 4 into (0, 1),
// (2, 3), and the B fragment of token g takes x at the same columns (x split in that order, so each
// lane's x of a k-block is contiguous). A k-block never straddles a group, so its products are
// summed, then scaled once.
//
// A block owns 16 rows of a matrix; its 8 warps take the k-blocks in turn, each keeping the words
// of its next kPrefetch k-blocks in flight, and the warps' sums are added in a fixed order at the
// end (the result does not depend on timing).
#include <cuda_fp16.h>

#include <cstdlib>
#include <string>

#include "backend/cuda/linear.h"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/split_rows.cuh"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

namespace {

constexpr int kFewWarps = 8;
constexpr int kFewThreads = kFewWarps * 32;
constexpr int kFewRows = 16;      // rows per block: one m16 tile
constexpr int kPrefetch = 4;      // k-blocks of words a warp keeps in flight
constexpr int kFewMats = 4;       // matrices over one x in a launch (q, k and v)

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

struct FewArgs {
  WeightRef w[kFewMats];
  const float* bias[kFewMats];  // [w.rows] or null
  float* out[kFewMats];         // [T, ldo]
  int64_t ldo[kFewMats];
  unsigned first_tile[kFewMats + 1];
  int n;
  SplitRows in;
  int T;
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
      h[4 * i + 0] = minus_1024((w[i] & 0x000F000Fu) | 0x64006400u);
      h[4 * i + 1] = sixteenth_minus_64((w[i] & 0x00F000F0u) | 0x64006400u);
      h[4 * i + 2] = minus_1024((hi & 0x000F000Fu) | 0x64006400u);
      h[4 * i + 3] = sixteenth_minus_64((hi & 0x00F000F0u) | 0x64006400u);
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
  const int group = col >> w.group_shift;  // a power of two (few_mma_for)
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

// This lane's sums of 16 rows of w (rows row0 + g, + 8; tokens 2j, 2j + 1, as the m16n8
// accumulator holds them) over the k-blocks of its warp: warp, warp + 8, ...; the codes of the
// next kPrefetch k-blocks in flight. The kernel's wait for the one before comes after the first
// weight loads (nothing before it reads what that kernel writes).
template <int KIND, bool SF16, bool WIDE>
__device__ __forceinline__ float4 few_tile(const WeightRef& w, int64_t row0, const FewB& b) {
  using L = Layout<KIND, WIDE>;
  constexpr int B = bits_of(KIND);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
  const int64_t rows[2] = {min(row0 + g, w.rows - 1), min(row0 + g + 8, w.rows - 1)};
  const int kbs = int(w.cols / L::kCols);
  RowPtrs rp[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rp[r].words = static_cast<const uint32_t*>(w.data) + rows[r] * (w.cols * B / 32) + j * L::kWords;
    rp[r].scales = static_cast<const uint16_t*>(w.scales) + rows[r] * w.groups_per_row;
    rp[r].biases = w.biases + rows[r] * w.groups_per_row;
  }
  RawBlock<L::kWords> raw[kPrefetch][2];
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    const int kb = warp + i * kFewWarps;
    if (kb < kbs)
#pragma unroll
      for (int r = 0; r < 2; ++r) load_block<L::kWords>(rp[r], kb, kb * L::kCols, w, raw[i][r]);
  }
  wait_prior_grid();  // x was split by the kernel before
  allow_next_grid();
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int base = warp; base < kbs; base += kPrefetch * kFewWarps) {
#pragma unroll
    for (int i = 0; i < kPrefetch; ++i) {
      const int kb = base + i * kFewWarps;
      if (kb >= kbs) break;
      // x of token g at this lane's columns, as the B fragments want them
      uint32_t bh[L::kPairs] = {}, bl[L::kPairs] = {};
      if (b.hi) {
#pragma unroll
        for (int q = 0; q < L::kPairs / 4; ++q) {
          const uint4 vh = reinterpret_cast<const uint4*>(b.hi + kb * L::kCols)[q];
          const uint4 vl = reinterpret_cast<const uint4*>(b.lo + kb * L::kCols)[q];
          bh[4 * q] = vh.x; bh[4 * q + 1] = vh.y; bh[4 * q + 2] = vh.z; bh[4 * q + 3] = vh.w;
          bl[4 * q] = vl.x; bl[4 * q + 1] = vl.y; bl[4 * q + 2] = vl.z; bl[4 * q + 3] = vl.w;
        }
      }
      float sx0, sx1;  // the k-block's sums of x of tokens 2j and 2j + 1 (they multiply the bias)
      if constexpr (L::kCols == 64) {
        const float2 s0 = *reinterpret_cast<const float2*>(b.sum0 + 2 * kb);
        const float2 s1 = *reinterpret_cast<const float2*>(b.sum1 + 2 * kb);
        sx0 = s0.x + s0.y;
        sx1 = s1.x + s1.y;
      } else {
        sx0 = b.sum0[kb];
        sx1 = b.sum1[kb];
      }
      uint32_t ha[L::kPairs], hb[L::kPairs];
      code_pairs<KIND, L::kWords>(raw[i][0].words, ha);
      code_pairs<KIND, L::kWords>(raw[i][1].words, hb);
      const float scale0 = scale_value<SF16>(raw[i][0].scale), scale1 = scale_value<SF16>(raw[i][1].scale);
      const float bias0 = scale_value<SF16>(raw[i][0].bias), bias1 = scale_value<SF16>(raw[i][1].bias);
      const int next = kb + kPrefetch * kFewWarps;
      if (next < kbs)
#pragma unroll
        for (int r = 0; r < 2; ++r) load_block<L::kWords>(rp[r], next, next * L::kCols, w, raw[i][r]);
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < L::kSteps; ++s) {
        const uint32_t fa[4] = {ha[2 * s], hb[2 * s], ha[2 * s + 1], hb[2 * s + 1]};
        mma16816(c, fa, bh[2 * s], bh[2 * s + 1]);
        mma16816(c, fa, bl[2 * s], bl[2 * s + 1]);
      }
      // c: rows g (0, 1) and g + 8 (2, 3), tokens 2j (0, 2) and 2j + 1 (1, 3)
      acc[0] += fmaf(c[0], scale0, bias0 * sx0);
      acc[1] += fmaf(c[1], scale0, bias0 * sx1);
      acc[2] += fmaf(c[2], scale1, bias1 * sx0);
      acc[3] += fmaf(c[3], scale1, bias1 * sx1);
    }
  }
  return make_float4(acc[0], acc[1], acc[2], acc[3]);
}

template <int KIND, bool SF16, bool WIDE>
__global__ void __launch_bounds__(kFewThreads, 2) gemv_few_mma_kernel(FewArgs a) {
  using L = Layout<KIND, WIDE>;
  __shared__ float4 partial[kFewWarps][32];
  int m = 0;
  while (m + 1 < a.n && blockIdx.x >= a.first_tile[m + 1]) ++m;
  const WeightRef& w = a.w[m];
  const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x - a.first_tile[m]) * kFewRows;
  const int T = a.T;
  const int64_t cols = w.cols;
  FewB b;
  b.hi = g < T ? a.in.hi + g * cols + j * L::kCodes : nullptr;
  b.lo = g < T ? a.in.lo + g * cols + j * L::kCodes : nullptr;
  b.sum0 = a.in.sum + int64_t(min(2 * j, T - 1)) * a.in.sum_stride;
  b.sum1 = a.in.sum + int64_t(min(2 * j + 1, T - 1)) * a.in.sum_stride;
  const int warp = int(threadIdx.x) / 32;
  partial[warp][lane] = few_tile<KIND, SF16, WIDE>(w, row0, b);
  __syncthreads();
  if (warp != 0) return;
  float4 t = partial[0][lane];  // the warps' sums in warp order
#pragma unroll
  for (int k = 1; k < kFewWarps; ++k) {
    const float4 p = partial[k][lane];
    t.x += p.x; t.y += p.y; t.z += p.z; t.w += p.w;
  }
  const float v[4] = {t.x, t.y, t.z, t.w};
  const float* bias = a.bias[m];
  float* out = a.out[m];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = 2 * j + (i & 1);
    const int64_t row = row0 + g + (i < 2 ? 0 : 8);
    if (tok < T && row < w.rows) out[int64_t(tok) * a.ldo[m] + row] = v[i] * a.in.inv[tok] + (bias ? bias[row] : 0.0f);
  }
}

}  // namespace

bool few_mma_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_FEW_MMA");
    return !(v && std::string(v) == "0") && exact_mma_enabled();
  }();
  return on;
}

bool few_mma_for(const Matrix& m, int64_t T, const float* x, int64_t ldx) {
  if (!few_mma_enabled() || T < 2 || T > kGemvMaxTokens) return false;
  const FormatTag tag = format_of(m);
  if (tag.kind != kQ4 && tag.kind != kQ8) return false;
  // whole k-blocks of 32 columns in whole groups; x rows split in float4s
  return m.cols % 32 == 0 && weight_ref(m).group_shift >= 5 && ldx % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

void linear_few_mma(std::span<const Matrix* const> mats, const float* x, int64_t ldx, int64_t T,
                    std::span<const float* const> bias, std::span<float* const> out, std::span<const int64_t> ldo,
                    GemmScratch& scratch, cudaStream_t s) {
  if (mats.empty() || mats.size() > size_t(kFewMats)) fail("cuda: ", mats.size(), " matrices in one few-token product");
  const FormatTag tag = format_of(*mats[0]);
  FewArgs a{};
  a.n = int(mats.size());
  bool wide = tag.kind == kQ4;
  for (int i = 0; i < a.n; ++i) {
    a.w[i] = weight_ref(*mats[size_t(i)]);
    a.bias[i] = bias[size_t(i)];
    a.out[i] = out[size_t(i)];
    a.ldo[i] = ldo[size_t(i)];
    a.first_tile[i + 1] = a.first_tile[i] + blocks_for(a.w[i].rows, kFewRows);
    wide = wide && a.w[i].group_shift >= 6 && a.w[i].cols % 64 == 0;
  }
  const int64_t cols = a.w[0].cols;
  auto get = [&](int slot, size_t bytes) { return scratch.area(slot, bytes); };
  a.in = split_buffers(get, kAreaExactHi, T, cols);
  a.T = int(T);
  split_tokens(x, ldx, T, tag.kind == kQ4, a.in, s);
  auto run = [&]<int KIND, bool WIDE>() {
    if (tag.scale_f16) launch(gemv_few_mma_kernel<KIND, true, WIDE>, a.first_tile[a.n], kFewThreads, 0, s, a);
    else launch(gemv_few_mma_kernel<KIND, false, WIDE>, a.first_tile[a.n], kFewThreads, 0, s, a);
  };
  if (tag.kind == kQ8) run.template operator()<kQ8, false>();
  else if (wide) run.template operator()<kQ4, true>();
  else run.template operator()<kQ4, false>();
}

}  // namespace moestream::cuda
