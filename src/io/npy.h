// NumPy .npy files of float arrays: how logits and activations are compared with reference
// outputs that numpy wrote.
//
// Layout: "\x93NUMPY", version (1.0 here; 2.0 and 3.0 are read too), header length (u16 LE for
// 1.0, u32 LE for 2.0/3.0), a Python dict literal
// {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } padded with spaces and ending in
// '\n' so the data starts at a multiple of 64 bytes, then the elements in C order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moestream {

// Writes a version 1.0 '<f4' C-order array to path + ".tmp-<pid>", then renames it into place.
// numel(shape) floats are read from data; shape {} is a scalar.
void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;  // C order; '<f8' input is rounded to float
};

// Reads a C-order '<f4' or '<f8' array; any other dtype, Fortran order, a malformed header or a
// data size that does not match the shape is an Error naming the file.
NpyArray read_npy_f32(const std::string& path);

}  // namespace moestream
