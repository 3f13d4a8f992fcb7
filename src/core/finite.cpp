#include "kdacp/finite.hpp"

#include <charconv>
#include <cmath>
#include <cstring>
#include <sstream>

#include "kdacp/error.hpp"

namespace kdacp {
namespace {

template <class T>
std::string shortest(T x) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  return ec == std::errc{} ? std::string(buf, end) : std::string("?");
}

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

// Element i of the array as T; the bytes of an NpyArray carry no alignment
// promise, and a copy of a large input just to check it would double its memory.
template <class T>
T element(const NpyArray& a, std::size_t i) {
  T x;
  std::memcpy(&x, a.data.data() + i * sizeof(T), sizeof(T));
  return x;
}

template <class T>
void check(const NpyArray& a, const std::string& name, bool bounded, double lo, double hi,
           const std::string& domain) {
  const std::size_t n = a.elements();
  for (std::size_t i = 0; i < n; ++i) {
    const T x = element<T>(a, i);
    const bool finite = std::isfinite(x);
    if (finite && (!bounded || (x >= lo && x <= hi))) continue;
    std::ostringstream os;
    os << name << ": element " << index_string(i, a.shape) << " is " << shortest(x) << ", expected "
       << (finite ? domain : std::string("finite values"));
    throw InvalidArgument(os.str());
  }
}

void dispatch(const NpyArray& a, const std::string& name, bool bounded, double lo, double hi,
              const std::string& domain) {
  if (a.dtype == DType::f64) check<double>(a, name, bounded, lo, hi, domain);
  else check<float>(a, name, bounded, lo, hi, domain);
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
  std::string s = "[";
  for (std::size_t d = 0; d < idx.size(); ++d) {
    if (d) s += ',';
    s += std::to_string(idx[d]);
  }
  return s + "]";
}

void require_finite(const NpyArray& a, const std::string& name) { dispatch(a, name, false, 0, 0, ""); }

void require_within(const NpyArray& a, const std::string& name, double lo, double hi, const std::string& domain) {
  dispatch(a, name, true, lo, hi, domain);
}

}  // namespace kdacp
