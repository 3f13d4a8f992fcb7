// Internal to the context-parallel layer (context_parallel.cpp): the scan of its
// outputs for NaN / ±Inf (LayerChecks::check_finite) and the names and
// shapes of the tensors it reports.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstddef>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda::layer_detail {

// A tensor of this rank for the finite check: its name, data (null: not
// given) and shape.
template <class T>
struct Named {
  const char* name;
  const T* data;
  std::vector<std::size_t> shape;
  HalfField half{};  // an input stored as 16-bit (data null)
};

// The first NaN / ±Inf of n 16-bit values, or nullopt.
inline std::optional<std::size_t> first_non_finite_half(const HalfField& f, std::size_t n) {
  const std::uint16_t exponent = f.type == Half::bf16 ? 0x7f80 : 0x7c00;
  for (std::size_t i = 0; i < n; ++i)
    if ((f.bits[i] & exponent) == exponent) return i;
  return std::nullopt;
}
inline std::string where(std::size_t rank, const char* op) {
  return fmt::format("kda::ContextParallelLayer::{} on rank {}", op, rank);
}

inline std::size_t elems_of(const std::vector<std::size_t>& shape) {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}
// Throws NumericalError naming the first of `outputs` that holds a NaN or
// ±Inf, its first such element, and whether this rank's `inputs` were finite.
// find_non_finite over the pool's threads (a memory-bound scan): the first
// non-finite index of `data`, or nullopt.
template <class T>
std::optional<std::size_t> first_non_finite(std::span<const T> data, ThreadPool* pool) {
  constexpr std::size_t kBlock = 1 << 14;  // elements per work item
  if (data.empty()) return std::nullopt;
  const std::size_t blocks = (data.size() + kBlock - 1) / kBlock;
  std::vector<std::size_t> first(participants(pool, blocks), data.size());
  parallel_ranges(pool, blocks, [&](std::size_t begin, std::size_t end, std::size_t part) {
    const std::size_t lo = begin * kBlock, hi = std::min(data.size(), end * kBlock);
    if (const auto i = find_non_finite(data.subspan(lo, hi - lo))) first[part] = lo + *i;
  });
  const std::size_t i = *std::min_element(first.begin(), first.end());
  return i < data.size() ? std::optional<std::size_t>(i) : std::nullopt;
}

template <class T>
void require_finite_results(const std::string& where, const std::vector<Named<T>>& outputs,
                            const std::vector<Named<T>>& inputs, ThreadPool* pool) {
  for (const Named<T>& out : outputs) {
    if (out.data == nullptr) continue;
    const auto bad = first_non_finite(std::span<const T>(out.data, elems_of(out.shape)), pool);
    if (!bad) continue;
    std::ostringstream os;
    os << where << ": " << out.name << index_string(*bad, out.shape) << " = " << out.data[*bad]
       << ", a non-finite result";
    std::string cause =
        fmt::format(" from finite inputs ({} overflow: inputs too large for this dtype?)",
                    std::is_same_v<T, float> ? "float32" : "float64");
    for (const Named<T>& in : inputs) {
      std::optional<std::size_t> i;
      if (in.data != nullptr) i = find_non_finite(std::span<const T>(in.data, elems_of(in.shape)));
      else if (in.half.bits != nullptr) i = first_non_finite_half(in.half, elems_of(in.shape));
      if (i) {
        std::ostringstream c;
        c << "; the input " << in.name << index_string(*i, in.shape) << " is already "
          << (in.data ? static_cast<double>(in.data[*i]) : static_cast<double>(in.half.at(*i)));
        cause = c.str();
        break;
      }
    }
    throw NumericalError(os.str() + cause +
                         " (LayerChecks::check_finite / check_finite(false) turns this check off)");
  }
}

template <class T>
std::vector<Named<T>> input_tensors(const Inputs<T>& in) {
  const Shape& s = in.shape;
  return {{"q", in.q, {s.batch, s.tokens, s.heads, s.key_dim}, in.half.q},
          {"k", in.k, {s.batch, s.tokens, s.heads, s.key_dim}, in.half.k},
          {"v", in.v, {s.batch, s.tokens, s.value_heads, s.value_dim}, in.half.v},
          {"g", in.g, {s.batch, s.tokens, s.value_heads, s.key_dim}, in.half.g},
          {"beta", in.beta, {s.batch, s.tokens, s.value_heads}, in.half.beta}};
}

template <class T>
std::vector<std::size_t> states_shape(const SequenceStates<T>& st) {
  return {st.sequences, st.value_heads, st.key_dim, st.value_dim};
}

template <class T>
std::vector<Named<T>> grad_tensors(const Grads<T>& g, const Shape& s) {
  return {{"dq", g.dq, {s.batch, s.tokens, s.heads, s.key_dim}},
          {"dk", g.dk, {s.batch, s.tokens, s.heads, s.key_dim}},
          {"dv", g.dv, {s.batch, s.tokens, s.value_heads, s.value_dim}},
          {"dg", g.dg, {s.batch, s.tokens, s.value_heads, s.key_dim}},
          {"dbeta", g.dbeta, {s.batch, s.tokens, s.value_heads}},
          {"d_incoming", g.d_incoming, {s.batch, s.value_heads, s.key_dim, s.value_dim}}};
}

}  // namespace kdacp::kda::layer_detail
