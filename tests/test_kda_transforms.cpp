// chunk_kda's in-kernel transforms (kdacp/kda.hpp): values against direct
// formulas, backward against central differences, finiteness over the whole
// finite domain, and the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/kda.hpp"

namespace kdacp::kda {
namespace {

constexpr std::size_t kTokens = 3, kHeads = 2, kDim = 3;

std::vector<double> ramp(std::size_t n, double a, double b) {
  std::vector<double> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = a + b * std::sin(1.7 * static_cast<double>(i) + 0.3);
  return x;
}

// Σ w · gate(raw, a_log, dt_bias) for the finite differences.
double weighted_gate(const std::vector<double>& raw, const std::vector<double>& a_log,
                     const std::vector<double>& bias, const std::vector<double>& w, bool lower) {
  GateParams<double> p{a_log.data(), bias.data(), lower, -3.0};
  std::vector<double> g(raw.size());
  gate_forward(raw.data(), p, kTokens, kHeads, kDim, g.data());
  double s = 0;
  for (std::size_t i = 0; i < g.size(); ++i) s += w[i] * g[i];
  return s;
}

TEST(KdaTransforms, GateValuesAndGradients) {
  const auto raw = ramp(kTokens * kHeads * kDim, 0.1, 2.0);
  const auto a_log = ramp(kHeads, -0.2, 0.5);
  const auto bias = ramp(kHeads * kDim, 0.0, 1.0);
  const auto w = ramp(raw.size(), 0.3, 1.0);
  for (bool lower : {false, true}) {
    GateParams<double> p{a_log.data(), bias.data(), lower, -3.0};
    std::vector<double> g(raw.size());
    gate_forward(raw.data(), p, kTokens, kHeads, kDim, g.data());
    for (std::size_t t = 0; t < kTokens; ++t)
      for (std::size_t h = 0; h < kHeads; ++h)
        for (std::size_t k = 0; k < kDim; ++k) {
          const std::size_t i = (t * kHeads + h) * kDim + k;
          const double z = raw[i] + bias[h * kDim + k], e = std::exp(a_log[h]);
          const double want = lower ? -3.0 / (1.0 + std::exp(-e * z)) : -e * std::log1p(std::exp(z));
          EXPECT_NEAR(g[i], want, 1e-14);
        }
    std::vector<double> d_raw(raw.size()), d_a(kHeads), d_b(kHeads * kDim);
    gate_backward(raw.data(), p, kTokens, kHeads, kDim, w.data(), d_raw.data(), d_a.data(), d_b.data());
    const double h = 1e-6;
    for (std::size_t i = 0; i < raw.size(); ++i) {
      auto up = raw, down = raw;
      up[i] += h;
      down[i] -= h;
      EXPECT_NEAR(d_raw[i], (weighted_gate(up, a_log, bias, w, lower) - weighted_gate(down, a_log, bias, w, lower)) / (2 * h), 1e-7);
    }
    for (std::size_t i = 0; i < kHeads; ++i) {
      auto up = a_log, down = a_log;
      up[i] += h;
      down[i] -= h;
      EXPECT_NEAR(d_a[i], (weighted_gate(raw, up, bias, w, lower) - weighted_gate(raw, down, bias, w, lower)) / (2 * h), 1e-7);
    }
    for (std::size_t i = 0; i < bias.size(); ++i) {
      auto up = bias, down = bias;
      up[i] += h;
      down[i] -= h;
      EXPECT_NEAR(d_b[i], (weighted_gate(raw, a_log, up, w, lower) - weighted_gate(raw, a_log, down, w, lower)) / (2 * h), 1e-7);
    }
  }
}

template <class T>
void extreme_gates_are_finite() {
  const T big = std::numeric_limits<T>::max() / 2;
  const std::vector<T> raw{big, -big, 0, T(1), big, -big};
  const std::vector<T> bias{big, -big, big};
  const std::vector<T> a_log{T(20)};
  const std::vector<T> dy(raw.size(), T(1));
  for (bool lower : {false, true}) {
    GateParams<T> p{a_log.data(), lower ? bias.data() : nullptr, lower, -5.0};
    std::vector<T> raw_used = raw;
    if (!lower) raw_used = {-big, -big, 0, T(1), -big, T(-1)};  // softplus: the representable side
    std::vector<T> g(raw.size()), d_raw(raw.size()), d_a(1), d_b(3);
    gate_forward(raw_used.data(), p, 2, 1, 3, g.data());
    gate_backward(raw_used.data(), p, 2, 1, 3, dy.data(), d_raw.data(), d_a.data(), d_b.data());
    for (T x : g) EXPECT_TRUE(std::isfinite(x) && x <= 0);
    for (T x : d_raw) EXPECT_TRUE(std::isfinite(x));
    EXPECT_TRUE(std::isfinite(d_a[0]));
    if (lower) {
      for (T x : d_b) EXPECT_TRUE(std::isfinite(x));
    }
  }
  // A gate beyond T's range is named, never an infinity.
  GateParams<T> p{a_log.data(), nullptr, false, 0};
  std::vector<T> g(raw.size());
  EXPECT_THROW(gate_forward(raw.data(), p, 2, 1, 3, g.data()), InvalidArgument);
  // l2norm and sigmoid at the extremes.
  const std::vector<T> x{big, -big, big, T(0), T(0), T(0)};
  std::vector<T> y(6), rstd(2), dx(6);
  l2norm_forward(x.data(), 2, 3, y.data(), rstd.data());
  l2norm_backward(y.data(), rstd.data(), dy.data(), 2, 3, dx.data());
  for (std::size_t i = 0; i < 6; ++i) EXPECT_TRUE(std::isfinite(y[i]) && std::isfinite(dx[i]));
  EXPECT_NEAR(static_cast<double>(y[0]), 1 / std::sqrt(3.0), 1e-6);
  std::vector<T> s(6);
  sigmoid_forward(x.data(), 6, s.data());
  sigmoid_backward(x.data(), dy.data(), 6, dx.data());
  EXPECT_EQ(s[0], T(1));
  EXPECT_EQ(s[1], T(0));
  EXPECT_EQ(dx[3], T(0.25));
  for (T v : dx) EXPECT_TRUE(std::isfinite(v));
}

TEST(KdaTransforms, ExtremesFloat) { extreme_gates_are_finite<float>(); }
TEST(KdaTransforms, ExtremesDouble) { extreme_gates_are_finite<double>(); }

TEST(KdaTransforms, Errors) {
  const std::vector<double> raw{1, 2, std::nan("")}, a_log{800};
  std::vector<double> g(3);
  EXPECT_THROW(gate_forward(raw.data(), GateParams<double>{}, 1, 1, 3, g.data()), InvalidArgument);
  const std::vector<double> ok{1, 2, 3};
  EXPECT_THROW(gate_forward(ok.data(), GateParams<double>{a_log.data()}, 1, 1, 3, g.data()), InvalidArgument);
  EXPECT_THROW(gate_forward(ok.data(), GateParams<double>{nullptr, nullptr, true, 0.5}, 1, 1, 3, g.data()),
               InvalidArgument);
  std::vector<double> y(3), r(1);
  EXPECT_THROW(l2norm_forward(raw.data(), 1, 3, y.data(), r.data()), InvalidArgument);
}

}  // namespace
}  // namespace kdacp::kda
