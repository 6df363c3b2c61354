// Launchers of rotary embeddings and attention (attention.cu). Device pointers; work on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"

namespace moestream::cuda {

// Rotates each head of x (T rows of x.cols) at positions n_past + t; inv_freq on the device.
void rope(Buffer& x, int n_heads, int head_dim, const RopeTable& rope, const float* inv_freq, int64_t n_past,
          cudaStream_t s);

// Causal attention of q (T, n_heads * head_dim) over cache rows [0, n_past + t] (the caches
// already hold this call's keys and values): out (T, n_heads * v_head_dim). sinks: device
// pointer or null.
void attention(const Buffer& q, const Buffer& k_cache, const Buffer& v_cache, const AttentionParams& p,
               const float* sinks, Buffer& out, cudaStream_t s);

}  // namespace moestream::cuda
