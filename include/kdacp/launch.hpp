// Where the ranks of a job run: threads of this process (in-process) or one
// process per rank under a process launcher such as mpirun. The core library
// knows only the in-process backend; a multi-process backend comes as a
// ProcessLauncher from its own library (kdacp_mpi: kdacp/launch_mpi.hpp), so
// that the core never depends on MPI.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "kdacp/inprocess.hpp"

namespace kdacp {

struct LaunchOptions {
  // "auto", "inprocess" or the name of a ProcessLauncher ("mpi"). auto picks
  // the launcher when this process was started by it with more than one
  // process, in-process ranks otherwise.
  std::string backend = "auto";
  std::size_t ranks = 4;     // in-process ranks (P)
  bool ranks_given = false;  // under a launcher, `ranks` must then equal its world size
  double timeout_s = defaults::kTimeoutSeconds;  // seconds any rank waits for a peer before failing
  // The caller keeps only the run's timing, not its results (kdacp bench
  // exchange): only then may the SMPI build run in its shared-memory mode
  // (KDACP_SMPI_SHARED_MEMORY=1, docs/scale.md), where results are
  // meaningless; it refuses otherwise.
  bool timing_only = false;
};

// A backend that runs one rank per process.
struct ProcessLauncher {
  std::string name;
  // True when this process was started by the launcher with more than one
  // process.
  std::function<bool()> started;
  // Runs fn once in this process, as its rank of the launcher's world, and
  // ends the whole job when fn fails (peers blocked on this rank would wait
  // forever otherwise).
  std::function<void(const LaunchOptions&, const RankFn&)> run;
};

// The backend `options` resolve to: "inprocess" or launcher->name.
// launcher may be null (no multi-process backend in this program).
std::string resolve_backend(const LaunchOptions& options, const ProcessLauncher* launcher);

// Runs fn on every rank and returns on all of them; rank 0 of the world is
// the one that reports. In-process, the first error of any rank is rethrown
// here. Asking for a backend that is neither "inprocess", "auto" nor
// launcher->name throws InvalidArgument; so does a rank count that differs
// from the launcher's world when options.ranks_given.
void launch(const LaunchOptions& options, const RankFn& fn, const ProcessLauncher* launcher);

// Ranks that share this process: `ranks` in-process, 1 under a launcher (for
// the default intra-rank thread count).
std::size_t ranks_per_process(const LaunchOptions& options, const ProcessLauncher* launcher);

}  // namespace kdacp
