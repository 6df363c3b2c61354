// MoE on the GPU. Routing: one warp per token, top-k by repeated warp argmax (ties to the lower
// expert id, as the CPU's partial_sort comparator). Experts: one launch covers every active
// expert of a batch (grid.y = active expert, grid.x = row tiles); the rows of an expert's
// tokens go through the GEMV tile kTokens at a time, so a row's value does not depend on which
// batch or tier its expert came from.
#include "backend/cuda/moe.h"

namespace moestream::cuda {

namespace {

constexpr int kMaxTopK = 32;

// Warp argmax of v[e] over experts not yet taken; ties to the lower id. Returns the id (-1: none).
__device__ int warp_argmax(const float* v, const unsigned char* taken, int n) {
  const int lane = threadIdx.x & 31;
  float best = 0;
  int id = -1;
  for (int e = lane; e < n; e += 32) {
    if (taken[e]) continue;
    if (id < 0 || v[e] > best) {
      best = v[e];
      id = e;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oid = __shfl_xor_sync(0xffffffffu, id, o);
    if (oid >= 0 && (id < 0 || ob > best || (ob == best && oid < id))) {
      best = ob;
      id = oid;
    }
  }
  return id;
}

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

// One block (one warp) per token. Shared: probs [n], choice [n], taken [n].
__global__ void route_kernel(RouteArgs a) {
  extern __shared__ float sm[];
  float* probs = sm;
  float* choice = sm + a.n;
  unsigned char* taken = reinterpret_cast<unsigned char*>(sm + 2 * a.n);
  const int lane = threadIdx.x;
  const int64_t t = blockIdx.x;
  const float* l = a.logits + t * a.n;
  for (int e = lane; e < a.n; e += 32) taken[e] = 0;
  if (a.kind == RouterKind::SoftmaxTopK) {
    float mx = -INFINITY;
    for (int e = lane; e < a.n; e += 32) mx = fmaxf(mx, l[e]);
    mx = warp_max(mx);
    float sum = 0;
    for (int e = lane; e < a.n; e += 32) sum += (probs[e] = expf(l[e] - mx));
    sum = warp_sum(sum);
    for (int e = lane; e < a.n; e += 32) choice[e] = probs[e] = probs[e] / sum;
  } else if (a.kind == RouterKind::SigmoidGroupTopK) {
    for (int e = lane; e < a.n; e += 32) {
      probs[e] = 1.0f / (1.0f + expf(-l[e]));
      choice[e] = probs[e] + (a.bias ? a.bias[e] : 0.0f);
    }
    __syncwarp();
    if (lane == 0) {  // groups: the sum of their two best choices; keep the topk_group best
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
    for (int e = lane; e < a.n; e += 32) choice[e] = probs[e] = l[e] + (a.bias ? a.bias[e] : 0.0f);
  }
  __syncwarp();
  // Top k, in rank order. Up to 256 experts: each lane ranks its experts against all (rank =
  // how many come first: larger value, or equal value and lower id); else k warp argmaxes.
  int ids[kMaxTopK];
  if (a.n <= 256) {
    int* by_rank = reinterpret_cast<int*>(taken + ((a.n + 15) / 16) * 16);
    for (int e = lane; e < a.n; e += 32) {
      const float v = choice[e];
      int rank = 0;
      for (int o = 0; o < a.n; ++o) {
        const float w = choice[o];
        rank += w > v || (w == v && o < e);
      }
      if (rank < a.k) by_rank[rank] = e;
    }
    __syncwarp();
    for (int i = 0; i < a.k; ++i) ids[i] = by_rank[i];
  } else {
    for (int i = 0; i < a.k; ++i) {
      const int id = warp_argmax(choice, taken, a.n);
      ids[i] = id;
      if (lane == 0) taken[id] = 1;
      __syncwarp();
    }
  }
  if (lane != 0) return;
  float w[kMaxTopK];
  if (a.kind == RouterKind::TopKSoftmax) {
    const float mx = probs[ids[0]];
    float sum = 0;
    for (int i = 0; i < a.k; ++i) sum += expf(probs[ids[i]] - mx);
    for (int i = 0; i < a.k; ++i) w[i] = expf(probs[ids[i]] - mx) / sum * a.scaling;
  } else {
    float norm = 1.0f;
    if (a.norm_topk) {
      float s = 0;
      for (int i = 0; i < a.k; ++i) s += probs[ids[i]];
      norm = 1.0f / (s + (a.kind == RouterKind::SigmoidGroupTopK ? 1e-20f : 0.0f));
    }
    for (int i = 0; i < a.k; ++i) w[i] = probs[ids[i]] * norm * a.scaling;
  }
  // Ascending expert id (insertion sort of k pairs): the combine then sums in the CPU's order.
  for (int i = 1; i < a.k; ++i)
    for (int j = i; j > 0 && ids[j - 1] > ids[j]; --j) {
      const int ti = ids[j]; ids[j] = ids[j - 1]; ids[j - 1] = ti;
      const float tw = w[j]; w[j] = w[j - 1]; w[j - 1] = tw;
    }
  for (int i = 0; i < a.k; ++i) {
    a.sel_ids[t * a.k + i] = ids[i];
    a.sel_w[t * a.k + i] = w[i];
  }
  if (a.direct) {  // one token: expert i of the selection owns row i
    for (int i = 0; i < a.k; ++i) {
      a.groups.active[i] = ids[i];
      a.groups.offset[i] = i;
      a.groups.row_token[i] = i;
      a.groups.row_of[i] = i;
    }
    a.groups.offset[a.k] = a.k;
    *a.groups.n_active = a.k;
  }
}

// One block; thread e counts and places expert e's rows (in (token, slot) order).
__global__ void group_kernel(const int* sel, int total, int n_experts, MoeGroups g) {
  extern __shared__ int counts[];  // [n_experts + 1]
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
    int c = 0;
    for (int i = 0; i < total; ++i) c += sel[i] == e;
    counts[e] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // counts -> first row of each expert; the active list
    int row = 0, n = 0;
    for (int e = 0; e < n_experts; ++e) {
      const int c = counts[e];
      counts[e] = row;
      if (c) {
        g.active[n] = e;
        g.offset[n] = row;
        ++n;
      }
      row += c;
    }
    g.offset[n] = row;
    *g.n_active = n;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
    int row = counts[e];
    for (int i = 0; i < total; ++i)
      if (sel[i] == e) {
        g.row_token[row] = i;  // the pair index; the kernels divide by k for the token
        g.row_of[i] = row;
        ++row;
      }
  }
}

struct ExpertArgs {
  const DevExpert* table;
  MoeGroups g;
  int a_begin, a_end;
  bool count_on_device;
  int k, nt_max;
  const float* x;
  float* hidden;
  float* y;
  int64_t dim, inter;
  bool clamped;
  float limit, alpha;
};

__device__ __forceinline__ bool expert_of_block(const ExpertArgs& a, int& expert, int& r0, int& r1) {
  const int ai = a.a_begin + int(blockIdx.y);
  const int end = a.count_on_device ? *a.g.n_active : a.a_end;
  if (ai >= end) return false;
  expert = a.g.active[ai];
  r0 = a.g.offset[ai];
  r1 = a.g.offset[ai + 1];
  return true;
}

template <int KIND, bool SF16>
__global__ void __launch_bounds__(kGemvWarps * 32) gate_up_kernel(ExpertArgs a) {
  extern __shared__ float smem[];
  int e, r0, r1;
  if (!expert_of_block(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  float* xs = smem;
  float* xsum = smem + a.nt_max * padded_cols(a.dim);
  const int64_t row0 = int64_t(blockIdx.x) * kGemvRows + (threadIdx.x / 32) * kRowsPerWarp;
  const int lane = threadIdx.x & 31;
  for (int p0 = r0; p0 < r1; p0 += a.nt_max) {
    const int nt = min(a.nt_max, r1 - p0);
    if (p0 > r0) __syncthreads();
    stage_x([&](int t) { return a.x + int64_t(a.g.row_token[p0 + t] / a.k) * a.dim; }, nt, a.dim, xs, xsum, false);
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
          float h;
          if (!a.clamped) {
            h = gv / (1.0f + expf(-gv)) * uv;
          } else {
            const float ac = fminf(gv, a.limit), bc = fminf(fmaxf(uv, -a.limit), a.limit);
            h = (bc + 1.0f) * (ac / (1.0f + expf(-a.alpha * ac)));
          }
          a.hidden[int64_t(p0 + t) * a.inter + row0 + r] = h;
        }
  }
}

template <int KIND, bool SF16>
__global__ void __launch_bounds__(kGemvWarps * 32) down_kernel(ExpertArgs a) {
  extern __shared__ float smem[];
  int e, r0, r1;
  if (!expert_of_block(a, e, r0, r1)) return;
  const DevExpert& d = a.table[e];
  float* xs = smem;
  float* xsum = smem + a.nt_max * padded_cols(a.inter);
  const int64_t row0 = int64_t(blockIdx.x) * kGemvRows + (threadIdx.x / 32) * kRowsPerWarp;
  const int lane = threadIdx.x & 31;
  for (int p0 = r0; p0 < r1; p0 += a.nt_max) {
    const int nt = min(a.nt_max, r1 - p0);
    if (p0 > r0) __syncthreads();
    stage_x([&](int t) { return a.hidden + int64_t(p0 + t) * a.inter; }, nt, a.inter, xs, xsum, false);
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

__global__ void combine_kernel(const float* y, const float* w, const int* row_of, int64_t T, int k, int64_t dim,
                               float* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * dim) return;
  const int64_t t = i / dim, c = i % dim;
  float s = 0;
  for (int j = 0; j < k; ++j) s += w[t * k + j] * y[int64_t(row_of[t * k + j]) * dim + c];
  out[i] = s;
}

int tokens_per_pass(int64_t cols) {
  int nt = kTokens;
  while (nt > 0 && gemv_smem_bytes(cols, nt) > max_gemv_smem()) --nt;
  if (nt == 0) fail("cuda moe: rows of ", cols, " values do not fit in shared memory");
  return nt;
}

}  // namespace

void route(const float* logits, int64_t T, const MoeParams& p, const float* router_bias, int* sel_ids,
           float* sel_w, const MoeGroups* direct_groups, cudaStream_t s) {
  if (p.top_k > kMaxTopK || p.top_k > p.n_experts) fail("cuda moe: top_k ", p.top_k, " (at most ", kMaxTopK, ")");
  if (p.router == RouterKind::SigmoidGroupTopK && (p.n_group > 64 || p.n_group < 1 || p.n_experts % p.n_group))
    fail("cuda moe: ", p.n_group, " expert groups are not supported");
  if (T == 0) return;
  RouteArgs a{logits, p.n_experts, p.top_k, p.router, p.norm_topk_prob, router_bias, p.n_group, p.topk_group,
              p.routed_scaling_factor, sel_ids, sel_w, direct_groups ? *direct_groups : MoeGroups{},
              direct_groups != nullptr && T == 1};
  const size_t smem = size_t(p.n_experts) * (2 * sizeof(float) + 1) + 16 + size_t(p.top_k) * sizeof(int);
  route_kernel<<<unsigned(T), 32, smem, s>>>(a);
  MS_CUDA_CHECK_LAUNCH();
}

void group_by_expert(const int* sel_ids, int64_t T, int k, int n_experts, MoeGroups g, cudaStream_t s) {
  group_kernel<<<1, 256, size_t(n_experts + 1) * sizeof(int), s>>>(sel_ids, int(T * k), n_experts, g);
  MS_CUDA_CHECK_LAUNCH();
}

void run_experts(const ExpertBatch& b, cudaStream_t s) {
  const int n_blocks = b.a_end - b.a_begin;
  if (n_blocks <= 0) return;
  ExpertArgs a;
  a.table = b.table;
  a.g = b.groups;
  a.a_begin = b.a_begin;
  a.a_end = b.a_end;
  a.count_on_device = b.count_on_device;
  a.k = b.params->top_k;
  a.x = b.x;
  a.hidden = b.hidden;
  a.y = b.y;
  a.dim = b.dim;
  a.inter = b.inter;
  a.clamped = b.params->activation == ExpertActivation::ClampedSwiGlu;
  a.limit = b.params->swiglu_limit;
  a.alpha = b.params->swiglu_alpha;
  const size_t limit = max_gemv_smem();
  dispatch_format(b.gate_up, [&]<int KIND, bool SF16>() {
    static bool configured = false;
    if (!configured) {
      MS_CUDA_CHECK(cudaFuncSetAttribute(gate_up_kernel<KIND, SF16>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
      configured = true;
    }
    ExpertArgs ga = a;
    ga.nt_max = tokens_per_pass(b.dim);
    gate_up_kernel<KIND, SF16><<<dim3(blocks_for(b.inter, kGemvRows), unsigned(n_blocks)), kGemvWarps * 32,
                                 gemv_smem_bytes(b.dim, ga.nt_max), s>>>(ga);
    MS_CUDA_CHECK_LAUNCH();
  });
  dispatch_format(b.down, [&]<int KIND, bool SF16>() {
    static bool configured = false;
    if (!configured) {
      MS_CUDA_CHECK(cudaFuncSetAttribute(down_kernel<KIND, SF16>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
      configured = true;
    }
    ExpertArgs da = a;
    da.nt_max = tokens_per_pass(b.inter);
    down_kernel<KIND, SF16><<<dim3(blocks_for(b.dim, kGemvRows), unsigned(n_blocks)), kGemvWarps * 32,
                              gemv_smem_bytes(b.inter, da.nt_max), s>>>(da);
    MS_CUDA_CHECK_LAUNCH();
  });
}

void combine(const float* y, const float* sel_w, const int* row_of, int64_t T, int k, int64_t dim, float* out,
             cudaStream_t s) {
  if (T * dim == 0) return;
  combine_kernel<<<blocks_for(T * dim, 256), 256, 0, s>>>(y, sel_w, row_of, T, k, dim, out);
  MS_CUDA_CHECK_LAUNCH();
}

}  // namespace moestream::cuda
