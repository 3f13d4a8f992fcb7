// Shared by the KDA math tests: random inputs of the shape the layer sees,
// the relative error they compare with, and central finite differences.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "kdacp/kda.hpp"

namespace kdacp::kda::test {

inline std::vector<double> uniform(std::size_t n, double lo, double hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> x(n);
  for (auto& e : x) e = dist(rng);
  return x;
}

// n values ∈ U(lo, hi) as T, from their own seed.
template <class T>
std::vector<T> filled(std::size_t n, double lo, double hi, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<double> x = uniform(n, lo, hi, rng);
  return std::vector<T>(x.begin(), x.end());
}

// q, v ∈ U(-1, 1), k L2-normalised per token and head, g = log U(0.9, 1),
// β ∈ U(0.1, 0.9): contractive transfers, drawn in this order from rng.
struct RandomInputs {
  std::vector<double> q, k, v, g, beta;
};
inline RandomInputs random_inputs(const Shape& s, std::mt19937_64& rng) {
  RandomInputs in;
  in.q = uniform(s.qk_elems(), -1, 1, rng);
  in.k = uniform(s.qk_elems(), -1, 1, rng);
  for (std::size_t r = 0; r < s.qk_elems(); r += s.key_dim) {
    double norm = 0;
    for (std::size_t i = 0; i < s.key_dim; ++i) norm += in.k[r + i] * in.k[r + i];
    for (std::size_t i = 0; i < s.key_dim; ++i) in.k[r + i] /= std::sqrt(norm);
  }
  in.v = uniform(s.v_elems(), -1, 1, rng);
  in.g = uniform(s.g_elems(), 0.9, 1.0, rng);
  for (auto& e : in.g) e = std::log(e);
  in.beta = uniform(s.beta_elems(), 0.1, 0.9, rng);
  return in;
}

// max |got - want| / max |want|: an error relative to the tensor's scale, so
// entries that happen to be near zero do not dominate.
template <class T, class U>
double rel_error(const std::vector<T>& got, const std::vector<U>& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])));
    ref = std::max(ref, std::abs(static_cast<double>(want[i])));
  }
  return ref > 0 ? diff / ref : diff;
}

// rel_error of `analytic` against central differences of `loss` in the
// entries of x (restored afterwards): all of them when samples is 0 or at
// least x.size(), otherwise `samples` drawn with rng.
inline double finite_difference_error(std::vector<double>& x, const std::vector<double>& analytic,
                                      std::size_t samples, std::mt19937_64& rng,
                                      const std::function<double()>& loss) {
  std::vector<std::size_t> idx(x.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  if (samples != 0 && samples < idx.size()) {
    std::shuffle(idx.begin(), idx.end(), rng);
    idx.resize(samples);
  }
  std::vector<double> numeric, want;
  constexpr double kStep = 1e-6;
  for (std::size_t i : idx) {
    const double saved = x[i];
    x[i] = saved + kStep;
    const double up = loss();
    x[i] = saved - kStep;
    const double down = loss();
    x[i] = saved;
    numeric.push_back((up - down) / (2 * kStep));
    want.push_back(analytic[i]);
  }
  return rel_error(want, numeric);
}

}  // namespace kdacp::kda::test
