// Deterministic synthetic inputs for tests, benchmarks and the CLI: summaries
// of the exchange and inputs of the KDA layer. The same (seed, rank) gives the
// same bits on every platform and backend, so separate processes can
// regenerate each other's inputs. Part of kdacp_testing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kdacp/kda_cp.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp {

// splitmix64-based generator with platform-independent float output.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next();
  // Uniform in [lo, hi), from 24 random bits.
  float uniform(float lo, float hi);

 private:
  std::uint64_t state_;
};

// One rank's summary: S/G [B,H,K,V] uniform in [-1,1), and M [B,H,K,K] a
// non-symmetric contraction with spectral norm < 1, shaped like a KDA chunk
// transfer: 0.97 · Diag(a) (I - b u uᵀ) + small noise, a ∈ [0.9,1), b ∈ (0,1).
struct SyntheticSummary {
  State offset;
  State transfer;
};
SyntheticSummary synthetic_summary(const SummaryShape& shape, std::uint64_t seed, std::size_t rank,
                                   bool gradient);

}  // namespace kdacp

namespace kdacp::kda {

// Random but well-conditioned inputs (deterministic in seed): k L2-normalised
// per token and head, g = log(a) with a in [0.9, 1) so g <= 0, beta in
// [0.1, 0.9]; q uniform in [-1, 1).
template <class T>
LayerData<T> synthetic_layer(const Shape& shape, std::uint64_t seed);
// A uniform [-1,1) tensor of n elements (for d_o).
template <class T>
std::vector<T> synthetic_tensor(std::size_t n, std::uint64_t seed);

// cu_seqlens of a random packing of `docs` documents into `tokens` tokens
// (deterministic in seed): 0 = c_0 < c_1 < ... < c_docs = tokens, the docs - 1
// inner boundaries drawn uniformly without repetition from [1, tokens - 1],
// so every document has at least one token. Throws InvalidArgument unless
// 1 <= docs <= tokens.
std::vector<std::int64_t> random_cu_seqlens(std::size_t tokens, std::size_t docs, std::uint64_t seed);

}  // namespace kdacp::kda
