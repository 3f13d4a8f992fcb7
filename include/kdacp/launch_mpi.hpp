// The MPI backend of launch() (kdacp/launch.hpp), in kdacp_mpi.
#pragma once

#include "kdacp/launch.hpp"

namespace kdacp {

// Launcher named "mpi": started() is true under mpirun with more than one
// process. run() starts MPI (MpiSession), builds the world communicator with
// LaunchOptions::timeout_s and calls fn; an error on any rank is printed to
// stderr as "kdacp: error: rank R: ..." and aborts the whole job with exit
// code 2, since a clean MPI_Finalize would wait for peers blocked on it.
ProcessLauncher mpi_launcher();

}  // namespace kdacp
