#include "backend/cpu/attention_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/thread_pool.h"

namespace moestream::cpu {

namespace {

constexpr int64_t kKeyBlock = 256;         // keys per product (rows of K, columns of V^T)
constexpr int64_t kQueryRows = 128;        // query rows an item aims for
constexpr int64_t kScoreFloats = 1 << 20;  // most scores an item holds (4 MB)

// Which keys a token sees (AttentionParams: the model's sliding window, the cache's window).
struct Visibility {
  int64_t sliding_window, window, sinks;
  int64_t first(int64_t pos) const { return sliding_window > 0 ? std::max<int64_t>(0, pos + 1 - sliding_window) : 0; }
  int64_t recent(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0; }
};

// An item's buffers, kept by each thread between calls.
struct Scratch {
  std::vector<int64_t> keys;      // positions seen by some token of the block, ascending
  std::vector<float> q, s, k, vt, p, o, ob, row;  // row: value rows before the transpose
  PreparedInput in;
};

// Rows of one kv head and tokens [t0, t1) of the call (see the header).
void attend_item(const Buffer& q, const AttentionParams& p, const KeyRows& rows, const Visibility& vis, int kvh,
                 int64_t t0, int64_t t1, Buffer& out, Scratch& sc) {
  const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim, group = p.n_heads / p.n_kv_heads;
  const int64_t nt = t1 - t0, R = nt * group, h0 = int64_t(kvh) * group;
  const int64_t pos0 = p.n_past + t0, last = p.n_past + t1 - 1;
  sc.keys.clear();
  for (int64_t j = vis.first(pos0); j <= last; ++j)
    if (vis.window == 0 || j < vis.sinks || j >= vis.recent(pos0)) sc.keys.push_back(j);
  const int64_t n = int64_t(sc.keys.size());

  sc.q.resize(size_t(R * hd));  // row ti * group + g: token t0 + ti, head h0 + g
  for (int64_t ti = 0; ti < nt; ++ti)
    std::memcpy(sc.q.data() + ti * group * hd, q.data + (t0 + ti) * q.cols + h0 * hd, size_t(group * hd) * sizeof(float));

  // S = Q K^T
  sc.s.resize(size_t(R * n));
  sc.k.resize(size_t(std::min(n, kKeyBlock) * hd));
  for (int64_t m0 = 0; m0 < n; m0 += kKeyBlock) {
    const int64_t kb = std::min(kKeyBlock, n - m0);
    for (int64_t m = 0; m < kb; ++m) rows.key(sc.keys[size_t(m0 + m)], kvh, sc.k.data() + m * hd);
    const Matrix keys{"attention keys", DType::F32, sc.k.data(), kb, hd};
    prepare_input(keys, sc.q.data(), R, true, sc.in);
    matmul_rows(keys, sc.in, sc.s.data() + m0, n, 0, kb);
  }

  // Softmax per query row over the keys its token sees: the union's entries [a0, a1) (sinks)
  // and [b0, end) (the rest), in key order.
  const auto at = [&](int64_t j) {
    return int64_t(std::lower_bound(sc.keys.begin(), sc.keys.end(), j) - sc.keys.begin());
  };
  for (int64_t ti = 0; ti < nt; ++ti) {
    const int64_t pos = p.n_past + t0 + ti, first = vis.first(pos), end = at(pos + 1);
    int64_t a0 = 0, a1 = 0, b0 = at(first);
    if (vis.window > 0) {
      const int64_t recent = vis.recent(pos);
      a0 = b0;
      a1 = std::max(a0, at(std::min(vis.sinks, recent)));
      b0 = std::max(a1, at(recent));
    }
    for (int g = 0; g < group; ++g) {
      float* s = sc.s.data() + (ti * group + g) * n;
      const float sink = p.sinks ? p.sinks->data[h0 + g] : -INFINITY;
      const std::pair<int64_t, int64_t> seen[2] = {{a0, a1}, {b0, end}};
      float mx = sink;
      for (const auto& [m0, m1] : seen)
        for (int64_t m = m0; m < m1; ++m) mx = std::max(mx, s[m] *= p.scale);
      float sum = p.sinks ? std::exp(sink - mx) : 0.0f;
      for (const auto& [m0, m1] : seen)
        for (int64_t m = m0; m < m1; ++m) sum += (s[m] = std::exp(s[m] - mx));
      std::fill(s, s + a0, 0.0f);
      std::fill(s + a1, s + b0, 0.0f);
      std::fill(s + end, s + n, 0.0f);
      for (const auto& [m0, m1] : seen)
        for (int64_t m = m0; m < m1; ++m) s[m] /= sum;  // divided, as the one-token loop's weights
    }
  }

  // O = P V, with V^T's rows the value dimensions.
  sc.o.assign(size_t(R * vd), 0.0f);
  sc.ob.resize(size_t(R * vd));
  sc.row.resize(size_t(vd * std::min(n, kKeyBlock)));
  sc.vt.resize(size_t(vd * std::min(n, kKeyBlock)));
  sc.p.resize(size_t(R * std::min(n, kKeyBlock)));
  for (int64_t m0 = 0; m0 < n; m0 += kKeyBlock) {
    const int64_t kb = std::min(kKeyBlock, n - m0);
    for (int64_t m = 0; m < kb; ++m) rows.value(sc.keys[size_t(m0 + m)], kvh, sc.row.data() + m * vd);
    for (int64_t mt = 0; mt < kb; mt += 16)  // V^T, by tiles of 16 x 16
      for (int64_t dt = 0; dt < vd; dt += 16)
        for (int64_t m = mt; m < std::min(kb, mt + 16); ++m)
          for (int64_t d = dt; d < std::min<int64_t>(vd, dt + 16); ++d)
            sc.vt[size_t(d * kb + m)] = sc.row[size_t(m * vd + d)];
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(sc.p.data() + r * kb, sc.s.data() + r * n + m0, size_t(kb) * sizeof(float));
    const Matrix values{"attention values", DType::F32, sc.vt.data(), vd, kb};
    prepare_input(values, sc.p.data(), R, true, sc.in);
    matmul_rows(values, sc.in, m0 == 0 ? sc.o.data() : sc.ob.data(), vd, 0, vd);
    if (m0 > 0)
      for (size_t i = 0; i < sc.o.size(); ++i) sc.o[i] += sc.ob[i];
  }
  for (int64_t ti = 0; ti < nt; ++ti)
    std::memcpy(out.data + (t0 + ti) * out.cols + h0 * vd, sc.o.data() + ti * group * vd,
                size_t(group * vd) * sizeof(float));
}

}  // namespace

void attention_by_blocks(ThreadPool& pool, const Buffer& q, const AttentionParams& p, const KeyRows& rows,
                         Buffer& out) {
  const int64_t T = q.rows, H = p.n_kv_heads, group = p.n_heads / p.n_kv_heads;
  const Visibility vis{p.sliding_window, p.kv.window, p.kv.sinks};
  // Tokens per item: about kQueryRows query rows, at least four items a thread, and the scores
  // of the widest item within kScoreFloats.
  const int64_t threads = pool.size(), widest = p.n_past + T;
  int64_t per = std::max<int64_t>(1, kQueryRows / group);
  per = std::min(per, std::max<int64_t>(1, (T * H + 4 * threads - 1) / (4 * threads)));
  per = std::min(per, std::max<int64_t>(1, kScoreFloats / (group * widest)));
  const int64_t blocks = (T + per - 1) / per;
  pool.parallel_for(size_t(H * blocks), [&](size_t i0, size_t i1) {
    thread_local Scratch sc;
    for (size_t i = i0; i < i1; ++i) {
      const int64_t b = int64_t(i) / H, t0 = b * per;
      attend_item(q, p, rows, vis, int(int64_t(i) % H), t0, std::min(T, t0 + per), out, sc);
    }
  });
}

}  // namespace moestream::cpu
