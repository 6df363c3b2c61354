#include <algorithm>
#include <string>

#include "backend/cuda/common.cuh"
#include "backend/cuda/growable.h"
#include "core/error.h"

namespace moestream::cuda {

namespace {

// A driver call's failure as an Error: what was being done and the driver's name for the code.
void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  fail("KV cache memory: ", what, " failed (CUDA driver error ", int(r), ")");
}

template <class Fn>
void entry(const char* symbol, Fn*& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  MS_CUDA_CHECK(cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || !p)
    fail("KV cache memory: the CUDA driver has no ", symbol);
  fn = reinterpret_cast<Fn*>(p);
}

}  // namespace

GrowableMemory::GrowableMemory(int device) : device_(device) {
  entry("cuMemCreate", mem_create_);
  entry("cuMemRelease", mem_release_);
  entry("cuMemMap", mem_map_);
  entry("cuMemUnmap", mem_unmap_);
  entry("cuMemSetAccess", mem_set_access_);
  entry("cuMemAddressReserve", address_reserve_);
  entry("cuMemAddressFree", address_free_);
  entry("cuMemGetAllocationGranularity", granularity_of_);
  prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop_.location.id = device;
  access_.location = prop_.location;
  access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(granularity_of_(&granularity_, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "asking the mapping granularity");
}

GrowableMemory::~GrowableMemory() {
  for (auto& [base, r] : ranges_) {
    for (size_t i = 0; i < r.chunks.size(); ++i) {
      mem_unmap_(CUdeviceptr(base) + i * granularity_, granularity_);
      mem_release_(r.chunks[i]);
    }
    address_free_(CUdeviceptr(base), r.reserved);
  }
  for (CUmemGenericAllocationHandle h : free_) mem_release_(h);
}

void* GrowableMemory::reserve(size_t bytes) {
  const size_t n = (std::max<size_t>(bytes, 1) + granularity_ - 1) / granularity_ * granularity_;
  CUdeviceptr p = 0;
  check(address_reserve_(&p, n, granularity_, 0, 0), "reserving addresses");
  ranges_[reinterpret_cast<const void*>(p)].reserved = n;
  return reinterpret_cast<void*>(p);
}

CUmemGenericAllocationHandle GrowableMemory::take_chunk() {
  CUmemGenericAllocationHandle h{};
  if (pooled_) {
    if (free_.empty())
      fail("KV cache memory: the ", pool_chunks_ * granularity_ / (1 << 20),
           " MiB set aside for KV caches are used up");
    h = free_.back();
    free_.pop_back();
    return h;
  }
  const CUresult r = mem_create_(&h, granularity_, &prop_, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    fail("KV cache memory: the GPU has no memory left for a longer KV cache");
  check(r, "allocating a chunk");
  return h;
}

void GrowableMemory::give_chunk(CUmemGenericAllocationHandle h) {
  if (pool_.count(h))
    free_.push_back(h);
  else
    check(mem_release_(h), "releasing a chunk");
}

void GrowableMemory::commit(void* base, size_t bytes, cudaStream_t s) {
  Range& r = ranges_.at(base);
  const size_t need =
      std::min(r.reserved, (bytes + granularity_ - 1) / granularity_ * granularity_) / granularity_;
  const size_t first = r.chunks.size();
  while (r.chunks.size() < need) {
    const CUmemGenericAllocationHandle h = take_chunk();
    const CUdeviceptr at = CUdeviceptr(base) + r.chunks.size() * granularity_;
    CUresult m = mem_map_(at, granularity_, 0, h, 0);
    if (m == CUDA_SUCCESS) m = mem_set_access_(at, granularity_, &access_, 1);
    if (m != CUDA_SUCCESS) {
      mem_unmap_(at, granularity_);
      give_chunk(h);
      check(m, "mapping a chunk");
    }
    r.chunks.push_back(h);
    ++committed_chunks_;
  }
  if (r.chunks.size() > first)
    MS_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(base) + first * granularity_, 0,
                                  (r.chunks.size() - first) * granularity_, s));
}

void GrowableMemory::decommit(void* base, size_t bytes) {
  Range& r = ranges_.at(base);
  const size_t keep = (bytes + granularity_ - 1) / granularity_;
  while (r.chunks.size() > keep) {
    const CUdeviceptr at = CUdeviceptr(base) + (r.chunks.size() - 1) * granularity_;
    check(mem_unmap_(at, granularity_), "unmapping a chunk");
    give_chunk(r.chunks.back());
    r.chunks.pop_back();
    --committed_chunks_;
  }
}

void GrowableMemory::release(void* base) {
  decommit(base, 0);
  auto it = ranges_.find(base);
  check(address_free_(CUdeviceptr(base), it->second.reserved), "freeing addresses");
  ranges_.erase(it);
}

void GrowableMemory::reserve_pool(size_t bytes) {
  const size_t want = (bytes + granularity_ - 1) / granularity_;
  // Chunks mapped before stay outside the pool: released when they come back.
  while (pool_chunks_ < want) {
    CUmemGenericAllocationHandle h{};
    const CUresult r = mem_create_(&h, granularity_, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY)
      fail("KV cache memory: the GPU cannot set aside ", bytes >> 20, " MiB for KV caches (it had ",
           (pool_chunks_ * granularity_) >> 20, " MiB)");
    check(r, "allocating a chunk");
    free_.push_back(h);
    pool_.insert(h);
    ++pool_chunks_;
  }
  pooled_ = true;
}

}  // namespace moestream::cuda
