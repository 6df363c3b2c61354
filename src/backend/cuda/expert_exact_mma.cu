// The experts of a call with more than one token on the tensor cores, to float32 accuracy
// (run_experts_exact_mma in moe.h). A quantized weight is code * scale (+ bias) per group, and the
// codes are small numbers that FP16 holds exactly: affine codes are integers below 256, MXFP4 codes
// (doubled, as everywhere here) integers up to 12, FP8 E4M3 values fit FP16's range and mantissa.
// So each pack of 32 columns is multiplied on the tensor cores as codes x activations, and the
// group's scale and bias are applied in float32 afterwards, as the CUDA-core kernels do.
// The activations are the inexact part: each token's 64 columns of a step are scaled by a power
// of two so their largest lands in [2^14, 2^15), then split into hi = fp16(x) and lo =
// fp16(x - hi), and both halves go through the MMA (products of FP16 values are exact in the
// float32 sums). That keeps 22 of float32's 24 bits of every activation above 2^-17 of the
// step's largest one, so the result differs from the float32 kernels by float32-sized rounding,
// not FP16's.
//
// One launch for gate/up and one for down cover every active expert (grid.y) and 64-row tiles
// of its matrices (grid.x); a block of 4 warps walks its expert's tokens 32 at a time (four MMA
// column tiles of 8; empty tiles skipped). mma.sync m16n8k16 with the fragment layout of the PTX
// ISA: a warp's 16 weight rows are the A operand (row-major), the tokens the B operand, and the
// float32 accumulators come back per (row, token), so the group's scale applies per row.
#include <cuda_fp16.h>

#include "backend/cuda/moe.h"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // weight rows per block
constexpr int kTok = 32;            // tokens per pass
constexpr int kTiles = kTok / 8;    // MMA column tiles per pass
constexpr int kK = 64;              // columns per step: two packs of 32
constexpr int kLd = kK + 8;         // halves per shared row: fragment loads hit 32 distinct banks



// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

// One matrix's share of a block's shared memory for one step: codes as FP16 [kRows][kLd] and the
// scale and bias of each (row, pack).
struct WeightTile {
  __half codes[kRows * kLd];
  float scale[kRows][2], bias[kRows][2];
};

struct TokenTile {
  __half hi[kTok * kLd], lo[kTok * kLd];
  float sum[kTok][2];  // float32 sum of each pack of the unscaled x: multiplies the affine bias
  float inv[kTok];     // 2^-shift of the token's scaling this step
};

constexpr int kTokPerWarp = kTok / kWarps;

// What a thread loads for one step, issued before the previous step's products so that the loads
// overlap them: its pack of each of the M matrices (row threadIdx / 2, pack threadIdx % 2 of the
// step) and its two columns (2 * lane, 2 * lane + 1) of the tokens its warp stages (warp,
// warp + kWarps, ...).
template <int KIND, int M>
struct StepLoads {
  RawQuantPack<KIND> w[M];
  bool w_valid;
  float2 x[kTokPerWarp];
};

// rows[i]: the float row of token warp + i * kWarps of the pass (null past the pass's tokens).
template <int KIND, int M>
__device__ __forceinline__ void load_step(const WeightRef* const (&mats)[M], int64_t row0, int64_t k0,
                                          const float* const (&rows)[kTokPerWarp], int64_t cols,
                                          StepLoads<KIND, M>& l) {
  const int r = int(threadIdx.x) / 2, half_pack = int(threadIdx.x) % 2, lane = int(threadIdx.x) % 32;
  const int64_t row = row0 + r, p = k0 / 32 + half_pack;
  l.w_valid = row < mats[0]->rows && p * 32 < mats[0]->cols;
  if (l.w_valid) {
#pragma unroll
    for (int m = 0; m < M; ++m) load_raw_pack<KIND>(*mats[m], row, p, l.w[m]);
  }
  const int64_t c = k0 + 2 * lane;
#pragma unroll
  for (int i = 0; i < kTokPerWarp; ++i)
    l.x[i] = rows[i] && c < cols ? *reinterpret_cast<const float2*>(rows[i] + c) : make_float2(0.0f, 0.0f);
}

// The loaded step into shared memory: codes as FP16 with the groups' scales and biases (zeros past
// the matrix), and the first `staged` tokens split into hi and lo halves after scaling each token
// by a power of two (its largest value of the step into [2^14, 2^15)), with the pack sums.
template <int KIND, bool SF16, int M>
__device__ __forceinline__ void store_step(const StepLoads<KIND, M>& l, int staged, WeightTile* w, TokenTile& t) {
  const int r = int(threadIdx.x) / 2, half_pack = int(threadIdx.x) % 2;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    __half* dst = w[m].codes + r * kLd + half_pack * 32;
    if (!l.w_valid) {
#pragma unroll
      for (int i = 0; i < 32; i += 2) *reinterpret_cast<__half2*>(dst + i) = __float2half2_rn(0.0f);
      w[m].scale[r][half_pack] = 0.0f;
      w[m].bias[r][half_pack] = 0.0f;
      continue;
    }
    float q[32], scale, bias;
    decode_raw_pack<KIND, SF16>(l.w[m], q, scale, bias);
    w[m].scale[r][half_pack] = scale;
    w[m].bias[r][half_pack] = bias;
#pragma unroll
    for (int i = 0; i < 32; i += 2) *reinterpret_cast<__half2*>(dst + i) = __floats2half2_rn(q[i], q[i + 1]);
  }
#pragma unroll
  for (int i = 0; i < kTokPerWarp; ++i) {
    const int tok = warp + i * kWarps;
    if (tok >= staged) break;
    const float2 v = l.x[i];
    const float mx = warp_max(fmaxf(fabsf(v.x), fabsf(v.y)));
    int shift = 0;
    if (mx > 0.0f && mx <= 3.4e38f) {  // finite and non-zero; Inf and NaN go through unscaled
      int e;
      frexpf(mx, &e);  // mx = f * 2^e, f in [0.5, 1)
      shift = min(max(15 - e, -126), 126);
    }
    const float up = pow2(shift);
    const float x0 = v.x * up, x1 = v.y * up;
    const __half2 hi = __floats2half2_rn(x0, x1);
    const float2 hf = __half22float2(hi);
    *reinterpret_cast<__half2*>(t.hi + tok * kLd + 2 * lane) = hi;
    *reinterpret_cast<__half2*>(t.lo + tok * kLd + 2 * lane) = __floats2half2_rn(x0 - hf.x, x1 - hf.y);
    float s = v.x + v.y;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) {
      t.sum[tok][0] = s;
      t.inv[tok] = pow2(-shift);
    }
    if (lane == 16) t.sum[tok][1] = s;
  }
}

__device__ __forceinline__ uint32_t ld32(const __half* p) { return *reinterpret_cast<const uint32_t*>(p); }

// d += a (16 x 16, row-major) * b (16 x 8, column-major), FP16 inputs, float32 sums.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// For M matrices sharing the staged tokens: acc[m][j][i] += this step's contribution to the
// warp's rows and the tokens of column tile j (element i: row g + 8 * (i / 2), token 2 * q + i % 2
// of the tile, where g = lane / 4 and q = lane % 4).
template <int M>
__device__ __forceinline__ void multiply_step(const WeightTile* w, const TokenTile& t, int tiles,
                                              float (&acc)[M][kTiles][4]) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, q = lane % 4;
  const int rl = warp * 16 + g;
#pragma unroll
  for (int pack = 0; pack < 2; ++pack) {
    float c[M][kTiles][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[m][j][i] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      const int kk = pack * 32 + ks * 16 + 2 * q;
      uint32_t a[M][4];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        a[m][0] = ld32(w[m].codes + rl * kLd + kk);
        a[m][1] = ld32(w[m].codes + (rl + 8) * kLd + kk);
        a[m][2] = ld32(w[m].codes + rl * kLd + kk + 8);
        a[m][3] = ld32(w[m].codes + (rl + 8) * kLd + kk + 8);
      }
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        if (j >= tiles) break;
        const int tok = j * 8 + g;
        const uint32_t h0 = ld32(t.hi + tok * kLd + kk), h1 = ld32(t.hi + tok * kLd + kk + 8);
        const uint32_t l0 = ld32(t.lo + tok * kLd + kk), l1 = ld32(t.lo + tok * kLd + kk + 8);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          mma16816(c[m][j], a[m], h0, h1);
          mma16816(c[m][j], a[m], l0, l1);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float s0 = w[m].scale[rl][pack], s1 = w[m].scale[rl + 8][pack];
      const float b0 = w[m].bias[rl][pack], b1 = w[m].bias[rl + 8][pack];
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        if (j >= tiles) break;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int tok = j * 8 + 2 * q + (i & 1);
          const float scale = i < 2 ? s0 : s1, bias = i < 2 ? b0 : b1;
          acc[m][j][i] += fmaf(c[m][j][i] * t.inv[tok], scale, bias * t.sum[tok][pack]);
        }
      }
    }
  }
}

// Every pass of up to kTok of the expert's tokens over the K columns of its M matrices (gate and
// up, or down): the loads of step s + 1 are issued between the barrier that publishes step s and
// its products. emit(acc, t0, nt) writes a pass's results.
template <int KIND, bool SF16, int M, class RowOf, class Emit>
__device__ __forceinline__ void expert_passes(const WeightRef* const (&mats)[M], int64_t row0, int r0, int r1,
                                              int64_t cols, RowOf row_of, Emit emit, WeightTile* w, TokenTile& t) {
  const int warp = int(threadIdx.x) / 32;
  for (int t0 = r0; t0 < r1; t0 += kTok) {
    const int nt = min(kTok, r1 - t0), tiles = (nt + 7) / 8;
    const float* rows[kTokPerWarp];
#pragma unroll
    for (int i = 0; i < kTokPerWarp; ++i) {
      const int tok = warp + i * kWarps;
      rows[i] = tok < nt ? row_of(t0 + tok) : nullptr;
    }
    float acc[M][kTiles][4] = {};
    StepLoads<KIND, M> l;
    load_step<KIND, M>(mats, row0, 0, rows, cols, l);
    for (int64_t k0 = 0; k0 < cols; k0 += kK) {
      store_step<KIND, SF16, M>(l, tiles * 8, w, t);
      __syncthreads();
      if (k0 + kK < cols) load_step<KIND, M>(mats, row0, k0 + kK, rows, cols, l);
      multiply_step<M>(w, t, tiles, acc);
      __syncthreads();
    }
    emit(acc, t0, nt);
  }
}

// f(j, i, token, row) for each of this thread's accumulator elements that is an output of the
// pass (token < nt, row < rows): column tile j, element i, at token j * 8 + 2 * (lane % 4) + i % 2
// of the pass and row row0 + 16 * warp + lane / 4 (+ 8 for i >= 2), the m16n8 accumulator layout.
template <class F>
__device__ __forceinline__ void for_each_output(int64_t row0, int nt, int64_t rows, F f) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = j * 8 + 2 * q + (i & 1);
      const int64_t row = row0 + warp * 16 + g + (i < 2 ? 0 : 8);
      if (tok < nt && row < rows) f(j, i, tok, row);
    }
}

template <int KIND, bool SF16>
__global__ void __launch_bounds__(kThreads) gate_up_exact_kernel(ExpertArgs a) {
  __shared__ __align__(16) WeightTile w[2];
  __shared__ __align__(16) TokenTile xt;
  int e, r0, r1;
  if (!block_expert(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const WeightRef* const mats[2] = {&d.gate, &d.up};
  expert_passes<KIND, SF16, 2>(
      mats, row0, r0, r1, a.dim, [&](int row) { return a.x + int64_t(a.g.row_token[row] / a.k) * a.dim; },
      [&](const float (&acc)[2][kTiles][4], int t0, int nt) {
        for_each_output(row0, nt, a.inter, [&](int j, int i, int tok, int64_t row) {
          const float gv = acc[0][j][i] + (d.gate_bias ? d.gate_bias[row] : 0.0f);
          const float uv = acc[1][j][i] + (d.up_bias ? d.up_bias[row] : 0.0f);
          a.hidden[int64_t(t0 + tok) * a.inter + row] = gated_activation(gv, uv, a.clamped, a.limit, a.alpha);
        });
      },
      w, xt);
}

template <int KIND, bool SF16>
__global__ void __launch_bounds__(kThreads) down_exact_kernel(ExpertArgs a) {
  __shared__ __align__(16) WeightTile w[1];
  __shared__ __align__(16) TokenTile xt;
  int e, r0, r1;
  if (!block_expert(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const WeightRef* const mats[1] = {&d.down};
  expert_passes<KIND, SF16, 1>(
      mats, row0, r0, r1, a.inter, [&](int row) { return a.hidden + int64_t(row) * a.inter; },
      [&](const float (&acc)[1][kTiles][4], int t0, int nt) {
        for_each_output(row0, nt, a.dim, [&](int j, int i, int tok, int64_t row) {
          a.y[int64_t(t0 + tok) * a.dim + row] = acc[0][j][i] + (d.down_bias ? d.down_bias[row] : 0.0f);
        });
      },
      w, xt);
}

}  // namespace

bool experts_exact_mma_supported(const ExpertBatch& b) {
  return exact_mma_enabled() && is_quant(b.gate_up.kind) && is_quant(b.down.kind) && b.dim % 32 == 0 && b.inter % 32 == 0;
}

void run_experts_exact_mma(const ExpertBatch& b, cudaStream_t s) {
  const int n_blocks = b.a_end - b.a_begin;
  if (n_blocks <= 0) return;
  const ExpertArgs a = expert_args(b);
  dispatch_format(b.gate_up, [&]<int KIND, bool SF16>() {
    if constexpr (is_quant(KIND)) {
      gate_up_exact_kernel<KIND, SF16><<<dim3(blocks_for(b.inter, kRows), unsigned(n_blocks)), kThreads, 0, s>>>(a);
      MS_CUDA_CHECK_LAUNCH();
    }
  });
  dispatch_format(b.down, [&]<int KIND, bool SF16>() {
    if constexpr (is_quant(KIND)) {
      down_exact_kernel<KIND, SF16><<<dim3(blocks_for(b.dim, kRows), unsigned(n_blocks)), kThreads, 0, s>>>(a);
      MS_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace moestream::cuda
