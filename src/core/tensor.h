// A typed, shaped view of bytes owned elsewhere (a memory-mapped file, an arena).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace moestream {

struct TensorView {
  std::string name;            // checkpoint name, for error messages
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // row-major, outermost first
  const void* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  template <class T>
  const T* as() const { return static_cast<const T*>(data); }
};

std::string shape_str(const std::vector<int64_t>& shape);  // "[4, 64]"

// Throws Error naming the tensor when dtype or shape differ from what the caller expects.
void check_tensor(const TensorView& t, DType dtype, const std::vector<int64_t>& shape);
void check_shape(const TensorView& t, const std::vector<int64_t>& shape);

}  // namespace moestream
