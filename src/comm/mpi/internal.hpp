// Private to the MPI backend: the communicator class and what its files
// share. communicator.cpp owns the life cycle and mpi_world(), header.cpp
// the collective header agreement (and the errors that name disagreeing or
// missing members), collectives.cpp the collectives' data transfers,
// point_to_point.cpp isend/irecv and their requests, wait.cpp the bounded
// waits, datatype.cpp the description of large buffers.
//
// Simulation (the SMPI build, KDACP_SMPI; docs/scale.md): the same code runs
// on SimGrid's SMPI, where ranks are simulated actors and time is simulated.
// There the deadlines follow MPI_Wtime (simulated seconds) and a wait is one
// MPI_Wait(all): polling would charge SMPI's per-MPI_Test cost to the
// simulated clock and blur every completion time. A wait that ends after its
// deadline is the same Timeout as on a real cluster; a wait that can never
// end is a deadlock, which the simulator detects at once and reports with
// every blocked rank before it stops the run.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/mpi.hpp"

#if defined(KDACP_SMPI)
#include "comm/smpi/shared_memory.hpp"
#endif

// Hidden: before the split these lived in communicator.cpp's anonymous
// namespace. kdacp_mpi and kdacp_smpi each define their own MpiComm (the SMPI
// one has another layout), so neither library may export or interpose them.
#pragma GCC visibility push(hidden)

namespace kdacp::mpi {

// Shared-memory mode (comm/smpi/shared_memory.hpp): the flops a rank's fold
// steps charged since its last MPI call go on its clock before the next one.
inline void charge_compute() {
#if defined(KDACP_SMPI)
  smpi::charge_pending_compute();
#endif
}

#if defined(KDACP_SMPI)
// Simulated seconds, as a std::chrono clock so that deadlines read the same.
struct Clock {
  using duration = std::chrono::duration<double>;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<Clock, duration>;
  static constexpr bool is_steady = true;
  static time_point now() {
    charge_compute();
    return time_point(duration(MPI_Wtime()));
  }
};
#else
using Clock = std::chrono::steady_clock;
#endif

// MPI's text for an error code.
std::string error_text(int code);

// MPI is initialised and not yet finalised: handles may be freed.
bool mpi_running();

// Completes `count` requests or gives up at `deadline` (wait.cpp). Returns
// false when the deadline passed first (the requests may still be active,
// and MPI may still write into their buffers), true with the MPI return
// code in `rc` otherwise.
bool complete(int count, MPI_Request* requests, MPI_Status* statuses, Clock::time_point deadline, int* rc);

// Completes one request (see complete()).
bool poll(MPI_Request* req, MPI_Status* status, Clock::time_point deadline, int* rc);

// `bytes` contiguous bytes as (count, datatype) within MPI's int counts
// (datatype.cpp).
class ByteType {
 public:
  // words: a buffer of whole 8-byte words as that many MPI_UINT64_T, a
  // predefined type, so that a collective's counts are 8 times smaller.
  ByteType(std::size_t bytes, std::size_t max_chunk, bool words = false);
  ~ByteType();
  ByteType(const ByteType&) = delete;
  ByteType& operator=(const ByteType&) = delete;

  int count() const { return count_; }
  MPI_Datatype type() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_BYTE;
  int count_ = 0;
};

// The collective header every member contributes before the data moves.
enum class Op : std::uint64_t { all_gather = 1, broadcast, barrier, split };
constexpr std::size_t kHeaderWords = 3;  // op, bytes, root

const char* op_name(std::uint64_t op);

// Operations whose deadline passed while MPI still owns their buffers: kept
// alive with them until the communicator goes away.
struct Abandoned {
  std::vector<MPI_Request> requests;
  std::vector<std::uint64_t> send, recv;
};

class MpiComm final : public Communicator, public std::enable_shared_from_this<MpiComm> {
 public:
  MpiComm(MPI_Comm comm, MpiOptions options, std::size_t world_size);
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  std::size_t rank() const override { return rank_; }
  std::size_t size() const override { return size_; }
  const std::vector<std::size_t>& global_ranks() const override { return global_; }
  std::size_t world_size() const override { return world_size_; }
  std::string backend() const override { return "mpi"; }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  CommStats stats() const override { return stats_; }
#if defined(KDACP_SMPI)
  double now_seconds() const override {
    charge_compute();
    return MPI_Wtime();
  }
#endif

  void all_gather(std::span<std::byte> buffer) override;
  void broadcast(std::span<std::byte> buffer, std::size_t root) override;
  void barrier() override;
  std::unique_ptr<Request> isend(std::span<const std::byte> data, std::size_t peer, int tag) override;
  std::unique_ptr<Request> irecv(std::span<std::byte> data, std::size_t peer, int tag) override;
  std::shared_ptr<Communicator> split(int color, int key) override;

  // "rank R (mpi group [...]): ", the prefix of every message.
  std::string who() const;
  // Throws Error naming the operation for a failed MPI call.
  void check(int rc, const std::string& op) const;
  void check_peer(std::size_t peer, const char* op) const;
  void check_tag(int tag, const char* op) const;

  const MpiOptions& options() const { return options_; }
  MPI_Comm handle() const { return comm_; }
  const std::vector<std::size_t>& globals() const { return global_; }

 private:
  // header.cpp: compares the members' (op, bytes, root) and throws when
  // they disagree or one does not join in time.
  void agree(Op op, std::size_t bytes, std::size_t root);
  bool probe_headers(Abandoned& probe, const std::string& what);
  void exchange_headers(Op op, std::size_t bytes, std::size_t root, bool joined, const std::string& what);
  [[noreturn]] void throw_disagreement(const std::vector<std::uint64_t>& headers, const std::string& what) const;

  // collectives.cpp
  void wait_collective(MPI_Request& req, const std::string& what);
#if defined(KDACP_SMPI)
  void doubling_all_gather(std::span<std::byte> buffer, std::size_t slot);
  void leave_together();
#endif

  MPI_Comm comm_;
  MpiOptions options_;
  std::size_t world_size_;
  std::size_t rank_ = 0, size_ = 0;
  std::vector<std::size_t> global_;
  int header_tag_ = 32767;
  CommStats stats_;
  std::list<std::unique_ptr<Abandoned>> abandoned_;
};

}  // namespace kdacp::mpi

#pragma GCC visibility pop
