// The flags every command that builds a state exchange shares: the method
// (auto by default), its group width and segments, and what auto weighs
// (memory budget, reassociation, the machine's cost parameters), into a
// report::ExchangeFlags.
#pragma once

#include <CLI/CLI.hpp>

#include "kdacp/report/exchange_flags.hpp"

namespace kdacp::cli {

using report::ExchangeFlags;

// Adds --protocol, --group-size, --segments, --memory-budget,
// --allow-reassociation and --calibration to a subcommand.
void add_exchange_flags(CLI::App& cmd, ExchangeFlags& flags);

}  // namespace kdacp::cli
