// CPU attention for calls of several new tokens (prefill chunks), by blocks of queries.
//
// One work item is a kv head and a block of consecutive tokens: its query rows (the block's
// tokens times the heads that share the kv head) against every key one of them sees, as two
// small GEMMs through the float path of matmul_rows (kernels.h), so that each key and value row
// is read once per block instead of once per query head and token:
//   scores  S = Q K^T, the keys of the block's union 256 at a time;
//   softmax per query row over its own visible keys, as the one-token loop computes it
//           (max with the sink, exp, sum in key order, then each weight divided by the sum);
//   output  O = P V, 256 keys at a time, the blocks' products added in order.
// Keys a row does not see get weight 0. A (query, key) score is one product chain in head-dim
// order, and a row's output sums the same key blocks, counted from the first key of the block's
// union, whatever the other rows; so the result does not depend on how tokens are blocked, or on
// how a prompt is cut into calls when no sliding window moves the first key. The order differs
// from the one-token loop (dot_f32 / axpy), so the last bits can differ between a token attended
// alone and in a batch, as for the linear layers.
#pragma once

#include <cstdint>
#include <functional>

#include "backend/backend.h"

namespace moestream {
class ThreadPool;
}

namespace moestream::cpu {

// Where the float32 rows of key position j come from, for kv head h: its key (p.head_dim floats)
// and value (v_head_dim floats) written to dst.
struct KeyRows {
  std::function<void(int64_t j, int h, float* dst)> key, value;
};

// out (T rows, p.n_heads * v_head_dim) for the T = q.rows tokens at positions p.n_past ..,
// each seeing the positions j <= its own that the model's sliding window and the cache's window
// (p.kv.window, p.kv.sinks) keep. Every such position must be readable through rows.
void attention_by_blocks(ThreadPool& pool, const Buffer& q, const AttentionParams& p, const KeyRows& rows,
                         Buffer& out);

}  // namespace moestream::cpu
