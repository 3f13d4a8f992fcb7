// Subcommands of the kdacp CLI; each file registers one.
#pragma once

#include <CLI/CLI.hpp>

namespace kdacp::cli {

void add_exchange_command(CLI::App& app);
void add_bench_command(CLI::App& app);
// `kdacp bench exchange` (bench_exchange_cmd.cpp), under `bench`.
void add_bench_exchange_command(CLI::App& bench);
void add_run_command(CLI::App& app);
void add_kda_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_calibrate_command(CLI::App& app);
void add_protocols_command(CLI::App& app);

}  // namespace kdacp::cli
