// The packed stream of `kdacp run` and `kdacp plan`: sequences of given
// lengths (--seqlens L1,L2,...) or a random packing of N documents (--docs
// N) in one row. The errors name those flags, as the commands take them.
// Part of kdacp_testing (a --docs packing is drawn by random_cu_seqlens).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kdacp::testing {

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

}  // namespace kdacp::testing
