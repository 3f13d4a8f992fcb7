// Open MPI backend (target kdacp::kdacp_mpi): one rank per process, across
// processes and hosts. This header never includes <mpi.h>; consumers of the
// backend need no MPI headers or flags.
//
// Threading: kdacp calls MPI from at most one thread at a time per process
// (a protocol drives its communicators from the calling thread; the kernels'
// thread pool never calls MPI), so MPI_THREAD_SERIALIZED is what the library
// needs. SERIALIZED rather than FUNNELED because the calling thread need not
// be the thread that initialised MPI (a training framework may run the
// exchange on a worker thread). It follows that two threads must not use MPI
// communicators of one process at the same time.
//
// Failure model: every wait polls with a bound (the communicator timeout), so
// a peer that stops answering turns into Timeout on the waiting rank, naming
// the peer it waited for (a rank blocked behind a stopped one is such a peer
// too: MPI has no failure detector to name the stopped rank instead). Open
// MPI itself ends the whole job when a process dies. After a Timeout or
// RemoteError an MPI communicator must not be used again: the abandoned
// operation may still complete later and write into its buffers. The usual
// reaction is to report the error and call MpiSession::abort().
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>

#include "kdacp/comm.hpp"
#include "kdacp/defaults.hpp"

namespace kdacp {

// RAII owner of the MPI library state of this process.
class MpiSession {
 public:
  // Initialises MPI with MPI_THREAD_SERIALIZED unless the host application
  // already did (then the session adopts it and will not finalise). argc/argv
  // may be null. Throws Error when MPI cannot be initialised, or when it was
  // already finalised.
  MpiSession();
  MpiSession(int* argc, char*** argv);
  // Finalises MPI if this session initialised it. Communicators still alive
  // must have been released first (their MPI handles are freed with them).
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  // True when this session called MPI_Init_thread (and will finalise).
  bool owns() const { return owns_; }
  // The thread level MPI provides (MPI_THREAD_* value as an int).
  int thread_level() const { return thread_level_; }
  // Rank and size in MPI_COMM_WORLD.
  std::size_t world_rank() const;
  std::size_t world_size() const;

  // Ends the whole job at once (MPI_Abort on MPI_COMM_WORLD) with `code`:
  // the way out after an error on one rank, since a clean MPI_Finalize would
  // wait for peers that may be blocked on this rank.
  [[noreturn]] static void abort(int code);

 private:
  bool owns_ = false;
  int thread_level_ = 0;
};

struct MpiOptions {
  // Bound on every blocking wait (collectives, send/receive completion).
  std::chrono::milliseconds timeout = defaults::kTimeout;
  // Largest byte count handed to MPI as one count of MPI_BYTE. Larger
  // buffers are described by a derived datatype of chunks of this size (MPI
  // counts are int). Test knob: a small value reaches the > 2 GiB path with
  // tiny buffers. Must be in [1, INT_MAX].
  std::size_t max_message_bytes = 2147483647;
};

// The world communicator: a duplicate of MPI_COMM_WORLD, so that kdacp
// traffic never matches the application's. Collective over MPI_COMM_WORLD.
// Requires an initialised MPI (an MpiSession, or the host application).
// Every collective first agrees on its byte count and root across the group
// (one small message to every member, on the top tag MPI allows, which user
// tags must stay below), so a rank whose buffer differs from its peers' gets
// InvalidArgument and its peers RemoteError, naming the rank, before any data
// moves, and a member that never joins is a Timeout naming it; a
// point-to-point message of the wrong size is a RemoteError on the receiver
// naming the sender.
std::shared_ptr<Communicator> mpi_world(MpiOptions options = {});

// True when this process was started by an MPI launcher (mpirun/mpiexec,
// srun with PMI/PMIx): reads the environment only, MPI need not be
// initialised.
bool launched_by_mpirun();
// The number of processes the launcher started, from the environment
// (OMPI_COMM_WORLD_SIZE, PMI_SIZE); nullopt when unknown or not launched.
std::optional<std::size_t> mpi_world_size_from_env();

}  // namespace kdacp
