// CPU Gated DeltaNet (Backend::gated_delta_net): causal conv1d with a rolling state, the gated
// delta rule in its token-by-token (recurrent) form and its chunked form, and the gated RMSNorm.
//
// The chunked form processes up to kChunk tokens of a value head at once: the delta-rule updates
// inside a chunk form a unit lower-triangular system, solved by forward substitution, after which
// the chunk's outputs and its effect on the state are matrix products. It computes the same
// function as the recurrence (up to float rounding) and is what prefill uses.
#pragma once

#include <vector>

#include "backend/backend.h"

namespace moestream {
class ThreadPool;
}

namespace moestream::cpu {

enum class DeltaRuleForm { Recurrent, Chunked };

constexpr int kDeltaNetChunk = 64;  // tokens per chunk of the chunked form

// Work space reused across calls: it grows to the largest batch seen, then never allocates.
struct DeltaNetScratch {
  std::vector<float> mixed;      // [T, conv_dim] conv + SiLU output; q, k normalized in place
  std::vector<float> g, beta;    // [T, n_v_heads] log decay and write strength
  std::vector<float> core;       // [T, n_v_heads * v_head_dim] delta-rule output
  std::vector<std::vector<float>> per_head;  // chunked form: one work area per value head
};

// See Backend::gated_delta_net; `form` picks the delta-rule algorithm.
void gated_delta_net(ThreadPool& pool, const Buffer& qkv, const Buffer& z, const Buffer& b,
                     const Buffer& a, const DeltaNetWeights& w, const DeltaNetParams& p,
                     DeltaNetState& state, Buffer& out, DeltaNetScratch& scratch, DeltaRuleForm form);

}  // namespace moestream::cpu
