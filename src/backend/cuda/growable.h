// Device buffers that take memory as they grow (Backend::alloc_growable, the KV caches): each is a
// range of virtual addresses reserved whole, with physical chunks of the driver's mapping
// granularity (2 MiB on current GPUs) mapped behind its first bytes as they are committed. Kernels
// see one contiguous buffer, so nothing that reads a cache changes, and a sequence grows without
// copying. Chunks come from a pool set aside by reserve_pool (then a commit fails once the pool is
// used up) or, without one, from the driver as needed. The driver's virtual memory calls are
// found at run time through the runtime (no link against libcuda).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace moestream::cuda {

class GrowableMemory {
 public:
  explicit GrowableMemory(int device);
  ~GrowableMemory();
  GrowableMemory(const GrowableMemory&) = delete;
  GrowableMemory& operator=(const GrowableMemory&) = delete;

  size_t granularity() const { return granularity_; }
  // Reserves addresses for `bytes` (rounded up to the granularity); no memory behind them yet.
  void* reserve(size_t bytes);
  bool owns(const void* base) const { return ranges_.count(base) != 0; }
  // Maps chunks behind the first `bytes` of the range at base (those not mapped yet), zeroed on s.
  void commit(void* base, size_t bytes, cudaStream_t s);
  // Unmaps the chunks past the first `bytes` (rounded up); the GPU must be done with them.
  void decommit(void* base, size_t bytes);
  // Unmaps everything and frees the addresses (the GPU must be done with them).
  void release(void* base);
  // Sets `bytes` (rounded up to whole chunks) aside now; later commits take only these.
  void reserve_pool(size_t bytes);
  size_t committed() const { return committed_chunks_ * granularity_; }

 private:
  struct Range {
    size_t reserved = 0;
    std::vector<CUmemGenericAllocationHandle> chunks;  // mapped at base + i * granularity
  };
  CUmemGenericAllocationHandle take_chunk();
  void give_chunk(CUmemGenericAllocationHandle h);

  int device_ = 0;
  size_t granularity_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::unordered_map<const void*, Range> ranges_;
  bool pooled_ = false;
  size_t pool_chunks_ = 0;  // chunks set aside in all
  std::unordered_set<CUmemGenericAllocationHandle> pool_;
  std::vector<CUmemGenericAllocationHandle> free_;  // of the pool, not mapped now
  size_t committed_chunks_ = 0;

  // The driver entry points (cudaGetDriverEntryPointByVersion).
  CUresult (*mem_create_)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*mem_release_)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*mem_map_)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*mem_unmap_)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_set_access_)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*address_reserve_)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                               unsigned long long) = nullptr;
  CUresult (*address_free_)(CUdeviceptr, size_t) = nullptr;
  CUresult (*granularity_of_)(size_t*, const CUmemAllocationProp*,
                              CUmemAllocationGranularity_flags) = nullptr;
};

}  // namespace moestream::cuda
