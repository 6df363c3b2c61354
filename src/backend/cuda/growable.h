// Device buffers that take memory as they grow (Backend::alloc_growable, the KV caches): each is a
// range of virtual addresses reserved whole, with physical chunks of the driver's mapping
// granularity (2 MiB on current GPUs) mapped behind its first bytes as they are committed. Kernels
// see one contiguous buffer, so nothing that reads a cache changes, and a sequence grows without
// copying. Chunks come from a pool set aside by reserve_pool (then a commit fails once the pool is
// used up) or, without one, from the driver as needed. A range's first chunks can be sealed (a
// prefix cache's entry) and then lent: mapped into other ranges at the same offsets, so that a
// state restored from the entry reads the entry's memory instead of a copy. A borrower gets its
// own copy of a chunk before it writes there (own()); a chunk goes back once no range maps it. The
// driver's virtual memory calls are found at run time through the runtime (no link against
// libcuda).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
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
  // Chunks of memory in use, each counted once however many ranges map it.
  size_t committed() const { return committed_chunks_ * granularity_; }

  // Marks the whole chunks within the first `bytes` of the range at base final (nothing writes
  // them while it lives), so that lend() can map them elsewhere. A range that borrows is not sealed.
  void seal(void* base, size_t bytes);
  bool sealed(const void* base) const;
  // Maps the sealed chunks of src's range that lie within its first `bytes` into dst's range at the
  // same offsets, in place of dst's own chunks there (and of what it borrowed before, which become
  // zeroed chunks of its own on s); returns the bytes so lent, from dst's start. The GPU must be
  // done with dst's chunks.
  size_t lend(const void* src, void* dst, size_t bytes, cudaStream_t s);
  // Whether the range at base borrows a chunk holding a byte at or after `from`; whether any does.
  bool borrows_from(const void* base, size_t from) const;
  bool borrows_any() const { return borrowing_ranges_ > 0; }
  // Gives the range at base its own copy of each chunk it borrows at or after byte `from` (copied
  // on s, which is synchronized). The GPU must be done with them.
  void own(void* base, size_t from, cudaStream_t s);
  // Bytes at the start of the range at base that it borrows from a sealed range still alive.
  size_t lent_bytes(const void* base) const;

 private:
  // A sealed range's first chunks, shared by it and the ranges they are lent to.
  struct Loan {
    std::vector<CUmemGenericAllocationHandle> chunks;
    bool lender_alive = true;
  };
  struct Range {
    size_t reserved = 0;
    std::vector<CUmemGenericAllocationHandle> chunks;  // mapped at base + i * granularity
    std::shared_ptr<Loan> sealed;                      // what this range lends
    std::shared_ptr<Loan> borrowed;                    // chunks [0, n_borrowed) are borrowed's
    size_t n_borrowed = 0;
  };
  CUmemGenericAllocationHandle take_chunk();
  void give_chunk(CUmemGenericAllocationHandle h);
  // Maps h at base + i * granularity (read and write for the device); unmaps it and gives h back
  // (once no other range maps it).
  void map_chunk(void* base, size_t i, CUmemGenericAllocationHandle h);
  void unmap_chunk(void* base, size_t i, CUmemGenericAllocationHandle h);
  // r's first n chunks are borrowed (of r.borrowed, which it drops at 0).
  void set_borrowed(Range& r, size_t n);
  // Chunk i of the range at base, borrowed, replaced by one of its own (zeroed on s, or holding a
  // copy of the borrowed one's bytes when `copy`).
  void replace_borrowed(void* base, Range& r, size_t i, bool copy, cudaStream_t s);

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
  // Chunks mapped in more than one range: how many map each.
  std::unordered_map<CUmemGenericAllocationHandle, int> shared_maps_;
  size_t borrowing_ranges_ = 0;  // ranges with n_borrowed > 0
  CUdeviceptr scratch_ = 0;  // one chunk of addresses where own() maps a new chunk to fill it

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
