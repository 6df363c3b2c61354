#include "backend/cuda/op_profile.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "backend/cuda/common.cuh"
#include "core/quant.h"

namespace moestream::cuda {

OpProfile::OpProfile() {
  const char* v = std::getenv("MOESTREAM_CUDA_PROFILE");
  on_ = v && *v && std::string(v) != "0";
}

OpProfile::~OpProfile() {
  if (!on_) return;
  try {
    report();
  } catch (...) {  // a failed CUDA call at exit: the profile is lost, the run is not
  }
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
}

cudaEvent_t OpProfile::event() {
  if (free_.empty()) {
    cudaEvent_t e = nullptr;
    MS_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
  cudaEvent_t e = free_.back();
  free_.pop_back();
  return e;
}

void OpProfile::begin(cudaStream_t stream) {
  if (!on_) return;
  if (!open_) open_ = event();
  MS_CUDA_CHECK(cudaEventRecord(open_, stream));
}

void OpProfile::end(cudaStream_t stream, const std::string& label, double bytes) {
  if (!on_ || !open_) return;
  cudaEvent_t stop = event();
  MS_CUDA_CHECK(cudaEventRecord(stop, stream));
  pending_.push_back(Pending{open_, stop, label, bytes});
  open_ = nullptr;
  if (pending_.size() >= 4096) harvest();
}

void OpProfile::harvest() {
  for (Pending& p : pending_) {
    MS_CUDA_CHECK(cudaEventSynchronize(p.stop));
    float ms = 0;
    MS_CUDA_CHECK(cudaEventElapsedTime(&ms, p.start, p.stop));
    Sum& s = sums_[p.label];
    if (s.first_ms < 0) {
      s.first_ms = ms;
    } else {
      ++s.calls;
      s.ms += ms;
      s.bytes += p.bytes;
    }
    free_.push_back(p.start);
    free_.push_back(p.stop);
  }
  pending_.clear();
}

void OpProfile::report() {
  if (!on_) return;
  harvest();
  if (sums_.empty()) return;
  std::vector<std::pair<std::string, Sum>> rows(sums_.begin(), sums_.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total = 0, first = 0;
  for (const auto& r : rows) {
    total += r.second.ms;
    first += r.second.first_ms;
  }
  std::fprintf(stderr,
               "GPU time by operation (MOESTREAM_CUDA_PROFILE): %.1f ms in all, not counting the first call of each "
               "operation (%.1f ms, one-time costs included)\n",
               total, first);
  std::fprintf(stderr, "%10s %6s %9s %8s %9s %10s  %s\n", "ms", "%", "calls", "us/call", "GB/s", "first us",
               "operation");
  for (const auto& [label, s] : rows) {
    const double us = s.calls ? s.ms * 1e3 / double(s.calls) : 0;
    char rate[32] = "";
    if (s.bytes > 0 && s.ms > 0) std::snprintf(rate, sizeof rate, "%.1f", s.bytes / (s.ms * 1e-3) / 1e9);
    std::fprintf(stderr, "%10.2f %6.2f %9llu %8.2f %9s %10.1f  %s\n", s.ms, total > 0 ? 100 * s.ms / total : 0.0,
                 static_cast<unsigned long long>(s.calls), us, rate, s.first_ms * 1e3, label.c_str());
  }
  sums_.clear();
}

std::string weight_label(const char* what, const Matrix& w, int64_t tokens) {
  const std::string format = w.quant.bits ? quant_format_name(w.quant) : std::string(dtype_name(w.dtype));
  return std::string(what) + " [" + std::to_string(w.rows) + " x " + std::to_string(w.cols) + " " + format +
         "] T=" + std::to_string(tokens);
}

std::string experts_label(const char* what, int64_t rows, int64_t cols, int n_experts, bool one_token) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s [%lld x %lld] x %d experts%s", what, static_cast<long long>(rows),
                static_cast<long long>(cols), n_experts, one_token ? ", one-token kernel" : "");
  return buf;
}

double stored_bytes(const Matrix& w) {
  const double n = double(w.rows) * double(w.cols);
  const QuantFormat& q = w.quant;
  if (!q.bits) return n * double(dtype_size(w.dtype));
  switch (q.scheme) {
    case QuantScheme::Mxfp4: return n / 2 + n / 32;
    case QuantScheme::Fp8: return n + double(w.rows) * double((w.cols + q.group_size - 1) / q.group_size) * 4;
    case QuantScheme::Affine: return n * q.bits / 8 + n / q.group_size * 2 * double(dtype_size(q.scale_dtype));
  }
  return 0;
}

}  // namespace moestream::cuda
