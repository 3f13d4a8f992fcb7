// Checks of input data before a run: a NaN or an infinity in a summary or a
// layer input would otherwise flow through every rank's result (and a report
// that takes the max of errors would not show it).
//
// One validator for every front end: the CLI (.npy files, through the
// NpyArray overloads) and kdacp.torch (tensor memory, through the binding)
// check the same rules with the same messages, "<name>: element <[i,j,..]>
// is <value>, expected <rule>", the value printed exactly (the shortest text
// that reads back as the same float or double: 1.0000001, not 1).
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kdacp/npy.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp {

// Index of the first NaN or ±Inf, or nullopt.
std::optional<std::size_t> find_non_finite(std::span<const float> data);
std::optional<std::size_t> find_non_finite(std::span<const double> data);

// Index of the first element outside [lo, hi] (NaN included), or nullopt.
std::optional<std::size_t> find_outside(std::span<const float> data, double lo, double hi);
std::optional<std::size_t> find_outside(std::span<const double> data, double lo, double hi);

// The shortest text that reads back as exactly `x` in its own type
// (std::to_chars): 1.0000001f is "1.0000001", not "1"; "inf", "-inf", "nan".
std::string exact_string(float x);
std::string exact_string(double x);

// "[1,0,3]": the C-order multi-index of flat index `flat` in `shape`.
std::string index_string(std::size_t flat, const std::vector<std::size_t>& shape);

// A tensor to check: its name in messages, its C-order shape and its
// prod(shape) elements of `dtype`, contiguous (no alignment promised).
struct TensorRef {
  std::string name;
  std::vector<std::size_t> shape;
  const void* data = nullptr;
  DType dtype = DType::f32;

  std::size_t elements() const;
};

// Typed spans as TensorRef; throws InvalidArgument when data.size() is not
// the product of shape.
TensorRef tensor_ref(std::string name, std::vector<std::size_t> shape, std::span<const float> data);
TensorRef tensor_ref(std::string name, std::vector<std::size_t> shape, std::span<const double> data);
TensorRef tensor_ref(const NpyArray& array, std::string name);

// Throws InvalidArgument naming the tensor, the first offending index, its
// exact value and the rule when the tensor holds a non-finite value, or (for
// require_within) a value outside [lo, hi]; `rule` says what holds ("beta in
// [0, 1]"). A non-finite value is reported as such ("expected finite values").
void require_finite(const TensorRef& tensor);
void require_within(const TensorRef& tensor, double lo, double hi, const std::string& rule);

// The rules of a KDA layer's inputs (SPEC §9), for every front end:
// q, k, v, h0 and the incoming gradients finite (require_finite); the log
// decay g finite and <= 0; beta in [0, 1].
void require_kda_gate(const TensorRef& g);
void require_kda_beta(const TensorRef& beta);

// The same on a whole .npy array, named `name`.
void require_finite(const NpyArray& array, const std::string& name);
void require_within(const NpyArray& array, const std::string& name, double lo, double hi,
                    const std::string& rule);

}  // namespace kdacp
