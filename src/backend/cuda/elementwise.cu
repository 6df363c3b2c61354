// RMSNorm, residual add, clamp, column copies, sigmoid gates and the SwiGLU activations.
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/split_rows.cuh"

namespace moestream::cuda {

namespace {

// out = RMSNorm of each row of `cols` values of x (a block a row) times w; ADD: x += y first
// (written back), the sums of add_kernel then the plain norm with as many threads. The sum of
// squares is float32 as the CPU reference's (block-reduced). Thread j takes elements j, j +
// blockDim.x, ...: up to PER of them held in registers, the weight read before the kernel waits
// for the one before it (a weight is never written during a step); PER 0: any width, each element
// read again after the sum. Every PER sums in the same order, so each gives the same bits. x and
// out may be one buffer.
// SPLIT (1 in order, 2 in q4's order; PER > 0 only): out's row is then also split for the
// tensor-core products (split_rows.cuh), as split_kernel splits it: its largest magnitude from
// the values in registers, its columns read back 8 a thread (the block's own stores, visible after
// block_max's barriers).
template <int PER, bool ADD, int SPLIT = 0>
__global__ void rmsnorm_kernel(float* x, const float* __restrict__ y, const float* __restrict__ w, float eps,
                               int64_t cols, float* out, SplitRows split = {}) {
  __shared__ float scratch[32];
  float* row = x + int64_t(blockIdx.x) * cols;
  float* dst = out + int64_t(blockIdx.x) * cols;
  auto value = [&](int64_t i) {
    if constexpr (ADD) {
      const float v = row[i] + y[int64_t(blockIdx.x) * cols + i];
      row[i] = v;
      return v;
    } else {
      return __ldg(row + i);  // read before any write of this block (in place: out is x)
    }
  };
  if constexpr (PER > 0) {
    float wv[PER], v[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      if (i < cols) wv[j] = w[i];
    }
    wait_prior_grid();
    allow_next_grid();
    float ss = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      if (i < cols) {
        v[j] = value(i);
        ss += v[j] * v[j];
      }
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / float(cols) + eps);
    float mx = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
      if (i < cols) {
        const float o = wv[j] * (v[j] * inv);
        dst[i] = o;
        if constexpr (SPLIT != 0) mx = fmaxf(mx, fabsf(o));
      }
    }
    if constexpr (SPLIT != 0) {
      const int shift = split_shift(block_max(mx, scratch));
      const float up = pow2(shift);
      const int64_t r = blockIdx.x;
      if (threadIdx.x == 0) {
        split.inv[r] = pow2(-shift);
        for (int64_t p = cols / 32; p < split.sum_stride; ++p) split.sum[r * split.sum_stride + p] = 0.0f;
      }
      split_row<SPLIT == 2>(dst, cols, up, r, split);
    }
  } else {
    wait_prior_grid();
    allow_next_grid();
    float ss = 0;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
      const float v = value(i);
      ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / float(cols) + eps);
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = w[i] * (row[i] * inv);
  }
}

// f.template operator()<PER>() for the elements per thread of a row of `cols` (0: more than 8).
template <class F>
void with_per_thread(int64_t cols, int threads, F&& f) {
  const int64_t per = (cols + threads - 1) / threads;
  if (per <= 1) f.template operator()<1>();
  else if (per <= 2) f.template operator()<2>();
  else if (per <= 4) f.template operator()<4>();
  else if (per <= 8) f.template operator()<8>();
  else f.template operator()<0>();
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

__global__ void clamp_kernel(float* x, float limit, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = fminf(fmaxf(x[i], -limit), limit);
}

__global__ void copy_columns_kernel(const float* src, int64_t src_cols, ColumnBlocks from, float* dst,
                                    int64_t dst_cols, ColumnBlocks to, int64_t width, int64_t blocks, int64_t rows) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * blocks * width) return;
  const int64_t t = i / (blocks * width), g = (i / width) % blocks, c = i % width;
  dst[t * dst_cols + to.offset + g * to.stride + c] = src[t * src_cols + from.offset + g * from.stride + c];
}

__global__ void sigmoid_gate_kernel(float* y, int64_t rows, int64_t cols, const float* gate, int64_t gate_cols) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t t = i / cols, c = i % cols;
  y[i] *= sigmoid(gate[t * gate_cols + c % gate_cols]);
}

// out += y * sigmoid(gate[t]), rounded as sigmoid_gate then add (no fused multiply-add).
__global__ void sigmoid_gate_add_kernel(float* out, const float* y, const float* gate, int64_t rows, int64_t cols) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  out[i] = __fadd_rn(out[i], __fmul_rn(y[i], sigmoid(gate[i / cols])));
}

__global__ void activation_kernel(float* g, const float* u, int64_t rows, int64_t cols, const float* gb,
                                  const float* ub, bool clamped, float limit, float alpha) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  const int64_t c = i % cols;
  const float a = g[i] + (gb ? gb[c] : 0.0f), b = u[i] + (ub ? ub[c] : 0.0f);
  g[i] = gated_activation(a, b, clamped, limit, alpha);
}

// Greedy token search: a block of kGreedyThreads takes kGreedyChunk columns of a row, each thread
// every kGreedyThreads-th of them in ascending order (the loads all issued first), keeping the first
// of its largest values; the block keeps the lowest column among equal values. A NaN or +inf
// poisons the chunk (column -1). Then one warp per row folds the chunks the same way.
constexpr int kGreedyThreads = 256, kGreedyPerThread = 16, kGreedyChunk = kGreedyThreads * kGreedyPerThread;
constexpr int kGreedyNone = 0x7fffffff;  // no value above -inf

struct Best {
  float v;
  int i;  // column, -1 when poisoned, kGreedyNone when empty
};

__device__ __forceinline__ Best better(Best a, Best b) {
  if (a.i == -1 || b.i == -1) return {0.0f, -1};
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) b = better(b, {__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)});
  return b;
}

__global__ void greedy_chunks_kernel(const float* __restrict__ x, int64_t cols, int n_chunks, float* part_v,
                                     int* part_i) {
  wait_prior_grid();
  allow_next_grid();
  const int64_t row = blockIdx.y;
  const int64_t c0 = int64_t(blockIdx.x) * kGreedyChunk + threadIdx.x;
  const float* src = x + row * cols;
  float v[kGreedyPerThread];
#pragma unroll
  for (int j = 0; j < kGreedyPerThread; ++j) {
    const int64_t c = c0 + int64_t(j) * kGreedyThreads;
    v[j] = c < cols ? src[c] : -INFINITY;
  }
  Best b{-INFINITY, kGreedyNone};
#pragma unroll
  for (int j = 0; j < kGreedyPerThread; ++j) {
    if (!(v[j] < INFINITY)) b.i = -1;  // NaN or +inf
    else if (b.i != -1 && v[j] > b.v) b = {v[j], int(c0 + int64_t(j) * kGreedyThreads)};
  }
  __shared__ Best warps[kGreedyThreads / 32];
  b = warp_best(b);
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x / 32] = b;
  __syncthreads();
  if (threadIdx.x < 32) {
    b = threadIdx.x < kGreedyThreads / 32 ? warps[threadIdx.x] : Best{-INFINITY, kGreedyNone};
    b = warp_best(b);
    if (threadIdx.x == 0) {
      part_v[row * n_chunks + blockIdx.x] = b.v;
      part_i[row * n_chunks + blockIdx.x] = b.i;
    }
  }
}

__global__ void greedy_fold_kernel(const float* __restrict__ part_v, const int* __restrict__ part_i, int n_chunks,
                                   int32_t* ids) {
  wait_prior_grid();
  allow_next_grid();
  const int64_t row = blockIdx.x;
  Best b{-INFINITY, kGreedyNone};
  for (int c = threadIdx.x; c < n_chunks; c += 32) b = better(b, {part_v[row * n_chunks + c], part_i[row * n_chunks + c]});
  b = warp_best(b);
  if (threadIdx.x == 0) ids[row] = b.i == kGreedyNone ? -1 : b.i;
}

}  // namespace

int64_t greedy_work_ints(int64_t rows, int64_t cols) {
  return 2 * rows * std::max<int64_t>(1, (cols + kGreedyChunk - 1) / kGreedyChunk);
}

void greedy_rows(const float* x, int64_t rows, int64_t cols, int32_t* ids, int32_t* work, cudaStream_t s) {
  if (rows == 0) return;
  const int n_chunks = int(std::max<int64_t>(1, (cols + kGreedyChunk - 1) / kGreedyChunk));
  float* part_v = reinterpret_cast<float*>(work);
  int* part_i = work + rows * n_chunks;
  launch(greedy_chunks_kernel, dim3(unsigned(n_chunks), unsigned(rows)), kGreedyThreads, 0, s, x,
         cols, n_chunks, part_v, part_i);
  launch(greedy_fold_kernel, unsigned(rows), 32, 0, s, part_v, part_i, n_chunks, ids);
}

int rmsnorm_threads(int64_t group) { return group >= 1024 ? 1024 : group >= 256 ? 256 : group > 64 ? 128 : 32; }

void rmsnorm(const float* x, const float* w, float eps, int64_t n, int64_t group, float* out, cudaStream_t s) {
  if (n == 0) return;
  const int threads = rmsnorm_threads(group);
  with_per_thread(group, threads, [&]<int PER>() {
    launch(rmsnorm_kernel<PER, false>, unsigned(n / group), threads, 0, s, const_cast<float*>(x), nullptr, w, eps,
           group, out, SplitRows{});
  });
}

void add_rmsnorm(float* x, const float* y, const float* w, float eps, int64_t rows, int64_t cols, float* out,
                 cudaStream_t s, const SplitRows* split, bool interleaved) {
  if (rows * cols == 0) return;
  const int threads = rmsnorm_threads(cols);
  with_per_thread(cols, threads, [&]<int PER>() {
    if (!split) launch(rmsnorm_kernel<PER, true>, unsigned(rows), threads, 0, s, x, y, w, eps, cols, out, SplitRows{});
    else if constexpr (PER == 0) fail("add_rmsnorm: rows of ", cols, " cannot be split in the norm");
    else if (interleaved) launch(rmsnorm_kernel<PER, true, 2>, unsigned(rows), threads, 0, s, x, y, w, eps, cols, out, *split);
    else launch(rmsnorm_kernel<PER, true, 1>, unsigned(rows), threads, 0, s, x, y, w, eps, cols, out, *split);
  });
}

bool add_rmsnorm_splits(int64_t cols) {
  const int threads = rmsnorm_threads(cols);
  return cols % 32 == 0 && (cols + threads - 1) / threads <= 8;
}

void add(float* x, const float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_kernel<<<blocks_for(n, 256), 256, 0, s>>>(x, y, n);
  MS_CUDA_CHECK_LAUNCH();
}

void clamp(float* x, float limit, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  clamp_kernel<<<blocks_for(n, 256), 256, 0, s>>>(x, limit, n);
  MS_CUDA_CHECK_LAUNCH();
}

void copy_columns(const Buffer& src, ColumnBlocks from, Buffer& dst, ColumnBlocks to, int64_t width,
                  int64_t blocks, cudaStream_t s) {
  const int64_t n = src.rows * blocks * width;
  if (n == 0) return;
  copy_columns_kernel<<<blocks_for(n, 256), 256, 0, s>>>(src.data, src.cols, from, dst.data, dst.cols, to,
                                                         width, blocks, src.rows);
  MS_CUDA_CHECK_LAUNCH();
}

void sigmoid_gate(float* y, int64_t rows, int64_t cols, const float* gate, int64_t gate_cols, cudaStream_t s) {
  if (rows * cols == 0) return;
  sigmoid_gate_kernel<<<blocks_for(rows * cols, 256), 256, 0, s>>>(y, rows, cols, gate, gate_cols);
  MS_CUDA_CHECK_LAUNCH();
}

void sigmoid_gate_add(float* out, const float* y, const float* gate, int64_t rows, int64_t cols, cudaStream_t s) {
  if (rows * cols == 0) return;
  sigmoid_gate_add_kernel<<<blocks_for(rows * cols, 256), 256, 0, s>>>(out, y, gate, rows, cols);
  MS_CUDA_CHECK_LAUNCH();
}

void expert_activation(float* g, const float* u, int64_t rows, int64_t cols, const float* gate_bias,
                       const float* up_bias, const MoeParams& p, cudaStream_t s) {
  if (rows * cols == 0) return;
  activation_kernel<<<blocks_for(rows * cols, 256), 256, 0, s>>>(
      g, u, rows, cols, gate_bias, up_bias, p.activation == ExpertActivation::ClampedSwiGlu, p.swiglu_limit,
      p.swiglu_alpha);
  MS_CUDA_CHECK_LAUNCH();
}

}  // namespace moestream::cuda
