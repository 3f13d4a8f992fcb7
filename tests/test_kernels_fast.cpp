// The tuned fold path. A fused scan must equal the same steps taken
// one affine_step at a time, bit for bit, for every step count (the ping-pong
// scratch is only used from two steps on), thread count, direction and
// strided (packed) layout; a one-step scan allocates no scratch; the peak
// probe measures something.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kdacp/kernels.hpp"
#include "kdacp/memory.hpp"
#include "kdacp/report/bench.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp {
namespace {

// `p` packed [S|M] slots of [1, slabs, k, v + k]: strided views as a gather
// buffer holds them.
struct Packed {
  std::size_t p, slabs, k, v;
  std::vector<float> buf;
  Packed(std::size_t p_, std::size_t slabs_, std::size_t k_, std::size_t v_)
      : p(p_), slabs(slabs_), k(k_), v(v_), buf(p_ * slabs_ * k_ * (v_ + k_)) {
    Rng rng(p * 7 + k * 3 + v);
    for (std::size_t i = 0; i < buf.size(); ++i) {
      const bool is_m = i % (v + k) >= v;
      buf[i] = is_m ? rng.uniform(-1, 1) / float(k) : rng.uniform(-1, 1);
    }
  }
  std::size_t ld() const { return v + k; }
  const float* s(std::size_t r, std::size_t slab) const { return buf.data() + (r * slabs + slab) * k * ld(); }
  const float* m(std::size_t r, std::size_t slab) const { return s(r, slab) + v; }
  Slots slots() {
    auto view = [&](std::size_t off, std::size_t cols) {
      StateView b;
      b.data = buf.data() + off;
      b.batch = 1, b.heads = slabs, b.rows = k, b.cols = cols;
      b.row_stride = ld(), b.head_stride = k * ld(), b.batch_stride = slabs * k * ld();
      return StackView{b, p, slabs * k * ld()};
    };
    return {view(0, v), view(v, k)};
  }
};

struct FastCase {
  std::size_t k, v, slabs, threads;
};

class FusedChain : public ::testing::TestWithParam<FastCase> {};

TEST_P(FusedChain, EqualsStepByStepBitwise) {
  const auto [k, v, slabs, threads] = GetParam();
  constexpr std::size_t kSlots = 5;
  Packed packed(kSlots, slabs, k, v);
  const Slots slots = packed.slots();
  State incoming(1, slabs, k, v);
  Rng rng(k + v);
  for (std::size_t i = 0; i < incoming.size(); ++i) incoming.data()[i] = rng.uniform(-1, 1);
  ThreadPool pool(threads);
  const ExecPolicy policy{&pool, KernelKind::best};
  for (Direction dir : {Direction::forward, Direction::backward}) {
    const bool fwd = dir == Direction::forward;
    for (std::size_t count = 0; count <= kSlots; ++count) {
      State fused(1, slabs, k, v);
      const StateView in = incoming.view();
      scan(slots, fwd ? 0 : kSlots - 1, count, dir, &in, fused.view(), std::nullopt, nullptr, policy);
      // The same steps, one call each, alternating two dense states.
      std::vector<float> x(incoming.data(), incoming.data() + incoming.size()), c(x.size());
      for (std::size_t t = 0; t < count; ++t) {
        const std::size_t j = fwd ? t : kSlots - 1 - t;
        for (std::size_t slab = 0; slab < slabs; ++slab)
          affine_step(packed.m(j, slab), packed.ld(), x.data() + slab * k * v, v, packed.s(j, slab),
                      packed.ld(), c.data() + slab * k * v, v, k, v, dir);
        std::swap(x, c);
      }
      EXPECT_EQ(0, std::memcmp(x.data(), fused.data(), fused.bytes()))
          << to_string(dir) << " count " << count;
    }
  }
}

// Sizes (multiples of 16, as scan requires) with one-vector column tiles and
// partial blocks; threads 1 to 3 (uneven shares). affine_step alone is swept
// over odd sizes in test_kernels.cpp.
INSTANTIATE_TEST_SUITE_P(Shapes, FusedChain,
                         ::testing::Values(FastCase{16, 16, 1, 1}, FastCase{48, 80, 3, 3},
                                           FastCase{128, 128, 2, 2}, FastCase{80, 208, 4, 3},
                                           FastCase{256, 64, 1, 1}),
                         [](const auto& info) {
                           const FastCase& c = info.param;
                           // Appends, not operator+ on a literal: g++ 12 warns
                           // falsely (-Wrestrict) on the latter.
                           std::string name = "K";
                           name += std::to_string(c.k);
                           name += 'V';
                           name += std::to_string(c.v);
                           name += 'S';
                           name += std::to_string(c.slabs);
                           name += 'T';
                           name += std::to_string(c.threads);
                           return name;
                         });

TEST(FusedChain, OneStepAllocatesNothing) {
  Packed packed(2, 2, 32, 32);
  State incoming(1, 2, 32, 32), out(1, 2, 32, 32);
  const StateView in = incoming.view();
  MemoryScope scope;
  scan(packed.slots(), 0, 1, Direction::forward, &in, out.view(), std::nullopt, nullptr);
  EXPECT_EQ(0u, scope.peak());
}

TEST(PeakProbe, MeasuresAPositivePeakOnTheKernelTarget) {
  const PeakResult r = measure_fma_peak(1, 0.01);
  EXPECT_GT(r.gflops, 0.1);
  EXPECT_EQ(1u, r.threads);
  EXPECT_EQ(simd_target_name(), r.target);
}

}  // namespace
}  // namespace kdacp
