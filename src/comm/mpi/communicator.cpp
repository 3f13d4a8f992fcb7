// The MPI communicator: the semantics of the in-process backend over MPI.
// This file holds its life cycle and mpi_world(); the operations are split
// by concern (internal.hpp lists the files).
//
// Every wait is bounded by the communicator's timeout (wait.cpp): MPI cannot
// bound a blocking call, so every operation is non-blocking and completed by
// polling. Every collective first agrees on its operation, byte count and
// root across the group (header.cpp), so that members that disagree are
// named instead of corrupting buffers or hanging.
#include <climits>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/mpi/internal.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

namespace mpi {

MpiComm::MpiComm(MPI_Comm comm, MpiOptions options, std::size_t world_size)
    : comm_(comm), options_(options), world_size_(world_size) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm_, &rank);
  MPI_Comm_size(comm_, &size);
  rank_ = static_cast<std::size_t>(rank);
  size_ = static_cast<std::size_t>(size);
  MPI_Group mine = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_Comm_group(comm_, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> local(size_), global(size_);
  for (std::size_t i = 0; i < size_; ++i) local[i] = static_cast<int>(i);
  MPI_Group_translate_ranks(mine, size, local.data(), world, global.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
  global_.assign(global.begin(), global.end());
  int tag_ub_flag = 0;
  int* tag_ub = nullptr;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &tag_ub_flag);
  // The standard guarantees at least 32767; the top tag carries the
  // collective headers, so user tags end one below it.
  header_tag_ = tag_ub_flag ? *tag_ub : 32767;
}

MpiComm::~MpiComm() {
  if (!mpi_running()) return;
  for (auto& a : abandoned_) {
    int flag = 0;
    MPI_Testall(static_cast<int>(a->requests.size()), a->requests.data(), &flag, MPI_STATUSES_IGNORE);
    // Still active: MPI may write into its buffers at any time, so they
    // must never be freed. Only happens after a Timeout, when the process
    // is expected to abort anyway.
    if (!flag) a.release();
  }
  MPI_Comm_free(&comm_);
}

std::string MpiComm::who() const {
  const std::string group =
      size_ <= 16 ? fmt::format("[{}]", fmt::join(global_, ",")) : fmt::format("{} ranks from {}", size_, global_.front());
  return fmt::format("rank {} (mpi group {}): ", global_[rank_], group);
}

void MpiComm::check(int rc, const std::string& op) const {
  if (rc != MPI_SUCCESS) throw Error(who() + op + ": " + error_text(rc));
}

void MpiComm::check_peer(std::size_t peer, const char* op) const {
  if (peer >= size_)
    throw InvalidArgument(fmt::format("{}{} peer {} outside the group of size {}", who(), op, peer, size_));
}

void MpiComm::check_tag(int tag, const char* op) const {
  if (tag < 0 || tag >= header_tag_)
    throw InvalidArgument(fmt::format("{}{} tag {}, expected 0..{}", who(), op, tag, header_tag_ - 1));
}

}  // namespace mpi

std::shared_ptr<Communicator> mpi_world(MpiOptions options) {
  if (!mpi::mpi_running())
    throw Error("mpi_world: MPI is not running, expected an initialised MPI (create an "
                "MpiSession first, and keep it alive while communicators exist)");
  if (options.max_message_bytes < 1 || options.max_message_bytes > static_cast<std::size_t>(INT_MAX))
    throw InvalidArgument(
        fmt::format("mpi_world: max_message_bytes is {}, expected 1..{}", options.max_message_bytes, INT_MAX));
  if (options.timeout.count() <= 0)
    throw InvalidArgument(fmt::format("mpi_world: timeout is {} ms, expected > 0", options.timeout.count()));
  int world_rank = 0, world_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  // Our own context: kdacp's tags can never match the application's.
  MPI_Comm dup = MPI_COMM_NULL;
#if defined(KDACP_SMPI)
  // SMPI lacks MPI_Comm_idup; a simulated rank that never arrives is a
  // deadlock the simulator reports.
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
#else
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(MPI_COMM_WORLD, &dup, &req);
  if (rc == MPI_SUCCESS) {
    if (!mpi::poll(&req, MPI_STATUS_IGNORE, mpi::Clock::now() + options.timeout, &rc))
      throw Timeout(fmt::format("rank {}: mpi_world: duplicating MPI_COMM_WORLD timed out after {} ms waiting for the "
                                "other {} processes",
                                world_rank, options.timeout.count(), world_size - 1));
  }
#endif
  if (rc != MPI_SUCCESS)
    throw Error(fmt::format("rank {}: mpi_world: MPI_Comm_idup failed: {}", world_rank, mpi::error_text(rc)));
  return std::make_shared<mpi::MpiComm>(dup, options, static_cast<std::size_t>(world_size));
}

}  // namespace kdacp
