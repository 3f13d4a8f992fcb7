// NumPy .npy files (format versions 1.0-3.0, little-endian float16/float32/
// float64, C order) for exchanging tensors with any other implementation.
// Malformed files raise IoError naming the file and what is wrong; never a
// crash. A float16 file is widened to float32 once, as it is read (kdacp
// computes in float32 and stores 16-bit types only at the edges); NumPy has
// no bfloat16, so .npy files carry no bfloat16 (kdacp.torch takes it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdacp/half.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp {

struct NpyArray {
  DType dtype = DType::f32;  // of `data`
  std::vector<std::size_t> shape;
  std::vector<std::byte> data;  // C order, little-endian
  // Half::f16 when the file held float16 ('<f2'): `data` is then its exact
  // float32 widening (dtype f32). nullopt for float32/float64 files.
  std::optional<Half> half;

  std::size_t elements() const;
  // The file's element type: "float16", "float32" or "float64".
  std::string file_dtype() const;
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
// A float16 file ('<f2') of raw binary16 values (float_to_f16's bits).
void write_npy_f16(const std::string& path, const std::uint16_t* bits, const std::vector<std::size_t>& shape);

}  // namespace kdacp
