// The flags of the commands that run the KDA layer over a stream (or price
// its exchange, `kdacp plan`): --layout, --split, --seqlens, --docs and
// --algorithm, checked here so that a bad one is an error naming
// the flag before any rank starts (or, under mpirun, before any message).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "kdacp/kda.hpp"
#include "kdacp/job.hpp"
#include "kdacp/report/packing.hpp"

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
CLI::Option* add_deterministic_flag(CLI::App& cmd, bool& deterministic);

// Parses an --algorithm value as add_algorithm_flag does (for commands that
// take several, e.g. `kdacp bench layer --algorithms`).
kda::Algorithm parse_algorithm_flag(const std::string& text, const std::string& flag);

// -B, -T (help: tokens_help), -H, --value-heads (0: --heads), -K and -V
// of the layer's shape (`kdacp run`, `kdacp bench layer`); returns --tokens.
CLI::Option* add_layer_shape_flags(CLI::App& cmd, kda::Shape& shape, std::size_t& value_heads,
                                   const std::string& tokens_help);

using report::LayoutFlags;

// Adds --layout contiguous|zigzag and --split n0,n1,... (report::LayoutFlags).
void add_layout_flags(CLI::App& cmd, LayoutFlags& flags);

// Adds --ulysses U|auto (LayerRunOptions::ulysses: an integer in [1, 65536],
// or auto = job::kUlyssesAuto; default 1): Ulysses x state CP.
CLI::Option* add_ulysses_flag(CLI::App& cmd, std::size_t& ulysses);

// "auto" or the number, as the flag was given.
std::string ulysses_flag_text(std::size_t ulysses);

// --ulysses `given` resolved for the layer of `shape` on `layout` with
// `method` (job::resolve_ulysses, cuts of `seqs`) and checked against P, H
// and HV (job::check_ulysses); InvalidArgument names the flag.
std::size_t resolve_ulysses_flag(std::size_t given, const std::string& method, const kda::Shape& shape,
                                 const kda::Layout& layout, const kda::Sequences& seqs,
                                 const ExchangeOptions& options, std::size_t elem_bytes);

// Adds --seqlens L1,L2,... (each at most max_tokens; `what` ends the help
// text, e.g. what the command does with them) and --docs N, the packed
// sequences in one row of `kdacp run` and `kdacp plan`
// (kdacp/report/packing.hpp checks and draws them).
void add_packing_flags(CLI::App& cmd, report::Packing& packing, std::size_t max_tokens, const std::string& what);

}  // namespace kdacp::cli
