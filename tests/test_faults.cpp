// SPEC §8 under injected faults: every protocol of the registry, on P ∈ {2, 4,
// 7}, driven through testing::FaultInjector. A late message changes no bit; a
// lost message or a rank that stops answering is an error naming the sender
// (a Timeout, within the timeout) on the ranks that wait for it; a failing rank is a RemoteError
// naming it on every rank that waits for it, long before the timeout, and the
// run rethrows the root cause. The configurations of one P run as concurrent
// worlds, so each test costs about one timeout whatever the registry holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "helpers.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/faulty_comm.hpp"

namespace kdacp {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::Fault;
using testing::FaultAction;
using testing::FaultOp;
using test::World;

const SummaryShape kShape{1, 2, 16, 16};
// Runs that must fail by timing out use a short timeout; runs that must not
// time out (late messages, a failing rank) a long one, so that an error there
// can only come from the fault itself.
constexpr std::chrono::milliseconds kShortTimeout = 300ms;
constexpr std::chrono::milliseconds kLongTimeout = 30s;
// Allowance for scheduling on top of a timeout: many rank threads share few
// cores, and the sanitizer builds run these tests too.
constexpr std::chrono::milliseconds kSlack = 1500ms;

double seconds(std::chrono::milliseconds d) { return std::chrono::duration<double>(d).count(); }

// Ends the process with a message when a test outlives its bound: a rank that
// hangs is a failure to report, not a test that never finishes.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds bound)
      : thread_([this, bound] {
          std::unique_lock lock(mu_);
          if (!cv_.wait_for(lock, bound, [this] { return done_; })) {
            std::fprintf(stderr, "test_faults: a run exceeded %lld s: a rank hangs\n",
                         static_cast<long long>(bound.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

enum class End { ok, timeout, remote, injected, other };

struct RankEnd {
  End end = End::ok;
  std::string what;
  double seconds = 0;  // from this rank's first forward to its result or error
  State fwd, bwd;
  std::vector<State> fwd_parts, bwd_parts;  // with a layout: this rank's parts
};

struct FaultRun {
  std::string label;
  std::vector<RankEnd> ranks;
  std::vector<std::size_t> fired;
  std::exception_ptr thrown;  // what run_in_process rethrew
};

// A layout (SPEC §10) for the runs that take one: the owner of each part and
// its cut flag; no owners: one part per rank, run with the plain calls.
struct LayoutArgs {
  std::optional<PartOwners> owners;
  std::vector<char> cuts;
};

// One world running forward + backward of `config` with `plan` injected once
// every rank built its exchange; with a layout, `w` holds one summary per part.
FaultRun run_with_faults(const World& w, const ProtocolConfig& config, std::vector<Fault> plan,
                         std::chrono::milliseconds timeout, const LayoutArgs& layout = {}) {
  std::size_t p = w.size();
  if (layout.owners) p = layout.owners->ranks();
  FaultRun run{protocol_label(config), std::vector<RankEnd>(p), {}, nullptr};
  testing::FaultInjector injector(p, std::move(plan));
  try {
    run_in_process(
        p,
        [&](const std::shared_ptr<Communicator>& world) {
          const std::size_t r = world->rank();
          RankEnd& end = run.ranks[r];
          ExchangeOptions o;
          o.segments = config.segments;
          o.part_owners = layout.owners;
          const DeviceMesh mesh = DeviceMesh::create(injector.wrap(world), {p}, {"cp"});
          auto ex = make_state_exchange(mesh, config.method,
                                        static_cast<long long>(config.group_size), o);
          injector.arm(r);
          const auto t0 = Clock::now();
          auto stamp = [&](End e, const char* what) {
            end.end = e;
            end.what = what;
            end.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
          };
          try {
            if (!layout.owners) {
              end.fwd = ex->forward(w.s[r].view(), w.m[r].view());
              end.bwd = ex->backward(w.g[r].view(), w.m[r].view());
            } else {
              std::vector<PartSummary> fwd, bwd;
              for (std::size_t j : ex->own_parts()) {
                fwd.push_back({w.s[j].view(), w.m[j].view(), PartFlags{layout.cuts[j] != 0}});
                bwd.push_back({w.g[j].view(), w.m[j].view(), PartFlags{layout.cuts[j] != 0}});
              }
              end.fwd_parts = ex->forward(fwd);
              end.bwd_parts = ex->backward(bwd);
            }
            stamp(End::ok, "");
          } catch (const Timeout& e) {
            stamp(End::timeout, e.what());
            throw;
          } catch (const RemoteError& e) {
            stamp(End::remote, e.what());
            throw;
          } catch (const testing::InjectedFault& e) {
            stamp(End::injected, e.what());
            throw;
          } catch (const std::exception& e) {
            stamp(End::other, e.what());
            throw;
          }
        },
        InProcessOptions{timeout});
  } catch (...) {
    run.thrown = std::current_exception();
  }
  for (std::size_t r = 0; r < p; ++r) run.fired.push_back(injector.fired(r));
  return run;
}

struct Job {
  ProtocolConfig config;
  std::vector<Fault> plan;
  std::chrono::milliseconds timeout;
  LayoutArgs layout{};
};

// Every job as its own in-process world, all at once.
std::vector<FaultRun> run_concurrently(const World& w, const std::vector<Job>& jobs) {
  std::vector<FaultRun> runs(jobs.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < jobs.size(); ++i)
    threads.emplace_back([&, i] { runs[i] = run_with_faults(w, jobs[i].config, jobs[i].plan, jobs[i].timeout, jobs[i].layout); });
  for (auto& t : threads) t.join();
  return runs;
}

// Every configuration of every row at P (the chooser has none).
std::vector<ProtocolConfig> all_configs(std::size_t p) {
  std::vector<ProtocolConfig> out;
  for (const ProtocolDescriptor* row : protocol_registry())
    for (const ProtocolConfig& c : valid_configs(*row, p, kShape.value_dim)) out.push_back(c);
  return out;
}

// True when the first peer `what` names, the one its rank waited for or lost
// ("irecv from rank 3", "peer rank 3 failed", "peer rank(s) 1 3"), is or
// includes global rank `r`. Later names belong to the nested causes.
bool names_peer(const std::string& what, std::size_t r) {
  static const std::regex peer(R"((?:peer rank|from rank) (\d+)|peer rank\(s\)((?: \d+)+))");
  std::smatch m;
  if (!std::regex_search(what, m, peer)) return false;
  const std::string want = std::to_string(r);
  if (m[1].matched) return m[1] == want;
  return (m[2].str() + " ").find(" " + want + " ") != std::string::npos;
}

std::size_t fired_total(const FaultRun& run) {
  std::size_t n = 0;
  for (std::size_t f : run.fired) n += f;
  return n;
}

bool thrown_is_peer_error(const FaultRun& run) {
  try {
    std::rethrow_exception(run.thrown);
  } catch (const Timeout&) {
    return true;
  } catch (const RemoteError&) {
    return true;
  } catch (...) {
    return false;
  }
}

// Every rank's end, for failure messages.
std::string ends_of(const FaultRun& run) {
  std::string out;
  for (std::size_t r = 0; r < run.ranks.size(); ++r)
    out += "\n  rank " + std::to_string(r) + ": " + (run.ranks[r].what.empty() ? "ok" : run.ranks[r].what);
  return out;
}

class Faults : public ::testing::TestWithParam<std::size_t> {};

// Late messages and late collectives on three ranks: every rank still gets
// the same bits as without them, and the exact protocols the chain's bits.
TEST_P(Faults, LateMessagesChangeNoBit) {
  const Watchdog watchdog(60s);
  const std::size_t p = GetParam();
  const World w(p, kShape, 7100 + p);
  const std::size_t mid = p / 2;
  const std::vector<Fault> late{
      {0, FaultOp::isend, 0, FaultAction::delay, 15ms, 0},
      {mid, FaultOp::any, 1, FaultAction::delay, 25ms, 0},
      {p - 1, FaultOp::collective, 0, FaultAction::delay, 15ms, 0},
      {p - 1, FaultOp::irecv, 1, FaultAction::delay, 10ms, 0},
  };
  std::vector<Job> jobs{{ProtocolConfig{std::string(kChainProtocol), 1, 0}, {}, kLongTimeout}};
  for (const ProtocolConfig& c : all_configs(p)) {
    jobs.push_back({c, {}, kLongTimeout});
    jobs.push_back({c, late, kLongTimeout});
  }
  const std::vector<FaultRun> runs = run_concurrently(w, jobs);
  const FaultRun& chain = runs[0];
  ASSERT_FALSE(chain.thrown);
  for (std::size_t i = 1; i < runs.size(); i += 2) {
    const FaultRun &clean = runs[i], &late_run = runs[i + 1];
    SCOPED_TRACE(late_run.label + " P=" + std::to_string(p));
    ASSERT_FALSE(clean.thrown);
    ASSERT_FALSE(late_run.thrown);
    EXPECT_GT(fired_total(late_run), 0u);
    const bool exact = find_protocol(jobs[i].config.method).exact();
    for (std::size_t r = 0; r < p; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_TRUE(test::bitwise_equal(late_run.ranks[r].fwd, clean.ranks[r].fwd));
      EXPECT_TRUE(test::bitwise_equal(late_run.ranks[r].bwd, clean.ranks[r].bwd));
      if (exact) {
        EXPECT_TRUE(test::bitwise_equal(clean.ranks[r].fwd, chain.ranks[r].fwd));
        EXPECT_TRUE(test::bitwise_equal(clean.ranks[r].bwd, chain.ranks[r].bwd));
      }
    }
  }
}

// The same on the zigzag layout with cuts: late messages and collectives
// change no bit of any part, and the exact rows give the chain's bits.
TEST_P(Faults, LateMessagesChangeNoBitOnZigzagWithCuts) {
  const Watchdog watchdog(60s);
  const std::size_t p = GetParam();
  LayoutArgs layout{PartOwners::zigzag(p), std::vector<char>(2 * p, 0)};
  for (std::size_t j = 0; j < 2 * p; ++j) layout.cuts[j] = j % 3 == 2;
  const World w(2 * p, kShape, 7300 + p);
  const std::size_t mid = p / 2;
  const std::vector<Fault> late{
      {0, FaultOp::isend, 0, FaultAction::delay, 15ms, 0},
      {mid, FaultOp::any, 1, FaultAction::delay, 25ms, 0},
      {p - 1, FaultOp::collective, 0, FaultAction::delay, 15ms, 0},
      {p - 1, FaultOp::irecv, 1, FaultAction::delay, 10ms, 0},
  };
  std::vector<Job> jobs{{ProtocolConfig{std::string(kChainProtocol), 1, 0}, {}, kLongTimeout, layout}};
  for (const ProtocolConfig& c : all_configs(p)) {
    jobs.push_back({c, {}, kLongTimeout, layout});
    jobs.push_back({c, late, kLongTimeout, layout});
  }
  const std::vector<FaultRun> runs = run_concurrently(w, jobs);
  const FaultRun& chain = runs[0];
  ASSERT_FALSE(chain.thrown);
  for (std::size_t i = 1; i < runs.size(); i += 2) {
    const FaultRun &clean = runs[i], &late_run = runs[i + 1];
    SCOPED_TRACE(late_run.label + " zigzag P=" + std::to_string(p));
    ASSERT_FALSE(clean.thrown);
    ASSERT_FALSE(late_run.thrown);
    EXPECT_GT(fired_total(late_run), 0u);
    const bool exact = find_protocol(jobs[i].config.method).exact();
    for (std::size_t r = 0; r < p; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_EQ(late_run.ranks[r].fwd_parts.size(), 2u);
      for (std::size_t k = 0; k < 2; ++k) {
        EXPECT_TRUE(test::bitwise_equal(late_run.ranks[r].fwd_parts[k], clean.ranks[r].fwd_parts[k]));
        EXPECT_TRUE(test::bitwise_equal(late_run.ranks[r].bwd_parts[k], clean.ranks[r].bwd_parts[k]));
        if (exact) {
          EXPECT_TRUE(test::bitwise_equal(clean.ranks[r].fwd_parts[k], chain.ranks[r].fwd_parts[k]));
          EXPECT_TRUE(test::bitwise_equal(clean.ranks[r].bwd_parts[k], chain.ranks[r].bwd_parts[k]));
        }
      }
    }
  }
}

// A rank that stops answering on the zigzag layout with cuts: every row
// fails with a peer error within the timeout, none hangs (P = 4: one
// timeout).
TEST(FaultsOnLayouts, SilentRankOnZigzagFailsEveryRowWithinTheTimeout) {
  const std::size_t p = 4;
  const Watchdog watchdog(60s);
  LayoutArgs layout{PartOwners::zigzag(p), std::vector<char>(2 * p, 0)};
  for (std::size_t j = 0; j < 2 * p; ++j) layout.cuts[j] = j == p + 1;
  const World w(2 * p, kShape, 7400 + p);
  const std::size_t silent = 1;
  const auto hold = 4 * kShortTimeout;
  std::vector<Job> jobs;
  for (const ProtocolConfig& c : all_configs(p))
    jobs.push_back({c, {{silent, FaultOp::any, 1, FaultAction::delay, hold, 0}}, kShortTimeout, layout});
  for (const FaultRun& run : run_concurrently(w, jobs)) {
    SCOPED_TRACE(run.label + " zigzag P=" + std::to_string(p));
    ASSERT_EQ(run.fired[silent], 1u);
    ASSERT_TRUE(run.thrown);
    EXPECT_TRUE(thrown_is_peer_error(run)) << ends_of(run);
    for (std::size_t r = 0; r < p; ++r) {
      const RankEnd& end = run.ranks[r];
      SCOPED_TRACE("rank " + std::to_string(r) + ": " + end.what);
      EXPECT_TRUE(end.end == End::ok || end.end == End::timeout || end.end == End::remote);
      if (r != silent) {
        EXPECT_LT(end.seconds, seconds(kShortTimeout + kSlack));
      }
    }
  }
}

// Rank 0's first message is lost. Its receiver fails naming rank 0 as the
// peer it waited for: with a Timeout; or with a RemoteError when rank 0, in
// turn waiting for it, timed out first (the receiver may have started waiting
// later), or when rank 0 needed nothing more and returned. Every rank ends
// within the timeout; nothing is a root cause. Rows where rank 0 sends
// nothing point to point (allgather) must be untouched.
TEST_P(Faults, LostMessageFailsItsReceiverNamingTheSender) {
  const Watchdog watchdog(60s);
  const std::size_t p = GetParam();
  const World w(p, kShape, 7200 + p);
  std::vector<Job> jobs;
  for (const ProtocolConfig& c : all_configs(p))
    jobs.push_back({c, {{0, FaultOp::isend, 0, FaultAction::drop, 0ms, 0}}, kShortTimeout});
  std::size_t dropped = 0;
  for (const FaultRun& run : run_concurrently(w, jobs)) {
    SCOPED_TRACE(run.label + " P=" + std::to_string(p));
    if (fired_total(run) == 0) {
      EXPECT_FALSE(run.thrown);
      continue;
    }
    ++dropped;
    ASSERT_TRUE(run.thrown);
    EXPECT_TRUE(thrown_is_peer_error(run));
    bool named = false;
    for (std::size_t r = 0; r < p; ++r) {
      const RankEnd& end = run.ranks[r];
      SCOPED_TRACE("rank " + std::to_string(r) + ": " + end.what);
      EXPECT_TRUE(end.end == End::ok || end.end == End::timeout || end.end == End::remote);
      EXPECT_LT(end.seconds, seconds(kShortTimeout + kSlack));
      named |= r != 0 && names_peer(end.what, 0);
    }
    EXPECT_TRUE(named) << "no rank failed naming rank 0:" << ends_of(run);
  }
  EXPECT_GT(dropped, 0u);
}

// A middle rank stops answering at its second operation for four timeouts,
// then resumes (SIGSTOP, later SIGCONT). The ranks waiting for it time out
// naming it, within the timeout, while it is still silent.
TEST_P(Faults, SilentRankTimesOutItsPeersNamingIt) {
  const Watchdog watchdog(60s);
  const std::size_t p = GetParam();
  const World w(p, kShape, 7300 + p);
  const std::size_t silent = p / 2;
  const auto hold = 4 * kShortTimeout;
  std::vector<Job> jobs;
  for (const ProtocolConfig& c : all_configs(p))
    jobs.push_back({c, {{silent, FaultOp::any, 1, FaultAction::delay, hold, 0}}, kShortTimeout});
  for (const FaultRun& run : run_concurrently(w, jobs)) {
    SCOPED_TRACE(run.label + " P=" + std::to_string(p));
    ASSERT_EQ(run.fired[silent], 1u);
    ASSERT_TRUE(run.thrown);
    EXPECT_TRUE(thrown_is_peer_error(run));
    bool named = false;
    for (std::size_t r = 0; r < p; ++r) {
      const RankEnd& end = run.ranks[r];
      SCOPED_TRACE("rank " + std::to_string(r) + ": " + end.what);
      EXPECT_TRUE(end.end == End::ok || end.end == End::timeout || end.end == End::remote);
      if (r == silent) {
        EXPECT_GE(end.seconds, seconds(hold));
        continue;
      }
      EXPECT_LT(end.seconds, seconds(kShortTimeout + kSlack));
      named |= end.end == End::timeout && names_peer(end.what, silent);
    }
    EXPECT_TRUE(named) << "no rank timed out naming rank " << silent << ":" << ends_of(run);
  }
}

// A middle rank throws at its second operation. Every rank that fails fails
// with RemoteError naming it, at once rather than at the (long) timeout, and
// run_in_process rethrows the injected root cause.
TEST_P(Faults, FailingRankIsNamedOnEveryRankWaitingForIt) {
  const Watchdog watchdog(60s);
  const std::size_t p = GetParam();
  const World w(p, kShape, 7400 + p);
  const std::size_t failing = p / 2;
  std::vector<Job> jobs;
  for (const ProtocolConfig& c : all_configs(p))
    jobs.push_back({c, {{failing, FaultOp::any, 1, FaultAction::fail, 0ms, 0}}, kLongTimeout});
  for (const FaultRun& run : run_concurrently(w, jobs)) {
    SCOPED_TRACE(run.label + " P=" + std::to_string(p));
    ASSERT_EQ(run.fired[failing], 1u);
    ASSERT_TRUE(run.thrown);
    try {
      std::rethrow_exception(run.thrown);
    } catch (const testing::InjectedFault& e) {
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(failing) + ": injected"),
                std::string::npos)
          << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rethrew " << e.what() << ", expected the injected failure";
    }
    std::size_t remote = 0;
    for (std::size_t r = 0; r < p; ++r) {
      const RankEnd& end = run.ranks[r];
      SCOPED_TRACE("rank " + std::to_string(r) + ": " + end.what);
      if (r == failing) {
        EXPECT_EQ(end.end, End::injected);
        continue;
      }
      EXPECT_TRUE(end.end == End::ok || end.end == End::remote);
      if (end.end == End::remote) {
        ++remote;
        // Directly ("peer rank F failed (...)") or through the peer it waited
        // for, whose failure message carries the root cause.
        EXPECT_NE(end.what.find("rank " + std::to_string(failing) + ": injected failure"),
                  std::string::npos);
      }
      EXPECT_LT(end.seconds, seconds(kSlack));
    }
    EXPECT_GT(remote, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, Faults, ::testing::Values(2, 4, 7),
                         [](const auto& info) { return std::string("P").append(std::to_string(info.param)); });

TEST(FaultInjector, RejectsPlansItCannotCarryOut) {
  auto plan = [](Fault f) { return testing::FaultInjector(4, {f}); };
  EXPECT_THROW(plan({4, FaultOp::isend, 0, FaultAction::fail, 0ms, 0}), InvalidArgument);
  EXPECT_THROW(plan({1, FaultOp::irecv, 0, FaultAction::drop, 0ms, 0}), InvalidArgument);
  EXPECT_THROW(plan({1, FaultOp::any, 0, FaultAction::signal, 0ms, 0}), InvalidArgument);
  EXPECT_THROW(plan({1, FaultOp::any, 0, FaultAction::delay, -1ms, 0}), InvalidArgument);
}

}  // namespace
}  // namespace kdacp
