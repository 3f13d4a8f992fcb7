// Checks of input data before a run: a NaN or an infinity in a summary or a
// layer input would otherwise flow through every rank's result (and a report
// that takes the max of errors would not show it).
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdacp/npy.hpp"

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

// Throws InvalidArgument naming `name`, the first offending index and value
// when the array holds a non-finite value, or (for require_within) a value
// outside [lo, hi]; `domain` says why the range holds.
void require_finite(const NpyArray& array, const std::string& name);
void require_within(const NpyArray& array, const std::string& name, double lo, double hi,
                    const std::string& domain);

}  // namespace kdacp
