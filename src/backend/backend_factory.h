// Creates the backend a model runs on: "cpu", "cuda", or "auto" (CUDA when this build has it and
// a device is present, else the CPU).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace moestream {

struct BackendOptions {
  std::string device = "auto";  // auto | cuda | cpu
  int threads = 0;              // CPU threads; 0 = one per hardware thread
  bool precise = true;          // CPU: float32 activations everywhere
  double gpu_expert_mb = -1;    // CUDA: VRAM for expert slots; < 0 = free memory minus a reserve
  uint64_t max_expert_bytes = 0;  // the pack's largest expert (a VRAM slot)
  int64_t total_experts = 0;      // routed experts in the pack
  double host_expert_mb = -1;     // the ExpertStore's budget (ExpertStoreOptions::cache_mb)
  std::string cache_policy = "lcp";  // CUDA: the VRAM slots' eviction policy (ExpertStoreOptions::policy)
  // CUDA: the usage profile whose hottest experts are pinned in VRAM (ExpertStoreOptions::profile,
  // pin_share of the VRAM slots).
  std::vector<std::vector<double>> profile;
  double pin_share = 0.5;
  // CUDA: the share of a decode step's experts read in place computed on the CPU (CudaOptions).
  double cpu_expert_share = 0;
};

// Fails naming --device when the device is unknown, or is "cuda" and unusable (a build without
// CUDA, no device found).
std::unique_ptr<Backend> make_backend(const BackendOptions& options);

// Whether this build includes the CUDA backend.
bool cuda_built();

// What the VRAM expert tier of a CUDA backend did (hits and misses count distinct experts of the
// MoE calls that went through the host; calls of fully resident layers are resident_calls).
struct GpuTierStats {
  uint64_t hits = 0, misses = 0, prefetched = 0, resident_calls = 0;
  uint64_t graph_steps = 0;   // decode steps replayed as one CUDA graph
  uint64_t norm_splits = 0;   // RMSNorms whose split rows the products after them took
  uint64_t bytes_h2d = 0;     // expert bytes copied host -> GPU
  // Decode read in place: MoE calls so run, the experts they read from pinned host memory (each
  // distinct expert of a call counted once), and misses copied into VRAM slots after their call.
  uint64_t in_place_calls = 0, bytes_in_place = 0, promotions = 0;
  // The CPU's share of those calls (--cpu-experts): experts it computed, their bytes (not in
  // bytes_in_place).
  uint64_t cpu_experts = 0, bytes_cpu = 0;
  double cpu_seconds = 0;         // host time computing them
  double split_wait_seconds = 0;  // host time waiting for those calls' routing to come back
  uint64_t pinned = 0;          // experts the profile pins in VRAM (loaded or not yet)
  uint64_t bytes_promoted = 0;  // copied by those promotions (not in bytes_h2d, whose time is measured)
  double h2d_seconds = 0;     // GPU time of those copies
  uint64_t slot_bytes = 0, slots = 0;
  uint64_t pinned_bytes = 0;  // pinned host memory handed to the ExpertStore
  std::string device;
};
// Limits of the GPU measured now: device-to-device copy (bytes read + written per second),
// pinned host-to-device (large copies, and copies of one expert slot each).
struct GpuLimits {
  double d2d_gb_per_s = 0, h2d_pinned_gb_per_s = 0, h2d_slot_gb_per_s = 0;
  // The GEMV kernel on one token (weight bytes per second) and one kernel launch (host time to
  // enqueue; with the GPU's time to drain the queue).
  double gemv_bf16_gb_per_s = 0, gemv_bf16_head_gb_per_s = 0, gemv_q4_gb_per_s = 0;
  double launch_us = 0, launch_drain_us = 0, round_trip_us = 0;  // round trip: launch + synchronize
};
std::optional<GpuLimits> measure_gpu_limits(Backend& backend);

// The tier statistics when `backend` is a CUDA backend, else nullopt.
std::optional<GpuTierStats> gpu_tier_stats(Backend& backend);

}  // namespace moestream
