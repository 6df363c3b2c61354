// Launchers of rotary embeddings and attention (attention.cu). Device pointers; work on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"

namespace moestream::cuda {

// Rotates each head of x (T rows of x.cols) at positions n_past + t; inv_freq on the device.
void rope(Buffer& x, int n_heads, int head_dim, const RopeTable& rope, const float* inv_freq, int64_t n_past,
          cudaStream_t s);

// Each head of q (n_heads) and k (n_kv_heads) RMS-normalized with q_norm / k_norm (device
// pointers, null: no norm; `threads` per block, cuda::rmsnorm_threads(head_dim) for rmsnorm()'s
// sums) then rotated at positions n_past + t, in one launch.
void qk_norm_rope(Buffer& q, Buffer& k, const float* q_norm, const float* k_norm, float eps, int n_heads,
                  int n_kv_heads, int head_dim, const RopeTable& rope, const float* inv_freq, int64_t n_past,
                  int threads, cudaStream_t s);

// The decode rows of several sequences in one batched step: row row[i] of q, k, v and out is
// sequence i's token at position pos[i], with its layer's caches (F32 rows, no KV window).
constexpr int kMaxDecodeRows = 16;
struct DecodeRows {
  int n = 0;
  int64_t row[kMaxDecodeRows] = {}, pos[kMaxDecodeRows] = {};
  float* k_cache[kMaxDecodeRows] = {};
  float* v_cache[kMaxDecodeRows] = {};
};

// qk_norm_rope, then the cache appends and attention of each of rows' decode rows, in two launches,
// every row computed as the one-token calls compute it (the same sums in the same order).
void decode_attention(Buffer& q, Buffer& k, const Buffer& v, const float* q_norm, const float* k_norm, float eps,
                      const RopeTable& rope, const float* inv_freq, int threads, const DecodeRows& rows,
                      const AttentionParams& p, const float* sinks, Buffer& out, cudaStream_t s);

// Causal attention of q (T, n_heads * head_dim) over positions [0, n_past + t] (those p.kv's
// window keeps; the caches already hold this call's keys and values, or with a ring k_staged and
// v_staged do, as kv_pack wrote them): out (T, n_heads * v_head_dim). sinks: device pointer or null.
// With k_append and v_append (one query row, F32 caches without a window, keys and values apart):
// its new key and value are read from k_staged and v_staged and stored by the kernel into those
// cache rows (row n_past), so the step needs no copies of its own.
// With `split` (attention_split_bytes(p, q.rows) bytes of device memory, where that is not 0)
// prefill splits the keys and values for the tensor cores once per call instead of once per block.
void attention(const Buffer& q, const Buffer& k_cache, const Buffer& v_cache, const AttentionParams& p,
               const float* sinks, Buffer& out, cudaStream_t s, const float* k_staged = nullptr,
               const float* v_staged = nullptr, float* k_append = nullptr, float* v_append = nullptr,
               void* split = nullptr);

// The scratch bytes attention() can use as `split` for this call; 0 where it takes none.
size_t attention_split_bytes(const AttentionParams& p, int64_t T);

// Packs each row of x (x.cols values in `heads` heads) into dst rows of `words` words, as
// kv_store_row does on the host.
void kv_pack(const Buffer& x, int heads, KvType type, float* dst, int64_t words, cudaStream_t s);

// After attention over a ring: the T staged rows that the ring keeps into their rows of cache.
void kv_ring_store(const float* staged, Buffer& cache, int64_t T, const AttentionParams& p, cudaStream_t s);

}  // namespace moestream::cuda
