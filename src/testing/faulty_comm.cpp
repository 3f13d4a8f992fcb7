#include "kdacp/testing/faulty_comm.hpp"

#include <array>
#include <csignal>
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>

namespace kdacp::testing {

namespace {

const char* op_name(FaultOp op) {
  switch (op) {
    case FaultOp::isend: return "isend";
    case FaultOp::irecv: return "irecv";
    case FaultOp::collective: return "collective";
    case FaultOp::any: return "operation";
  }
  return "operation";
}

// A send whose message was dropped: complete from the sender's point of view.
class DroppedSend final : public Request {
 public:
  void wait() override {}
};

}  // namespace

namespace detail {

struct FaultState {
  // One rank's counters; only that rank's thread touches them.
  struct RankState {
    bool armed = false;
    std::array<std::size_t, 4> count{};  // indexed by FaultOp
    std::size_t fired = 0;
  };

  std::vector<Fault> plan;
  std::vector<RankState> ranks;

  // Counts one operation of `kind` of `global` and returns the fault aimed at
  // it, or nullptr.
  const Fault* next(std::size_t global, FaultOp kind) {
    RankState& st = ranks[global];
    if (!st.armed) return nullptr;
    const std::size_t of_kind = st.count[static_cast<std::size_t>(kind)]++;
    const std::size_t of_any = st.count[static_cast<std::size_t>(FaultOp::any)]++;
    for (const Fault& f : plan) {
      if (f.rank != global) continue;
      if ((f.op == kind && f.index == of_kind) || (f.op == FaultOp::any && f.index == of_any)) {
        ++st.fired;
        return &f;
      }
    }
    return nullptr;
  }
};

}  // namespace detail

namespace {

class FaultyComm final : public Communicator {
 public:
  FaultyComm(std::shared_ptr<detail::FaultState> shared, std::shared_ptr<Communicator> inner)
      : shared_(std::move(shared)),
        inner_(std::move(inner)),
        global_(inner_->global_ranks().at(inner_->rank())) {}

  std::size_t rank() const override { return inner_->rank(); }
  std::size_t size() const override { return inner_->size(); }
  const std::vector<std::size_t>& global_ranks() const override { return inner_->global_ranks(); }
  std::size_t world_size() const override { return inner_->world_size(); }
  std::string backend() const override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  CommStats stats() const override { return inner_->stats(); }
  double now_seconds() const override { return inner_->now_seconds(); }

  void all_gather(std::span<std::byte> buffer) override {
    strike(FaultOp::collective, "all_gather");
    inner_->all_gather(buffer);
  }
  void broadcast(std::span<std::byte> buffer, std::size_t root) override {
    strike(FaultOp::collective, "broadcast");
    inner_->broadcast(buffer, root);
  }
  void barrier() override {
    strike(FaultOp::collective, "barrier");
    inner_->barrier();
  }
  std::unique_ptr<Request> isend(std::span<const std::byte> data, std::size_t peer,
                                 int tag) override {
    if (strike(FaultOp::isend, "isend") == FaultAction::drop) return std::make_unique<DroppedSend>();
    return inner_->isend(data, peer, tag);
  }
  std::unique_ptr<Request> irecv(std::span<std::byte> data, std::size_t peer, int tag) override {
    strike(FaultOp::irecv, "irecv");
    return inner_->irecv(data, peer, tag);
  }
  std::shared_ptr<Communicator> split(int color, int key) override {
    strike(FaultOp::collective, "split");
    auto child = inner_->split(color, key);
    if (!child) return nullptr;
    return std::make_shared<FaultyComm>(shared_, std::move(child));
  }

 private:
  // Applies the fault aimed at this operation, if any, and returns its
  // action (delay when there is none: the operation proceeds).
  FaultAction strike(FaultOp kind, const char* op) {
    const Fault* f = shared_->next(global_, kind);
    if (!f) return FaultAction::delay;
    switch (f->action) {
      case FaultAction::delay:
        std::this_thread::sleep_for(f->duration);
        break;
      case FaultAction::drop:
        break;
      case FaultAction::fail:
        throw InjectedFault(
            fmt::format("rank {}: injected failure at its {} #{} ({})", global_, op_name(f->op), f->index, op));
      case FaultAction::signal:
        std::raise(f->signal);
        break;
    }
    return f->action;
  }

  std::shared_ptr<detail::FaultState> shared_;
  std::shared_ptr<Communicator> inner_;
  std::size_t global_;
};

}  // namespace

FaultInjector::FaultInjector(std::size_t world_size, std::vector<Fault> plan)
    : shared_(std::make_shared<detail::FaultState>()) {
  for (const Fault& f : plan) {
    const std::string which = fmt::format("fault on rank {}, {} #{}", f.rank, op_name(f.op), f.index);
    if (f.rank >= world_size)
      throw InvalidArgument(fmt::format("{}: rank outside the world of size {}", which, world_size));
    if (f.action == FaultAction::drop && f.op != FaultOp::isend)
      throw InvalidArgument(fmt::format("{}: drop aimed at {}, expected isend (only a sent message can be lost)",
                                        which, op_name(f.op)));
    if (f.action == FaultAction::signal && f.signal <= 0)
      throw InvalidArgument(fmt::format("{}: signal {}, expected a signal number > 0", which, f.signal));
    if (f.duration.count() < 0)
      throw InvalidArgument(fmt::format("{}: delay of {} ms, expected >= 0", which, f.duration.count()));
  }
  shared_->plan = std::move(plan);
  shared_->ranks.resize(world_size);
}

std::shared_ptr<Communicator> FaultInjector::wrap(std::shared_ptr<Communicator> comm) {
  if (comm->world_size() != shared_->ranks.size())
    throw InvalidArgument(fmt::format("FaultInjector::wrap: a communicator of a world of {} ranks, expected {}",
                                      comm->world_size(), shared_->ranks.size()));
  return std::make_shared<FaultyComm>(shared_, std::move(comm));
}

void FaultInjector::arm(std::size_t rank) {
  detail::FaultState::RankState& st = shared_->ranks.at(rank);
  st.armed = true;
  st.count = {};
}

std::size_t FaultInjector::fired(std::size_t rank) const { return shared_->ranks.at(rank).fired; }

}  // namespace kdacp::testing
