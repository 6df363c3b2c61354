// CPU attention over a compact or windowed KV cache (backend/kv_cache.h). The f32 cache without
// a window keeps the backend's own loop, so its results do not change.
#pragma once

#include <vector>

#include "backend/backend.h"

namespace moestream {
class ThreadPool;
}

namespace moestream::cpu {

// Backend::attention for any p.kv: new rows are packed (into `staged` when the cache is a ring,
// so that a batch longer than the ring still reads every key it needs, then copied to their
// rows), and each key and value row is unpacked to float32 as it is read, then multiplied as the
// f32 cache's are: one token by the dot_f32 / axpy loop, several by attention_by_blocks.
void attention_kv(ThreadPool& pool, const Buffer& q, const Buffer& k, const Buffer& v, Buffer& k_cache,
                  Buffer& v_cache, const AttentionParams& p, Buffer& out, std::vector<float>& staged);

}  // namespace moestream::cpu
