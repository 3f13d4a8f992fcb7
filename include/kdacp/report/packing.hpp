// The stream of `kdacp run`, `kdacp kda` and `kdacp plan` as their flags
// describe it: sequences of given lengths (--seqlens L1,L2,...) or a random
// packing of N documents (--docs N) in one row, and where the tokens live
// (--layout, --split). The errors name those flags, as the commands take
// them. Part of kdacp_report (a --docs packing is drawn by
// random_cu_seqlens).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kdacp/layout.hpp"

namespace kdacp::report {

struct Packing {
  std::vector<std::size_t> seqlens;  // packed sequence lengths (sum T)
  std::size_t docs = 0;              // a random packing of this many documents
  bool packed() const { return !seqlens.empty() || docs > 0; }
};

// T with seqlens: their sum, which must equal `tokens` when tokens_given
// and be at most max_tokens; without seqlens, `tokens`. Throws
// InvalidArgument naming the flags (also for --seqlens with --docs).
std::size_t packed_tokens(const Packing& packing, std::size_t tokens, bool tokens_given, std::size_t max_tokens);

// N, the sequences packed_cu_seqlens would return (batch without packing),
// after every check it makes, without drawing them: what a memory admission
// needs before the (for --docs N, large) packing is drawn. Throws
// InvalidArgument naming the flag for --seqlens with --docs, batch != 1, or
// more documents than tokens.
std::size_t packed_sequences(const Packing& packing, std::size_t batch, std::size_t tokens);

// The cu_seqlens of the packing over `tokens` tokens (empty: one sequence
// per row); docs draws kda::random_cu_seqlens(tokens, N, seed + 2), `seed`
// being the command's --seed, so that `kdacp plan` and `kdacp run` with the
// same --seed pack alike. Throws as packed_sequences.
std::vector<std::int64_t> packed_cu_seqlens(const Packing& packing, std::size_t batch, std::size_t tokens,
                                            std::uint64_t seed);

struct LayoutFlags {
  std::string layout = "contiguous";  // or "zigzag"
  std::vector<std::size_t> split;     // per-rank token counts (contiguous)
};

// Throws InvalidArgument for --split with --layout zigzag.
void check_layout_flags(const LayoutFlags& flags);

// The layout of `tokens` tokens on `ranks` ranks (job::make_layout); what
// Layout rejects (a split that is not P entries, has a zero or does not sum
// to T; zigzag with T < 2P; P > T) throws InvalidArgument naming the flag.
Layout layout_of(const LayoutFlags& flags, std::size_t tokens, std::size_t ranks);

// The flags as the commands print them: "contiguous", "contiguous 3,5,4" or
// "zigzag".
std::string layout_name(const LayoutFlags& flags);

}  // namespace kdacp::report
