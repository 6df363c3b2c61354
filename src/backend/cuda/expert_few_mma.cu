// The q4 and q8 experts of a batched decode step (2 to kGemvMaxTokens tokens) on the tensor
// cores, to float32 accuracy as the exact kernels: work items of up to 8 rows of one expert
// (expert_items.cuh), each lane decoding its codes straight into its A fragments (few_mma.cuh).
//
// The exact kernels' items of 8 (expert_exact_mma.cu) decode every code into shared memory and read
// it back through ldmatrix: for one or two real rows an item that is 8 bytes of shared traffic for
// each byte of weights, which bound them (ncu: L1 73% busy, DRAM 17%; docs/PERFORMANCE.md, session
// 25). Here the codes go straight from the words into the fragments, a warp's 16-row tiles share
// one B fragment of the item's x (gate/up: the same rows of gate and up; down: two row tiles), and
// lanes without a row of the item load no x.
//
// The words reach the lanes one of two ways. Directly (lane_tiles): each lane loads its own, the
// next kPrefetch k-blocks in flight. Through the warp's staging (lane_tiles_staged): the warp
// copies its tiles' words 128 bytes of a row at a time (8 lanes a row, 16 bytes each) into its own
// part of shared memory with cp.async, kStages lines ahead, with the tiles' scales and biases once,
// and the lanes read their words from there. Experts read in place from the host tier
// (DevExpert::in_host) need the staging: over PCIe, what bounds the rate is the size of each read,
// and the lanes' own loads (8 bytes of each of 16 rows a k-block, each row's 2-byte scale and bias)
// go out as 32-byte reads and reach ~24 GB/s of an H200's 55, whole 128-byte lines ~46
// (docs/PERFORMANCE.md, session 26). Both ways sum the same products in the same order.
//
// The split kernels (the default) give a block's warps the same tiles and split the rows' columns
// between them (split_tiles), and stage every expert of a layer whose arrays are all aligned for
// it, in VRAM or not; down goes further where every expert is staged (down_stream_kernel: a grid
// of about the blocks the SMs hold, each taking item after item). The whole-row kernels (a warp's
// own tiles over all their columns, staged only when read in place) are left where a split
// block's shared memory would not fit.
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <string_view>

#include "backend/cuda/expert_items.cuh"
#include "backend/cuda/few_mma.cuh"
#include "backend/cuda/linear.h"
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

// This lane's sums of NA 16-row tiles (tile t: rows row0[t] + g and + 8 of w[t]) over k-blocks
// [kb0, kb1), all against the same B (tokens 2j and 2j + 1 as the m16n8 accumulator holds them).
// The words of k-block kb + kPrefetch are loaded, and its x sent to L1, as k-block kb is
// multiplied. wait: the first k-blocks' words are loaded before the wait for the kernel before
// (block_work's early).
template <int KIND, bool SF16, bool WIDE, int NA>
__device__ __forceinline__ void lane_tiles(const WeightRef* const (&w)[NA],
                                           const int64_t (&row0)[NA], const FewB& b, int kb0,
                                           int kb1, float (&acc)[NA][4], bool wait = false) {
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
  const int kbs = kb1 - kb0;  // k-block kb0 + i below is the range's i
  RawBlock<L::kWords> raw[kPrefetch][NA][2];
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i)
    if (i < kbs)
#pragma unroll
      for (int t = 0; t < NA; ++t)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          load_block<L::kWords>(rp[t][r], kb0 + i, (kb0 + i) * L::kCols, *w[t], raw[i][t][r]);
  if (wait) follow_prior_grid();  // x is the kernel before's
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i)
    if (i < kbs) prefetch_x<KIND, WIDE>(b, kb0 + i);
  for (int base = 0; base < kbs; base += kPrefetch) {
#pragma unroll
    for (int i = 0; i < kPrefetch; ++i) {
      const int kb = base + i;
      if (kb >= kbs) break;
      XBlock<KIND, WIDE> x;
      x.load(b, kb0 + kb);
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
            load_block<L::kWords>(rp[t][r], kb0 + next, (kb0 + next) * L::kCols, *w[t],
                                  raw[i][t][r]);
        add_block<KIND, WIDE>(ha, hb, x, scale, bias, acc[t]);
      }
      if (next < kbs) prefetch_x<KIND, WIDE>(b, kb0 + next);
    }
  }
}

// --- the staging ---
constexpr int kChunk = 128;  // bytes of a row a chunk (one line)
constexpr int kPitch =
    kChunk + 32;  // a staged row: the 8-byte reads of 4 rows (a half warp) on distinct banks
constexpr int kStages = 2;  // chunks in flight
constexpr int kTileChunk = 16 * kPitch;

// Bytes of shared memory a warp stages for NA tiles of rows of `cols` columns whose groups are at
// least 2^group_shift columns: its chunk ring, then each tile's scales and biases.
inline int scale_stage_bytes(int64_t cols, int group_shift) {
  const int64_t groups = (cols + (int64_t(1) << group_shift) - 1) >> group_shift;
  return int((16 * groups * 2 + 15) / 16 * 16);
}
// The 128-byte lines of a row of `cols` columns of `bits`-bit codes (the last may be partial).
__host__ __device__ inline int row_lines(int64_t cols, int bits) {
  return int((cols * bits / 8 + kChunk - 1) / kChunk);
}
// A block stages at most this much (3 blocks an SM, as the direct path runs); beyond it experts
// read in place take the direct path, and the split kernels are not taken.
constexpr int kMaxStagedBlockBytes = 72 * 1024;
__host__ __device__ inline int staged_warp_bytes(int na, int scale_stage) {
  return na * (kStages * kTileChunk + 2 * scale_stage);
}

// Whether the expert's matrices can be staged: in the host tier, every array 16-byte aligned (a
// pack's tensors start at multiples of 64 bytes).
__device__ __forceinline__ bool staged(const DevExpert& d) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  bool ok = d.in_host != 0;
  for (const WeightRef* w : {&d.gate, &d.up, &d.down})
    ok = ok && aligned(w->data) && aligned(w->scales) && aligned(w->biases);
  return ok;
}

// Copies the scales and biases of NA 16-row tiles (tile t: rows row0[t] .. + 15 of w[t]) into sc
// ([NA][scales, biases][scale_stage]) with cp.async, uncommitted. BLOCK: the block's threads share
// the copy; else the warp copies it alone.
template <int NA, bool BLOCK>
__device__ __forceinline__ void stage_scales(const WeightRef* const (&w)[NA],
                                             const int64_t (&row0)[NA], char* sc,
                                             int scale_stage) {
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int t = 0; t < NA; ++t) {
    const int64_t gpr = w[t]->groups_per_row;
    const int64_t n = (min(row0[t] + 16, w[t]->rows) - row0[t]) * gpr * 2;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const char* src =
          static_cast<const char*>(m ? static_cast<const void*>(w[t]->biases) : w[t]->scales) +
          row0[t] * gpr * 2;
      const int64_t first = BLOCK ? int64_t(threadIdx.x) : lane;
      const int64_t step = BLOCK ? int64_t(blockDim.x) : 32;
      for (int64_t off = 16 * first; off < n; off += 16 * step)
        cp_async16(sc + (2 * t + m) * scale_stage + off, src + off,
                   int(n - off < 16 ? n - off : 16));
    }
  }
}

// What a lane's copies and products need of NA 16-row tiles (tile t: rows row0[t] .. + 15 of
// w[t], clamped to the matrix), worked out once a call: the tiles' fields are loads from the
// expert table, which the compiler cannot keep in registers across the copies' asm, and the
// clamps in 64 bits cost a dozen instructions a row (ncu's SASS counts, docs/PERFORMANCE.md,
// session 41).
template <int NA>
struct StagedTiles {
  const char* base[NA];  // tile t's first row at this lane's 16 bytes of a line
  int copy_row[NA][4];   // from base: the rows this lane copies (lane / 8 + 4 i)
  int scale_at[NA][2];   // this lane's rows g and g + 8 in the staged scales, in bytes
  int group_shift[NA];
  int row_bytes;
};

template <int NA>
__device__ __forceinline__ StagedTiles<NA> staged_tiles(const WeightRef* const (&w)[NA],
                                                        const int64_t (&row0)[NA],
                                                        int64_t row_bytes) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4;
  StagedTiles<NA> s;
  s.row_bytes = int(row_bytes);
#pragma unroll
  for (int t = 0; t < NA; ++t) {
    // the tile's last row, from row0 (negative where row0 is past it: rows are then clamped to
    // the matrix's last, as before any tile)
    const int last = int(min(w[t]->rows - 1 - row0[t], int64_t(15)));
    const int gpr = int(w[t]->groups_per_row);
    s.base[t] = static_cast<const char*>(w[t]->data) + row0[t] * row_bytes + (lane % 8) * 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) s.copy_row[t][i] = min(lane / 8 + 4 * i, last) * int(row_bytes);
#pragma unroll
    for (int r = 0; r < 2; ++r) s.scale_at[t][r] = min(g + 8 * r, last) * gpr * 2;
    s.group_shift[t] = w[t]->group_shift;
  }
  return s;
}

// Copies line c (128 bytes) of every tile's 16 rows into `stage` ([NA][16][kPitch]) with
// cp.async, uncommitted; the warp's lanes take 16 bytes each of 4 rows.
template <int NA>
__device__ __forceinline__ void stage_line(const StagedTiles<NA>& s, int c, char* stage) {
  const int lane = int(threadIdx.x) % 32;
  const int off = c * kChunk;
  const int left = s.row_bytes - off - (lane % 8) * 16;
  const int n = left <= 0 ? 0 : left < 16 ? left : 16;
#pragma unroll
  for (int t = 0; t < NA; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = lane / 8 + 4 * i;
      char* dst = stage + t * kTileChunk + r * kPitch + (lane % 8) * 16;
      cp_async16(dst, s.base[t] + s.copy_row[t][i] + off, n);
    }
}

// The staged line c's products added to acc: its words in `stage` ([NA][16][kPitch]), the tiles'
// scales and biases in sc (stage_scales), where s says this lane's rows are.
template <int KIND, bool SF16, bool WIDE, int NA>
__device__ __forceinline__ void staged_line_products(const StagedTiles<NA>& s, const FewB& b,
                                                     int64_t cols, int c, const char* stage,
                                                     const char* sc, int scale_stage,
                                                     float (&acc)[NA][4]) {
  using L = Layout<KIND, WIDE>;
  constexpr int kBlockBytes = 16 * L::kWords;  // a row's bytes of a k-block (4 lanes)
  constexpr int kPerChunk = kChunk / kBlockBytes;
  const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
  const int kbs = int(cols / L::kCols);
#pragma unroll
  for (int i = 0; i < kPerChunk; ++i) {
    const int kb = c * kPerChunk + i;
    if (kb >= kbs) break;
    XBlock<KIND, WIDE> x;
    x.load(b, kb);
#pragma unroll
    for (int t = 0; t < NA; ++t) {
      uint32_t raw[2][L::kWords];
      float scale[2], bias[2];
      const int group = (kb * L::kCols) >> s.group_shift[t];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const char* p =
            stage + t * kTileChunk + (g + 8 * r) * kPitch + i * kBlockBytes + j * L::kWords * 4;
        if constexpr (L::kWords == 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(p);
          raw[r][0] = v.x;
          raw[r][1] = v.y;
        } else {
          raw[r][0] = *reinterpret_cast<const uint32_t*>(p);
        }
        const int at = s.scale_at[t][r] + group * 2;
        scale[r] =
            scale_value<SF16>(*reinterpret_cast<const uint16_t*>(sc + 2 * t * scale_stage + at));
        bias[r] = scale_value<SF16>(
            *reinterpret_cast<const uint16_t*>(sc + (2 * t + 1) * scale_stage + at));
      }
      uint32_t ha[L::kPairs], hb[L::kPairs];
      code_pairs<KIND, L::kWords>(raw[0], ha);
      code_pairs<KIND, L::kWords>(raw[1], hb);
      add_block<KIND, WIDE>(ha, hb, x, scale, bias, acc[t]);
    }
  }
}

// lane_tiles through the staging: the same products, summed in the same order (bit for bit the
// direct loads'), over lines [c0, c1) of each row, from words staged in this warp's `ring`
// ([kStages][NA][16][kPitch]) and the tiles' scales and biases staged in `sc` ([NA][scales,
// biases][scale_stage]). BLOCK: the block's warps share sc, copy it together and wait for each
// other once (every warp of the block must call this); else the warp copies it alone. wait: as
// lane_tiles's, after the first lines are issued.
template <int KIND, bool SF16, bool WIDE, int NA, bool BLOCK>
__device__ __forceinline__ void lane_tiles_staged(const WeightRef* const (&w)[NA],
                                                  const int64_t (&row0)[NA], const FewB& b,
                                                  int64_t cols, int c0, int c1, char* ring,
                                                  char* sc, int scale_stage,
                                                  float (&acc)[NA][4], bool wait = false) {
  const StagedTiles<NA> s = staged_tiles<NA>(w, row0, cols * bits_of(KIND) / 8);
  stage_scales<NA, BLOCK>(w, row0, sc, scale_stage);
  // line c into stage (c - c0) % kStages
  auto issue = [&](int c) {
    if (c < c1) stage_line<NA>(s, c, ring + ((c - c0) % kStages) * NA * kTileChunk);
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < kStages; ++c) issue(c0 + c);
  if (wait) follow_prior_grid();  // x is the kernel before's
  for (int c = c0; c < c1; ++c) {
    cp_async_wait<kStages - 1>();
    if (BLOCK && c == c0)
      __syncthreads();  // every thread's pieces of the scales (in the first line's group)
    else
      __syncwarp();
    staged_line_products<KIND, SF16, WIDE, NA>(s, b, cols, c,
                                               ring + ((c - c0) % kStages) * NA * kTileChunk, sc,
                                               scale_stage, acc);
    __syncwarp();
    issue(c + kStages);
  }
  cp_async_wait<0>();
}

// --- a row's columns split across a block's warps ---
// In the split kernels a block's warps share its rows (gate/up: 16 of gate and of up; down: 32)
// and split their columns: warp p of S takes lines [p * lines / S, (p + 1) * lines / S) of each
// row (128 bytes a line, as the staging copies them, so experts read in place still move whole
// lines), and warp 0 adds the others' sums to its own in warp order. A block's chain of k-blocks
// is S times shorter and a step's experts are S times as many warps, where the blocks of whole
// rows ran one wave of ~2.4 blocks an SM, each warp waiting on its loads most of the time
// (docs/PERFORMANCE.md, session 30). Measured (session 34): more warps active (ncu: 21% of the
// slots against 14%), each kernel alone about as fast, a batched step 2-4% faster.

// The warps (parts) for rows of `lines` lines: at most 4, whole lines each.
__host__ __device__ inline int k_parts(int lines) {
  if (lines % 4 == 0) return 4;
  if (lines % 3 == 0) return 3;
  return lines < 4 ? lines : 4;
}
// A split block's shared memory: its warps' rings, its two tiles' scales and biases, and the sums
// of warps 1 .. S - 1.
inline int split_smem_bytes(int parts, int scale_stage) {
  return parts * kStages * 2 * kTileChunk + 4 * scale_stage + (parts - 1) * 2 * 4 * 32 * 4;
}

// This warp's part of the sums of the two tiles of expert d's matrices w, then warp 0's acc the
// whole sums: through the staging, or where PURE is false and d is not staged (not in the host
// tier, not aligned, or stage_host 0) through lane_tiles over the same k-blocks, the same sums.
template <int KIND, bool SF16, bool WIDE, bool PURE>
__device__ __forceinline__ void split_tiles(const DevExpert& d, const WeightRef* const (&w)[2],
                                            const int64_t (&rows)[2], const FewB& b, int64_t cols,
                                            int scale_stage, int stage_host, float (&acc)[2][4],
                                            bool wait = false) {
  using L = Layout<KIND, WIDE>;
  constexpr int kPerChunk = kChunk / (16 * L::kWords);
  extern __shared__ __align__(16) char split_smem[];
  const int parts = int(blockDim.x) / 32, p = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int lines = row_lines(cols, bits_of(KIND));
  const int c0 = p * lines / parts, c1 = (p + 1) * lines / parts;
  char* const sc = split_smem + parts * kStages * 2 * kTileChunk;
  float* const sums = reinterpret_cast<float*>(sc + 4 * scale_stage);
  if (PURE || (stage_host && staged(d))) {
    lane_tiles_staged<KIND, SF16, WIDE, 2, true>(w, rows, b, cols, c0, c1,
                                           split_smem + p * kStages * 2 * kTileChunk, sc,
                                           scale_stage, acc, wait);
  } else {
    const int kbs = int(cols / L::kCols);
    lane_tiles<KIND, SF16, WIDE, 2>(w, rows, b, min(c0 * kPerChunk, kbs), min(c1 * kPerChunk, kbs),
                                    acc, wait);
  }
  if (p > 0)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) sums[((p - 1) * 8 + t * 4 + i) * 32 + lane] = acc[t][i];
  __syncthreads();
  if (p == 0)
    for (int q = 1; q < parts; ++q)
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] += sums[((q - 1) * 8 + t * 4 + i) * 32 + lane];
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

// This lane's sums of the two tiles of expert d's matrices w (lane_tiles), through the warp's
// staging when the launch has it (STAGED) and d is read in place.
template <int KIND, bool SF16, bool WIDE, bool STAGED>
__device__ __forceinline__ void expert_tiles(const DevExpert& d, const WeightRef* const (&w)[2],
                                             const int64_t (&rows)[2], const FewB& b, int64_t cols,
                                             int scale_stage, float (&acc)[2][4],
                                             bool wait = false) {
  if (STAGED && staged(d)) {
    extern __shared__ __align__(16) char stage_smem[];
    char* mine = stage_smem + (int(threadIdx.x) / 32) * staged_warp_bytes(2, scale_stage);
    lane_tiles_staged<KIND, SF16, WIDE, 2, false>(w, rows, b, cols, 0, row_lines(cols, bits_of(KIND)),
                                                  mine, mine + kStages * 2 * kTileChunk,
                                                  scale_stage, acc, wait);
  } else {
    lane_tiles<KIND, SF16, WIDE, 2>(w, rows, b, 0, int(cols / Layout<KIND, WIDE>::kCols), acc, wait);
  }
}

// The token whose x gate/up's item row r0 + r multiplies.
__device__ __forceinline__ int64_t gate_up_token(const ExactArgs& a, int r0, int r) {
  return int64_t(a.e.g.row_token[r0 + r] / a.e.k);
}

// The item's hidden rows act(gate, up) of this lane's outputs of 16 rows from `row` (acc[0] the
// gate's sums, acc[1] the up's).
__device__ __forceinline__ void write_hidden(const ExactArgs& a, const DevExpert& d, int64_t row,
                                             int r0, int nt, const float (&acc)[2][4]) {
  for_each_lane_output(row, nt, a.e.inter, [&](int i, int tok, int64_t r) {
    const float inv = a.in.inv[gate_up_token(a, r0, tok)];
    const float gv = acc[0][i] * inv + (d.gate_bias ? d.gate_bias[r] : 0.0f);
    const float uv = acc[1][i] * inv + (d.up_bias ? d.up_bias[r] : 0.0f);
    a.e.hidden[int64_t(r0 + tok) * a.e.inter + r] =
        gated_activation(gv, uv, a.e.clamped, a.e.limit, a.e.alpha);
  });
}

// The item's down rows of this lane's outputs of the tiles from rows[0] and rows[1].
__device__ __forceinline__ void write_down(const ExactArgs& a, const DevExpert& d,
                                           const int64_t (&rows)[2], int r0, int nt,
                                           const float (&acc)[2][4]) {
#pragma unroll
  for (int t = 0; t < 2; ++t)
    for_each_lane_output(rows[t], nt, a.e.dim, [&](int i, int tok, int64_t r) {
      a.e.y[int64_t(r0 + tok) * a.e.dim + r] =
          acc[t][i] * a.in.inv[r0 + tok] + (d.down_bias ? d.down_bias[r] : 0.0f);
    });
}

// A block of 4 warps takes 64 rows of gate and up (a warp 16 of each) of one item.
template <int KIND, bool SF16, bool WIDE, bool STAGED>
__global__ void __launch_bounds__(kLaneThreads, 3)
    gate_up_lanes_kernel(ExactArgs a, int scale_stage) {
  int e, r0, nt;
  if (!block_work<kFewLaneRows>(a, e, r0, nt)) return;
  const int64_t row = int64_t(blockIdx.x) * (16 * kLaneWarps) + 16 * (int(threadIdx.x) / 32);
  if (row >= a.e.inter) return;
  const DevExpert& d = a.e.table[e];
  const FewB b = item_b<KIND, WIDE>(a.in, nt, [&](int r) { return gate_up_token(a, r0, r); });
  const WeightRef* const w[2] = {&d.gate, &d.up};
  const int64_t rows[2] = {row, row};
  float acc[2][4] = {};
  expert_tiles<KIND, SF16, WIDE, STAGED>(d, w, rows, b, a.e.dim, scale_stage, acc);
  write_hidden(a, d, row, r0, nt, acc);
}

// A block of 4 warps takes 128 rows of down (a warp two tiles of 16) of one item.
template <int KIND, bool SF16, bool WIDE, bool STAGED>
__global__ void __launch_bounds__(kLaneThreads, 3) down_lanes_kernel(ExactArgs a, int scale_stage) {
  int e, r0, nt;
  const bool early = a.e.down_early;
  if (!block_work<kFewLaneRows>(a, e, r0, nt, early)) return;
  const int64_t row = int64_t(blockIdx.x) * (32 * kLaneWarps) + 32 * (int(threadIdx.x) / 32);
  if (row >= a.e.dim) return;
  const DevExpert& d = a.e.table[e];
  const FewB b = item_b<KIND, WIDE>(a.in, nt, [&](int r) { return int64_t(r0 + r); });
  const WeightRef* const w[2] = {&d.down, &d.down};
  const int64_t rows[2] = {row, row + 16};
  float acc[2][4] = {};
  expert_tiles<KIND, SF16, WIDE, STAGED>(d, w, rows, b, a.e.inter, scale_stage, acc, early);
  write_down(a, d, rows, r0, nt, acc);
}

// gate_up_lanes_kernel with a block's columns split across its warps (split_tiles): a block of
// S warps takes 16 rows of gate and of up of one item. PURE: every expert of the layer staged.
template <int KIND, bool SF16, bool WIDE, bool PURE>
__global__ void __launch_bounds__(kLaneThreads, PURE ? 4 : 3)
    gate_up_split_kernel(ExactArgs a, int scale_stage, int stage_host) {
  int e, r0, nt;
  if (!block_work<kFewLaneRows>(a, e, r0, nt)) return;
  const int64_t row = int64_t(blockIdx.x) * 16;
  const DevExpert& d = a.e.table[e];
  const FewB b = item_b<KIND, WIDE>(a.in, nt, [&](int r) { return gate_up_token(a, r0, r); });
  const WeightRef* const w[2] = {&d.gate, &d.up};
  const int64_t rows[2] = {row, row};
  float acc[2][4] = {};
  split_tiles<KIND, SF16, WIDE, PURE>(d, w, rows, b, a.e.dim, scale_stage, stage_host, acc);
  if (threadIdx.x >= 32) return;
  write_hidden(a, d, row, r0, nt, acc);
}

// down_lanes_kernel the same way: a block of S warps takes 32 rows of down of one item.
template <int KIND, bool SF16, bool WIDE, bool PURE>
__global__ void __launch_bounds__(kLaneThreads, PURE ? 4 : 3)
    down_split_kernel(ExactArgs a, int scale_stage, int stage_host) {
  int e, r0, nt;
  const bool early = a.e.down_early;
  if (!block_work<kFewLaneRows>(a, e, r0, nt, early)) return;
  const int64_t row = int64_t(blockIdx.x) * 32;
  const DevExpert& d = a.e.table[e];
  const FewB b = item_b<KIND, WIDE>(a.in, nt, [&](int r) { return int64_t(r0 + r); });
  const WeightRef* const w[2] = {&d.down, &d.down};
  const int64_t rows[2] = {row, row + 16};
  float acc[2][4] = {};
  split_tiles<KIND, SF16, WIDE, PURE>(d, w, rows, b, a.e.inter, scale_stage, stage_host, acc,
                                      early);
  if (threadIdx.x >= 32) return;
  write_down(a, d, rows, r0, nt, acc);
}

// --- down as a stream of items ---
// A warp takes two tiles of 16 rows (32 rows) of down over all their lines (3 for q4 over 768
// columns, too few to split across warps with two lines in flight each), a block four such warps
// (128 rows). The grid holds about the blocks the SMs do at once, and block (x, y) takes row block
// x of items y, y + gridDim.y, ... of the work plan, each warp's lines of the next item following
// this item's through its ring, with each item's scales and biases staged by the warp into one of
// two buffers. The sums are the split kernel's, bit for bit: the warp sums the split kernel's
// parts of the lines apart and adds them in warp order. Against down_split_kernel (ncu, p4q's
// 8-stream step, session 40): 11% fewer instructions (no sums through shared memory, no block
// barrier) and 12-19% less time. Needs every expert of the layer staged, one format, and rows of at
// least kStages lines (the next item's scales are issued after this item's first line).
inline int down_stream_smem_bytes(int scale_stage) {
  return kLaneWarps * (kStages * 2 * kTileChunk + 2 * 4 * scale_stage);
}

template <int KIND, bool SF16, bool WIDE>
__global__ void __launch_bounds__(kLaneThreads, 4)
    down_stream_kernel(ExactArgs a, int scale_stage) {
  extern __shared__ __align__(16) char stream_smem[];
  const bool early = a.e.down_early;
  if (!early) follow_prior_grid();  // the plan (else older than the kernel before) and x
  const int p = int(threadIdx.x) / 32;
  const int per = row_lines(a.e.inter, bits_of(KIND));  // lines a row
  const int parts = k_parts(per);  // the split kernel's, whose sums these equal
  char* const ring = stream_smem + p * (kStages * 2 * kTileChunk + 8 * scale_stage);
  char* const scales = ring + kStages * 2 * kTileChunk;  // [2][4 * scale_stage]
  const int n_work = *a.n_work;
  const int64_t row = int64_t(blockIdx.x) * (32 * kLaneWarps) + 32 * p,
                row_bytes = a.e.inter * bits_of(KIND) / 8;
  const int64_t rows[2] = {row, row + 16};
  auto item = [&](int k, int& e, int& r0, int& nt) {
    const int i = int(blockIdx.y) + k * int(gridDim.y);
    if (i >= n_work || row >= a.e.dim) return false;
    const int2 w = a.work[i];
    e = a.e.g.active[w.x];
    r0 = a.e.g.offset[w.x] + w.y;
    nt = min(kFewLaneRows, a.e.g.offset[w.x + 1] - r0);
    return true;
  };
  auto issue = [&](int s) {
    int e, r0, nt;
    if (item(s / per, e, r0, nt)) {
      const DevExpert& d = a.e.table[e];
      const WeightRef* const w[2] = {&d.down, &d.down};
      if (s % per == 0)
        stage_scales<2, false>(w, rows, scales + (s / per % 2) * 4 * scale_stage, scale_stage);
      stage_line<2>(staged_tiles<2>(w, rows, row_bytes), s % per,
                    ring + (s % kStages) * 2 * kTileChunk);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages; ++s) issue(s);
  if (early) follow_prior_grid();  // x is the kernel before's
  int e, r0, nt;
  for (int k = 0; item(k, e, r0, nt); ++k) {
    const DevExpert& d = a.e.table[e];
    const WeightRef* const w[2] = {&d.down, &d.down};
    const FewB b = item_b<KIND, WIDE>(a.in, nt, [&](int r) { return int64_t(r0 + r); });
    const char* const sc = scales + (k % 2) * 4 * scale_stage;
    const StagedTiles<2> tiles = staged_tiles<2>(w, rows, row_bytes);
    float acc[2][4] = {}, part[2][4] = {};
    for (int q = 0, o = 0; q < per; ++q) {
      const int s = k * per + q;
      cp_async_wait<kStages - 1>();
      __syncwarp();
      staged_line_products<KIND, SF16, WIDE, 2>(tiles, b, a.e.inter, q,
                                                ring + (s % kStages) * 2 * kTileChunk, sc,
                                                scale_stage, part);
      __syncwarp();
      issue(s + kStages);
      if (q + 1 == (o + 1) * per / parts) {  // the end of the split kernel's part o
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            acc[t][i] = o == 0 ? part[t][i] : acc[t][i] + part[t][i];
            part[t][i] = 0.0f;
          }
        ++o;
      }
    }
    write_down(a, d, rows, r0, nt, acc);
  }
  cp_async_wait<0>();
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

namespace {

// Launches K<false> (smem 0), or K<true> with each warp's staging when the call may read experts
// in place and that fits.
template <auto Plain, auto Staged>
void launch_lanes(const ExactArgs& a, dim3 grid, int64_t cols, int group_shift, bool in_place,
                  cudaStream_t s) {
  const int scale_stage = scale_stage_bytes(cols, group_shift);
  const int smem = kLaneWarps * staged_warp_bytes(2, scale_stage);
  if (in_place && smem <= kMaxStagedBlockBytes) {
    allow_smem<Staged>(size_t(smem));
    launch(Staged, grid, kLaneThreads, size_t(smem), s, a, scale_stage);
  } else {
    launch(Plain, grid, kLaneThreads, 0, s, a, 0);
  }
}

// MOESTREAM_CUDA_EXPERT_SPLIT: 0 the blocks of whole rows (for comparison), "mixed" the split
// kernels that check each expert (the tests: their direct loads against the staging), else the
// split kernels. Read at each call (the GPU tests set it).
int split_mode() {
  const char* v = std::getenv("MOESTREAM_CUDA_EXPERT_SPLIT");
  const std::string_view s = v ? v : "";
  return s == "0" ? 0 : s == "mixed" ? 2 : 1;
}

// Launches a split kernel over row blocks x items, Pure where every expert of the layer is
// aligned for the staging (ExpertBatch::staged_aligned), else Mixed, which stages the experts read
// in place when in_place (ExpertBatch::in_place); false (nothing launched) when split_mode() is 0
// or its shared memory would not fit kMaxStagedBlockBytes.
template <auto Pure, auto Mixed>
bool launch_split(const ExactArgs& a, unsigned row_blocks, unsigned items, int64_t cols, int bits,
                  int group_shift, bool aligned, bool in_place, cudaStream_t s) {
  const int parts = k_parts(row_lines(cols, bits));
  const int scale_stage = scale_stage_bytes(cols, group_shift);
  const int smem = split_smem_bytes(parts, scale_stage);
  const int mode = split_mode();
  if (mode == 0 || smem > kMaxStagedBlockBytes) return false;
  const dim3 grid(row_blocks, items);
  if (aligned && mode == 1) {
    allow_smem<Pure>(size_t(smem));
    launch(Pure, grid, unsigned(32 * parts), size_t(smem), s, a, scale_stage, 1);
  } else {
    allow_smem<Mixed>(size_t(smem));
    launch(Mixed, grid, unsigned(32 * parts), size_t(smem), s, a, scale_stage, int(in_place));
  }
  return true;
}

std::atomic<uint64_t> down_streams{0};  // launches of down_stream_kernel (the tests)

// MOESTREAM_CUDA_DOWN_STREAM: 0 down's split kernel (for comparison); "all" a block an item
// (no stream, for comparison); a number above 1 caps the grid's item rows (the tests: many items a
// block). Read at each call.
int down_stream_mode(unsigned held_rows, unsigned items) {
  const char* v = std::getenv("MOESTREAM_CUDA_DOWN_STREAM");
  const std::string_view s = v ? v : "";
  if (s == "0") return 0;
  if (s == "all") return int(items);
  const int cap = v ? std::atoi(v) : 0;
  return int(cap > 1 ? std::min(held_rows, unsigned(cap)) : held_rows);
}

// Launches down_stream_kernel where it applies (above) over row blocks x item rows; false
// (nothing launched) where not, or where the split kernels are off (split_mode()).
template <int KIND, bool SF16, bool WIDE>
bool launch_down_stream(const ExactArgs& a, unsigned items, int group_shift, bool aligned,
                        cudaStream_t s) {
  const int lines = row_lines(a.e.inter, bits_of(KIND));
  const int scale_stage = scale_stage_bytes(a.e.inter, group_shift);
  const int smem = down_stream_smem_bytes(scale_stage);
  if (split_mode() != 1 || !aligned || a.e.only_formats >= 0 || lines < kStages ||
      smem > kMaxStagedBlockBytes)
    return false;
  constexpr auto kernel = down_stream_kernel<KIND, SF16, WIDE>;
  thread_local int sized = 0, per_sm = 1;  // the bytes per_sm is for (each thread its own)
  if (smem != sized) {
    allow_smem<kernel>(size_t(smem));
    MS_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kLaneThreads, size_t(smem)));
    sized = smem;
  }
  const unsigned row_blocks = blocks_for(a.e.dim, 32 * kLaneWarps);
  const unsigned held = unsigned(std::max(1, per_sm)) * unsigned(sm_count());
  const int rows = down_stream_mode(std::max(1u, held / row_blocks), items);
  if (rows == 0) return false;
  launch(kernel, dim3(row_blocks, std::min(items, unsigned(rows))), kLaneThreads, size_t(smem), s,
         a, scale_stage);
  down_streams.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace

uint64_t down_stream_launches() { return down_streams.load(std::memory_order_relaxed); }

void gate_up_few_lanes(const ExactArgs& a, FormatTag t, int group_shift, unsigned items,
                       bool in_place, bool aligned, cudaStream_t s) {
  dispatch_lanes(t, group_shift, a.e.dim, [&]<int KIND, bool SF16, bool WIDE>() {
    if (launch_split<gate_up_split_kernel<KIND, SF16, WIDE, true>,
                     gate_up_split_kernel<KIND, SF16, WIDE, false>>(
            a, blocks_for(a.e.inter, 16), items, a.e.dim, bits_of(KIND), group_shift, aligned,
            in_place, s))
      return;
    launch_lanes<gate_up_lanes_kernel<KIND, SF16, WIDE, false>,
                 gate_up_lanes_kernel<KIND, SF16, WIDE, true>>(
        a, dim3(blocks_for(a.e.inter, 16 * kLaneWarps), items), a.e.dim, group_shift, in_place, s);
  });
}

void down_few_lanes(const ExactArgs& a, FormatTag t, int group_shift, unsigned items, bool in_place,
                    bool aligned, cudaStream_t s) {
  dispatch_lanes(t, group_shift, a.e.inter, [&]<int KIND, bool SF16, bool WIDE>() {
    if (launch_down_stream<KIND, SF16, WIDE>(a, items, group_shift, aligned, s)) return;
    if (launch_split<down_split_kernel<KIND, SF16, WIDE, true>,
                     down_split_kernel<KIND, SF16, WIDE, false>>(
            a, blocks_for(a.e.dim, 32), items, a.e.inter, bits_of(KIND), group_shift, aligned,
            in_place, s))
      return;
    launch_lanes<down_lanes_kernel<KIND, SF16, WIDE, false>,
                 down_lanes_kernel<KIND, SF16, WIDE, true>>(
        a, dim3(blocks_for(a.e.dim, 32 * kLaneWarps), items), a.e.inter, group_shift, in_place, s);
  });
}

}  // namespace moestream::cuda
