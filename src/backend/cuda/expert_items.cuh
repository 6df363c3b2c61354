// The work items of the experts of a call with more than one token (expert_exact_mma.cu plans
// them): an active expert's rows (its (token, slot) pairs) in chunks of a few rows, one chunk per
// grid row of the product kernels, over activations split into two FP16 halves (split_rows.cuh).
// The batched decode step's q4 and q8 experts go through the lane-decoded kernels of
// expert_few_mma.cu, every other item through expert_exact_mma.cu's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/moe.h"
#include "backend/cuda/split_rows.cuh"

namespace moestream::cuda {

struct ExactArgs {
  ExpertArgs e;
  const int2* work;  // [*n_work]: (active index, first row within the expert's rows)
  const int* n_work;
  SplitRows in;  // gate/up: the tokens' x; down: the hidden rows
};

// Whether the lane-decoded kernels take a matrix of this format, width and smallest group shift
// (MOESTREAM_CUDA_EXPERT_LANES=0: never, for comparison).
bool few_lanes_take(FormatTag t, int group_shift, int64_t cols);
// hidden = act(gate x, up x) and y = down hidden over work items of up to kFewLaneRows rows, grid
// rows 0 .. items - 1 (items past *n_work return at once). in_place: the table may point into the
// host tier (ExpertBatch::in_place); aligned: every expert's arrays are aligned for the staging
// (ExpertBatch::staged_aligned).
constexpr int kFewLaneRows = 8;
void gate_up_few_lanes(const ExactArgs& a, FormatTag t, int group_shift, unsigned items,
                       bool in_place, bool aligned, cudaStream_t s);
void down_few_lanes(const ExactArgs& a, FormatTag t, int group_shift, unsigned items, bool in_place,
                    bool aligned, cudaStream_t s);

#ifdef __CUDACC__
// The work item of this block: its expert and rows [r0, r0 + nt); false when there is none.
// early (down's kernels, ExpertArgs::down_early): the caller waits for the kernel before, after its
// first weight loads (the plan is older than that kernel).
template <int TOK>
__device__ __forceinline__ bool block_work(const ExactArgs& a, int& expert, int& r0, int& nt,
                                          bool early = false) {
  // the plan and x are the kernels' before (when launched to overlap them)
  if (!early) follow_prior_grid();
  if (int(blockIdx.y) >= *a.n_work) return false;
  const int2 w = a.work[blockIdx.y];
  expert = a.e.g.active[w.x];
  if (a.e.only_formats >= 0 && a.e.table[expert].formats != a.e.only_formats) return false;
  r0 = a.e.g.offset[w.x] + w.y;
  nt = min(TOK, a.e.g.offset[w.x + 1] - r0);
  return true;
}
#endif

}  // namespace moestream::cuda
