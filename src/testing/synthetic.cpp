#include "kdacp/testing/synthetic.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kdacp/error.hpp"

namespace kdacp {

std::uint64_t Rng::next() {
  std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float Rng::uniform(float lo, float hi) {
  const float unit = static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
  return lo + (hi - lo) * unit;
}

SyntheticSummary synthetic_summary(const SummaryShape& shape, std::uint64_t seed, std::size_t rank,
                                   bool gradient) {
  const std::size_t k = shape.key_dim, v = shape.value_dim;
  SyntheticSummary out{State(shape.batch, shape.heads, k, v),
                       State(shape.batch, shape.heads, k, k)};
  // Distinct streams per (seed, rank, role); the transfer is the same in the
  // forward and backward roles, as a caller saves M from the forward.
  Rng off_rng(seed * 0x100000001B3ull + rank * 2 + (gradient ? 1 : 0) + 0x5bd1e995ull);
  Rng map_rng(seed * 0x9E3779B97F4A7C15ull + rank + 0x2545F491ull);
  for (std::size_t i = 0; i < out.offset.size(); ++i) out.offset.data()[i] = off_rng.uniform(-1, 1);
  std::vector<float> u(k), a(k);
  const float noise = 0.02f / std::sqrt(static_cast<float>(k));
  for (std::size_t slab = 0; slab < shape.slabs(); ++slab) {
    float norm = 0;
    for (std::size_t i = 0; i < k; ++i) {
      u[i] = map_rng.uniform(-1, 1);
      norm += u[i] * u[i];
      a[i] = map_rng.uniform(0.9f, 1.0f);
    }
    const float inv = 1.0f / std::sqrt(norm);
    const float b = map_rng.uniform(0.05f, 0.95f);
    float* m = out.transfer.data() + slab * k * k;
    for (std::size_t i = 0; i < k; ++i)
      for (std::size_t j = 0; j < k; ++j) {
        const float h = (i == j ? 1.0f : 0.0f) - b * (u[i] * inv) * (u[j] * inv);
        m[i * k + j] = 0.97f * a[i] * h + noise * map_rng.uniform(-1, 1);
      }
  }
  return out;
}

}  // namespace kdacp

namespace kdacp::kda {

template <class T>
LayerData<T> synthetic_layer(const Shape& shape, std::uint64_t seed) {
  validate(shape);
  LayerData<T> d;
  d.shape = shape;
  Rng rng(seed * 0x9E3779B97F4A7C15ull + 17);
  auto fill = [&](std::vector<T>& x, std::size_t n, float lo, float hi) {
    x.resize(n);
    for (auto& e : x) e = static_cast<T>(rng.uniform(lo, hi));
  };
  fill(d.q, shape.qk_elems(), -1, 1);
  fill(d.k, shape.qk_elems(), -1, 1);
  for (std::size_t row = 0; row < shape.qk_elems() / shape.key_dim; ++row) {
    T* kr = d.k.data() + row * shape.key_dim;
    T norm = 0;
    for (std::size_t i = 0; i < shape.key_dim; ++i) norm += kr[i] * kr[i];
    norm = std::sqrt(norm);
    for (std::size_t i = 0; i < shape.key_dim; ++i) kr[i] /= norm;
  }
  fill(d.v, shape.v_elems(), -1, 1);
  fill(d.g, shape.g_elems(), 0.9f, 1.0f);
  for (auto& e : d.g) e = std::log(e);
  fill(d.beta, shape.beta_elems(), 0.1f, 0.9f);
  return d;
}

template <class T>
std::vector<T> synthetic_tensor(std::size_t n, std::uint64_t seed) {
  Rng rng(seed * 0xD1B54A32D192ED03ull + 5);
  std::vector<T> x(n);
  for (auto& e : x) e = static_cast<T>(rng.uniform(-1, 1));
  return x;
}

std::vector<std::int64_t> random_cu_seqlens(std::size_t tokens, std::size_t docs, std::uint64_t seed) {
  if (docs == 0 || docs > tokens)
    throw InvalidArgument(fmt::format(
        "random_cu_seqlens: {} documents in {} tokens, expected 1 to {} (each document needs a token)", docs, tokens,
        tokens));
  // Floyd's sampling of docs - 1 distinct boundaries from [1, tokens - 1]:
  // O(docs log docs) whatever T.
  Rng rng(seed * 0xA0761D6478BD642Full + 29);
  std::set<std::size_t> cuts;
  const std::size_t range = tokens - 1;  // candidates 1..tokens-1
  for (std::size_t j = range - (docs - 1); j < range; ++j) {
    const std::size_t t = static_cast<std::size_t>(rng.next() % (j + 1));  // in [0, j]
    cuts.insert(cuts.count(t + 1) ? j + 1 : t + 1);
  }
  std::vector<std::int64_t> cu{0};
  for (std::size_t c : cuts) cu.push_back(static_cast<std::int64_t>(c));
  cu.push_back(static_cast<std::int64_t>(tokens));
  return cu;
}

template LayerData<float> synthetic_layer<float>(const Shape&, std::uint64_t);
template LayerData<double> synthetic_layer<double>(const Shape&, std::uint64_t);
template std::vector<float> synthetic_tensor<float>(std::size_t, std::uint64_t);
template std::vector<double> synthetic_tensor<double>(std::size_t, std::uint64_t);

}  // namespace kdacp::kda
