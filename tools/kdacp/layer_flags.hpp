// The flags of the commands that run the KDA layer over a stream (or price
// its exchange, `kdacp plan`): --layout, --split, --seqlens, --docs and
// --algorithm, checked here so that a bad one is an error naming
// the flag before any rank starts (or, under mpirun, before any message).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "kdacp/kda.hpp"
#include "kdacp/job.hpp"

namespace kdacp::cli {

// Adds --algorithm recurrent|chunk (kda::Algorithm, default `algorithm`'s
// value); another name throws InvalidArgument naming the flag, the text and
// the choices (exit status 2).
CLI::Option* add_algorithm_flag(CLI::App& cmd, kda::Algorithm& algorithm);

// Adds --recompute: with the chunk algorithm the forward keeps what its
// backward would recompute (kda::ForwardCache, LayerJob::keep_forward,
// defaults::kKeepForward); --recompute keeps only the incoming states (less
// memory, a slower backward). The results are the same bits either way.
CLI::Option* add_recompute_flag(CLI::App& cmd, bool& recompute);

// Parses an --algorithm value as add_algorithm_flag does (for commands that
// take several, e.g. `kdacp bench layer --algorithms`).
kda::Algorithm parse_algorithm_flag(const std::string& text, const std::string& flag);

// -B, -T (help: tokens_help), -H, --value-heads (0: --heads), -K and -V
// of the layer's shape (`kdacp run`, `kdacp bench layer`); returns --tokens.
CLI::Option* add_layer_shape_flags(CLI::App& cmd, kda::Shape& shape, std::size_t& value_heads,
                                   const std::string& tokens_help);

struct LayoutFlags {
  std::string layout = "contiguous";
  std::vector<std::size_t> split;  // per-rank token counts (contiguous)
};

// Adds --layout contiguous|zigzag and --split n0,n1,...
void add_layout_flags(CLI::App& cmd, LayoutFlags& flags);

// Throws InvalidArgument for --split with --layout zigzag.
void check_layout_flags(const LayoutFlags& flags);

// The layout of `tokens` tokens on `ranks` ranks (job::make_layout); what
// Layout rejects (a split that is not P entries, has a zero or does not sum
// to T; zigzag with T < 2P; P > T) throws InvalidArgument naming the flag.
kda::Layout layout_of(const LayoutFlags& flags, std::size_t tokens, std::size_t ranks);

// The flags as the commands print them: "contiguous", "contiguous 3,5,4" or
// "zigzag".
std::string layout_name(const LayoutFlags& flags);

// --seqlens and --docs: packed sequences in one row (`kdacp run`, `kdacp
// plan`).
struct PackingFlags {
  std::vector<std::size_t> seqlens;  // packed sequence lengths (sum T)
  std::size_t docs = 0;              // a random packing of this many documents
  bool packed() const { return !seqlens.empty() || docs > 0; }
};

// Adds --seqlens L1,L2,... (each at most max_tokens; `what` ends the help
// text, e.g. what the command does with them) and --docs N.
void add_packing_flags(CLI::App& cmd, PackingFlags& flags, std::size_t max_tokens, const std::string& what);

// T with --seqlens: their sum, which must equal `tokens` when tokens_given
// and be at most max_tokens; without --seqlens, `tokens`. Throws
// InvalidArgument naming the flags (also for --seqlens with --docs).
std::size_t packed_tokens(const PackingFlags& flags, std::size_t tokens, bool tokens_given,
                          std::size_t max_tokens);

// The cu_seqlens of --seqlens or --docs over `tokens` tokens (empty: one
// sequence per row); --docs draws kda::random_cu_seqlens(tokens, N, seed +
// 2), `seed` being the command's --seed, so that `kdacp plan` and `kdacp
// run` with the same --seed pack alike. Throws InvalidArgument naming the
// flag for --seqlens with --docs, batch != 1, or more documents than tokens.
std::vector<std::int64_t> packing(const PackingFlags& flags, std::size_t batch, std::size_t tokens,
                                  std::uint64_t seed);

// N, the sequences packing() would return (batch without packing), after
// every check packing() makes, without drawing them: what a memory admission
// needs before the (for --docs N, large) packing is drawn.
std::size_t packed_sequences(const PackingFlags& flags, std::size_t batch, std::size_t tokens);

}  // namespace kdacp::cli
