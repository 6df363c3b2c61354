#include "core/tensor.h"

#include "core/error.h"

namespace moestream {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

void check_shape(const TensorView& t, const std::vector<int64_t>& shape) {
  if (t.shape != shape)
    fail("tensor ", t.name, ": expected shape ", shape_str(shape), ", found ", shape_str(t.shape));
}

void check_tensor(const TensorView& t, DType dtype, const std::vector<int64_t>& shape) {
  if (t.dtype != dtype)
    fail("tensor ", t.name, ": expected dtype ", dtype_name(dtype), ", found ", dtype_name(t.dtype));
  check_shape(t, shape);
}

}  // namespace moestream
