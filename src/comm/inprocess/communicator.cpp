// The in-process communicator's collectives (all_gather, broadcast, barrier,
// split). They rendezvous on a per-group sequence number: each member
// publishes a pointer, waits for all members, copies what it needs from its
// peers, then (when peers read its buffer) waits until all members are done
// copying before it may return.
#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>

#include <fmt/format.h>

#include "comm/inprocess/internal.hpp"
#include "kdacp/error.hpp"

namespace kdacp::inprocess {

InProcessComm::InProcessComm(std::shared_ptr<WorldState> world, std::shared_ptr<Group> group,
                             std::size_t me)
    : world_(std::move(world)), group_(std::move(group)), me_(me) {}

std::string InProcessComm::who() const {
  return fmt::format("rank {} (group {}): ", group_->members[me_], group_->id);
}

void InProcessComm::check_peer(std::size_t peer, const char* op) const {
  if (peer >= size())
    throw InvalidArgument(fmt::format("{}{} peer {} outside the group of size {}", who(), op, peer, size()));
}

void InProcessComm::check_tag(int tag, const char* op) {
  if (tag < 0)
    throw InvalidArgument(fmt::format("{} tag {}, expected >= 0", op, tag));
}

void InProcessComm::wake_group() {
  for (std::size_t g : group_->members) world_->wake(g);
}

template <class Fn>
void InProcessComm::rendezvous(const char* op, const void* ptr, std::size_t bytes,
                               bool wait_departure, Fn&& fn) {
  const std::size_t n = size();
  const auto deadline = Clock::now() + world_->options.timeout;
  std::unique_lock lock(world_->mu);
  const std::uint64_t seq = group_->next_seq[me_]++;
  auto& slot = group_->collectives[seq];
  if (!slot) {
    slot = std::make_shared<Collective>();
    slot->op = op;
    slot->bytes = bytes;
    slot->ptrs.assign(n, nullptr);
    slot->here.assign(n, 0);
  }
  std::shared_ptr<Collective> c = slot;
  if (c->op != op || c->bytes != bytes) {
    // The first caller's op stays in the slot for the others to compare
    // against; this member fails here.
    throw InvalidArgument(fmt::format("{}{} of {} bytes, but a peer called {} of {} bytes as collective #{}", who(),
                                      op, bytes, c->op, c->bytes, seq));
  }
  c->ptrs[me_] = ptr;
  c->here[me_] = 1;
  ++c->arrived;
  if (c->arrived == n) wake_group();
  auto not_arrived = [&] {
    std::vector<std::size_t> out;
    for (std::size_t r = 0; r < n; ++r)
      if (!c->here[r]) out.push_back(r);
    return out;
  };
  try {
    wait_for(lock, deadline, op, not_arrived, [&] {
      if (!c->abandoned.empty()) throw RemoteError(who() + op + ": " + c->abandoned);
      return c->arrived == n;
    });
  } catch (const std::exception& e) {
    // Withdraw our buffer before the caller frees it.
    if (c->abandoned.empty())
      c->abandoned = fmt::format("abandoned by rank {} ({})", group_->members[me_], e.what());
    c->here[me_] = 0;
    c->ptrs[me_] = nullptr;
    --c->arrived;
    wake_group();
    throw;
  }
  lock.unlock();
  fn(*c);
  lock.lock();
  ++c->departed;
  if (c->departed == n) {
    // Members that lent their buffer (wait_departure) may return now.
    group_->collectives.erase(seq);
    wake_group();
  }
  if (wait_departure) {
    // Peers read our buffer: they all finished copying before any member
    // departs, since copies cannot fail; the wait is still bounded.
    wait_for(lock, deadline, op, [] { return std::vector<std::size_t>{}; },
             [&] { return c->departed == n; });
  }
}

void InProcessComm::all_gather(std::span<std::byte> buffer) {
  const std::size_t n = size();
  if (buffer.size() % n != 0)
    throw InvalidArgument(fmt::format("{}all_gather buffer of {} bytes, expected a multiple of the group size {}",
                                      who(), buffer.size(), n));
  const std::size_t slot = buffer.size() / n;
  rendezvous("all_gather", buffer.data(), buffer.size(), true, [&](const Collective& c) {
    for (std::size_t r = 0; r < n; ++r) {
      if (r == me_) continue;
      std::memcpy(buffer.data() + r * slot, static_cast<const std::byte*>(c.ptrs[r]) + r * slot,
                  slot);
    }
  });
  stats_.bytes_received += slot * (n - 1);
  stats_.bytes_sent += slot * (n - 1);
  ++stats_.messages_sent;
}

void InProcessComm::broadcast(std::span<std::byte> buffer, std::size_t root) {
  check_peer(root, "broadcast");
  const bool is_root = root == me_;
  rendezvous("broadcast", buffer.data(), buffer.size(), is_root, [&](const Collective& c) {
    if (!is_root) std::memcpy(buffer.data(), c.ptrs[root], buffer.size());
  });
  if (is_root) stats_.bytes_sent += buffer.size() * (size() - 1);
  else stats_.bytes_received += buffer.size();
  ++stats_.messages_sent;
}

void InProcessComm::barrier() {
  rendezvous("barrier", nullptr, 0, false, [](const Collective&) {});
}

std::shared_ptr<Communicator> InProcessComm::split(int color, int key) {
  struct Entry {
    int color, key;
  };
  const Entry mine{color, key};
  std::vector<Entry> all(size());
  std::uint64_t split_id = 0;
  {
    std::lock_guard lock(world_->mu);
    split_id = group_->next_split[me_]++;
  }
  rendezvous("split", &mine, 0, true, [&](const Collective& c) {
    for (std::size_t r = 0; r < all.size(); ++r) all[r] = *static_cast<const Entry*>(c.ptrs[r]);
  });
  if (color < 0) return nullptr;
  std::vector<std::size_t> order;
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r].color == color) order.push_back(r);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return all[a].key < all[b].key; });
  std::vector<std::size_t> members;
  std::size_t my_pos = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (order[i] == me_) my_pos = i;
    members.push_back(group_->members[order[i]]);
  }
  const std::string id = fmt::format("{}.{}:{}", group_->id, split_id, color);
  std::lock_guard lock(world_->mu);
  auto& g = world_->groups[id];
  // The first member to get here creates the group; the others join it.
  if (!g) g = std::make_shared<Group>(id, std::move(members));
  return std::make_shared<InProcessComm>(world_, g, my_pos);
}

}  // namespace kdacp::inprocess
