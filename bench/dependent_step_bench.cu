// What one dependent step costs on this GPU, by how the steps are joined. A decode step is a chain
// of small operations, each reading what the last one wrote; this measures the chain with almost
// no work in its links. A step: every block reads the whole 2,048-float vector the last step wrote
// (as a GEMV stages x), sums it, and writes its share of the next vector. 1,000 steps, the best of
// 5 runs, for 16 blocks, one an SM, two and three an SM. Joins:
//   graph, plain              one kernel a step, in a CUDA graph
//   graph, PDL                the same launched for programmatic dependent launch (what the
//                             decode kernels use: wait_prior_grid / allow_next_grid)
//   persistent, barrier       one kernel, its steps separated by a grid barrier (a count and a
//                             generation word)
//   persistent, count         one kernel, each step ending when a count that only grows reaches
//                             its blocks times the step
//   graph, PDL + block counts PDL launches that wait for the last kernel's blocks to count
//                             themselves done instead of for its grid to end
//
//   dependent_step_bench
#include <cuda_runtime.h>

#include <cstdio>

#include "backend/cuda/common.cuh"

namespace {

constexpr int kCols = 2048, kThreads = 256, kSteps = 1000, kRuns = 5;
constexpr long kSpinLimit = 1l << 24;  // a join that never comes reports instead of hanging

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::printf("dependent_step_bench: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

__device__ __forceinline__ void step_body(const float* in, float* out, int block, int blocks) {
  __shared__ float part[kThreads / 32];
  float s = 0;
  for (int i = threadIdx.x; i < kCols; i += kThreads) s += __ldcg(in + i);
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = s;
  __syncthreads();
  float t = 0;
  for (int w = 0; w < kThreads / 32; ++w) t += part[w];
  const int per = (kCols + blocks - 1) / blocks;
  for (int i = block * per + threadIdx.x; i < min(kCols, (block + 1) * per); i += kThreads)
    out[i] = t * 1e-4f + __ldcg(in + i) * 0.5f;
  __syncthreads();
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <bool PDL>
__global__ void step_kernel(const float* in, float* out) {
  if (PDL) moestream::cuda::follow_prior_grid();  // as the decode kernels join
  step_body(in, out, blockIdx.x, gridDim.x);
}

__global__ void counted_step_kernel(const float* in, float* out, const unsigned* prev_done, unsigned* done) {
  moestream::cuda::allow_next_grid();
  if (prev_done) {
    if (threadIdx.x == 0)
      for (long n = 0; load_acquire(prev_done) < gridDim.x && n < kSpinLimit; ++n) {
      }
    __syncthreads();
  }
  step_body(in, out, blockIdx.x, gridDim.x);
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(done, 1u);
  }
}

// bar[0]: blocks arrived, bar[1]: generation.
__global__ void barrier_kernel(float* a, float* b, int steps, unsigned* bar) {
  for (int s = 0; s < steps; ++s) {
    step_body(s & 1 ? b : a, s & 1 ? a : b, blockIdx.x, gridDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned gen = *reinterpret_cast<volatile unsigned*>(bar + 1);
      __threadfence();
      if (atomicAdd(bar, 1u) == gridDim.x - 1) {
        *reinterpret_cast<volatile unsigned*>(bar) = 0;
        __threadfence();
        atomicExch(bar + 1, gen + 1);
      } else {
        for (long n = 0; *reinterpret_cast<volatile unsigned*>(bar + 1) == gen && n < kSpinLimit; ++n) {
        }
      }
      __threadfence();
    }
    __syncthreads();
  }
}

__global__ void count_kernel(float* a, float* b, int steps, unsigned* count) {
  for (int s = 0; s < steps; ++s) {
    step_body(s & 1 ? b : a, s & 1 ? a : b, blockIdx.x, gridDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(count, 1u);
      for (long n = 0; load_acquire(count) < unsigned(s + 1) * gridDim.x && n < kSpinLimit; ++n) {
      }
    }
    __syncthreads();
  }
}

enum Join { kPlain, kPdl, kBarrier, kCount, kPdlCounts, kJoins };
const char* const kJoinNames[kJoins] = {"graph, plain", "graph, PDL", "persistent, barrier", "persistent, count",
                                        "graph, PDL + block counts"};

struct Buffers {
  float *a = nullptr, *b = nullptr;
  unsigned *bar = nullptr, *done = nullptr;
};

// The chain of kSteps kernels as a graph.
bool capture(Join join, int blocks, const Buffers& m, cudaStream_t st, cudaGraphExec_t* exec) {
  if (!ok(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed), "capture")) return false;
  if (join == kPdlCounts && !ok(cudaMemsetAsync(m.done, 0, kSteps * sizeof(unsigned), st), "memset")) return false;
  for (int s = 0; s < kSteps; ++s) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = blocks;
    cfg.blockDim = kThreads;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = join == kPlain ? 0 : 1;
    const float* in = s & 1 ? m.b : m.a;
    float* out = s & 1 ? m.a : m.b;
    cudaError_t e;
    if (join == kPdlCounts)
      e = cudaLaunchKernelEx(&cfg, counted_step_kernel, in, out, s ? m.done + s - 1 : nullptr, m.done + s);
    else if (join == kPdl) e = cudaLaunchKernelEx(&cfg, step_kernel<true>, in, out);
    else e = cudaLaunchKernelEx(&cfg, step_kernel<false>, in, out);
    if (!ok(e, "launch")) return false;
  }
  cudaGraph_t g = nullptr;
  if (!ok(cudaStreamEndCapture(st, &g), "end capture")) return false;
  const bool made = ok(cudaGraphInstantiate(exec, g, 0), "instantiate");
  cudaGraphDestroy(g);
  return made;
}

// Microseconds a step, the best of kRuns; negative where the join cannot run.
float measure(Join join, int blocks, const Buffers& m, cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1) {
  cudaGraphExec_t exec = nullptr;
  const bool graph = join == kPlain || join == kPdl || join == kPdlCounts;
  if (graph && !capture(join, blocks, m, st, &exec)) return -1;
  if (!graph) {  // the persistent kernels need every block resident at once
    int per_sm = 0, sms = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, join == kBarrier ? barrier_kernel : count_kernel, kThreads, 0);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    if (blocks > per_sm * sms) return -1;
  }
  float best = 1e30f;
  for (int run = 0; run < kRuns + 1; ++run) {  // the first run warms up
    if (graph) {
      cudaEventRecord(e0, st);
      cudaGraphLaunch(exec, st);
    } else {
      cudaMemsetAsync(m.bar, 0, 2 * sizeof(unsigned), st);
      cudaEventRecord(e0, st);
      if (join == kBarrier) barrier_kernel<<<blocks, kThreads, 0, st>>>(m.a, m.b, kSteps, m.bar);
      else count_kernel<<<blocks, kThreads, 0, st>>>(m.a, m.b, kSteps, m.bar);
    }
    cudaEventRecord(e1, st);
    if (!ok(cudaStreamSynchronize(st), "run")) return -1;
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (run > 0 && ms < best) best = ms;
  }
  if (exec) cudaGraphExecDestroy(exec);
  return best * 1000.0f / kSteps;
}

}  // namespace

int main() {
  Buffers m;
  if (!ok(cudaMalloc(&m.a, kCols * sizeof(float)), "alloc") || !ok(cudaMalloc(&m.b, kCols * sizeof(float)), "alloc") ||
      !ok(cudaMalloc(&m.bar, 2 * sizeof(unsigned)), "alloc") ||
      !ok(cudaMalloc(&m.done, kSteps * sizeof(unsigned)), "alloc"))
    return 1;
  cudaMemset(m.a, 0, kCols * sizeof(float));
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs: us a dependent step (%d steps, best of %d)\n", prop.name, sms, kSteps, kRuns);
  std::printf("%-28s", "join \\ blocks");
  const int grids[] = {16, sms, 2 * sms, 3 * sms};
  for (int blocks : grids) std::printf(" %8d", blocks);
  std::printf("\n");
  for (int j = 0; j < kJoins; ++j) {
    std::printf("%-28s", kJoinNames[j]);
    for (int blocks : grids) {
      const float us = measure(Join(j), blocks, m, st, e0, e1);
      if (us < 0) std::printf(" %8s", "-");
      else std::printf(" %8.2f", us);
    }
    std::printf("\n");
  }
  return 0;
}
