// The q4 and q8 experts of a batched decode step (2 to kGemvMaxTokens tokens) on the tensor
// cores, to float32 accuracy as the exact kernels: work items of up to 8 rows of one expert
// (expert_items.cuh), each lane decoding its codes straight into its A fragments (few_mma.cuh).
//
// The exact kernels' items of 8 (expert_exact_mma.cu) decode every code into shared memory and read
// it back through ldmatrix: for one or two real rows an item that is 8 bytes of shared traffic for
// each byte of weights, which bound them (ncu: L1 73% busy, DRAM 17%; docs/PERFORMANCE.md, session
// 25). Here no operand passes through shared memory: a warp owns whole 16-row tiles and walks all
// their k-blocks with the words of the next kPrefetch k-blocks in flight, its tiles sharing one B
// fragment of the item's x (gate/up: the same rows of gate and up; down: two row tiles), and
// lanes without a row of the item load no x. No barriers, no shared memory.
#include <cuda_fp16.h>

#include <cstdlib>
#include <string>

#include "backend/cuda/expert_items.cuh"
#include "backend/cuda/few_mma.cuh"
#include "backend/cuda/mma.cuh"

namespace moestream::cuda {

namespace {

constexpr int kLaneWarps = 4;
constexpr int kLaneThreads = 32 * kLaneWarps;
constexpr int kPrefetch = 4;  // k-blocks of words a warp keeps in flight

// Token g's x of k-block kb (this lane's columns) into L1 without registers: the load of the
// k-block then finds it there (the warps of a block share the item's x).
template <int KIND, bool WIDE>
__device__ __forceinline__ void prefetch_x(const FewB& b, int kb) {
  using L = Layout<KIND, WIDE>;
  if (b.hi) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(b.hi + kb * L::kCols));
    asm volatile("prefetch.global.L1 [%0];" ::"l"(b.lo + kb * L::kCols));
  }
}

// This lane's sums of NA 16-row tiles (tile t: rows row0[t] + g and + 8 of w[t]) over cols
// columns, all against the same B (tokens 2j and 2j + 1 as the m16n8 accumulator holds them). The
// words of k-block kb + kPrefetch are loaded, and its x sent to L1, as k-block kb is multiplied.
template <int KIND, bool SF16, bool WIDE, int NA>
__device__ __forceinline__ void lane_tiles(const WeightRef* const (&w)[NA],
                                           const int64_t (&row0)[NA], const FewB& b, int64_t cols,
                                           float (&acc)[NA][4]) {
  using L = Layout<KIND, WIDE>;
  constexpr int B = bits_of(KIND);
  const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
  RowPtrs rp[NA][2];
#pragma unroll
  for (int t = 0; t < NA; ++t)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = min(row0[t] + g + 8 * r, w[t]->rows - 1);
      rp[t][r].words =
          static_cast<const uint32_t*>(w[t]->data) + row * (w[t]->cols * B / 32) + j * L::kWords;
      rp[t][r].scales = static_cast<const uint16_t*>(w[t]->scales) + row * w[t]->groups_per_row;
      rp[t][r].biases = w[t]->biases + row * w[t]->groups_per_row;
    }
  const int kbs = int(cols / L::kCols);
  RawBlock<L::kWords> raw[kPrefetch][NA][2];
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i)
    if (i < kbs)
#pragma unroll
      for (int t = 0; t < NA; ++t)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          load_block<L::kWords>(rp[t][r], i, i * L::kCols, *w[t], raw[i][t][r]);
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i)
    if (i < kbs) prefetch_x<KIND, WIDE>(b, i);
  for (int base = 0; base < kbs; base += kPrefetch) {
#pragma unroll
    for (int i = 0; i < kPrefetch; ++i) {
      const int kb = base + i;
      if (kb >= kbs) break;
      XBlock<KIND, WIDE> x;
      x.load(b, kb);
      const int next = kb + kPrefetch;
#pragma unroll
      for (int t = 0; t < NA; ++t) {
        uint32_t ha[L::kPairs], hb[L::kPairs];
        code_pairs<KIND, L::kWords>(raw[i][t][0].words, ha);
        code_pairs<KIND, L::kWords>(raw[i][t][1].words, hb);
        float scale[2], bias[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          scale[r] = scale_value<SF16>(raw[i][t][r].scale);
          bias[r] = scale_value<SF16>(raw[i][t][r].bias);
        }
        if (next < kbs)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            load_block<L::kWords>(rp[t][r], next, next * L::kCols, *w[t], raw[i][t][r]);
        add_block<KIND, WIDE>(ha, hb, x, scale, bias, acc[t]);
      }
      if (next < kbs) prefetch_x<KIND, WIDE>(b, next);
    }
  }
}

// The B operand of an item of nt rows: lane (g, j) multiplies by the split row in_row(g) (none
// past nt) and holds the accumulators of item rows 2j and 2j + 1 (clamped to the item).
template <int KIND, bool WIDE, class InRow>
__device__ __forceinline__ FewB item_b(const SplitRows& in, int nt, InRow in_row) {
  using L = Layout<KIND, WIDE>;
  const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
  FewB b;
  b.hi = g < nt ? in.hi + in_row(g) * in.cols + j * L::kCodes : nullptr;
  b.lo = g < nt ? in.lo + in_row(g) * in.cols + j * L::kCodes : nullptr;
  b.sum0 = in.sum + in_row(min(2 * j, nt - 1)) * in.sum_stride;
  b.sum1 = in.sum + in_row(min(2 * j + 1, nt - 1)) * in.sum_stride;
  return b;
}

// f(i, item row, output row) for each accumulator element of tile row0 that is an output.
template <class F>
__device__ __forceinline__ void for_each_lane_output(int64_t row0, int nt, int64_t rows, F f) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = 2 * j + (i & 1);
    const int64_t row = row0 + g + (i < 2 ? 0 : 8);
    if (tok < nt && row < rows) f(i, tok, row);
  }
}

// A block of 4 warps takes 64 rows of gate and up (a warp 16 of each) of one item.
template <int KIND, bool SF16, bool WIDE>
__global__ void __launch_bounds__(kLaneThreads, 3) gate_up_lanes_kernel(ExactArgs a) {
  int e, r0, nt;
  if (!block_work<kFewLaneRows>(a, e, r0, nt)) return;
  const int64_t row = int64_t(blockIdx.x) * (16 * kLaneWarps) + 16 * (int(threadIdx.x) / 32);
  if (row >= a.e.inter) return;
  const DevExpert& d = a.e.table[e];
  auto token = [&](int r) { return int64_t(a.e.g.row_token[r0 + r] / a.e.k); };
  const FewB b = item_b<KIND, WIDE>(a.in, nt, token);
  const WeightRef* const w[2] = {&d.gate, &d.up};
  const int64_t rows[2] = {row, row};
  float acc[2][4] = {};
  lane_tiles<KIND, SF16, WIDE, 2>(w, rows, b, a.e.dim, acc);
  for_each_lane_output(row, nt, a.e.inter, [&](int i, int tok, int64_t r) {
    const float inv = a.in.inv[token(tok)];
    const float gv = acc[0][i] * inv + (d.gate_bias ? d.gate_bias[r] : 0.0f);
    const float uv = acc[1][i] * inv + (d.up_bias ? d.up_bias[r] : 0.0f);
    a.e.hidden[int64_t(r0 + tok) * a.e.inter + r] =
        gated_activation(gv, uv, a.e.clamped, a.e.limit, a.e.alpha);
  });
}

// A block of 4 warps takes 128 rows of down (a warp two tiles of 16) of one item.
template <int KIND, bool SF16, bool WIDE>
__global__ void __launch_bounds__(kLaneThreads, 3) down_lanes_kernel(ExactArgs a) {
  int e, r0, nt;
  if (!block_work<kFewLaneRows>(a, e, r0, nt)) return;
  const int64_t row = int64_t(blockIdx.x) * (32 * kLaneWarps) + 32 * (int(threadIdx.x) / 32);
  if (row >= a.e.dim) return;
  const DevExpert& d = a.e.table[e];
  const FewB b = item_b<KIND, WIDE>(a.in, nt, [&](int r) { return int64_t(r0 + r); });
  const WeightRef* const w[2] = {&d.down, &d.down};
  const int64_t rows[2] = {row, row + 16};
  float acc[2][4] = {};
  lane_tiles<KIND, SF16, WIDE, 2>(w, rows, b, a.e.inter, acc);
#pragma unroll
  for (int t = 0; t < 2; ++t)
    for_each_lane_output(rows[t], nt, a.e.dim, [&](int i, int tok, int64_t r) {
      a.e.y[int64_t(r0 + tok) * a.e.dim + r] =
          acc[t][i] * a.in.inv[r0 + tok] + (d.down_bias ? d.down_bias[r] : 0.0f);
    });
}

bool lanes_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_EXPERT_LANES");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

// Calls f.template operator()<KIND, SF16, WIDE>() for a format few_lanes_take accepted.
template <class F>
void dispatch_lanes(FormatTag t, int group_shift, int64_t cols, F&& f) {
  auto with = [&]<int KIND, bool WIDE>() {
    if (t.scale_f16)
      f.template operator()<KIND, true, WIDE>();
    else
      f.template operator()<KIND, false, WIDE>();
  };
  if (t.kind == kQ8)
    with.template operator()<kQ8, false>();
  else if (wide_k_blocks(group_shift, cols))
    with.template operator()<kQ4, true>();
  else
    with.template operator()<kQ4, false>();
}

}  // namespace

bool few_lanes_take(FormatTag t, int group_shift, int64_t cols) {
  // k-blocks of 32 columns (64 when wide) in whole groups of a power of two
  return lanes_enabled() && (t.kind == kQ4 || t.kind == kQ8) && group_shift >= 5 && cols % 32 == 0;
}

void gate_up_few_lanes(const ExactArgs& a, FormatTag t, int group_shift, unsigned items,
                       cudaStream_t s) {
  dispatch_lanes(t, group_shift, a.e.dim, [&]<int KIND, bool SF16, bool WIDE>() {
    gate_up_lanes_kernel<KIND, SF16, WIDE>
        <<<dim3(blocks_for(a.e.inter, 16 * kLaneWarps), items), kLaneThreads, 0, s>>>(a);
    MS_CUDA_CHECK_LAUNCH();
  });
}

void down_few_lanes(const ExactArgs& a, FormatTag t, int group_shift, unsigned items,
                    cudaStream_t s) {
  dispatch_lanes(t, group_shift, a.e.inter, [&]<int KIND, bool SF16, bool WIDE>() {
    down_lanes_kernel<KIND, SF16, WIDE>
        <<<dim3(blocks_for(a.e.dim, 32 * kLaneWarps), items), kLaneThreads, 0, s>>>(a);
    MS_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace moestream::cuda
