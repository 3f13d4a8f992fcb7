#include "kdacp/launch_mpi.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/mpi.hpp"

#if defined(KDACP_SMPI)
#include "comm/smpi/shared_memory.hpp"
#endif

namespace kdacp {

namespace {

// Bounds MPI's start-up by --timeout. MPI_Init waits for every process of
// the job; one that never reaches it (stopped, or stuck before it) would keep
// the others there forever, where no communicator timeout applies yet. When
// start-up has not ended within the timeout, the process says so and exits
// (status 2); the launcher then ends the whole job.
class StartupWatchdog {
 public:
  explicit StartupWatchdog(double seconds)
      : thread_([this, seconds] {
          std::unique_lock lock(mutex_);
          if (done_cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) return;
          std::fprintf(stderr,
                       "kdacp: error: MPI start-up (MPI_Init and the world communicator) did not complete within "
                       "--timeout %s s: a process of the job never reached MPI_Init (stopped, hung or not "
                       "started); aborting this process (pid %ld)\n",
                       exact_string(seconds).c_str(), static_cast<long>(::getpid()));
          std::fflush(stderr);
          std::_Exit(2);
        }) {}
  ~StartupWatchdog() { stop(); }
  StartupWatchdog(const StartupWatchdog&) = delete;
  StartupWatchdog& operator=(const StartupWatchdog&) = delete;

  // Start-up ended (either way): the watchdog exits without a word.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

#if defined(KDACP_SMPI)
// Simulated (docs/scale.md): start-up cannot hang, the simulator starts every
// rank and reports a deadlock with all blocked ranks; no watchdog thread per
// simulated rank.
struct NoWatchdog {
  void stop() {}
};
#endif

void run_mpi(const LaunchOptions& options, const RankFn& fn) {
#if defined(KDACP_SMPI)
  NoWatchdog watchdog;
#else
  StartupWatchdog watchdog(options.timeout_s);
#endif
  MpiSession session;
  std::shared_ptr<Communicator> world;
  try {
#if defined(KDACP_SMPI)
    // Before any message: a bad KDACP_SMPI_SHARED_MEMORY, or a
    // shared-memory run whose results would be kept.
    if (smpi::shared_memory() && !options.timing_only)
      throw InvalidArgument(
          "KDACP_SMPI_SHARED_MEMORY=1 shares every rank's buffers and charges compute as flops, so every result "
          "is meaningless bytes: only `bench exchange` (a timing) runs in the shared-memory mode");
#endif
    MpiOptions mo;
    mo.timeout = std::chrono::milliseconds(static_cast<long long>(options.timeout_s * 1000));
    world = mpi_world(mo);
    watchdog.stop();
    if (options.ranks_given && options.ranks != world->size())
      throw InvalidArgument(
          fmt::format("--ranks is {} but mpirun started {} processes", options.ranks, world->size()));
    fn(world);
  } catch (const std::exception& e) {
    watchdog.stop();
    std::fprintf(stderr, "kdacp: error: rank %zu: %s\n", session.world_rank(), e.what());
    std::fflush(stderr);
#if !defined(KDACP_SMPI)
    // Ranks often fail together: a disagreement found by a collective is
    // raised on every rank as the collective completes (at moments that
    // differ by the polling's back-off), and a timed-out wait may be one
    // link of a chain of waits (rank 3 on rank 2, rank 2 on a stopped rank
    // 1) whose ranks all time out within moments of each other. The first
    // to abort would cut the others off, and its message may name a rank
    // that only waited too. A grace of up to the timeout (at most 2 s)
    // before the job is ended lets each print its own diagnosis.
    std::this_thread::sleep_for(std::chrono::duration<double>(std::min(options.timeout_s, 2.0)));
#endif
    MpiSession::abort(2);
  }
  world.reset();  // communicators go before MPI_Finalize
}

}  // namespace

ProcessLauncher mpi_launcher() {
  return ProcessLauncher{
      "mpi", [] { return launched_by_mpirun() && mpi_world_size_from_env().value_or(0) > 1; }, run_mpi};
}

}  // namespace kdacp
