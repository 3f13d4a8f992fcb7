// Fault injection for the failure tests (SPEC §8): a Communicator that wraps
// any other and, per a plan, delays, drops or fails a chosen operation of a
// chosen rank, or makes the rank raise a signal there (SIGKILL: a process that
// dies mid-call; SIGSTOP: one that stops answering). Part of kdacp_testing.
//
// A protocol only goes through the wrapper when its mesh is built on it:
// DeviceMesh::create(injector.wrap(world), ...). Every communicator split
// from a wrapped one is wrapped too, and all of a rank's wrappers share that
// rank's operation counters, so "the 3rd isend of rank 2" means the same
// whatever sub-group the protocol sends it on.
//
// Threading: each rank's counters are touched only by the thread that drives
// that rank's communicators (the rule every backend already imposes), so the
// ranks of one in-process world may share one injector without locks.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/error.hpp"

namespace kdacp::testing {

namespace detail {
struct FaultState;
}

// The operations a fault can be aimed at. `collective` counts all_gather,
// broadcast, barrier and split; `any` counts every operation.
enum class FaultOp { isend, irecv, collective, any };

enum class FaultAction {
  // Sleep `duration`, then perform the operation: a late message, or, with a
  // duration beyond the timeout, a rank that stops answering for a while and
  // then resumes (what SIGSTOP followed by SIGCONT does to a process).
  delay,
  // isend only: the message is never sent and the send completes at once, as
  // if the network lost it; its receiver waits in vain.
  drop,
  // Throw InjectedFault instead of performing the operation: a rank that fails.
  fail,
  // raise(`signal`), then perform the operation (if the process still runs).
  signal,
};

struct Fault {
  std::size_t rank = 0;  // global rank
  FaultOp op = FaultOp::any;
  // Which operation of kind `op`, counted from 0 since the rank's arm().
  std::size_t index = 0;
  FaultAction action = FaultAction::delay;
  std::chrono::milliseconds duration{0};  // delay
  int signal = 0;                         // signal
};

// The failure a `fail` fault throws: a root cause, neither Timeout nor
// RemoteError, so in-process runs rethrow it over the errors it causes.
class InjectedFault : public Error {
 public:
  using Error::Error;
};

class FaultInjector {
 public:
  // `world_size` bounds the global ranks of the plan. Throws InvalidArgument
  // for a rank outside the world, a drop aimed at anything but isend, a signal
  // fault without a signal, or a negative delay.
  FaultInjector(std::size_t world_size, std::vector<Fault> plan);

  // A communicator that behaves like `comm` except for the planned faults of
  // its rank. Operations are not counted until that rank's arm().
  std::shared_ptr<Communicator> wrap(std::shared_ptr<Communicator> comm);

  // Starts counting `rank`'s operations from 0, so that a plan can aim at an
  // exchange's calls and not at the splits that built its mesh. Called by the
  // rank's own thread.
  void arm(std::size_t rank);

  // How many of `rank`'s faults took effect: read by the rank's own thread,
  // or after the ranks were joined.
  std::size_t fired(std::size_t rank) const;

 private:
  std::shared_ptr<detail::FaultState> shared_;
};

}  // namespace kdacp::testing
