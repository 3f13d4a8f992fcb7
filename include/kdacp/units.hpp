// Numbers and quantities from text (command-line flags, config values): one
// place that range-checks them, so that no caller converts an unchecked
// string. Integers are plain decimal digits (no sign, no exponent), so "-16"
// can never wrap to 2^64 - 16; reals must be finite; a quantity with a unit
// ("5us", "50GB/s", "2GiB") must be positive and, for bytes, fit in size_t.
// Bad text throws InvalidArgument "<what> is '<text>', expected <limits>".
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

namespace kdacp {

// An integer in [min, max] that is a multiple of `multiple`.
struct IntRange {
  std::uint64_t min = 0;
  std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t multiple = 1;
};

// A finite real in [min, max], or (min, max] when min_exclusive.
struct RealRange {
  double min = 0;
  double max = std::numeric_limits<double>::max();
  bool min_exclusive = false;
};

// "an integer in [1, 256]", "an integer in [0, 64] that is a multiple of 8", "a finite
// number > 0".
std::string describe(const IntRange& range);
std::string describe(const RealRange& range);

std::uint64_t parse_integer(std::string_view text, const IntRange& range, std::string_view what);
double parse_real(std::string_view text, const RealRange& range, std::string_view what);

// Longest wait a timeout may ask for (one day): larger values are refused
// rather than overflowing a millisecond count.
inline constexpr double kMaxTimeoutSeconds = 86400;
inline constexpr RealRange kTimeoutRange{0, kMaxTimeoutSeconds, true};

// Worker threads per rank a caller may ask for (the CLI's --threads, the
// Python package's threads=); 0: the default.
inline constexpr IntRange kThreadsRange{0, 1024};

// Quantities with a unit; decimal and binary prefixes mean what they say and
// a bare number is in the base unit. Each is positive and finite.
double parse_seconds(std::string_view text, std::string_view what);  // s, ms, us, µs, ns
double parse_rate(std::string_view text, std::string_view what);     // bytes per second
std::size_t parse_bytes(std::string_view text, std::string_view what);

}  // namespace kdacp
