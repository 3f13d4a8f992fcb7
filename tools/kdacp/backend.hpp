// The --backend, --ranks and --timeout flags and the launch of a command's
// ranks (kdacp/launch.hpp), with the MPI launcher when kdacp was built with it.
#pragma once

#include <cstddef>
#include <string>

#include <CLI/CLI.hpp>

#include "kdacp/launch.hpp"

namespace kdacp::cli {

void add_backend_flags(CLI::App& cmd, LaunchOptions& opts);
// The MPI launcher when kdacp was built with it, else null.
const ProcessLauncher* launcher();
void run_ranks(const LaunchOptions& opts, const RankFn& fn);
std::size_t ranks_per_process(const LaunchOptions& opts);
// "inprocess" or the launcher's name.
std::string resolved_backend(const LaunchOptions& opts);

}  // namespace kdacp::cli
