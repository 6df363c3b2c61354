// Wall time per phase of a forward pass, for --timing. Phases are accumulated by whoever runs
// them (model code, backend, generation loop); ScopedTimer adds the time of a scope.
#pragma once

#include <chrono>

namespace moestream {

struct PhaseTimes {
  double embed = 0, attention = 0, routing = 0, expert_compute = 0, expert_wait = 0,
         dense_mlp = 0, output_head = 0, sampling = 0;
};

class ScopedTimer {
 public:
  explicit ScopedTimer(double& into) : into_(into), start_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() {
    into_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  ScopedTimer(const ScopedTimer&) = delete;
  ScopedTimer& operator=(const ScopedTimer&) = delete;

 private:
  double& into_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace moestream
