// Deterministic per-rank summaries for the MPI tests: every process generates
// the inputs of EVERY rank from the seed, so each one can compute the
// in-process reference itself and no data has to be shipped around.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kdacp/summary.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp::mpitest {

struct Inputs {
  SummaryShape shape;
  std::vector<State> s, m, g;  // one per chronological rank
  std::size_t size() const { return s.size(); }
};

inline State random_state(const SummaryShape& sh, std::size_t cols, std::uint64_t seed,
                          float scale) {
  State out(sh.batch, sh.heads, sh.key_dim, cols);
  std::mt19937_64 gen(seed);
  // Integer draws mapped to floats by hand: std::uniform_real_distribution's
  // output is implementation-defined, these bits are not.
  for (std::size_t i = 0; i < out.size(); ++i) {
    const auto u = static_cast<std::int64_t>(gen() >> 40) - (std::int64_t{1} << 23);
    out.data()[i] = scale * static_cast<float>(u) / static_cast<float>(1 << 23);
  }
  return out;
}

// S, G in [-1, 1); M in [-1/K, 1/K) so the chain neither explodes nor vanishes.
inline Inputs make_inputs(const SummaryShape& sh, std::size_t ranks, std::uint64_t seed) {
  Inputs in;
  in.shape = sh;
  const float m_scale = 1.0f / static_cast<float>(sh.key_dim);
  for (std::size_t r = 0; r < ranks; ++r) {
    const std::uint64_t base = seed * 1000003u + r * 7919u;
    in.s.push_back(random_state(sh, sh.value_dim, base + 1, 1.0f));
    in.m.push_back(random_state(sh, sh.key_dim, base + 2, m_scale));
    in.g.push_back(random_state(sh, sh.value_dim, base + 3, 1.0f));
  }
  return in;
}

}  // namespace kdacp::mpitest
