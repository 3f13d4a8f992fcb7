// ThreadPool creation: a thread the OS refuses is a kdacp::Error, with every
// worker started before it joined. The refusal comes from a ThreadStarter
// that fails at a chosen worker: the OS cannot be made to refuse reliably
// here (root ignores RLIMIT_NPROC, and running out of pids would starve every
// other process on the host).
#include <atomic>
#include <functional>
#include <cerrno>
#include <string>
#include <system_error>
#include <thread>

#include <gtest/gtest.h>

#include "kdacp/error.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp {
namespace {

// Starts `allowed` workers with std::thread, then throws what std::thread
// throws when the OS has no thread to give (EAGAIN). `live` counts the
// workers whose bodies have not returned.
struct RefusingStarter {
  std::size_t allowed;
  std::atomic<std::size_t>* started;
  std::atomic<int>* live;

  std::thread operator()(std::function<void()> body) const {
    if (started->load() == allowed)
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
    ++*started;
    ++*live;
    std::atomic<int>* l = live;
    return std::thread([body = std::move(body), l] {
      body();
      --*l;
    });
  }
};

TEST(ThreadPool, RefusedThreadIsAnErrorAndJoinsTheStartedWorkers) {
  for (std::size_t allowed : {0, 1, 3}) {
    std::atomic<std::size_t> started{0};
    std::atomic<int> live{0};
    try {
      ThreadPool pool(8, RefusingStarter{allowed, &started, &live});
      FAIL() << "a refused thread must throw";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("asked for 8 threads"), std::string::npos) << what;
      EXPECT_NE(what.find("could start only " + std::to_string(allowed + 1)), std::string::npos) << what;
    }
    EXPECT_EQ(started.load(), allowed);
    // The constructor returned only after joining: no worker runs anymore.
    EXPECT_EQ(live.load(), 0);
  }
}

TEST(ThreadPool, StarterStartsEveryWorker) {
  std::atomic<std::size_t> started{0};
  std::atomic<int> live{0};
  {
    ThreadPool pool(4, RefusingStarter{3, &started, &live});
    EXPECT_EQ(started.load(), 3u);
    std::atomic<std::size_t> sum{0};
    pool.parallel_for(100, [&](std::size_t i) { sum += i; });
    EXPECT_EQ(sum.load(), 4950u);
  }
  EXPECT_EQ(live.load(), 0);
}

TEST(ThreadPool, OtherStarterErrorsPropagateAfterTheJoin) {
  std::atomic<int> live{0};
  std::size_t calls = 0;
  const ThreadPool::ThreadStarter start = [&](std::function<void()> body) {
    if (++calls == 3) throw InvalidArgument("no third worker");
    ++live;
    return std::thread([body = std::move(body), &live] {
      body();
      --live;
    });
  };
  EXPECT_THROW(ThreadPool(5, start), InvalidArgument);
  EXPECT_EQ(live.load(), 0);
}

}  // namespace
}  // namespace kdacp
