#include "kdacp/finite.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/error.hpp"

namespace kdacp {
namespace {

template <class T>
std::optional<std::size_t> first_non_finite(std::span<const T> data) {
  for (std::size_t i = 0; i < data.size(); ++i)
    if (!std::isfinite(data[i])) return i;
  return std::nullopt;
}

template <class T>
std::optional<std::size_t> first_outside(std::span<const T> data, double lo, double hi) {
  for (std::size_t i = 0; i < data.size(); ++i)
    if (!(data[i] >= lo && data[i] <= hi)) return i;
  return std::nullopt;
}

template <class T>
std::string shortest(T x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  return ec == std::errc() ? std::string(buf, end) : std::string("?");
}

template <class T>
bool block_ok(const T* x, std::size_t n, bool bounded, double lo, double hi) {
  int ok = 1;
  if (bounded) {
    for (std::size_t i = 0; i < n; ++i) ok &= (double(x[i]) >= lo) & (double(x[i]) <= hi);
  } else {
    for (std::size_t i = 0; i < n; ++i) ok &= (x[i] - x[i] == T(0));
  }
  return ok != 0;
}

template <class T>
void check(const TensorRef& t, bool bounded, double lo, double hi, const std::string& rule) {
  constexpr std::size_t kBlock = 1024;
  T block[kBlock];
  const std::size_t n = t.elements();
  for (std::size_t start = 0; start < n; start += kBlock) {
    const std::size_t len = std::min(kBlock, n - start);
    // A copy per block: the bytes carry no alignment promise.
    std::memcpy(block, static_cast<const std::byte*>(t.data) + start * sizeof(T), len * sizeof(T));
    if (block_ok(block, len, bounded, lo, hi)) continue;
    for (std::size_t i = 0; i < len; ++i) {
      const T x = block[i];
      const bool finite = std::isfinite(x);
      if (finite && (!bounded || (x >= lo && x <= hi))) continue;
      throw InvalidArgument(t.name + ": element " + index_string(start + i, t.shape) + " is " + shortest(x) +
                            ", expected " + (finite ? rule : std::string("finite values")));
    }
  }
}

void dispatch(const TensorRef& t, bool bounded, double lo, double hi, const std::string& rule) {
  if (t.elements() != 0 && t.data == nullptr)
    throw InvalidArgument(fmt::format("{}: no data for {} elements", t.name, t.elements()));
  if (t.dtype == DType::f64)
    check<double>(t, bounded, lo, hi, rule);
  else
    check<float>(t, bounded, lo, hi, rule);
}

template <class T>
TensorRef make_ref(std::string name, std::vector<std::size_t> shape, std::span<const T> data) {
  TensorRef t{std::move(name), std::move(shape), data.data(), std::is_same_v<T, double> ? DType::f64 : DType::f32};
  if (t.elements() != data.size())
    throw InvalidArgument(
        fmt::format("{}: {} elements for a shape of {}", t.name, data.size(), t.elements()));
  return t;
}

}  // namespace

std::optional<std::size_t> find_non_finite(std::span<const float> d) { return first_non_finite(d); }
std::optional<std::size_t> find_non_finite(std::span<const double> d) { return first_non_finite(d); }
std::optional<std::size_t> find_outside(std::span<const float> d, double lo, double hi) {
  return first_outside(d, lo, hi);
}
std::optional<std::size_t> find_outside(std::span<const double> d, double lo, double hi) {
  return first_outside(d, lo, hi);
}

std::string exact_string(float x) { return shortest(x); }
std::string exact_string(double x) { return shortest(x); }

std::string index_string(std::size_t flat, const std::vector<std::size_t>& shape) {
  std::vector<std::size_t> idx(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    const std::size_t n = shape[d] ? shape[d] : 1;
    idx[d] = flat % n;
    flat /= n;
  }
  return fmt::format("[{}]", fmt::join(idx, ","));
}

std::size_t TensorRef::elements() const {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}

TensorRef tensor_ref(std::string name, std::vector<std::size_t> shape, std::span<const float> data) {
  return make_ref(std::move(name), std::move(shape), data);
}
TensorRef tensor_ref(std::string name, std::vector<std::size_t> shape, std::span<const double> data) {
  return make_ref(std::move(name), std::move(shape), data);
}
TensorRef tensor_ref(const NpyArray& a, std::string name) {
  return TensorRef{std::move(name), a.shape, a.data.data(), a.dtype};
}

void require_finite(const TensorRef& t) { dispatch(t, false, 0, 0, ""); }

void require_within(const TensorRef& t, double lo, double hi, const std::string& rule) {
  dispatch(t, true, lo, hi, rule);
}

void require_kda_gate(const TensorRef& g) {
  require_within(g, -std::numeric_limits<double>::max(), 0, "g <= 0 (the log of a decay in (0, 1])");
}

void require_kda_beta(const TensorRef& beta) { require_within(beta, 0, 1, "beta in [0, 1]"); }

void require_finite(const NpyArray& a, const std::string& name) { require_finite(tensor_ref(a, name)); }

void require_within(const NpyArray& a, const std::string& name, double lo, double hi, const std::string& rule) {
  require_within(tensor_ref(a, name), lo, hi, rule);
}

}  // namespace kdacp
