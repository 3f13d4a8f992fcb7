// NumPy .npy files (format versions 1.0-3.0, little-endian float32/float64,
// C order) for exchanging tensors with any other implementation. Malformed
// files raise IoError naming the file and what is wrong; never a crash.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "kdacp/tensor.hpp"

namespace kdacp {

struct NpyArray {
  DType dtype = DType::f32;
  std::vector<std::size_t> shape;
  std::vector<std::byte> data;  // C order, little-endian

  std::size_t elements() const;
  // Float32 copy of the data; float64 is converted only when asked.
  std::vector<float> to_f32(bool allow_f64) const;
};

NpyArray read_npy(const std::string& path);
void write_npy(const std::string& path, const float* data, const std::vector<std::size_t>& shape);
void write_npy(const std::string& path, const double* data, const std::vector<std::size_t>& shape);

}  // namespace kdacp
