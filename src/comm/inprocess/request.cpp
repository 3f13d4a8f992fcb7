// The in-process communicator's point-to-point messages and their requests.
//
// Matching is per group, by (source, destination, tag), in posting order. A
// send that finds its receive posted copies straight into the receiver's
// buffer and completes at once; otherwise it leaves a copy in the group's
// unexpected queue, which the receive takes when it is posted. So isend never
// waits, and irecv returns a request that waits only when its message has not
// arrived yet.
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "comm/inprocess/internal.hpp"
#include "core/buffer_allocator.hpp"
#include "kdacp/error.hpp"

namespace kdacp::inprocess {

Bytes::Bytes(std::span<const std::byte> src)
    : data_(static_cast<std::byte*>(detail::buffer_allocate(src.size() ? src.size() : 1))),
      size_(src.size()) {
  if (size_) std::memcpy(data_, src.data(), size_);
}

Bytes::Bytes(Bytes&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

Bytes& Bytes::operator=(Bytes&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

Bytes::~Bytes() { reset(); }

void Bytes::reset() noexcept {
  if (data_) detail::buffer_deallocate(data_, size_ ? size_ : 1);
  data_ = nullptr;
  size_ = 0;
}

namespace {

// A send, or a receive whose message had already arrived.
class DoneRequest final : public Request {
 public:
  void wait() override {}
};

// A receive posted before its message: the matching sender fills posted_.
class RecvRequest final : public Request {
 public:
  RecvRequest(std::shared_ptr<InProcessComm> comm, std::size_t peer, int tag,
              std::span<std::byte> buf)
      : comm_(std::move(comm)), peer_(peer) {
    posted_.src = peer;
    posted_.dst = comm_->rank();
    posted_.tag = tag;
    posted_.buf = buf;
  }

  // Lock held: makes the receive visible to senders.
  void register_posted() {
    comm_->group().posted.push_back(&posted_);
    registered_ = true;
  }

  ~RecvRequest() override {
    if (!registered_) return;
    WorldState& world = comm_->world();
    std::unique_lock lock(world.mu);
    // A sender may be copying into our buffer right now: let it finish. Not
    // bounded by the timeout on purpose: returning early would free the
    // buffer under the copy, and a claimed copy is one memcpy outside the
    // lock that cannot block or fail.
    world.cvs[comm_->global_ranks()[posted_.dst]].wait(
        lock, [&] { return !posted_.claimed || posted_.done; });
    comm_->group().posted.remove(&posted_);
  }

  void wait() override {
    if (!registered_) return;
    const auto deadline = Clock::now() + comm_->timeout();
    std::unique_lock lock(comm_->world().mu);
    const std::string op = fmt::format("irecv from rank {} (tag {})", comm_->global_ranks()[peer_], posted_.tag);
    // A claimed receive is being filled and will complete even if the sender
    // fails afterwards, so only an unclaimed one waits on the peer's status.
    auto pending = [&] {
      return posted_.claimed ? std::vector<std::size_t>{} : std::vector<std::size_t>{peer_};
    };
    comm_->wait_for(lock, deadline, op, pending, [&] { return posted_.done; });
    comm_->group().posted.remove(&posted_);
    registered_ = false;
    if (!posted_.error.empty()) throw RemoteError(comm_->who() + op + ": " + posted_.error);
  }

 private:
  std::shared_ptr<InProcessComm> comm_;
  std::size_t peer_;
  PostedRecv posted_;
  bool registered_ = false;
};

}  // namespace

PostedRecv* InProcessComm::find_posted(std::size_t dst, int tag) {
  for (PostedRecv* r : group_->posted)
    if (!r->claimed && r->src == me_ && r->dst == dst && r->tag == tag) return r;
  return nullptr;
}

void InProcessComm::deliver(std::unique_lock<std::mutex>& lock, PostedRecv& r,
                            std::span<const std::byte> data) {
  r.claimed = true;
  if (data.size() != r.buf.size()) {
    r.error = fmt::format("message of {} bytes from rank {}, expected {}", data.size(), group_->members[me_],
                          r.buf.size());
  } else {
    lock.unlock();
    std::memcpy(r.buf.data(), data.data(), data.size());
    lock.lock();
  }
  r.done = true;
  world_->wake(group_->members[r.dst]);
}

std::unique_ptr<Request> InProcessComm::isend(std::span<const std::byte> data, std::size_t peer,
                                              int tag) {
  check_peer(peer, "isend");
  check_tag(tag, "isend");
  std::unique_lock lock(world_->mu);
  if (PostedRecv* r = find_posted(peer, tag)) {
    deliver(lock, *r, data);
  } else {
    // Copy outside the lock; the receive may be posted meanwhile.
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

std::unique_ptr<Request> InProcessComm::irecv(std::span<std::byte> data, std::size_t peer,
                                              int tag) {
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
        throw RemoteError(fmt::format("{}irecv from rank {}: message of {} bytes, expected {}", who(),
                                      group_->members[peer], msg.data.size(), data.size()));
      }
      std::memcpy(data.data(), msg.data.data(), data.size());
      stats_.bytes_received += data.size();
      return std::make_unique<DoneRequest>();
    }
  }
  auto req = std::make_unique<RecvRequest>(shared_from_this(), peer, tag, data);
  req->register_posted();
  stats_.bytes_received += data.size();
  return req;
}

}  // namespace kdacp::inprocess
