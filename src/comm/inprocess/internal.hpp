// Private to the in-process backend: the world's shared state, the matching
// structures and the communicator. world.cpp owns the life cycle,
// communicator.cpp the collectives, request.cpp point-to-point and requests.
//
// One mutex per world guards every field below that is not marked immutable;
// each rank sleeps on its own condition variable and is woken only by events
// that concern it (a message for it, a collective of its group completing, a
// peer failing), so with more ranks than cores a message does not wake every
// rank. Copies run outside the lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/comm.hpp"
#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"

namespace kdacp::inprocess {

using Clock = std::chrono::steady_clock;

enum class Status { running, exited, failed };

// One collective call of a group, matched by its sequence number.
struct Collective {
  std::string op;
  std::size_t bytes = 0;
  std::vector<const void*> ptrs;
  // One flag per member. Plain bytes, not vector<bool>: bits of one word are
  // not separate memory locations, and these flags belong to different ranks.
  std::vector<unsigned char> here;
  std::size_t arrived = 0;
  std::size_t departed = 0;
  // Set when a member gave up waiting (timeout, failed peer): its buffer is
  // gone, so nobody may complete this collective any more.
  std::string abandoned;
};

// A receive waiting for its send. The receiver owns it (in its request);
// the group lists it while it is registered.
struct PostedRecv {
  std::size_t src = 0, dst = 0;
  int tag = 0;
  std::span<std::byte> buf;
  bool claimed = false;  // a sender is copying into buf
  bool done = false;
  std::string error;  // set when the matched send had the wrong size
};

// A send that arrived before its receive: a copy in cached large-buffer
// memory (kdacp/memory.hpp), so that messages of a few MiB per call do not fault
// fresh pages in every time.
class Bytes {
 public:
  Bytes() = default;
  explicit Bytes(std::span<const std::byte> src);
  Bytes(Bytes&& o) noexcept;
  Bytes& operator=(Bytes&& o) noexcept;
  ~Bytes();
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;

  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<const std::byte> span() const { return {data_, size_}; }

 private:
  void reset() noexcept;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

struct Message {
  std::size_t src = 0, dst = 0;
  int tag = 0;
  Bytes data;
};

struct Group {
  // Immutable once the group is published in WorldState::groups.
  std::string id;
  std::vector<std::size_t> members;  // global ranks, group order

  std::vector<std::uint64_t> next_seq;
  std::vector<std::uint64_t> next_split;
  std::map<std::uint64_t, std::shared_ptr<Collective>> collectives;
  std::deque<Message> unexpected;
  std::list<PostedRecv*> posted;

  Group(std::string group_id, std::vector<std::size_t> group_members);
};

struct WorldState {
  WorldState(std::size_t world_size, InProcessOptions world_options);

  // Immutable.
  const std::size_t size;
  const InProcessOptions options;
  // The world group, kept apart from `groups` so that handing out a world
  // communicator needs no lock while ranks insert split groups.
  const std::shared_ptr<Group> world_group;

  std::mutex mu;
  std::unique_ptr<std::condition_variable[]> cvs;  // one per global rank
  std::vector<Status> status;
  std::vector<std::string> failure;
  std::map<std::string, std::shared_ptr<Group>> groups;  // split groups by id

  // Lock held.
  void wake(std::size_t global) { cvs[global].notify_all(); }
  void wake_all();
  // A peer that will never answer: failed or exited. Empty while running.
  std::string gone(std::size_t global) const;
};

class InProcessComm final : public Communicator,
                            public std::enable_shared_from_this<InProcessComm> {
 public:
  InProcessComm(std::shared_ptr<WorldState> world, std::shared_ptr<Group> group, std::size_t me);

  std::size_t rank() const override { return me_; }
  std::size_t size() const override { return group_->members.size(); }
  const std::vector<std::size_t>& global_ranks() const override { return group_->members; }
  std::size_t world_size() const override { return world_->size; }
  std::string backend() const override { return "inprocess"; }
  std::chrono::milliseconds timeout() const override { return world_->options.timeout; }
  CommStats stats() const override { return stats_; }

  void all_gather(std::span<std::byte> buffer) override;
  void broadcast(std::span<std::byte> buffer, std::size_t root) override;
  void barrier() override;
  std::unique_ptr<Request> isend(std::span<const std::byte> data, std::size_t peer,
                                 int tag) override;
  std::unique_ptr<Request> irecv(std::span<std::byte> data, std::size_t peer, int tag) override;
  std::shared_ptr<Communicator> split(int color, int key) override;

  // Waits (lock held) until pred(). Throws RemoteError when a peer that
  // pending() still awaits failed or exited, Timeout at the deadline.
  template <class Pending, class Pred>
  void wait_for(std::unique_lock<std::mutex>& lock, Clock::time_point deadline,
                const std::string& op, Pending pending, Pred pred) {
    for (;;) {
      if (pred()) return;
      for (std::size_t p : pending()) {
        const std::string why = world_->gone(group_->members[p]);
        if (!why.empty())
          throw RemoteError(fmt::format("{}{}: peer rank {} {}", who(), op, group_->members[p], why));
      }
      if (world_->cvs[group_->members[me_]].wait_until(lock, deadline) ==
              std::cv_status::timeout &&
          !pred()) {
        std::vector<std::size_t> peers;
        for (std::size_t p : pending()) peers.push_back(group_->members[p]);
        throw Timeout(fmt::format("{}{}: timed out after {} ms waiting for peer rank(s){}{}", who(), op,
                                  world_->options.timeout.count(), peers.empty() ? "" : " ",
                                  fmt::join(peers, " ")));
      }
    }
  }

  // "rank G (group ID): ", the prefix of every error message.
  std::string who() const;

  WorldState& world() { return *world_; }
  Group& group() { return *group_; }

 private:
  void check_peer(std::size_t peer, const char* op) const;
  static void check_tag(int tag, const char* op);

  // Lock held: the unclaimed receive posted by group rank `dst` for a
  // message from us with `tag`, or nullptr.
  PostedRecv* find_posted(std::size_t dst, int tag);
  // Copies a send into a matched posted receive, outside the lock.
  void deliver(std::unique_lock<std::mutex>& lock, PostedRecv& r,
               std::span<const std::byte> data);

  // The rendezvous of every collective; defined in communicator.cpp, the only
  // file that instantiates it.
  template <class Fn>
  void rendezvous(const char* op, const void* ptr, std::size_t bytes, bool wait_departure,
                  Fn&& fn);
  // Lock held: every member of this group.
  void wake_group();

  std::shared_ptr<WorldState> world_;
  std::shared_ptr<Group> group_;
  std::size_t me_;
  // Touched only by the rank thread that owns this handle.
  CommStats stats_;
};

}  // namespace kdacp::inprocess
