// Rotary embeddings and attention with an online softmax over the KV cache.
//
// Attention: one block per (head, query token) of W warps (16 for one query token, whose heads
// alone make too few blocks to keep the GPU's loads in flight; 4 for prefill, which has T x heads
// blocks). Each warp takes every W-th key, keeps its own running max, denominator and weighted
// value sum (lane owns value dims lane + 32c), and the warps merge at the end.
#include "backend/cuda/attention.h"
#include "backend/cuda/common.cuh"

namespace moestream::cuda {

namespace {

__global__ void rope_kernel(float* x, int64_t T, int64_t ld, int n_heads, int head_dim, int half, const float* inv_freq,
                            float factor, bool interleaved, int rot_offset, int64_t n_past) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * n_heads * half) return;
  const int p = int(i % half);
  const int h = int((i / half) % n_heads);
  const int64_t t = i / (int64_t(half) * n_heads);
  // Angles in float32, as transformers computes them.
  const float angle = float(n_past + t) * inv_freq[p];
  const float c = cosf(angle) * factor, s = sinf(angle) * factor;
  float* v = x + t * ld + int64_t(h) * head_dim + rot_offset;
  const int a = interleaved ? 2 * p : p, b = interleaved ? 2 * p + 1 : p + half;
  const float x0 = v[a], x1 = v[b];
  v[a] = x0 * c - x1 * s;
  v[b] = x1 * c + x0 * s;
}

constexpr int kAttnWarps = 4;         // warps per block for several query tokens
constexpr int kAttnDecodeWarps = 16;  // for one
constexpr int kMaxValueChunks = 16;  // value dims per lane: v_head_dim <= 512

struct AttnArgs {
  const float* q;
  int64_t q_ld;
  const float* k_cache;
  int64_t kv_dim;
  const float* v_base;  // value j of kv head h at v_base + j * v_stride + h * v_head
  int64_t v_stride, v_head;
  float* out;
  int64_t out_ld;
  int head_dim, v_dim, group;
  float scale;
  int64_t n_past, window;
  const float* sinks;
};

__global__ void __launch_bounds__(kAttnDecodeWarps * 32) attention_kernel(AttnArgs a) {
  extern __shared__ float smem[];
  float* qs = smem;                             // [head_dim]
  float* part = smem + a.head_dim;              // per warp: m, l, then v_dim sums
  const int h = blockIdx.x, kvh = h / a.group;
  const int64_t t = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const float* qv = a.q + t * a.q_ld + int64_t(h) * a.head_dim;
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) qs[d] = qv[d];
  __syncthreads();
  const int64_t n_keys = a.n_past + t + 1;
  const int64_t first = a.window > 0 && n_keys > a.window ? n_keys - a.window : 0;
  float m = -INFINITY, l = 0.0f;
  float o[kMaxValueChunks];
#pragma unroll
  for (int c = 0; c < kMaxValueChunks; ++c) o[c] = 0.0f;
  for (int64_t j = first + warp; j < n_keys; j += n_warps) {
    const float* kr = a.k_cache + j * a.kv_dim + int64_t(kvh) * a.head_dim;
    float d = 0;
    for (int i = lane; i < a.head_dim; i += 32) d = fmaf(qs[i], kr[i], d);
    const float score = warp_sum(d) * a.scale;
    const float m_new = fmaxf(m, score);
    const float correction = expf(m - m_new), p = expf(score - m_new);
    l = l * correction + p;
    const float* vr = a.v_base + j * a.v_stride + int64_t(kvh) * a.v_head;
#pragma unroll
    for (int c = 0; c < kMaxValueChunks; ++c) {
      const int i = lane + 32 * c;
      if (i < a.v_dim) o[c] = o[c] * correction + p * vr[i];
    }
    m = m_new;
  }
  float* mine = part + warp * (2 + a.v_dim);
  if (lane == 0) {
    mine[0] = m;
    mine[1] = l;
  }
#pragma unroll
  for (int c = 0; c < kMaxValueChunks; ++c) {
    const int i = lane + 32 * c;
    if (i < a.v_dim) mine[2 + i] = o[c];
  }
  __syncthreads();
  // Merge the warps (and the sink, which joins the denominator only).
  float mx = a.sinks ? a.sinks[h] : -INFINITY;
  for (int w = 0; w < n_warps; ++w) mx = fmaxf(mx, part[w * (2 + a.v_dim)]);
  float denom = a.sinks ? expf(a.sinks[h] - mx) : 0.0f;
  for (int w = 0; w < n_warps; ++w) {
    const float* pw = part + w * (2 + a.v_dim);
    if (pw[1] > 0) denom += pw[1] * expf(pw[0] - mx);
  }
  float* ov = a.out + t * a.out_ld + int64_t(h) * a.v_dim;
  for (int i = threadIdx.x; i < a.v_dim; i += blockDim.x) {
    float s = 0;
    for (int w = 0; w < n_warps; ++w) {
      const float* pw = part + w * (2 + a.v_dim);
      if (pw[1] > 0) s += pw[2 + i] * expf(pw[0] - mx);
    }
    ov[i] = s / denom;
  }
}

}  // namespace

void rope(Buffer& x, int n_heads, int head_dim, const RopeTable& r, const float* inv_freq, int64_t n_past,
          cudaStream_t s) {
  const int half = r.rot_dim / 2;
  const int64_t n = x.rows * n_heads * half;
  if (n == 0) return;
  rope_kernel<<<blocks_for(n, 256), 256, 0, s>>>(x.data, x.rows, x.cols, n_heads, head_dim, half, inv_freq,
                                                 r.attention_factor, r.interleaved, r.rot_offset, n_past);
  MS_CUDA_CHECK_LAUNCH();
}

void attention(const Buffer& q, const Buffer& k_cache, const Buffer& v_cache, const AttentionParams& p,
               const float* sinks, Buffer& out, cudaStream_t s) {
  const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
  if (vd > 32 * kMaxValueChunks) fail("cuda attention: value heads of ", vd, " dims (at most ", 32 * kMaxValueChunks, ")");
  const int64_t kv_dim = int64_t(p.n_kv_heads) * hd;
  AttnArgs a;
  a.q = q.data;
  a.q_ld = q.cols;
  a.k_cache = k_cache.data;
  a.kv_dim = kv_dim;
  a.v_base = p.values_in_keys ? k_cache.data : v_cache.data;
  a.v_stride = p.values_in_keys ? kv_dim : int64_t(p.n_kv_heads) * vd;
  a.v_head = p.values_in_keys ? hd : vd;
  a.out = out.data;
  a.out_ld = out.cols;
  a.head_dim = hd;
  a.v_dim = vd;
  a.group = p.n_heads / p.n_kv_heads;
  a.scale = p.scale;
  a.n_past = p.n_past;
  a.window = p.sliding_window;
  a.sinks = sinks;
  const int warps = q.rows == 1 ? kAttnDecodeWarps : kAttnWarps;
  const size_t smem = size_t(hd + warps * (2 + vd)) * sizeof(float);
  if (q.rows == 0) return;
  attention_kernel<<<dim3(unsigned(p.n_heads), unsigned(q.rows)), unsigned(warps) * 32, smem, s>>>(a);
  MS_CUDA_CHECK_LAUNCH();
}

}  // namespace moestream::cuda
