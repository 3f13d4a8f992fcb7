#include "kdacp/testing/packing.hpp"

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/testing/synthetic.hpp"

namespace kdacp::testing {

namespace {

void check_exclusive(const Packing& packing) {
  if (!packing.seqlens.empty() && packing.docs > 0) throw InvalidArgument("--seqlens and --docs exclude each other");
}

}  // namespace

std::size_t packed_tokens(const Packing& packing, std::size_t tokens, bool tokens_given, std::size_t max_tokens) {
  check_exclusive(packing);
  if (packing.seqlens.empty()) return tokens;
  std::size_t sum = 0;
  for (std::size_t len : packing.seqlens) {
    sum += len;
    if (sum > max_tokens)
      throw InvalidArgument(fmt::format("--seqlens sum to more than the most tokens this command takes, {}", max_tokens));
  }
  if (tokens_given && sum != tokens)
    throw InvalidArgument(fmt::format("--seqlens sum to {}, expected --tokens {} (or leave --tokens out)", sum, tokens));
  return sum;
}

std::size_t packed_sequences(const Packing& packing, std::size_t batch, std::size_t tokens) {
  if (!packing.packed()) return batch;
  check_exclusive(packing);
  if (batch != 1)
    throw InvalidArgument(fmt::format("{} packs sequences into one row, expected --batch 1, not {}",
                                      packing.docs ? "--docs" : "--seqlens", batch));
  if (packing.docs > tokens)
    throw InvalidArgument(fmt::format("--docs {} is more documents than T = {} tokens (each document needs a token)",
                                      packing.docs, tokens));
  return packing.docs > 0 ? packing.docs : packing.seqlens.size();
}

std::vector<std::int64_t> packed_cu_seqlens(const Packing& packing, std::size_t batch, std::size_t tokens,
                                            std::uint64_t seed) {
  packed_sequences(packing, batch, tokens);
  if (!packing.packed()) return {};
  if (packing.docs > 0) return kda::random_cu_seqlens(tokens, packing.docs, seed + 2);
  std::vector<std::int64_t> cu{0};
  for (std::size_t len : packing.seqlens) cu.push_back(cu.back() + static_cast<std::int64_t>(len));
  return cu;
}

}  // namespace kdacp::testing
