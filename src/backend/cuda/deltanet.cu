// Gated DeltaNet on the GPU: causal conv + SiLU, per-head L2 norm of q and k, decay and write
// strength, the delta-rule recurrence (tiles of 32 columns of a value head's S held in registers
// over the call's tokens, in order), and the gated RMSNorm. Prefill runs the same recurrence: it
// equals the CPU's chunked form up to rounding.
#include <cstdlib>
#include <string>

#include "backend/cuda/common.cuh"
#include "backend/cuda/deltanet.h"

namespace moestream::cuda {

namespace {

__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// mixed[t, c] = silu(sum_j w[c, j] * row(t + j)[c]) over rows [state; x].
__global__ void conv_kernel(const float* x, int64_t T, int64_t C, const float* w, int kernel, const float* state,
                            float* mixed) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * C) return;
  const int64_t t = i / C, c = i % C, hist = kernel - 1;
  float s = 0;
  for (int j = 0; j < kernel; ++j) {
    const int64_t r = t + j;
    const float v = r < hist ? state[r * C + c] : x[(r - hist) * C + c];
    s = fmaf(w[c * kernel + j], v, s);
  }
  mixed[i] = silu(s);
}

// New conv state row i = row T + i of [state; x], into tmp (copied back after).
__global__ void conv_state_kernel(const float* x, int64_t T, int64_t C, int hist, const float* state, float* tmp) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= hist * C) return;
  const int64_t row = i / C, c = i % C, r = T + row;
  tmp[i] = r < hist ? state[r * C + c] : x[(r - hist) * C + c];
}

// A few tokens (decode) in one launch instead of four and a copy: conv_kernel, conv_state_kernel
// (the state updated in place: each thread owns its channels), qk_norm_kernel and gate_kernel, with
// their arithmetic. Warp u < conv_dim / dk takes channels [u dk, u dk + dk), lane l the channels
// l + 32 m; units below 2 key_dim / dk are q and k heads, normalized per token. The warps after
// them compute the gates of T * nv (token, value head) pairs, one a lane.
constexpr int kPrepMaxTokens = 16;

template <int M, int K>  // channels a lane (dk = 32 M), conv kernel width
__global__ void prep_few_kernel(const float* x, int64_t T, int64_t C, const float* w, float* state,
                                float* mixed, int64_t key_dim, float q_scale, const float* a, const float* b, int nv,
                                const float* A_log, const float* dt_bias, float* g, float* beta) {
  constexpr int dk = 32 * M;
  const int64_t u = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  const int64_t units = C / dk;
  if (u >= units) {
    const int64_t i = (u - units) * 32 + lane;
    if (i < T * nv) {
      const int h = int(i % nv);
      g[i] = -expf(A_log[h]) * softplus(a[i] + dt_bias[h]);
      beta[i] = 1.0f / (1.0f + expf(-b[i]));
    }
    return;
  }
  constexpr int hist = K - 1;
  const bool qk = u * dk < 2 * key_dim, is_q = u * dk < key_dim;
  float win[M][K];  // the last `hist` rows of [state; x] before the token, per channel
  float wt[M][K];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int64_t c = u * dk + lane + 32 * m;
#pragma unroll
    for (int j = 0; j < K; ++j) wt[m][j] = w[c * K + j];
#pragma unroll
    for (int r = 0; r < hist; ++r) win[m][r] = state[r * C + c];
  }
  for (int64_t t = 0; t < T; ++t) {
    float y[M];
    float ss = 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int64_t c = u * dk + lane + 32 * m;
      const float xv = x[t * C + c];
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < K; ++j) sum = fmaf(wt[m][j], j < hist ? win[m][j] : xv, sum);
#pragma unroll
      for (int r = 0; r + 1 < hist; ++r) win[m][r] = win[m][r + 1];
      if constexpr (hist > 0) win[m][hist - 1] = xv;
      y[m] = silu(sum);
      ss = fmaf(y[m], y[m], ss);
    }
    if (qk) {
      ss = warp_sum(ss);
      const float inv = 1.0f / sqrtf(ss + 1e-6f);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        y[m] = y[m] * inv;
        if (is_q) y[m] *= q_scale;
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) mixed[t * C + u * dk + lane + 32 * m] = y[m];
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int64_t c = u * dk + lane + 32 * m;
#pragma unroll
    for (int r = 0; r < hist; ++r) state[r * C + c] = win[m][r];
  }
}

// One warp per (token, q or k head): unit length (eps 1e-6 inside the root), q also / sqrt(dk).
__global__ void qk_norm_kernel(float* mixed, int64_t T, int64_t conv_dim, int64_t key_dim, int dk, float q_scale) {
  const int64_t heads = 2 * key_dim / dk;
  const int64_t wi = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (wi >= T * heads) return;
  const int64_t t = wi / heads, hh = wi % heads;
  float* x = mixed + t * conv_dim + hh * dk;
  float ss = 0;
  for (int i = lane; i < dk; i += 32) ss = fmaf(x[i], x[i], ss);
  ss = warp_sum(ss);
  float inv = 1.0f / sqrtf(ss + 1e-6f);
  const bool is_q = hh * dk < key_dim;
  for (int i = lane; i < dk; i += 32) {
    float v = x[i] * inv;
    if (is_q) v *= q_scale;
    x[i] = v;
  }
}

__global__ void gate_kernel(const float* a, const float* b, int64_t n, int nv, const float* A_log,
                            const float* dt_bias, float* g, float* beta) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int h = int(i % nv);
  g[i] = -expf(A_log[h]) * softplus(a[i] + dt_bias[h]);
  beta[i] = 1.0f / (1.0f + expf(-b[i]));
}

// Block = value head h, thread j = column j of S (dk x dv, row i = key dim i).
__global__ void recurrent_kernel(const float* mixed, int64_t T, int64_t conv_dim, int64_t key_dim, int nv,
                                 int group, int dk, int dv, const float* g, const float* beta, float* S_all,
                                 float* core, int64_t value_dim) {
  extern __shared__ float qk[];  // q [dk], k [dk]
  const int h = blockIdx.x, j = threadIdx.x;
  float* S = S_all + int64_t(h) * dk * dv;
  const int kh = h / group;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = mixed + t * conv_dim;
    __syncthreads();
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
      qk[i] = row[int64_t(kh) * dk + i];
      qk[dk + i] = row[key_dim + int64_t(kh) * dk + i];
    }
    __syncthreads();
    if (j >= dv) continue;
    const float decay = expf(g[t * nv + h]), bt = beta[t * nv + h];
    const float v = row[2 * key_dim + int64_t(h) * dv + j];
    float kv = 0;
    for (int i = 0; i < dk; ++i) {
      const float s = S[int64_t(i) * dv + j] * decay;
      S[int64_t(i) * dv + j] = s;
      kv += qk[dk + i] * s;
    }
    const float corr = (v - kv) * bt;
    float o = 0;
    for (int i = 0; i < dk; ++i) {
      const float s = S[int64_t(i) * dv + j] + qk[dk + i] * corr;
      S[int64_t(i) * dv + j] = s;
      o += qk[i] * s;
    }
    core[t * value_dim + int64_t(h) * dv + j] = o;
  }
}

// The same recurrence with the state in registers: block (h, c) holds columns [32 c, 32 c + 32)
// of value head h's S, warp w its rows i = w, w + 8, ... (R of them, dk <= 8 R), read once and
// written once per call however many tokens it has. Each token's two sums over i (k . S and
// q . S of a column) are the warps' partial sums added in warp order, the same for every token
// and every T (so a prefill's tokens compute as single decode steps do).
constexpr int kRecWarps = 8, kRecCols = 32;

template <int R>
__global__ void __launch_bounds__(kRecWarps * 32)
    recurrent_tile_kernel(const float* mixed, int64_t T, int64_t conv_dim, int64_t key_dim, int nv, int group, int dk,
                          int dv, const float* g, const float* beta, float* S_all, float* core, int64_t value_dim) {
  __shared__ float qs[kRecWarps * R], ks[kRecWarps * R];
  __shared__ float part[2][kRecWarps][kRecCols];
  const int h = blockIdx.x, w = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int j = blockIdx.y * kRecCols + lane;
  const bool col = j < dv;
  const int kh = h / group;
  float* S = S_all + int64_t(h) * dk * dv;
  float st[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = w + kRecWarps * r;
    st[r] = col && i < dk ? S[int64_t(i) * dv + j] : 0.0f;
  }
  for (int64_t t = 0; t < T; ++t) {
    const float* row = mixed + t * conv_dim;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
      qs[i] = row[int64_t(kh) * dk + i];
      ks[i] = row[key_dim + int64_t(kh) * dk + i];
    }
    __syncthreads();
    const float decay = expf(g[t * nv + h]), bt = beta[t * nv + h];
    float kv = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = w + kRecWarps * r;
      if (i < dk) {
        st[r] *= decay;
        kv = fmaf(ks[i], st[r], kv);
      }
    }
    part[0][w][lane] = kv;
    __syncthreads();
    kv = 0.0f;
#pragma unroll
    for (int u = 0; u < kRecWarps; ++u) kv += part[0][u][lane];
    const float v = col ? row[2 * key_dim + int64_t(h) * dv + j] : 0.0f;
    const float corr = (v - kv) * bt;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = w + kRecWarps * r;
      if (i < dk) {
        st[r] = fmaf(ks[i], corr, st[r]);
        o = fmaf(qs[i], st[r], o);
      }
    }
    part[1][w][lane] = o;
    __syncthreads();
    if (w == 0 && col) {
      o = 0.0f;
#pragma unroll
      for (int u = 0; u < kRecWarps; ++u) o += part[1][u][lane];
      core[t * value_dim + int64_t(h) * dv + j] = o;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = w + kRecWarps * r;
    if (col && i < dk) S[int64_t(i) * dv + j] = st[r];
  }
}

// One block per (token, value head): out = norm(o) * w * silu(z).
__global__ void gated_norm_kernel(const float* core, const float* z, const float* w, int dv, float eps, float* out) {
  __shared__ float scratch[32];
  const int64_t off = int64_t(blockIdx.x) * dv;
  float ss = 0;
  for (int i = threadIdx.x; i < dv; i += blockDim.x) ss += core[off + i] * core[off + i];
  ss = block_sum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / float(dv) + eps);
  for (int i = threadIdx.x; i < dv; i += blockDim.x) out[off + i] = w[i] * (core[off + i] * inv) * silu(z[off + i]);
}

// MOESTREAM_CUDA_DELTANET_PREP=0: a few tokens' conv, norms and gates as four launches and a copy,
// as a prompt's, for comparison.
bool deltanet_prep_off() {
  static const bool off = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_DELTANET_PREP");
    return v && std::string(v) == "0";
  }();
  return off;
}

}  // namespace

void gated_delta_net(const Buffer& qkv, const Buffer& z, const Buffer& b, const Buffer& a,
                     const DeltaNetWeights& w, const DeltaNetParams& p, DeltaNetState& state, Buffer& out,
                     Scratch& scratch, cudaStream_t s) {
  const int64_t T = qkv.rows, conv_dim = qkv.cols;
  const int nk = p.n_k_heads, nv = p.n_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
  const int64_t key_dim = int64_t(nk) * dk, value_dim = int64_t(nv) * dv;
  if (nk <= 0 || nv % nk != 0 || conv_dim != 2 * key_dim + value_dim || z.cols != value_dim ||
      out.cols != value_dim || b.cols != nv || a.cols != nv ||
      state.recurrent.rows != int64_t(nv) * dk || state.recurrent.cols != dv ||
      state.conv.rows != p.conv_kernel - 1 || state.conv.cols != conv_dim)
    fail("gated_delta_net: shapes do not match ", nv, " value heads over ", nk, " key heads of ", dk, "/", dv);
  if (dv > 1024) fail("cuda gated_delta_net: value heads of ", dv, " dims (at most 1024)");
  if (T == 0) return;
  float* mixed = scratch.get(0, size_t(T * conv_dim));
  float* g = scratch.get(1, size_t(T * nv));
  float* beta = scratch.get(2, size_t(T * nv));
  float* core = scratch.get(3, size_t(T * value_dim));
  const float q_scale = 1.0f / std::sqrt(float(dk));
  if (T <= kPrepMaxTokens && p.conv_kernel == 4 && dk % 32 == 0 && dk <= 128 && conv_dim % dk == 0 &&
      !deltanet_prep_off()) {
    const int64_t warps = conv_dim / dk + (T * nv + 31) / 32;
    auto prep = [&](auto kernel) {
      kernel<<<blocks_for(warps * 32, 256), 256, 0, s>>>(qkv.data, T, conv_dim, w.conv.data, state.conv.data, mixed,
                                                         key_dim, q_scale, a.data, b.data, nv, w.A_log.data,
                                                         w.dt_bias.data, g, beta);
    };
    if (dk == 32) prep(prep_few_kernel<1, 4>);
    else if (dk == 64) prep(prep_few_kernel<2, 4>);
    else if (dk == 96) prep(prep_few_kernel<3, 4>);
    else prep(prep_few_kernel<4, 4>);
    MS_CUDA_CHECK_LAUNCH();
  } else {
    const int hist = p.conv_kernel - 1;
    float* tmp = scratch.get(4, size_t(std::max<int64_t>(1, hist * conv_dim)));
    conv_kernel<<<blocks_for(T * conv_dim, 256), 256, 0, s>>>(qkv.data, T, conv_dim, w.conv.data, p.conv_kernel,
                                                             state.conv.data, mixed);
    MS_CUDA_CHECK_LAUNCH();
    if (hist > 0) {
      conv_state_kernel<<<blocks_for(hist * conv_dim, 256), 256, 0, s>>>(qkv.data, T, conv_dim, hist,
                                                                        state.conv.data, tmp);
      MS_CUDA_CHECK_LAUNCH();
      MS_CUDA_CHECK(cudaMemcpyAsync(state.conv.data, tmp, size_t(hist * conv_dim) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, s));
    }
    const int64_t warps = T * 2 * key_dim / dk;
    qk_norm_kernel<<<blocks_for(warps * 32, 256), 256, 0, s>>>(mixed, T, conv_dim, key_dim, dk, q_scale);
    MS_CUDA_CHECK_LAUNCH();
    gate_kernel<<<blocks_for(T * nv, 256), 256, 0, s>>>(a.data, b.data, T * nv, nv, w.A_log.data, w.dt_bias.data, g,
                                                        beta);
    MS_CUDA_CHECK_LAUNCH();
  }
  const dim3 tiles(unsigned(nv), unsigned((dv + kRecCols - 1) / kRecCols));
  auto tile = [&](auto kernel) {
    kernel<<<tiles, kRecWarps * 32, 0, s>>>(mixed, T, conv_dim, key_dim, nv, nv / nk, dk, dv, g, beta,
                                           state.recurrent.data, core, value_dim);
  };
  if (dk <= kRecWarps * 4) {
    tile(recurrent_tile_kernel<4>);
  } else if (dk <= kRecWarps * 8) {
    tile(recurrent_tile_kernel<8>);
  } else if (dk <= kRecWarps * 16) {
    tile(recurrent_tile_kernel<16>);
  } else {  // wider key heads than any published model's: a thread per column, S in global memory
    const int threads = (dv + 31) / 32 * 32;
    recurrent_kernel<<<unsigned(nv), threads, size_t(2 * dk) * sizeof(float), s>>>(
        mixed, T, conv_dim, key_dim, nv, nv / nk, dk, dv, g, beta, state.recurrent.data, core, value_dim);
  }
  MS_CUDA_CHECK_LAUNCH();
  gated_norm_kernel<<<unsigned(T * nv), dv >= 128 ? 128 : 32, 0, s>>>(core, z.data, w.norm.data, dv, p.norm_eps,
                                                                       out.data);
  MS_CUDA_CHECK_LAUNCH();
}

}  // namespace moestream::cuda
