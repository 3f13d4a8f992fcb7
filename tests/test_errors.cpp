// SPEC §8: every invalid input is a typed error raised before any message is
// sent, and a failing or silent peer becomes an error on every waiting rank.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <thread>

#include "helpers.hpp"
#include "kdacp/error.hpp"

namespace kdacp {
namespace {

// `scratch` is large enough for any resized view a mutator builds.
using Mutator = std::function<void(StateView& s, StateView& m, float* scratch)>;

// Every rank calls forward with mutated views: all must throw
// InvalidArgument having sent nothing; afterwards a valid exchange on the
// same executor still gives the chain's bits (no stray message in flight).
void expect_rejected(const std::string& method, long long width, const Mutator& mutate,
                     const std::string& fragment) {
  constexpr std::size_t P = 4;
  const SummaryShape shape{1, 2, 16, 16};
  test::World w(P, shape, 5);
  std::vector<float> big(4 * 272 * 272, 0.5f);
  std::mutex mu;
  std::vector<State> got(P);
  run_in_process(P, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t r = comm->rank();
    auto mesh = DeviceMesh::create(comm, {P}, {"cp"});
    auto ex = make_state_exchange(mesh, method, width);
    StateView s = w.s[r].view(), m = w.m[r].view();
    std::vector<float> own = big;  // per-rank storage for resized views
    mutate(s, m, own.data());
    test::expect_rejected_before_sending(*ex, *comm, s, m, fragment, r);
    State f = ex->forward(w.s[r].view(), w.m[r].view());
    std::lock_guard lock(mu);
    got[r] = std::move(f);
  });
  std::vector<const float*> off, maps;
  for (std::size_t r = 0; r < P; ++r) off.push_back(w.s[r].data()), maps.push_back(w.m[r].data());
  const auto ref = reference::chain(off, maps, shape, Direction::forward);
  for (std::size_t r = 0; r < P; ++r) EXPECT_LT(reference::compare(got[r].data(), ref[r]).rel_fro, 1e-6);
}

struct BadInput {
  const char* name;
  Mutator mutate;
  const char* fragment;
};

class InvalidSummary : public ::testing::TestWithParam<BadInput> {};

TEST_P(InvalidSummary, RaisedBeforeAnyMessageByEveryProtocol) {
  for (const auto& [method, width] :
       std::vector<std::pair<std::string, long long>>{{"p2p", 1}, {"allgather", 1}, {"grouped_allgather_p2p", 2}}) {
    SCOPED_TRACE(method);
    expect_rejected(method, width, GetParam().mutate, GetParam().fragment);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Spec8, InvalidSummary,
    ::testing::Values(
        BadInput{"EmptyBatch", [](StateView& s, StateView&, float*) { s.batch = 0; }, "batch size B"},
        BadInput{"EmptyHeads", [](StateView& s, StateView& m, float*) { s.heads = 0; m.heads = 0; }, "head count H"},
        BadInput{"MismatchedM", [](StateView&, StateView& m, float*) { m.heads = 1; }, "M shape"},
        BadInput{"NotFp32", [](StateView& s, StateView&, float*) { s.dtype = DType::f64; }, "dtype"},
        BadInput{"UnsupportedDevice",
                 [](StateView& s, StateView& m, float*) { s.device.kind = m.device.kind = DeviceKind::cuda; },
                 "device"},
        BadInput{"MixedDevices", [](StateView&, StateView& m, float*) { m.device.index = 1; }, "device"},
        BadInput{"ColumnStride", [](StateView& s, StateView&, float*) { s.col_stride = 2; }, "column stride"},
        BadInput{"BatchStride",
                 [](StateView& s, StateView& m, float*) { s.batch = m.batch = 2; s.heads = m.heads = 1; s.batch_stride = 3; },
                 "batch stride"},
        BadInput{"KeyDimZero",
                 [](StateView& s, StateView& m, float* scratch) {
                   s = StateView::dense(scratch, 1, 1, 0, 16);
                   m = StateView::dense(scratch, 1, 1, 0, 0);
                 },
                 "key dim K"},
        BadInput{"ValueDimTooLarge",
                 [](StateView& s, StateView& m, float* scratch) {
                   s = StateView::dense(scratch, 1, 1, 16, 272);
                   m = StateView::dense(scratch, 1, 1, 16, 16);
                 },
                 "value dim V"},
        BadInput{"NullData", [](StateView&, StateView& m, float*) { m.data = nullptr; }, "data pointer"}),
    [](const auto& info) { return std::string(info.param.name); });

// Factory and mesh rules: each must throw before any exchange traffic.
void on_world(std::size_t n, const std::function<void(const std::shared_ptr<Communicator>&)>& fn) {
  InProcessOptions o;
  o.timeout = std::chrono::milliseconds(5000);
  run_in_process(n, fn, o);
}

TEST(Factory, RejectsUnknownMethodAndBadGroupSizes) {
  on_world(4, [](const std::shared_ptr<Communicator>& comm) {
    auto mesh = DeviceMesh::create(comm, {4}, {"cp"});
    EXPECT_THROW(make_state_exchange(mesh, "ring"), InvalidArgument);
    EXPECT_THROW(make_state_exchange(mesh, "grouped_allgather_p2p", 0), InvalidArgument);
    EXPECT_THROW(make_state_exchange(mesh, "grouped_allgather_p2p", -2), InvalidArgument);
    EXPECT_THROW(make_state_exchange(mesh, "allgather", 2), InvalidArgument);
    EXPECT_THROW(make_state_exchange(mesh, "p2p", 4), InvalidArgument);
    EXPECT_THROW(make_state_exchange(mesh, "grouped_allgather_p2p", 3), InvalidArgument);
    EXPECT_EQ(make_state_exchange(mesh, "grouped_allgather_p2p", 1)->method(), "p2p");
    EXPECT_EQ(make_state_exchange(mesh, "grouped_allgather_p2p", 4)->method(), "allgather");
    EXPECT_EQ(comm->stats().messages_sent, 0u);
    try {
      make_state_exchange(mesh, "ring");
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'ring'"), std::string::npos);
    }
  });
}

TEST(Mesh, RejectsOrderMismatchDuplicatesAndBadSplits) {
  on_world(4, [](const std::shared_ptr<Communicator>& comm) {
    // Chronological list that disagrees with the communicator's order.
    auto swapped = DeviceMesh::from_group(comm, {1, 0, 2, 3}, "cp");
    EXPECT_THROW(make_state_exchange(swapped, "allgather"), InvalidArgument);
    EXPECT_THROW(make_state_exchange(swapped, "p2p"), InvalidArgument);
    EXPECT_THROW(DeviceMesh::from_group(comm, {0, 0, 2, 3}, "cp"), InvalidArgument);
    // This rank is not in the list: outside the group.
    EXPECT_THROW(DeviceMesh::from_group(comm, {10, 11, 12, 13}, "cp"), InvalidArgument);
    EXPECT_THROW(DeviceMesh::from_group(comm, {0, 1, 2}, "cp"), InvalidArgument);
    auto mesh2d = DeviceMesh::create(comm, {2, 2}, {"cp", "dp"});
    EXPECT_THROW(make_state_exchange(mesh2d, "allgather"), InvalidArgument);
    EXPECT_THROW(split_mesh(mesh2d, 2, "a", "b"), InvalidArgument);
    auto mesh = DeviceMesh::create(comm, {4}, {"cp"});
    EXPECT_THROW(split_mesh(mesh, 3, "a", "b"), InvalidArgument);
    EXPECT_THROW(split_mesh(mesh, 0, "a", "b"), InvalidArgument);
    EXPECT_THROW(DeviceMesh::create(comm, {3}, {"cp"}), InvalidArgument);
    EXPECT_THROW(DeviceMesh::create(comm, {2, 2}, {"cp", "cp"}), InvalidArgument);
    EXPECT_THROW(mesh["dp"], InvalidArgument);
  });
}

TEST(Mesh, DetachedSubmeshCannotSplit) {
  on_world(8, [](const std::shared_ptr<Communicator>& world) {
    const std::size_t g = world->rank();
    auto half = world->split(static_cast<int>(g / 4), static_cast<int>(g));
    std::vector<std::size_t> ranks;
    for (std::size_t r = 0; r < 4; ++r) ranks.push_back(g / 4 * 4 + r);
    auto detached = DeviceMesh::from_group(half, ranks, "cp");
    try {
      make_state_exchange(detached, "grouped_allgather_p2p", 2);
      ADD_FAILURE() << "detached mesh was split";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("detached"), std::string::npos) << e.what();
    }
    // The same group works for the protocols that do not split.
    EXPECT_NO_THROW(make_state_exchange(detached, "allgather"));
  });
}

TEST(Mesh, UnflattenCreatesSiblingGroupsOnEveryRank) {
  on_world(8, [](const std::shared_ptr<Communicator>& world) {
    const std::size_t g = world->rank();
    auto root = DeviceMesh::create(world, {4, 2}, {"cp", "dp"});
    auto cp = root["cp"];
    EXPECT_EQ(cp.rank_list(), (std::vector<std::size_t>{g % 2, g % 2 + 2, g % 2 + 4, g % 2 + 6}));
    auto split = split_mesh(cp, 2, "outer", "inner");
    EXPECT_EQ(split.shape(), (std::vector<std::size_t>{2, 2}));
    EXPECT_EQ(split.local_rank(0), (g / 2) / 2);
    EXPECT_EQ(split.local_rank(1), (g / 2) % 2);
    const auto& inner = split.group(1)->global_ranks();
    const std::size_t base = (g / 4) * 4 + g % 2;
    EXPECT_EQ(inner, (std::vector<std::size_t>{base, base + 2}));
    EXPECT_EQ(split["inner"].rank_list(), inner);
  });
}

TEST(Failure, ThrowingRankReleasesEveryWaiterQuickly) {
  for (const std::string method : {"p2p", "allgather", "grouped_allgather_p2p"}) {
    const long long width = method == "grouped_allgather_p2p" ? 2 : 1;
    test::World w(4, SummaryShape{1, 1, 16, 16}, 3);
    std::atomic<int> remote_errors{0};
    InProcessOptions o;
    o.timeout = std::chrono::milliseconds(30000);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      run_in_process(4, [&](const std::shared_ptr<Communicator>& comm) {
        auto mesh = DeviceMesh::create(comm, {4}, {"cp"});
        auto ex = make_state_exchange(mesh, method, width);
        const std::size_t r = comm->rank();
        if (r == 2) throw std::runtime_error("rank 2 crashed");
        try {
          ex->forward(w.s[r].view(), w.m[r].view());
          ex->backward(w.g[r].view(), w.m[r].view());
        } catch (const RemoteError& e) {
          ++remote_errors;
          EXPECT_NE(std::string(e.what()).find("peer rank"), std::string::npos) << e.what();
          throw;
        }
      }, o);
      ADD_FAILURE() << "no error";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "rank 2 crashed") << method;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(secs, 10.0) << method;
    EXPECT_GE(remote_errors.load(), 1) << method;
  }
}

TEST(Failure, SilentRankTimesOut) {
  test::World w(3, SummaryShape{1, 1, 16, 16}, 4);
  std::atomic<int> timeouts{0}, released{0};
  InProcessOptions o;
  o.timeout = std::chrono::milliseconds(300);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(run_in_process(3, [&](const std::shared_ptr<Communicator>& comm) {
    auto mesh = DeviceMesh::create(comm, {3}, {"cp"});
    auto ex = make_state_exchange(mesh, "allgather");
    const std::size_t r = comm->rank();
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    try {
      ex->forward(w.s[r].view(), w.m[r].view());
    } catch (const Timeout& e) {
      ++timeouts;
      ++released;
      EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos);
      EXPECT_NE(std::string(e.what()).find("all_gather"), std::string::npos);
      throw;
    } catch (const RemoteError& e) {
      // The first rank to time out abandons the collective: the others
      // (and the late rank itself) learn it at once instead of waiting.
      ++released;
      EXPECT_NE(std::string(e.what()).find("all_gather"), std::string::npos);
      throw;
    }
  }, o), Error);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(timeouts.load(), 1);
  EXPECT_EQ(released.load(), 3);
  EXPECT_LT(secs, 10.0);
}

}  // namespace
}  // namespace kdacp
