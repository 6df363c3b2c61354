// The GPU-limits probe behind measure_gpu_limits (cuda_limits.cu): what the device's copies,
// GEMV kernel and kernel launches achieve right now, for `moestream bench` to compare against.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend_factory.h"
#include "backend/cuda/linear.h"

namespace moestream::cuda {

// Measures on `stream` (after waiting for its work), with 2 GiB of device and 256 MiB of pinned
// memory held while it runs. Slot copies are of max_expert_bytes (0: 3 MiB, a typical expert).
GpuLimits probe_gpu_limits(cudaStream_t stream, GemmScratch& gemm, uint64_t max_expert_bytes);

}  // namespace moestream::cuda
