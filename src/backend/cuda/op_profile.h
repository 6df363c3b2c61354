// A profile of GPU time by operation (MOESTREAM_CUDA_PROFILE=1): every backend operation, and each
// step of the MoE layer, is bracketed by two CUDA events on the compute stream; at exit the times
// are summed per label and printed to stderr, the slowest first, with the bytes of weights each
// read per second where the label has them. The first call of each label is shown apart and left
// out of the averages: it carries one-time costs (cuBLAS handles, lazy loading of kernels, the
// first touch of a buffer). Decode-step graphs are off while it runs (events
// between kernels cost ~1 us of GPU time each), so the total is a little above an unprofiled run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace moestream::cuda {

class OpProfile {
 public:
  OpProfile();  // on when MOESTREAM_CUDA_PROFILE is set and not "0"
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  bool on() const { return on_; }
  // Marks the start of the next operation on `stream`.
  void begin(cudaStream_t stream);
  // Ends the operation begun last; `bytes`: weight bytes it reads (0 if none are counted).
  void end(cudaStream_t stream, const std::string& label, double bytes = 0);
  // Prints the table (called by the destructor too; a second call prints nothing new).
  void report();

 private:
  struct Pending {
    cudaEvent_t start, stop;
    std::string label;
    double bytes;
  };
  struct Sum {
    uint64_t calls = 0;     // after the first
    double ms = 0, bytes = 0;
    double first_ms = -1;   // the first call's time
  };
  cudaEvent_t event();
  void harvest();  // waits for the pending events and adds their times

  bool on_ = false;
  cudaEvent_t open_ = nullptr;
  std::vector<cudaEvent_t> free_;
  std::vector<Pending> pending_;
  std::map<std::string, Sum> sums_;
};

inline std::string op_label(const char* what, int64_t tokens) { return std::string(what) + " T=" + std::to_string(tokens); }
// "<what> [rows x cols <format>] T=<tokens>": the label of an operation that reads weight w.
std::string weight_label(const char* what, const Matrix& w, int64_t tokens);
// "<what> [rows x cols] x <n> experts[, one-token kernel]".
std::string experts_label(const char* what, int64_t rows, int64_t cols, int n_experts, bool one_token);
// The bytes of w's codes, scales and biases as stored.
double stored_bytes(const Matrix& w);

}  // namespace moestream::cuda
