#include "backend.hpp"

#include <chrono>
#include <cstdio>

#include "kdacp/error.hpp"
#ifdef KDACP_HAVE_MPI
#include "kdacp/mpi.hpp"
#endif

namespace kdacp::cli {

void add_backend_flags(CLI::App& cmd, BackendOptions& opts) {
  cmd.add_option("--backend", opts.backend,
                 "where ranks run: inprocess (threads of this process), mpi (one process per "
                 "rank under mpirun) or auto (mpi when launched by mpirun with more than one "
                 "process)")
      ->check(CLI::IsMember({"auto", "inprocess", "mpi"}))
      ->capture_default_str();
  cmd.add_option("--ranks,-P", opts.ranks,
                 "number of in-process ranks (context-parallel size P); under mpirun P is the "
                 "number of processes")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str()
      ->each([&opts](const std::string&) { opts.ranks_given = true; });
  cmd.add_option("--timeout", opts.timeout_s, "seconds any rank waits for a peer before failing")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
}

namespace {

std::string resolve(const BackendOptions& opts) {
  if (opts.backend != "auto") return opts.backend;
#ifdef KDACP_HAVE_MPI
  if (launched_by_mpirun() && mpi_world_size_from_env().value_or(0) > 1) return "mpi";
#endif
  return "inprocess";
}

std::chrono::milliseconds timeout_of(const BackendOptions& opts) {
  return std::chrono::milliseconds(static_cast<long long>(opts.timeout_s * 1000));
}

#ifdef KDACP_HAVE_MPI
// One rank per process. A failing rank reports and ends the whole job: a
// clean MPI_Finalize would wait for peers that are blocked on it.
void run_mpi(const BackendOptions& opts, const RankFn& fn) {
  MpiSession session;
  std::shared_ptr<Communicator> world;
  try {
    MpiOptions mo;
    mo.timeout = timeout_of(opts);
    world = mpi_world(mo);
    if (opts.ranks_given && opts.ranks != world->size())
      throw InvalidArgument("--ranks is " + std::to_string(opts.ranks) + " but mpirun started " +
                            std::to_string(world->size()) + " processes");
    fn(world);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kdacp: error: rank %zu: %s\n", session.world_rank(), e.what());
    std::fflush(stderr);
    MpiSession::abort(2);
  }
  world.reset();  // communicators go before MPI_Finalize
}
#endif

}  // namespace

void run_ranks(const BackendOptions& opts, const RankFn& fn) {
  const std::string backend = resolve(opts);
  if (backend == "mpi") {
#ifdef KDACP_HAVE_MPI
    run_mpi(opts, fn);
    return;
#else
    throw InvalidArgument("--backend mpi: this kdacp was built without the MPI backend");
#endif
  }
  InProcessOptions o;
  o.timeout = timeout_of(opts);
  run_in_process(opts.ranks, fn, o);
}

std::size_t ranks_per_process(const BackendOptions& opts) {
  return resolve(opts) == "inprocess" ? opts.ranks : 1;
}

}  // namespace kdacp::cli
