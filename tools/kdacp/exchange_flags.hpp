// The flags every command that builds a state exchange shares: the method
// (auto by default), its group width and segments, and what auto weighs
// (memory budget, reassociation, the machine's cost parameters).
#pragma once

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "kdacp/exchange.hpp"

namespace kdacp::cli {

struct ExchangeFlags {
  std::string protocol = "auto";
  long long group_size = 1;
  std::size_t segments = 0;          // pipelined_p2p / auto: 0 = the model's c
  std::string memory_budget;         // auto: per-rank budget, e.g. "2GiB"; empty = none
  bool allow_reassociation = false;  // auto: weigh the reassociating protocols too
  std::string calibration;           // auto: CostParams JSON from `kdacp calibrate`
};

// Adds --protocol, --group-size, --segments, --memory-budget,
// --allow-reassociation and --calibration to a subcommand.
void add_exchange_flags(CLI::App& cmd, ExchangeFlags& flags);

// The factory's options for calls of `shape` (auto needs the shape to choose).
// Reads the calibration file when one is named; bad values throw.
ExchangeOptions exchange_options(const ExchangeFlags& flags, const SummaryShape& shape);

// "auto -> pipelined_p2p c=4, predicted 1.20 ms, 256 KiB/rank" for an auto
// executor (one with a prediction), the method name otherwise.
std::string describe_method(const std::string& method, const std::optional<Prediction>& prediction,
                            const ExchangeFlags& flags);

}  // namespace kdacp::cli
