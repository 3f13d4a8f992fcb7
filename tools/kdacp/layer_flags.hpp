// The flags of the commands that run the KDA layer over a stream: --layout,
// --split and --algorithm, checked here so that a bad one is an error naming
// the flag before any rank starts (or, under mpirun, before any message).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "kdacp/kda.hpp"
#include "kdacp/testing/layer_runner.hpp"

namespace kdacp::cli {

// The algorithm `kdacp run` and `kdacp kda` (and so `make run`) use without
// --algorithm: the one place to change the CLI's default.
inline constexpr kda::Algorithm kDefaultAlgorithm = kda::Algorithm::recurrent;

// Adds --algorithm recurrent|chunk (kda::Algorithm, default `algorithm`'s
// value); another name throws InvalidArgument naming the flag, the text and
// the choices (exit status 2).
CLI::Option* add_algorithm_flag(CLI::App& cmd, kda::Algorithm& algorithm);

// Parses an --algorithm value as add_algorithm_flag does (for commands that
// take several, e.g. `kdacp bench layer --algorithms`).
kda::Algorithm parse_algorithm_flag(const std::string& text, const std::string& flag);

struct LayoutFlags {
  std::string layout = "contiguous";
  std::vector<std::size_t> split;  // per-rank token counts (contiguous)
};

// Adds --layout contiguous|zigzag and --split n0,n1,...
void add_layout_flags(CLI::App& cmd, LayoutFlags& flags);

// Throws InvalidArgument for --split with --layout zigzag.
void check_layout_flags(const LayoutFlags& flags);

// The layout of `tokens` tokens on `ranks` ranks; what Layout rejects (a
// split that is not P entries, has a zero or does not sum to T; zigzag with
// T < 2P; P > T) throws InvalidArgument naming the flag.
testing::LayoutSpec layout_spec(const LayoutFlags& flags, std::size_t tokens, std::size_t ranks);

}  // namespace kdacp::cli
