// The experts of a call with more than one token on the tensor cores, to float32 accuracy
// (run_experts_exact_mma in moe.h). A quantized weight is code * scale (+ bias) per group, and the
// codes are small numbers that FP16 holds exactly: affine codes are integers below 256, MXFP4 codes
// (doubled, as everywhere here) integers up to 12, FP8 E4M3 values fit FP16's range and mantissa.
// So each group's columns are multiplied on the tensor cores as codes x activations, and the
// group's scale and bias are applied in float32 afterwards, as the CUDA-core kernels do.
//
// The activations are the inexact part. Before the products, split_kernel scales each row (a
// token's x, or an expert row's hidden values) by a power of two that puts its largest finite
// magnitude in [2^14, 2^15) and splits it into hi = fp16(x) and lo = fp16(x - hi); both halves go
// through the MMA (products of FP16 values are exact in the float32 sums) and the row's scaling is
// undone when the result is written. That keeps 22 of float32's 24 bits of every activation above
// 2^-18 of its row's largest; smaller ones keep fewer (an absolute error below 2^-39 of the row's
// largest), far below the float32 rounding of a sum that holds the largest. It also gives each
// pack of 32 columns its float32 sum, which multiplies an affine group's bias.
//
// Work items: an active expert's rows (its (token, slot) pairs) in chunks of kTok (kFewTok in a
// batched decode step, whose experts mostly have one or two rows; such a step's q4 and q8 experts
// go through expert_few_mma.cu's kernels over the same items), planned on the device
// (plan_kernel), so that a heavily chosen expert is spread over many blocks instead of one block
// walking all its rows. A block of 4 warps computes 64 output rows (16 per warp) of one work
// item: per step of 64 columns, the next step's activations are copied to shared memory with
// cp.async and its weight packs loaded into registers while the current step's products run; the
// packs are then decoded into FP16 codes in shared memory (q4 and q8 without int-to-float
// conversions: the code is placed in the mantissa of 1024.0 and 1024 subtracted). Fragments come
// from shared memory through ldmatrix; mma.sync m16n8k16, the weight rows as the A operand, the
// tokens as B, float32 accumulators per (row, token).
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "backend/cuda/expert_items.cuh"
#include "backend/cuda/few_mma.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/moe.h"
#include "backend/cuda/split_rows.cuh"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // weight rows per block
constexpr int kTok = 32;            // rows of activations (tokens) per work item ...
constexpr int kFewTok = kFewLaneRows;  // ... in a batched decode step (expert_items.cuh)
constexpr int kK = 64;              // columns per step: two packs of 32
constexpr int kSplitThreads = 128;

// Offset (in halves) of 16-byte chunk `chunk` (8 columns) of `row` in a shared [rows][kK] array:
// the chunks of each row are permuted by the row's low 3 bits, so the 8 rows an ldmatrix reads at
// one chunk lie on distinct banks without padding (which would cost the fourth block per SM).
__device__ __forceinline__ int swz(int row, int chunk) { return row * kK + ((chunk ^ (row & 7)) * 8); }

// Shared memory for one step: M matrices' codes (FP16, kRows x kK) with each (row, pack)'s scale
// and bias, and the activations of the work item's tokens (hi and lo halves, TOK x kK) with the
// sums of their two packs.
template <int M, int TOK>
struct alignas(128) Stage {
  __half codes[M][kRows * kK];  // swizzled (swz)
  __half x[2][TOK * kK];
  float scale[M][kRows][2], bias[M][kRows][2];
  float sum[TOK][2];
};

// Alignment of the kernels' shared memory and of each Stage in it.
constexpr int kSmemAlign = 128;

struct SplitArgs {
  const float* src;  // [n_rows, out.cols], row stride ld
  int64_t ld, n_rows;
  // When set, only rows [offset[a_begin], offset[end]) of the batch are split (end = *n_active
  // when counted on the device, else a_end).
  const int* offset;
  const int* n_active;
  int a_begin, a_end;
  SplitRows out;
};

// The largest of v over a block of 32 * WARPS threads; every thread gets it (one barrier).
template <int WARPS>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) v = fmaxf(v, scratch[w]);
  return v;
}

// One block per row: the row's largest finite magnitude, then 8 columns per thread scaled, split
// and stored in the format's order; 4 threads per pack of 32 sum it.
template <bool INTERLEAVED>
__global__ void __launch_bounds__(kSplitThreads) split_kernel(SplitArgs a) {
  __shared__ float scratch[kSplitThreads / 32];
  wait_prior_grid();  // x is the kernel before's output (when launched to overlap it)
  allow_next_grid();
  const int64_t r = blockIdx.x;
  if (a.offset) {
    const int end = a.n_active ? *a.n_active : a.a_end;
    if (r < a.offset[a.a_begin] || r >= a.offset[end]) return;
  }
  const int64_t cols = a.out.cols;
  const float* x = a.src + r * a.ld;
  const int tid = int(threadIdx.x);
  float mx = 0.0f;
  for (int64_t c = 4 * tid; c < cols; c += 4 * kSplitThreads) {
    const float4 v = *reinterpret_cast<const float4*>(x + c);
    mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  }
  const int shift = split_shift(block_max<kSplitThreads / 32>(mx, scratch));
  const float up = pow2(shift);
  if (tid == 0) a.out.inv[r] = pow2(-shift);
  const int64_t packs = cols / 32;
  split_row<INTERLEAVED>(x, cols, up, r, a.out);
  if (tid == 0)
    for (int64_t p = packs; p < a.out.sum_stride; ++p) a.out.sum[r * a.out.sum_stride + p] = 0.0f;
}

// The work items of a batch: (active index, first row within the expert's rows), tok rows each,
// in active order. One warp.
__global__ void plan_kernel(const int* offset, int a_begin, int a_end, const int* n_active, int tok, int2* work,
                            int* n_work) {
  wait_prior_grid();  // the groups are the kernel before's (when launched to overlap it)
  allow_next_grid();
  const int lane = int(threadIdx.x);
  const int end = n_active ? *n_active : a_end;
  int base = 0;
  for (int a0 = a_begin; a0 < end; a0 += 32) {
    const int ai = a0 + lane;
    const int rows = ai < end ? offset[ai + 1] - offset[ai] : 0;
    const int n = (rows + tok - 1) / tok;
    int incl = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    for (int i = 0, first = base + incl - n; i < n; ++i) work[first + i] = make_int2(ai, i * tok);
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) *n_work = base;
}

// A pack's 32 codes as FP16 pairs, in the format's column order.
template <int KIND, bool SF16>
__device__ __forceinline__ void codes_of(const RawQuantPack<KIND>& p, uint32_t (&h)[16]) {
  if constexpr (KIND == kQ4) {
    code_pairs<kQ4, 4>(p.words, h);  // word j's nibbles (s, s + 4) into h[4 j + s]
  } else if constexpr (KIND == kQ8) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      h[2 * j] = minus_1024(__byte_perm(p.words[j], 0x64646464u, 0x4140));
      h[2 * j + 1] = minus_1024(__byte_perm(p.words[j], 0x64646464u, 0x4342));
    }
  } else {
    float q[32], scale, bias;
    decode_raw_pack<KIND, SF16>(p, q, scale, bias);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const __half2 v = __floats2half2_rn(q[2 * i], q[2 * i + 1]);
      h[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
  }
}

template <int KIND, bool SF16>
__device__ __forceinline__ void pack_scale_bias(const RawQuantPack<KIND>& p, float& scale, float& bias) {
  if constexpr (KIND == kMxfp4) scale = mxfp4_scale(p.scale);
  else if constexpr (KIND == kFp8) scale = __uint_as_float(p.scale);
  else scale = scale_value<SF16>(uint16_t(p.scale));
  bias = is_affine(KIND) ? scale_value<SF16>(uint16_t(p.bias)) : 0.0f;
}

// This thread's share of one matrix's weights in ExactBlock: pack `hp` (0 or 1) of every step of
// its row (columns 64 s + 32 hp of step s) with the row's scales and biases, addressed once.
template <int KIND>
struct PackStream {
  static constexpr int kWords = RawQuantPack<KIND>::kWords;
  const uint32_t* words;  // the row's pack hp
  const void* scales;     // the row's first group
  const uint16_t* biases;
  int group_shift, group_size;

  __device__ __forceinline__ void init(const WeightRef& w, int64_t row, int hp) {
    words = static_cast<const uint32_t*>(w.data) + row * (w.cols * kWords / 32) + hp * kWords;
    const int64_t g0 = row * w.groups_per_row;
    if constexpr (KIND == kMxfp4) scales = static_cast<const uint8_t*>(w.scales) + g0;
    else if constexpr (KIND == kFp8) scales = static_cast<const float*>(w.scales) + g0;
    else scales = static_cast<const uint16_t*>(w.scales) + g0;
    biases = is_affine(KIND) ? w.biases + g0 : nullptr;
    group_shift = w.group_shift;
    group_size = w.group_size;
  }

  // The raw pack (words, scale and bias bits) of step s, at column col of the row.
  __device__ __forceinline__ void load(int s, int col, RawQuantPack<KIND>& r) const {
    load_words<kWords>(words + s * (2 * kWords), r.words);
    const int g = group_shift >= 0 ? col >> group_shift : col / group_size;
    if constexpr (KIND == kMxfp4) r.scale = static_cast<const uint8_t*>(scales)[g];
    else if constexpr (KIND == kFp8) r.scale = __float_as_uint(static_cast<const float*>(scales)[g]);
    else r.scale = static_cast<const uint16_t*>(scales)[g];
    if constexpr (is_affine(KIND)) r.bias = biases[g];
    else r.bias = 0;
  }
};

// One work item's 64 output rows (blockIdx.x) of M matrices sharing the input (gate and up, or
// down), over all columns; the accumulators come back in the scaled units of the input rows.
// Every address a step uses is set up once (init): the loop over the steps only adds the step's
// column, and with the two stages unrolled their shared-memory offsets are constants.
template <int KIND, bool SF16, int M, int TOK>
struct ExactBlock {
  using St = Stage<M, TOK>;
  static constexpr int kTiles = TOK / 8;  // MMA column tiles per work item
  static constexpr int kStageBytes = int(sizeof(St));
  static_assert(kStageBytes % kSmemAlign == 0 && offsetof(St, x) % kSmemAlign == 0);
  PackStream<KIND> w[M];
  int64_t row0;
  int cols, nt, tiles;
  bool merge;   // every matrix's groups span whole steps: one epilogue per step instead of per pack
  bool row_ok;  // this thread's weight row (threadIdx.x / 2) is a row of the matrices
  St* st;
  // The copies: this thread's 8 columns (hi or lo) of TOK / 8 token rows, and (threads below TOK)
  // one token's two pack sums; their shared addresses in stage 0.
  const __half* x_src[TOK / 8];
  const float* sum_src;
  uint32_t x_dst, sum_dst;
  // Shared addresses (stage 0, matrix 0) of this lane's ldmatrix rows for the first 16 columns:
  // the weight codes (A) and the activations (B, column tile 0). Those of columns 16 c on are
  // these ^ 32 c: swz places chunk 2 c + b of a row at (2 c + b) ^ (row & 7) = 2 c ^ (b ^ (row &
  // 7)), and every row starts at a multiple of 128 bytes (kSmemAlign).
  uint32_t a_addr, b_addr;
  // This thread's codes in stage 0, matrix 0: its row's first chunk and the swizzle of its packs.
  uint32_t w_dst;
  int w_swz;

  // in_row(r): the row of `in` that row r of the item (r0 <= r < r0 + nt) multiplies.
  template <class InRow>
  __device__ __forceinline__ void init(const WeightRef* const (&mats)[M], void* smem, const SplitRows& in,
                                       int64_t first_row, int r0, int n_tok, int64_t n_cols, InRow in_row) {
    const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
    row0 = first_row;
    cols = int(n_cols);
    nt = n_tok;
    tiles = (nt + 7) / 8;
    merge = cols % kK == 0;
#pragma unroll
    for (int m = 0; m < M; ++m) merge = merge && mats[m]->group_size % kK == 0;
    st = static_cast<St*>(smem);
    const uint32_t base = smem_addr(smem);
    // weights: thread t loads pack t % 2 of row t / 2 of each step
    const int r = tid / 2, hp = tid % 2;
    row_ok = row0 + r < mats[0]->rows;
#pragma unroll
    for (int m = 0; m < M; ++m) w[m].init(*mats[m], row0 + r, hp);
    w_dst = base + uint32_t(offsetof(St, codes)) + uint32_t(r * kK * 2);
    w_swz = (4 * hp) ^ (r & 7);
    // activations: thread t copies chunk t % 8 of half (t / 8) % 2 of tokens t / 16 + 8 u; rows
    // past the item's tokens copy its last token's (their products are never written)
    const int half = (tid / 8) % 2, part = tid % 8;
    const __half* src = half ? in.lo : in.hi;
#pragma unroll
    for (int u = 0; u < TOK / 8; ++u) x_src[u] = src + in_row(r0 + min(tid / 16 + 8 * u, nt - 1)) * n_cols + 8 * part;
    x_dst = base + uint32_t(offsetof(St, x) + 2 * (half * TOK * kK + swz(tid / 16, part)));
    sum_src = in.sum + in_row(r0 + min(tid % TOK, nt - 1)) * in.sum_stride;
    sum_dst = base + uint32_t(offsetof(St, sum) + (tid % TOK) * 2 * sizeof(float));
    // ldmatrix rows: A, row warp * 16 + lane % 16 at chunk lane / 16; B, half lane / 16, token
    // lane % 8 at chunk (lane / 8) % 2
    a_addr = base + uint32_t(offsetof(St, codes) + 2 * swz(warp * 16 + lane % 16, lane / 16));
    b_addr = base + uint32_t(offsetof(St, x) + 2 * ((lane / 16) * TOK * kK + swz(lane % 8, (lane / 8) % 2)));
  }

  // The activations of step s into stage ST (cp.async).
  template <int ST>
  __device__ __forceinline__ void copy_x(int s) const {
    const int k0 = s * kK;
    const bool ok = k0 + 8 * (int(threadIdx.x) % 8) < cols;
#pragma unroll
    for (int u = 0; u < TOK / 8; ++u)
      cp_async16_at(x_dst + ST * kStageBytes + u * (8 * kK * 2), x_src[u] + (ok ? k0 : 0), ok ? 16 : 0);
    if (int(threadIdx.x) < TOK) cp_async8_at(sum_dst + ST * kStageBytes, sum_src + 2 * s);
  }

  // The raw packs of this thread's (row, pack) of step s for every matrix.
  __device__ __forceinline__ bool load_w(int s, RawQuantPack<KIND> (&raw)[M]) const {
    const int col = s * kK + 32 * (int(threadIdx.x) % 2);
    const bool valid = row_ok && col < cols;
    if (valid) {
#pragma unroll
      for (int m = 0; m < M; ++m) w[m].load(s, col, raw[m]);
    }
    return valid;
  }

  template <int ST>
  __device__ __forceinline__ void store_w(const RawQuantPack<KIND> (&raw)[M], bool valid) const {
    const int r = int(threadIdx.x) / 2, hp = int(threadIdx.x) % 2;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint32_t dst = w_dst + ST * kStageBytes + m * (kRows * kK * 2);
      uint32_t h[16] = {};
      if (valid) codes_of<KIND, SF16>(raw[m], h);
#pragma unroll
      for (int i = 0; i < 4; ++i) st_shared16(dst + ((w_swz ^ i) * 16), h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
      float scale = 0.0f, bias = 0.0f;
      if (valid) pack_scale_bias<KIND, SF16>(raw[m], scale, bias);
      st[ST].scale[m][r][hp] = scale;
      st[ST].bias[m][r][hp] = bias;
    }
  }

  // acc[m][j][i] += stage ST's contribution to the warp's rows and the tokens of column tile j
  // (element i: row g + 8 * (i / 2), token 2 * q + i % 2 of the tile; g = lane / 4, q = lane % 4).
  template <int ST>
  __device__ __forceinline__ void multiply(float (&acc)[M][kTiles][4]) const {
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, q = lane % 4;
    const int rl = warp * 16 + g;
    const St& sg = st[ST];
    float c[M][kTiles][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[m][j][i] = 0.0f;
#pragma unroll
    for (int pack = 0; pack < 2; ++pack) {
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        const int cc = 2 * pack + ks;
        uint32_t a[M][4];
#pragma unroll
        for (int m = 0; m < M; ++m) ldsm4_at(a[m], (a_addr ^ (32 * cc)) + ST * kStageBytes + m * (kRows * kK * 2));
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          if (j >= tiles) break;
          uint32_t b[4];  // hi k0..7, hi k8..15, lo k0..7, lo k8..15
          ldsm4_at(b, (b_addr ^ (32 * cc)) + ST * kStageBytes + j * (8 * kK * 2));
#pragma unroll
          for (int m = 0; m < M; ++m) {
            mma16816(c[m][j], a[m], b[0], b[1]);
            mma16816(c[m][j], a[m], b[2], b[3]);
          }
        }
      }
      if (merge && pack == 0) continue;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float s0 = sg.scale[m][rl][pack], s1 = sg.scale[m][rl + 8][pack];
        const float b0 = sg.bias[m][rl][pack], b1 = sg.bias[m][rl + 8][pack];
#pragma unroll
        for (int j = 0; j < kTiles; ++j) {
          if (j >= tiles) break;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float scale = i < 2 ? s0 : s1;
            if constexpr (is_affine(KIND)) {
              const int tok = j * 8 + 2 * q + (i & 1);
              float sx;
              if (merge) {
                const float2 both = *reinterpret_cast<const float2*>(sg.sum[tok]);
                sx = both.x + both.y;
              } else {
                sx = sg.sum[tok][pack];
              }
              acc[m][j][i] += fmaf(c[m][j][i], scale, (i < 2 ? b0 : b1) * sx);
            } else {
              acc[m][j][i] = fmaf(c[m][j][i], scale, acc[m][j][i]);
            }
            c[m][j][i] = 0.0f;
          }
        }
      }
    }
  }

  // Step s from stage ST: the next step's copies and loads are issued before the products, its
  // codes decoded after them; one barrier per step.
  template <int ST>
  __device__ __forceinline__ void step(int s, int steps, RawQuantPack<KIND> (&raw)[M], float (&acc)[M][kTiles][4]) const {
    const bool more = s + 1 < steps;
    bool valid = false;
    if (more) {
      copy_x<ST ^ 1>(s + 1);
      valid = load_w(s + 1, raw);
    }
    multiply<ST>(acc);
    if (more) store_w<ST ^ 1>(raw, valid);
    cp_async_wait_all();
    __syncthreads();
  }

  __device__ __forceinline__ void run(float (&acc)[M][kTiles][4]) const {
    RawQuantPack<KIND> raw[M];
    copy_x<0>(0);
    store_w<0>(raw, load_w(0, raw));
    cp_async_wait_all();
    __syncthreads();
    const int steps = (cols + kK - 1) / kK;
    for (int s = 0; s < steps; s += 2) {
      step<0>(s, steps, raw, acc);
      if (s + 1 < steps) step<1>(s + 1, steps, raw, acc);
    }
  }
};

// f(j, i, token, row) for each of this thread's accumulator elements that is an output (token <
// nt, row < rows): column tile j, element i, at token j * 8 + 2 * (lane % 4) + i % 2 of the item
// and row row0 + 16 * warp + lane / 4 (+ 8 for i >= 2), the m16n8 accumulator layout.
template <int TOK, class F>
__device__ __forceinline__ void for_each_output(int64_t row0, int nt, int64_t rows, F f) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < TOK / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = j * 8 + 2 * q + (i & 1);
      const int64_t row = row0 + warp * 16 + g + (i < 2 ? 0 : 8);
      if (tok < nt && row < rows) f(j, i, tok, row);
    }
}

template <int KIND, bool SF16, int TOK>
__global__ void __launch_bounds__(kThreads, 3) gate_up_exact_kernel(ExactArgs a) {
  extern __shared__ __align__(kSmemAlign) unsigned char smem[];
  int e, r0, nt;
  if (!block_work<TOK>(a, e, r0, nt)) return;
  const DevExpert& d = a.e.table[e];
  ExactBlock<KIND, SF16, 2, TOK> blk;
  const WeightRef* const mats[2] = {&d.gate, &d.up};
  blk.init(mats, smem, a.in, int64_t(blockIdx.x) * kRows, r0, nt, a.e.dim,
           [&](int r) { return int64_t(a.e.g.row_token[r] / a.e.k); });
  float acc[2][TOK / 8][4] = {};
  blk.run(acc);
  for_each_output<TOK>(blk.row0, nt, a.e.inter, [&](int j, int i, int tok, int64_t row) {
    const float inv = a.in.inv[a.e.g.row_token[r0 + tok] / a.e.k];
    const float gv = acc[0][j][i] * inv + (d.gate_bias ? d.gate_bias[row] : 0.0f);
    const float uv = acc[1][j][i] * inv + (d.up_bias ? d.up_bias[row] : 0.0f);
    a.e.hidden[int64_t(r0 + tok) * a.e.inter + row] = gated_activation(gv, uv, a.e.clamped, a.e.limit, a.e.alpha);
  });
}

template <int KIND, bool SF16, int TOK>
__global__ void __launch_bounds__(kThreads, 5) down_exact_kernel(ExactArgs a) {
  extern __shared__ __align__(kSmemAlign) unsigned char smem[];
  int e, r0, nt;
  if (!block_work<TOK>(a, e, r0, nt)) return;
  const DevExpert& d = a.e.table[e];
  ExactBlock<KIND, SF16, 1, TOK> blk;
  const WeightRef* const mats[1] = {&d.down};
  blk.init(mats, smem, a.in, int64_t(blockIdx.x) * kRows, r0, nt, a.e.inter, [](int r) { return int64_t(r); });
  float acc[1][TOK / 8][4] = {};
  blk.run(acc);
  for_each_output<TOK>(blk.row0, nt, a.e.dim, [&](int j, int i, int tok, int64_t row) {
    a.e.y[int64_t(r0 + tok) * a.e.dim + row] = acc[0][j][i] * a.in.inv[r0 + tok] + (d.down_bias ? d.down_bias[row] : 0.0f);
  });
}

// Up to kMaxLinear matrices of one format and width over the same x (q, k and v): blockIdx.x
// counts the row tiles of matrix 0, then of matrix 1, ...
constexpr int kMaxLinear = 4;
struct LinearExactArgs {
  WeightRef w[kMaxLinear];
  const float* bias[kMaxLinear];  // [w.rows] or null
  float* out[kMaxLinear];         // [T, ldo]
  int64_t ldo[kMaxLinear];
  unsigned first_tile[kMaxLinear + 1];
  int n;
  SplitRows in;  // the tokens' x
  int64_t T;
};

// Dense quantized matrices over T tokens: work item blockIdx.y is tokens [32 y, 32 y + 32).
template <int KIND, bool SF16>
__global__ void __launch_bounds__(kThreads, 5) linear_exact_kernel(LinearExactArgs a) {
  extern __shared__ __align__(kSmemAlign) unsigned char smem[];
  int m = 0;
  while (m + 1 < a.n && blockIdx.x >= a.first_tile[m + 1]) ++m;
  const int r0 = int(blockIdx.y) * kTok, nt = int(min(int64_t(kTok), a.T - r0));
  ExactBlock<KIND, SF16, 1, kTok> blk;
  const WeightRef* const mats[1] = {&a.w[m]};
  blk.init(mats, smem, a.in, int64_t(blockIdx.x - a.first_tile[m]) * kRows, r0, nt, a.w[m].cols,
           [](int r) { return int64_t(r); });
  float acc[1][kTok / 8][4] = {};
  blk.run(acc);
  const float* bias = a.bias[m];
  float* out = a.out[m];
  const int64_t ldo = a.ldo[m];
  for_each_output<kTok>(blk.row0, nt, a.w[m].rows, [&](int j, int i, int tok, int64_t row) {
    out[int64_t(r0 + tok) * ldo + row] = acc[0][j][i] * a.in.inv[r0 + tok] + (bias ? bias[row] : 0.0f);
  });
}

// Dense quantized matrices over many tokens through cuBLAS (split_gemm_linears): each weight
// dequantized in float32 as weight_at gives it, its row scaled by a power of two that puts the
// row's largest magnitude in [2^14, 2^15), and split into FP16 hi = fp16(w) and lo = fp16(w - hi)
// (22 of its 24 bits; an absolute error below 2^-39 of the row's largest, as split_kernel's for
// x). The products hi x hi, hi x lo and lo x hi (lo x lo, below 2^-22 of each product, is left
// out) are two FP16 GEMMs with float32 sums (hi times x's two halves side by side, lo times x's hi),
// added smallest first, and the rows' and tokens' scalings are undone, when they are copied out.
// The weights are decoded once a call instead of once per 32 tokens, as the kernels above do, and
// the products run at cuBLAS's rate.
constexpr int kMaxSplitMats = 4;
struct SplitWeightArgs {
  WeightRef w[kMaxSplitMats];
  int64_t first[kMaxSplitMats + 1];  // rows of w[i] are rows [first[i], first[i + 1]) of the stack
  int n;
  int64_t r0;                        // this pass: rows [r0, r0 + gridDim.x) of the stack
  __half* hi;                        // [gridDim.x, cols]
  __half* lo;
  float* inv;                        // [gridDim.x]: 2^-s, the inverse of each row's scaling
};

constexpr int kSplitWeightThreads = 256;

// Columns [c, c + 8) of row r of w (c a multiple of 8, so one group), as weight_at gives them;
// 2-, 4- and 8-bit codes and FP8 bytes in one load (3- and 6-bit codes straddle words: weight_at).
template <int KIND, bool SF16>
__device__ __forceinline__ void weights8(const WeightRef& w, int64_t r, int c, float (&v)[8]) {
  constexpr int B = bits_of(KIND);
  if constexpr (B != 2 && B != 4 && B != 8) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = weight_at<KIND, SF16>(w, r, c + i);
  } else {
    const int64_t g = group_index(w, r, c);
    const float scale = group_scale<KIND, SF16>(w, g);
    const float bias = is_affine(KIND) ? scale_value<SF16>(w.biases[g]) : 0.0f;
    uint64_t bits;  // code i at bits B * i
    if constexpr (B == 8) {  // q8 codes and FP8 bytes: a byte a column
      const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(w.data) + r * w.cols + c);
      bits = u.x | (uint64_t(u.y) << 32);
    } else {
      const uint32_t* row = static_cast<const uint32_t*>(w.data) + r * (w.cols * B / 32);
      bits = B == 4 ? row[c / 8] : row[c / 16] >> ((c % 16) * 2);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t code = uint32_t(bits >> (B * i)) & ((1u << B) - 1);
      const float q = KIND == kFp8 ? fp8_e4m3_value(code) : code_value<KIND>(code);
      v[i] = is_affine(KIND) ? fmaf(q, scale, bias) : q * scale;
    }
  }
}

// One block per row of the pass: the row's largest finite magnitude, then 8 columns a thread
// (one 16-byte store of each half, a warp's stores contiguous).
template <int KIND, bool SF16>
__global__ void __launch_bounds__(kSplitWeightThreads) split_weights_kernel(SplitWeightArgs a) {
  constexpr int kStride = 8 * kSplitWeightThreads;
  constexpr int kKeep = 2;  // chunks of 8 a thread keeps from the first pass to the second
  __shared__ float scratch[kSplitWeightThreads / 32];
  const int64_t rr = int64_t(blockIdx.x), r = a.r0 + rr;
  int m = 0;
  while (m + 1 < a.n && r >= a.first[m + 1]) ++m;
  const WeightRef& w = a.w[m];
  const int64_t row = r - a.first[m];
  const int cols = int(w.cols), tid = int(threadIdx.x);
  float keep[kKeep][8], mx = 0.0f;
  auto fold = [&](const float (&v)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) mx = fabsf(v[i]) <= 3.4e38f ? fmaxf(mx, fabsf(v[i])) : mx;
  };
#pragma unroll
  for (int k = 0; k < kKeep; ++k)
    if (8 * tid + k * kStride < cols) {
      weights8<KIND, SF16>(w, row, 8 * tid + k * kStride, keep[k]);
      fold(keep[k]);
    }
  for (int c = 8 * tid + kKeep * kStride; c < cols; c += kStride) {
    float v[8];
    weights8<KIND, SF16>(w, row, c, v);
    fold(v);
  }
  const int shift = split_shift(block_max<kSplitWeightThreads / 32>(mx, scratch));
  const float up = pow2(shift);
  if (tid == 0) a.inv[rr] = pow2(-shift);
  auto store = [&](int c, const float (&v)[8]) {
    __align__(16) __half hi[8], lo[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = v[i] * up;
      hi[i] = __float2half_rn(x);
      lo[i] = __float2half_rn(isinf(x) ? 0.0f : x - __half2float(hi[i]));  // an infinity stays in hi
    }
    *reinterpret_cast<uint4*>(a.hi + rr * cols + c) = *reinterpret_cast<const uint4*>(hi);
    *reinterpret_cast<uint4*>(a.lo + rr * cols + c) = *reinterpret_cast<const uint4*>(lo);
  };
#pragma unroll
  for (int k = 0; k < kKeep; ++k)
    if (8 * tid + k * kStride < cols) store(8 * tid + k * kStride, keep[k]);
  for (int c = 8 * tid + kKeep * kStride; c < cols; c += kStride) {
    float v[8];
    weights8<KIND, SF16>(w, row, c, v);
    store(c, v);
  }
}

// The pass's sums (rows [r0, r0 + n) of the stack) unscaled into each matrix's output, with its
// bias: blockIdx.y the token, threads over the rows.
struct SplitOutArgs {
  float* out[kMaxSplitMats];
  const float* bias[kMaxSplitMats];
  int64_t ldo[kMaxSplitMats];
  int64_t first[kMaxSplitMats + 1];
  int n_mats;
  int64_t r0, n, T;
  const float* sums;   // [2T, n]: hi x (x hi), then hi x (x lo); then [T, n]: lo x (x hi)
  const float* inv_w;  // [n]
  const float* inv_x;  // [T]
};

__global__ void split_out_kernel(SplitOutArgs a) {
  const int64_t total = a.T * a.n;
  for (int64_t t = blockIdx.y; t < a.T; t += gridDim.y) {
    const int e_x = ilogbf(a.inv_x[t]);  // inv_x and inv_w are powers of two
    for (int64_t rr = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; rr < a.n; rr += int64_t(gridDim.x) * blockDim.x) {
      const int64_t r = a.r0 + rr, i = t * a.n + rr;
      int m = 0;
      while (m + 1 < a.n_mats && r >= a.first[m + 1]) ++m;
      const int64_t row = r - a.first[m];
      // both scalings at once: each alone could leave the float range on the way
      const float v = ldexpf((a.sums[2 * total + i] + a.sums[total + i]) + a.sums[i], ilogbf(a.inv_w[rr]) + e_x);
      a.out[m][t * a.ldo[m] + row] = a.bias[m] ? v + a.bias[m][row] : v;
    }
  }
}

enum ExactSlot { kXHi, kXLo, kXSum, kXInv, kHHi, kHLo, kHSum, kHInv, kWork, kNWork };

template <bool INTERLEAVED>
void split(const SplitArgs& a, cudaStream_t s) {
  launch(split_kernel<INTERLEAVED>, unsigned(a.n_rows), kSplitThreads, 0, s, a);
}

void split_rows(const SplitArgs& a, bool interleaved, cudaStream_t s) {
  if (a.n_rows <= 0) return;
  if (interleaved) split<true>(a, s);
  else split<false>(a, s);
}

}  // namespace

void split_tokens(const float* x, int64_t ldx, int64_t T, bool interleaved, const SplitRows& out, cudaStream_t s) {
  if (T <= 0) return;
  const SplitArgs a{x, ldx, T, nullptr, nullptr, 0, 0, out};
  if (interleaved) launch(split_kernel<true>, unsigned(T), kSplitThreads, 0, s, a);
  else launch(split_kernel<false>, unsigned(T), kSplitThreads, 0, s, a);
}

namespace {

bool interleaved_of(FormatTag t) { return t.kind == kQ4; }

}  // namespace

bool experts_exact_mma_supported(const ExpertBatch& b) {
  return exact_mma_enabled() && b.exact && b.pairs > 0 && is_quant(b.gate_up.kind) && is_quant(b.down.kind) &&
         b.dim % 32 == 0 && b.inter % 32 == 0;
}

namespace {

// lanes: the lane-decoded kernels take both matrices (few_lanes_take), for work items of 8 rows.
template <int TOK>
void experts_exact(const ExpertBatch& b, bool lanes, cudaStream_t s) {
  const int n_active = b.a_end - b.a_begin;
  const int k = b.params->top_k;
  const int64_t T = b.pairs / k;
  const int64_t max_work = (b.pairs + TOK - 1) / TOK + n_active;
  if (max_work > 65535) fail("cuda moe: ", b.pairs, " (token, expert) pairs in one call over ", n_active, " experts (too many)");
  Scratch& sc = *b.exact;
  auto get = [&](int slot, size_t bytes) { return static_cast<void*>(sc.get<unsigned char>(slot, bytes)); };
  ExactArgs a;
  a.e = expert_args(b);
  int2* work = sc.get<int2>(kWork, size_t(max_work));
  int* n_work = sc.get<int>(kNWork, 1);
  a.work = work;
  a.n_work = n_work;
  const int* count = b.count_on_device ? b.groups.n_active : nullptr;
  launch(plan_kernel, 1, 32, 0, s, b.groups.offset, b.a_begin, b.a_end, count, TOK, work, n_work);

  // gate/up over the tokens' x
  const SplitRows* pre = b.gemm ? b.gemm->norm_split.find(b.x, b.dim, T, b.dim, interleaved_of(b.gate_up)) : nullptr;
  if (pre) {
    a.in = *pre;  // the norm before split x
  } else {
    a.in = split_buffers(get, kXHi, T, b.dim);
    split_rows(SplitArgs{b.x, b.dim, T, nullptr, nullptr, 0, 0, a.in}, interleaved_of(b.gate_up), s);
  }
  // a batched decode step's q4 and q8 experts: the lane-decoded kernels
  lanes = lanes && TOK == kFewTok;
  if (lanes)
    gate_up_few_lanes(a, b.gate_up, b.group_shift, unsigned(max_work), b.in_place, b.staged_aligned, s);
  else dispatch_format(b.gate_up, [&]<int KIND, bool SF16>() {
    if constexpr (is_quant(KIND)) {
      const size_t smem = 2 * sizeof(Stage<2, TOK>);
      allow_smem<gate_up_exact_kernel<KIND, SF16, TOK>>(smem);
      gate_up_exact_kernel<KIND, SF16, TOK><<<dim3(blocks_for(b.inter, kRows), unsigned(max_work)), kThreads, smem, s>>>(a);
      MS_CUDA_CHECK_LAUNCH();
    }
  });
  // down over the batch's hidden rows
  a.in = split_buffers(get, kHHi, b.pairs, b.inter);
  split_rows(SplitArgs{b.hidden, b.inter, b.pairs, b.groups.offset, count, b.a_begin, b.a_end, a.in},
             interleaved_of(b.down), s);
  if (lanes)
    down_few_lanes(a, b.down, b.group_shift, unsigned(max_work), b.in_place, b.staged_aligned, s);
  else dispatch_format(b.down, [&]<int KIND, bool SF16>() {
    if constexpr (is_quant(KIND)) {
      const size_t smem = 2 * sizeof(Stage<1, TOK>);
      allow_smem<down_exact_kernel<KIND, SF16, TOK>>(smem);
      down_exact_kernel<KIND, SF16, TOK><<<dim3(blocks_for(b.dim, kRows), unsigned(max_work)), kThreads, smem, s>>>(a);
      MS_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace

void run_experts_exact_mma(const ExpertBatch& b, cudaStream_t s) {
  if (b.a_end - b.a_begin <= 0) return;
  // a batched decode step's experts mostly have one or two rows: work items of 8; so do the
  // lane-decoded formats' calls of up to lane_tokens() (linear.h)
  const bool lanes = few_lanes_take(b.gate_up, b.group_shift, b.dim) &&
                     few_lanes_take(b.down, b.group_shift, b.inter);
  if (b.few_tokens || (lanes && b.pairs <= lane_tokens() * b.params->top_k))
    experts_exact<kFewTok>(b, lanes, s);
  else experts_exact<kTok>(b, lanes, s);
}

namespace {
constexpr int64_t kSplitGemmTokens = 128;
}  // namespace

bool split_gemm_for(int64_t T) {
  static const int64_t min_tokens = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_SPLIT_GEMM_TOKENS");
    const int64_t t = v ? int64_t(std::atoll(v)) : kSplitGemmTokens;
    // Never for the GEMV's few tokens: their steps may be captured as CUDA graphs, where the
    // scratch could not grow.
    return t > 0 ? std::max<int64_t>(t, kGemvMaxTokens + 1) : 0;
  }();
  return min_tokens > 0 && T >= min_tokens;
}

bool linear_exact_mma_supported(FormatTag tag, int64_t cols, const float* x, int64_t ldx) {
  // split_kernel reads x in float4s
  return exact_mma_enabled() && is_quant(tag.kind) && cols % 32 == 0 && ldx % 4 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

namespace {

// The matrices w (of one format and width) over x as a stack of their rows, in passes of at most
// 2^24 weights (and 3 x 2^22 sums): split_weights_kernel, two GEMMs, split_out_kernel.
void split_gemm_linears(std::span<const Matrix* const> w, const float* x, int64_t ldx, int64_t T,
                        std::span<const float* const> bias, std::span<float* const> out,
                        std::span<const int64_t> ldo, GemmScratch& scratch, cudaStream_t s) {
  const FormatTag tag = format_of(*w[0]);
  const int64_t cols = w[0]->cols;
  SplitWeightArgs wa{};
  SplitOutArgs oa{};
  wa.n = oa.n_mats = int(w.size());
  for (int i = 0; i < wa.n; ++i) {
    wa.w[i] = weight_ref(*w[size_t(i)]);
    wa.first[i + 1] = oa.first[i + 1] = wa.first[i] + w[size_t(i)]->rows;
    oa.out[i] = out[size_t(i)];
    oa.bias[i] = bias[size_t(i)];
    oa.ldo[i] = ldo[size_t(i)];
  }
  const int64_t rows = wa.first[wa.n];
  auto get = [&](int slot, size_t bytes) { return scratch.area(slot, bytes); };
  SplitRows in;  // as split_buffers lays it out, but hi and lo one after the other (one GEMM operand)
  in.cols = cols;
  in.sum_stride = (cols / 32 + 1) / 2 * 2;
  in.hi = static_cast<__half*>(get(kAreaExactHi, size_t(2 * T * cols) * sizeof(__half)));
  in.lo = in.hi + T * cols;
  in.sum = static_cast<float*>(get(kAreaExactSum, size_t(T * in.sum_stride) * sizeof(float)));
  in.inv = static_cast<float*>(get(kAreaExactInv, size_t(T) * sizeof(float)));
  split_rows(SplitArgs{x, ldx, T, nullptr, nullptr, 0, 0, in}, false, s);
  const int64_t per_pass =
      std::min(rows, std::max<int64_t>(64, std::min((int64_t(1) << 24) / cols, (int64_t(1) << 22) / T)));
  wa.hi = static_cast<__half*>(scratch.area(kAreaSplitW, size_t(2 * per_pass * cols) * sizeof(__half)));
  wa.lo = wa.hi + per_pass * cols;
  wa.inv = static_cast<float*>(scratch.area(kAreaSplitInv, size_t(per_pass) * sizeof(float)));
  float* sums = static_cast<float*>(scratch.area(kAreaSplitSums, size_t(3 * T * per_pass) * sizeof(float)));
  cublasHandle_t h = scratch.tensor_handle(s);
  const float one = 1.0f, zero = 0.0f;
  for (int64_t r0 = 0; r0 < rows; r0 += per_pass) {
    const int64_t n = std::min(per_pass, rows - r0);
    wa.r0 = r0;
    dispatch_format(tag, [&]<int KIND, bool SF16>() {
      if constexpr (is_quant(KIND)) {
        split_weights_kernel<KIND, SF16><<<unsigned(n), kSplitWeightThreads, 0, s>>>(wa);
        MS_CUDA_CHECK_LAUNCH();
      }
    });
    // Column-major view, as in linear(): sums (n x 2T, ld n) = hi^T (n x cols) * [x hi, x lo] (cols x
    // 2T), then (n x T) = lo^T * x hi; split_out_kernel adds them smallest first.
    MS_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(2 * T), int(cols), &one, wa.hi, CUDA_R_16F,
                                 int(cols), in.hi, CUDA_R_16F, int(cols), &zero, sums, CUDA_R_32F, int(n),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    MS_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(T), int(cols), &one, wa.lo, CUDA_R_16F,
                                 int(cols), in.hi, CUDA_R_16F, int(cols), &zero, sums + 2 * T * n, CUDA_R_32F, int(n),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    oa.r0 = r0;
    oa.n = n;
    oa.T = T;
    oa.sums = sums;
    oa.inv_w = wa.inv;
    oa.inv_x = in.inv;
    split_out_kernel<<<dim3(blocks_for(n, 256), unsigned(std::min<int64_t>(T, 65535))), 256, 0, s>>>(oa);
    MS_CUDA_CHECK_LAUNCH();
  }
}

// The matrices w (1 to kMaxLinear, of one format and width: the callers check) over x in one
// launch; false when they cannot take it.
bool exact_linears(std::span<const Matrix* const> w, const float* x, int64_t ldx, int64_t T,
                   std::span<const float* const> bias, std::span<float* const> out, std::span<const int64_t> ldo,
                   GemmScratch& scratch, cudaStream_t s) {
  const FormatTag tag = format_of(*w[0]);
  if (T <= 0 || !linear_exact_mma_supported(tag, w[0]->cols, x, ldx)) return false;
  if ((T + kTok - 1) / kTok > 65535) fail("cuda: ", T, " tokens in one call of ", w[0]->name);
  LinearExactArgs a{};
  a.n = int(w.size());
  for (int i = 0; i < a.n; ++i) {
    a.w[i] = weight_ref(*w[size_t(i)]);
    a.bias[i] = bias[size_t(i)];
    a.out[i] = out[size_t(i)];
    a.ldo[i] = ldo[size_t(i)];
    a.first_tile[i + 1] = a.first_tile[i] + blocks_for(a.w[i].rows, kRows);
  }
  if (split_gemm_for(T)) {
    split_gemm_linears(w, x, ldx, T, bias, out, ldo, scratch, s);
    return true;
  }
  auto get = [&](int slot, size_t bytes) { return scratch.area(slot, bytes); };
  a.in = split_buffers(get, kAreaExactHi, T, a.w[0].cols);
  a.T = T;
  split_rows(SplitArgs{x, ldx, T, nullptr, nullptr, 0, 0, a.in}, interleaved_of(tag), s);
  dispatch_format(tag, [&]<int KIND, bool SF16>() {
    if constexpr (is_quant(KIND)) {
      const size_t smem = 2 * sizeof(Stage<1, kTok>);
      allow_smem<linear_exact_kernel<KIND, SF16>>(smem);
      linear_exact_kernel<KIND, SF16>
          <<<dim3(a.first_tile[a.n], unsigned((T + kTok - 1) / kTok)), kThreads, smem, s>>>(a);
      MS_CUDA_CHECK_LAUNCH();
    }
  });
  return true;
}

}  // namespace

bool linear_exact_mma_shared(std::span<const Matrix* const> w, const float* x, int64_t ldx, int64_t T,
                             std::span<const float* const> bias, std::span<float* const> out, GemmScratch& scratch,
                             cudaStream_t s) {
  if (w.empty() || w.size() > size_t(kMaxLinear)) return false;
  int64_t ldo[kMaxLinear] = {};
  for (size_t i = 0; i < w.size(); ++i) ldo[i] = w[i]->rows;
  return exact_linears(w, x, ldx, T, bias, out, std::span<const int64_t>(ldo, w.size()), scratch, s);
}

void linear_exact_mma(const Matrix& m, const float* x, int64_t ldx, int64_t T, const float* bias, float* out,
                      int64_t ldo, GemmScratch& scratch, cudaStream_t s) {
  const Matrix* w[1] = {&m};
  const float* b[1] = {bias};
  float* o[1] = {out};
  const int64_t l[1] = {ldo};
  if (!exact_linears(w, x, ldx, T, b, o, l, scratch, s))
    fail("cuda: ", m.name, " cannot take the exact tensor-core linear");
}

}  // namespace moestream::cuda
