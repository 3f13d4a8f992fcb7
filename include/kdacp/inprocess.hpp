// In-process backend: P ranks as threads of one process (the embedded
// default). Each World is independent: several worlds may run at once in one
// process, nothing is global.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>

#include "kdacp/comm.hpp"
#include "kdacp/defaults.hpp"

namespace kdacp {

struct InProcessOptions {
  // Bound on every blocking wait of every rank of the world.
  std::chrono::milliseconds timeout = defaults::kTimeout;
};

class InProcessWorld {
 public:
  explicit InProcessWorld(std::size_t size, InProcessOptions options = {});
  ~InProcessWorld();
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;

  std::size_t size() const;
  // The world communicator of `rank`. Each rank thread uses its own.
  std::shared_ptr<Communicator> communicator(std::size_t rank);

  // Rank life cycle, used by run(): a rank that failed or exited turns every
  // wait on it into a RemoteError naming it.
  void mark_failed(std::size_t rank, const std::string& what);
  void mark_exited(std::size_t rank);

  // Runs fn(comm) on `size` threads, one per rank, and joins them. If any
  // rank throws, the others are released with RemoteError and the first
  // exception (by rank order of the root cause) is rethrown here.
  void run(const std::function<void(const std::shared_ptr<Communicator>&)>& fn);

 private:
  // The world's shared state; communicators keep it alive past the world.
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Convenience: a fresh world of `size` ranks running fn on each.
using RankFn = std::function<void(const std::shared_ptr<Communicator>&)>;
void run_in_process(std::size_t size, const RankFn& fn,
                    InProcessOptions options = {});

}  // namespace kdacp
