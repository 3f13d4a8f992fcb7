#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "helpers.hpp"
#include "kdacp/error.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp {
namespace {

struct StepCase {
  std::size_t k, v;
};

class StepTest : public ::testing::TestWithParam<StepCase> {};

// op(M)·X + S in double, for one slab.
std::vector<double> step_ref(const std::vector<float>& m, const std::vector<float>& x,
                             const std::vector<float>& s, std::size_t k, std::size_t v, bool t) {
  std::vector<double> c(k * v);
  for (std::size_t i = 0; i < k; ++i)
    for (std::size_t j = 0; j < v; ++j) {
      double acc = s[i * v + j];
      for (std::size_t kk = 0; kk < k; ++kk) acc += double(t ? m[kk * k + i] : m[i * k + kk]) * x[kk * v + j];
      c[i * v + j] = acc;
    }
  return c;
}

TEST_P(StepTest, SimdMatchesScalarAndReference) {
  const auto [k, v] = GetParam();
  Rng rng(k * 1000 + v);
  std::vector<float> m(k * k), x(k * v), s(k * v);
  for (auto& e : m) e = rng.uniform(-1, 1) / float(k);
  for (auto& e : x) e = rng.uniform(-1, 1);
  for (auto& e : s) e = rng.uniform(-1, 1);
  for (Direction dir : {Direction::forward, Direction::backward}) {
    std::vector<float> cs(k * v), cv(k * v);
    affine_step(m.data(), k, x.data(), v, s.data(), v, cs.data(), v, k, v, dir, KernelKind::scalar);
    affine_step(m.data(), k, x.data(), v, s.data(), v, cv.data(), v, k, v, dir, KernelKind::simd);
    const auto ref = step_ref(m, x, s, k, v, dir == Direction::backward);
    double num = 0, den = 0;
    for (std::size_t i = 0; i < k * v; ++i) {
      num += (cv[i] - ref[i]) * (cv[i] - ref[i]);
      den += ref[i] * ref[i];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-6) << to_string(dir);
    // Both kernels do acc = S then a fused multiply-add over k in order (the
    // FMA policy, src/kernels/table.hpp): they agree bit for bit on every
    // target, whatever the SIMD width and register blocking.
    EXPECT_EQ(0, std::memcmp(cs.data(), cv.data(), cs.size() * sizeof(float)))
        << to_string(dir) << " on " << simd_target_name();
  }
}

TEST_P(StepTest, OutputMayAliasOffset) {
  const auto [k, v] = GetParam();
  Rng rng(7 + k + v);
  std::vector<float> m(k * k), x(k * v), s(k * v);
  for (auto& e : m) e = rng.uniform(-1, 1) / float(k);
  for (auto& e : x) e = rng.uniform(-1, 1);
  for (auto& e : s) e = rng.uniform(-1, 1);
  std::vector<float> c(k * v), inplace = s;
  affine_step(m.data(), k, x.data(), v, s.data(), v, c.data(), v, k, v, Direction::forward);
  affine_step(m.data(), k, x.data(), v, inplace.data(), v, inplace.data(), v, k, v, Direction::forward);
  EXPECT_EQ(0, std::memcmp(c.data(), inplace.data(), c.size() * sizeof(float)));
}

// Around the lane count and register tiles; the public step takes any size.
INSTANTIATE_TEST_SUITE_P(Sizes, StepTest,
                         ::testing::Values(StepCase{16, 16}, StepCase{16, 48}, StepCase{32, 16},
                                           StepCase{64, 128}, StepCase{128, 128},
                                           StepCase{128, 64}, StepCase{256, 256},
                                           StepCase{5, 7}, StepCase{9, 33}, StepCase{1, 1}),
                         [](const auto& info) {
                           std::ostringstream name;
                           name << "K" << info.param.k << "_V" << info.param.v;
                           return name.str();
                         });

// Packed [S|M] slots for a stacked world.
struct Packed {
  SummaryShape shape;
  std::size_t p;
  std::vector<float> buf;
  Packed(const test::World& w) : shape(w.shape), p(w.size()), buf(p * w.shape.packed_elems()) {
    const std::size_t k = shape.key_dim, v = shape.value_dim, cols = v + k;
    for (std::size_t r = 0; r < p; ++r)
      for (std::size_t slab = 0; slab < shape.slabs(); ++slab)
        for (std::size_t i = 0; i < k; ++i) {
          float* row = buf.data() + r * shape.packed_elems() + slab * k * cols + i * cols;
          std::memcpy(row, w.s[r].data() + slab * k * v + i * v, v * 4);
          std::memcpy(row + v, w.m[r].data() + slab * k * k + i * k, k * 4);
        }
  }
  Slots slots() {
    const std::size_t k = shape.key_dim, v = shape.value_dim, cols = v + k;
    StateView off = StateView::dense(buf.data(), shape.batch, shape.heads, k, v);
    off.row_stride = cols;
    off.head_stride = k * cols;
    off.batch_stride = shape.heads * k * cols;
    StateView tr = off;
    tr.data = buf.data() + v;
    tr.cols = k;
    return {StackView{off, p, shape.packed_elems()}, StackView{tr, p, shape.packed_elems()}};
  }
};

TEST(Merge, PackedStridedMatchesChainForEveryRankAndFlag) {
  const SummaryShape shape{2, 3, 32, 48};
  test::World w(5, shape, 42);
  const auto ref = w.reference(Direction::forward);
  ThreadPool pool(3);
  for (std::size_t r = 0; r < 5; ++r) {
    State plain(2, 3, 32, 48), consumed(2, 3, 32, 48), threaded(2, 3, 32, 48);
    Packed a(w), b(w);
    merge(a.slots(), r, Direction::forward, plain.view());
    merge(b.slots(), r, Direction::forward, consumed.view(), {}, FoldFlags::consume_offsets);
    Packed c(w);
    merge(c.slots(), r, Direction::forward, threaded.view(), ExecPolicy{&pool, KernelKind::best});
    EXPECT_TRUE(test::bitwise_equal(plain, consumed)) << r;
    EXPECT_TRUE(test::bitwise_equal(plain, threaded)) << r;
    EXPECT_LT(reference::compare(plain.data(), ref[r]).rel_fro, 1e-6) << r;
    if (r == 1) {
      EXPECT_EQ(0, std::memcmp(plain.data(), w.s[0].data(), plain.bytes()));
    }
  }
}

TEST(Scan, PrefixAndIncomingAndEmpty) {
  const SummaryShape shape{1, 2, 16, 32};
  test::World w(4, shape, 3);
  Packed pk(w);
  State in = test::copy_of(w.g[0]);
  State out(1, 2, 16, 32), pre(1, 2, 16, 32), step_by_step(1, 2, 16, 32);
  const StateView iv = in.view(), pv = pre.view();
  scan(pk.slots(), 0, 4, Direction::forward, &iv, out.view(), 2, &pv);
  // Same thing one step at a time.
  State x = test::copy_of(in);
  for (std::size_t j = 0; j < 4; ++j) {
    State y(1, 2, 16, 32);
    const StateView xv = x.view();
    scan(pk.slots(), j, 1, Direction::forward, &xv, y.view(), std::nullopt, nullptr);
    x = std::move(y);
    if (j == 1) {
      EXPECT_TRUE(test::bitwise_equal(x, pre));
    }
  }
  EXPECT_TRUE(test::bitwise_equal(x, out));
  // Zero steps: the incoming state; zero steps and no incoming: zeros.
  State same(1, 2, 16, 32), zeros(1, 2, 16, 32);
  scan(pk.slots(), 0, 0, Direction::forward, &iv, same.view(), std::nullopt, nullptr);
  EXPECT_TRUE(test::bitwise_equal(same, in));
  std::fill(zeros.data(), zeros.data() + zeros.size(), 1.0f);
  scan(pk.slots(), 0, 0, Direction::forward, nullptr, zeros.view(), std::nullopt, nullptr);
  for (std::size_t i = 0; i < zeros.size(); ++i) ASSERT_EQ(zeros.data()[i], 0.0f);
}

TEST(Scan, RejectsRangesOutsideTheSlots) {
  const SummaryShape shape{1, 1, 16, 16};
  test::World w(3, shape, 1);
  Packed pk(w);
  State out(1, 1, 16, 16);
  EXPECT_THROW(scan(pk.slots(), 2, 2, Direction::forward, nullptr, out.view(), std::nullopt, nullptr),
               InvalidArgument);
  EXPECT_THROW(scan(pk.slots(), 1, 3, Direction::backward, nullptr, out.view(), std::nullopt, nullptr),
               InvalidArgument);
  EXPECT_THROW(merge(pk.slots(), 3, Direction::forward, out.view()), InvalidArgument);
  State pre(1, 1, 16, 16);
  const StateView pv = pre.view();
  EXPECT_THROW(scan(pk.slots(), 0, 1, Direction::forward, nullptr, out.view(), 2, &pv),
               InvalidArgument);
}

TEST(ThreadPool, CoversEveryIndexOnceAndRethrows) {
  ThreadPool pool(3);
  std::vector<int> hits(101, 0);
  pool.parallel_for(hits.size(), [&](std::size_t i) { ++hits[i]; });
  for (int h : hits) EXPECT_EQ(h, 1);
  EXPECT_THROW(pool.parallel_for(10, [](std::size_t i) { if (i == 7) throw std::runtime_error("x"); }),
               std::runtime_error);
  pool.parallel_for(4, [&](std::size_t i) { hits[i] = 5; });
  EXPECT_EQ(hits[3], 5);
}

}  // namespace
}  // namespace kdacp
