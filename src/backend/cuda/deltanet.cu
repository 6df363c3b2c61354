// Gated DeltaNet on the GPU: causal conv + SiLU, per-head L2 norm of q and k, decay and write
// strength, the delta-rule recurrence (one block per value head, a thread per value column of
// S, tokens in order), and the gated RMSNorm. Prefill runs the same recurrence: it equals the
// CPU's chunked form up to rounding.
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
    s += w[c * kernel + j] * v;
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

// One warp per (token, q or k head): unit length (eps 1e-6 inside the root), q also / sqrt(dk).
__global__ void qk_norm_kernel(float* mixed, int64_t T, int64_t conv_dim, int64_t key_dim, int dk, float q_scale) {
  const int64_t heads = 2 * key_dim / dk;
  const int64_t wi = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (wi >= T * heads) return;
  const int64_t t = wi / heads, hh = wi % heads;
  float* x = mixed + t * conv_dim + hh * dk;
  float ss = 0;
  for (int i = lane; i < dk; i += 32) ss += x[i] * x[i];
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
  qk_norm_kernel<<<blocks_for(warps * 32, 256), 256, 0, s>>>(mixed, T, conv_dim, key_dim, dk,
                                                            1.0f / std::sqrt(float(dk)));
  MS_CUDA_CHECK_LAUNCH();
  gate_kernel<<<blocks_for(T * nv, 256), 256, 0, s>>>(a.data, b.data, T * nv, nv, w.A_log.data, w.dt_bias.data, g, beta);
  MS_CUDA_CHECK_LAUNCH();
  const int threads = (dv + 31) / 32 * 32;
  recurrent_kernel<<<unsigned(nv), threads, size_t(2 * dk) * sizeof(float), s>>>(
      mixed, T, conv_dim, key_dim, nv, nv / nk, dk, dv, g, beta, state.recurrent.data, core, value_dim);
  MS_CUDA_CHECK_LAUNCH();
  gated_norm_kernel<<<unsigned(T * nv), dv >= 128 ? 128 : 32, 0, s>>>(core, z.data, w.norm.data, dv, p.norm_eps,
                                                                       out.data);
  MS_CUDA_CHECK_LAUNCH();
}

}  // namespace moestream::cuda
