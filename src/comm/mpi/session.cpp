// MPI life cycle: initialise once with the thread level kdacp needs (see
// kdacp/mpi.hpp), adopt an MPI the host application already initialised, and
// finalise only what we initialised.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "comm/mpi/internal.hpp"
#include "kdacp/error.hpp"
#include "kdacp/mpi.hpp"

namespace kdacp {

MpiSession::MpiSession() : MpiSession(nullptr, nullptr) {}

MpiSession::MpiSession(int* argc, char*** argv) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized)
    throw Error("MpiSession: MPI was already finalised in this process, expected it "
                "uninitialised or still running (MPI cannot be initialised twice)");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    // The host application owns MPI: keep its thread level and let it finalise.
    MPI_Query_thread(&thread_level_);
    return;
  }
  const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &thread_level_);
  if (rc != MPI_SUCCESS)
    throw Error("MpiSession: MPI_Init_thread(MPI_THREAD_SERIALIZED) failed: " + mpi::error_text(rc));
  owns_ = true;
}

MpiSession::~MpiSession() {
  if (!owns_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

std::size_t MpiSession::world_rank() const {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return static_cast<std::size_t>(rank);
}

std::size_t MpiSession::world_size() const {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return static_cast<std::size_t>(size);
}

void MpiSession::abort(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
#if defined(KDACP_SMPI)
  // Simulated, every rank is a thread of smpirun's one process, and SMPI's
  // MPI_Abort ends the actors but lets smpirun exit 0: the process ends
  // here, with the code, as a job would.
  (void)initialized, (void)finalized;
  std::fflush(stdout);
  std::fflush(stderr);
#else
  // MPI_Abort makes the launcher kill every process of the job; without a
  // running MPI there is no job to end but our own process.
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::_Exit(code);
}

}  // namespace kdacp
