// The MPI communicator's collectives: all_gather, broadcast, barrier and
// split, each after the header agreement (header.cpp) and, on a real
// cluster, as the non-blocking MPI call completed within the timeout.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/mpi/internal.hpp"
#include "kdacp/error.hpp"

#if defined(KDACP_SMPI)
#include <simgrid/s4u/Actor.hpp>
#endif

namespace kdacp::mpi {

namespace {

#if defined(KDACP_SMPI)
// SMPI 3.32's own recursive doubling fails once a round's message reaches
// 2 GiB (P = 1024 at H = 32: the host ran out of memory inside SMPI). Past
// kSmpiLargeMessage kdacp runs the same algorithm, round for round (the
// member q ^ 2^k exchanges the 2^k slots each side holds), with every
// message of a round cut into pieces under 1 GiB that travel together.
constexpr std::size_t kSmpiLargeMessage = std::size_t{1} << 31;
constexpr std::size_t kSmpiPiece = std::size_t{1} << 30;

// The last round's message size from which the own algorithm runs:
// kSmpiLargeMessage, or KDACP_SMPI_OWN_ALLGATHER_FROM (bytes, at least 1),
// with which make test's small simulation runs it on every all-gather to
// check its bytes and its time against SMPI's (scripts/simulate.py --check).
std::size_t own_all_gather_from() {
  static const std::size_t from = [] {
    const char* env = std::getenv("KDACP_SMPI_OWN_ALLGATHER_FROM");
    if (env == nullptr || *env == '\0') return kSmpiLargeMessage;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (*end != '\0' || v == 0 || env[0] == '-')
      throw InvalidArgument(
          fmt::format("KDACP_SMPI_OWN_ALLGATHER_FROM is '{}', expected a byte count of at least 1", env));
    return static_cast<std::size_t>(v);
  }();
  return from;
}
#endif

}  // namespace

void MpiComm::all_gather(std::span<std::byte> buffer) {
  const std::size_t n = size_;
  if (buffer.size() % n != 0)
    throw InvalidArgument(fmt::format("{}all_gather buffer of {} bytes, expected a multiple of the group size {}",
                                      who(), buffer.size(), n));
  const std::size_t slot = buffer.size() / n;
  agree(Op::all_gather, slot, 0);
#if defined(KDACP_SMPI)
  // Simulated: the blocking collective, whose algorithm smpirun selects
  // (scripts/simulate.py: recursive doubling, one of Open MPI's
  // MPI_Iallgather algorithms and the one the cost model prices). SMPI's
  // MPI_Iallgather posts all P - 1 sends at once, O(P²) simulated flows:
  // 21 minutes of real time for one P = 256 sweep row (docs/scale.md).
  // A slot is counted in 8-byte words: SMPI 3.32's recursive doubling
  // counts a round's message in an int of elements, which in bytes
  // overflowed at P/2 slots of 4 MiB (P = 1024, H = 32). Not a derived
  // type: SMPI copies those through a buffer it allocates per message,
  // which at that size took all of this host's memory.
  if (n > 1 && (n & (n - 1)) == 0 && (n / 2) * slot >= own_all_gather_from() && slot % 8 == 0) {
    doubling_all_gather(buffer, slot);
  } else {
    const ByteType type(slot, options_.max_message_bytes, /*words=*/true);
    check(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer.data(), type.count(), type.type(), comm_),
          "all_gather");
  }
#else
  const ByteType type(slot, options_.max_message_bytes);
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer.data(), type.count(), type.type(), comm_, &req),
        "all_gather");
  wait_collective(req, fmt::format("all_gather of {} bytes per slot", slot));
#endif
  stats_.bytes_received += slot * (n - 1);
  stats_.bytes_sent += slot * (n - 1);
  ++stats_.messages_sent;
}

#if defined(KDACP_SMPI)
void MpiComm::doubling_all_gather(std::span<std::byte> buffer, std::size_t slot) {
  const std::size_t n = size_, me = rank_;
  std::vector<MPI_Request> reqs;
  for (std::size_t mask = 1; mask < n; mask <<= 1) {
    const std::size_t peer = me ^ mask;
    const std::size_t mine = me & ~(mask - 1), theirs = peer & ~(mask - 1);
    const std::size_t bytes = mask * slot;
    reqs.clear();
    for (std::size_t at = 0; at < bytes; at += kSmpiPiece) {
      const std::size_t len = std::min(kSmpiPiece, bytes - at);
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Irecv(buffer.data() + theirs * slot + at, static_cast<int>(len / 8), MPI_UINT64_T,
                      static_cast<int>(peer), header_tag_, comm_, &reqs.back()),
            "all_gather");
      reqs.push_back(MPI_REQUEST_NULL);
      check(MPI_Isend(buffer.data() + mine * slot + at, static_cast<int>(len / 8), MPI_UINT64_T,
                      static_cast<int>(peer), header_tag_, comm_, &reqs.back()),
            "all_gather");
    }
    check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), "all_gather");
  }
}
#endif

void MpiComm::broadcast(std::span<std::byte> buffer, std::size_t root) {
  check_peer(root, "broadcast");
  agree(Op::broadcast, buffer.size(), root);
  const ByteType type(buffer.size(), options_.max_message_bytes);
#if defined(KDACP_SMPI)
  // Simulated: the blocking collective, a binomial tree (smpirun's
  // selection in scripts/simulate.py, what the model prices); SMPI's
  // MPI_Ibcast sends from the root to every member in turn.
  check(MPI_Bcast(buffer.data(), type.count(), type.type(), static_cast<int>(root), comm_), "broadcast");
#else
  MPI_Request req = MPI_REQUEST_NULL;
  check(MPI_Ibcast(buffer.data(), type.count(), type.type(), static_cast<int>(root), comm_, &req), "broadcast");
  wait_collective(req, fmt::format("broadcast of {} bytes from rank {}", buffer.size(), global_[root]));
#endif
  if (root == rank_) stats_.bytes_sent += buffer.size() * (size_ - 1);
  else stats_.bytes_received += buffer.size();
  ++stats_.messages_sent;
}

// The agreement's all-reduce completing proves every member arrived.
// Simulated, every member also leaves at the same instant (below).
void MpiComm::barrier() {
  agree(Op::barrier, 0, 0);
#if defined(KDACP_SMPI)
  leave_together();
#endif
}

#if defined(KDACP_SMPI)
// A barrier lets its members go at different times (an all-reduce's last
// round reaches some before others), and a call timed after it would count
// that skew: simulated, each member learns the latest entry and the latest
// exit of an all-reduce, and all sleep until the same instant beyond the
// next one's end (twice that all-reduce's span later), so that timed calls
// start together, as the cost model assumes.
void MpiComm::leave_together() {
  const double entry = MPI_Wtime();
  double latest_entry = entry, latest_exit = entry;
  check(MPI_Allreduce(&entry, &latest_entry, 1, MPI_DOUBLE, MPI_MAX, comm_), "barrier");
  const double exit = MPI_Wtime();
  check(MPI_Allreduce(&exit, &latest_exit, 1, MPI_DOUBLE, MPI_MAX, comm_), "barrier");
  simgrid::s4u::this_actor::sleep_until(latest_exit + 2 * (latest_exit - latest_entry) + 1e-6);
}
#endif

std::shared_ptr<Communicator> MpiComm::split(int color, int key) {
  // The agreement bounds the wait for the members; once it completed,
  // every member is inside split() and MPI_Comm_split cannot hang on one.
  agree(Op::split, 0, 0);
  MPI_Comm out = MPI_COMM_NULL;
  check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out), "split");
  if (out == MPI_COMM_NULL) return nullptr;
  return std::make_shared<MpiComm>(out, options_, world_size_);
}

// Completes a collective's data transfer within the deadline. Every member
// joined (the agreement proved it), so a timeout here means one stopped
// answering in the middle of the transfer, which MPI cannot attribute to a
// member.
void MpiComm::wait_collective(MPI_Request& req, const std::string& what) {
  MPI_Status status;
  int rc = MPI_SUCCESS;
  if (!poll(&req, &status, Clock::now() + options_.timeout, &rc)) {
    throw Timeout(fmt::format("{}{}: timed out after {} ms in the data transfer with the group's members (global "
                              "ranks [{}]), which all joined it",
                              who(), what, options_.timeout.count(), fmt::join(global_, ",")));
  }
  if (rc != MPI_SUCCESS) throw RemoteError(who() + what + ": " + error_text(rc));
}

}  // namespace kdacp::mpi
