// Launchers of the MoE kernels (moe.cu): routing on the GPU, grouping of (token, expert) pairs
// by expert, the expert FFNs of many experts in one launch (weights found through a device-side
// table indexed by layer * n_experts + expert), and the weighted combine.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

// One routed expert's weights in device memory, as the expert kernels find it in the table.
struct DevExpert {
  WeightRef gate, up, down;
  const float* gate_bias = nullptr;  // [inter] or null
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;  // [dim] or null
};

// (token, expert) pairs grouped by expert. Pairs of active expert a occupy rows
// [offset[a], offset[a + 1]) of the hidden / output buffers; row_token[row] is the token,
// row_of[t * k + i] the row of token t's i-th selection.
struct MoeGroups {
  int* n_active;    // [1] (device-built groups) or unused
  int* active;      // [<= min(E, T*k)] expert ids
  int* offset;      // [<= min(E, T*k) + 1]
  int* row_token;   // [T*k]
  int* row_of;      // [T*k]
};

// sel_ids/sel_w [T, k]: each token's experts in ascending id order and their weights. With
// direct_groups and T == 1 it also writes the groups (so group_by_expert is not needed).
void route(const float* logits, int64_t T, const MoeParams& p, const float* router_bias, int* sel_ids,
           float* sel_w, const MoeGroups* direct_groups, cudaStream_t s);
// Groups built on the device (every expert resident): active experts in ascending order.
void group_by_expert(const int* sel_ids, int64_t T, int k, int n_experts, MoeGroups g, cudaStream_t s);

struct ExpertBatch {
  const DevExpert* table;  // row of this layer: table[expert]
  FormatTag gate_up, down;
  int64_t dim, inter;
  MoeGroups groups;
  int a_begin = 0, a_end = 0;     // active experts [a_begin, a_end) ...
  bool count_on_device = false;   // ... or [0, *groups.n_active) when true, a_end an upper bound
  const float* x;     // [T, dim]
  float* hidden;      // [T*k, inter]
  float* y;           // [T*k, dim]
  const MoeParams* params;
  bool one_token = false;  // the call has one token (each active expert one row): the decode kernels
};
// hidden = act(gate x, up x) and y = down hidden for every (token, expert) row of the batch.
void run_experts(const ExpertBatch& b, cudaStream_t s);
// out[t] = sum_i sel_w[t, i] * y[row_of[t * k + i]]
void combine(const float* y, const float* sel_w, const int* row_of, int64_t T, int k, int64_t dim, float* out,
             cudaStream_t s);

}  // namespace moestream::cuda
