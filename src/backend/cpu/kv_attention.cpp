#include "backend/cpu/kv_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/attention_blocks.h"
#include "backend/cpu/kernels.h"
#include "core/thread_pool.h"

namespace moestream::cpu {

void attention_kv(ThreadPool& pool, const Buffer& q, const Buffer& k, const Buffer& v, Buffer& k_cache,
                  Buffer& v_cache, const AttentionParams& p, Buffer& out, std::vector<float>& staged) {
  const KvCacheSpec& kv = p.kv;
  const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim, H = p.n_kv_heads;
  const int64_t T = q.rows, kv_dim = int64_t(H) * hd, v_dim = int64_t(H) * vd;
  const int64_t kw = k_cache.cols, vw = p.values_in_keys ? 0 : v_cache.cols;
  const bool ring = kv.window > 0 && kv.ring && k_cache.rows == kv.sinks + kv.window;

  // New rows: straight into the cache, or staged when the ring could overwrite a key that an
  // earlier query of this batch still reads.
  float* k_new = k_cache.data + p.n_past * kw;
  float* v_new = p.values_in_keys ? nullptr : v_cache.data + p.n_past * vw;
  if (ring) {
    staged.resize(size_t(T * (kw + vw)));
    k_new = staged.data();
    v_new = staged.data() + T * kw;
  }
  for (int64_t t = 0; t < T; ++t) {
    kv_store_row(kv.type, k.data + t * kv_dim, kv_dim, H, k_new + t * kw);
    if (!p.values_in_keys) kv_store_row(kv.type, v.data + t * v_dim, v_dim, H, v_new + t * vw);
  }
  const auto k_row = [&](int64_t j) {
    return j >= p.n_past ? k_new + (j - p.n_past) * kw : k_cache.data + kv_slot(kv, j) * kw;
  };
  const auto v_row = [&](int64_t j) {
    if (p.values_in_keys) return k_row(j);
    return j >= p.n_past ? v_new + (j - p.n_past) * vw : v_cache.data + kv_slot(kv, j) * vw;
  };
  const int64_t v_cols = p.values_in_keys ? kv_dim : v_dim, v_head = p.values_in_keys ? hd : vd;
  const int group = p.n_heads / H;

  if (T > 1) {
    // A prompt chunk: by blocks of queries, as the f32 cache's (attention_blocks.h), each row
    // unpacked as it is read.
    KeyRows rows;
    rows.key = [&](int64_t j, int h, float* dst) { kv_load(kv.type, k_row(j), kv_dim, H, int64_t(h) * hd, hd, dst); };
    rows.value = [&](int64_t j, int h, float* dst) {
      kv_load(kv.type, v_row(j), v_cols, H, int64_t(h) * v_head, vd, dst);
    };
    attention_by_blocks(pool, q, p, rows, out);
  } else {
    // One work item per (token, kv head): each visible key and value row is unpacked once and used
    // by the `group` query heads that share it. Per head the arithmetic is the f32 path's: the same
    // dot_f32 and axpy calls in the same order.
    pool.parallel_for(size_t(T * H), [&](size_t i0, size_t i1) {
      thread_local std::vector<float> scores, row, sums;
      thread_local std::vector<int64_t> keys;
      row.resize(size_t(std::max(hd, vd)));
      for (size_t i = i0; i < i1; ++i) {
        const int64_t t = int64_t(i) / H;
        const int kvh = int(int64_t(i) % H), h0 = kvh * group;
        const int64_t pos = p.n_past + t, n_keys = pos + 1;
        // Visible keys: the model's own sliding window, then the KV window (sinks + latest).
        const int64_t first = p.sliding_window > 0 ? std::max<int64_t>(0, n_keys - p.sliding_window) : 0;
        keys.clear();
        if (kv.window > 0) {
          const int64_t recent = std::max<int64_t>(0, n_keys - kv.window);
          for (int64_t j = first; j < std::min({kv.sinks, recent, n_keys}); ++j) keys.push_back(j);
          for (int64_t j = std::max(first, recent); j < n_keys; ++j) keys.push_back(j);
        } else {
          for (int64_t j = first; j < n_keys; ++j) keys.push_back(j);
        }
        const size_t n = keys.size();
        scores.resize(n * size_t(group));  // [head g][key]
        for (size_t m = 0; m < n; ++m) {
          kv_load(kv.type, k_row(keys[m]), kv_dim, H, int64_t(kvh) * hd, hd, row.data());
          for (int g = 0; g < group; ++g)
            scores[size_t(g) * n + m] = dot_f32(q.data + t * q.cols + int64_t(h0 + g) * hd, row.data(), hd) * p.scale;
        }
        sums.assign(size_t(group), 0.0f);
        for (int g = 0; g < group; ++g) {
          float* sc = scores.data() + size_t(g) * n;
          const float sink = p.sinks ? p.sinks->data[h0 + g] : -INFINITY;
          float mx = sink;
          for (size_t m = 0; m < n; ++m) mx = std::max(mx, sc[m]);
          float sum = p.sinks ? std::exp(sink - mx) : 0.0f;
          for (size_t m = 0; m < n; ++m) sum += (sc[m] = std::exp(sc[m] - mx));
          sums[size_t(g)] = sum;
          float* o = out.data + t * out.cols + int64_t(h0 + g) * vd;
          std::fill(o, o + vd, 0.0f);
        }
        for (size_t m = 0; m < n; ++m) {
          kv_load(kv.type, v_row(keys[m]), v_cols, H, int64_t(kvh) * v_head, vd, row.data());
          for (int g = 0; g < group; ++g)
            axpy(scores[size_t(g) * n + m] / sums[size_t(g)], row.data(),
                 out.data + t * out.cols + int64_t(h0 + g) * vd, vd);
        }
      }
    });
  }

  if (!ring) return;
  // Into the ring: the sinks among the new positions and the latest `window` of them.
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = p.n_past + t;
    if (pos >= kv.sinks && pos < p.n_past + T - kv.window) continue;
    std::memcpy(k_cache.data + kv_slot(kv, pos) * kw, k_new + t * kw, size_t(kw) * sizeof(float));
    if (!p.values_in_keys)
      std::memcpy(v_cache.data + kv_slot(kv, pos) * vw, v_new + t * vw, size_t(vw) * sizeof(float));
  }
}

}  // namespace moestream::cpu
