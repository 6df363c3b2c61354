#include <algorithm>
#include <string>
#include <unordered_set>

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
  std::unordered_set<CUmemGenericAllocationHandle> mapped;  // each released once, however often mapped
  for (auto& [base, r] : ranges_) {
    for (size_t i = 0; i < r.chunks.size(); ++i) {
      mem_unmap_(CUdeviceptr(base) + i * granularity_, granularity_);
      mapped.insert(r.chunks[i]);
    }
    address_free_(CUdeviceptr(base), r.reserved);
  }
  for (CUmemGenericAllocationHandle h : mapped) mem_release_(h);
  for (CUmemGenericAllocationHandle h : free_) mem_release_(h);
  if (scratch_) address_free_(scratch_, granularity_);
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
  --committed_chunks_;
  if (pool_.count(h))
    free_.push_back(h);
  else
    check(mem_release_(h), "releasing a chunk");
}

void GrowableMemory::map_chunk(void* base, size_t i, CUmemGenericAllocationHandle h) {
  const CUdeviceptr at = CUdeviceptr(base) + i * granularity_;
  CUresult m = mem_map_(at, granularity_, 0, h, 0);
  if (m == CUDA_SUCCESS) m = mem_set_access_(at, granularity_, &access_, 1);
  if (m != CUDA_SUCCESS) mem_unmap_(at, granularity_);
  check(m, "mapping a chunk");
}

void GrowableMemory::unmap_chunk(void* base, size_t i, CUmemGenericAllocationHandle h) {
  check(mem_unmap_(CUdeviceptr(base) + i * granularity_, granularity_), "unmapping a chunk");
  if (auto it = shared_maps_.find(h); it != shared_maps_.end()) {
    if (--it->second == 1) shared_maps_.erase(it);
    return;  // another range still maps it
  }
  give_chunk(h);
}

void GrowableMemory::commit(void* base, size_t bytes, cudaStream_t s) {
  Range& r = ranges_.at(base);
  const size_t need =
      std::min(r.reserved, (bytes + granularity_ - 1) / granularity_ * granularity_) / granularity_;
  const size_t first = r.chunks.size();
  while (r.chunks.size() < need) {
    const CUmemGenericAllocationHandle h = take_chunk();
    ++committed_chunks_;
    try {
      map_chunk(base, r.chunks.size(), h);
    } catch (...) {
      give_chunk(h);
      throw;
    }
    r.chunks.push_back(h);
  }
  if (r.chunks.size() > first)
    MS_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(base) + first * granularity_, 0,
                                  (r.chunks.size() - first) * granularity_, s));
}

void GrowableMemory::decommit(void* base, size_t bytes) {
  Range& r = ranges_.at(base);
  const size_t keep = (bytes + granularity_ - 1) / granularity_;
  while (r.chunks.size() > keep) {
    unmap_chunk(base, r.chunks.size() - 1, r.chunks.back());
    r.chunks.pop_back();
  }
  set_borrowed(r, std::min(r.n_borrowed, r.chunks.size()));
  if (r.sealed && r.sealed->chunks.size() > r.chunks.size()) r.sealed->chunks.resize(r.chunks.size());
}

void GrowableMemory::release(void* base) {
  auto it = ranges_.find(base);
  if (it->second.sealed) {
    it->second.sealed->lender_alive = false;
    it->second.sealed.reset();
  }
  decommit(base, 0);
  check(address_free_(CUdeviceptr(base), it->second.reserved), "freeing addresses");
  ranges_.erase(it);
}

void GrowableMemory::seal(void* base, size_t bytes) {
  Range& r = ranges_.at(base);
  if (r.sealed || r.n_borrowed > 0) return;
  const size_t n = std::min(bytes / granularity_, r.chunks.size());
  if (n == 0) return;
  r.sealed = std::make_shared<Loan>();
  r.sealed->chunks.assign(r.chunks.begin(), r.chunks.begin() + long(n));
}

bool GrowableMemory::sealed(const void* base) const {
  const auto it = ranges_.find(base);
  return it != ranges_.end() && it->second.sealed && !it->second.sealed->chunks.empty();
}

void GrowableMemory::replace_borrowed(void* base, Range& r, size_t i, bool copy, cudaStream_t s) {
  const CUmemGenericAllocationHandle mine = take_chunk();
  ++committed_chunks_;
  try {
    if (copy) {  // filled through addresses of its own, then put in the borrowed one's place
      if (!scratch_) check(address_reserve_(&scratch_, granularity_, granularity_, 0, 0), "reserving addresses");
      map_chunk(reinterpret_cast<void*>(scratch_), 0, mine);
      MS_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(scratch_), static_cast<char*>(base) + i * granularity_,
                                    granularity_, cudaMemcpyDeviceToDevice, s));
      MS_CUDA_CHECK(cudaStreamSynchronize(s));
      check(mem_unmap_(scratch_, granularity_), "unmapping a chunk");
    }
    unmap_chunk(base, i, r.chunks[i]);
    map_chunk(base, i, mine);
  } catch (...) {
    give_chunk(mine);
    throw;
  }
  r.chunks[i] = mine;
  if (!copy) MS_CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(base) + i * granularity_, 0, granularity_, s));
}

size_t GrowableMemory::lend(const void* src, void* dst, size_t bytes, cudaStream_t s) {
  const Range& from = ranges_.at(src);
  Range& to = ranges_.at(dst);
  if (!from.sealed || to.sealed || src == dst) return 0;
  const std::vector<CUmemGenericAllocationHandle>& lent = from.sealed->chunks;
  const size_t n = std::min({bytes / granularity_, lent.size(), to.reserved / granularity_});
  // what it borrowed before past the new loan: its own again
  for (size_t i = n; i < to.n_borrowed; ++i) replace_borrowed(dst, to, i, false, s);
  for (size_t i = 0; i < n; ++i) {
    const CUmemGenericAllocationHandle h = lent[i];
    if (i < to.chunks.size()) {
      if (to.chunks[i] == h) continue;
      unmap_chunk(dst, i, to.chunks[i]);
    }
    map_chunk(dst, i, h);
    auto [it, added] = shared_maps_.try_emplace(h, 1);
    ++it->second;
    if (i < to.chunks.size()) to.chunks[i] = h;
    else to.chunks.push_back(h);
  }
  set_borrowed(to, 0);  // the old loan, if any, is let go
  if (n > 0) {
    to.borrowed = from.sealed;
    set_borrowed(to, n);
  }
  return n * granularity_;
}

bool GrowableMemory::borrows_from(const void* base, size_t from) const {
  if (borrowing_ranges_ == 0) return false;
  const auto it = ranges_.find(base);
  return it != ranges_.end() && from / granularity_ < it->second.n_borrowed;
}

void GrowableMemory::own(void* base, size_t from, cudaStream_t s) {
  Range& r = ranges_.at(base);
  const size_t first = from / granularity_;
  for (size_t i = first; i < r.n_borrowed; ++i) replace_borrowed(base, r, i, true, s);
  set_borrowed(r, std::min(r.n_borrowed, first));
}

void GrowableMemory::set_borrowed(Range& r, size_t n) {
  if (r.n_borrowed == 0 && n > 0) ++borrowing_ranges_;
  if (r.n_borrowed > 0 && n == 0) --borrowing_ranges_;
  r.n_borrowed = n;
  if (n == 0) r.borrowed.reset();
}

size_t GrowableMemory::lent_bytes(const void* base) const {
  const auto it = ranges_.find(base);
  if (it == ranges_.end() || !it->second.borrowed || !it->second.borrowed->lender_alive) return 0;
  return it->second.n_borrowed * granularity_;
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
