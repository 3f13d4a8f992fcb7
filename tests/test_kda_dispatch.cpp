// The kernel table (src/kernels/table.hpp) on every compiled target the CPU
// supports: with the targets narrowed to one (hwy::SetSupportedTargetsForTest),
// make_kernel_table installs that target's entries over the reference ones,
// and every entry point of kda.hpp — both algorithms — and the affine step
// run on them must give the reference entries' bits (the baseline target's
// KDA kernels, step_scalar) and those of the table the library chose:
// o, the final state, the summary, G and every gradient, bitwise.
#include <gtest/gtest.h>

// The library's target set (before any Highway header).
#include "kernels/per_target.h"

#include <hwy/targets.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kda/kda_kernels.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/thread_pool.hpp"
#include "kernels/table.hpp"

namespace kdacp::kda::detail {
namespace {

using kdacp::detail::KernelTable;

template <class T>
struct Case {
  Shape shape;
  std::vector<T> q, k, v, g, beta, d_o, incoming, d_final;

  Case(const Shape& s, double g_min) : shape(s) {
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
    fill(g, s.g_elems(), g_min, 0);
    fill(beta, s.beta_elems(), 0.05, 0.95);
    fill(d_o, s.v_elems(), -1, 1);
    fill(incoming, s.state_elems(), -0.5, 0.5);
    fill(d_final, s.state_elems(), -0.5, 0.5);
  }

  // Every output of every entry point on `table`'s kernels, concatenated.
  std::vector<T> run(const KernelTable& table, Algorithm algorithm) const {
    Inputs<T> in{q.data(), k.data(), v.data(), g.data(), beta.data(), shape,
                 default_scale<T>(shape.key_dim)};
    const Shape& s = shape;
    std::vector<T> o(s.v_elems()), fin(s.state_elems()), st(s.state_elems()),
        m(s.transfer_elems()), gs(s.state_elems()), dq(s.qk_elems()), dk(s.qk_elems()),
        dv(s.v_elems()), dg(s.g_elems()), db(s.beta_elems()), di(s.state_elems());
    ThreadPool pool(2);
    const kda::Exec exec{{&pool, KernelKind::best}, algorithm};
    const Grads<T> grads{dq.data(), dk.data(), dv.data(), dg.data(), db.data(), di.data()};
    const KernelSet<T>& kernels = table.of<T>();
    forward_on(kernels, in, incoming.data(), o.data(), fin.data(), exec);
    chunk_summary_on(kernels, in, st.data(), m.data(), exec);
    incoming_grad_on(kernels, in, d_o.data(), gs.data(), exec);
    backward_on(kernels, in, incoming.data(), d_o.data(), d_final.data(), grads, exec, 5);
    std::vector<T> all;
    for (const auto* x : {&o, &fin, &st, &m, &gs, &dq, &dk, &dv, &dg, &db, &di})
      all.insert(all.end(), x->begin(), x->end());
    return all;
  }
};

template <class T>
void expect_bitwise(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  std::size_t differ = 0, first = got.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && differ++ == 0) first = i;
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " of " << got.size()
                        << " outputs differ, first at " << first;
}

// One slab step C = op(M)·X + S with strided rows, C aliasing S exactly.
template <class T>
std::vector<T> run_step(const KernelTable& table, std::size_t k, std::size_t v, bool transpose) {
  const std::size_t ldm = k + 3, ldx = v + 5, lds = v + 1;
  std::mt19937_64 rng(k * 1000 + v);
  std::uniform_real_distribution<double> uni(-1.0, 1.0);
  std::vector<T> m(k * ldm), x(k * ldx), s(k * lds);
  for (auto& e : m) e = T(uni(rng) / double(k));
  for (auto* a : {&x, &s})
    for (auto& e : *a) e = T(uni(rng));
  table.of<T>().step(m.data(), ldm, x.data(), ldx, s.data(), lds, s.data(), lds, k, v, transpose);
  return s;
}

// Every target against the reference entries and the library's choice. K, V
// multiples of 8 and 16 (whole vectors) and ragged (vector tails and partial
// lane groups); grouped value heads, B > 1, a ragged last chunk; weak gates,
// and strong ones that send every sub-chunk's channels to the chunk
// kernels' exact path.
template <class T>
void expect_every_target_is_the_reference() {
  const KernelTable& reference = kdacp::detail::reference_kernel_table();
  const KernelTable& chosen = kdacp::detail::kernel_table();
  struct Run {
    Shape shape;
    double g_min;
    Algorithm algorithm;
  };
  const std::vector<Run> runs{{Shape{1, 40, 2, 2, 32, 48}, -0.2, Algorithm::recurrent},
                              {Shape{2, 23, 1, 2, 19, 37}, -0.2, Algorithm::recurrent},
                              {Shape{1, 85, 1, 2, 32, 16}, -7, Algorithm::chunk},
                              {Shape{1, 70, 2, 2, 16, 32}, -1e4, Algorithm::chunk}};
  std::vector<std::vector<T>> want;
  for (const Run& r : runs) want.push_back(Case<T>(r.shape, r.g_min).run(reference, r.algorithm));
  const std::vector<std::int64_t> targets = hwy::SupportedAndGeneratedTargets();
  EXPECT_FALSE(targets.empty());
  for (std::int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    const KernelTable table = kdacp::detail::make_kernel_table();
    EXPECT_EQ(std::string(table.target), hwy::TargetName(target));
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const Case<T> c(runs[i].shape, runs[i].g_min);
      const std::string what = std::string(table.target) + " " + algorithm_name(runs[i].algorithm) +
                               " case " + std::to_string(i);
      expect_bitwise(c.run(table, runs[i].algorithm), want[i], what + " against the reference");
      expect_bitwise(c.run(chosen, runs[i].algorithm), want[i], what + " (the library's choice)");
    }
    for (std::size_t k : {1, 3, 8, 9, 17, 33})
      for (std::size_t v : {1, 7, 16, 17, 31, 48, 70})
        for (bool transpose : {false, true})
          expect_bitwise(run_step<T>(table, k, v, transpose), run_step<T>(reference, k, v, transpose),
                         std::string(table.target) + " step k=" + std::to_string(k) +
                             " v=" + std::to_string(v) + (transpose ? " backward" : " forward"));
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(KdaDispatch, FloatBitwiseEqualAcrossTargets) { expect_every_target_is_the_reference<float>(); }

TEST(KdaDispatch, DoubleBitwiseEqualAcrossTargets) { expect_every_target_is_the_reference<double>(); }

// The table the process runs is one of the compiled targets' (the best the
// CPU supports), made once: every call returns the same object.
TEST(KdaDispatch, TableIsMadeOncePerProcess) {
  const KernelTable& a = kdacp::detail::kernel_table();
  EXPECT_EQ(&a, &kdacp::detail::kernel_table());
  EXPECT_EQ(std::string(a.target), hwy::TargetName(hwy::SupportedAndGeneratedTargets().front()));
  EXPECT_EQ(std::string(kdacp::detail::reference_kernel_table().target), "reference");
}

}  // namespace
}  // namespace kdacp::kda::detail
