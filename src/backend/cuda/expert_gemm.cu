// The experts of a prefill-sized batch on the tensor cores (see run_experts_gemm in moe.h).
//
// For a chunk of active experts [a0, a1) whose rows are [r0, r1) of the batch:
//   1. each expert's gate, up and down matrices dequantized to FP16 (found through the device
//      table, like the GEMV kernels find them);
//   2. the chunk's rows of x gathered (row -> token) and rounded to FP16;
//   3. gate and up: one cuBLAS grouped GEMM, two problems per expert (float32 sums, FP16 outputs:
//      cuBLAS 13's grouped GEMM takes FP16 inputs only with FP16 outputs);
//   4. hidden = act(gate + bias, up + bias) in float32, stored as FP16;
//   5. down: one grouped GEMM, then y's rows = its outputs + the down bias, in float32.
// Where cuBLAS lacks the grouped GEMM, each problem runs as its own cublasGemmEx.
#include <cublas_v2.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/moe.h"
#include "backend/cuda/weights.cuh"

namespace moestream::cuda {

namespace {

template <int KIND, bool SF16>
__global__ void dequant_experts_kernel(const DevExpert* table, const int* active, int a0, int which0,
                                       __half* w16, int64_t per_expert, int64_t per_matrix) {
  const int a = int(blockIdx.y), which = which0 + int(blockIdx.z);  // 0 gate, 1 up, 2 down
  const DevExpert& d = table[active[a0 + a]];
  const WeightRef& w = which == 0 ? d.gate : which == 1 ? d.up : d.down;
  dequant_rows_f16<KIND, SF16>(w, 0, w.rows, w16 + a * per_expert + which * per_matrix);
}

// out[r - r0] = x[row_token[r] / k] for rows r in [r0, r0 + rows), as FP16.
__global__ void gather_f16_kernel(const float* __restrict__ x, const int* __restrict__ row_token, int k, int64_t dim,
                                  int r0, int64_t rows, __half* __restrict__ out) {
  const int64_t total = rows * dim;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / dim, c = i % dim;
    out[i] = to_half_saturated(x[int64_t(row_token[r0 + r] / k) * dim + c]);
  }
}

struct ActArgs {
  const DevExpert* table;
  const int* active;
  const int* offset;
  int a0, r0;
  const __half* gate;
  const __half* up;
  __half* hidden;
  int64_t inter;
  bool clamped;
  float limit, alpha;
};

// hidden = act(gate + gate_bias, up + up_bias) over expert a0 + blockIdx.y's rows.
__global__ void activation_kernel(ActArgs a) {
  const int ai = a.a0 + int(blockIdx.y);
  const DevExpert& d = a.table[a.active[ai]];
  const int64_t begin = int64_t(a.offset[ai] - a.r0) * a.inter, end = int64_t(a.offset[ai + 1] - a.r0) * a.inter;
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % a.inter;
    const float gv = __half2float(a.gate[i]) + (d.gate_bias ? d.gate_bias[c] : 0.0f);
    const float uv = __half2float(a.up[i]) + (d.up_bias ? d.up_bias[c] : 0.0f);
    a.hidden[i] = to_half_saturated(gated_activation(gv, uv, a.clamped, a.limit, a.alpha));
  }
}

// y's rows of expert a0 + blockIdx.y = its FP16 down outputs (chunk rows from r0) + down_bias.
__global__ void down_out_kernel(const DevExpert* table, const int* active, const int* offset, int a0, int r0,
                                const __half* y16, float* y, int64_t dim) {
  const int ai = a0 + int(blockIdx.y);
  const float* bias = table[active[ai]].down_bias;
  const int64_t begin = int64_t(offset[ai]) * dim, end = int64_t(offset[ai + 1]) * dim, skip = int64_t(r0) * dim;
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __half2float(y16[i - skip]) + (bias ? bias[i % dim] : 0.0f);
}

// Problems of one shape per group, as cuBLAS's grouped GEMM takes them: C_j (m x n_j) =
// A_j^T (m x kdim) B_j (kdim x n_j), column-major, A_j ld kdim, B_j ld kdim, C_j ld m. Group i
// holds `per_group` problems with n_i columns.
struct Problems {
  int m = 0, kdim = 0, per_group = 1;
  std::vector<int> n;  // per group
  std::vector<const void*> A, B;
  std::vector<void*> C;
};

// Whether cuBLAS runs the grouped GEMM for FP16 inputs and float32 outputs (learnt at first use;
// MOESTREAM_CUDA_EXPERT_GEMM_GROUPED=0 starts without it: one cublasGemmEx per problem).
int grouped_state = [] {
  const char* v = std::getenv("MOESTREAM_CUDA_EXPERT_GEMM_GROUPED");
  return v && std::string(v) == "0" ? -1 : 0;  // 0 unknown, 1 works, -1 not used
}();

void run_problems(const Problems& p, GemmScratch& g, cudaStream_t s) {
  const int groups = int(p.n.size());
  if (groups == 0) return;
  cublasHandle_t h = g.tensor_handle(s);
  const float one = 1.0f, zero = 0.0f;
  if (grouped_state >= 0) {
    const size_t n = p.A.size();
    std::vector<const void*> ptrs;
    ptrs.reserve(3 * n);
    ptrs.insert(ptrs.end(), p.A.begin(), p.A.end());
    ptrs.insert(ptrs.end(), p.B.begin(), p.B.end());
    ptrs.insert(ptrs.end(), p.C.begin(), p.C.end());
    auto** dev = static_cast<void**>(g.area(kAreaExpertPointers, ptrs.size() * sizeof(void*)));
    // From pageable memory: the call returns once `ptrs` is staged, so it may go out of scope.
    MS_CUDA_CHECK(cudaMemcpyAsync(dev, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice, s));
    const std::vector<cublasOperation_t> ta(size_t(groups), CUBLAS_OP_T), tb(size_t(groups), CUBLAS_OP_N);
    const std::vector<int> m(size_t(groups), p.m), k(size_t(groups), p.kdim), lda(size_t(groups), p.kdim),
        ldc(size_t(groups), p.m), size(size_t(groups), p.per_group);
    const std::vector<float> alpha(size_t(groups), 1.0f), beta(size_t(groups), 0.0f);
    const cublasStatus_t st = cublasGemmGroupedBatchedEx(
        h, ta.data(), tb.data(), m.data(), p.n.data(), k.data(), alpha.data(), dev, CUDA_R_16F, lda.data(),
        dev + n, CUDA_R_16F, lda.data(), beta.data(), dev + 2 * n, CUDA_R_16F, ldc.data(), groups, size.data(),
        CUBLAS_COMPUTE_32F);
    if (st == CUBLAS_STATUS_SUCCESS) {
      grouped_state = 1;
      return;
    }
    if (grouped_state == 1) check_cublas(st, "cublasGemmGroupedBatchedEx", __FILE__, __LINE__);
    grouped_state = -1;
    std::fprintf(stderr, "cuda: cuBLAS has no grouped FP16 GEMM here (status %d); experts multiply one by one\n",
                 int(st));
  }
  size_t j = 0;
  for (int i = 0; i < groups; ++i)
    for (int q = 0; q < p.per_group; ++q, ++j)
      MS_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, p.m, p.n[size_t(i)], p.kdim, &one, p.A[j], CUDA_R_16F,
                                p.kdim, p.B[j], CUDA_R_16F, p.kdim, &zero, p.C[j], CUDA_R_16F, p.m, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
}

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + 255) / 256, 1, 4096)); }

}  // namespace

bool use_expert_gemm(int64_t T, int k, int E, int64_t dim, int64_t inter) {
  static const int64_t min_rows = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_EXPERT_GEMM_ROWS");
    const int r = v ? std::atoi(v) : 0;
    return r >= 1 ? r : 8;
  }();
  const int64_t pairs = T * k;
  return tensor_cores_for(T) && dim % 8 == 0 && inter % 8 == 0 &&
         pairs >= min_rows * std::min<int64_t>(E, pairs);
}

void run_experts_gemm(const ExpertBatch& b, cudaStream_t s) {
  GemmScratch& g = *b.gemm;
  const int64_t dim = b.dim, inter = b.inter;
  // The groups' offsets (and count) on the host.
  const int n_max = b.a_end - b.a_begin;
  std::vector<int> off(size_t(n_max) + 1);
  int n_active = b.a_end;
  MS_CUDA_CHECK(cudaMemcpyAsync(off.data(), b.groups.offset + b.a_begin, off.size() * sizeof(int),
                                cudaMemcpyDeviceToHost, s));
  if (b.count_on_device)
    MS_CUDA_CHECK(cudaMemcpyAsync(&n_active, b.groups.n_active, sizeof(int), cudaMemcpyDeviceToHost, s));
  MS_CUDA_CHECK(cudaStreamSynchronize(s));
  const int a_end = std::min(b.a_end, n_active);
  if (a_end <= b.a_begin) return;

  const int64_t per_matrix = inter * dim, per_expert = 3 * per_matrix;
  static const int64_t budget = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_EXPERT_GEMM_MB");
    const double mb = v ? std::atof(v) : 0.0;
    return int64_t((mb > 0 ? mb : 256.0) * 1e6);
  }();
  const int chunk = int(std::max<int64_t>(1, budget / (per_expert * int64_t(sizeof(__half)))));
  const bool clamped = b.params->activation == ExpertActivation::ClampedSwiGlu;
  const int* active = b.groups.active;
  const int* offset = b.groups.offset;
  auto at = [&](int a) { return off[size_t(a - b.a_begin)]; };

  for (int a0 = b.a_begin; a0 < a_end; a0 += chunk) {
    const int a1 = std::min(a_end, a0 + chunk), n = a1 - a0;
    const int r0 = at(a0), r1 = at(a1);
    const int64_t rows = r1 - r0;
    if (rows <= 0) continue;
    int64_t max_rows = 0;
    for (int a = a0; a < a1; ++a) max_rows = std::max<int64_t>(max_rows, at(a + 1) - at(a));
    auto* w16 = static_cast<__half*>(g.area(kAreaExpertW16, size_t(std::min(chunk, n_max)) * size_t(per_expert) * sizeof(__half)));
    auto* x16 = static_cast<__half*>(g.area(kAreaExpertX16, size_t(rows * dim) * sizeof(__half)));
    auto* gate = static_cast<__half*>(g.area(kAreaExpertGate, size_t(rows * inter) * sizeof(__half)));
    auto* up = static_cast<__half*>(g.area(kAreaExpertUp, size_t(rows * inter) * sizeof(__half)));
    auto* y16 = static_cast<__half*>(g.area(kAreaExpertDown, size_t(rows * dim) * sizeof(__half)));
    auto* hidden = static_cast<__half*>(g.area(kAreaExpertHidden, size_t(rows * inter) * sizeof(__half)));

    // 1. FP16 weights.
    const unsigned wblocks = grid_for(per_matrix / 8);
    dispatch_format(b.gate_up, [&]<int KIND, bool SF16>() {
      dequant_experts_kernel<KIND, SF16><<<dim3(wblocks, unsigned(n), 2), 256, 0, s>>>(b.table, active, a0, 0, w16,
                                                                                        per_expert, per_matrix);
      MS_CUDA_CHECK_LAUNCH();
    });
    dispatch_format(b.down, [&]<int KIND, bool SF16>() {
      dequant_experts_kernel<KIND, SF16><<<dim3(wblocks, unsigned(n), 1), 256, 0, s>>>(b.table, active, a0, 2, w16,
                                                                                        per_expert, per_matrix);
      MS_CUDA_CHECK_LAUNCH();
    });
    // 2. The chunk's rows of x.
    gather_f16_kernel<<<grid_for(rows * dim), 256, 0, s>>>(b.x, b.groups.row_token, b.params->top_k, dim, r0, rows,
                                                           x16);
    MS_CUDA_CHECK_LAUNCH();
    // 3. gate and up.
    Problems gu;
    gu.m = int(inter);
    gu.kdim = int(dim);
    gu.per_group = 2;
    for (int a = a0; a < a1; ++a) {
      const int m = at(a + 1) - at(a);
      if (m <= 0) continue;
      const int64_t row = at(a) - r0;
      const __half* w = w16 + (a - a0) * per_expert;
      gu.n.push_back(m);
      gu.A.push_back(w);
      gu.A.push_back(w + per_matrix);
      gu.B.push_back(x16 + row * dim);
      gu.B.push_back(x16 + row * dim);
      gu.C.push_back(gate + row * inter);
      gu.C.push_back(up + row * inter);
    }
    run_problems(gu, g, s);
    // 4. The activation.
    ActArgs aa{b.table, active, offset, a0, r0, gate, up, hidden, inter, clamped,
               b.params->swiglu_limit, b.params->swiglu_alpha};
    activation_kernel<<<dim3(grid_for(max_rows * inter), unsigned(n)), 256, 0, s>>>(aa);
    MS_CUDA_CHECK_LAUNCH();
    // 5. down, into y's rows.
    Problems dn;
    dn.m = int(dim);
    dn.kdim = int(inter);
    for (int a = a0; a < a1; ++a) {
      const int m = at(a + 1) - at(a);
      if (m <= 0) continue;
      dn.n.push_back(m);
      dn.A.push_back(w16 + (a - a0) * per_expert + 2 * per_matrix);
      dn.B.push_back(hidden + (at(a) - r0) * inter);
      dn.C.push_back(y16 + int64_t(at(a) - r0) * dim);
    }
    run_problems(dn, g, s);
    down_out_kernel<<<dim3(grid_for(max_rows * dim), unsigned(n)), 256, 0, s>>>(b.table, active, offset, a0, r0, y16,
                                                                                b.y, dim);
    MS_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moestream::cuda
