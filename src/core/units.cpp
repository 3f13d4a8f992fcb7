#include "kdacp/units.hpp"

#include <charconv>
#include <cmath>
#include <sstream>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/error.hpp"

namespace kdacp {
namespace {

using Units = std::vector<std::pair<std::string_view, double>>;

[[noreturn]] void reject(std::string_view what, std::string_view text, const std::string& expected) {
  throw InvalidArgument(fmt::format("{} is '{}', expected {}", what, text, expected));
}

std::string number(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// Splits the leading real of `text` from the rest; false when there is none.
// Overflow reads as infinity, which every caller rejects.
bool split_real(std::string_view text, double& value, std::string_view& rest) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec == std::errc::result_out_of_range) {
    value = std::numeric_limits<double>::infinity();
  } else if (ec != std::errc()) {
    return false;
  }
  rest = std::string_view(ptr, static_cast<std::size_t>(end - ptr));
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  return true;
}

double parse_with_unit(std::string_view text, const Units& units, std::string_view what, double max) {
  std::vector<std::string_view> names;
  for (const auto& unit : units) names.push_back(unit.first.empty() ? "none" : unit.first);
  const std::string expected =
      fmt::format("a positive number up to {} with a unit among: {}", number(max), fmt::join(names, ", "));
  double value = 0;
  std::string_view unit;
  if (!split_real(text, value, unit)) reject(what, text, expected);
  for (const auto& [name, scale] : units) {
    if (name != unit) continue;
    const double x = value * scale;
    if (!std::isfinite(x) || !(x > 0) || x > max) reject(what, text, expected);
    return x;
  }
  reject(what, text, expected);
}

}  // namespace

std::string describe(const IntRange& r) {
  std::string s = fmt::format("an integer in [{}, {}]", r.min, r.max);
  if (r.multiple > 1) s += fmt::format(" that is a multiple of {}", r.multiple);
  return s;
}

std::string describe(const RealRange& r) {
  std::string s = "a finite number " + std::string(r.min_exclusive ? "> " : ">= ") + number(r.min);
  if (r.max < std::numeric_limits<double>::max()) s += " and <= " + number(r.max);
  return s;
}

std::uint64_t parse_integer(std::string_view text, const IntRange& range, std::string_view what) {
  std::uint64_t value = 0;
  const char* end = text.data() + text.size();
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string_view::npos;
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (!digits || ec != std::errc() || ptr != end || value < range.min || value > range.max ||
      value % range.multiple != 0)
    reject(what, text, describe(range));
  return value;
}

double parse_real(std::string_view text, const RealRange& range, std::string_view what) {
  double value = 0;
  std::string_view rest;
  if (!split_real(text, value, rest) || !rest.empty() || !std::isfinite(value) || value > range.max ||
      (range.min_exclusive ? !(value > range.min) : !(value >= range.min)))
    reject(what, text, describe(range));
  return value;
}

double parse_seconds(std::string_view text, std::string_view what) {
  static const Units units{{"", 1}, {"s", 1}, {"ms", 1e-3}, {"us", 1e-6}, {"µs", 1e-6}, {"ns", 1e-9}};
  return parse_with_unit(text, units, what, kMaxTimeoutSeconds);
}

double parse_rate(std::string_view text, std::string_view what) {
  static const Units units{{"", 1},         {"B/s", 1},           {"KB/s", 1e3},
                           {"MB/s", 1e6},   {"GB/s", 1e9},        {"TB/s", 1e12},
                           {"KiB/s", 1024.0}, {"MiB/s", 1048576.0}, {"GiB/s", 1073741824.0},
                           {"Gb/s", 1e9 / 8}};
  return parse_with_unit(text, units, what, std::numeric_limits<double>::max());
}

std::size_t parse_bytes(std::string_view text, std::string_view what) {
  static const Units units{{"", 1},     {"B", 1},       {"KB", 1e3},         {"MB", 1e6},
                           {"GB", 1e9}, {"TB", 1e12},   {"KiB", 1024.0},     {"MiB", 1048576.0},
                           {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  // 2^63: every larger value is no budget a machine has, and the cast stays defined.
  const double x = parse_with_unit(text, units, what, 9223372036854775808.0);
  // A positive fraction of a byte would truncate to 0, which budgets read as
  // "unlimited": refuse it rather than change its meaning.
  if (x < 1) reject(what, text, "a size of at least 1 byte");
  return static_cast<std::size_t>(x);
}

}  // namespace kdacp
