// MoE on the GPU. Routing: one block per token, a thread per expert ranks it against all (ties
// to the lower expert id, as the CPU's partial_sort comparator). Experts: one launch covers every
// active expert of a batch (grid.y = active expert, grid.x = row tiles); the rows of an expert's
// tokens go through the GEMV tile kTokens at a time, kExpertRowTiles tiles per block, or, for one
// token, through kernels shaped for decode (below). Every row sums in one fixed order, so a row's value does not depend on
// which batch or tier its expert came from.
#include "backend/cuda/moe.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "backend/cuda/gemv_one.cuh"

namespace moestream::cuda {

namespace {

constexpr int kMaxTopK = 32;
// Row tiles of kGemvRows per block of the batched expert kernels, all computed from one staging
// of the block's x rows: with one tile per block, staging x moved more bytes than the tile's
// weights. H100, pp512 of the 16-layer Qwen3-30B-A3B shape (q4 experts): 1 tile 3026 tok/s,
// 2 tiles 3409, 4 tiles 3375, 8 tiles 2926.
constexpr int kExpertRowTiles = 2;

struct RouteArgs {
  const float* logits;
  int n, k;
  RouterKind kind;
  bool norm_topk;
  const float* bias;
  int n_group, topk_group;
  float scaling;
  int* sel_ids;
  float* sel_w;
  MoeGroups groups;  // one token: the groups are the selection itself (written when direct)
  bool direct;
};

// Routers of more experts than this pick their top k from candidates (route_token).
constexpr int kRankAllMax = 256;

// Shared memory route_token uses for n experts and top k.
inline size_t route_smem_bytes(int n, int k) {
  const size_t candidates = n > kRankAllMax ? size_t(n) * sizeof(int) : 0;
  return (size_t(2 * n) + 32) * sizeof(float) + size_t(k) * sizeof(int) + candidates;
}

// Token t's routing by one block (blockDim.x a multiple of 32, at least k). The logits are read
// past L1 (another block of the same launch may have written them: route_few_kernel).
// Shared `sm`: probs [n], choice [n], scratch [32], by_rank [k], and past kRankAllMax experts the
// candidates [n].
__device__ __forceinline__ void route_token(const RouteArgs& a, int64_t t, float* sm) {
  float* probs = sm;
  float* choice = sm + a.n;
  float* scratch = sm + 2 * a.n;
  int* by_rank = reinterpret_cast<int*>(sm + 2 * a.n + 32);
  const int tid = threadIdx.x, nth = blockDim.x;
  const float* l = a.logits + t * a.n;
  if (tid < a.k) by_rank[tid] = 0;  // NaN scores may leave a rank unfilled: never an id out of range
  if (a.kind == RouterKind::SoftmaxTopK) {
    float mx = -INFINITY;
    for (int e = tid; e < a.n; e += nth) mx = fmaxf(mx, __ldcg(l + e));
    mx = block_max(mx, scratch);
    float sum = 0;
    for (int e = tid; e < a.n; e += nth) sum += (probs[e] = expf(__ldcg(l + e) - mx));
    sum = block_sum(sum, scratch);
    for (int e = tid; e < a.n; e += nth) choice[e] = probs[e] = probs[e] / sum;
  } else if (a.kind == RouterKind::SigmoidGroupTopK) {
    for (int e = tid; e < a.n; e += nth) {
      probs[e] = 1.0f / (1.0f + expf(-__ldcg(l + e)));
      choice[e] = probs[e] + (a.bias ? a.bias[e] : 0.0f);
    }
    __syncthreads();
    if (tid == 0) {  // groups: the sum of their two best choices; keep the topk_group best
      const int per = a.n / a.n_group;
      float gs[64];
      bool kept[64];
      for (int g = 0; g < a.n_group; ++g) {
        const float* c = choice + g * per;
        float best = -INFINITY;
        for (int i = 0; i < per; ++i) best = fmaxf(best, c[i]);
        float second = -INFINITY;
        for (int i = 0, skipped = 0; i < per; ++i) {
          if (c[i] == best && !skipped) skipped = 1;
          else second = fmaxf(second, c[i]);
        }
        gs[g] = best + (per > 1 ? second : 0.0f);
        kept[g] = false;
      }
      for (int r = 0; r < a.topk_group; ++r) {
        int bi = -1;
        for (int g = 0; g < a.n_group; ++g)
          if (!kept[g] && (bi < 0 || gs[g] > gs[bi])) bi = g;
        kept[bi] = true;
      }
      for (int e = 0; e < a.n; ++e)
        if (!kept[e / per]) choice[e] = 0.0f;
    }
  } else {  // TopKSoftmax
    for (int e = tid; e < a.n; e += nth) choice[e] = probs[e] = __ldcg(l + e) + (a.bias ? a.bias[e] : 0.0f);
  }
  __syncthreads();
  // An expert's rank: how many come first (a larger value, or an equal value and a lower id, as
  // the CPU's partial_sort comparator); the first k by rank.
  auto before = [&](int o, float w, int e, float v) { return w > v || (w == v && o < e); };
  if (a.n <= kRankAllMax) {
    // each thread ranks its experts against all
    for (int e = tid; e < a.n; e += nth) {
      const float v = choice[e];
      int rank = 0;
#pragma unroll 8
      for (int o = 0; o < a.n; ++o) rank += before(o, choice[o], e, v);
      if (rank < a.k) by_rank[rank] = e;
    }
  } else {
    // All against all is n^2 steps on one SM (~8 us for 512 experts). An expert with k others
    // before it among its 32 neighbours (ids e / 32 alike) has rank k or more; those with fewer
    // are the candidates, and an expert of rank below k has only candidates before it (each
    // non-candidate before it brings k of its own neighbours before it), so its rank among the
    // candidates is its rank. (32 + candidates) steps an expert instead of n.
    int* cand = reinterpret_cast<int*>(by_rank + a.k);
    __shared__ int n_cand;
    if (tid == 0) n_cand = 0;
    __syncthreads();
    for (int e = tid; e < a.n; e += nth) {
      const float v = choice[e];
      const int g0 = e / 32 * 32, g1 = min(a.n, g0 + 32);
      int near = 0;
#pragma unroll 8
      for (int o = g0; o < g1; ++o) near += before(o, choice[o], e, v);
      if (near < a.k) cand[atomicAdd(&n_cand, 1)] = e;
    }
    __syncthreads();
    const int nc = n_cand;
    for (int i = tid; i < nc; i += nth) {
      const int e = cand[i];
      const float v = choice[e];
      int rank = 0;
      for (int j = 0; j < nc; ++j) {
        const int o = cand[j];
        rank += before(o, choice[o], e, v);
      }
      if (rank < a.k) by_rank[rank] = e;
    }
  }
  __syncthreads();
  if (tid >= a.k) return;
  // Thread i: the i-th by rank. Sums over the k run in rank order, as the CPU's.
  const int id = by_rank[tid];
  float w;
  if (a.kind == RouterKind::TopKSoftmax) {
    const float mx = probs[by_rank[0]];
    float sum = 0;
    for (int i = 0; i < a.k; ++i) sum += expf(probs[by_rank[i]] - mx);
    w = expf(probs[id] - mx) / sum * a.scaling;
  } else {
    float norm = 1.0f;
    if (a.norm_topk) {
      float s = 0;
      for (int i = 0; i < a.k; ++i) s += probs[by_rank[i]];
      norm = 1.0f / (s + (a.kind == RouterKind::SigmoidGroupTopK ? 1e-20f : 0.0f));
    }
    w = probs[id] * norm * a.scaling;
  }
  // Stored in ascending expert id: the combine then sums in the CPU's order.
  int pos = 0;
  for (int i = 0; i < a.k; ++i) pos += by_rank[i] < id;
  a.sel_ids[t * a.k + pos] = id;
  a.sel_w[t * a.k + pos] = w;
  if (a.direct) {  // one token: expert i of the selection owns row i
    a.groups.active[pos] = id;
    a.groups.offset[tid] = tid;
    a.groups.row_token[tid] = tid;
    a.groups.row_of[tid] = tid;
    if (tid == 0) {
      a.groups.offset[a.k] = a.k;
      *a.groups.n_active = a.k;
    }
  }
}

// One block per token, a thread per expert (blockDim.x = n rounded up to a warp, at most 1024).
__global__ void route_kernel(RouteArgs a) {
  wait_prior_grid();
  allow_next_grid();
  extern __shared__ float sm[];
  route_token(a, blockIdx.x, sm);
}

// A few tokens (grid row t: token t): the router's logits on the single-token tile (gemv_one.cuh:
// each bit-identical to the GEMV's), then the block of the token's row that finishes last routes
// the token, in one launch. blocks_done[t] is 0 between launches (that last block resets it). R
// rows a warp: with_one_rows.
template <int KIND, bool SF16, int R>
__global__ void __launch_bounds__(kOneWarps * 32, 3)
    route_few_kernel(WeightRef w, const float* __restrict__ x, unsigned* blocks_done, RouteArgs a) {
  extern __shared__ float smem[];
  __shared__ bool last;
  const WeightRef* const ws[1] = {&w};
  const int64_t t = blockIdx.y;
  const int64_t row0 = int64_t(blockIdx.x) * (kOneWarps * R) + (threadIdx.x / 32) * R;
  const int lane = threadIdx.x & 31;
  RawPack<KIND> cur[1][R], next[1][R];
  load_first<KIND, 1, R>(ws, row0, cur, next);
  wait_prior_grid();  // the weights' first loads overlap the kernel before
  allow_next_grid();
  stage_row(x + t * w.cols, w.cols, smem);
  float acc[1][R];
  dot_rows<KIND, SF16, 1, R, false>(ws, row0, cur, next, smem, acc);
  float* logits = const_cast<float*>(a.logits) + t * a.n;
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (lane == r && row0 + r < w.rows) logits[row0 + r] = acc[0][r];
  __threadfence();
  __syncthreads();  // every warp's logits written, and its reads of smem done
  if (threadIdx.x == 0) last = atomicAdd(blocks_done + t, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) blocks_done[t] = 0;
  __threadfence();
  route_token(a, t, smem);
}

// One block: a stable counting sort of the (token, slot) pairs by expert, so that each expert's
// rows keep the pairs' order. Warp w takes the w-th of kGroupWarps ranges of pairs: it counts its
// range's pairs by expert (shared atomics), an exclusive scan over experts gives each expert its
// first row and each warp its first row within the expert, and the warp places its pairs in
// order, 32 at a time (lanes of one expert ranked by __match_any_sync).
constexpr int kGroupWarps = 8;
constexpr int kGroupThreads = 32 * kGroupWarps;

__global__ void __launch_bounds__(kGroupThreads)
    group_kernel(const int* sel, int total, int n_experts, int chunk, MoeGroups g) {
  wait_prior_grid();
  allow_next_grid();
  extern __shared__ int cursor[];  // [warp][expert]: the warp's pairs of the expert, then its next row
  int* first_row = cursor + kGroupWarps * n_experts;  // [expert]: its first row (chunk > 0)
  int* rows_of = first_row + n_experts;               // [expert]: its rows (chunk > 0)
  __shared__ int warp_rows[kGroupWarps], warp_active[kGroupWarps];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int i = tid; i < kGroupWarps * n_experts; i += kGroupThreads) cursor[i] = 0;
  __syncthreads();
  const int per = (total + kGroupWarps - 1) / kGroupWarps, lo = min(total, warp * per), hi = min(total, lo + per);
  int* mine = cursor + warp * n_experts;
  for (int i = lo + lane; i < hi; i += 32) atomicAdd(&mine[sel[i]], 1);
  __syncthreads();
  // Thread t owns experts [e0, e1): their rows and whether they are active, summed, then scanned
  // over the block.
  const int per_thread = (n_experts + kGroupThreads - 1) / kGroupThreads;
  const int e0 = min(n_experts, tid * per_thread), e1 = min(n_experts, e0 + per_thread);
  int rows = 0, active = 0;
  for (int e = e0; e < e1; ++e) {
    int n = 0;
    for (int w = 0; w < kGroupWarps; ++w) n += cursor[w * n_experts + e];
    rows += n;
    active += n > 0;
  }
  int rows_incl = rows, active_incl = active;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, rows_incl, o), a = __shfl_up_sync(0xffffffffu, active_incl, o);
    if (lane >= o) {
      rows_incl += r;
      active_incl += a;
    }
  }
  if (lane == 31) {
    warp_rows[warp] = rows_incl;
    warp_active[warp] = active_incl;
  }
  __syncthreads();
  int row = rows_incl - rows, n = active_incl - active;
  for (int w = 0; w < warp; ++w) {
    row += warp_rows[w];
    n += warp_active[w];
  }
  for (int e = e0; e < e1; ++e) {
    int count = 0;
    for (int w = 0; w < kGroupWarps; ++w) {
      const int c = cursor[w * n_experts + e];
      cursor[w * n_experts + e] = row + count;
      count += c;
    }
    if (count > 0) {
      g.active[n] = e;
      g.offset[n] = row;
      ++n;
    }
    if (chunk > 0) {
      first_row[e] = row;
      rows_of[e] = count;
    }
    row += count;
  }
  if (tid == kGroupThreads - 1) {  // its prefix ends at every expert
    g.offset[n] = row;
    *g.n_active = n;
  }
  __syncthreads();
  for (int i0 = lo; i0 < hi; i0 += 32) {
    const int i = i0 + lane;
    const bool ok = i < hi;
    const int e = ok ? sel[i] : -1 - lane;  // idle lanes match nobody
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(same & ((1u << lane) - 1u));
    const int pos = ok ? mine[e] + rank : 0;
    __syncwarp();
    if (ok && rank == 0) mine[e] += __popc(same);
    __syncwarp();
    if (ok) {
      g.row_token[pos] = i;  // the pair index; the kernels divide by k for the token
      g.row_of[i] = pos;
      if (chunk > 0) {
        const int rel = pos - first_row[e];
        g.row_chunk[pos] = rel % chunk ? 0 : (e << 4) | min(chunk, rows_of[e] - rel);
      }
    }
  }
}

// The expert's activation of its gate and up values: SwiGLU, or gpt-oss's clamped variant.
__device__ __forceinline__ float activation(const ExpertArgs& a, float gv, float uv) {
  return gated_activation(gv, uv, a.clamped, a.limit, a.alpha);
}

template <int KIND, bool SF16>
__global__ void __launch_bounds__(kGemvWarps * 32) gate_up_kernel(ExpertArgs a) {
  wait_prior_grid();
  allow_next_grid();
  extern __shared__ float smem[];
  int e, r0, r1;
  if (!block_expert(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  float* xs = smem;
  float* xsum = smem + a.nt_max * padded_cols(a.dim);
  const int lane = threadIdx.x & 31;
  for (int p0 = r0; p0 < r1; p0 += a.nt_max) {
    const int nt = min(a.nt_max, r1 - p0);
    if (p0 > r0) __syncthreads();
    stage_x([&](int t) { return a.x + int64_t(a.g.row_token[p0 + t] / a.k) * a.dim; }, nt, a.dim, xs, xsum, is_affine(KIND));
    for (int tile = 0; tile < kExpertRowTiles; ++tile) {
      const int64_t row0 = (int64_t(blockIdx.x) * kExpertRowTiles + tile) * kGemvRows + (threadIdx.x / 32) * kRowsPerWarp;
      if (row0 >= a.inter) break;
      float g[kRowsPerWarp][kTokens], u[kRowsPerWarp][kTokens];
      gemv_warp<KIND, SF16>(d.gate, row0, xs, xsum, nt, g);
      gemv_warp<KIND, SF16>(d.up, row0, xs, xsum, nt, u);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
        for (int t = 0; t < kTokens; ++t)
          if (lane == r * kTokens + t && t < nt && row0 + r < a.inter) {
            const float gv = g[r][t] + (d.gate_bias ? d.gate_bias[row0 + r] : 0.0f);
            const float uv = u[r][t] + (d.up_bias ? d.up_bias[row0 + r] : 0.0f);
            a.hidden[int64_t(p0 + t) * a.inter + row0 + r] = activation(a, gv, uv);
          }
    }
  }
}

template <int KIND, bool SF16>
__global__ void __launch_bounds__(kGemvWarps * 32) down_kernel(ExpertArgs a) {
  wait_prior_grid();
  allow_next_grid();
  extern __shared__ float smem[];
  int e, r0, r1;
  if (!block_expert(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  float* xs = smem;
  float* xsum = smem + a.nt_max * padded_cols(a.inter);
  const int lane = threadIdx.x & 31;
  for (int p0 = r0; p0 < r1; p0 += a.nt_max) {
    const int nt = min(a.nt_max, r1 - p0);
    if (p0 > r0) __syncthreads();
    stage_x([&](int t) { return a.hidden + int64_t(p0 + t) * a.inter; }, nt, a.inter, xs, xsum, is_affine(KIND));
    for (int tile = 0; tile < kExpertRowTiles; ++tile) {
      const int64_t row0 = (int64_t(blockIdx.x) * kExpertRowTiles + tile) * kGemvRows + (threadIdx.x / 32) * kRowsPerWarp;
      if (row0 >= a.dim) break;
      float acc[kRowsPerWarp][kTokens];
      gemv_warp<KIND, SF16>(d.down, row0, xs, xsum, nt, acc);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
        for (int t = 0; t < kTokens; ++t)
          if (lane == r * kTokens + t && t < nt && row0 + r < a.dim)
            a.y[int64_t(p0 + t) * a.dim + row0 + r] = acc[r][t] + (d.down_bias ? d.down_bias[row0 + r] : 0.0f);
    }
  }
}

// Single-token expert kernels (every active expert has one row), on the tile of gemv_one.cuh.
// CHUNK 0: a block per active expert, its rows in turn. CHUNK > 0 (a batched decode step, groups
// built on the device): a block per chunk of up to CHUNK rows of one expert, whose weights are
// read and decoded once for them. Each row's value is the one it gets alone either way.
template <int CHUNK>
__device__ __forceinline__ bool block_rows(const ExpertArgs& a, int& e, int& r0, int& r1) {
  return CHUNK > 0 ? block_chunk(a, e, r0, r1) : block_expert(a, e, r0, r1);
}

// Rows of x a block computes against one read of the weights in chunks of CHUNK rows: the chunk's,
// but one at a time for MXFP4 (its decoded values and the chunk's sums do not fit the registers of
// 3 blocks an SM: ptxas spilled 130-800 bytes a thread).
template <int KIND, int CHUNK>
constexpr int chunk_tokens() {
  return CHUNK > 0 && KIND != kMxfp4 ? CHUNK : 1;
}
// Rows per warp for M matrices: half of one_rows's for 4 rows of x at once, so that their sums fit
// the registers of 3 blocks an SM.
template <int KIND, int M, int CHUNK>
constexpr int chunk_rows() {
  constexpr int r = one_rows<KIND, M>();
  return chunk_tokens<KIND, CHUNK>() >= 4 && r > 1 ? r / 2 : r;
}

template <int KIND, bool SF16, int CHUNK>
__global__ void __launch_bounds__(kOneWarps * 32, 3) gate_up_one_kernel(ExpertArgs a) {
  wait_prior_grid();
  allow_next_grid();
  constexpr int R = chunk_rows<KIND, 2, CHUNK>(), NT = chunk_tokens<KIND, CHUNK>();
  extern __shared__ float smem[];
  int e, r0, r1;
  if (!block_rows<CHUNK>(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  const WeightRef* const w[2] = {&d.gate, &d.up};
  const int64_t row0 = int64_t(blockIdx.x) * (kOneWarps * R) + (threadIdx.x / 32) * R;
  const int lane = threadIdx.x & 31;
  for (int pr = r0; pr < r1; pr += NT) {
    const int nt = min(NT, r1 - pr);
    const float* x[NT];  // read before the weights
#pragma unroll
    for (int t = 0; t < NT; ++t) x[t] = a.x + int64_t(a.g.row_token[pr + min(t, nt - 1)] / a.k) * a.dim;
    RawPack<KIND> cur[2][R], next[2][R];
    load_first<KIND, 2, R>(w, row0, cur, next);
    if (pr > r0) __syncthreads();  // the previous rows' reads of smem are done
    stage_rows([&](int t) { return x[t]; }, nt, a.dim, smem);
    float acc[NT][2][R];
    dot_rows<KIND, SF16, 2, R, false, NT>(w, row0, cur, next, smem, padded_cols(a.dim), nt, acc);
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (t < nt && lane == r && row0 + r < a.inter) {
          const float gv = acc[t][0][r] + (d.gate_bias ? d.gate_bias[row0 + r] : 0.0f);
          const float uv = acc[t][1][r] + (d.up_bias ? d.up_bias[row0 + r] : 0.0f);
          a.hidden[int64_t(pr + t) * a.inter + row0 + r] = activation(a, gv, uv);
        }
  }
}

// ONE_PASS (inter <= 1024): no buffer for a second pass, 4 blocks per SM.
// With a.down_early, the block finds its expert and issues its first weight loads before it waits
// for gate/up (down_early in moe.h), so they overlap gate/up's end.
template <int KIND, bool SF16, bool ONE_PASS, int CHUNK>
__global__ void __launch_bounds__(kOneWarps * 32, ONE_PASS ? 4 : 3) down_one_kernel(ExpertArgs a) {
  if (!a.down_early) follow_prior_grid();
  constexpr int R = chunk_rows<KIND, 1, CHUNK>(), NT = chunk_tokens<KIND, CHUNK>();
  extern __shared__ float smem[];
  int e, r0, r1;
  if (!block_rows<CHUNK>(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  const WeightRef* const w[1] = {&d.down};
  const int64_t row0 = int64_t(blockIdx.x) * (kOneWarps * R) + (threadIdx.x / 32) * R;
  const int lane = threadIdx.x & 31;
  for (int pr = r0; pr < r1; pr += NT) {
    const int nt = min(NT, r1 - pr);
    RawPack<KIND> cur[1][R], next[1][R];
    load_first<KIND, 1, R>(w, row0, cur, next);
    if (pr == r0 && a.down_early) follow_prior_grid();
    if (pr > r0) __syncthreads();
    stage_rows([&](int t) { return a.hidden + int64_t(pr + t) * a.inter; }, nt, a.inter, smem);
    float acc[NT][1][R];
    dot_rows<KIND, SF16, 1, R, ONE_PASS, NT>(w, row0, cur, next, smem, padded_cols(a.inter), nt, acc);
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (t < nt && lane == r && row0 + r < a.dim)
          a.y[int64_t(pr + t) * a.dim + row0 + r] = acc[t][0][r] + (d.down_bias ? d.down_bias[row0 + r] : 0.0f);
  }
}

// early: the first selections' weights and rows (the router's, older than the kernel before) are
// read before the wait for that kernel (down_early in moe.h).
__global__ void combine_kernel(const float* y, const float* w, const int* row_of, int64_t T, int k, int64_t dim,
                               float* out, bool early) {
  if (!early) follow_prior_grid();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * dim) return;
  const int64_t t = i / dim, c = i % dim;
  float s = 0;
  // The loads of 8 selections are issued together (one round trip for row_of and w, one for y);
  // the sum runs in selection order.
  for (int j0 = 0; j0 < k; j0 += 8) {
    float wv[8], yv[8];
    int64_t row[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j0 + j < k) {
        wv[j] = w[t * k + j0 + j];
        row[j] = row_of[t * k + j0 + j];
      }
    if (early && j0 == 0) follow_prior_grid();
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j0 + j < k) yv[j] = y[row[j] * dim + c];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j0 + j < k) s += wv[j] * yv[j];
  }
  out[i] = s;
}

// f.template operator()<CHUNK>() for a call's rows_per_block (the instances the kernels have).
template <class F>
void with_chunk(int chunk, F&& f) {
  switch (chunk) {
    case 4: f.template operator()<4>(); break;
    case 2: f.template operator()<2>(); break;
    case 1: f.template operator()<1>(); break;
    default: f.template operator()<0>();
  }
}

int tokens_per_pass(int64_t cols) {
  int nt = kTokens;
  while (nt > 0 && gemv_smem_bytes(cols, nt) > max_gemv_smem()) --nt;
  if (nt == 0) fail("cuda moe: rows of ", cols, " values do not fit in shared memory");
  return nt;
}

}  // namespace

namespace {

// The routings the kernels compute (route_token), else the error.
void check_routing(const MoeParams& p) {
  if (p.top_k > kMaxTopK || p.top_k > p.n_experts) fail("cuda moe: top_k ", p.top_k, " (at most ", kMaxTopK, ")");
  if (p.router == RouterKind::SigmoidGroupTopK && (p.n_group > 64 || p.n_group < 1 || p.n_experts % p.n_group))
    fail("cuda moe: ", p.n_group, " expert groups are not supported");
}

}  // namespace

void route(const float* logits, int64_t T, const MoeParams& p, const float* router_bias, int* sel_ids,
           float* sel_w, const MoeGroups* direct_groups, cudaStream_t s) {
  check_routing(p);
  if (T == 0) return;
  RouteArgs a{logits, p.n_experts, p.top_k, p.router, p.norm_topk_prob, router_bias, p.n_group, p.topk_group,
              p.routed_scaling_factor, sel_ids, sel_w, direct_groups ? *direct_groups : MoeGroups{},
              direct_groups != nullptr && T == 1};
  const int threads = std::min(1024, (p.n_experts + kWarp - 1) / kWarp * kWarp);
  const size_t smem = route_smem_bytes(p.n_experts, p.top_k);
  launch(route_kernel, unsigned(T), unsigned(threads), smem, s, a);
}

bool route_few(const Matrix& router, const float* x, int64_t T, const MoeParams& p, const float* router_bias,
               float* logits, int* sel_ids, float* sel_w, const MoeGroups* direct_groups, unsigned* blocks_done,
               cudaStream_t s) {
  const WeightRef w = weight_ref(router);
  // At most a block's threads of experts: route_kernel then sums and compares in the same order
  // (its threads past n add exact zeros), so the selection and weights are route()'s bit for bit.
  check_routing(p);
  if (one_token_gemv_off() || T < 1 || T > kGemvMaxTokens || w.cols % 32 != 0 ||
      (reinterpret_cast<uintptr_t>(x) & 15) != 0 || p.n_experts > kOneWarps * 32 || w.rows != p.n_experts)
    return false;
  const size_t route_smem = route_smem_bytes(p.n_experts, p.top_k);
  const size_t smem = std::max(size_t(padded_cols(w.cols)) * sizeof(float), route_smem);
  if (smem + 1024 > max_gemv_smem()) return false;
  RouteArgs a{logits, p.n_experts, p.top_k, p.router, p.norm_topk_prob, router_bias, p.n_group, p.topk_group,
              p.routed_scaling_factor, sel_ids, sel_w, direct_groups ? *direct_groups : MoeGroups{},
              direct_groups != nullptr && T == 1};
  bool launched = false;
  dispatch_format(format_of(router), [&]<int KIND, bool SF16>() {
    if constexpr (one_token_kind(KIND)) {
      with_one_rows<KIND, 1>(w.rows * T, [&]<int R>() {
        static size_t configured = 0;  // the dynamic bytes allowed so far (the kernel has static shared memory too)
        if (smem > configured) {
          MS_CUDA_CHECK(cudaFuncSetAttribute(route_few_kernel<KIND, SF16, R>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
          configured = smem;
        }
        launch(route_few_kernel<KIND, SF16, R>, dim3(blocks_for(w.rows, kOneWarps * R), unsigned(T)), kOneWarps * 32,
               smem, s, w, x, blocks_done, a);
      });
      launched = true;
    }
  });
  return launched;
}

void group_by_expert(const int* sel_ids, int64_t T, int k, int n_experts, int chunk, MoeGroups g, cudaStream_t s) {
  if (chunk < 0 || chunk > 8) fail("cuda moe: chunks of ", chunk, " rows (at most 8)");
  const size_t smem = size_t(kGroupWarps + 2) * n_experts * sizeof(int);
  constexpr size_t kStatic = 2 * kGroupWarps * sizeof(int), kMax = 48 * 1024 - kStatic;  // group_kernel's own
  if (smem > kMax) fail("cuda moe: ", n_experts, " experts (at most ", kMax / sizeof(int) / (kGroupWarps + 2), ")");
  launch(group_kernel, 1, kGroupThreads, smem, s, sel_ids, int(T * k), n_experts, chunk, g);
}

int expert_rows_per_block(int64_t pairs, int k, int64_t dim, int64_t inter) {
  static const int chosen = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_EXPERT_ROWS");
    const std::string_view s = v ? v : "";
    return s == "0" ? 0 : s == "1" ? 1 : s == "4" ? 4 : 2;
  }();
  if (pairs <= k) return 0;  // one token: every expert has one row
  // The chunk's staged rows: 2 rows of hidden 4096 are 37 KB.
  int rows = chosen;
  while (rows > 1 && size_t(rows) * padded_cols(std::max(dim, inter)) * sizeof(float) > 80 * 1024) rows /= 2;
  return rows;
}

ExpertArgs expert_args(const ExpertBatch& b) {
  ExpertArgs a;
  a.table = b.table;
  a.g = b.groups;
  a.a_begin = b.a_begin;
  a.a_end = b.a_end;
  a.count_on_device = b.count_on_device;
  a.only_formats = b.only_formats;
  a.k = b.params->top_k;
  a.nt_max = 0;
  a.x = b.x;
  a.hidden = b.hidden;
  a.y = b.y;
  a.dim = b.dim;
  a.inter = b.inter;
  a.clamped = b.params->activation == ExpertActivation::ClampedSwiGlu;
  a.limit = b.params->swiglu_limit;
  a.alpha = b.params->swiglu_alpha;
  a.down_early = down_early();
  return a;
}

bool down_early() {
  static const bool on = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_DOWN_EARLY");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
}

void run_experts(const ExpertBatch& b, cudaStream_t s) {
  const int n_blocks = b.a_end - b.a_begin;
  if (n_blocks <= 0) return;
  if (b.tensor_cores && b.gemm) {
    const bool prof = b.profile && b.profile->on(), mma = experts_mma_supported(b);
    if (prof) b.profile->begin(s);
    if (mma) run_experts_mma(b, s);
    else run_experts_gemm(b, s);
    if (prof)
      b.profile->end(s, experts_label(mma ? "moe experts, fused tensor-core kernels" : "moe experts, cuBLAS FP16 GEMMs",
                                      b.inter, b.dim, n_blocks, false));
    return;
  }
  // More than one token (a prompt, or a batched decode step: few_mma_enabled) on the tensor cores.
  if (experts_exact_mma_supported(b) && (!b.few_tokens || (b.pairs > b.params->top_k && few_mma_enabled()))) {
    const bool prof = b.profile && b.profile->on();
    if (prof) b.profile->begin(s);
    run_experts_exact_mma(b, s);
    if (prof) b.profile->end(s, experts_label("moe experts, exact tensor-core kernels", b.inter, b.dim, n_blocks, false));
    return;
  }
  const ExpertArgs a = expert_args(b);
  const size_t limit = max_gemv_smem();
  // One token, or a few (each expert's rows in turn): the single-token kernels where they read
  // the format (x rows 16-byte aligned).
  const bool one = b.few_tokens && (b.dim & 31) == 0 && (b.inter & 31) == 0 && (reinterpret_cast<uintptr_t>(b.x) & 15) == 0;
  // Chunks only where the groups were built on the device with them (every row is in a chunk).
  const int chunk = b.count_on_device ? b.rows_per_block : 0;
  const bool prof = b.profile && b.profile->on();
  if (prof) b.profile->begin(s);
  dispatch_format(b.gate_up, [&]<int KIND, bool SF16>() {
    if constexpr (one_token_kind(KIND)) {
      const size_t smem = size_t(padded_cols(b.dim)) * sizeof(float);
      if (one && smem <= limit) {
        auto run = [&]<int CHUNK>() {
          static bool configured = false;
          if (!configured) {
            MS_CUDA_CHECK(cudaFuncSetAttribute(gate_up_one_kernel<KIND, SF16, CHUNK>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
            configured = true;
          }
          launch(gate_up_one_kernel<KIND, SF16, CHUNK>,
                 dim3(blocks_for(b.inter, kOneWarps * chunk_rows<KIND, 2, CHUNK>()), unsigned(CHUNK ? b.pairs : n_blocks)),
                 kOneWarps * 32, chunk_tokens<KIND, CHUNK>() * smem, s, a);
        };
        with_chunk(chunk, run);
        return;
      }
    }
    static bool configured = false;
    if (!configured) {
      MS_CUDA_CHECK(cudaFuncSetAttribute(gate_up_kernel<KIND, SF16>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
      configured = true;
    }
    ExpertArgs ga = a;
    ga.nt_max = tokens_per_pass(b.dim);
    launch(gate_up_kernel<KIND, SF16>,
           dim3(blocks_for(b.inter, kGemvRows * kExpertRowTiles), unsigned(n_blocks)),
           kGemvWarps * 32, gemv_smem_bytes(b.dim, ga.nt_max), s, ga);
  });
  if (prof) {
    b.profile->end(s, experts_label("moe gate/up", b.inter, b.dim, n_blocks, one));
    b.profile->begin(s);
  }
  dispatch_format(b.down, [&]<int KIND, bool SF16>() {
    if constexpr (one_token_kind(KIND)) {
      const size_t smem = size_t(padded_cols(b.inter)) * sizeof(float);
      if (one && smem <= limit) {
        auto run = [&]<bool ONE_PASS, int CHUNK>() {
          static bool configured = false;
          if (!configured) {
            MS_CUDA_CHECK(cudaFuncSetAttribute(down_one_kernel<KIND, SF16, ONE_PASS, CHUNK>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
            configured = true;
          }
          launch(down_one_kernel<KIND, SF16, ONE_PASS, CHUNK>,
                 dim3(blocks_for(b.dim, kOneWarps * chunk_rows<KIND, 1, CHUNK>()), unsigned(CHUNK ? b.pairs : n_blocks)),
                 kOneWarps * 32, chunk_tokens<KIND, CHUNK>() * smem, s, a);
        };
        if (b.inter <= 32 * 32) with_chunk(chunk, [&]<int CHUNK>() { run.template operator()<true, CHUNK>(); });
        else with_chunk(chunk, [&]<int CHUNK>() { run.template operator()<false, CHUNK>(); });
        return;
      }
    }
    static bool configured = false;
    if (!configured) {
      MS_CUDA_CHECK(cudaFuncSetAttribute(down_kernel<KIND, SF16>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
      configured = true;
    }
    ExpertArgs da = a;
    da.nt_max = tokens_per_pass(b.inter);
    launch(down_kernel<KIND, SF16>,
           dim3(blocks_for(b.dim, kGemvRows * kExpertRowTiles), unsigned(n_blocks)),
           kGemvWarps * 32, gemv_smem_bytes(b.inter, da.nt_max), s, da);
  });
  if (prof) b.profile->end(s, experts_label("moe down", b.dim, b.inter, n_blocks, one));
}

void combine(const float* y, const float* sel_w, const int* row_of, int64_t T, int k, int64_t dim, float* out,
             cudaStream_t s) {
  if (T * dim == 0) return;
  launch(combine_kernel, blocks_for(T * dim, 256), 256, 0, s, y, sel_w, row_of, T, k, dim, out, down_early());
}

}  // namespace moestream::cuda
