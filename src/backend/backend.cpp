#include "backend/backend.h"

#include "core/error.h"

namespace moestream {

void check_attention_args(const Buffer& q, const Buffer& k, const Buffer& v, const Buffer& k_cache,
                          const Buffer& v_cache, const AttentionParams& p) {
  const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
  const int64_t T = q.rows, kv_dim = int64_t(p.n_kv_heads) * hd, v_dim = int64_t(p.n_kv_heads) * vd;
  if (p.n_past + T > k_cache.rows)
    fail("context full: ", p.n_past + T, " positions needed, cache holds ", k_cache.rows);
  if (k.cols != kv_dim || k_cache.cols != kv_dim ||
      (p.values_in_keys ? vd > hd : v.cols != v_dim || v_cache.cols != v_dim))
    fail("attention: k/v widths ", k.cols, "/", v.cols, " (caches ", k_cache.cols, "/", v_cache.cols,
         ") do not match ", p.n_kv_heads, " heads of ", hd, "/", vd);
}

}  // namespace moestream
