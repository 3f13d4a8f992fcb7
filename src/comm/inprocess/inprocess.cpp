// In-process backend: every rank is a thread; data moves by memcpy between the
// ranks' own buffers (one copy per byte received).
//
// One mutex per world guards all matching state; each rank sleeps on its own
// condition variable and is woken only by events that concern it (a message
// for it, a collective of its group completing, a peer failing), so with more
// ranks than cores a message does not wake every rank. Copies run outside the
// lock. Collectives rendezvous on a per-group sequence
// number: each member publishes a pointer, waits for all members, copies what
// it needs from its peers, then (when peers read its buffer) waits until all
// members are done copying before it may return.
#include "kdacp/inprocess.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/memory.hpp"

namespace kdacp {

namespace {

enum class Status { running, exited, failed };

struct Collective {
  std::string op;
  std::size_t bytes = 0;
  std::vector<const void*> ptrs;
  std::vector<bool> here;
  std::size_t arrived = 0;
  std::size_t departed = 0;
  // Set when a member gave up waiting (timeout, failed peer): its buffer is
  // gone, so nobody may complete this collective any more.
  std::string abandoned;
};

struct PostedRecv {
  std::size_t src = 0, dst = 0;
  int tag = 0;
  std::span<std::byte> buf;
  bool claimed = false;  // a sender is copying into buf
  bool done = false;
  std::string error;  // set when the matched send had the wrong size
};

// A send that arrived before its receive: a copy in cached large-buffer
// memory (memory.hpp), so that messages of a few MiB per call do not fault
// fresh pages in every time.
class Bytes {
 public:
  Bytes() = default;
  explicit Bytes(std::span<const std::byte> src)
      : data_(static_cast<std::byte*>(detail::buffer_allocate(src.size() ? src.size() : 1))),
        size_(src.size()) {
    if (size_) std::memcpy(data_, src.data(), size_);
  }
  Bytes(Bytes&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Bytes& operator=(Bytes&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~Bytes() { reset(); }
  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::span<const std::byte> span() const { return {data_, size_}; }

 private:
  void reset() noexcept {
    if (data_) detail::buffer_deallocate(data_, size_ ? size_ : 1);
    data_ = nullptr;
    size_ = 0;
  }
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

struct Message {
  std::size_t src = 0, dst = 0;
  int tag = 0;
  Bytes data;
};

struct Group {
  std::string id;
  std::vector<std::size_t> members;  // global ranks, group order
  std::vector<std::uint64_t> next_seq;
  std::vector<std::uint64_t> next_split;
  std::map<std::uint64_t, std::shared_ptr<Collective>> collectives;
  std::deque<Message> unexpected;
  std::list<PostedRecv*> posted;
};

}  // namespace

struct InProcessWorld::State {
  std::size_t size = 0;
  InProcessOptions options;
  std::mutex mu;
  std::unique_ptr<std::condition_variable[]> cvs;  // one per global rank

  // Lock held.
  void wake(std::size_t global) { cvs[global].notify_all(); }
  void wake_all() {
    for (std::size_t r = 0; r < size; ++r) cvs[r].notify_all();
  }
  std::vector<Status> status;
  std::vector<std::string> failure;
  std::map<std::string, std::shared_ptr<Group>> groups;

  // A peer that will never answer: failed or exited.
  std::string gone(std::size_t global) const {
    if (status[global] == Status::failed) return "failed (" + failure[global] + ")";
    if (status[global] == Status::exited) return "exited";
    return {};
  }
};

namespace {

using WorldState = InProcessWorld::State;
using Clock = std::chrono::steady_clock;

class DoneRequest final : public Request {
 public:
  void wait() override {}
};

class InProcessComm final : public Communicator, public std::enable_shared_from_this<InProcessComm> {
 public:
  InProcessComm(std::shared_ptr<WorldState> world, std::shared_ptr<Group> group, std::size_t me)
      : world_(std::move(world)), group_(std::move(group)), me_(me) {}

  std::size_t rank() const override { return me_; }
  std::size_t size() const override { return group_->members.size(); }
  const std::vector<std::size_t>& global_ranks() const override { return group_->members; }
  std::size_t world_size() const override { return world_->size; }
  std::string backend() const override { return "inprocess"; }
  std::chrono::milliseconds timeout() const override { return world_->options.timeout; }
  CommStats stats() const override { return stats_; }

  void all_gather(std::span<std::byte> buffer) override {
    const std::size_t n = size();
    if (buffer.size() % n != 0)
      throw InvalidArgument(who() + "all_gather buffer of " + std::to_string(buffer.size()) +
                            " bytes, expected a multiple of the group size " + std::to_string(n));
    const std::size_t slot = buffer.size() / n;
    rendezvous("all_gather", buffer.data(), buffer.size(), true, [&](const Collective& c) {
      for (std::size_t r = 0; r < n; ++r) {
        if (r == me_) continue;
        std::memcpy(buffer.data() + r * slot,
                    static_cast<const std::byte*>(c.ptrs[r]) + r * slot, slot);
      }
    });
    stats_.bytes_received += slot * (n - 1);
    stats_.bytes_sent += slot * (n - 1);
    ++stats_.messages_sent;
  }

  void broadcast(std::span<std::byte> buffer, std::size_t root) override {
    check_peer(root, "broadcast");
    const bool is_root = root == me_;
    rendezvous("broadcast", buffer.data(), buffer.size(), is_root, [&](const Collective& c) {
      if (!is_root) std::memcpy(buffer.data(), c.ptrs[root], buffer.size());
    });
    if (is_root) stats_.bytes_sent += buffer.size() * (size() - 1);
    else stats_.bytes_received += buffer.size();
    ++stats_.messages_sent;
  }

  void barrier() override { rendezvous("barrier", nullptr, 0, false, [](const Collective&) {}); }

  std::unique_ptr<Request> isend(std::span<const std::byte> data, std::size_t peer,
                                 int tag) override {
    check_peer(peer, "isend");
    check_tag(tag, "isend");
    std::unique_lock lock(world_->mu);
    if (PostedRecv* r = find_posted(peer, tag)) {
      deliver(lock, *r, data);
    } else {
      lock.unlock();
      Message msg{me_, peer, tag, Bytes(data)};
      lock.lock();
      if (PostedRecv* r2 = find_posted(peer, tag)) {
        deliver(lock, *r2, msg.data.span());
      } else {
        group_->unexpected.push_back(std::move(msg));
        world_->wake(group_->members[peer]);
      }
    }
    stats_.bytes_sent += data.size();
    ++stats_.messages_sent;
    return std::make_unique<DoneRequest>();
  }

  std::unique_ptr<Request> irecv(std::span<std::byte> data, std::size_t peer, int tag) override;

  std::shared_ptr<Communicator> split(int color, int key) override;

  // Waits (lock held) until pred(). Throws RemoteError when a peer that
  // pending() still awaits failed or exited, Timeout at the deadline.
  template <class Pending, class Pred>
  void wait_for(std::unique_lock<std::mutex>& lock, Clock::time_point deadline,
                const std::string& op, Pending pending, Pred pred) {
    for (;;) {
      if (pred()) return;
      const std::vector<std::size_t> peers = pending();
      for (std::size_t p : peers) {
        const std::string why = world_->gone(group_->members[p]);
        if (!why.empty()) {
          throw RemoteError(who() + op + ": peer rank " + std::to_string(group_->members[p]) +
                            " " + why);
        }
      }
      if (world_->cvs[group_->members[me_]].wait_until(lock, deadline) == std::cv_status::timeout &&
          !pred()) {
        std::ostringstream os;
        os << who() << op << ": timed out after " << world_->options.timeout.count()
           << " ms waiting for peer rank(s)";
        for (std::size_t p : pending()) os << " " << group_->members[p];
        throw Timeout(os.str());
      }
    }
  }

  std::string who() const {
    return "rank " + std::to_string(group_->members[me_]) + " (group " + group_->id + "): ";
  }

  std::shared_ptr<WorldState> world_;
  std::shared_ptr<Group> group_;

 private:
  void check_peer(std::size_t peer, const char* op) const {
    if (peer >= size())
      throw InvalidArgument(who() + op + " peer " + std::to_string(peer) +
                            " outside the group of size " + std::to_string(size()));
  }
  static void check_tag(int tag, const char* op) {
    if (tag < 0) throw InvalidArgument(std::string(op) + " tag " + std::to_string(tag) + ", expected >= 0");
  }

  PostedRecv* find_posted(std::size_t dst, int tag) {
    for (PostedRecv* r : group_->posted)
      if (!r->claimed && r->src == me_ && r->dst == dst && r->tag == tag) return r;
    return nullptr;
  }

  // Copies a send into a matched posted receive, outside the lock.
  void deliver(std::unique_lock<std::mutex>& lock, PostedRecv& r, std::span<const std::byte> data) {
    r.claimed = true;
    if (data.size() != r.buf.size()) {
      r.error = "message of " + std::to_string(data.size()) + " bytes from rank " +
                std::to_string(group_->members[me_]) + ", expected " +
                std::to_string(r.buf.size());
    } else {
      lock.unlock();
      std::memcpy(r.buf.data(), data.data(), data.size());
      lock.lock();
    }
    r.done = true;
    world_->wake(group_->members[r.dst]);
  }

  template <class Fn>
  void rendezvous(const char* op, const void* ptr, std::size_t bytes, bool wait_departure, Fn&& fn) {
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
      slot->here.assign(n, false);
    }
    std::shared_ptr<Collective> c = slot;
    if (c->op != op || c->bytes != bytes) {
      // Remember the disagreement for the others, then fail here.
      const std::string msg = who() + op + " of " + std::to_string(bytes) +
                              " bytes, but a peer called " + c->op + " of " +
                              std::to_string(c->bytes) + " bytes as collective #" +
                              std::to_string(seq);
      throw InvalidArgument(msg);
    }
    c->ptrs[me_] = ptr;
    c->here[me_] = true;
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
      if (c->abandoned.empty()) c->abandoned = "abandoned by rank " + std::to_string(group_->members[me_]) + " (" + e.what() + ")";
      c->here[me_] = false;
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

  // Lock held: every member of this group.
  void wake_group() {
    for (std::size_t g : group_->members) world_->wake(g);
  }

  std::size_t me_;
  CommStats stats_;
};

class RecvRequest final : public Request {
 public:
  RecvRequest(std::shared_ptr<InProcessComm> comm, std::size_t peer)
      : comm_(std::move(comm)), peer_(peer) {}
  ~RecvRequest() override {
    if (!registered_) return;
    std::unique_lock lock(comm_->world_->mu);
    // A sender may be copying into our buffer right now: let it finish.
    comm_->world_->cvs[comm_->global_ranks()[posted_.dst]].wait(
        lock, [&] { return !posted_.claimed || posted_.done; });
    comm_->group_->posted.remove(&posted_);
  }

  void wait() override {
    if (!registered_) return;
    const auto deadline = std::chrono::steady_clock::now() + comm_->timeout();
    std::unique_lock lock(comm_->world_->mu);
    const std::string op = "irecv from rank " +
                           std::to_string(comm_->group_->members[peer_]) + " (tag " +
                           std::to_string(posted_.tag) + ")";
    comm_->wait_for(
        lock, deadline, op,
        [&] { return posted_.claimed ? std::vector<std::size_t>{} : std::vector<std::size_t>{peer_}; },
        [&] { return posted_.done; });
    comm_->group_->posted.remove(&posted_);
    registered_ = false;
    if (!posted_.error.empty()) throw RemoteError(comm_->who() + op + ": " + posted_.error);
  }

  std::shared_ptr<InProcessComm> comm_;
  std::size_t peer_;
  PostedRecv posted_;
  bool registered_ = false;
};

std::unique_ptr<Request> InProcessComm::irecv(std::span<std::byte> data, std::size_t peer, int tag) {
  check_peer(peer, "irecv");
  check_tag(tag, "irecv");
  std::unique_lock lock(world_->mu);
  auto& q = group_->unexpected;
  for (auto it = q.begin(); it != q.end(); ++it) {
    if (it->src == peer && it->dst == me_ && it->tag == tag) {
      Message msg = std::move(*it);
      q.erase(it);
      lock.unlock();
      if (msg.data.size() != data.size()) {
        throw RemoteError(who() + "irecv from rank " + std::to_string(group_->members[peer]) +
                          ": message of " + std::to_string(msg.data.size()) +
                          " bytes, expected " + std::to_string(data.size()));
      }
      std::memcpy(data.data(), msg.data.data(), data.size());
      stats_.bytes_received += data.size();
      return std::make_unique<DoneRequest>();
    }
  }
  auto req = std::make_unique<RecvRequest>(shared_from_this(), peer);
  req->posted_.src = peer;
  req->posted_.dst = me_;
  req->posted_.tag = tag;
  req->posted_.buf = data;
  req->registered_ = true;
  group_->posted.push_back(&req->posted_);
  stats_.bytes_received += data.size();
  return req;
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
  const std::string id = group_->id + "." + std::to_string(split_id) + ":" + std::to_string(color);
  std::lock_guard lock(world_->mu);
  auto& g = world_->groups[id];
  if (!g) {
    g = std::make_shared<Group>();
    g->id = id;
    g->members = members;
    g->next_seq.assign(members.size(), 0);
    g->next_split.assign(members.size(), 0);
  }
  return std::make_shared<InProcessComm>(world_, g, my_pos);
}

}  // namespace

InProcessWorld::InProcessWorld(std::size_t size, InProcessOptions options)
    : state_(std::make_shared<State>()) {
  if (size == 0) throw InvalidArgument("in-process world size is 0, expected >= 1");
  state_->size = size;
  state_->cvs = std::make_unique<std::condition_variable[]>(size);
  state_->options = options;
  state_->status.assign(size, Status::running);
  state_->failure.assign(size, {});
  auto g = std::make_shared<Group>();
  g->id = "world";
  for (std::size_t r = 0; r < size; ++r) g->members.push_back(r);
  g->next_seq.assign(size, 0);
  g->next_split.assign(size, 0);
  state_->groups["world"] = g;
}

InProcessWorld::~InProcessWorld() = default;

std::size_t InProcessWorld::size() const { return state_->size; }

std::shared_ptr<Communicator> InProcessWorld::communicator(std::size_t rank) {
  if (rank >= state_->size)
    throw InvalidArgument("rank " + std::to_string(rank) + " outside the world of size " +
                          std::to_string(state_->size));
  return std::make_shared<InProcessComm>(state_, state_->groups.at("world"), rank);
}

void InProcessWorld::mark_failed(std::size_t rank, const std::string& what) {
  std::lock_guard lock(state_->mu);
  state_->status.at(rank) = Status::failed;
  state_->failure.at(rank) = what;
  state_->wake_all();
}

void InProcessWorld::mark_exited(std::size_t rank) {
  std::lock_guard lock(state_->mu);
  if (state_->status.at(rank) == Status::running) state_->status[rank] = Status::exited;
  state_->wake_all();
}

void InProcessWorld::run(const std::function<void(const std::shared_ptr<Communicator>&)>& fn) {
  const std::size_t n = state_->size;
  std::vector<std::exception_ptr> errors(n);
  std::vector<bool> root_cause(n, false);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (std::size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::shared_ptr<Communicator> comm = communicator(r);
      try {
        fn(comm);
        mark_exited(r);
      } catch (const RemoteError& e) {
        errors[r] = std::current_exception();
        mark_failed(r, e.what());
      } catch (const Timeout& e) {
        errors[r] = std::current_exception();
        mark_failed(r, e.what());
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        root_cause[r] = true;
        mark_failed(r, e.what());
      } catch (...) {
        errors[r] = std::current_exception();
        root_cause[r] = true;
        mark_failed(r, "unknown exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t r = 0; r < n; ++r)
    if (root_cause[r]) std::rethrow_exception(errors[r]);
  for (std::size_t r = 0; r < n; ++r)
    if (errors[r]) std::rethrow_exception(errors[r]);
}

void run_in_process(std::size_t size, const RankFn& fn,
                    InProcessOptions options) {
  InProcessWorld world(size, options);
  world.run(fn);
}

}  // namespace kdacp
