#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <chrono>
#include <mutex>
#include <sstream>
#include <thread>

#include "helpers.hpp"
#include "kdacp/error.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp {
namespace {

using test::World;

struct Results {
  std::vector<State> fwd, bwd;
};

// Runs `method` on P in-process ranks over a plain 1-D CP mesh.
Results run_protocol(const World& w, const std::string& method, long long width,
                     std::size_t threads = 1) {
  const std::size_t p = w.size();
  Results res{std::vector<State>(p), std::vector<State>(p)};
  run_in_process(p, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t r = comm->rank();
    ThreadPool pool(threads);
    ExchangeOptions opts;
    opts.exec.pool = threads > 1 ? &pool : nullptr;
    auto mesh = DeviceMesh::create(comm, {p}, {"cp"});
    auto ex = make_state_exchange(mesh, method, width, opts);
    res.fwd[r] = ex->forward(w.s[r].view(), w.m[r].view());
    res.bwd[r] = ex->backward(w.g[r].view(), w.m[r].view());
  });
  return res;
}

TEST(Exchange, ThreadCountDoesNotChangeBits) {
  World w(4, SummaryShape{2, 3, 32, 32}, 5);
  for (const std::string method : {"allgather", "grouped_allgather_p2p"}) {
    const long long gw = method == "allgather" ? 1 : 2;
    const auto one = run_protocol(w, method, gw, 1);
    const auto three = run_protocol(w, method, gw, 3);
    for (std::size_t r = 0; r < 4; ++r) {
      EXPECT_TRUE(test::bitwise_equal(one.fwd[r], three.fwd[r]));
      EXPECT_TRUE(test::bitwise_equal(one.bwd[r], three.bwd[r]));
    }
  }
}

TEST(Exchange, NonContiguousGlobalRanksAndConcurrentSiblings) {
  // CP positions on global ranks 2r+1, the even ranks form a sibling CP group
  // that exchanges different data at the same time.
  constexpr std::size_t P = 4;
  const SummaryShape shape{1, 2, 16, 32};
  World odd(P, shape, 77), even(P, shape, 78);
  const auto want_odd = run_protocol(odd, "p2p", 1);
  const auto want_even = run_protocol(even, "p2p", 1);
  for (const std::string method : {"p2p", "allgather", "grouped_allgather_p2p"}) {
    const long long gw = method == "grouped_allgather_p2p" ? 2 : 1;
    std::mutex mu;
    std::vector<State> got_odd(P), got_even(P);
    run_in_process(2 * P, [&](const std::shared_ptr<Communicator>& world) {
      const std::size_t g = world->rank();
      const bool is_odd = g % 2 == 1;
      std::vector<std::size_t> ranks;
      for (std::size_t r = 0; r < P; ++r) ranks.push_back(2 * r + (is_odd ? 1 : 0));
      // A CP mesh whose root is the whole world (the (dp=2, cp=P) layout).
      auto root = DeviceMesh::create(world, {P, 2}, {"cp", "dp"});
      auto mesh = root["cp"];
      EXPECT_EQ(mesh.rank_list(), ranks);
      auto ex = make_state_exchange(mesh, method, gw);
      const World& w = is_odd ? odd : even;
      const std::size_t r = mesh.local_rank();
      State f = ex->forward(w.s[r].view(), w.m[r].view());
      State b = ex->backward(w.g[r].view(), w.m[r].view());
      std::lock_guard lock(mu);
      (is_odd ? got_odd : got_even)[r] = std::move(f);
      (void)b;
    });
    for (std::size_t r = 0; r < P; ++r) {
      EXPECT_TRUE(test::bitwise_equal(got_odd[r], want_odd.fwd[r])) << method << " odd " << r;
      EXPECT_TRUE(test::bitwise_equal(got_even[r], want_even.fwd[r])) << method << " even " << r;
    }
  }
}

TEST(Exchange, ExplicitGroupMeshOnOddRanks) {
  constexpr std::size_t P = 3;
  World w(P, SummaryShape{1, 1, 16, 16}, 9);
  const auto want = run_protocol(w, "p2p", 1);
  std::vector<State> got(P);
  std::mutex mu;
  run_in_process(2 * P, [&](const std::shared_ptr<Communicator>& world) {
    const std::size_t g = world->rank();
    auto cp = world->split(static_cast<int>(g % 2), static_cast<int>(g));
    if (g % 2 == 0) return;
    std::vector<std::size_t> ranks{1, 3, 5};
    auto mesh = DeviceMesh::from_group(cp, ranks, "cp");
    auto ex = make_state_exchange(mesh, "allgather");
    const std::size_t r = mesh.local_rank();
    State f = ex->forward(w.s[r].view(), w.m[r].view());
    std::lock_guard lock(mu);
    got[r] = std::move(f);
  });
  for (std::size_t r = 0; r < P; ++r) EXPECT_TRUE(test::bitwise_equal(got[r], want.fwd[r]));
}

TEST(Exchange, LiveForwardsThenBackwardsInReverseLeaveInputsUntouched) {
  constexpr std::size_t P = 4;
  const SummaryShape shape{1, 2, 16, 16};
  std::vector<World> calls;
  for (int c = 0; c < 3; ++c) calls.emplace_back(P, shape, 200 + c);
  for (const std::string method : {"p2p", "allgather", "grouped_allgather_p2p"}) {
    const long long gw = method == "grouped_allgather_p2p" ? 2 : 1;
    std::vector<Results> want;
    for (const auto& w : calls) want.push_back(run_protocol(w, "p2p", 1));
    run_in_process(P, [&](const std::shared_ptr<Communicator>& comm) {
      const std::size_t r = comm->rank();
      auto mesh = DeviceMesh::create(comm, {P}, {"cp"});
      auto ex = make_state_exchange(mesh, method, gw);
      std::vector<State> s_copy, m_copy, g_copy, fwd(3), bwd(3);
      for (auto& w : calls) {
        s_copy.push_back(test::copy_of(w.s[r]));
        m_copy.push_back(test::copy_of(w.m[r]));
        g_copy.push_back(test::copy_of(w.g[r]));
      }
      for (int c = 0; c < 3; ++c) fwd[c] = ex->forward(calls[c].s[r].view(), calls[c].m[r].view());
      for (int c = 2; c >= 0; --c) bwd[c] = ex->backward(calls[c].g[r].view(), calls[c].m[r].view());
      for (int c = 0; c < 3; ++c) {
        EXPECT_TRUE(test::bitwise_equal(fwd[c], want[c].fwd[r])) << method << " call " << c;
        EXPECT_TRUE(test::bitwise_equal(bwd[c], want[c].bwd[r])) << method << " call " << c;
        EXPECT_TRUE(test::bitwise_equal(calls[c].s[r], s_copy[c]));
        EXPECT_TRUE(test::bitwise_equal(calls[c].m[r], m_copy[c]));
        EXPECT_TRUE(test::bitwise_equal(calls[c].g[r], g_copy[c]));
      }
    });
  }
}

TEST(Exchange, StridedInputsGiveTheSameBits) {
  // S and M as views into one padded buffer per rank: row padding and a
  // packed [S|M] layout, as a caller might hold them.
  constexpr std::size_t P = 4, B = 2, H = 2, K = 32, V = 16;
  World w(P, SummaryShape{B, H, K, V}, 31);
  const auto want = run_protocol(w, "p2p", 1);
  for (const std::string method : {"p2p", "allgather", "grouped_allgather_p2p"}) {
    const long long gw = method == "grouped_allgather_p2p" ? 2 : 1;
    std::vector<State> got(P);
    std::mutex mu;
    run_in_process(P, [&](const std::shared_ptr<Communicator>& comm) {
      const std::size_t r = comm->rank();
      const std::size_t cols = V + K + 3;  // packed [S|M|pad]
      std::vector<float> store(B * H * K * cols, -7.0f);
      for (std::size_t slab = 0; slab < B * H; ++slab)
        for (std::size_t i = 0; i < K; ++i) {
          std::memcpy(&store[slab * K * cols + i * cols], w.s[r].data() + slab * K * V + i * V, V * 4);
          std::memcpy(&store[slab * K * cols + i * cols + V], w.m[r].data() + slab * K * K + i * K, K * 4);
        }
      StateView s = StateView::dense(store.data(), B, H, K, V);
      s.row_stride = cols;
      s.head_stride = K * cols;
      s.batch_stride = H * K * cols;
      StateView m = s;
      m.data = store.data() + V;
      m.cols = K;
      auto mesh = DeviceMesh::create(comm, {P}, {"cp"});
      auto ex = make_state_exchange(mesh, method, gw);
      State f = ex->forward(s, m);
      std::lock_guard lock(mu);
      got[r] = std::move(f);
    });
    for (std::size_t r = 0; r < P; ++r) EXPECT_TRUE(test::bitwise_equal(got[r], want.fwd[r])) << method << r;
  }
}

TEST(Exchange, ReportsTrafficAndPeakMemory) {
  constexpr std::size_t P = 4;
  const SummaryShape shape{1, 4, 32, 32};
  World w(P, shape, 12);
  // A packed slot carries 64 bytes of flags (the cut) after [S|M].
  const std::size_t state = shape.state_elems() * 4, slot = shape.packed_elems() * 4 + 64;
  run_in_process(P, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t r = comm->rank();
    auto mesh = DeviceMesh::create(comm, {P}, {"cp"});
    auto ag = make_state_exchange(mesh, "allgather");
    ag->forward(w.s[r].view(), w.m[r].view());
    EXPECT_EQ(ag->last_stats().peak_extra_bytes, P * slot);
    EXPECT_EQ(ag->last_stats().bytes_received, (P - 1) * slot);
    auto chain = make_state_exchange(mesh, "p2p");
    chain->forward(w.s[r].view(), w.m[r].view());
    EXPECT_LE(chain->last_stats().peak_extra_bytes, 2 * state);
    EXPECT_EQ(chain->last_stats().bytes_received, r > 0 ? state : 0);
    EXPECT_EQ(chain->last_stats().bytes_sent, r + 1 < P ? state : 0);
    auto grouped = make_state_exchange(mesh, "grouped_allgather_p2p", 2);
    grouped->forward(w.s[r].view(), w.m[r].view());
    EXPECT_LE(grouped->last_stats().peak_extra_bytes, 2 * slot + 2 * state);
  });
}

TEST(Exchange, TwoIndependentWorldsRunAtOnce) {
  World a(3, SummaryShape{1, 1, 16, 16}, 1), b(5, SummaryShape{1, 2, 16, 32}, 2);
  const auto want_a = run_protocol(a, "p2p", 1), want_b = run_protocol(b, "p2p", 1);
  Results got_a, got_b;
  std::thread ta([&] { got_a = run_protocol(a, "allgather", 1); });
  std::thread tb([&] { got_b = run_protocol(b, "allgather", 1); });
  ta.join();
  tb.join();
  for (std::size_t r = 0; r < 3; ++r) EXPECT_TRUE(test::bitwise_equal(got_a.fwd[r], want_a.fwd[r]));
  for (std::size_t r = 0; r < 5; ++r) EXPECT_TRUE(test::bitwise_equal(got_b.bwd[r], want_b.bwd[r]));
}

}  // namespace
}  // namespace kdacp

namespace kdacp {
namespace {

// The float64 verification path: the same protocols on double summaries stay
// bitwise identical to each other and match the FP64 chain to round-off.
TEST(Exchange, Float64SummariesRunEveryProtocolExactly) {
  constexpr std::size_t P = 6;
  const SummaryShape shape{1, 2, 16, 32};
  test::World w(P, shape, 64);
  const auto ref_f = w.reference(Direction::forward);
  const auto ref_b = w.reference(Direction::backward);
  auto widen = [](const State& s) {
    State d(s.batch(), s.heads(), s.rows(), s.cols(), DType::f64);
    for (std::size_t i = 0; i < s.size(); ++i) d.data<double>()[i] = s.data()[i];
    return d;
  };
  std::vector<State> s64, m64, g64;
  for (std::size_t r = 0; r < P; ++r) {
    s64.push_back(widen(w.s[r]));
    m64.push_back(widen(w.m[r]));
    g64.push_back(widen(w.g[r]));
  }
  std::vector<std::vector<State>> fwd, bwd;
  for (const auto& [name, width] : std::vector<std::pair<std::string, long long>>{
           {"p2p", 1}, {"allgather", 1}, {"grouped_allgather_p2p", 3}}) {
    // Copies: clang 14 cannot capture structured bindings in a lambda.
    const std::string method = name;
    const long long gw = width;
    std::vector<State> f(P), b(P);
    run_in_process(P, [&](const std::shared_ptr<Communicator>& comm) {
      const std::size_t r = comm->rank();
      auto mesh = DeviceMesh::create(comm, {P}, {"cp"});
      auto ex = make_state_exchange(mesh, method, gw);
      f[r] = ex->forward(s64[r].view(), m64[r].view());
      b[r] = ex->backward(g64[r].view(), m64[r].view());
    });
    fwd.push_back(std::move(f));
    bwd.push_back(std::move(b));
  }
  for (std::size_t i = 0; i < fwd.size(); ++i)
    for (std::size_t r = 0; r < P; ++r) {
      ASSERT_EQ(fwd[i][r].dtype(), DType::f64);
      EXPECT_EQ(0, std::memcmp(fwd[i][r].data(), fwd[0][r].data(), fwd[0][r].bytes())) << i << r;
      EXPECT_EQ(0, std::memcmp(bwd[i][r].data(), bwd[0][r].data(), bwd[0][r].bytes())) << i << r;
      double num = 0, den = 0;
      for (std::size_t e = 0; e < ref_f[r].size(); ++e) {
        const double d = fwd[i][r].data<double>()[e] - ref_f[r][e];
        num += d * d;
        den += ref_f[r][e] * ref_f[r][e];
        const double db = bwd[i][r].data<double>()[e] - ref_b[r][e];
        num += db * db;
        den += ref_b[r][e] * ref_b[r][e];
      }
      EXPECT_LT(std::sqrt(num / std::max(den, 1e-300)), 1e-13) << i << r;
    }
}

TEST(Exchange, MixedDtypesAreRejected) {
  State s(1, 1, 16, 16, DType::f64), m(1, 1, 16, 16);
  EXPECT_THROW(validate_summary(s.view(), m.view(), "S", 0), InvalidArgument);
}

}  // namespace
}  // namespace kdacp
