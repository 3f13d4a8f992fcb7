#include "backend.hpp"

#include "flags.hpp"

#ifdef KDACP_HAVE_MPI
#include "kdacp/launch_mpi.hpp"
#endif

namespace kdacp::cli {

const ProcessLauncher* launcher() {
#ifdef KDACP_HAVE_MPI
  static const ProcessLauncher mpi = mpi_launcher();
  return &mpi;
#else
  return nullptr;
#endif
}

void add_backend_flags(CLI::App& cmd, LaunchOptions& opts) {
  add_choice(cmd, "--backend", opts.backend,
             "where ranks run: inprocess (threads of this process), mpi (one process per rank under mpirun) or "
             "auto (mpi when launched by mpirun with more than one process)",
             {"auto", "inprocess", "mpi"});
  add_int(cmd, "--ranks,-P", opts.ranks,
          "number of in-process ranks (context-parallel size P); under mpirun P is the number of processes",
          kRanksRange)
      ->each([&opts](const std::string&) { opts.ranks_given = true; });
  add_real(cmd, "--timeout", opts.timeout_s,
           "seconds any rank waits for a peer before failing; under mpirun also the bound on MPI start-up "
           "(MPI_Init waits for every process of the job)",
           kTimeoutRange);
}

void run_ranks(const LaunchOptions& opts, const RankFn& fn) { launch(opts, fn, launcher()); }

std::size_t ranks_per_process(const LaunchOptions& opts) { return kdacp::ranks_per_process(opts, launcher()); }

std::string resolved_backend(const LaunchOptions& opts) { return resolve_backend(opts, launcher()); }

}  // namespace kdacp::cli
