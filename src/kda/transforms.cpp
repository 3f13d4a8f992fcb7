// The input transforms of chunk_kda's in-kernel flags (kdacp/kda.hpp): the
// gate, the q/k l2norm and the beta sigmoid, forward and reverse. One pass
// each over contiguous memory; intermediates in double (exact forms of
// softplus and sigmoid for every finite argument), results rounded once.
#include <cmath>
#include <cstddef>
#include <limits>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/kda.hpp"

namespace kdacp::kda {
namespace {

// log(1 + e^x) without overflow or cancellation: max(x, 0) + log1p(e^-|x|).
double softplus(double x) { return std::fmax(x, 0.0) + std::log1p(std::exp(-std::fabs(x))); }

// 1 / (1 + e^-x), from e^-|x| ∈ (0, 1]: never exp of a large positive value.
double sigmoid(double x) {
  const double a = std::exp(-std::fabs(x));
  return x >= 0 ? 1.0 / (1.0 + a) : a / (1.0 + a);
}

// sigmoid'(x) = s (1 - s) = e^-|x| / (1 + e^-|x|)², which is 0 (never NaN) at ±inf.
double sigmoid_slope(double x) {
  const double a = std::exp(-std::fabs(x));
  return a / ((1.0 + a) * (1.0 + a));
}

template <class T>
const char* type_name() {
  return sizeof(T) == 8 ? "float64" : "float32";
}

template <class T>
void require_finite(const T* x, std::size_t n, std::string_view what, std::string_view op) {
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      throw InvalidArgument(fmt::format("{}: {} element {} is {}, expected a finite value", op, what, i,
                                        static_cast<double>(x[i])));
}

void require_pointer(const void* p, std::string_view what, std::string_view op) {
  if (p == nullptr) throw InvalidArgument(fmt::format("{}: {} is null, expected its tensor", op, what));
}

// exp(A_log[h]) per head (1 without A_log), finite or InvalidArgument.
template <class T>
std::vector<double> decay_scales(const GateParams<T>& p, std::size_t heads, std::string_view op) {
  std::vector<double> e(heads, 1.0);
  if (p.a_log == nullptr) return e;
  require_finite(p.a_log, heads, "A_log", op);
  for (std::size_t h = 0; h < heads; ++h) {
    e[h] = std::exp(static_cast<double>(p.a_log[h]));
    if (!std::isfinite(e[h]) || e[h] > static_cast<double>(std::numeric_limits<T>::max()))
      throw InvalidArgument(fmt::format("{}: A_log[{}] = {}: exp(A_log) is beyond {}'s range", op, h,
                                        static_cast<double>(p.a_log[h]), type_name<T>()));
  }
  return e;
}

// One element's gate input: its dt_bias (0 without), z = g + dt_bias, and
// the lower-bound form's sigmoid argument x = exp(A_log)·z (0 at z = 0).
struct GateInput {
  double bias, z, x;
};

template <class T>
GateInput gate_input(T raw, const GateParams<T>& p, std::size_t bias_index, double scale) {
  const double bias = p.dt_bias ? static_cast<double>(p.dt_bias[bias_index]) : 0.0;
  const double z = static_cast<double>(raw) + bias;
  return {bias, z, z == 0 ? 0.0 : scale * z};
}

template <class T>
void check_gate(const T* raw, const GateParams<T>& p, std::size_t tokens, std::size_t heads,
                std::size_t key_dim, std::string_view op) {
  require_pointer(raw, "g", op);
  if (heads == 0 || key_dim == 0)
    throw InvalidArgument(fmt::format("{}: {} heads of dimension {}, expected both >= 1", op, heads, key_dim));
  if (p.use_lower_bound && !(std::isfinite(p.lower_bound) && p.lower_bound < 0))
    throw InvalidArgument(
        fmt::format("{}: lower_bound = {}, expected a finite value < 0", op, p.lower_bound));
  require_finite(raw, tokens * heads * key_dim, "g", op);
  if (p.dt_bias) require_finite(p.dt_bias, heads * key_dim, "dt_bias", op);
}

}  // namespace

template <class T>
void gate_forward(const Elem<T>* raw, const GateParams<T>& p, std::size_t tokens, std::size_t heads,
                  std::size_t key_dim, Elem<T>* g) {
  constexpr std::string_view op = "kda gate";
  check_gate(raw, p, tokens, heads, key_dim, op);
  require_pointer(g, "the gate's output", op);
  const std::vector<double> e = decay_scales(p, heads, op);
  for (std::size_t t = 0; t < tokens; ++t) {
    for (std::size_t h = 0; h < heads; ++h) {
      const std::size_t row = (t * heads + h) * key_dim;
      for (std::size_t k = 0; k < key_dim; ++k) {
        const auto [bias, z, x] = gate_input(raw[row + k], p, h * key_dim + k, e[h]);
        double y;
        if (p.use_lower_bound) {
          // x = e·z may overflow to ±inf: sigmoid is then exactly 1 or 0, its limit.
          y = p.lower_bound * sigmoid(x);
        } else {
          y = -e[h] * softplus(z);
        }
        const T out = static_cast<T>(y);
        if (!std::isfinite(out))
          throw InvalidArgument(fmt::format(
              "{}: g[token {}, head {}, k {}] = {} (dt_bias {}, exp(A_log) {}) gives a gate of {}, "
              "beyond {}'s range",
              op, t, h, k, static_cast<double>(raw[row + k]),
              bias, e[h], y, type_name<T>()));
        g[row + k] = out;
      }
    }
  }
}

template <class T>
void gate_backward(const Elem<T>* raw, const GateParams<T>& p, std::size_t tokens, std::size_t heads,
                   std::size_t key_dim, const Elem<T>* d_g, Elem<T>* d_raw, Elem<T>* d_a_log,
                   Elem<T>* d_dt_bias) {
  constexpr std::string_view op = "kda gate backward";
  check_gate(raw, p, tokens, heads, key_dim, op);
  require_pointer(d_g, "the gate's gradient", op);
  require_pointer(d_raw, "the raw gate's gradient", op);
  require_finite(d_g, tokens * heads * key_dim, "the gate's gradient", op);
  const std::vector<double> e = decay_scales(p, heads, op);
  std::vector<double> da(heads, 0.0), db(heads * key_dim, 0.0);
  for (std::size_t t = 0; t < tokens; ++t) {
    for (std::size_t h = 0; h < heads; ++h) {
      const std::size_t row = (t * heads + h) * key_dim;
      for (std::size_t k = 0; k < key_dim; ++k) {
        const auto [bias, z, x] = gate_input(raw[row + k], p, h * key_dim + k, e[h]);
        const double dy = static_cast<double>(d_g[row + k]);
        double dz, dlog_a;
        if (p.use_lower_bound) {
          const double slope = sigmoid_slope(x);  // 0 where x overflowed
          const double common = dy * p.lower_bound * slope;
          dz = common * e[h];
          // ∂g/∂A_log = lower_bound · s'(x) · x; 0 (its limit) once s'(x) is 0.
          dlog_a = slope == 0 ? 0.0 : common * x;
        } else {
          dz = -e[h] * sigmoid(z) * dy;
          dlog_a = -e[h] * softplus(z) * dy;  // ∂g/∂A_log = g
        }
        d_raw[row + k] = static_cast<T>(dz);
        da[h] += dlog_a;
        db[h * key_dim + k] += dz;
      }
    }
  }
  if (d_a_log && p.a_log)
    for (std::size_t h = 0; h < heads; ++h) d_a_log[h] = static_cast<T>(da[h]);
  if (d_dt_bias && p.dt_bias)
    for (std::size_t i = 0; i < heads * key_dim; ++i) d_dt_bias[i] = static_cast<T>(db[i]);
}

template <class T>
void l2norm_forward(const T* x, std::size_t rows, std::size_t dim, T* y, T* rstd) {
  constexpr std::string_view op = "kda l2norm";
  require_pointer(x, "the input", op);
  require_pointer(y, "the output", op);
  require_pointer(rstd, "rstd", op);
  if (dim == 0) throw InvalidArgument(fmt::format("{}: rows of dimension 0, expected >= 1", op));
  require_finite(x, rows * dim, "the input", op);
  // Above this magnitude a square could overflow double: scale the row by its max.
  constexpr double kHuge = 1e100;
  for (std::size_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* yr = y + r * dim;
    double m = 0;
    for (std::size_t i = 0; i < dim; ++i) m = std::fmax(m, std::fabs(static_cast<double>(xr[i])));
    if (m > kHuge) {
      double s = 0;
      for (std::size_t i = 0; i < dim; ++i) {
        const double u = static_cast<double>(xr[i]) / m;
        s += u * u;
      }
      const double root = std::sqrt(s + kL2NormEpsilon / m / m);  // ε/m² underflows harmlessly
      for (std::size_t i = 0; i < dim; ++i) yr[i] = static_cast<T>(static_cast<double>(xr[i]) / m / root);
      rstd[r] = static_cast<T>(1.0 / root / m);
    } else {
      double s = 0;
      for (std::size_t i = 0; i < dim; ++i) s += static_cast<double>(xr[i]) * static_cast<double>(xr[i]);
      const double inv = 1.0 / std::sqrt(s + kL2NormEpsilon);
      for (std::size_t i = 0; i < dim; ++i) yr[i] = static_cast<T>(static_cast<double>(xr[i]) * inv);
      rstd[r] = static_cast<T>(inv);
    }
  }
}

template <class T>
void l2norm_backward(const T* y, const T* rstd, const T* d_y, std::size_t rows, std::size_t dim, T* d_x) {
  constexpr std::string_view op = "kda l2norm backward";
  require_pointer(y, "y", op);
  require_pointer(rstd, "rstd", op);
  require_pointer(d_y, "the gradient", op);
  require_pointer(d_x, "the input's gradient", op);
  require_finite(d_y, rows * dim, "the gradient", op);
  for (std::size_t r = 0; r < rows; ++r) {
    const T* yr = y + r * dim;
    const T* gr = d_y + r * dim;
    double dot = 0;
    for (std::size_t i = 0; i < dim; ++i) dot += static_cast<double>(gr[i]) * static_cast<double>(yr[i]);
    const double s = static_cast<double>(rstd[r]);
    for (std::size_t i = 0; i < dim; ++i)
      d_x[r * dim + i] = static_cast<T>(s * (static_cast<double>(gr[i]) - dot * static_cast<double>(yr[i])));
  }
}

template <class T>
void sigmoid_forward(const T* x, std::size_t n, T* y, bool allow_neg_eigval) {
  constexpr std::string_view op = "kda beta sigmoid";
  require_pointer(x, "the input", op);
  require_pointer(y, "the output", op);
  require_finite(x, n, "beta", op);
  // x2 is exact: 2·sigmoid rounds as sigmoid does.
  const double scale = allow_neg_eigval ? 2.0 : 1.0;
  for (std::size_t i = 0; i < n; ++i) y[i] = static_cast<T>(scale * sigmoid(static_cast<double>(x[i])));
}

template <class T>
void sigmoid_backward(const T* x, const T* d_y, std::size_t n, T* d_x, bool allow_neg_eigval) {
  constexpr std::string_view op = "kda beta sigmoid backward";
  require_pointer(x, "x", op);
  require_pointer(d_y, "the gradient", op);
  require_pointer(d_x, "the input's gradient", op);
  require_finite(d_y, n, "the gradient", op);
  const double scale = allow_neg_eigval ? 2.0 : 1.0;
  for (std::size_t i = 0; i < n; ++i) {
    d_x[i] = static_cast<T>(static_cast<double>(d_y[i]) * (scale * sigmoid_slope(static_cast<double>(x[i]))));
  }
}

#define KDACP_TRANSFORMS(T)                                                                           \
  template void gate_forward<T>(const T*, const GateParams<T>&, std::size_t, std::size_t, std::size_t, \
                                T*);                                                                  \
  template void gate_backward<T>(const T*, const GateParams<T>&, std::size_t, std::size_t,            \
                                 std::size_t, const T*, T*, T*, T*);                                  \
  template void l2norm_forward<T>(const T*, std::size_t, std::size_t, T*, T*);                        \
  template void l2norm_backward<T>(const T*, const T*, const T*, std::size_t, std::size_t, T*);       \
  template void sigmoid_forward<T>(const T*, std::size_t, T*, bool);                                  \
  template void sigmoid_backward<T>(const T*, const T*, std::size_t, T*, bool);
KDACP_TRANSFORMS(float)
KDACP_TRANSFORMS(double)
#undef KDACP_TRANSFORMS

}  // namespace kdacp::kda
