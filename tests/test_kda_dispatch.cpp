// The KDA kernels are compiled once per SIMD target and chosen at run time
// (src/kda/kda_math.cpp). Results must not depend on that choice: this forces
// each target the CPU supports and compares o, the final state, the summary,
// G and every gradient bitwise against the first target's.
//
// Highway's target mock lives in libhwy, which the library links privately,
// so the test binary does not link it; the functions are looked up in the
// already loaded libhwy instead. Without them (a static libhwy) the test is
// skipped.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kdacp/kda.hpp"

namespace kdacp::kda {
namespace {

using SetTargetsFn = void (*)(std::int64_t);
using GetTargetsFn = std::int64_t (*)();

// Mangled names of hwy::SetSupportedTargetsForTest(int64_t) and
// hwy::SupportedTargets() (int64_t is long on LP64).
SetTargetsFn set_targets() {
  return reinterpret_cast<SetTargetsFn>(
      dlsym(RTLD_DEFAULT, "_ZN3hwy26SetSupportedTargetsForTestEl"));
}
GetTargetsFn supported_targets() {
  return reinterpret_cast<GetTargetsFn>(dlsym(RTLD_DEFAULT, "_ZN3hwy16SupportedTargetsEv"));
}

template <class T>
struct Case {
  Shape shape;
  std::vector<T> q, k, v, g, beta, d_o, incoming, d_final;

  explicit Case(const Shape& s) : shape(s) {
    std::mt19937_64 rng(20240607);
    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    auto fill = [&](std::vector<T>& x, std::size_t n, double lo, double hi) {
      x.resize(n);
      for (auto& e : x) e = T(lo + (hi - lo) * (uni(rng) + 1) / 2);
    };
    fill(q, s.qk_elems(), -1, 1);
    fill(k, s.qk_elems(), -1, 1);
    for (std::size_t r = 0; r < k.size(); r += s.key_dim) {
      T norm = 0;
      for (std::size_t i = 0; i < s.key_dim; ++i) norm += k[r + i] * k[r + i];
      for (std::size_t i = 0; i < s.key_dim; ++i) k[r + i] /= std::sqrt(norm);
    }
    fill(v, s.v_elems(), -1, 1);
    fill(g, s.g_elems(), -0.2, 0);
    fill(beta, s.beta_elems(), 0.05, 0.95);
    fill(d_o, s.v_elems(), -1, 1);
    fill(incoming, s.state_elems(), -0.5, 0.5);
    fill(d_final, s.state_elems(), -0.5, 0.5);
  }

  // Every output of every entry point, concatenated.
  std::vector<T> run() const {
    Inputs<T> in;
    in.q = q.data();
    in.k = k.data();
    in.v = v.data();
    in.g = g.data();
    in.beta = beta.data();
    in.shape = shape;
    in.scale = default_scale<T>(shape.key_dim);
    const Shape& s = shape;
    std::vector<T> o(s.v_elems()), fin(s.state_elems()), st(s.state_elems()),
        m(s.transfer_elems()), gs(s.state_elems()), dq(s.qk_elems()), dk(s.qk_elems()),
        dv(s.v_elems()), dg(s.g_elems()), db(s.beta_elems()), di(s.state_elems());
    forward(in, incoming.data(), o.data(), fin.data(), 2);
    chunk_summary(in, st.data(), m.data(), 2);
    incoming_grad(in, d_o.data(), gs.data(), 2);
    Grads<T> grads{dq.data(), dk.data(), dv.data(), dg.data(), db.data(), di.data()};
    backward(in, incoming.data(), d_o.data(), d_final.data(), grads, 2, 5);
    std::vector<T> all;
    for (const auto* x : {&o, &fin, &st, &m, &gs, &dq, &dk, &dv, &dg, &db, &di})
      all.insert(all.end(), x->begin(), x->end());
    return all;
  }
};

// Restores the real target set however the test ends.
struct TargetMock {
  SetTargetsFn set;
  ~TargetMock() { set(0); }
};

template <class T>
void expect_same_on_every_target(const Shape& shape) {
  SetTargetsFn set = set_targets();
  GetTargetsFn get = supported_targets();
  if (set == nullptr || get == nullptr) GTEST_SKIP() << "libhwy's target mock not found";
  TargetMock restore{set};
  const std::int64_t targets = get() & HWY_TARGETS;
  const Case<T> c(shape);
  std::vector<T> reference;
  std::string reference_name;
  int tried = 0;
  // Lowest bit first: the best target first, down to the baseline.
  for (std::int64_t rest = targets; rest != 0; rest &= rest - 1) {
    const std::int64_t target = rest & -rest;
    set(target);
    ASSERT_EQ(get() & HWY_TARGETS, target) << "could not force " << hwy::TargetName(target);
    std::vector<T> out = c.run();
    ++tried;
    if (reference.empty()) {
      reference = std::move(out);
      reference_name = hwy::TargetName(target);
      continue;
    }
    ASSERT_EQ(out.size(), reference.size());
    std::size_t differ = 0, first = out.size();
    for (std::size_t i = 0; i < out.size(); ++i)
      if (std::memcmp(&out[i], &reference[i], sizeof(T)) != 0) {
        if (differ++ == 0) first = i;
      }
    EXPECT_EQ(differ, 0u) << hwy::TargetName(target) << " differs from " << reference_name
                          << " in " << differ << " of " << out.size()
                          << " outputs, first at " << first;
  }
  EXPECT_GE(tried, 1);
}

// K, V multiples of 8 and 16 (whole vectors) and ragged (vector tails and
// partial lane groups); grouped value heads and B > 1.
TEST(KdaDispatch, FloatBitwiseEqualAcrossTargets) {
  expect_same_on_every_target<float>(Shape{1, 40, 2, 2, 32, 48});
  expect_same_on_every_target<float>(Shape{2, 23, 1, 2, 19, 37});
}

TEST(KdaDispatch, DoubleBitwiseEqualAcrossTargets) {
  expect_same_on_every_target<double>(Shape{1, 40, 2, 2, 32, 48});
  expect_same_on_every_target<double>(Shape{2, 23, 1, 2, 19, 37});
}

}  // namespace
}  // namespace kdacp::kda
