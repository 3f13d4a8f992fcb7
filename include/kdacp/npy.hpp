// NumPy .npy files (format versions 1.0-3.0, little-endian float32/float64,
// C order) for exchanging tensors with any other implementation. Malformed
// files raise IoError naming the file and what is wrong; never a crash.
#pragma once

#include <cstddef>
#include <span>
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

// Throws IoError naming `path` unless it is a regular file (or a link to
// one): checked with stat before any open, so that a FIFO, a device or a
// directory is refused with a message instead of blocking the reader.
void require_regular_file(const std::string& path);

// Reads a whole file (require_regular_file first). The header's shape is checked against the file's size
// before anything is allocated: a truncated file, or bytes after the data,
// raise IoError naming the file, the shape and both sizes.
NpyArray read_npy(const std::string& path);
// The same from memory; `name` stands for the path in messages.
NpyArray parse_npy(std::span<const std::byte> bytes, const std::string& name);
void write_npy(const std::string& path, const float* data, const std::vector<std::size_t>& shape);
void write_npy(const std::string& path, const double* data, const std::vector<std::size_t>& shape);

}  // namespace kdacp
