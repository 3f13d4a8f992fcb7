// In-process backend: every rank is a thread; data moves by memcpy between the
// ranks' own buffers (one copy per byte received). This file holds the world:
// its shared state, the rank life cycle and run(), which spawns the ranks.
#include <exception>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "comm/inprocess/internal.hpp"
#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"

namespace kdacp {

namespace inprocess {

Group::Group(std::string group_id, std::vector<std::size_t> group_members)
    : id(std::move(group_id)),
      members(std::move(group_members)),
      next_seq(members.size(), 0),
      next_split(members.size(), 0) {}

namespace {

std::vector<std::size_t> iota(std::size_t n) {
  std::vector<std::size_t> out(n);
  for (std::size_t r = 0; r < n; ++r) out[r] = r;
  return out;
}

}  // namespace

WorldState::WorldState(std::size_t world_size, InProcessOptions world_options)
    : size(world_size),
      options(world_options),
      world_group(std::make_shared<Group>("world", iota(world_size))),
      cvs(std::make_unique<std::condition_variable[]>(world_size)),
      status(world_size, Status::running),
      failure(world_size) {}

void WorldState::wake_all() {
  for (std::size_t r = 0; r < size; ++r) cvs[r].notify_all();
}

std::string WorldState::gone(std::size_t global) const {
  if (status[global] == Status::failed) return "failed (" + failure[global] + ")";
  if (status[global] == Status::exited) return "exited";
  return {};
}

}  // namespace inprocess

struct InProcessWorld::Impl {
  std::shared_ptr<inprocess::WorldState> state;
};

InProcessWorld::InProcessWorld(std::size_t size, InProcessOptions options) {
  if (size == 0) throw InvalidArgument("in-process world size is 0, expected >= 1");
  impl_ = std::make_unique<Impl>(Impl{std::make_shared<inprocess::WorldState>(size, options)});
}

InProcessWorld::~InProcessWorld() = default;

std::size_t InProcessWorld::size() const { return impl_->state->size; }

std::shared_ptr<Communicator> InProcessWorld::communicator(std::size_t rank) {
  const auto& state = impl_->state;
  if (rank >= state->size)
    throw InvalidArgument(fmt::format("rank {} outside the world of size {}", rank, state->size));
  return std::make_shared<inprocess::InProcessComm>(state, state->world_group, rank);
}

void InProcessWorld::mark_failed(std::size_t rank, const std::string& what) {
  inprocess::WorldState& s = *impl_->state;
  std::lock_guard lock(s.mu);
  s.status.at(rank) = inprocess::Status::failed;
  s.failure.at(rank) = what;
  s.wake_all();
}

void InProcessWorld::mark_exited(std::size_t rank) {
  inprocess::WorldState& s = *impl_->state;
  std::lock_guard lock(s.mu);
  if (s.status.at(rank) == inprocess::Status::running) s.status[rank] = inprocess::Status::exited;
  s.wake_all();
}

void InProcessWorld::run(const std::function<void(const std::shared_ptr<Communicator>&)>& fn) {
  // What each rank ended with. Each thread writes only its own element, a
  // separate object, so the threads need no lock; join() publishes them.
  struct Outcome {
    std::exception_ptr error;
    // The rank failed by itself, not because a peer failed or went silent:
    // that exception explains the run and is the one rethrown.
    bool root_cause = false;
  };
  const std::size_t n = size();
  std::vector<Outcome> outcomes(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (std::size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Outcome& out = outcomes[r];
      std::shared_ptr<Communicator> comm = communicator(r);
      try {
        fn(comm);
        mark_exited(r);
      } catch (const RemoteError& e) {
        out.error = std::current_exception();
        mark_failed(r, e.what());
      } catch (const Timeout& e) {
        out.error = std::current_exception();
        mark_failed(r, e.what());
      } catch (const std::exception& e) {
        out.error = std::current_exception();
        out.root_cause = true;
        mark_failed(r, e.what());
      } catch (...) {
        out.error = std::current_exception();
        out.root_cause = true;
        mark_failed(r, "unknown exception");
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const Outcome& out : outcomes)
    if (out.root_cause) std::rethrow_exception(out.error);
  for (const Outcome& out : outcomes)
    if (out.error) std::rethrow_exception(out.error);
}

void run_in_process(std::size_t size, const RankFn& fn, InProcessOptions options) {
  InProcessWorld world(size, options);
  world.run(fn);
}

}  // namespace kdacp
