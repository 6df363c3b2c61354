// The GPU-limits probe (see cuda_limits.h): timed copies and kernels on the backend's compute
// stream, best of a few repetitions each.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_limits.h"
#include "backend/cuda/elementwise.h"

namespace moestream::cuda {

GpuLimits probe_gpu_limits(cudaStream_t stream, GemmScratch& gemm, uint64_t max_expert_bytes) {
  MS_CUDA_CHECK(cudaStreamSynchronize(stream));
  GpuLimits l;
  cudaEvent_t a, b;
  MS_CUDA_CHECK(cudaEventCreate(&a));
  MS_CUDA_CHECK(cudaEventCreate(&b));
  auto time_copy = [&](void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, int reps) {
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      MS_CUDA_CHECK(cudaEventRecord(a, stream));
      MS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream));
      MS_CUDA_CHECK(cudaEventRecord(b, stream));
      MS_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      MS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      best = std::min(best, double(ms) / 1e3);
    }
    return best;
  };
  const size_t big = size_t(1) << 30, host_bytes = size_t(256) << 20;
  void *d0 = nullptr, *d1 = nullptr, *h = nullptr;
  MS_CUDA_CHECK(cudaMalloc(&d0, big));
  MS_CUDA_CHECK(cudaMalloc(&d1, big));
  MS_CUDA_CHECK(cudaMemset(d0, 1, big));
  l.d2d_gb_per_s = 2.0 * double(big) / time_copy(d1, d0, big, cudaMemcpyDeviceToDevice, 5) / 1e9;
  MS_CUDA_CHECK(cudaHostAlloc(&h, host_bytes, cudaHostAllocDefault));
  std::memset(h, 1, host_bytes);
  l.h2d_pinned_gb_per_s = double(host_bytes) / time_copy(d0, h, host_bytes, cudaMemcpyHostToDevice, 3) / 1e9;
  const size_t slot = std::min<size_t>(host_bytes, max_expert_bytes ? max_expert_bytes : (size_t(3) << 20));
  double t = 0;
  const int n = int(host_bytes / slot);
  for (int i = 0; i < n; ++i)
    t += time_copy(static_cast<char*>(d0) + size_t(i) * slot, static_cast<char*>(h) + size_t(i) * slot, slot,
                   cudaMemcpyHostToDevice, 1);
  l.h2d_slot_gb_per_s = double(slot) * n / t / 1e9;
  MS_CUDA_CHECK(cudaFreeHost(h));
  // The GEMV kernel on one token: bf16 [4096, 2048] (an attention projection), bf16
  // [151936, 2048] (an output head) and q4g64 [768 x 3, 2048] (one expert's gate/up/down
  // bytes), weights read per second; and the host cost of one kernel launch.
  auto gemv = [&](int64_t rows, int64_t cols, bool q4) {
    Matrix m{"probe", q4 ? DType::U32 : DType::BF16, d0, rows, cols};
    if (q4) {
      m.quant = QuantFormat{4, 64, DType::BF16};
      m.scales = static_cast<char*>(d0) + size_t(rows * cols / 2);
      m.biases = static_cast<const char*>(m.scales) + size_t(rows * cols / 64 * 2);
    }
    const size_t bytes = q4 ? size_t(rows * cols / 2 + rows * cols / 64 * 4) : size_t(rows * cols * 2);
    float* x = static_cast<float*>(d1);
    float* y = x + cols;
    MS_CUDA_CHECK(cudaMemset(d0, 0x3c, bytes));  // finite values in every format
    MS_CUDA_CHECK(cudaMemset(x, 0, size_t(cols) * 4));
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      MS_CUDA_CHECK(cudaEventRecord(a, stream));
      for (int i = 0; i < 10; ++i) cuda::linear(m, x, cols, 1, nullptr, y, rows, gemm, stream);
      MS_CUDA_CHECK(cudaEventRecord(b, stream));
      MS_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      MS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      best = std::min(best, double(ms) / 1e3 / 10);
    }
    return double(bytes) / best / 1e9;
  };
  l.gemv_bf16_gb_per_s = gemv(4096, 2048, false);
  l.gemv_bf16_head_gb_per_s = gemv(151936, 2048, false);
  l.gemv_q4_gb_per_s = gemv(3 * 768, 2048, true);
  {
    const int n = 2000;
    float* x = static_cast<float*>(d1);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) cuda::add(x, x + 64, 64, stream);
    const double host = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MS_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double all = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    l.launch_us = host / n * 1e6;
    l.launch_drain_us = all / n * 1e6;
    auto t1 = std::chrono::steady_clock::now();
    for (int i = 0; i < 200; ++i) {  // a round trip: one small launch, then wait for it
      cuda::add(x, x + 64, 64, stream);
      MS_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    l.round_trip_us = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count() / 200 * 1e6;
  }
  MS_CUDA_CHECK(cudaFree(d0));
  MS_CUDA_CHECK(cudaFree(d1));
  MS_CUDA_CHECK(cudaEventDestroy(a));
  MS_CUDA_CHECK(cudaEventDestroy(b));
  return l;
}

}  // namespace moestream::cuda
