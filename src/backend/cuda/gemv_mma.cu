// Quantized linear layers of 2 to kGemvMaxTokens tokens (a batched decode step) on the tensor
// cores, to float32 accuracy as the exact prefill kernels (expert_exact_mma.cu): the codes, exact
// in FP16, times the tokens' x split into two FP16 halves (split_rows.cuh), the groups' scales and
// biases applied in float32. The GEMV of several tokens on the CUDA cores issues one FMA per code
// and token and was bound by issuing them (docs/PERFORMANCE.md, session 23); here one m16n8k16
// product covers 16 rows x 16 columns x 8 tokens.
//
// No shared memory for the operands: each lane decodes its own codes straight into its A
// fragments (few_mma.cuh).
//
// A block owns 16 rows of a matrix; its 8 warps take the k-blocks in turn, each keeping the words
// of its next kPrefetch k-blocks in flight, and the warps' sums are added in a fixed order at the
// end (the result does not depend on timing).
#include <cuda_fp16.h>

#include <cstdlib>
#include <string>

#include "backend/cuda/few_mma.cuh"
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
      XBlock<KIND, WIDE> xb;
      xb.load(b, kb);
      uint32_t ha[L::kPairs], hb[L::kPairs];
      code_pairs<KIND, L::kWords>(raw[i][0].words, ha);
      code_pairs<KIND, L::kWords>(raw[i][1].words, hb);
      const float scale[2] = {scale_value<SF16>(raw[i][0].scale), scale_value<SF16>(raw[i][1].scale)};
      const float bias[2] = {scale_value<SF16>(raw[i][0].bias), scale_value<SF16>(raw[i][1].bias)};
      const int next = kb + kPrefetch * kFewWarps;
      if (next < kbs)
#pragma unroll
        for (int r = 0; r < 2; ++r) load_block<L::kWords>(rp[r], next, next * L::kCols, w, raw[i][r]);
      add_block<KIND, WIDE>(ha, hb, xb, scale, bias, acc);
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
    wide = wide && wide_k_blocks(a.w[i].group_shift, a.w[i].cols);
  }
  const int64_t cols = a.w[0].cols;
  auto get = [&](int slot, size_t bytes) { return scratch.area(slot, bytes); };
  a.T = int(T);
  if (const SplitRows* pre = scratch.norm_split.find(x, ldx, T, cols, tag.kind == kQ4)) {
    a.in = *pre;  // the norm before split x
  } else {
    a.in = split_buffers(get, kAreaExactHi, T, cols);
    split_tokens(x, ldx, T, tag.kind == kQ4, a.in, s);
  }
  auto run = [&]<int KIND, bool WIDE>() {
    if (tag.scale_f16) launch(gemv_few_mma_kernel<KIND, true, WIDE>, a.first_tile[a.n], kFewThreads, 0, s, a);
    else launch(gemv_few_mma_kernel<KIND, false, WIDE>, a.first_tile[a.n], kFewThreads, 0, s, a);
  };
  if (tag.kind == kQ8) run.template operator()<kQ8, false>();
  else if (wide) run.template operator()<kQ4, true>();
  else run.template operator()<kQ4, false>();
}

}  // namespace moestream::cuda
