#include "kdacp/report/packing.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/error.hpp"
#include "kdacp/job.hpp"
#include "kdacp/testing/synthetic.hpp"

namespace kdacp::report {

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

void check_layout_flags(const LayoutFlags& flags) {
  if (flags.layout == "zigzag" && !flags.split.empty())
    throw InvalidArgument("--split applies to --layout contiguous only, not to --layout zigzag");
}

Layout layout_of(const LayoutFlags& flags, std::size_t tokens, std::size_t ranks) {
  check_layout_flags(flags);
  const bool zigzag = flags.layout == "zigzag";
  try {
    return job::make_layout(zigzag, flags.split, tokens, ranks);
  } catch (const InvalidArgument& e) {
    if (zigzag) throw InvalidArgument(fmt::format("--layout zigzag on P = {} ranks: {}", ranks, e.what()));
    if (!flags.split.empty())
      throw InvalidArgument(fmt::format("--split {} on P = {} ranks, T = {}: {}", fmt::join(flags.split, ","), ranks,
                                        tokens, e.what()));
    throw InvalidArgument(fmt::format("P = {} ranks for T = {} tokens: {}", ranks, tokens, e.what()));
  }
}

std::string layout_name(const LayoutFlags& flags) {
  if (flags.layout == "zigzag" || flags.split.empty()) return flags.layout;
  return fmt::format("contiguous {}", fmt::join(flags.split, ","));
}

}  // namespace kdacp::report
