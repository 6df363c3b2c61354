// The experts of a prefill-sized batch on the tensor cores without FP16 copies of the weights in
// HBM (run_experts_mma in moe.h): one launch for gate/up and one for down cover every active
// expert (grid.y) and 64-row tiles of its matrices (grid.x). A block of 4 warps walks its expert's
// tokens 16 at a time; per 64 columns it dequantizes the tile's weights straight from the stored
// format into shared memory as FP16 (the values dequant_rows_f16 gives, rounded once), stages the
// 16 token rows of x as FP16, and each warp multiplies its 16 rows with WMMA (float32 sums).
// gate/up write act(gate + bias, up + bias) in float32 to hidden; down writes y + bias. Same
// tolerance as run_experts_gemm (FP16 operands), no host round trip, and the weights are read
// once per 16 tokens of an expert instead of being written and read back as FP16.
#include <mma.h>

#include <cstdlib>
#include <string>

#include "backend/cuda/moe.h"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

namespace {

using namespace nvcuda;

constexpr int kRows = 64;     // output rows per block (16 per warp)
constexpr int kTok = 16;      // tokens per pass
constexpr int kK = 64;        // columns per step: two packs of 32
constexpr int kLd = kK + 8;   // padded row of a shared tile (halves)
constexpr int kThreads = 128;



// Rows [row0, row0 + kRows) x columns [k0, k0 + kK) of w as FP16 into tile [kRows][kLd]; rows
// or packs past the matrix are zeros. Thread i: row i / 2, pack i % 2.
template <int KIND, bool SF16>
__device__ __forceinline__ void stage_weights(const WeightRef& w, int64_t row0, int64_t k0, __half* tile) {
  const int r = int(threadIdx.x) / 2, half_pack = int(threadIdx.x) % 2;
  const int64_t row = row0 + r, p = k0 / 32 + half_pack;
  __half* dst = tile + r * kLd + half_pack * 32;
  if (row >= w.rows || p * 32 >= w.cols) {
#pragma unroll
    for (int i = 0; i < 32; ++i) dst[i] = __float2half(0.0f);
    return;
  }
  float q[32];
  load_pack<KIND>(w, row, p, true, q);
  float scale = 1.0f, bias = 0.0f;
  if constexpr (is_quant(KIND)) {
    const int64_t g = group_index(w, row, p * 32);
    scale = group_scale<KIND, SF16>(w, g);
    if constexpr (is_affine(KIND)) bias = scale_value<SF16>(w.biases[g]);
  }
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    float v0 = q[i], v1 = q[i + 1];
    if constexpr (is_affine(KIND)) {
      v0 = fmaf(v0, scale, bias);
      v1 = fmaf(v1, scale, bias);
    } else if constexpr (is_quant(KIND)) {
      v0 *= scale;
      v1 *= scale;
    }
    *reinterpret_cast<__half2*>(dst + i) = __halves2half2(to_half_saturated(v0), to_half_saturated(v1));
  }
}

// Token rows t < nt of x (row_of(t) gives the float row), columns [k0, k0 + kK), as FP16 into
// xs [kTok][kLd]; the rest zeros.
template <class RowOf>
__device__ __forceinline__ void stage_x16(RowOf row_of, int nt, int64_t cols, int64_t k0, __half* xs) {
  for (int i = int(threadIdx.x); i < kTok * kK; i += kThreads) {
    const int t = i / kK, c = i % kK;
    const float v = t < nt && k0 + c < cols ? row_of(t)[k0 + c] : 0.0f;
    xs[t * kLd + c] = to_half_saturated(v);
  }
}

template <int KIND, bool SF16>
__global__ void __launch_bounds__(kThreads) gate_up_mma_kernel(ExpertArgs a) {
  __shared__ __align__(32) __half wg[kRows * kLd];
  __shared__ __align__(32) __half wu[kRows * kLd];
  __shared__ __align__(32) __half xs[kTok * kLd];
  __shared__ __align__(32) float out[2][4][kTok * 16];
  int e, r0, r1;
  if (!block_expert(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const int warp = int(threadIdx.x) / 32;
  for (int t0 = r0; t0 < r1; t0 += kTok) {
    const int nt = min(kTok, r1 - t0);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> cg, cu;
    wmma::fill_fragment(cg, 0.0f);
    wmma::fill_fragment(cu, 0.0f);
    for (int64_t k0 = 0; k0 < a.dim; k0 += kK) {
      stage_weights<KIND, SF16>(d.gate, row0, k0, wg);
      stage_weights<KIND, SF16>(d.up, row0, k0, wu);
      stage_x16([&](int t) { return a.x + int64_t(a.g.row_token[t0 + t] / a.k) * a.dim; }, nt, a.dim, k0, xs);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fx;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fw;
        wmma::load_matrix_sync(fx, xs + kk, kLd);
        wmma::load_matrix_sync(fw, wg + warp * 16 * kLd + kk, kLd);
        wmma::mma_sync(cg, fx, fw, cg);
        wmma::load_matrix_sync(fw, wu + warp * 16 * kLd + kk, kLd);
        wmma::mma_sync(cu, fx, fw, cu);
      }
      __syncthreads();
    }
    // out[.][warp]: [token][row of the warp's 16]
    wmma::store_matrix_sync(out[0][warp], cg, 16, wmma::mem_row_major);
    wmma::store_matrix_sync(out[1][warp], cu, 16, wmma::mem_row_major);
    __syncwarp();
    for (int i = int(threadIdx.x) % 32; i < kTok * 16; i += 32) {
      const int t = i / 16, r = i % 16;
      const int64_t row = row0 + warp * 16 + r;
      if (t >= nt || row >= a.inter) continue;
      const float gv = out[0][warp][i] + (d.gate_bias ? d.gate_bias[row] : 0.0f);
      const float uv = out[1][warp][i] + (d.up_bias ? d.up_bias[row] : 0.0f);
      a.hidden[int64_t(t0 + t) * a.inter + row] = gated_activation(gv, uv, a.clamped, a.limit, a.alpha);
    }
    __syncwarp();
  }
}

template <int KIND, bool SF16>
__global__ void __launch_bounds__(kThreads) down_mma_kernel(ExpertArgs a) {
  __shared__ __align__(32) __half wd[kRows * kLd];
  __shared__ __align__(32) __half xs[kTok * kLd];
  __shared__ __align__(32) float out[4][kTok * 16];
  int e, r0, r1;
  if (!block_expert(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const int warp = int(threadIdx.x) / 32;
  for (int t0 = r0; t0 < r1; t0 += kTok) {
    const int nt = min(kTok, r1 - t0);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
    wmma::fill_fragment(c, 0.0f);
    for (int64_t k0 = 0; k0 < a.inter; k0 += kK) {
      stage_weights<KIND, SF16>(d.down, row0, k0, wd);
      stage_x16([&](int t) { return a.hidden + int64_t(t0 + t) * a.inter; }, nt, a.inter, k0, xs);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fx;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fw;
        wmma::load_matrix_sync(fx, xs + kk, kLd);
        wmma::load_matrix_sync(fw, wd + warp * 16 * kLd + kk, kLd);
        wmma::mma_sync(c, fx, fw, c);
      }
      __syncthreads();
    }
    wmma::store_matrix_sync(out[warp], c, 16, wmma::mem_row_major);
    __syncwarp();
    for (int i = int(threadIdx.x) % 32; i < kTok * 16; i += 32) {
      const int t = i / 16, r = i % 16;
      const int64_t row = row0 + warp * 16 + r;
      if (t >= nt || row >= a.dim) continue;
      a.y[int64_t(t0 + t) * a.dim + row] = out[warp][i] + (d.down_bias ? d.down_bias[row] : 0.0f);
    }
    __syncwarp();
  }
}

}  // namespace

bool experts_mma_supported(const ExpertBatch& b) {
  static const bool on = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_EXPERT_MMA");
    return !(v && std::string(v) == "0");
  }();
  return on && b.dim % 32 == 0 && b.inter % 32 == 0;
}

void run_experts_mma(const ExpertBatch& b, cudaStream_t s) {
  const int n_blocks = b.a_end - b.a_begin;
  if (n_blocks <= 0) return;
  const ExpertArgs a = expert_args(b);
  dispatch_format(b.gate_up, [&]<int KIND, bool SF16>() {
    gate_up_mma_kernel<KIND, SF16><<<dim3(blocks_for(b.inter, kRows), unsigned(n_blocks)), kThreads, 0, s>>>(a);
    MS_CUDA_CHECK_LAUNCH();
  });
  dispatch_format(b.down, [&]<int KIND, bool SF16>() {
    down_mma_kernel<KIND, SF16><<<dim3(blocks_for(b.dim, kRows), unsigned(n_blocks)), kThreads, 0, s>>>(a);
    MS_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace moestream::cuda
