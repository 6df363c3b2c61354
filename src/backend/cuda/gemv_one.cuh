// The single-token GEMV tile shared by the expert kernels (moe.cu) and the linear layers
// (linear.cu): weight loads issued before x is staged and double-buffered, decoded only once x is
// in shared memory.
#pragma once

#include <cstdint>
#include <utility>

#include "backend/cuda/linear.h"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

// The single-token GEMV tile (moe.cu's one-token expert kernels, linear.cu's one-token GEMV):
// a warp owns R rows of M matrices that share x (gate and up, or down), a block 8 warps;
// a lane walks packs p = lane, lane + 32, ... of its rows. The warp's first weight loads are
// issued before the block stages x, the next pack's while the current one is computed, and
// registers stay low enough for 3 blocks per SM (4 for a one-pass down: 48 registers in q4), so
// the whole batch runs in one wave with every row's loads in flight.
// Each row sums exactly as gemv_warp does (per-lane packs in order, then the warp butterfly):
// its value is bit-identical to the batched kernels' and to linear's GEMV.
constexpr int kOneWarps = 8;
constexpr int kOneRawRegs = 24;  // registers for one buffer of a warp's loaded packs (two are in flight)

// The kinds these kernels decode (through weights.cuh's code_at / load_fp8 / load_plain and scale
// helpers): those the GPU parity tests run through them (bf16, q4 and MXFP4 experts of the
// fixtures, bit-identical to the batched kernels; every expert format of Pair.MoeEveryExpertFormat
// at one token against the CPU; q2 and q4 experts of one layer in TieredGpu). RawPack / load_raw
// also read f16; any other kind, or a width that is not whole packs, goes through the batched
// kernels. The one-token linears and router take the same kinds (linear.cu, moe.cu's route_few),
// each checked bit for bit against the GEMV (Pair.OneTokenGemvEqualsTheGemvBitForBit).
constexpr bool one_token_kind(int kind) {
  return kind == kBF16 || kind == kMxfp4 || kind == kFp8 || kind == kQ2 || kind == kQ3 || kind == kQ4 ||
         kind == kQ6 || kind == kQ8;
}
// MOESTREAM_CUDA_ONE_TOKEN_GEMV=0: one-token linears and routers through the GEMV of several
// tokens instead, for comparison (linear.cu).
bool one_token_gemv_off();

// One pack (32 values) of one row as loaded: raw words and the raw bits of its group's scale (and
// affine bias), decoded only once x is staged, so that no use of a loaded value comes before the
// block's barrier.
template <int KIND>
struct RawPack {
  static constexpr int kWords = KIND == kFp8 ? 8 : is_quant(KIND) ? bits_of(KIND) : KIND == kF32 ? 32 : 16;
  alignas(16) uint32_t w[kWords];
  uint32_t scale, bias;
};

// Rows per warp for M matrices of a kind: as many as one buffer of kOneRawRegs holds (2 of gate
// and up in q4, 4 of down); the next packs are loaded while the current ones are computed when
// that fits too.
template <int KIND, int M>
constexpr int one_rows() {
  constexpr int per_row = M * (RawPack<KIND>::kWords + 2);
  return per_row >= kOneRawRegs ? 1 : kOneRawRegs / per_row;
}
// MOESTREAM_CUDA_ONE_ROWS=1, 2 or 4: at most that many rows a warp in with_one_rows (read at each
// launch, so that a test can compare them in one process); 0 when unset.
int one_rows_cap();
// f.template operator()<R>() with the rows a warp takes for M matrices of `rows` rows in all: as
// many as one_rows allows, or 2, or 1, the most that still makes two blocks an SM, so that a small
// matrix reaches every SM (o_proj's 2,048 rows made 64 blocks of 32 rows on 132 SMs). A row sums
// the same way whatever R is.
template <int KIND, int M, class F>
void with_one_rows(int64_t rows, F&& f) {
  constexpr int most = one_rows<KIND, M>();
  const int cap = one_rows_cap();
  auto takes = [&](int r) {
    return r <= most && (cap > 0 ? r <= cap : blocks_for(rows, kOneWarps * r) >= 2 * unsigned(sm_count()));
  };
  if (takes(most)) {
    f.template operator()<most>();
  } else if (takes(2)) {
    if constexpr (most > 2) f.template operator()<2>();
  } else {
    f.template operator()<1>();
  }
}

template <int KIND, int M, int R>
constexpr bool one_double_buffered() {
  return M * R * (RawPack<KIND>::kWords + 2) <= kOneRawRegs;
}

// A lane's second pack loaded with its first, before x is staged (load_first), from the row address
// computed once: for the quantized kinds (whose address arithmetic that saves), when both buffers
// fit in kOneEarlyRegs; more spilled beside the staging under __launch_bounds__(256, 3) (ptxas,
// session 37). The others load it in dot_rows's loop, one pack ahead.
constexpr int kOneEarlyRegs = 40;
template <int KIND, int M, int R>
constexpr bool one_early_second() {
  return is_quant(KIND) && one_double_buffered<KIND, M, R>() &&
         2 * M * R * (RawPack<KIND>::kWords + 2) <= kOneEarlyRegs;
}

// Where one row's packs are: its first word and its first group's scale and bias, so that a row's
// address arithmetic (the row times its words and its groups, in 64 bits) is done once for the
// packs loaded together (load_first's two).
template <int KIND>
struct RowAddr {
  const uint32_t* words;  // pack p's words at words + p * RawPack<KIND>::kWords
  const void* scales;     // quantized: the row's first group's scale (uint8, float or uint16 by KIND)
  const uint16_t* biases;  // affine: the row's first group's bias
};

template <int KIND>
__device__ __forceinline__ RowAddr<KIND> row_addr(const WeightRef& m, int64_t row) {
  constexpr int W = RawPack<KIND>::kWords;
  RowAddr<KIND> a{};
  if constexpr (KIND == kFp8) a.words = reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(m.data) + row * m.cols);
  else if constexpr (is_quant(KIND)) a.words = static_cast<const uint32_t*>(m.data) + row * (m.cols * W / 32);
  else a.words = reinterpret_cast<const uint32_t*>(static_cast<const char*>(m.data) + row * m.cols * (W / 8));
  if constexpr (is_quant(KIND)) {
    const int64_t g = row * m.groups_per_row;  // group_index's row part
    if constexpr (KIND == kMxfp4) a.scales = static_cast<const uint8_t*>(m.scales) + g;
    else if constexpr (KIND == kFp8) a.scales = static_cast<const float*>(m.scales) + g;
    else a.scales = static_cast<const uint16_t*>(m.scales) + g;
    if constexpr (is_affine(KIND)) a.biases = m.biases + g;
  }
  return a;
}

// Pack p of the row at a (of m), with the load widths of load_codes / load_fp8 / load_plain
// (cols % 32 == 0); its scale and bias those group_index gives for column p * 32.
template <int KIND>
__device__ __forceinline__ void load_raw(const WeightRef& m, const RowAddr<KIND>& a, int p, RawPack<KIND>& r) {
  constexpr int W = RawPack<KIND>::kWords;
  const uint32_t* words = a.words + p * W;
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int j = 0; j < W / 4; ++j) reinterpret_cast<uint4*>(r.w)[j] = __ldg(reinterpret_cast<const uint4*>(words) + j);
  } else if constexpr (W % 2 == 0) {  // 2- and 6-bit rows are 8-byte aligned
#pragma unroll
    for (int j = 0; j < W / 2; ++j) reinterpret_cast<uint2*>(r.w)[j] = __ldg(reinterpret_cast<const uint2*>(words) + j);
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) r.w[j] = __ldg(words + j);
  }
  if constexpr (is_quant(KIND)) {
    const int g = group_in_row(m, p * 32);
    if constexpr (KIND == kMxfp4) r.scale = __ldg(static_cast<const uint8_t*>(a.scales) + g);
    else if constexpr (KIND == kFp8) r.scale = __float_as_uint(__ldg(static_cast<const float*>(a.scales) + g));
    else r.scale = __ldg(static_cast<const uint16_t*>(a.scales) + g);
    if constexpr (is_affine(KIND)) r.bias = __ldg(a.biases + g);
  }
}

// Pack p of `row` of m.
template <int KIND>
__device__ __forceinline__ void load_raw(const WeightRef& m, int64_t row, int p, RawPack<KIND>& r) {
  load_raw<KIND>(m, row_addr<KIND>(m, row), p, r);
}

// acc[t][m][r] gains pack . x_t for M x R loaded packs and the activation rows x_t = xv + t *
// stride, t < nt <= NT (all NT when NT is 1): the codes are decoded once for every row, and each
// row's sums run exactly as they run for that row alone (the arithmetic of gemv_warp's inner loop).
template <int KIND, bool SF16, int M, int R, int NT>
__device__ __forceinline__ void dot_packs(const RawPack<KIND> (&raw)[M][R], const float* xv, int64_t stride, int nt,
                                          float (&acc)[NT][M][R]) {
  // Packed codes are decoded where they are used, 4 a row for each float4 of x (the values
  // decode_codes gives); FP8 and plain rows all at once.
  constexpr bool kByQuad = is_quant(KIND) && KIND != kFp8;
  float q[M][R][kByQuad ? 1 : 32];
  if constexpr (!kByQuad) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (KIND == kFp8) load_fp8(reinterpret_cast<const uint8_t*>(raw[m][r].w), true, 32, q[m][r]);
        else load_plain<KIND>(raw[m][r].w, 0, true, 32, q[m][r]);
      }
  }
  float d[NT][M][R];
  float sx[NT];  // sum of this pack of x_t: multiplies the affine bias
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    sx[t] = 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) d[t][m][r] = 0.0f;
  }
  auto quad = [&]<int J>() {
    float c[M][R][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (kByQuad) {
          const uint32_t(&w)[bits_of(KIND)] = reinterpret_cast<const uint32_t(&)[bits_of(KIND)]>(raw[m][r].w);
          c[m][r][0] = code_at<KIND, NT == 1, 4 * J>(w);
          c[m][r][1] = code_at<KIND, NT == 1, 4 * J + 1>(w);
          c[m][r][2] = code_at<KIND, NT == 1, 4 * J + 2>(w);
          c[m][r][3] = code_at<KIND, NT == 1, 4 * J + 3>(w);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) c[m][r][e] = q[m][r][4 * J + e];
        }
      }
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (NT == 1 || t < nt) {
        const float4 x4 = reinterpret_cast<const float4*>(xv + t * stride)[J];
        if constexpr (is_affine(KIND)) sx[t] += quad_sum(x4);
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) {
            d[t][m][r] = fmaf(c[m][r][0], x4.x, d[t][m][r]);
            d[t][m][r] = fmaf(c[m][r][1], x4.y, d[t][m][r]);
            d[t][m][r] = fmaf(c[m][r][2], x4.z, d[t][m][r]);
            d[t][m][r] = fmaf(c[m][r][3], x4.w, d[t][m][r]);
          }
      }
  };
  [&]<int... J>(std::integer_sequence<int, J...>) {
    (quad.template operator()<J>(), ...);
  }(std::make_integer_sequence<int, 8>{});
#pragma unroll
  for (int t = 0; t < NT; ++t)
    if (NT == 1 || t < nt) {
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const RawPack<KIND>& p = raw[m][r];
          float& a = acc[t][m][r];
          if constexpr (is_affine(KIND))
            a += fmaf(scale_value<SF16>(uint16_t(p.scale)), d[t][m][r], scale_value<SF16>(uint16_t(p.bias)) * sx[t]);
          else if constexpr (KIND == kMxfp4) a = fmaf(mxfp4_scale(p.scale), d[t][m][r], a);
          else if constexpr (KIND == kFp8) a = fmaf(__uint_as_float(p.scale), d[t][m][r], a);
          else a += d[t][m][r];
        }
    }
}

// acc[t][m][r] = row row0 + r of w[m] . x_t for nt <= NT staged x rows (x_t at xs + t * stride,
// padded as stage_x lays it out); `cur` holds load_first's packs at p = lane and, where
// one_early_second, `next` those at p = lane + 32. Each row's weights are read once for all nt rows
// of x; double-buffered, a pack's loads are issued one pack ahead of its products. ONE_PASS: a row
// has at most 32 packs (no second pass, no buffer for it). All lanes get the sums.
template <int KIND, bool SF16, int M, int R, bool ONE_PASS, int NT>
__device__ __forceinline__ void dot_rows(const WeightRef* const (&w)[M], int64_t row0, RawPack<KIND> (&cur)[M][R],
                                         RawPack<KIND> (&next)[M][R], const float* xs, int64_t stride, int nt,
                                         float (&acc)[NT][M][R]) {
  const int lane = threadIdx.x & 31;
  const int packs = int(w[0]->cols >> 5);
  auto load_packs = [&](int p, RawPack<KIND>(&raw)[M][R]) {  // pack p of each row
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) load_raw<KIND>(*w[m], min(row0 + r, w[m]->rows - 1), p, raw[m][r]);
  };
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[t][m][r] = 0.0f;
  if constexpr (ONE_PASS) {
    if (lane < packs) dot_packs<KIND, SF16, M, R, NT>(cur, xs + lane * 36, stride, nt, acc);
  } else {
  for (int p = lane; p < packs; p += 32) {
    if constexpr (one_double_buffered<KIND, M, R>()) {
      // cur holds pack p; next pack p + 32, when there is one, loaded here or (early) already
      constexpr bool early = one_early_second<KIND, M, R>();
      if (!early && p + 32 < packs) load_packs(p + 32, next);
      dot_packs<KIND, SF16, M, R, NT>(cur, xs + p * 36, stride, nt, acc);
      if (p + 32 < packs) {
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) cur[m][r] = next[m][r];
        if (early && p + 64 < packs) load_packs(p + 64, next);
      }
    } else {
      if (p > lane) load_packs(p, cur);
      dot_packs<KIND, SF16, M, R, NT>(cur, xs + p * 36, stride, nt, acc);
    }
  }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (NT == 1 || t < nt) acc[t][m][r] = warp_sum(acc[t][m][r]);
}

// The same for one x row.
template <int KIND, bool SF16, int M, int R, bool ONE_PASS>
__device__ __forceinline__ void dot_rows(const WeightRef* const (&w)[M], int64_t row0, RawPack<KIND> (&cur)[M][R],
                                         RawPack<KIND> (&next)[M][R], const float* xs, float (&acc)[M][R]) {
  dot_rows<KIND, SF16, M, R, ONE_PASS, 1>(w, row0, cur, next, xs, 0, 1, reinterpret_cast<float (&)[1][M][R]>(acc));
}

// cur[m][r]: the pack at p = lane of row row0 + r of w[m] (past the last row, the last row again:
// computed, never stored); where one_early_second, next[m][r] the pack at p = lane + 32 too, from
// the same row address (2-13% fewer instructions in the one-token kernels, docs/PERFORMANCE.md
// session 37).
template <int KIND, int M, int R>
__device__ __forceinline__ void load_first(const WeightRef* const (&w)[M], int64_t row0, RawPack<KIND> (&cur)[M][R],
                                           RawPack<KIND> (&next)[M][R]) {
  const int lane = threadIdx.x & 31;
  const int packs = int(w[0]->cols >> 5);
  if (lane >= packs) return;
  const bool second = one_early_second<KIND, M, R>() && lane + 32 < packs;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const RowAddr<KIND> a = row_addr<KIND>(*w[m], min(row0 + r, w[m]->rows - 1));
      load_raw<KIND>(*w[m], a, lane, cur[m][r]);
      if (second) load_raw<KIND>(*w[m], a, lane + 32, next[m][r]);
    }
}

// Row t < nt of xs (at xs + t * padded_cols(cols)) = the x row at x_of(t) [cols] (cols % 32 == 0,
// rows 16-byte aligned); ends with the block synchronized.
template <class XOf>
__device__ __forceinline__ void stage_rows(XOf x_of, int nt, int64_t cols, float* xs) {
  for (int t = 0; t < nt; ++t) {
    const float4* x4 = reinterpret_cast<const float4*>(x_of(t));
    float* row = xs + t * padded_cols(cols);
    for (int64_t i = threadIdx.x; i < cols / 4; i += blockDim.x) *reinterpret_cast<float4*>(row + padded(4 * i)) = x4[i];
  }
  __syncthreads();
}

// xs [padded_cols(cols)] = x [cols] (cols % 32 == 0); ends with the block synchronized.
__device__ __forceinline__ void stage_row(const float* __restrict__ x, int64_t cols, float* xs) {
  stage_rows([&](int) { return x; }, 1, cols, xs);
}

}  // namespace moestream::cuda
