#include "kdacp/thread_pool.hpp"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "kdacp/error.hpp"

namespace kdacp {

// Workers wait on a generation counter; each job is one contiguous range per
// participant (worker 0 is the caller itself).
struct ThreadPool::Impl {
  std::size_t threads = 1;
  std::vector<std::thread> workers;
  std::mutex mu;
  std::condition_variable start_cv, done_cv;
  std::uint64_t generation = 0;
  std::size_t pending = 0;
  bool stop = false;
  const std::function<void(std::size_t, std::size_t, std::size_t)>* fn = nullptr;
  std::size_t n = 0;
  std::exception_ptr error;

  // Stops and joins the workers, so that a constructor that fails halfway
  // leaves no joinable thread behind (std::thread's destructor would
  // terminate the process).
  ~Impl() {
    {
      std::lock_guard lock(mu);
      stop = true;
    }
    start_cv.notify_all();
    for (auto& w : workers) w.join();
  }

  void run_share(std::size_t part) {
    std::size_t begin = n * part / threads, end = n * (part + 1) / threads;
    try {
      if (begin < end) (*fn)(begin, end, part);
    } catch (...) {
      std::lock_guard lock(mu);
      if (!error) error = std::current_exception();
    }
  }

  void worker(std::size_t part) {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mu);
        start_cv.wait(lock, [&] { return stop || generation != seen; });
        if (stop) return;
        seen = generation;
      }
      run_share(part);
      std::lock_guard lock(mu);
      if (--pending == 0) done_cv.notify_one();
    }
  }
};

ThreadPool::ThreadPool(std::size_t threads)
    : ThreadPool(threads, [](std::function<void()> body) { return std::thread(std::move(body)); }) {}

ThreadPool::ThreadPool(std::size_t threads, const ThreadStarter& start) : impl_(std::make_unique<Impl>()) {
  Impl* p = impl_.get();
  p->threads = std::max<std::size_t>(threads, 1);
  // Reserved up front: a reallocation failing after a start would drop a
  // joinable thread.
  p->workers.reserve(p->threads - 1);
  for (std::size_t part = 1; part < p->threads; ++part) {
    try {
      p->workers.push_back(start([p, part] { p->worker(part); }));
    } catch (const std::system_error& e) {
      const std::size_t asked = p->threads;
      impl_.reset();  // joins the workers started so far
      throw Error(fmt::format(
          "ThreadPool: asked for {} threads, could start only {} (the caller and {} workers); starting the "
          "next failed: {}",
          asked, part, part - 1, e.what()));
    }
  }
}

ThreadPool::~ThreadPool() = default;

std::size_t ThreadPool::threads() const { return impl_->threads; }

void ThreadPool::parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn) {
  parallel_ranges(n, [&](std::size_t begin, std::size_t end, std::size_t) {
    for (std::size_t i = begin; i < end; ++i) fn(i);
  });
}

void ThreadPool::parallel_ranges(
    std::size_t n, const std::function<void(std::size_t, std::size_t, std::size_t)>& fn) {
  Impl& p = *impl_;
  if (p.threads == 1 || n <= 1) {
    if (n > 0) fn(0, n, 0);
    return;
  }
  {
    std::lock_guard lock(p.mu);
    p.fn = &fn;
    p.n = n;
    p.error = nullptr;
    p.pending = p.threads - 1;
    ++p.generation;
  }
  p.start_cv.notify_all();
  p.run_share(0);
  std::unique_lock lock(p.mu);
  p.done_cv.wait(lock, [&] { return p.pending == 0; });
  if (p.error) std::rethrow_exception(p.error);
}

std::size_t ThreadPool::default_threads(std::size_t ranks_per_process) {
  std::size_t hw = std::max<unsigned>(std::thread::hardware_concurrency(), 1u);
  return std::max<std::size_t>(hw / std::max<std::size_t>(ranks_per_process, 1), 1);
}

void parallel_ranges(ThreadPool* pool, std::size_t n,
                     const std::function<void(std::size_t, std::size_t, std::size_t)>& fn) {
  if (pool == nullptr) {
    if (n > 0) fn(0, n, 0);
  } else {
    pool->parallel_ranges(n, fn);
  }
}

std::size_t participants(const ThreadPool* pool, std::size_t n) {
  if (pool == nullptr || n <= 1) return 1;
  return pool->threads();
}

}  // namespace kdacp
