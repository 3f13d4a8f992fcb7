// Subcommands of the kdacp CLI; each file registers one.
#pragma once

#include <CLI/CLI.hpp>

namespace kdacp::cli {

void add_exchange_command(CLI::App& app);

}  // namespace kdacp::cli
