// Shared by the CUDA kernels: error checks with file:line, warp/block reductions, and the
// conversions of stored element types to float32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
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
