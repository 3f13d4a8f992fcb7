#include "kdacp/launch_mpi.hpp"

#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "kdacp/error.hpp"
#include "kdacp/mpi.hpp"

namespace kdacp {

namespace {

void run_mpi(const LaunchOptions& options, const RankFn& fn) {
  MpiSession session;
  std::shared_ptr<Communicator> world;
  try {
    MpiOptions mo;
    mo.timeout = std::chrono::milliseconds(static_cast<long long>(options.timeout_s * 1000));
    world = mpi_world(mo);
    if (options.ranks_given && options.ranks != world->size())
      throw InvalidArgument("--ranks is " + std::to_string(options.ranks) + " but mpirun started " +
                            std::to_string(world->size()) + " processes");
    fn(world);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kdacp: error: rank %zu: %s\n", session.world_rank(), e.what());
    std::fflush(stderr);
    MpiSession::abort(2);
  }
  world.reset();  // communicators go before MPI_Finalize
}

}  // namespace

ProcessLauncher mpi_launcher() {
  return ProcessLauncher{
      "mpi", [] { return launched_by_mpirun() && mpi_world_size_from_env().value_or(0) > 1; }, run_mpi};
}

}  // namespace kdacp
