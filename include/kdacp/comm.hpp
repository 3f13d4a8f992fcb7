// The abstract communicator: what a protocol may ask of a backend.
//
// A Communicator is one group of ranks (a world or a sub-group). Every member
// calls a collective in the same order. Every blocking call is bounded by the
// communicator's timeout and throws Timeout when it expires, or RemoteError
// when a peer it waits on has failed or exited; messages name the rank, the
// peer and the operation. Backends live in their own folders (inprocess/,
// mpi/); their headers never leak through this one.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kdacp {

// Traffic counters of one communicator handle (this rank only).
struct CommStats {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t messages_sent = 0;  // p2p sends + collective calls
};

// Completion handle of a non-blocking send or receive.
class Request {
 public:
  virtual ~Request() = default;
  // Blocks until the operation completed. Throws Timeout / RemoteError.
  // Calling wait() again after success returns at once.
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // Position of this rank inside the group, 0..size()-1.
  virtual std::size_t rank() const = 0;
  virtual std::size_t size() const = 0;
  // Global (world) rank of every member, in group order.
  virtual const std::vector<std::size_t>& global_ranks() const = 0;
  // Size of the world this group was derived from.
  virtual std::size_t world_size() const = 0;
  // Short backend name ("inprocess", "mpi").
  virtual std::string backend() const = 0;

  // In-place all-gather: `buffer` holds size() equal slots; this rank has
  // already written slot rank(). On return every slot holds its member's data.
  virtual void all_gather(std::span<std::byte> buffer) = 0;
  // Broadcast `buffer` from group rank `root` to every member.
  virtual void broadcast(std::span<std::byte> buffer, std::size_t root) = 0;
  virtual void barrier() = 0;
  // Non-blocking point-to-point. `peer` is a group rank; tags must be >= 0.
  // The buffer must stay valid until wait() returned.
  virtual std::unique_ptr<Request> isend(std::span<const std::byte> data, std::size_t peer,
                                         int tag) = 0;
  virtual std::unique_ptr<Request> irecv(std::span<std::byte> data, std::size_t peer,
                                         int tag) = 0;

  // Collective over this group: members passing the same `color` form a new
  // group, ordered by (key, rank). A negative color takes no part in any new
  // group and gets nullptr. Every member derives the same groups.
  virtual std::shared_ptr<Communicator> split(int color, int key) = 0;

  virtual std::chrono::milliseconds timeout() const = 0;
  virtual CommStats stats() const = 0;

  // Seconds on the clock this backend's timeouts follow, for timing calls:
  // steady wall time, or the simulated time of a simulator (the SMPI build,
  // docs/scale.md). Only differences mean anything.
  virtual double now_seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
};

}  // namespace kdacp
