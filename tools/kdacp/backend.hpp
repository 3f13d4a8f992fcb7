// Where the ranks of a CLI job run: threads of this process (in-process) or
// one process per rank under mpirun.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "kdacp/inprocess.hpp"

namespace kdacp::cli {

struct BackendOptions {
  std::string backend = "auto";  // auto | inprocess | mpi
  std::size_t ranks = 4;         // in-process ranks
  bool ranks_given = false;      // --ranks on the command line
  double timeout_s = 60;
};

// Adds --backend, --ranks and --timeout to a subcommand.
void add_backend_flags(CLI::App& cmd, BackendOptions& opts);

// Runs fn on every rank and returns on all of them; rank 0 of the world is
// the one that reports. Errors of any rank are rethrown.
void run_ranks(const BackendOptions& opts, const RankFn& fn);

// Ranks that share this process (for the default intra-rank thread count).
std::size_t ranks_per_process(const BackendOptions& opts);

}  // namespace kdacp::cli
