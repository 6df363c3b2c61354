// Launchers of the MoE kernels (moe.cu): routing on the GPU, grouping of (token, expert) pairs
// by expert, the expert FFNs of many experts in one launch (weights found through a device-side
// table indexed by layer * n_experts + expert), and the weighted combine.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/linear.h"
#include "backend/cuda/op_profile.h"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

// One routed expert's weights in device memory, as the expert kernels find it in the table.
struct DevExpert {
  WeightRef gate, up, down;
  const float* gate_bias = nullptr;  // [inter] or null
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;  // [dim] or null
  int formats = 0;                   // format_pair(gate/up format, down format)
  // Its bytes are the host tier's (mapped pinned memory, read in place over PCIe), not a VRAM
  // slot's: the batched decode step's lane-decoded kernels then copy whole lines of it.
  int in_host = 0;
};

// One code for an expert's (gate/up, down) formats: a layer whose experts differ in format (a
// tiered pack's hot and cold experts) runs each format's kernels over the experts of that code.
inline int format_pair(FormatTag gate_up, FormatTag down) {
  return (gate_up.kind * 2 + int(gate_up.scale_f16)) * 64 + down.kind * 2 + int(down.scale_f16);
}

// (token, expert) pairs grouped by expert. Pairs of active expert a occupy rows
// [offset[a], offset[a + 1]) of the hidden / output buffers; row_token[row] is the token,
// row_of[t * k + i] the row of token t's i-th selection.
struct MoeGroups {
  int* n_active;    // [1] (device-built groups) or unused
  int* active;      // [<= min(E, T*k)] expert ids
  int* offset;      // [<= min(E, T*k) + 1]
  int* row_token;   // [T*k]
  int* row_of;      // [T*k]
  // Groups of several tokens built on the device: row r starts a chunk of up to `chunk` rows of
  // one expert (group_by_expert's) when row_chunk[r] = (expert << 4) | rows in it, else 0.
  int* row_chunk;   // [T*k]
};

// sel_ids/sel_w [T, k]: each token's experts in ascending id order and their weights. With
// direct_groups and T == 1 it also writes the groups (so group_by_expert is not needed).
void route(const float* logits, int64_t T, const MoeParams& p, const float* router_bias, int* sel_ids,
           float* sel_w, const MoeGroups* direct_groups, cudaStream_t s);
// The router logits of T <= kGemvMaxTokens tokens (x [T, dim] . router^T into logits [T,
// n_experts], as linear computes them) and their route() in one launch, bit for bit, when the
// router's format and shape allow (at most 256 experts; else false, nothing launched): the blocks
// of token t are grid row t, and the last of them to finish routes it. blocks_done: T device
// counters that are 0 (and are 0 again after the launch). direct_groups: as route()'s, T == 1.
bool route_few(const Matrix& router, const float* x, int64_t T, const MoeParams& p, const float* router_bias,
               float* logits, int* sel_ids, float* sel_w, const MoeGroups* direct_groups, unsigned* blocks_done,
               cudaStream_t s);
// Groups built on the device (every expert resident): active experts in ascending order, and
// each expert's rows cut into chunks of `chunk` rows (1 to 8; 0: no chunks).
void group_by_expert(const int* sel_ids, int64_t T, int k, int n_experts, int chunk, MoeGroups g, cudaStream_t s);

struct ExpertBatch {
  const DevExpert* table;  // row of this layer: table[expert]
  FormatTag gate_up, down;
  int64_t dim, inter;
  MoeGroups groups;
  int64_t pairs = 0;              // (token, expert) pairs of the call: T * top_k
  int a_begin = 0, a_end = 0;     // active experts [a_begin, a_end) ...
  bool count_on_device = false;   // ... or [0, *groups.n_active) when true, a_end an upper bound
  const float* x;     // [T, dim]
  float* hidden;      // [T*k, inter]
  float* y;           // [T*k, dim]
  const MoeParams* params;
  // The call has at most kGemvMaxTokens tokens (one decode token, or a batched decode step: most
  // active experts get one or two rows). One token takes the decode kernels; several take the
  // tensor cores in work items of 8 rows (few_mma_enabled: q4 and q8 the lane-decoded kernels of
  // expert_few_mma.cu, other formats the exact ones; else the decode kernels, each row computed
  // as a lone decode step computes it).
  bool few_tokens = false;
  // With few tokens and groups built on the device: a block of the decode kernels per chunk of
  // this many rows of one expert (the groups' row_chunk; expert_rows_per_block), the chunk's rows
  // against one read of the weights. 0: a block per expert, its rows in turn.
  int rows_per_block = 0;
  // When the layer mixes formats: the format_pair of gate_up and down, and the kernels skip the
  // experts of other formats (the caller runs each of the layer's formats); -1 runs every expert.
  int only_formats = -1;
  // The smallest log2(group size) of the layer's expert matrices; -1 when a group size is not a
  // power of two or not known (the lane-decoded kernels of expert_few_mma.cu need it).
  int group_shift = -1;
  // Some of the table's experts may be read in place from the host tier (DevExpert::in_host): the
  // batched kernels then stage their lines (false with MOESTREAM_CUDA_EXPERT_STAGING=0).
  bool in_place = false;
  // Every expert of the layer, wherever it lives, has its words, scales and biases 16-byte aligned
  // (the lane-decoded kernels may then stage every expert without checking; false with
  // MOESTREAM_CUDA_EXPERT_STAGING=0).
  bool staged_aligned = false;
  // The call takes the tensor-core path (run_experts_gemm, with this handle and scratch). Decided
  // once per MoE call, never per batch, so that how a call's experts split into batches (what
  // is resident, the budgets) does not change how any expert is computed.
  bool tensor_cores = false;
  GemmScratch* gemm = nullptr;
  Scratch* exact = nullptr;      // the exact tensor-core kernels' split activations and work items
  OpProfile* profile = nullptr;  // when profiling: the gate/up and down kernels as entries of their own
};
// What the expert kernels read (expert_args(batch) fills it): the table, the groups, the
// buffers and the activation.
struct ExpertArgs {
  const DevExpert* table;
  MoeGroups g;
  int a_begin, a_end;
  bool count_on_device;
  int only_formats;
  int k, nt_max;
  const float* x;
  float* hidden;
  float* y;
  int64_t dim, inter;
  bool clamped;
  float limit, alpha;
  bool down_early;  // down_early(), for down's kernels and the combine
};
ExpertArgs expert_args(const ExpertBatch& b);
// Whether down's kernels read their work and issue their first weight loads, and the combine reads
// the selections' weights and rows, before they wait for the kernel before them
// (MOESTREAM_CUDA_DOWN_EARLY=0: after, for comparison; read once). What they read early is
// older than that kernel (gate/up, the split of the hidden rows, down), which waited for it before
// they could start, so the loads see it whole.
bool down_early();
// The rows_per_block a call of `pairs` (token, expert) pairs of rows [dim] and [inter] takes
// (MOESTREAM_CUDA_EXPERT_ROWS=0, 1, 2 or 4 chooses another, for comparison).
int expert_rows_per_block(int64_t pairs, int k, int64_t dim, int64_t inter);

#ifdef __CUDACC__
// The expert of this block (blockIdx.y indexes the batch's active experts) and its rows
// [r0, r1); false when the block has none (past the active count, or another format's expert).
__device__ __forceinline__ bool block_expert(const ExpertArgs& a, int& expert, int& r0, int& r1) {
  const int ai = a.a_begin + int(blockIdx.y);
  const int end = a.count_on_device ? *a.g.n_active : a.a_end;
  if (ai >= end) return false;
  expert = a.g.active[ai];
  if (a.only_formats >= 0 && a.table[expert].formats != a.only_formats) return false;
  r0 = a.g.offset[ai];
  r1 = a.g.offset[ai + 1];
  return true;
}
// The same when blockIdx.y indexes rows (rows_per_block > 0): the chunk that starts at row y.
__device__ __forceinline__ bool block_chunk(const ExpertArgs& a, int& expert, int& r0, int& r1) {
  const int c = a.g.row_chunk[blockIdx.y];
  if (c == 0) return false;
  expert = c >> 4;
  if (a.only_formats >= 0 && a.table[expert].formats != a.only_formats) return false;
  r0 = int(blockIdx.y);
  r1 = r0 + (c & 15);
  return true;
}
#endif

// hidden = act(gate x, up x) and y = down hidden for every (token, expert) row of the batch.
// Calls that take the tensor cores (use_expert_gemm) go to run_experts_gemm.
void run_experts(const ExpertBatch& b, cudaStream_t s);

// The prefill path (expert_gemm.cu): each active expert's matrices dequantized to FP16, its rows
// of x gathered and rounded to FP16, and the products on the tensor cores through cuBLAS grouped
// GEMMs (one problem per expert and matrix) with float32 sums; the activation in float32 between
// them. Experts go in chunks whose FP16 weights fit MOESTREAM_CUDA_EXPERT_GEMM_MB (default 256).
// It reads the groups' offsets back to the host: one wait per batch. Same tolerance as linear()'s
// GemmMath::Fp16.
// A call of T tokens choosing k of E experts takes it when tensor_cores_for(T) (linear.h) and its
// rows per selected expert, T * k / min(E, T * k), reach 8 (MOESTREAM_CUDA_EXPERT_GEMM_ROWS moves
// the bound; tests force the path with 1) and dim and inter are multiples of 8.
bool use_expert_gemm(int64_t T, int k, int E, int64_t dim, int64_t inter);
// The same batches through fused kernels (expert_mma.cu): weights dequantized into shared memory
// and multiplied with WMMA, no FP16 copy in HBM and no host round trip. Taken for calls that take
// the tensor cores when dim and inter are multiples of 32 (MOESTREAM_CUDA_EXPERT_MMA=0: the
// cuBLAS path instead).
bool experts_mma_supported(const ExpertBatch& b);
void run_experts_mma(const ExpertBatch& b, cudaStream_t s);
// The default for calls of more than one token (expert_exact_mma.cu): the codes of quantized
// experts (exact in FP16) times activations split into two FP16 halves on the tensor cores, the
// groups' scales and biases applied in float32: float32-level rounding, tensor-core speed. Each
// active expert's rows go in chunks of 32 to blocks of their own (planned on the device, no host
// round trip); a batched decode step's in chunks of 8. Taken when both matrices are quantized,
// dim and inter are multiples of 32 and the batch has its `exact` scratch
// (MOESTREAM_CUDA_EXACT_MMA=0: the CUDA-core kernels instead, for comparison).
bool experts_exact_mma_supported(const ExpertBatch& b);
void run_experts_exact_mma(const ExpertBatch& b, cudaStream_t s);
void run_experts_gemm(const ExpertBatch& b, cudaStream_t s);

// out[t] = sum_i sel_w[t, i] * y[row_of[t * k + i]]
void combine(const float* y, const float* sel_w, const int* row_of, int64_t T, int k, int64_t dim, float* out,
             cudaStream_t s);

}  // namespace moestream::cuda
