// Rotary embeddings and attention with an online softmax over the KV cache.
//
// Attention: one block per (head, query token) of W warps (16 for one query token, whose heads
// alone make too few blocks to keep the GPU's loads in flight; 4 for prefill, which has T x heads
// blocks). Each warp takes every W-th key, keeps its own running max, denominator and weighted
// value sum (lane owns value dims lane + 32c), and the warps merge at the end.
//
// Prefill takes the tensor cores where it applies (attention_mma_kernel, float32 accuracy through
// FP16 halves), the float32 tiled kernel otherwise.
//
// KV caches of other types (backend/kv_cache.h) are read through the same kernel, instantiated per
// type, each value unpacked as it is read; a KV window maps positions to ring rows, and a ring's
// new rows are staged first so that a batch longer than the ring still reads every key it needs.
#include "backend/cuda/attention.h"

#include <cstdlib>
#include <string>
#include <type_traits>

#include "backend/cuda/common.cuh"
#include "backend/cuda/mma.cuh"
#include "core/quant.h"

namespace moestream::cuda {

namespace {

// Pair p of one head (head points at its first rotated dim) rotated at `pos`. Angles in float32,
// as transformers computes them.
__device__ __forceinline__ void rotate_pair(float* head, int p, int half, int64_t pos, const float* inv_freq,
                                            float factor, bool interleaved) {
  const float angle = float(pos) * inv_freq[p];
  const float c = cosf(angle) * factor, s = sinf(angle) * factor;
  const int a = interleaved ? 2 * p : p, b = interleaved ? 2 * p + 1 : p + half;
  const float x0 = head[a], x1 = head[b];
  head[a] = x0 * c - x1 * s;
  head[b] = x1 * c + x0 * s;
}

__global__ void rope_kernel(float* x, int64_t T, int64_t ld, int n_heads, int head_dim, int half, const float* inv_freq,
                            float factor, bool interleaved, int rot_offset, int64_t n_past) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * n_heads * half) return;
  const int p = int(i % half);
  const int h = int((i / half) % n_heads);
  const int64_t t = i / (int64_t(half) * n_heads);
  rotate_pair(x + t * ld + int64_t(h) * head_dim + rot_offset, p, half, n_past + t, inv_freq, factor, interleaved);
}

// What qk_norm_rope_kernel needs besides the rows and their positions.
struct NormRope {
  float *q, *k;
  const float *q_norm, *k_norm;
  float eps;
  int n_heads, head_dim, half;
  const float* inv_freq;
  float factor;
  bool interleaved;
  int rot_offset;
  int64_t ldq, ldk;
};

// Block (row t, head h) of q then k: the head's RMSNorm (when its weight is given; the sums of
// rmsnorm_kernel with the same threads), then its RoPE at pos, as rmsnorm() then rope() compute them.
__device__ __forceinline__ void norm_rope_head(const NormRope& a, int64_t t, int h, int64_t pos) {
  __shared__ float scratch[32];
  const bool is_q = h < a.n_heads;
  float* head = is_q ? a.q + t * a.ldq + int64_t(h) * a.head_dim : a.k + t * a.ldk + int64_t(h - a.n_heads) * a.head_dim;
  const float* w = is_q ? a.q_norm : a.k_norm;
  if (w) {
    float ss = 0;
    for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) ss += head[i] * head[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / float(a.head_dim) + a.eps);
    for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) head[i] = w[i] * (head[i] * inv);
    __syncthreads();
  }
  for (int p = threadIdx.x; p < a.half; p += blockDim.x)
    rotate_pair(head + a.rot_offset, p, a.half, pos, a.inv_freq, a.factor, a.interleaved);
}

// One block per (token, head): tokens at positions n_past + t.
__global__ void qk_norm_rope_kernel(NormRope a, int64_t n_past) {
  wait_prior_grid();
  allow_next_grid();
  norm_rope_head(a, blockIdx.x, blockIdx.y, n_past + blockIdx.x);
}

// One block per (decode row, head): row rows.row[i] at position rows.pos[i].
__global__ void qk_norm_rope_rows_kernel(NormRope a, DecodeRows rows) {
  wait_prior_grid();
  allow_next_grid();
  norm_rope_head(a, rows.row[blockIdx.x], blockIdx.y, rows.pos[blockIdx.x]);
}

constexpr int kAttnWarps = 4;         // warps per block for several query tokens
constexpr int kAttnDecodeWarps = 16;  // for one
constexpr int kMaxValueChunks = 16;  // value dims per lane: v_head_dim <= 512

__constant__ float kFp8Table[256];  // E4M3 code -> float, uploaded once

// Where the kernel finds the row of position j and how it unpacks a value (backend/kv_cache.h).
struct KvRows {
  const float* cache;   // row r at cache + r * words
  const float* staged;  // this call's new rows (a ring's), or null: position n_past + t at staged + t * words
  int64_t words, n_past, sinks, window;
  bool ring;
  int heads;  // scale groups of a row (fp8, q8)
  __device__ const float* row(int64_t j) const {
    if (staged && j >= n_past) return staged + (j - n_past) * words;
    const int64_t slot = window <= 0 || !ring || j < sinks ? j : sinks + (j - sinks) % window;
    return cache + slot * words;
  }
};

template <KvType T>
__device__ __forceinline__ float kv_value(const float* row, int heads, int64_t c, float scale) {
  if constexpr (T == KvType::F32) return row[c];
  if constexpr (T == KvType::BF16) return bf16_bits_to_f32(reinterpret_cast<const uint16_t*>(row)[c]);
  if constexpr (T == KvType::F16) return f16_bits_to_f32(reinterpret_cast<const uint16_t*>(row)[c]);
  if constexpr (T == KvType::Fp8) return kFp8Table[reinterpret_cast<const uint8_t*>(row + heads)[c]] * scale;
  if constexpr (T == KvType::Q8) return float(reinterpret_cast<const int8_t*>(row + heads)[c]) * scale;
  return 0.0f;
}

struct AttnArgs {
  const float* q;
  int64_t q_ld;
  KvRows k, v;          // values: v, or (MLA) the key rows again
  int64_t v_head;       // offset of kv head h's values in a value row: h * v_head
  float* out;
  int64_t out_ld;
  int head_dim, v_dim, group;
  float scale;
  int64_t n_past, window;
  int64_t kv_window, kv_sinks;  // KV window: keys [0, sinks) and the latest kv_window
  const float* sinks;
  // One query row whose new key and value are read from k.staged / v.staged: the blocks of each
  // KV head's first query head store that head's key and value into these cache rows (F32).
  float* k_append = nullptr;
  float* v_append = nullptr;
};

// The new key and value of KV head h / group into the cache rows a.k_append / a.v_append (the
// block of the group's first query head), as the cache append copies them.
__device__ __forceinline__ void append_head(const AttnArgs& a) {
  if (!a.k_append || blockIdx.x % a.group) return;
  const int kvh = blockIdx.x / a.group;
  const int64_t k0 = int64_t(kvh) * a.head_dim, v0 = int64_t(kvh) * a.v_head;
  for (int i = threadIdx.x; i < a.head_dim; i += blockDim.x) a.k_append[k0 + i] = a.k.staged[k0 + i];
  for (int i = threadIdx.x; i < a.v_dim; i += blockDim.x) a.v_append[v0 + i] = a.v.staged[v0 + i];
}

// Block (head blockIdx.x, query row t) of attention. CH > 0 (key and value heads of at most
// 32 x CH dims): each warp loads its next key's and value's row while it computes with the
// current ones, the same sums in the same order as CH = 0, which loads each row when it uses it.
template <KvType T, int CH>
__device__ __forceinline__ void attend_row(const AttnArgs& a, int64_t t) {
  extern __shared__ float smem[];
  float* qs = smem;                             // [head_dim]
  float* part = smem + a.head_dim;              // per warp: m, l, then v_dim sums
  const int h = blockIdx.x, kvh = h / a.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  const float* qv = a.q + t * a.q_ld + int64_t(h) * a.head_dim;
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) qs[d] = qv[d];
  __syncthreads();
  const int64_t n_keys = a.n_past + t + 1;
  const int64_t first = a.window > 0 && n_keys > a.window ? n_keys - a.window : 0;
  // Visible keys as one index n: [first, sink_end) then [recent, n_keys).
  int64_t sink_end = n_keys, recent = n_keys;
  if (a.kv_window > 0) {
    recent = max(first, n_keys > a.kv_window ? n_keys - a.kv_window : int64_t(0));
    sink_end = max(first, min(min(a.kv_sinks, recent), n_keys));
  }
  const int64_t n_sink = sink_end - first, count = n_sink + (n_keys - recent);
  float m = -INFINITY, l = 0.0f;
  float o[kMaxValueChunks];
#pragma unroll
  for (int c = 0; c < kMaxValueChunks; ++c) o[c] = 0.0f;
  const int64_t k0 = int64_t(kvh) * a.head_dim, v0 = int64_t(kvh) * a.v_head;
  if constexpr (CH > 0) {
    // Key n's row values (lane + 32c) of this warp's KV head.
    auto fetch = [&](int64_t n, float (&kx)[CH], float (&vx)[CH]) {
      const int64_t j = n < n_sink ? first + n : recent + (n - n_sink);
      const float* kr = a.k.row(j);
      const float* vr = a.v.row(j);
      const float ks = T == KvType::Fp8 || T == KvType::Q8 ? kr[kvh] : 1.0f;
      const float vs = T == KvType::Fp8 || T == KvType::Q8 ? vr[kvh] : 1.0f;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const int i = lane + 32 * c;
        kx[c] = i < a.head_dim ? kv_value<T>(kr, a.k.heads, k0 + i, ks) : 0.0f;
        vx[c] = i < a.v_dim ? kv_value<T>(vr, a.v.heads, v0 + i, vs) : 0.0f;
      }
    };
    float kc[CH], vc[CH];
    if (warp < count) fetch(warp, kc, vc);
    for (int64_t n = warp; n < count; n += n_warps) {
      float kn[CH], vn[CH];
      const bool more = n + n_warps < count;
      if (more) fetch(n + n_warps, kn, vn);
      float d = 0;
#pragma unroll
      for (int c = 0; c < CH; ++c)
        if (lane + 32 * c < a.head_dim) d = fmaf(qs[lane + 32 * c], kc[c], d);
      const float score = warp_sum(d) * a.scale;
      const float m_new = fmaxf(m, score);
      const float correction = expf(m - m_new), p = expf(score - m_new);
      l = l * correction + p;
#pragma unroll
      for (int c = 0; c < CH; ++c)
        if (lane + 32 * c < a.v_dim) o[c] = o[c] * correction + p * vc[c];
      m = m_new;
      if (more) {
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          kc[c] = kn[c];
          vc[c] = vn[c];
        }
      }
    }
  } else {
    for (int64_t n = warp; n < count; n += n_warps) {
      const int64_t j = n < n_sink ? first + n : recent + (n - n_sink);
      const float* kr = a.k.row(j);
      const float ks = T == KvType::Fp8 || T == KvType::Q8 ? kr[kvh] : 1.0f;
      float d = 0;
      for (int i = lane; i < a.head_dim; i += 32) d = fmaf(qs[i], kv_value<T>(kr, a.k.heads, k0 + i, ks), d);
      const float score = warp_sum(d) * a.scale;
      const float m_new = fmaxf(m, score);
      const float correction = expf(m - m_new), p = expf(score - m_new);
      l = l * correction + p;
      const float* vr = a.v.row(j);
      const float vs = T == KvType::Fp8 || T == KvType::Q8 ? vr[kvh] : 1.0f;
#pragma unroll
      for (int c = 0; c < kMaxValueChunks; ++c) {
        const int i = lane + 32 * c;
        if (i < a.v_dim) o[c] = o[c] * correction + p * kv_value<T>(vr, a.v.heads, v0 + i, vs);
      }
      m = m_new;
    }
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

template <KvType T, int CH>
__global__ void __launch_bounds__(kAttnDecodeWarps * 32) attention_kernel(AttnArgs a) {
  wait_prior_grid();
  allow_next_grid();
  append_head(a);
  attend_row<T, CH>(a, blockIdx.y);
}

// Heads of at most 32 x kPipelinedChunks dims take the pipelined key loop (attend_row).
constexpr int kPipelinedChunks = 4;
// MOESTREAM_CUDA_ATTN_PIPELINE=0: every head through the loop that loads each row when it uses it.
// Read at each launch, so that a test can compare the two loops in one process.
bool pipelined(int head_dim, int v_dim) {
  const char* v = std::getenv("MOESTREAM_CUDA_ATTN_PIPELINE");
  const bool on = !(v && std::string(v) == "0");
  return on && head_dim <= 32 * kPipelinedChunks && v_dim <= 32 * kPipelinedChunks;
}

// MOESTREAM_CUDA_ATTN_MMA=0: prefill through the float32 tiled kernel instead of the tensor
// cores. Read at each launch, like the switch above.
bool attention_mma_enabled() {
  const char* v = std::getenv("MOESTREAM_CUDA_ATTN_MMA");
  return !(v && std::string(v) == "0");
}

// One block per (head, decode row): row rows.row[i] at position rows.pos[i], over its own caches
// (each row one query, as attention_kernel computes a lone decode step). The row's new key and
// value are read from k and v, and stored into its caches by append_head.
template <KvType T, int CH>
__global__ void __launch_bounds__(kAttnDecodeWarps * 32) attention_rows_kernel(AttnArgs a, DecodeRows rows, const float* k,
                                                                               int64_t ldk, const float* v, int64_t ldv) {
  wait_prior_grid();
  allow_next_grid();
  const int i = blockIdx.y;
  a.q += rows.row[i] * a.q_ld;
  a.out += rows.row[i] * a.out_ld;
  a.k.cache = rows.k_cache[i];
  a.v.cache = rows.v_cache[i];
  a.k.staged = k + rows.row[i] * ldk;
  a.v.staged = v + rows.row[i] * ldv;
  a.n_past = a.k.n_past = a.v.n_past = rows.pos[i];
  a.k_append = rows.k_cache[i] + rows.pos[i] * a.k.words;
  a.v_append = rows.v_cache[i] + rows.pos[i] * a.v.words;
  append_head(a);
  attend_row<T, CH>(a, 0);
}

// Prefill attention in tiles: a block takes kPrefillRows (query token, head) rows that share one
// KV head (kPrefillRows / group tokens x the group's heads) and walks the keys kPrefillKeys at a
// time, staged in shared memory with the queries, so every key and value row read serves all the
// block's rows (the per-row kernel above reads each once per head and query). Scores, online
// softmax and value sums in float32, as above; only the order of the sums differs. Thread
// (ty, tx) of the 8 x 16 grid owns rows ty and ty + 16, keys tx + 8i of a tile for the scores, and
// dims 4 tx + 32 c (+0..3) of its two rows' outputs.
constexpr int kPrefillRows = 32;
constexpr int kPrefillKeys = 32;
constexpr int kPrefillThreads = 128;

template <int HD>
constexpr size_t prefill_smem_floats() {
  return size_t(kPrefillRows + 2 * kPrefillKeys) * (HD + 4) + size_t(kPrefillRows) * (kPrefillKeys + 1);
}

template <KvType T, int HD>
__global__ void __launch_bounds__(kPrefillThreads) attention_prefill_kernel(AttnArgs a, int64_t n_tokens) {
  extern __shared__ float smem[];
  constexpr int ld = HD + 4, chunks = HD / 32;
  float* qs = smem;                              // [rows][ld]
  float* ks = qs + kPrefillRows * ld;            // [keys][ld]
  float* vs = ks + kPrefillKeys * ld;            // [keys][ld]
  float* ps = vs + kPrefillKeys * ld;            // [rows][keys + 1]
  const int kvh = blockIdx.x, per_block = kPrefillRows / a.group;
  const int64_t t0 = int64_t(blockIdx.y) * per_block;
  const int tid = threadIdx.x, tx = tid % 8, ty = tid / 8;
  // Row r: token t0 + r / group, head kvh * group + r % group.
  for (int i = tid; i < kPrefillRows * HD; i += kPrefillThreads) {
    const int r = i / HD, d = i % HD;
    const int64_t t = t0 + r / a.group;
    const int h = kvh * a.group + r % a.group;
    qs[r * ld + d] = t < n_tokens ? a.q[t * a.q_ld + int64_t(h) * HD + d] : 0.0f;
  }
  // The visible keys of each of this thread's two rows: [first, sink_end) and [recent, n_keys).
  int64_t first[2], sink_end[2], recent[2], n_keys[2];
  float m[2], l[2], o[2][chunks][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = ty + 16 * i;
    const int64_t t = t0 + r / a.group;
    n_keys[i] = t < n_tokens ? a.n_past + t + 1 : 0;
    first[i] = a.window > 0 && n_keys[i] > a.window ? n_keys[i] - a.window : 0;
    sink_end[i] = n_keys[i];
    recent[i] = n_keys[i];
    if (a.kv_window > 0) {
      recent[i] = max(first[i], n_keys[i] > a.kv_window ? n_keys[i] - a.kv_window : int64_t(0));
      sink_end[i] = max(first[i], min(min(a.kv_sinks, recent[i]), n_keys[i]));
    }
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < chunks; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][c][e] = 0.0f;
  }
  const int64_t t_last = min(n_tokens, t0 + per_block) - 1;
  const int64_t j_end = a.n_past + t_last + 1;  // past the last row's keys
  int64_t j_begin = j_end;                      // the first row's first visible key
  {
    const int64_t nk = a.n_past + t0 + 1;
    j_begin = a.window > 0 && nk > a.window ? nk - a.window : 0;
  }
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kPrefillKeys) {
    // Skip tiles no row of the block sees (a KV window's gap between sinks and recent keys).
    bool any = false;
#pragma unroll
    for (int i = 0; i < 2; ++i)
      any |= (j0 < sink_end[i] && j0 + kPrefillKeys > first[i]) || (j0 < n_keys[i] && j0 + kPrefillKeys > recent[i]);
    if (!__syncthreads_or(any)) continue;
    for (int i = tid; i < kPrefillKeys * HD; i += kPrefillThreads) {
      const int key = i / HD, d = i % HD;
      const int64_t j = j0 + key;
      float kv = 0.0f, vv = 0.0f;
      if (j < j_end) {
        const float* kr = a.k.row(j);
        const float* vr = a.v.row(j);
        const float ksc = T == KvType::Fp8 || T == KvType::Q8 ? kr[kvh] : 1.0f;
        const float vsc = T == KvType::Fp8 || T == KvType::Q8 ? vr[kvh] : 1.0f;
        kv = kv_value<T>(kr, a.k.heads, int64_t(kvh) * HD + d, ksc);
        vv = kv_value<T>(vr, a.v.heads, int64_t(kvh) * a.v_head + d, vsc);
      }
      ks[key * ld + d] = kv;
      vs[key * ld + d] = vv;
    }
    __syncthreads();
    float sc[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) sc[i][k] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < HD; d += 4) {
      float4 q4[2], k4[4];
#pragma unroll
      for (int i = 0; i < 2; ++i) q4[i] = *reinterpret_cast<const float4*>(qs + (ty + 16 * i) * ld + d);
#pragma unroll
      for (int k = 0; k < 4; ++k) k4[k] = *reinterpret_cast<const float4*>(ks + (tx + 8 * k) * ld + d);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          sc[i][k] = fmaf(q4[i].x, k4[k].x, sc[i][k]);
          sc[i][k] = fmaf(q4[i].y, k4[k].y, sc[i][k]);
          sc[i][k] = fmaf(q4[i].z, k4[k].z, sc[i][k]);
          sc[i][k] = fmaf(q4[i].w, k4[k].w, sc[i][k]);
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t j = j0 + tx + 8 * k;
        const bool seen = (j >= first[i] && j < sink_end[i]) || (j >= recent[i] && j < n_keys[i]);
        sc[i][k] = seen ? sc[i][k] * a.scale : -INFINITY;
        mx = fmaxf(mx, sc[i][k]);
      }
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m[i], mx);
      const float correction = m_new == -INFINITY ? 1.0f : expf(m[i] - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float p = sc[i][k] == -INFINITY ? 0.0f : expf(sc[i][k] - m_new);
        ps[(ty + 16 * i) * (kPrefillKeys + 1) + tx + 8 * k] = p;
        sum += p;
      }
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l[i] = l[i] * correction + sum;
      m[i] = m_new;
#pragma unroll
      for (int c = 0; c < chunks; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][c][e] *= correction;
    }
    __syncwarp();  // a row's probabilities come from the 8 threads of its own warp
#pragma unroll 4
    for (int key = 0; key < kPrefillKeys; ++key) {
      const float p0 = ps[ty * (kPrefillKeys + 1) + key], p1 = ps[(ty + 16) * (kPrefillKeys + 1) + key];
#pragma unroll
      for (int c = 0; c < chunks; ++c) {
        const float4 v4 = *reinterpret_cast<const float4*>(vs + key * ld + 4 * tx + 32 * c);
        o[0][c][0] = fmaf(p0, v4.x, o[0][c][0]);
        o[0][c][1] = fmaf(p0, v4.y, o[0][c][1]);
        o[0][c][2] = fmaf(p0, v4.z, o[0][c][2]);
        o[0][c][3] = fmaf(p0, v4.w, o[0][c][3]);
        o[1][c][0] = fmaf(p1, v4.x, o[1][c][0]);
        o[1][c][1] = fmaf(p1, v4.y, o[1][c][1]);
        o[1][c][2] = fmaf(p1, v4.z, o[1][c][2]);
        o[1][c][3] = fmaf(p1, v4.w, o[1][c][3]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = ty + 16 * i;
    const int64_t t = t0 + r / a.group;
    if (t >= n_tokens) continue;
    const int h = kvh * a.group + r % a.group;
    // The sink (gpt-oss) joins the denominator only.
    const float mx = a.sinks ? fmaxf(m[i], a.sinks[h]) : m[i];
    const float w = m[i] == -INFINITY ? 0.0f : expf(m[i] - mx);
    const float denom = l[i] * w + (a.sinks ? expf(a.sinks[h] - mx) : 0.0f);
    float* ov = a.out + t * a.out_ld + int64_t(h) * HD;
#pragma unroll
    for (int c = 0; c < chunks; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) ov[4 * tx + 32 * c + e] = o[i][c][e] * w / denom;
  }
}

// Prefill attention on the tensor cores, to float32 accuracy (attention_mma_kernel). A block of
// 4 warps (8 for heads of 256 dims: mma_split) takes kMmaRows (query token, head) rows that share
// one KV head (the heads of kMmaRows / group tokens), 16 a warp (or a pair), and walks the keys
// kMmaKeys at a time. Every operand is split into FP16 halves, hi = fp16(x) and lo = fp16(x - hi),
// after a power of two has put its largest magnitude in [2^14, 2^15): queries per row, a tile's
// keys and its values per tile. hi x hi + hi x lo + lo x hi (three MMAs, float32 sums) keeps 22
// bits of every value above 2^-17 of its scale's largest and an absolute error below 2^-39 of it
// for smaller ones, as the exact expert kernels do (expert_exact_mma.cu). Scores are scaled back
// in float32, and the online softmax runs in float32 as in the kernels above but in base 2 (scores
// times log2 e, exp2f); its probabilities (times 2^kMmaProbExp, so that small ones stay normal
// FP16) are split the same way for the products with the values. The value sums are kept in units
// of a recent tile's value scale (a power of two: rescaling them is exact). Keys and values of
// caches without a KV window are split once per call (SplitKv); otherwise each block splits the
// tiles it reads.
constexpr int kMmaRows = 64;
constexpr int kMmaKeys = 32;
constexpr int kMmaThreads = 128;  // a block of rows; heads of 256 dims take two (mma_split)
constexpr int kMmaProbExp = 12;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxUnitStep = 64;    // value sums stay below 2^(27 + 64) x their denominator
constexpr int kNoUnit = -(1 << 20);  // MmaRows::v_exp before the first tile

// Warps per 16 rows: heads of 256 dims split their value dims over two warps (both compute the
// rows' scores), so that no thread holds more than 64 value sums.
template <int HD>
constexpr int mma_split() {
  return HD > 128 ? 2 : 1;
}
template <int HD>
constexpr int mma_threads() {
  return kMmaThreads * mma_split<HD>();
}

// Offset (halves) of column col of row `row` in a shared [rows][HD] FP16 array whose 16-byte
// chunks are permuted by the row's low 3 bits, so that ldmatrix's 8 rows at one chunk hit
// distinct banks.
template <int HD>
__device__ __forceinline__ int mma_swz(int row, int col) {
  return row * HD + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// The power of two that puts a largest magnitude m in [2^14, 2^15); 0 for zero, inf or NaN.
__device__ __forceinline__ int split_exp(float m) {
  if (!(m > 0.0f) || isinf(m)) return 0;
  int e;
  frexpf(m, &e);
  return min(max(15 - e, -120), 120);
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) {
  return *reinterpret_cast<const uint32_t*>(&h);
}

// x and y split into hi and lo FP16 pairs (x in the low half, as the MMA fragments order them).
__device__ __forceinline__ void split2(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x, y);
  const float2 back = __half22float2(h);
  hi = half2_bits(h);
  lo = half2_bits(__floats2half2_rn(x - back.x, y - back.y));
}

// Four values (already scaled) split into columns col..col + 3 of `row` of hi and lo.
template <int HD>
__device__ __forceinline__ void store_split4(__half* hi, __half* lo, int row, int col, float4 v) {
  uint2 h, l;
  split2(v.x, v.y, h.x, l.x);
  split2(v.z, v.w, h.y, l.y);
  const int off = mma_swz<HD>(row, col);
  *reinterpret_cast<uint2*>(hi + off) = h;
  *reinterpret_cast<uint2*>(lo + off) = l;
}

__device__ __forceinline__ float abs_max4(float4 v) {
  return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
}
__device__ __forceinline__ float4 scale4(float4 v, float f) {
  return make_float4(v.x * f, v.y * f, v.z * f, v.w * f);
}

// Values col..col + 3 of KV head kvh's part (at head_off) of position j's row.
template <KvType T>
__device__ __forceinline__ float4 kv_load4(const KvRows& rows, int64_t j, int kvh, int64_t head_off, int col) {
  const float* r = rows.row(j);
  if constexpr (T == KvType::F32) {
    return *reinterpret_cast<const float4*>(r + head_off + col);
  } else {
    const float sc = T == KvType::Fp8 || T == KvType::Q8 ? r[kvh] : 1.0f;
    const int64_t c = head_off + col;
    return make_float4(kv_value<T>(r, rows.heads, c, sc), kv_value<T>(r, rows.heads, c + 1, sc),
                       kv_value<T>(r, rows.heads, c + 2, sc), kv_value<T>(r, rows.heads, c + 3, sc));
  }
}

// Keys (or values) j0 .. j0 + kMmaKeys - 1 of KV head kvh (zeros from j_end on) scaled by one
// power of two and split into hi and lo; returns the exponent. The rows are read twice (their
// largest magnitude, then the split), so no thread holds its share of the tile in registers.
// red: a float of shared memory per warp of the block (mma_threads).
template <KvType T, int HD>
__device__ __forceinline__ int load_split_tile(const KvRows& rows, int j0, int j_end, int kvh, int64_t head_off,
                                               __half* hi, __half* lo, float* red) {
  constexpr int threads = mma_threads<HD>(), per = kMmaKeys * HD / 4 / threads;
  const int tid = threadIdx.x;
  float mx = 0.0f;
#pragma unroll
  for (int i = 0; i < per; ++i) {
    const int idx = tid + i * threads, key = idx / (HD / 4), col = idx % (HD / 4) * 4;
    if (j0 + key < j_end) mx = fmaxf(mx, abs_max4(kv_load4<T>(rows, j0 + key, kvh, head_off, col)));
  }
  mx = warp_max(mx);
  if (tid % 32 == 0) red[tid / 32] = mx;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < threads / 32; ++w) mx = fmaxf(mx, red[w]);
  const int e = split_exp(mx);
  const float f = ldexpf(1.0f, e);
#pragma unroll
  for (int i = 0; i < per; ++i) {
    const int idx = tid + i * threads, key = idx / (HD / 4), col = idx % (HD / 4) * 4;
    const float4 v =
        j0 + key < j_end ? kv_load4<T>(rows, j0 + key, kvh, head_off, col) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    store_split4<HD>(hi, lo, key, col, scale4(v, f));
  }
  return e;
}

// Caches without a KV window: each key and value tile split once per call (split_kv_kernel)
// instead of once per block that reads it. For each KV head, positions [0, rows) (rows a multiple
// of kMmaKeys, zeros past the call's last key) as hi and lo halves in the kernel's swizzled
// shared-memory order, and each tile's exponent.
struct SplitKv {
  __half *k_hi, *k_lo, *v_hi, *v_lo;  // [head][rows][HD]
  int *k_exp, *v_exp;                 // [head][rows / kMmaKeys]
  int64_t rows;
};

// The positions a SplitKv of `keys` keys holds: whole tiles.
int64_t split_kv_rows(int64_t keys) { return (keys + kMmaKeys - 1) / kMmaKeys * kMmaKeys; }

// Bytes of a SplitKv of `keys` keys.
size_t split_kv_bytes(int64_t keys, int kv_heads, int hd) {
  const size_t rows = size_t(split_kv_rows(keys));
  return rows * kv_heads * hd * 4 * sizeof(__half) + 2 * (rows / kMmaKeys) * kv_heads * sizeof(int);
}

SplitKv split_kv_layout(void* area, int64_t keys, int kv_heads, int hd) {
  SplitKv sk;
  sk.rows = split_kv_rows(keys);
  const size_t n = size_t(sk.rows) * kv_heads * hd;
  sk.k_hi = static_cast<__half*>(area);
  sk.k_lo = sk.k_hi + n;
  sk.v_hi = sk.k_lo + n;
  sk.v_lo = sk.v_hi + n;
  sk.k_exp = reinterpret_cast<int*>(sk.v_lo + n);
  sk.v_exp = sk.k_exp + sk.rows / kMmaKeys * kv_heads;
  return sk;
}

// Block (tile, KV head, keys or values): that tile split into sk as load_split_tile splits it,
// each thread's share held in registers between the tile's largest magnitude and the split.
template <KvType T, int HD>
__global__ void __launch_bounds__(kMmaThreads) split_kv_kernel(KvRows k, KvRows v, int64_t v_head, int keys, SplitKv sk) {
  constexpr int per = kMmaKeys * HD / 4 / kMmaThreads;
  __shared__ float red[4];
  const int tile = blockIdx.x, kvh = blockIdx.y, tid = threadIdx.x, j0 = tile * kMmaKeys;
  const bool values = blockIdx.z == 1;
  const KvRows& rows = values ? v : k;
  const int64_t head_off = values ? int64_t(kvh) * v_head : int64_t(kvh) * HD;
  float4 x[per];
  float mx = 0.0f;
#pragma unroll
  for (int i = 0; i < per; ++i) {
    const int idx = tid + i * kMmaThreads, key = idx / (HD / 4), col = idx % (HD / 4) * 4;
    x[i] = j0 + key < keys ? kv_load4<T>(rows, j0 + key, kvh, head_off, col) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    mx = fmaxf(mx, abs_max4(x[i]));
  }
  mx = warp_max(mx);
  if (tid % 32 == 0) red[tid / 32] = mx;
  __syncthreads();
  const int e = split_exp(fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3])));
  const float f = ldexpf(1.0f, e);
  const size_t at = (size_t(kvh) * sk.rows + j0) * HD;
  __half* hi = (values ? sk.v_hi : sk.k_hi) + at;
  __half* lo = (values ? sk.v_lo : sk.k_lo) + at;
#pragma unroll
  for (int i = 0; i < per; ++i) {
    const int idx = tid + i * kMmaThreads, key = idx / (HD / 4), col = idx % (HD / 4) * 4;
    store_split4<HD>(hi, lo, key, col, scale4(x[i], f));
  }
  if (tid == 0) (values ? sk.v_exp : sk.k_exp)[int64_t(kvh) * (sk.rows / kMmaKeys) + tile] = e;
}

// Tile j0 of KV head kvh from sk into shared memory (hi and lo of keys, then of values), by
// cp.async.
template <int HD>
__device__ __forceinline__ void copy_split_tile(const SplitKv& sk, int kvh, int j0, __half* dst) {
  constexpr int chunks = kMmaKeys * HD / 8;  // 16-byte chunks of one array's tile
  const size_t at = (size_t(kvh) * sk.rows + j0) * HD;
  const __half* src[4] = {sk.k_hi + at, sk.k_lo + at, sk.v_hi + at, sk.v_lo + at};
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int i = threadIdx.x; i < chunks; i += mma_threads<HD>())
      cp_async16(dst + m * kMmaKeys * HD + 8 * i, src[m] + 8 * i, 16);
}

// What a thread of attention_mma_kernel carries from tile to tile for its rows g and g + 8 of its
// warp: their visible keys [first, sink_end) and [recent, n_keys), the scores' scale over each
// row's power of two (times log2 e: the softmax runs in base 2, in float32), the online softmax, and
// the value sums in units of 2^-(kMmaProbExp + v_exp).
template <int HD>
struct MmaRows {
  int first[2], sink_end[2], recent[2], n_keys[2];  // positions below 2^31 (the launcher checks)
  float qf[2], m[2], l[2];
  float o[HD / 8 / mma_split<HD>()][4];  // this warp's value dims
  int v_exp, min_exp;  // the sums' units; the exponent of the largest values so far
};

// One tile of keys j0 .. j0 + kMmaKeys - 1 (hi and lo of keys and values in shared memory, split
// under 2^k_exp and 2^v_exp) for the warp's 16 rows.
template <int HD>
__device__ __forceinline__ void mma_tile(MmaRows<HD>& st, int j0, const __half* qh, const __half* ql, const __half* kh,
                                         const __half* kl, const __half* vh, const __half* vl, int k_exp, int v_exp) {
  constexpr int kt = kMmaKeys / 8;                // key tiles of 8 (score fragments)
  constexpr int vd = HD / mma_split<HD>(), dt = vd / 8;  // this warp's value dims, in tiles of 8
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4, tq = lane % 4;
  const int d0 = threadIdx.x / 128 * vd;  // the first of them
  float s[kt][4];
#pragma unroll
  for (int n = 0; n < kt; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
      // The three products of each key tile in turn, so that consecutive MMAs of a warp do not wait
      // for each other's sums.
#pragma unroll 2
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t qa_hi[4], qa_lo[4], b_hi[kt / 2][4], b_lo[kt / 2][4];
    const int q_off = mma_swz<HD>(warp * 16 + lane % 8 + 8 * (lane / 8 % 2), 16 * kk + 8 * (lane / 16));
    ldsm4(qa_hi, qh + q_off);
    ldsm4(qa_lo, ql + q_off);
#pragma unroll
    for (int np = 0; np < kt / 2; ++np) {
      const int k_off = mma_swz<HD>(16 * np + lane % 8 + 8 * (lane / 16), 16 * kk + 8 * (lane / 8 % 2));
      ldsm4(b_hi[np], kh + k_off);
      ldsm4(b_lo[np], kl + k_off);
    }
#pragma unroll
    for (int n = 0; n < kt; ++n) mma16816(s[n], qa_lo, b_hi[n / 2][2 * (n % 2)], b_hi[n / 2][2 * (n % 2) + 1]);
#pragma unroll
    for (int n = 0; n < kt; ++n) mma16816(s[n], qa_hi, b_lo[n / 2][2 * (n % 2)], b_lo[n / 2][2 * (n % 2) + 1]);
#pragma unroll
    for (int n = 0; n < kt; ++n) mma16816(s[n], qa_hi, b_hi[n / 2][2 * (n % 2)], b_hi[n / 2][2 * (n % 2) + 1]);
  }
  // The value sums' new units: this tile's values' power of two, but at most kMaxUnitStep above
  // that of the largest values so far (a tile of values that much smaller), so that the sums stay
  // finite; the rest of the difference then scales this tile's probabilities down.
  const bool first = st.v_exp == kNoUnit;
  const int min_exp = first ? v_exp : min(st.min_exp, v_exp);
  const int unit = min(v_exp, min_exp + kMaxUnitStep);
  const float pf = ldexpf(float(1 << kMmaProbExp), unit - v_exp);
  // Online softmax of rows g (fragment elements 0, 1) and g + 8 (2, 3).
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float f = st.qf[i] * pow2(-k_exp);
    float mx = -INFINITY;
    const bool full =
        (j0 >= st.first[i] && j0 + kMmaKeys <= st.sink_end[i]) || (j0 >= st.recent[i] && j0 + kMmaKeys <= st.n_keys[i]);
    if (full) {
#pragma unroll
      for (int n = 0; n < kt; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[n][2 * i + e] *= f;
          mx = fmaxf(mx, s[n][2 * i + e]);
        }
    } else {
#pragma unroll
      for (int n = 0; n < kt; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = j0 + 8 * n + 2 * tq + e;
          const bool seen = (j >= st.first[i] && j < st.sink_end[i]) || (j >= st.recent[i] && j < st.n_keys[i]);
          const float sc = seen ? s[n][2 * i + e] * f : -INFINITY;
          s[n][2 * i + e] = sc;
          mx = fmaxf(mx, sc);
        }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(st.m[i], mx);
    const float correction = m_new == -INFINITY ? 1.0f : exp2f(st.m[i] - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < kt; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float sc = s[n][2 * i + e];
        const float p = sc == -INFINITY ? 0.0f : exp2f(sc - m_new);
        s[n][2 * i + e] = p;
        sum += p;
      }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    st.l[i] = st.l[i] * correction + sum;
    st.m[i] = m_new;
    // Sums in the new units (zero before the first tile: nothing to rescale).
    const float rescale = first ? correction : ldexpf(correction, unit - st.v_exp);
#pragma unroll
    for (int d = 0; d < dt; ++d) {
      st.o[d][2 * i] *= rescale;
      st.o[d][2 * i + 1] *= rescale;
    }
  }
  st.v_exp = unit;
  st.min_exp = min_exp;
  // Value sums: the probabilities of 16 keys at a time as the A operand.
#pragma unroll
  for (int kk = 0; kk < kMmaKeys / 16; ++kk) {
    uint32_t pa_hi[4], pa_lo[4];
    split2(s[2 * kk][0] * pf, s[2 * kk][1] * pf, pa_hi[0], pa_lo[0]);
    split2(s[2 * kk][2] * pf, s[2 * kk][3] * pf, pa_hi[1], pa_lo[1]);
    split2(s[2 * kk + 1][0] * pf, s[2 * kk + 1][1] * pf, pa_hi[2], pa_lo[2]);
    split2(s[2 * kk + 1][2] * pf, s[2 * kk + 1][3] * pf, pa_hi[3], pa_lo[3]);
    // Four value tiles of 8 dims at a time, their products interleaved as above.
#pragma unroll
    for (int dq = 0; dq < dt / 4; ++dq) {
      uint32_t b_hi[2][4], b_lo[2][4];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int v_off = mma_swz<HD>(16 * kk + lane % 8 + 8 * (lane / 8 % 2), d0 + 32 * dq + 16 * u + 8 * (lane / 16));
        ldsm4_trans(b_hi[u], vh + v_off);
        ldsm4_trans(b_lo[u], vl + v_off);
      }
#pragma unroll
      for (int n = 0; n < 4; ++n)
        mma16816(st.o[4 * dq + n], pa_lo, b_hi[n / 2][2 * (n % 2)], b_hi[n / 2][2 * (n % 2) + 1]);
#pragma unroll
      for (int n = 0; n < 4; ++n)
        mma16816(st.o[4 * dq + n], pa_hi, b_lo[n / 2][2 * (n % 2)], b_lo[n / 2][2 * (n % 2) + 1]);
#pragma unroll
      for (int n = 0; n < 4; ++n)
        mma16816(st.o[4 * dq + n], pa_hi, b_hi[n / 2][2 * (n % 2)], b_hi[n / 2][2 * (n % 2) + 1]);
    }
  }
}

// Shared memory of attention_mma_kernel: the queries' hi and lo, one tile's four arrays (two with
// SPLIT: the next tile's copy lands while the current one is multiplied), the queries' exponents
// and the tiles' maxima.
template <int HD, bool SPLIT>
constexpr size_t mma_smem_bytes() {
  return size_t(2 * kMmaRows + (SPLIT ? 8 : 4) * kMmaKeys) * HD * sizeof(__half) + kMmaRows * sizeof(int) +
         2 * (mma_threads<HD>() / 32) * sizeof(float);
}

// SPLIT (caches without a KV window): tiles from sk, aligned to kMmaKeys, double-buffered.
// Otherwise each tile read from the caches and split by the block (any KV type and window).
template <KvType T, int HD, bool SPLIT>
__global__ void __launch_bounds__(mma_threads<HD>(), 2 / mma_split<HD>())
    attention_mma_kernel(AttnArgs a, SplitKv sk, int64_t n_tokens) {
  constexpr int split = mma_split<HD>(), vd = HD / split, dt = vd / 8;  // the value dims of a warp
  constexpr int tile = kMmaKeys * HD;                                   // halves of one array's tile
  extern __shared__ __align__(16) unsigned char mma_smem[];
  __half* qh = reinterpret_cast<__half*>(mma_smem);
  __half* ql = qh + kMmaRows * HD;
  __half* tiles = ql + kMmaRows * HD;  // [stage][k_hi, k_lo, v_hi, v_lo][tile]
  int* q_exp = reinterpret_cast<int*>(tiles + (SPLIT ? 8 : 4) * tile);
  float* red = reinterpret_cast<float*>(q_exp + kMmaRows);  // [2][warps]: keys', values' maxima
  // Warp w takes rows 16 (w % 4) .. + 15, and of their values the dims from (w / 4) vd.
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32 % 4, g = lane / 4, d0 = tid / 128 * vd;
  const int kvh = blockIdx.x, per_block = kMmaRows / a.group;
  // The last tokens (most keys) first.
  const int64_t t0 = int64_t(gridDim.y - 1 - blockIdx.y) * per_block;
  // Row r: token t0 + r / group, head kvh * group + r % group; the rows past per_block tokens'
  // (a group that does not divide kMmaRows) take no token, like those past the call's last.
  const auto token_of = [&](int r) { return r < per_block * a.group ? t0 + r / a.group : n_tokens; };
  // The warps of 16 rows split them, 16 / split rows each, a row's float4s c = lane + 32 i.
  {
    constexpr int rows = 16 / split, per_lane = (HD / 4 + 31) / 32;
    float4 qv[rows][per_lane];
#pragma unroll
    for (int rr = 0; rr < rows; ++rr) {
      const int r = warp * 16 + d0 / vd * rows + rr;
      const int64_t t = token_of(r);
      const int h = kvh * a.group + r % a.group;
#pragma unroll
      for (int i = 0; i < per_lane; ++i) {
        const int c = lane + 32 * i;
        qv[rr][i] = t < n_tokens && c < HD / 4
                        ? *reinterpret_cast<const float4*>(a.q + t * a.q_ld + int64_t(h) * HD + 4 * c)
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int rr = 0; rr < rows; ++rr) {
      const int r = warp * 16 + d0 / vd * rows + rr;
      float mx = 0.0f;
#pragma unroll
      for (int i = 0; i < per_lane; ++i) mx = fmaxf(mx, abs_max4(qv[rr][i]));
      const int e = split_exp(warp_max(mx));
#pragma unroll
      for (int i = 0; i < per_lane; ++i)
        if (lane + 32 * i < HD / 4) store_split4<HD>(qh, ql, r, 4 * (lane + 32 * i), scale4(qv[rr][i], ldexpf(1.0f, e)));
      if (lane == 0) q_exp[r] = e;
    }
  }
  __syncthreads();  // a warp's rows were split by the warps of its 16 rows
  MmaRows<HD> st;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i;
    const int64_t t = token_of(r);
    st.qf[i] = ldexpf(a.scale * kLog2e, -q_exp[r]);
    st.n_keys[i] = t < n_tokens ? int(a.n_past + t + 1) : 0;
    st.first[i] = a.window > 0 && st.n_keys[i] > a.window ? st.n_keys[i] - int(a.window) : 0;
    st.sink_end[i] = st.n_keys[i];
    st.recent[i] = st.n_keys[i];
    if (a.kv_window > 0) {
      st.recent[i] = max(st.first[i], st.n_keys[i] > a.kv_window ? st.n_keys[i] - int(a.kv_window) : 0);
      st.sink_end[i] = max(st.first[i], min(min(int(a.kv_sinks), st.recent[i]), st.n_keys[i]));
    }
    st.m[i] = -INFINITY;
    st.l[i] = 0.0f;
  }
#pragma unroll
  for (int d = 0; d < dt; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[d][e] = 0.0f;
  st.v_exp = kNoUnit;
  const int64_t t_last = min(n_tokens, t0 + per_block) - 1;
  const int j_end = int(a.n_past + t_last + 1);
  const int nk0 = int(a.n_past + t0 + 1);
  const int j_begin = a.window > 0 && nk0 > a.window ? nk0 - int(a.window) : 0;
  if constexpr (SPLIT) {
    // Without a KV window the block's rows see [j_begin, j_end) together: every tile counts.
    const int n_tiles = int(sk.rows / kMmaKeys);
    const int* k_exps = sk.k_exp + kvh * n_tiles;
    const int* v_exps = sk.v_exp + kvh * n_tiles;
    int j0 = j_begin / kMmaKeys * kMmaKeys;
    copy_split_tile<HD>(sk, kvh, j0, tiles);
    int ke = k_exps[j0 / kMmaKeys], ve = v_exps[j0 / kMmaKeys];
    for (int buf = 0; j0 < j_end; j0 += kMmaKeys, buf ^= 1) {
      cp_async_wait_all();
      __syncthreads();  // the tile has landed, and every warp is done with the other buffer
      const int k_exp = ke, v_exp = ve;
      if (j0 + kMmaKeys < j_end) {
        copy_split_tile<HD>(sk, kvh, j0 + kMmaKeys, tiles + (buf ^ 1) * 4 * tile);
        ke = k_exps[j0 / kMmaKeys + 1];
        ve = v_exps[j0 / kMmaKeys + 1];
      }
      const __half* cur = tiles + buf * 4 * tile;
      mma_tile<HD>(st, j0, qh, ql, cur, cur + tile, cur + 2 * tile, cur + 3 * tile, k_exp, v_exp);
    }
  } else {
    const int64_t k_off = int64_t(kvh) * HD, v_off = int64_t(kvh) * a.v_head;
    for (int j0 = j_begin; j0 < j_end; j0 += kMmaKeys) {
      bool any = false;  // skip tiles no row of the block sees (a KV window's gap)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        any |=
            (j0 < st.sink_end[i] && j0 + kMmaKeys > st.first[i]) || (j0 < st.n_keys[i] && j0 + kMmaKeys > st.recent[i]);
      if (!__syncthreads_or(any)) continue;
      const int k_exp = load_split_tile<T, HD>(a.k, j0, j_end, kvh, k_off, tiles, tiles + tile, red);
      const int v_exp =
          load_split_tile<T, HD>(a.v, j0, j_end, kvh, v_off, tiles + 2 * tile, tiles + 3 * tile, red + 4 * split);
      __syncthreads();
      mma_tile<HD>(st, j0, qh, ql, tiles, tiles + tile, tiles + 2 * tile, tiles + 3 * tile, k_exp, v_exp);
      __syncthreads();  // the tile is read
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i;
    const int64_t t = token_of(r);
    if (t >= n_tokens) continue;
    const int h = kvh * a.group + r % a.group;
    // The sink (gpt-oss) joins the denominator only.
    const float sink = a.sinks ? a.sinks[h] * kLog2e : -INFINITY;
    const float mx = fmaxf(st.m[i], sink);
    const float w = st.m[i] == -INFINITY ? 0.0f : exp2f(st.m[i] - mx);
    const float denom = st.l[i] * w + (a.sinks ? exp2f(sink - mx) : 0.0f);
    const float f = ldexpf(w / denom, -kMmaProbExp);
    float* ov = a.out + t * a.out_ld + int64_t(h) * HD + d0 + 2 * (lane % 4);
#pragma unroll
    for (int d = 0; d < dt; ++d)
      *reinterpret_cast<float2*>(ov + 8 * d) =
          make_float2(ldexpf(st.o[d][2 * i] * f, -st.v_exp), ldexpf(st.o[d][2 * i + 1] * f, -st.v_exp));
  }
}

// The tensor-core prefill kernel takes value heads as wide as the keys (not MLA's latent) of 64,
// 128 or 256 dims, head groups of up to kMmaRows heads, and positions below 2^31.
bool mma_applies(const AttentionParams& p, int64_t T) {
  const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
  return attention_mma_enabled() && !p.values_in_keys && vd == hd && (hd == 64 || hd == 128 || hd == 256) &&
         p.n_heads % p.n_kv_heads == 0 && p.n_heads / p.n_kv_heads <= kMmaRows &&
         p.n_past + T < (int64_t(1) << 31);
}

// Its keys and values split once per call (SplitKv): caches without a KV window, of any type.
bool split_kv_applies(const AttentionParams& p) { return p.kv.window <= 0; }

// The E4M3 code of x as kv_cache.cpp's f32_to_fp8_e4m3 computes it (nearest, ties to even).
__device__ uint8_t fp8_code(float x) {
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  const float a = fabsf(x);
  if (!(a < 448.0f)) return sign | 0x7E;
  int e;
  frexpf(a, &e);
  const int step_exp = max(e - 1, -6) - 3;
  const float units = rintf(ldexpf(a, -step_exp));
  const float q = ldexpf(units, step_exp);
  if (q >= 448.0f) return sign | 0x7E;
  if (q < 0.015625f) return sign | uint8_t(units);
  int qe;
  const float f = frexpf(q, &qe);
  return sign | uint8_t((qe + 6) << 3) | uint8_t(int(f * 16.0f) - 8);
}

// One warp per (row, head): x row t, head h -> dst row t (kv_store_row's layout).
template <KvType T>
__global__ void kv_pack_kernel(const float* x, int64_t ld, int64_t cols, int heads, float* dst, int64_t words) {
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y, lane = threadIdx.x;
  const int64_t width = cols / heads, c0 = int64_t(h) * width;
  const float* in = x + t * ld + c0;
  float* row = dst + t * words;
  if constexpr (T == KvType::F32) {
    for (int64_t i = lane; i < width; i += 32) row[c0 + i] = in[i];
  } else if constexpr (T == KvType::BF16 || T == KvType::F16) {
    auto* out = reinterpret_cast<uint16_t*>(row) + c0;
    for (int64_t i = lane; i < width; i += 32) {
      const float v = in[i];
      if constexpr (T == KvType::BF16) {
        // Round to nearest even, as dtype.h's f32_to_bf16 (NaN stays NaN).
        const uint32_t b = __float_as_uint(v);
        out[i] = isnan(v) ? uint16_t((b >> 16) | 0x40) : uint16_t((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
      } else {
        out[i] = __half_as_ushort(__float2half_rn(fminf(fmaxf(v, -65504.0f), 65504.0f)));
      }
    }
  } else {
    float amax = 0;
    for (int64_t i = lane; i < width; i += 32) amax = fmaxf(amax, fabsf(in[i]));
    amax = warp_max(amax);
    const float scale = amax > 0 ? amax / (T == KvType::Fp8 ? 448.0f : 127.0f) : 1.0f;
    if (lane == 0) row[h] = scale;
    auto* codes = reinterpret_cast<uint8_t*>(row + heads) + c0;
    for (int64_t i = lane; i < width; i += 32) {
      const float v = in[i] / scale;
      codes[i] = T == KvType::Fp8 ? fp8_code(v) : uint8_t(int8_t(fminf(fmaxf(rintf(v), -127.0f), 127.0f)));
    }
  }
}

// Staged rows into a ring: the sinks among the new positions and the latest `window` of them.
__global__ void kv_ring_store_kernel(const float* staged, float* cache, int64_t words, int64_t n_past, int64_t T,
                                     int64_t sinks, int64_t window) {
  const int64_t t = blockIdx.x, pos = n_past + t;
  if (pos >= sinks && pos < n_past + T - window) return;
  const int64_t slot = pos < sinks ? pos : sinks + (pos - sinks) % window;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) cache[slot * words + i] = staged[t * words + i];
}

template <class F>
void dispatch_kv(KvType t, F&& f) {
  switch (t) {
    case KvType::F32: f(std::integral_constant<KvType, KvType::F32>{}); return;
    case KvType::BF16: f(std::integral_constant<KvType, KvType::BF16>{}); return;
    case KvType::F16: f(std::integral_constant<KvType, KvType::F16>{}); return;
    case KvType::Fp8: f(std::integral_constant<KvType, KvType::Fp8>{}); return;
    case KvType::Q8: f(std::integral_constant<KvType, KvType::Q8>{}); return;
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

namespace {
NormRope norm_rope_args(Buffer& q, Buffer& k, const float* q_norm, const float* k_norm, float eps, int n_heads,
                        int head_dim, const RopeTable& r, const float* inv_freq) {
  return NormRope{q.data, k.data, q_norm, k_norm, eps, n_heads, head_dim, r.rot_dim / 2, inv_freq,
                  r.attention_factor, r.interleaved, r.rot_offset, q.cols, k.cols};
}
// The arguments of the attention kernels for q, the key and value rows k and v (v_head: the
// offset of a KV head's values in a value row) and p.
AttnArgs attn_args(const Buffer& q, const KvRows& k, const KvRows& v, int64_t v_head, const AttentionParams& p,
                   const float* sinks, Buffer& out) {
  AttnArgs a;
  a.q = q.data;
  a.q_ld = q.cols;
  a.k = k;
  a.v = v;
  a.v_head = v_head;
  a.out = out.data;
  a.out_ld = out.cols;
  a.head_dim = p.head_dim;
  a.v_dim = p.v_head_dim ? p.v_head_dim : p.head_dim;
  a.group = p.n_heads / p.n_kv_heads;
  a.scale = p.scale;
  a.n_past = p.n_past;
  a.window = p.sliding_window;
  a.kv_window = p.kv.window;
  a.kv_sinks = p.kv.sinks;
  a.sinks = sinks;
  return a;
}
}  // namespace

void qk_norm_rope(Buffer& q, Buffer& k, const float* q_norm, const float* k_norm, float eps, int n_heads,
                  int n_kv_heads, int head_dim, const RopeTable& r, const float* inv_freq, int64_t n_past,
                  int threads, cudaStream_t s) {
  if (q.rows == 0) return;
  launch(qk_norm_rope_kernel, dim3(unsigned(q.rows), unsigned(n_heads + n_kv_heads)),
         unsigned(threads), 0, s,
         norm_rope_args(q, k, q_norm, k_norm, eps, n_heads, head_dim, r, inv_freq), n_past);
}

void decode_attention(Buffer& q, Buffer& k, const Buffer& v, const float* q_norm, const float* k_norm, float eps,
                      const RopeTable& r, const float* inv_freq, int threads, const DecodeRows& rows,
                      const AttentionParams& p, const float* sinks, Buffer& out, cudaStream_t s) {
  if (rows.n <= 0) return;
  if (rows.n > kMaxDecodeRows || p.kv.type != KvType::F32 || p.kv.window > 0 || p.values_in_keys)
    fail("cuda decode_attention: ", rows.n, " rows (at most ", kMaxDecodeRows, "), F32 caches without a window only");
  const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
  if (vd > 32 * kMaxValueChunks) fail("cuda attention: value heads of ", vd, " dims (at most ", 32 * kMaxValueChunks, ")");
  const unsigned n = unsigned(rows.n);
  launch(qk_norm_rope_rows_kernel, dim3(n, unsigned(p.n_heads + p.n_kv_heads)), unsigned(threads),
         0, s, norm_rope_args(q, k, q_norm, k_norm, eps, p.n_heads, hd, r, inv_freq), rows);
  const int64_t kv_dim = int64_t(p.n_kv_heads) * hd, v_dim = int64_t(p.n_kv_heads) * vd;
  // Each row's caches and position come from `rows`, its new key and value from k and v, which
  // the kernel also appends to the caches (attention_rows_kernel).
  const AttnArgs a = attn_args(q, KvRows{nullptr, nullptr, kv_dim, 0, 0, 0, false, p.n_kv_heads},
                               KvRows{nullptr, nullptr, v_dim, 0, 0, 0, false, p.n_kv_heads}, vd, p, sinks, out);
  const size_t smem = size_t(hd + kAttnDecodeWarps * (2 + vd)) * sizeof(float);
  const dim3 grid(unsigned(p.n_heads), n);
  if (pipelined(hd, vd))
    launch(attention_rows_kernel<KvType::F32, kPipelinedChunks>, grid, kAttnDecodeWarps * 32, smem,
           s, a, rows, k.data, k.cols, v.data, v.cols);
  else
    launch(attention_rows_kernel<KvType::F32, 0>, grid, kAttnDecodeWarps * 32, smem, s, a, rows,
           k.data, k.cols, v.data, v.cols);
}

size_t attention_split_bytes(const AttentionParams& p, int64_t T) {
  const char* env = std::getenv("MOESTREAM_CUDA_ATTN_SPLIT");  // 0: every block splits its tiles
  if (T <= 1 || !mma_applies(p, T) || !split_kv_applies(p) || (env && std::string(env) == "0")) return 0;
  return split_kv_bytes(p.n_past + T, p.n_kv_heads, p.head_dim);
}

void attention(const Buffer& q, const Buffer& k_cache, const Buffer& v_cache, const AttentionParams& p,
               const float* sinks, Buffer& out, cudaStream_t s, const float* k_staged, const float* v_staged,
               float* k_append, float* v_append, void* split) {
  const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
  if (vd > 32 * kMaxValueChunks) fail("cuda attention: value heads of ", vd, " dims (at most ", 32 * kMaxValueChunks, ")");
  const KvCacheSpec& kv = p.kv;
  const bool ring = kv.window > 0 && kv.ring && k_cache.rows == kv.sinks + kv.window;
  const KvRows k{k_cache.data, k_staged, k_cache.cols, p.n_past, kv.sinks, kv.window, ring, p.n_kv_heads};
  AttnArgs a = attn_args(
      q, k, p.values_in_keys ? k : KvRows{v_cache.data, v_staged, v_cache.cols, p.n_past, kv.sinks, kv.window, ring, p.n_kv_heads},
      p.values_in_keys ? hd : vd, p, sinks, out);
  if (q.rows == 0) return;
  const auto aligned = [](const void* ptr, int64_t words) {
    return ptr == nullptr || (reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && words % 4 == 0);
  };
  if (k_append) {
    if (q.rows != 1 || !k_staged || !v_staged || !v_append || p.values_in_keys || kv.type != KvType::F32 || kv.window > 0)
      fail("cuda attention: appending keys takes one query row, its staged key and value, F32 caches without a window");
    a.k_append = k_append;
    a.v_append = v_append;
  }
  // Prefill on the tensor cores where it applies (attention_mma_kernel).
  if (q.rows > 1 && mma_applies(p, q.rows) && aligned(q.data, q.cols) && aligned(out.data, out.cols) &&
      (kv.type != KvType::F32 || (aligned(k_cache.data, k_cache.cols) && aligned(v_cache.data, v_cache.cols) &&
                                  aligned(k_staged, k_cache.cols) && aligned(v_staged, v_cache.cols)))) {
    const bool split_kv = split && split_kv_applies(p);  // no KV window: no ring, nothing staged
    const int64_t keys = p.n_past + q.rows;
    const SplitKv sk = split_kv ? split_kv_layout(split, keys, p.n_kv_heads, hd) : SplitKv{};
    if (split_kv) {
      const dim3 grid(unsigned(sk.rows / kMmaKeys), unsigned(p.n_kv_heads), 2);
      dispatch_kv(kv.type, [&](auto type) {
        constexpr KvType T = decltype(type)::value;
        if (hd == 64) split_kv_kernel<T, 64><<<grid, kMmaThreads, 0, s>>>(a.k, a.v, a.v_head, int(keys), sk);
        else if (hd == 128) split_kv_kernel<T, 128><<<grid, kMmaThreads, 0, s>>>(a.k, a.v, a.v_head, int(keys), sk);
        else split_kv_kernel<T, 256><<<grid, kMmaThreads, 0, s>>>(a.k, a.v, a.v_head, int(keys), sk);
      });
      MS_CUDA_CHECK_LAUNCH();
    }
    auto launch = [&]<int HD, bool SPLIT>() {
      dispatch_kv(SPLIT ? KvType::F32 : kv.type, [&](auto type) {
        constexpr KvType T = decltype(type)::value;
        if constexpr (SPLIT && T != KvType::F32) {
          return;  // unreachable: a split call launches the F32 instance (its tiles do not depend on the type)
        } else {
          auto kernel = attention_mma_kernel<T, HD, SPLIT>;
          const size_t bytes = mma_smem_bytes<HD, SPLIT>();
          static bool configured = false;
          if (!configured) {
            MS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
            configured = true;
          }
          const int64_t per_block = kMmaRows / a.group;
          kernel<<<dim3(unsigned(p.n_kv_heads), unsigned((q.rows + per_block - 1) / per_block)), mma_threads<HD>(),
                   bytes, s>>>(a, sk, q.rows);
        }
      });
    };
    auto launch_hd = [&]<int HD>() {
      if (split_kv) launch.template operator()<HD, true>();
      else launch.template operator()<HD, false>();
    };
    if (hd == 64) launch_hd.template operator()<64>();
    else if (hd == 128) launch_hd.template operator()<128>();
    else launch_hd.template operator()<256>();
    MS_CUDA_CHECK_LAUNCH();
    return;
  }
  // Otherwise prefill through the tiled float32 kernel where it applies: value heads as wide as the
  // keys, 64, 128 or 256 dims, and a head group that divides its rows.
  const bool tiled = q.rows > 1 && !p.values_in_keys && vd == hd && kPrefillRows % a.group == 0 &&
                     (hd == 64 || hd == 128 || hd == 256);
  if (tiled) {
    auto launch = [&]<int HD>() {
      dispatch_kv(kv.type, [&](auto type) {
        auto kernel = attention_prefill_kernel<decltype(type)::value, HD>;
        const size_t bytes = prefill_smem_floats<HD>() * sizeof(float);
        static bool configured = false;
        if (!configured) {
          MS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
          configured = true;
        }
        const int64_t per_block = kPrefillRows / a.group;
        kernel<<<dim3(unsigned(p.n_kv_heads), unsigned((q.rows + per_block - 1) / per_block)), kPrefillThreads, bytes, s>>>(
            a, q.rows);
      });
    };
    if (hd == 64) launch.template operator()<64>();
    else if (hd == 128) launch.template operator()<128>();
    else launch.template operator()<256>();
    MS_CUDA_CHECK_LAUNCH();
    return;
  }
  const int warps = q.rows == 1 ? kAttnDecodeWarps : kAttnWarps;
  const size_t smem = size_t(hd + warps * (2 + vd)) * sizeof(float);
  const dim3 grid(unsigned(p.n_heads), unsigned(q.rows));
  const bool pipe = pipelined(hd, p.values_in_keys ? hd : vd);
  dispatch_kv(kv.type, [&](auto type) {
    if (pipe)
      launch(attention_kernel<decltype(type)::value, kPipelinedChunks>, grid, unsigned(warps) * 32,
             smem, s, a);
    else
      launch(attention_kernel<decltype(type)::value, 0>, grid, unsigned(warps) * 32, smem, s, a);
  });
}

void kv_pack(const Buffer& x, int heads, KvType type, float* dst, int64_t words, cudaStream_t s) {
  if (x.rows == 0 || x.cols == 0) return;
  if (type == KvType::Fp8) {
    static bool uploaded = false;  // one table per process (one device)
    if (!uploaded) {
      MS_CUDA_CHECK(cudaMemcpyToSymbol(kFp8Table, fp8_e4m3_table().data(), sizeof(kFp8Table)));
      uploaded = true;
    }
  }
  dispatch_kv(type, [&](auto t) {
    kv_pack_kernel<decltype(t)::value><<<dim3(unsigned(x.rows), unsigned(heads)), 32, 0, s>>>(x.data, x.cols, x.cols,
                                                                                              heads, dst, words);
  });
  MS_CUDA_CHECK_LAUNCH();
}

void kv_ring_store(const float* staged, Buffer& cache, int64_t T, const AttentionParams& p, cudaStream_t s) {
  if (T == 0 || cache.cols == 0) return;
  kv_ring_store_kernel<<<unsigned(T), 128, 0, s>>>(staged, cache.data, cache.cols, p.n_past, T, p.kv.sinks,
                                                   p.kv.window);
  MS_CUDA_CHECK_LAUNCH();
}

}  // namespace moestream::cuda
