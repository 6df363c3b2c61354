// Shared by the CUDA kernels: error checks with file:line, warp/block reductions, and the
// conversions of stored element types to float32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.h"

namespace moestream::cuda {

// A failed CUDA call throws Error naming the call site; a launch is checked right after it.
#define MS_CUDA_CHECK(expr)                                                                   \
  do {                                                                                        \
    cudaError_t err_ = (expr);                                                                \
    if (err_ != cudaSuccess)                                                                  \
      ::moestream::fail(__FILE__, ":", __LINE__, ": ", #expr, ": ", cudaGetErrorString(err_)); \
  } while (0)
#define MS_CUDA_CHECK_LAUNCH() MS_CUDA_CHECK(cudaGetLastError())

constexpr int kWarp = 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory; the call ends with the block synchronized.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

// The largest of v over the block (blockDim.x a multiple of 32); every thread gets it. `scratch`
// holds 32 floats of shared memory; the call ends with the block synchronized.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = blockDim.x / kWarp;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }
__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// An expert's (or MLP's) activation of its gate and up values: SwiGLU, or gpt-oss's clamped
// variant (gate clamped above at limit, up to [-limit, limit], sigmoid scaled by alpha).
__device__ __forceinline__ float gated_activation(float g, float u, bool clamped, float limit, float alpha) {
  if (!clamped) return g / (1.0f + expf(-g)) * u;
  const float gc = fminf(g, limit), uc = fminf(fmaxf(u, -limit), limit);
  return (uc + 1.0f) * (gc / (1.0f + expf(-alpha * gc)));
}

inline unsigned blocks_for(int64_t n, int per_block) { return unsigned((n + per_block - 1) / per_block); }

// Programmatic dependent launch (compute capability 9.0 on): a kernel started by launch() may
// begin while the kernel before it in the stream is still running, so that its start-up and its
// first weight loads overlap that kernel's end. Such a kernel calls wait_prior_grid() before it
// reads anything the kernel before it wrote, or writes anything it reads; before that it reads
// only weights, which nothing on the device writes during a step, or what work older than the
// kernel before wrote (down's kernels read the routing so: down_early in moe.h). allow_next_grid()
// lets the next kernel start once every block of this one has called it (or ended); a kernel
// calls it after its wait, so that at most two kernels overlap, and every older kernel (and copy)
// has finished when the next one starts. Both are no-ops in a kernel started plainly (<<< >>>)
// and on older GPUs, where launch() starts kernels plainly.
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The wait, then the next kernel allowed: where a kernel reads early (down_early in moe.h), after
// its early reads.
__device__ __forceinline__ void follow_prior_grid() {
  wait_prior_grid();
  allow_next_grid();
}

// Whether launch() overlaps kernels: the current device is of compute capability 9.0 or later,
// and MOESTREAM_CUDA_PDL is not 0 (for comparisons). Read once.
bool dependent_launch_on();

// kernel<<<grid, block, smem, s>>>(args...), allowed to overlap the previous kernel in the
// stream (see wait_prior_grid); checked.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
            Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = s;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = dependent_launch_on() ? 1 : 0;
  MS_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Lets Kernel take `bytes` of dynamic shared memory (beyond the 48 KiB every kernel may take),
// raising its limit once per larger size it is asked for.
template <auto Kernel>
void allow_smem(size_t bytes) {
  static size_t allowed = 48 * 1024;  // one per kernel
  if (bytes > allowed) {
    MS_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    allowed = bytes;
  }
}

}  // namespace moestream::cuda

namespace moestream::cuda {

// Device scratch areas by slot, each grown to the largest size asked for and then reused, so a
// steady decode step does not allocate. Growing synchronizes the device (cudaFree).
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    for (auto& a : areas_)
      if (a.ptr) cudaFree(a.ptr);
  }
  template <class T = float>
  T* get(int slot, size_t count) {
    if (areas_.size() <= size_t(slot)) areas_.resize(size_t(slot) + 1);
    Area& a = areas_[size_t(slot)];
    const size_t bytes = count * sizeof(T);
    if (a.bytes < bytes) {
      if (a.ptr) MS_CUDA_CHECK(cudaFree(a.ptr));
      a.ptr = nullptr;
      MS_CUDA_CHECK(cudaMalloc(&a.ptr, bytes));
      a.bytes = bytes;
    }
    return static_cast<T*>(a.ptr);
  }

 private:
  struct Area {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  std::vector<Area> areas_;
};

}  // namespace moestream::cuda
