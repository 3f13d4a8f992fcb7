// A small fixed-size worker pool for intra-rank parallelism over (b,h) slabs:
// the one execution model of kdacp. The caller creates it and passes it in an
// ExecPolicy (kernels.hpp) to the KDA math, the layer and the exchange;
// nothing in kdacp starts threads per call. parallel_ranges splits [0, n)
// into contiguous ranges, one per worker, so work assignment is
// deterministic; results never depend on the thread count because every
// index is computed by exactly one thread with the same code.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <thread>

namespace kdacp {

class ThreadPool {
 public:
  // Starts one worker running `body` and returns it, as std::thread(body)
  // does; throws std::system_error, as std::thread does, when the OS refuses
  // a thread.
  using ThreadStarter = std::function<std::thread(std::function<void()> body)>;

  // threads == 0 or 1: run inline on the caller. Otherwise starts threads - 1
  // workers with std::thread; the caller is the last participant. When the
  // OS refuses a worker, the ones already started are stopped and joined and
  // kdacp::Error names how many threads were asked for and how many started.
  explicit ThreadPool(std::size_t threads);
  // The same with each worker started by `start`, for a caller that places
  // its threads itself (affinity, names, stack size). A std::system_error
  // from `start` becomes kdacp::Error as above; any other exception
  // propagates once the started workers are joined.
  ThreadPool(std::size_t threads, const ThreadStarter& start);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::size_t threads() const;
  // Calls fn(i) for every i in [0, n); returns when all are done. The first
  // exception thrown by fn is rethrown on the caller. Not reentrant.
  void parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn);
  // Calls fn(begin, end, part) once per participant with its contiguous share
  // of [0, n); part < threads() identifies the participant (for scratch).
  void parallel_ranges(std::size_t n,
                       const std::function<void(std::size_t, std::size_t, std::size_t)>& fn);

  // Hardware threads divided among `ranks_per_process` ranks, at least 1.
  static std::size_t default_threads(std::size_t ranks_per_process);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs fn over [0, n) on `pool` when given and worth it, else inline.
void parallel_ranges(ThreadPool* pool, std::size_t n,
                     const std::function<void(std::size_t, std::size_t, std::size_t)>& fn);
// Upper bound (exclusive) of the `part` values parallel_ranges passes for n items.
std::size_t participants(const ThreadPool* pool, std::size_t n);

}  // namespace kdacp
