// The KDA kernels are compiled once per SIMD target (src/kda/kda_math.cpp).
// Results must not depend on the target: for every compiled target the CPU
// supports, Highway's test macros run every entry point on that target's
// kernels (recurrent-inl.h, reverse-inl.h, compiled here per target) and
// compare o, the final state, the summary, G and every gradient bitwise with
// the baseline target's and with the library's own choice.
#include "kernels/hwy_targets.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "test_kda_dispatch.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/tests/test_util-inl.h>

#include "kda/recurrent-inl.h"
#include "kda/reverse-inl.h"

// Shared by every target: defined once, on the first inclusion.
#ifndef KDACP_TEST_KDA_DISPATCH_SHARED_
#define KDACP_TEST_KDA_DISPATCH_SHARED_

#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kda/kda_kernels.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda::detail {

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

  // Every output of every entry point, concatenated; on `kernels`, or on the
  // library's choice when null.
  std::vector<T> run(const Kernels<T>* kernels) const {
    Inputs<T> in{q.data(), k.data(), v.data(), g.data(), beta.data(), shape,
                 default_scale<T>(shape.key_dim)};
    const Shape& s = shape;
    std::vector<T> o(s.v_elems()), fin(s.state_elems()), st(s.state_elems()),
        m(s.transfer_elems()), gs(s.state_elems()), dq(s.qk_elems()), dk(s.qk_elems()),
        dv(s.v_elems()), dg(s.g_elems()), db(s.beta_elems()), di(s.state_elems());
    ThreadPool pool(2);
    // The kernels below are the recurrent algorithm's (the chunk one has its own dispatch test).
    const ExecPolicy exec{&pool, KernelKind::best, Algorithm::recurrent};
    const Grads<T> grads{dq.data(), dk.data(), dv.data(), dg.data(), db.data(), di.data()};
    if (kernels != nullptr) {
      forward_on(*kernels, in, incoming.data(), o.data(), fin.data(), exec);
      chunk_summary_on(*kernels, in, st.data(), m.data(), exec);
      incoming_grad_on(*kernels, in, d_o.data(), gs.data(), exec);
      backward_on(*kernels, in, incoming.data(), d_o.data(), d_final.data(), grads, exec, 5);
    } else {
      forward(in, incoming.data(), o.data(), fin.data(), exec);
      chunk_summary(in, st.data(), m.data(), exec);
      incoming_grad(in, d_o.data(), gs.data(), exec);
      backward(in, incoming.data(), d_o.data(), d_final.data(), grads, exec, 5);
    }
    std::vector<T> all;
    for (const auto* x : {&o, &fin, &st, &m, &gs, &dq, &dk, &dv, &dg, &db, &di})
      all.insert(all.end(), x->begin(), x->end());
    return all;
  }
};

// The kernels of the baseline target (HWY_STATIC_TARGET), defined below with
// the last, static inclusion of this file.
template <class T>
Kernels<T> baseline_kernels();

template <class T>
void expect_bitwise(const std::vector<T>& got, const std::vector<T>& want, const char* target,
                    const char* against) {
  ASSERT_EQ(got.size(), want.size());
  std::size_t differ = 0, first = got.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && differ++ == 0) first = i;
  EXPECT_EQ(differ, 0u) << target << " differs from " << against << " in " << differ << " of "
                        << got.size() << " outputs, first at " << first;
}

}  // namespace kdacp::kda::detail

#endif  // KDACP_TEST_KDA_DISPATCH_SHARED_

HWY_BEFORE_NAMESPACE();
namespace kdacp::kda::detail::HWY_NAMESPACE {

template <class T>
void ExpectSameAsBaseline(const Shape& shape) {
  const Kernels<T> kernels{&sweep<T>, &summary_head<T>, &backward_head<T>,
                           &incoming_grad_head<T>};
  const Case<T> c(shape);
  const std::vector<T> got = c.run(&kernels);
  const Kernels<T> baseline = baseline_kernels<T>();
  expect_bitwise(got, c.run(&baseline), hwy::TargetName(HWY_TARGET),
                 hwy::TargetName(HWY_STATIC_TARGET));
  expect_bitwise(got, c.run(nullptr), hwy::TargetName(HWY_TARGET), "the library's choice");
}

// K, V multiples of 8 and 16 (whole vectors) and ragged (vector tails and
// partial lane groups); grouped value heads and B > 1.
void FloatBitwiseEqualAcrossTargets() {
  ExpectSameAsBaseline<float>(Shape{1, 40, 2, 2, 32, 48});
  ExpectSameAsBaseline<float>(Shape{2, 23, 1, 2, 19, 37});
}

void DoubleBitwiseEqualAcrossTargets() {
  ExpectSameAsBaseline<double>(Shape{1, 40, 2, 2, 32, 48});
  ExpectSameAsBaseline<double>(Shape{2, 23, 1, 2, 19, 37});
}

}  // namespace kdacp::kda::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kdacp::kda::detail {

template <class T>
Kernels<T> baseline_kernels() {
  return {&HWY_NAMESPACE::sweep<T>, &HWY_NAMESPACE::summary_head<T>,
          &HWY_NAMESPACE::backward_head<T>, &HWY_NAMESPACE::incoming_grad_head<T>};
}

HWY_BEFORE_TEST(KdaDispatch);
HWY_EXPORT_AND_TEST_P(KdaDispatch, FloatBitwiseEqualAcrossTargets);
HWY_EXPORT_AND_TEST_P(KdaDispatch, DoubleBitwiseEqualAcrossTargets);

}  // namespace kdacp::kda::detail
#endif
