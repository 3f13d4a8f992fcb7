// The in-process backend under contention: many rank threads failing,
// communicating and splitting at the same moment. Each test is written so
// that a race in the backend's shared state is a ThreadSanitizer report in
// the tsan build (make test-tsan), not only a rare wrong result.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"

namespace kdacp {
namespace {

using namespace std::chrono_literals;

std::span<std::byte> bytes_of(std::vector<std::uint32_t>& v) {
  return std::as_writable_bytes(std::span(v));
}

// Every rank throws a root-cause error right after the same barrier, so the
// ranks record their outcome at the same moment; run() must rethrow rank 0's.
TEST(InProcess, EveryRankFailingAtOnceRethrowsTheLowestRank) {
  for (std::size_t p : {2, 7, 32, 64}) {
    SCOPED_TRACE("P=" + std::to_string(p));
    try {
      run_in_process(p, [](const std::shared_ptr<Communicator>& comm) {
        comm->barrier();
        throw std::runtime_error("rank " + std::to_string(comm->rank()) + " failed");
      });
      ADD_FAILURE() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "rank 0 failed");
    }
  }
}

// Odd ranks fail at once while even ranks wait in a collective: the waiters
// end with RemoteError, and the root cause (rank 1) is what run() rethrows.
TEST(InProcess, SimultaneousFailuresReleaseWaitersAndReportTheRootCause) {
  constexpr std::size_t P = 33;
  std::atomic<std::size_t> remote_errors{0};
  try {
    run_in_process(P, [&](const std::shared_ptr<Communicator>& comm) {
      comm->barrier();
      if (comm->rank() % 2 == 1) throw InvalidArgument("rank " + std::to_string(comm->rank()));
      std::vector<std::uint32_t> buf(P, 0);
      try {
        comm->all_gather(bytes_of(buf));
      } catch (const RemoteError&) {
        ++remote_errors;
        throw;
      }
    }, InProcessOptions{10s});
    ADD_FAILURE() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "rank 1");
  }
  EXPECT_EQ(remote_errors.load(), (P + 1) / 2);
}

// All members of every sub-group exchange at once, by collectives and by
// point-to-point messages posted both before and after their sends, while
// sibling groups do the same in the same world.
TEST(InProcess, ConcurrentCollectivesAndMessagesInSiblingGroupsStayCorrect) {
  constexpr std::size_t P = 12;
  constexpr int kRounds = 20;
  run_in_process(P, [](const std::shared_ptr<Communicator>& world) {
    // Three sibling groups of 4, members in reverse world order.
    const auto comm = world->split(static_cast<int>(world->rank() % 3),
                                   -static_cast<int>(world->rank()));
    ASSERT_NE(comm, nullptr);
    const std::size_t n = comm->size(), me = comm->rank();
    ASSERT_EQ(n, 4u);
    for (int round = 0; round < kRounds; ++round) {
      const auto stamp = [&](std::size_t r) {
        return static_cast<std::uint32_t>(comm->global_ranks()[r] * 1000 + round);
      };
      std::vector<std::uint32_t> slots(n * 3, 0);
      for (std::size_t i = 0; i < 3; ++i) slots[me * 3 + i] = stamp(me);
      comm->all_gather(bytes_of(slots));
      for (std::size_t r = 0; r < n; ++r) ASSERT_EQ(slots[r * 3 + 2], stamp(r));

      std::vector<std::uint32_t> value{me == static_cast<std::size_t>(round) % n ? stamp(me) : 0u};
      comm->broadcast(bytes_of(value), static_cast<std::size_t>(round) % n);
      ASSERT_EQ(value[0], stamp(static_cast<std::size_t>(round) % n));

      // A ring: receives posted first on even rounds, sends first on odd.
      const std::size_t next = (me + 1) % n, prev = (me + n - 1) % n;
      std::vector<std::uint32_t> out(64, stamp(me)), in(64, 0);
      std::unique_ptr<Request> recv, send;
      if (round % 2 == 0) recv = comm->irecv(bytes_of(in), prev, round);
      send = comm->isend(std::as_bytes(std::span(out)), next, round);
      if (round % 2 == 1) recv = comm->irecv(bytes_of(in), prev, round);
      recv->wait();
      send->wait();
      ASSERT_EQ(in.front(), stamp(prev));
      ASSERT_EQ(in.back(), stamp(prev));
    }
    world->barrier();
  });
}

// A world driven by the caller's own threads: handing out communicators
// while ranks split (and so add groups to the world) is safe, and
// mark_failed releases a waiting peer with an error that names the rank.
TEST(InProcess, CallerDrivenWorldHandsOutCommunicatorsDuringSplits) {
  constexpr std::size_t P = 4;
  InProcessWorld world(P, InProcessOptions{10s});
  std::vector<std::shared_ptr<Communicator>> comms;
  for (std::size_t r = 0; r < P; ++r) comms.push_back(world.communicator(r));
  std::atomic<bool> splitting{true};
  std::vector<std::thread> threads;
  std::vector<std::size_t> sizes(P, 0);
  for (std::size_t r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      for (int i = 0; i < 50; ++i) sizes[r] += comms[r]->split(static_cast<int>(r % 2), 0)->size();
      world.mark_exited(r);
    });
  }
  std::thread reader([&] {
    while (splitting.load()) {
      EXPECT_EQ(world.communicator(P - 1)->global_ranks().size(), P);
      std::this_thread::yield();
    }
  });
  for (auto& t : threads) t.join();
  splitting = false;
  reader.join();
  for (std::size_t r = 0; r < P; ++r) EXPECT_EQ(sizes[r], 50u * 2);

  InProcessWorld pair(2, InProcessOptions{10s});
  std::thread failing([&] { pair.mark_failed(1, "disk on fire"); });
  try {
    pair.communicator(0)->barrier();
    ADD_FAILURE() << "no exception";
  } catch (const RemoteError& e) {
    EXPECT_NE(std::string(e.what()).find("peer rank 1 failed (disk on fire)"), std::string::npos)
        << e.what();
  }
  failing.join();
}

// A rank that never arrives: the first waiter to reach the world's bound
// times out naming it and abandons the barrier, which releases the others
// at once with RemoteError; run() returns well within the silent rank's sleep.
TEST(InProcess, SilentRankTimesOutOneWaiterAndReleasesTheRest) {
  constexpr std::size_t P = 8;
  const auto start = std::chrono::steady_clock::now();
  std::atomic<std::size_t> timeouts{0}, remote_errors{0}, waiters_done{0};
  EXPECT_THROW(
      run_in_process(P, [&](const std::shared_ptr<Communicator>& comm) {
        if (comm->rank() == P - 1) {
          const auto until = std::chrono::steady_clock::now() + 10s;
          while (waiters_done.load() < P - 1 && std::chrono::steady_clock::now() < until)
            std::this_thread::sleep_for(1ms);
          return;
        }
        try {
          comm->barrier();
        } catch (const Timeout& e) {
          EXPECT_NE(std::string(e.what()).find("waiting for peer rank(s) 7"), std::string::npos)
              << e.what();
          ++timeouts;
          ++waiters_done;
          throw;
        } catch (const RemoteError& e) {
          EXPECT_NE(std::string(e.what()).find("abandoned by rank"), std::string::npos)
              << e.what();
          ++remote_errors;
          ++waiters_done;
          throw;
        }
      }, InProcessOptions{200ms}),
      Error);
  EXPECT_EQ(timeouts.load(), 1u);
  EXPECT_EQ(remote_errors.load(), P - 2);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

}  // namespace
}  // namespace kdacp
