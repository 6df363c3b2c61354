#include "backend/cpu/deltanet.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/kernels.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace moestream::cpu {

namespace {

float silu(float x) { return x / (1.0f + std::exp(-x)); }
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }  // as torch (threshold 20)

// Per-token views into the prepared inputs of one call.
struct Inputs {
  const float* mixed;  // [T, conv_dim]: q | k | v
  const float* g;      // [T, n_v_heads]
  const float* beta;   // [T, n_v_heads]
  int64_t T, conv_dim, key_dim;
  int n_v_heads, group;  // value heads per key head
  int dk, dv;

  const float* q(int64_t t, int h) const { return mixed + t * conv_dim + int64_t(h / group) * dk; }
  const float* k(int64_t t, int h) const { return mixed + t * conv_dim + key_dim + int64_t(h / group) * dk; }
  const float* v(int64_t t, int h) const { return mixed + t * conv_dim + 2 * key_dim + int64_t(h) * dv; }
  float decay(int64_t t, int h) const { return g[t * n_v_heads + h]; }
  float strength(int64_t t, int h) const { return beta[t * n_v_heads + h]; }
};

// Causal depthwise conv over [state rows; x rows], SiLU, into mixed (tokens split over the pool);
// the state keeps the last kernel - 1 inputs.
void causal_conv(ThreadPool& pool, const Buffer& x, const Vector& taps, int kernel, Buffer& state, float* mixed) {
  const int64_t T = x.rows, C = x.cols, hist = kernel - 1;
  auto row = [&](int64_t r) { return r < hist ? state.data + r * C : x.data + (r - hist) * C; };
  pool.parallel_for(size_t(T), [&](size_t t0, size_t t1) {
    for (int64_t t = int64_t(t0); t < int64_t(t1); ++t) {
      float* o = mixed + t * C;
      for (int64_t c = 0; c < C; ++c) {
        const float* w = taps.data + c * kernel;
        float s = 0;
        for (int j = 0; j < kernel; ++j) s += w[j] * row(t + j)[c];
        o[c] = silu(s);
      }
    }
  }, ThreadPool::elementwise_chunk(C));
  // New state row i is input row T + i of [state; x].
  for (int64_t i = 0; i < hist; ++i) {
    const int64_t r = T + i;
    if (r < hist)
      std::memmove(state.data + i * C, state.data + r * C, size_t(C) * sizeof(float));
    else
      std::memcpy(state.data + i * C, x.data + (r - hist) * C, size_t(C) * sizeof(float));
  }
}

// S (dk, dv) of one value head through T tokens, one at a time; out rows of stride out_stride.
void recurrent_head(const Inputs& in, int h, float* S, float* out, int64_t out_stride, float* tmp) {
  const int dk = in.dk, dv = in.dv;
  float* kv = tmp;  // [dv] what S predicts for k
  for (int64_t t = 0; t < in.T; ++t) {
    const float* q = in.q(t, h);
    const float* k = in.k(t, h);
    const float* v = in.v(t, h);
    const float decay = std::exp(in.decay(t, h)), beta = in.strength(t, h);
    for (int64_t i = 0; i < int64_t(dk) * dv; ++i) S[i] *= decay;
    std::fill(kv, kv + dv, 0.0f);
    for (int i = 0; i < dk; ++i) axpy(k[i], S + int64_t(i) * dv, kv, dv);
    for (int j = 0; j < dv; ++j) kv[j] = (v[j] - kv[j]) * beta;  // the correction written to S
    for (int i = 0; i < dk; ++i) axpy(k[i], kv, S + int64_t(i) * dv, dv);
    float* o = out + t * out_stride;
    std::fill(o, o + dv, 0.0f);
    for (int i = 0; i < dk; ++i) axpy(q[i], S + int64_t(i) * dv, o, dv);
  }
}

size_t chunk_work_size(int dk, int dv) {
  const size_t C = kDeltaNetChunk;
  return C * C + C * size_t(dv) + C * size_t(dk) + C + size_t(dv);
}

// The same function as recurrent_head, kDeltaNetChunk tokens at a time. Within a chunk, with
// c_i the cumulative log decay up to token i and A_ij = beta_i (k_i . k_j) exp(c_i - c_j), j < i:
//   (I + A) U = beta v,  (I + A) W = beta exp(c) k      (forward substitution)
//   v'_i = U_i - W_i S                                   (what token i writes, given S before the chunk)
//   o_i = exp(c_i) q_i S + sum_{j <= i} (q_i . k_j) exp(c_i - c_j) v'_j
//   S <- exp(c_last) S + sum_j exp(c_last - c_j) k_j v'_j^T
void chunked_head(const Inputs& in, int h, float* S, float* out, int64_t out_stride, float* work) {
  const int dk = in.dk, dv = in.dv;
  const int64_t C = kDeltaNetChunk;
  float* A = work;          // [C, C] strictly lower part
  float* U = A + C * C;     // [C, dv] -> v'
  float* W = U + C * dv;    // [C, dk]
  float* cum = W + C * dk;  // [C]
  float* o_tmp = cum + C;   // [dv]
  for (int64_t c0 = 0; c0 < in.T; c0 += C) {
    const int64_t L = std::min(C, in.T - c0);
    float acc = 0;
    for (int64_t i = 0; i < L; ++i) cum[i] = acc += in.decay(c0 + i, h);
    for (int64_t i = 0; i < L; ++i) {
      const float beta = in.strength(c0 + i, h);
      const float* ki = in.k(c0 + i, h);
      for (int64_t j = 0; j < i; ++j)
        A[i * C + j] = beta * dot_f32(ki, in.k(c0 + j, h), dk) * std::exp(cum[i] - cum[j]);
      float* u = U + i * dv;
      float* w = W + i * dk;
      const float* v = in.v(c0 + i, h);
      const float e = std::exp(cum[i]);
      for (int r = 0; r < dv; ++r) u[r] = v[r] * beta;
      for (int r = 0; r < dk; ++r) w[r] = ki[r] * beta * e;
      for (int64_t j = 0; j < i; ++j) {
        axpy(-A[i * C + j], U + j * dv, u, dv);
        axpy(-A[i * C + j], W + j * dk, w, dk);
      }
    }
    for (int64_t i = 0; i < L; ++i)
      for (int r = 0; r < dk; ++r) axpy(-W[i * dk + r], S + int64_t(r) * dv, U + i * dv, dv);
    for (int64_t i = 0; i < L; ++i) {
      const float* q = in.q(c0 + i, h);
      std::fill(o_tmp, o_tmp + dv, 0.0f);
      for (int r = 0; r < dk; ++r) axpy(q[r], S + int64_t(r) * dv, o_tmp, dv);
      float* o = out + (c0 + i) * out_stride;
      const float e = std::exp(cum[i]);
      for (int r = 0; r < dv; ++r) o[r] = o_tmp[r] * e;
      for (int64_t j = 0; j <= i; ++j)
        axpy(dot_f32(q, in.k(c0 + j, h), dk) * std::exp(cum[i] - cum[j]), U + j * dv, o, dv);
    }
    const float last = cum[L - 1], e_last = std::exp(last);
    for (int64_t i = 0; i < int64_t(dk) * dv; ++i) S[i] *= e_last;
    for (int64_t j = 0; j < L; ++j) {
      const float* kj = in.k(c0 + j, h);
      const float e = std::exp(last - cum[j]);
      for (int r = 0; r < dk; ++r) axpy(kj[r] * e, U + j * dv, S + int64_t(r) * dv, dv);
    }
  }
}

void check_shapes(const Buffer& qkv, const Buffer& z, const Buffer& b, const Buffer& a,
                  const DeltaNetWeights& w, const DeltaNetParams& p, const DeltaNetState& s,
                  const Buffer& out) {
  if (p.n_k_heads <= 0 || p.n_v_heads <= 0 || p.n_v_heads % p.n_k_heads != 0 || p.k_head_dim <= 0 ||
      p.v_head_dim <= 0 || p.conv_kernel <= 0)
    fail("gated_delta_net: ", p.n_v_heads, " value heads over ", p.n_k_heads, " key heads (dims ",
         p.k_head_dim, "/", p.v_head_dim, ", conv kernel ", p.conv_kernel, ") is not a valid layout");
  const int64_t T = qkv.rows, key_dim = int64_t(p.n_k_heads) * p.k_head_dim;
  const int64_t value_dim = int64_t(p.n_v_heads) * p.v_head_dim, conv_dim = 2 * key_dim + value_dim;
  auto want = [&](const char* what, int64_t rows, int64_t cols, int64_t want_rows, int64_t want_cols) {
    if (rows != want_rows || cols != want_cols)
      fail("gated_delta_net: ", what, " is [", rows, ", ", cols, "], expected [", want_rows, ", ", want_cols, "]");
  };
  want("qkv", qkv.rows, qkv.cols, T, conv_dim);
  want("z", z.rows, z.cols, T, value_dim);
  want("b", b.rows, b.cols, T, p.n_v_heads);
  want("a", a.rows, a.cols, T, p.n_v_heads);
  want("out", out.rows, out.cols, T, value_dim);
  want("conv state", s.conv.rows, s.conv.cols, p.conv_kernel - 1, conv_dim);
  want("recurrent state", s.recurrent.rows, s.recurrent.cols, int64_t(p.n_v_heads) * p.k_head_dim, p.v_head_dim);
  auto want_size = [](const Vector& v, int64_t n, const char* what) {
    if (v.size != n) fail("gated_delta_net: ", what, " ", v.name, " has ", v.size, " values, expected ", n);
  };
  want_size(w.conv, conv_dim * p.conv_kernel, "conv weight");
  want_size(w.A_log, p.n_v_heads, "A_log");
  want_size(w.dt_bias, p.n_v_heads, "dt_bias");
  want_size(w.norm, p.v_head_dim, "norm weight");
}

}  // namespace

void gated_delta_net(ThreadPool& pool, const Buffer& qkv, const Buffer& z, const Buffer& b,
                     const Buffer& a, const DeltaNetWeights& w, const DeltaNetParams& p,
                     DeltaNetState& state, Buffer& out, DeltaNetScratch& s, DeltaRuleForm form) {
  check_shapes(qkv, z, b, a, w, p, state, out);
  const int64_t T = qkv.rows, conv_dim = qkv.cols;
  if (T == 0) return;
  const int nk = p.n_k_heads, nv = p.n_v_heads, dk = p.k_head_dim, dv = p.v_head_dim;
  const int64_t key_dim = int64_t(nk) * dk, value_dim = int64_t(nv) * dv;

  s.mixed.resize(size_t(T * conv_dim));
  causal_conv(pool, qkv, w.conv, p.conv_kernel, state.conv, s.mixed.data());

  // q and k: unit length per head (eps as the reference kernels), q also scaled by dk^-1/2.
  const float q_scale = 1.0f / std::sqrt(float(dk));
  pool.parallel_for(size_t(T), [&](size_t t0, size_t t1) {
    for (int64_t t = int64_t(t0); t < int64_t(t1); ++t)
      for (int64_t c = 0; c < 2 * key_dim; c += dk) {
        float* x = s.mixed.data() + t * conv_dim + c;
        const float inv = 1.0f / std::sqrt(dot_f32(x, x, dk) + 1e-6f);
        for (int i = 0; i < dk; ++i) x[i] *= inv;
        if (c < key_dim)
          for (int i = 0; i < dk; ++i) x[i] *= q_scale;
      }
  }, ThreadPool::elementwise_chunk(2 * key_dim));

  s.g.resize(size_t(T * nv));
  s.beta.resize(size_t(T * nv));
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < nv; ++h) {
      const int64_t i = t * nv + h;
      s.g[size_t(i)] = -std::exp(w.A_log.data[h]) * softplus(a.data[i] + w.dt_bias.data[h]);
      s.beta[size_t(i)] = 1.0f / (1.0f + std::exp(-b.data[i]));
    }

  const Inputs in{s.mixed.data(), s.g.data(), s.beta.data(), T, conv_dim, key_dim, nv, nv / nk, dk, dv};
  s.core.resize(size_t(T * value_dim));
  s.per_head.resize(size_t(nv));
  for (auto& area : s.per_head) area.resize(std::max(chunk_work_size(dk, dv), size_t(dv)));
  pool.parallel_for(size_t(nv), [&](size_t h0, size_t h1) {
    for (size_t h = h0; h < h1; ++h) {
      float* S = state.recurrent.data + int64_t(h) * dk * dv;
      float* o = s.core.data() + int64_t(h) * dv;
      if (form == DeltaRuleForm::Chunked)
        chunked_head(in, int(h), S, o, value_dim, s.per_head[h].data());
      else
        recurrent_head(in, int(h), S, o, value_dim, s.per_head[h].data());
    }
  });

  // Gated RMSNorm per value head: norm(o) * w * silu(z).
  pool.parallel_for(size_t(T), [&](size_t t0, size_t t1) {
    for (int64_t t = int64_t(t0); t < int64_t(t1); ++t)
      for (int h = 0; h < nv; ++h) {
        const int64_t off = t * value_dim + int64_t(h) * dv;
        const float* o = s.core.data() + off;
        const float inv = 1.0f / std::sqrt(dot_f32(o, o, dv) / float(dv) + p.norm_eps);
        for (int i = 0; i < dv; ++i)
          out.data[off + i] = w.norm.data[i] * (o[i] * inv) * silu(z.data[off + i]);
      }
  }, ThreadPool::elementwise_chunk(value_dim));
}

}  // namespace moestream::cpu
