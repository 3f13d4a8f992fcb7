// KDA math (SPEC §9) against an explicit-matrix reference, its own chunk
// summaries, and central finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/thread_pool.hpp"
#include "kda_test_inputs.hpp"

namespace kdacp::kda {
namespace {

// This file tests the recurrent algorithm (the reference); test_kda_chunk.cpp the chunk one.
const kda::Exec kRecurrent{{nullptr, KernelKind::best}, Algorithm::recurrent};
kda::Exec recurrent_on(ThreadPool& pool) { return kda::Exec{{&pool, KernelKind::best}, Algorithm::recurrent}; }


// Random but well-conditioned inputs: k L2-normalised per token and head,
// g = log U(0.9, 1), β ∈ (0.1, 0.9), so every transfer is a contraction.
template <class T>
struct Problem {
  Shape shape;
  T scale = 0;
  std::vector<T> q, k, v, g, beta;

  Inputs<T> inputs() const {
    return {q.data(), k.data(), v.data(), g.data(), beta.data(), shape, scale};
  }

  template <class U>
  Problem<U> cast() const {
    auto conv = [](const std::vector<T>& x) { return std::vector<U>(x.begin(), x.end()); };
    return {shape, static_cast<U>(scale), conv(q), conv(k), conv(v), conv(g), conv(beta)};
  }
};

Problem<double> make_problem(const Shape& s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Problem<double> p;
  p.shape = s;
  p.scale = default_scale<double>(s.key_dim);
  test::RandomInputs in = test::random_inputs(s, rng);
  p.q = std::move(in.q);
  p.k = std::move(in.k);
  p.v = std::move(in.v);
  p.g = std::move(in.g);
  p.beta = std::move(in.beta);
  return p;
}

using test::rel_error;
using test::uniform;

template <class T>
struct Outputs {
  std::vector<T> o, final_state;
};

template <class T>
Outputs<T> run_forward(const Problem<T>& p, const T* incoming, std::size_t threads = 1) {
  Outputs<T> out{std::vector<T>(p.shape.v_elems()), std::vector<T>(p.shape.state_elems())};
  ThreadPool pool(threads);
  forward(p.inputs(), incoming, out.o.data(), out.final_state.data(), recurrent_on(pool));
  return out;
}

template <class T>
struct Gradients {
  std::vector<T> dq, dk, dv, dg, dbeta, d_incoming;
  explicit Gradients(const Shape& s)
      : dq(s.qk_elems()), dk(s.qk_elems()), dv(s.v_elems()), dg(s.g_elems()),
        dbeta(s.beta_elems()), d_incoming(s.state_elems()) {}
  Grads<T> view() {
    return {dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), d_incoming.data()};
  }
  bool operator==(const Gradients&) const = default;
};

template <class T>
Gradients<T> run_backward(const Problem<T>& p, const T* incoming, const std::vector<T>& d_o,
                          const T* d_final, std::size_t threads = 1,
                          std::size_t interval = kDefaultCheckpointInterval) {
  Gradients<T> grads(p.shape);
  ThreadPool pool(threads);
  backward(p.inputs(), incoming, d_o.data(), d_final, grads.view(), recurrent_on(pool), interval);
  return grads;
}

// The recurrence exactly as SPEC §9 writes it, with explicit K×K matrices.
Outputs<double> reference_forward(const Problem<double>& p, const std::vector<double>& incoming) {
  const Shape& s = p.shape;
  const std::size_t kd = s.key_dim, vd = s.value_dim;
  Outputs<double> out{std::vector<double>(s.v_elems()), incoming};
  for (std::size_t b = 0; b < s.batch; ++b)
    for (std::size_t j = 0; j < s.value_heads; ++j) {
      std::size_t h = j / s.group();
      double* st = out.final_state.data() + (b * s.value_heads + j) * kd * vd;
      for (std::size_t t = 0; t < s.tokens; ++t) {
        const double* q = p.q.data() + ((b * s.tokens + t) * s.heads + h) * kd;
        const double* k = p.k.data() + ((b * s.tokens + t) * s.heads + h) * kd;
        const double* v = p.v.data() + ((b * s.tokens + t) * s.value_heads + j) * vd;
        const double* g = p.g.data() + ((b * s.tokens + t) * s.value_heads + j) * kd;
        double beta = p.beta[(b * s.tokens + t) * s.value_heads + j];
        std::vector<double> a(kd * kd), next(kd * vd);
        for (std::size_t r = 0; r < kd; ++r)
          for (std::size_t c = 0; c < kd; ++c)
            a[r * kd + c] = ((r == c ? 1.0 : 0.0) - beta * k[r] * k[c]) * std::exp(g[c]);
        for (std::size_t r = 0; r < kd; ++r)
          for (std::size_t c = 0; c < vd; ++c) {
            double acc = beta * k[r] * v[c];
            for (std::size_t m = 0; m < kd; ++m) acc += a[r * kd + m] * st[m * vd + c];
            next[r * vd + c] = acc;
          }
        std::copy(next.begin(), next.end(), st);
        double* o = out.o.data() + ((b * s.tokens + t) * s.value_heads + j) * vd;
        for (std::size_t c = 0; c < vd; ++c) {
          double acc = 0;
          for (std::size_t r = 0; r < kd; ++r) acc += q[r] * st[r * vd + c];
          o[c] = p.scale * acc;
        }
      }
    }
  return out;
}

Shape shape_of(std::size_t b, std::size_t t, std::size_t h, std::size_t hv, std::size_t k,
               std::size_t v) {
  return {b, t, h, hv, k, v};
}

TEST(KdaMath, ForwardMatchesExplicitMatrices) {
  for (const Shape& s : {shape_of(1, 12, 1, 1, 16, 16), shape_of(2, 9, 2, 4, 12, 20)}) {
    auto p = make_problem(s, 1);
    std::mt19937_64 rng(2);
    auto h0 = uniform(s.state_elems(), -1, 1, rng);
    auto got = run_forward(p, h0.data());
    auto want = reference_forward(p, h0);
    EXPECT_LE(rel_error(got.o, want.o), 1e-13);
    EXPECT_LE(rel_error(got.final_state, want.final_state), 1e-13);
    // A null incoming state is the zero state.
    auto zero = run_forward(p, static_cast<const double*>(nullptr));
    auto want_zero = reference_forward(p, std::vector<double>(s.state_elems(), 0.0));
    EXPECT_LE(rel_error(zero.o, want_zero.o), 1e-13);
  }
}

// forward(h).final == M·h + S for the chunk's summary (S, M).
template <class T>
void check_summary(const Shape& s, double tolerance) {
  auto p = make_problem(s, 3).cast<T>();
  std::mt19937_64 rng(4);
  auto h0d = uniform(s.state_elems(), -1, 1, rng);
  std::vector<T> h0(h0d.begin(), h0d.end());
  std::vector<T> state(s.state_elems()), transfer(s.transfer_elems());
  ThreadPool pool(2);
  chunk_summary(p.inputs(), state.data(), transfer.data(), recurrent_on(pool));
  auto fwd = run_forward(p, h0.data());

  const std::size_t kd = s.key_dim, vd = s.value_dim;
  std::vector<double> composed(s.state_elems());
  for (std::size_t slab = 0; slab < s.batch * s.value_heads; ++slab)
    for (std::size_t r = 0; r < kd; ++r)
      for (std::size_t c = 0; c < vd; ++c) {
        double acc = state[slab * kd * vd + r * vd + c];
        for (std::size_t m = 0; m < kd; ++m)
          acc += static_cast<double>(transfer[slab * kd * kd + r * kd + m]) *
                 static_cast<double>(h0[slab * kd * vd + m * vd + c]);
        composed[slab * kd * vd + r * vd + c] = acc;
      }
  EXPECT_LE(rel_error(fwd.final_state, composed), tolerance);

  // The summary's S is the final state from zero.
  auto from_zero = run_forward(p, static_cast<const T*>(nullptr));
  EXPECT_EQ(from_zero.final_state, state);
}

TEST(KdaMath, SummaryComposesDouble) {
  check_summary<double>(shape_of(2, 37, 2, 4, 16, 24), 1e-12);
  check_summary<double>(shape_of(1, 64, 1, 1, 24, 16), 1e-12);
}

TEST(KdaMath, SummaryComposesFloat) {
  check_summary<float>(shape_of(2, 37, 2, 4, 16, 24), 2e-5);
  check_summary<float>(shape_of(1, 64, 1, 1, 32, 32), 2e-5);
}

struct FdCase {
  Shape shape;
  std::size_t interval;
  std::size_t samples;  // entries checked per tensor; 0: all of them
};

std::string name_of(const FdCase& c) {
  const Shape& s = c.shape;
  return "B" + std::to_string(s.batch) + "T" + std::to_string(s.tokens) + "H" +
         std::to_string(s.heads) + "HV" +
         std::to_string(s.value_heads) + "K" + std::to_string(s.key_dim) + "V" +
         std::to_string(s.value_dim) + "C" + std::to_string(c.interval);
}

void PrintTo(const FdCase& c, std::ostream* os) { *os << name_of(c); }

// L = Σ o ⊙ R1 + Σ S_T ⊙ R2, so ∂L/∂o = R1 and ∂L/∂S_T = R2.
class KdaFiniteDifference : public ::testing::TestWithParam<FdCase> {};

TEST_P(KdaFiniteDifference, EveryGradient) {
  const FdCase& fd = GetParam();
  const Shape& s = fd.shape;
  auto p = make_problem(s, 5);
  std::mt19937_64 rng(6);
  auto h0 = uniform(s.state_elems(), -1, 1, rng);
  auto r1 = uniform(s.v_elems(), -1, 1, rng);
  auto r2 = uniform(s.state_elems(), -1, 1, rng);

  auto grads = run_backward(p, h0.data(), r1, r2.data(), 2, fd.interval);

  auto loss = [&] {
    auto out = run_forward(p, h0.data());
    double l = 0;
    for (std::size_t i = 0; i < out.o.size(); ++i) l += out.o[i] * r1[i];
    for (std::size_t i = 0; i < out.final_state.size(); ++i) l += out.final_state[i] * r2[i];
    return l;
  };
  auto check = [&](std::vector<double>& x, const std::vector<double>& analytic,
                   const std::string& name) {
    EXPECT_LE(test::finite_difference_error(x, analytic, fd.samples, rng, loss), 1e-6) << name;
  };
  check(p.q, grads.dq, "dq");
  check(p.k, grads.dk, "dk");
  check(p.v, grads.dv, "dv");
  check(p.g, grads.dg, "dg");
  check(p.beta, grads.dbeta, "dbeta");
  check(h0, grads.d_incoming, "d_incoming");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, KdaFiniteDifference,
    ::testing::Values(FdCase{shape_of(1, 12, 1, 1, 16, 16), 64, 0},
                      FdCase{shape_of(1, 1, 1, 1, 16, 16), 64, 0},
                      FdCase{shape_of(1, 12, 1, 1, 16, 16), 5, 0},
                      FdCase{shape_of(1, 12, 1, 1, 16, 20), 4, 96},
                      FdCase{shape_of(1, 12, 1, 1, 12, 16), 64, 96},
                      FdCase{shape_of(2, 12, 2, 4, 16, 16), 5, 64}),
    [](const ::testing::TestParamInfo<FdCase>& info) { return name_of(info.param); });

template <class T>
void check_incoming_grad(const Shape& s, double tolerance) {
  auto p = make_problem(s, 7).cast<T>();
  std::mt19937_64 rng(8);
  auto h0d = uniform(s.state_elems(), -1, 1, rng);
  auto dod = uniform(s.v_elems(), -1, 1, rng);
  std::vector<T> h0(h0d.begin(), h0d.end()), d_o(dod.begin(), dod.end());
  auto grads = run_backward(p, h0.data(), d_o, static_cast<const T*>(nullptr), 3, 7);
  std::vector<T> g(s.state_elems());
  ThreadPool pool(3);
  incoming_grad(p.inputs(), d_o.data(), g.data(), recurrent_on(pool));
  EXPECT_LE(rel_error(g, grads.d_incoming), tolerance);
}

TEST(KdaMath, IncomingGradEqualsBackward) {
  check_incoming_grad<double>(shape_of(2, 37, 2, 4, 16, 24), 1e-13);
  check_incoming_grad<float>(shape_of(2, 37, 2, 4, 16, 24), 1e-6);
}

TEST(KdaMath, FloatAgreesWithDouble) {
  const Shape s = shape_of(2, 48, 1, 2, 32, 24);
  auto pd = make_problem(s, 9);
  auto pf = pd.cast<float>();
  std::mt19937_64 rng(10);
  auto h0d = uniform(s.state_elems(), -1, 1, rng);
  auto dod = uniform(s.v_elems(), -1, 1, rng);
  auto dfd = uniform(s.state_elems(), -1, 1, rng);
  std::vector<float> h0f(h0d.begin(), h0d.end()), dof(dod.begin(), dod.end()),
      dff(dfd.begin(), dfd.end());

  auto fd = run_forward(pd, h0d.data());
  auto ff = run_forward(pf, h0f.data());
  EXPECT_LE(rel_error(ff.o, fd.o), 2e-5);
  EXPECT_LE(rel_error(ff.final_state, fd.final_state), 2e-5);

  auto gd = run_backward(pd, h0d.data(), dod, dfd.data());
  auto gf = run_backward(pf, h0f.data(), dof, dff.data());
  EXPECT_LE(rel_error(gf.dq, gd.dq), 2e-5);
  EXPECT_LE(rel_error(gf.dk, gd.dk), 2e-5);
  EXPECT_LE(rel_error(gf.dv, gd.dv), 2e-5);
  EXPECT_LE(rel_error(gf.dg, gd.dg), 2e-5);
  EXPECT_LE(rel_error(gf.dbeta, gd.dbeta), 2e-5);
  EXPECT_LE(rel_error(gf.d_incoming, gd.d_incoming), 2e-5);

  std::vector<float> sf(s.state_elems()), mf(s.transfer_elems());
  std::vector<double> sd(s.state_elems()), md(s.transfer_elems());
  chunk_summary(pf.inputs(), sf.data(), mf.data(), kRecurrent);
  chunk_summary(pd.inputs(), sd.data(), md.data(), kRecurrent);
  EXPECT_LE(rel_error(sf, sd), 2e-5);
  EXPECT_LE(rel_error(mf, md), 2e-5);
}

TEST(KdaMath, ResultsIndependentOfThreadsAndCheckpoints) {
  const Shape s = shape_of(2, 23, 2, 4, 8, 12);
  auto p = make_problem(s, 11).cast<float>();
  std::mt19937_64 rng(12);
  auto h0d = uniform(s.state_elems(), -1, 1, rng);
  auto dod = uniform(s.v_elems(), -1, 1, rng);
  std::vector<float> h0(h0d.begin(), h0d.end()), d_o(dod.begin(), dod.end());

  auto base = run_forward(p, h0.data(), 1);
  auto base_grads = run_backward(p, h0.data(), d_o, h0.data(), 1, 64);
  for (std::size_t threads : {0, 3, 8, 64}) {
    auto out = run_forward(p, h0.data(), threads);
    EXPECT_EQ(out.o, base.o) << threads;
    EXPECT_EQ(out.final_state, base.final_state) << threads;
    for (std::size_t interval : {1, 5, 22, 23, 64}) {
      EXPECT_TRUE(run_backward(p, h0.data(), d_o, h0.data(), threads, interval) == base_grads)
          << "threads " << threads << " interval " << interval;
    }
  }
}

TEST(KdaMath, SingleTokenHasClosedForm) {
  // From zero: S = β k vᵀ, o = scale·β (q·k) v, M = (I - β k kᵀ) Diag(α).
  const Shape s = shape_of(1, 1, 1, 1, 4, 3);
  auto p = make_problem(s, 13);
  std::vector<double> state(s.state_elems()), transfer(s.transfer_elems());
  chunk_summary(p.inputs(), state.data(), transfer.data(), kRecurrent);
  auto out = run_forward(p, static_cast<const double*>(nullptr));
  double qk = 0;
  for (std::size_t i = 0; i < 4; ++i) qk += p.q[i] * p.k[i];
  for (std::size_t c = 0; c < 3; ++c)
    EXPECT_NEAR(out.o[c], p.scale * p.beta[0] * qk * p.v[c], 1e-15);
  for (std::size_t r = 0; r < 4; ++r) {
    for (std::size_t c = 0; c < 3; ++c)
      EXPECT_NEAR(state[r * 3 + c], p.beta[0] * p.k[r] * p.v[c], 1e-15);
    for (std::size_t c = 0; c < 4; ++c)
      EXPECT_NEAR(transfer[r * 4 + c],
                  ((r == c ? 1.0 : 0.0) - p.beta[0] * p.k[r] * p.k[c]) * std::exp(p.g[c]),
                  1e-15);
  }
}

TEST(KdaMath, DefaultScaleIsInverseSqrtK) {
  EXPECT_DOUBLE_EQ(default_scale<double>(128), 1.0 / std::sqrt(128.0));
  EXPECT_FLOAT_EQ(default_scale<float>(16), 0.25f);
  EXPECT_THROW(default_scale<float>(0), InvalidArgument);
}

// Runs fn, expecting InvalidArgument whose message contains `needle`.
void expect_invalid(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no InvalidArgument; expected one mentioning '" << needle << "'";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(KdaMath, BadArgumentsThrow) {
  const Shape good = shape_of(1, 4, 2, 4, 8, 8);
  auto p = make_problem(good, 14);
  std::vector<double> o(good.v_elems()), st(good.state_elems()), m(good.transfer_elems());
  Gradients<double> grads(good);
  auto run_all = [&](const Inputs<double>& in) {
    forward(in, nullptr, o.data(), st.data());
  };

  const std::pair<std::size_t Shape::*, const char*> fields[] = {
      {&Shape::batch, "batch"},         {&Shape::tokens, "tokens"},
      {&Shape::heads, "heads"},         {&Shape::value_heads, "value_heads"},
      {&Shape::key_dim, "key_dim"},     {&Shape::value_dim, "value_dim"}};
  for (const auto& [field, name] : fields) {
    auto in = p.inputs();
    in.shape.*field = 0;
    expect_invalid([&] { run_all(in); }, name);
    expect_invalid([&] { validate(in.shape); }, name);
  }
  auto in = p.inputs();
  in.shape.value_heads = 3;
  expect_invalid([&] { chunk_summary(in, st.data(), m.data()); }, "multiple of heads");

  in = p.inputs();
  in.g = nullptr;
  expect_invalid([&] { incoming_grad(in, o.data(), st.data()); }, "g is null");
  in = p.inputs();
  in.scale = std::nan("");
  expect_invalid([&] { run_all(in); }, "scale");
  in = p.inputs();
  in.scale = 0;
  expect_invalid([&] { run_all(in); }, "scale");

  in = p.inputs();
  expect_invalid([&] { forward(in, nullptr, nullptr, st.data()); }, "o is null");
  expect_invalid([&] { chunk_summary(in, st.data(), nullptr); }, "transfer is null");
  expect_invalid(
      [&] { backward(in, nullptr, o.data(), nullptr, grads.view(), {}, 0); },
      "checkpoint_interval");
  auto no_dg = grads.view();
  no_dg.dg = nullptr;
  expect_invalid([&] { backward(in, nullptr, o.data(), nullptr, no_dg); }, "dg is null");
  expect_invalid([&] { backward(in, nullptr, nullptr, nullptr, grads.view()); },
                 "d_o is null");
}

}  // namespace
}  // namespace kdacp::kda
