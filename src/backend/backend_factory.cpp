#include "backend/backend_factory.h"

#include "core/error.h"
#ifdef MOESTREAM_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace moestream {

bool cuda_built() {
#ifdef MOESTREAM_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

#ifndef MOESTREAM_HAVE_CUDA
std::optional<GpuTierStats> gpu_tier_stats(Backend&) { return std::nullopt; }
std::optional<GpuLimits> measure_gpu_limits(Backend&) { return std::nullopt; }
#endif

std::unique_ptr<Backend> make_backend(const BackendOptions& o) {
  if (o.device != "auto" && o.device != "cuda" && o.device != "cpu")
    fail("--device: '", o.device, "' is not one of auto, cuda, cpu");
#ifdef MOESTREAM_HAVE_CUDA
  if (o.device != "cpu") {
    std::string why;
    if (cuda_device_available(&why)) {
      CudaOptions c;
      c.gpu_expert_mb = o.gpu_expert_mb;
      c.max_expert_bytes = o.max_expert_bytes;
      c.total_experts = o.total_experts;
      c.host_expert_mb = o.host_expert_mb;
      c.policy = o.cache_policy;
      c.profile = o.profile;
      c.pin_share = o.pin_share;
      c.cpu_expert_share = o.cpu_expert_share;
      c.cpu_threads = o.threads;
      return make_cuda_backend(c);
    }
    if (o.device == "cuda") fail("--device cuda: ", why);
  }
#else
  if (o.device == "cuda") fail("--device cuda: this build of moestream has no CUDA backend (configure with -DMOESTREAM_CUDA=ON)");
#endif
  return make_cpu_backend(o.threads, o.precise);
}

}  // namespace moestream
