// Quantized linear layers of 2 to kGemvMaxTokens tokens (a batched decode step) on the tensor
// cores, to float32 accuracy as the exact prefill kernels (expert_exact_mma.cu): the codes, exact
// in FP16, times the tokens' x split into two FP16 halves (split_rows.cuh), the groups' scales and
// biases applied in float32. The GEMV of several tokens on the CUDA cores issues one FMA per code
// and token and was bound by issuing them (docs/PERFORMANCE.md, session 23); here one m16n8k16
// product covers 16 rows x 16 columns x 8 tokens.
//
// The tile kernel (gemv_few_mma_kernel) has no shared memory for the operands: each lane decodes
// its own codes straight into its A fragments (few_mma.cuh). A block owns 16 rows of a matrix;
// its 8 warps (16 for a launch of one wave and many k-blocks: few_warps) take the k-blocks in
// turn, each keeping the words of its next kPrefetch k-blocks in flight, and the warps' sums are
// added in a fixed order at the end (the result does not depend on timing).
//
// A launch of more such blocks than the device has SMs (q/k/v and the LM head at 2-8 tokens:
// few_rows_take) goes through gemv_few_rows_kernel instead: a grid that stays, whose blocks copy
// units of two tiles (32 rows of words, scales and biases) into shared memory a unit ahead, in
// 16-byte pieces of whole rows, and take them in turn with the tile kernel's warps, k-blocks and
// order of sums (so the same rows bit for bit), each warp loading a k-block's x once for both
// tiles. The tile kernel's blocks issue their loads at their start and then wait a whole memory
// latency with nothing else in flight (ncu on the head at 8 tokens: 38% of its stalls on the
// first word's decode, DRAM 26% busy), and its lanes' 8- and 2-byte loads, with x loaded again for
// every tile, keep L1 74% busy (docs/PERFORMANCE.md, sessions 32-34).
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>

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

// The matrix of a launch's tile (or, in the rows kernel, unit) number t: a.first_tile numbers them.
__device__ __forceinline__ int matrix_of(const FewArgs& a, unsigned t) {
  int m = 0;
  while (m + 1 < a.n && t >= a.first_tile[m + 1]) ++m;
  return m;
}

// This lane's sums of 16 rows of w (rows row0 + g, + 8; tokens 2j, 2j + 1, as the m16n8
// accumulator holds them) over the k-blocks of its warp: warp, warp + WARPS, ...; the codes of
// the next kPrefetch k-blocks in flight. The kernel's wait for the one before comes after the
// first weight loads (nothing before it reads what that kernel writes).
template <int KIND, bool SF16, bool WIDE, int WARPS>
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
    const int kb = warp + i * WARPS;
    if (kb < kbs)
#pragma unroll
      for (int r = 0; r < 2; ++r) load_block<L::kWords>(rp[r], kb, kb * L::kCols, w, raw[i][r]);
  }
  wait_prior_grid();  // x was split by the kernel before
  allow_next_grid();
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int base = warp; base < kbs; base += kPrefetch * WARPS) {
#pragma unroll
    for (int i = 0; i < kPrefetch; ++i) {
      const int kb = base + i * WARPS;
      if (kb >= kbs) break;
      XBlock<KIND, WIDE> xb;
      xb.load(b, kb);
      uint32_t ha[L::kPairs], hb[L::kPairs];
      code_pairs<KIND, L::kWords>(raw[i][0].words, ha);
      code_pairs<KIND, L::kWords>(raw[i][1].words, hb);
      const float scale[2] = {scale_value<SF16>(raw[i][0].scale), scale_value<SF16>(raw[i][1].scale)};
      const float bias[2] = {scale_value<SF16>(raw[i][0].bias), scale_value<SF16>(raw[i][1].bias)};
      const int next = kb + kPrefetch * WARPS;
      if (next < kbs)
#pragma unroll
        for (int r = 0; r < 2; ++r) load_block<L::kWords>(rp[r], next, next * L::kCols, w, raw[i][r]);
      add_block<KIND, WIDE>(ha, hb, xb, scale, bias, acc);
    }
  }
  return make_float4(acc[0], acc[1], acc[2], acc[3]);
}

// This lane's B operands (FewB): token g's split x of `cols` columns (none past a.T), the pack sums
// of tokens 2j and 2j + 1.
template <int KIND, bool WIDE>
__device__ __forceinline__ FewB few_b(const FewArgs& a, int64_t cols) {
  using L = Layout<KIND, WIDE>;
  const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4, T = a.T;
  FewB b;
  b.hi = g < T ? a.in.hi + g * cols + j * L::kCodes : nullptr;
  b.lo = g < T ? a.in.lo + g * cols + j * L::kCodes : nullptr;
  b.sum0 = a.in.sum + int64_t(min(2 * j, T - 1)) * a.in.sum_stride;
  b.sum1 = a.in.sum + int64_t(min(2 * j + 1, T - 1)) * a.in.sum_stride;
  return b;
}

// Rows row0 + g and + 8 of matrix m's output for this lane's tokens 2j, 2j + 1: the WARPS warps'
// sums of the tile (sums[k * 32 + lane] is warp k's) added in warp order, the split's scaling
// undone, the bias added.
template <int WARPS>
__device__ __forceinline__ void write_few_rows(const FewArgs& a, int m, int64_t row0, const float4* sums) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
  float4 t = sums[lane];
#pragma unroll
  for (int k = 1; k < WARPS; ++k) {
    const float4 p = sums[k * 32 + lane];
    t.x += p.x; t.y += p.y; t.z += p.z; t.w += p.w;
  }
  const float v[4] = {t.x, t.y, t.z, t.w};
  const float* bias = a.bias[m];
  float* out = a.out[m];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int tok = 2 * j + (i & 1);
    const int64_t row = row0 + g + (i < 2 ? 0 : 8);
    if (tok < a.T && row < a.w[m].rows)
      out[int64_t(tok) * a.ldo[m] + row] = v[i] * a.in.inv[tok] + (bias ? bias[row] : 0.0f);
  }
}

// WARPS = 8 (2 blocks an SM), or 16 (1) for a matrix of one wave and many k-blocks (few_warps).
template <int KIND, bool SF16, bool WIDE, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, 16 / WARPS) gemv_few_mma_kernel(FewArgs a) {
  __shared__ float4 partial[WARPS][32];
  const int m = matrix_of(a, blockIdx.x);
  const WeightRef& w = a.w[m];
  const int lane = int(threadIdx.x) % 32;
  const int64_t row0 = int64_t(blockIdx.x - a.first_tile[m]) * kFewRows;
  const int warp = int(threadIdx.x) / 32;
  partial[warp][lane] = few_tile<KIND, SF16, WIDE, WARPS>(w, row0, few_b<KIND, WIDE>(a, w.cols));
  __syncthreads();
  if (warp == 0) write_few_rows<WARPS>(a, m, row0, &partial[0][0]);
}

// The rows kernel's units in shared memory: kRowStages of them, each kUnitRows rows of words (each
// row padded by 32 bytes, so that rows g and g + 1 of a lane group fall 8 banks apart), then as
// many rows of scales and of biases (padded by 16 bytes); then the warps' sums of two units.
constexpr int kRowStages = 2;
constexpr int kRowTiles = 2;                     // tiles a stage: each warp loads x once for both
constexpr int kUnitRows = kRowTiles * kFewRows;  // rows a stage
struct RowsGeometry {
  int row_bytes = 0, word_stride = 0;  // a row's words; between rows in a stage
  int scale_bytes = 0, scale_stride = 0;
  int stage_bytes = 0;
};

RowsGeometry rows_geometry(const WeightRef& w, int bits) {
  RowsGeometry g;
  g.row_bytes = int(w.cols * bits / 8);
  g.word_stride = g.row_bytes + 32;
  g.scale_bytes = int(w.groups_per_row * 2);
  g.scale_stride = g.scale_bytes + 16;
  g.stage_bytes = kUnitRows * (g.word_stride + 2 * g.scale_stride);
  return g;
}
size_t rows_smem_bytes(const RowsGeometry& g) {
  return size_t(kRowStages) * size_t(g.stage_bytes) + 2 * size_t(kRowTiles * kFewWarps) * 32 * sizeof(float4);
}

// Copies unit u's rows (a row past the matrix repeats its last, as the tile kernel reads) into a
// stage in 16-byte pieces: kFewThreads / kUnitRows threads a row, each taking every such piece of
// its row's words, then of its scales and biases, so a thread's row and addresses are worked out
// once a unit (a piece numbered across the unit cost a division by the row's pieces, which made
// the copy ~a third of the kernel's instructions). a.first_tile counts units here.
constexpr int kCopyLanes = kFewThreads / kUnitRows;  // threads copying one row
static_assert(kFewThreads % kUnitRows == 0);
__device__ __forceinline__ void copy_unit(const FewArgs& a, const RowsGeometry& geo, unsigned u,
                                          unsigned char* stage) {
  const int m = matrix_of(a, u);
  const WeightRef& w = a.w[m];
  const int r = int(threadIdx.x) / kCopyLanes, k = int(threadIdx.x) % kCopyLanes;
  const int64_t row = min(int64_t(u - a.first_tile[m]) * kUnitRows + r, w.rows - 1);
  // this thread's pieces of the row of one array
  auto copy = [&](unsigned char* to, const void* array, int bytes) {
    const unsigned char* from = static_cast<const unsigned char*>(array) + row * bytes;
    for (int q = 16 * k; q < bytes; q += 16 * kCopyLanes) cp_async16(to + q, from + q, 16);
  };
  unsigned char* const scales = stage + kUnitRows * geo.word_stride;
  copy(stage + r * geo.word_stride, w.data, geo.row_bytes);
  copy(scales + r * geo.scale_stride, w.scales, geo.scale_bytes);
  copy(scales + (kUnitRows + r) * geo.scale_stride, w.biases, geo.scale_bytes);
}

template <int KIND, bool SF16, bool WIDE>
__global__ void __launch_bounds__(kFewThreads, 2) gemv_few_rows_kernel(FewArgs a, RowsGeometry geo) {
  using L = Layout<KIND, WIDE>;
  constexpr int kBlockBytes = L::kCols * bits_of(KIND) / 8;  // a row's bytes of one k-block
  extern __shared__ __align__(16) unsigned char rows_smem[];
  float4* partial = reinterpret_cast<float4*>(rows_smem + kRowStages * geo.stage_bytes);  // [2][tiles][warps][32]
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, j = lane % 4;
  const unsigned units = a.first_tile[a.n];  // numbered by units of kRowTiles tiles
#pragma unroll 1
  for (int s = 0; s < kRowStages - 1; ++s) {  // the first units, a group each (empty past the last)
    const unsigned u = blockIdx.x + unsigned(s) * gridDim.x;
    if (u < units) copy_unit(a, geo, u, rows_smem + s * geo.stage_bytes);
    cp_async_commit();
  }
  wait_prior_grid();  // x was split by the kernel before
  allow_next_grid();
  const int64_t cols = a.w[0].cols;  // the matrices share x
  const int kbs = int(cols / L::kCols);
  const FewB b = few_b<KIND, WIDE>(a, cols);
  // Warp i writes tile i of unit u at the next unit's barrier (the warps' sums in `partial` by then).
  auto write_tile = [&](unsigned u, int buf) {
    const int m = matrix_of(a, u);
    write_few_rows<kFewWarps>(a, m, int64_t(u - a.first_tile[m]) * kUnitRows + kFewRows * warp,
                   partial + (buf * kRowTiles + warp) * kFewWarps * 32);
  };
  int stage = 0, done = 0;  // units this block has taken
#pragma unroll 1
  for (unsigned u = blockIdx.x; u < units; u += gridDim.x, ++done) {
    cp_async_wait<kRowStages - 2>();
    __syncthreads();  // unit u is in; every warp is done with the stage refilled below and with partial[done & 1]
    if (warp < kRowTiles && done > 0) write_tile(u - gridDim.x, (done - 1) & 1);
    const unsigned ahead = u + unsigned(kRowStages - 1) * gridDim.x;
    const int refill = stage == 0 ? kRowStages - 1 : stage - 1;
    if (ahead < units) copy_unit(a, geo, ahead, rows_smem + refill * geo.stage_bytes);
    cp_async_commit();
    const WeightRef& w = a.w[matrix_of(a, u)];
    const unsigned char* words = rows_smem + stage * geo.stage_bytes;
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(words + kUnitRows * geo.word_stride);
    const uint16_t* biases = scales + kUnitRows * geo.scale_stride / 2;
    const int srow = geo.scale_stride / 2;
    float acc[kRowTiles][4] = {};
#pragma unroll 1
    for (int kb = warp; kb < kbs; kb += kFewWarps) {
      XBlock<KIND, WIDE> xb;
      xb.load(b, kb);
      const int group = (kb * L::kCols) >> w.group_shift;
#pragma unroll
      for (int t2 = 0; t2 < kRowTiles; ++t2) {
        RawBlock<L::kWords> raw[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = kFewRows * t2 + g + 8 * r;
          const unsigned char* p = words + row * geo.word_stride + kb * kBlockBytes + j * L::kWords * 4;
          if constexpr (L::kWords == 2) {
            const uint2 v = *reinterpret_cast<const uint2*>(p);
            raw[r].words[0] = v.x;
            raw[r].words[1] = v.y;
          } else {
            raw[r].words[0] = *reinterpret_cast<const uint32_t*>(p);
          }
          raw[r].scale = scales[row * srow + group];
          raw[r].bias = biases[row * srow + group];
        }
        uint32_t ha[L::kPairs], hb[L::kPairs];
        code_pairs<KIND, L::kWords>(raw[0].words, ha);
        code_pairs<KIND, L::kWords>(raw[1].words, hb);
        const float scale[2] = {scale_value<SF16>(raw[0].scale), scale_value<SF16>(raw[1].scale)};
        const float bias[2] = {scale_value<SF16>(raw[0].bias), scale_value<SF16>(raw[1].bias)};
        add_block<KIND, WIDE>(ha, hb, xb, scale, bias, acc[t2]);
      }
    }
#pragma unroll
    for (int t2 = 0; t2 < kRowTiles; ++t2)
      partial[(((done & 1) * kRowTiles + t2) * kFewWarps + warp) * 32 + lane] =
          make_float4(acc[t2][0], acc[t2][1], acc[t2][2], acc[t2][3]);
    stage = stage + 1 == kRowStages ? 0 : stage + 1;
  }
  cp_async_wait_all();
  __syncthreads();
  if (warp < kRowTiles && done > 0) write_tile(blockIdx.x + unsigned(done - 1) * gridDim.x, (done - 1) & 1);
}

// The tile kernel's warps a block: 16 for a launch of at most one block an SM (its matrices' tiles
// together) and at least 64 k-blocks (o_proj at 2-8 tokens: each warp's chain of k-blocks halved,
// 16 warps an SM instead of 8), else 8. The sums are added in another order, so the rows differ
// from 8 warps' by float32 rounding. MOESTREAM_CUDA_FEW_WARPS=8: always 8, for comparison (any
// other value: the rule). Read at each call (the GPU tests set it).
int few_warps(unsigned tiles, int kbs, int sms) {
  if (tiles > unsigned(sms) || kbs < 64) return 8;
  const char* v = std::getenv("MOESTREAM_CUDA_FEW_WARPS");
  return v && std::string_view(v) == "8" ? 8 : 16;
}

// Whether a launch of `tiles` tiles (its matrices' together) takes the rows kernel: where it has
// more tiles than the device has SMs, so that the tile kernel would run more than one block of 8
// warps an SM (q/k/v and the LM head at 2-8 tokens; o_proj's 128 tiles take the tile kernel's 16
// warps). MOESTREAM_CUDA_FEW_ROWS: 0 never, 2 for every launch it fits (tests), "head" only for
// launches of more than four waves of tile blocks (the rule before session 34, for comparison).
// Read at each call (the GPU tests set it).
bool few_rows_take(unsigned tiles, int sms) {
  const char* v = std::getenv("MOESTREAM_CUDA_FEW_ROWS");
  const std::string_view s = v ? v : "";
  if (s == "0" || s == "2") return s == "2";
  return tiles > unsigned(s == "head" ? 4 * 2 * sms : sms);
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

bool few_rows_fit(std::span<const Matrix* const> mats) {
  if (mats.empty()) return false;
  const WeightRef w0 = weight_ref(*mats[0]);
  const RowsGeometry geo = rows_geometry(w0, bits_of(format_of(*mats[0]).kind));
  // at most 110 KiB (two blocks an SM on sm_90), and what a block may have (99 KiB on sm_86/89)
  bool fit = geo.row_bytes % 16 == 0 && geo.scale_bytes % 16 == 0 &&
             rows_smem_bytes(geo) <= std::min<size_t>(110 * 1024, max_gemv_smem());
  for (const Matrix* m : mats) {
    const WeightRef w = weight_ref(*m);
    fit = fit && w.groups_per_row == w0.groups_per_row &&
          (reinterpret_cast<uintptr_t>(w.data) | reinterpret_cast<uintptr_t>(w.scales) |
           reinterpret_cast<uintptr_t>(w.biases)) % 16 == 0;
  }
  return fit;
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
  const RowsGeometry geo = rows_geometry(a.w[0], bits_of(tag.kind));
  const bool rows_fit = few_rows_fit(mats);
  const int sms = sm_count();
  const unsigned tiles = a.first_tile[a.n];
  const bool rows = rows_fit && few_rows_take(tiles, sms);
  auto run = [&]<int KIND, bool WIDE>() {
    auto go = [&]<bool SF16>() {
      if (!rows) {
        if (few_warps(tiles, int(cols / Layout<KIND, WIDE>::kCols), sms) == 16)
          launch(gemv_few_mma_kernel<KIND, SF16, WIDE, 16>, tiles, 16 * 32, 0, s, a);
        else
          launch(gemv_few_mma_kernel<KIND, SF16, WIDE, kFewWarps>, tiles, kFewThreads, 0, s, a);
        return;
      }
      auto kernel = gemv_few_rows_kernel<KIND, SF16, WIDE>;
      const size_t bytes = rows_smem_bytes(geo);
      static size_t allowed = 0, sized = 0;  // the dynamic bytes allowed so far; those per_sm is for
      static int per_sm = 0;
      if (bytes != sized) {
        if (bytes > allowed) {
          MS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
          allowed = bytes;
        }
        MS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kFewThreads, bytes));
        sized = bytes;
      }
      FewArgs by_units = a;  // first_tile counts units of kRowTiles tiles
      for (int i = 0; i < by_units.n; ++i)
        by_units.first_tile[i + 1] = by_units.first_tile[i] + blocks_for(by_units.w[i].rows, kUnitRows);
      const unsigned units = by_units.first_tile[by_units.n];
      launch(kernel, std::min(units, unsigned(std::max(1, per_sm) * sms)), kFewThreads, bytes, s, by_units, geo);
    };
    if (tag.scale_f16) go.template operator()<true>();
    else go.template operator()<false>();
  };
  if (tag.kind == kQ8) run.template operator()<kQ8, false>();
  else if (wide) run.template operator()<kQ4, true>();
  else run.template operator()<kQ4, false>();
}

}  // namespace moestream::cuda
