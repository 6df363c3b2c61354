// The CUDA backend: activations, non-expert weights and KV caches in GPU memory; routed experts
// in a VRAM slot cache fed from the ExpertStore (pinned host slots, filled from disk).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/backend_factory.h"

namespace moestream {

struct CudaOptions {
  // VRAM for expert slots in MB (1e6 bytes); < 0: the free memory at the first MoE layer minus a
  // reserve for activations and scratch.
  double gpu_expert_mb = -1;
  uint64_t max_expert_bytes = 0;  // the pack's largest expert (one slot); 0: the first one seen
  int64_t total_experts = 0;      // routed experts of the model, for sizing the slot arena
  double host_expert_mb = -1;     // the ExpertStore's budget (the pinned host tier); < 0: unbounded
  std::string policy = "lcp";     // which VRAM slot a miss takes (backend/eviction.h), as the store's
  // A usage profile (profile[layer][expert] counts, ExpertStoreOptions::profile): when the slots
  // cannot hold every expert, its hottest experts, up to pin_share of the slots, are brought into
  // VRAM as soon as their host copies are known and never evicted.
  std::vector<std::vector<double>> profile;
  double pin_share = 0.5;
  // With experts read in place from the pinned host tier (a decode step over a partial VRAM
  // tier): the share of each MoE call's missed expert bytes computed on the CPU, on cpu_threads
  // threads (0: one per hardware thread), while the GPU reads the others over PCIe; the calls
  // then go through the host (no CUDA graph). 0: none. The CPU's sums are not the GPU's bit for
  // bit (float32 rounding).
  double cpu_expert_share = 0;
  int cpu_threads = 0;
};

// Whether a CUDA device can be used; when not, `why` says what is missing.
bool cuda_device_available(std::string* why = nullptr);
std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& options);



}  // namespace moestream
