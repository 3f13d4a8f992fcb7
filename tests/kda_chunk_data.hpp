// Shared by the chunkwise KDA tests (test_kda_chunk*.cpp): random inputs,
// running every pass of one algorithm, the comparisons, the backward.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

// The library's target set (before any Highway header).
#include "kernels/per_target.h"

#include <hwy/targets.h>

#include "kda/chunk.hpp"
#include "kda_cp_runner.hpp"
#include "kda_helpers.hpp"
#include "kda_test_inputs.hpp"
#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/kda_cp.hpp"
#include "kda/sequences.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/synthetic.hpp"
#include "kdacp/thread_pool.hpp"
#include "kernels/table.hpp"

namespace kdacp::kda {
namespace {

using test::rel_error;

constexpr std::size_t kC = kChunkSize;

// Random inputs; g ∈ log U(0.9, 1) (weak decay) or U(g_min, 0) (strong).
template <class T>
struct Data {
  Shape shape;
  std::vector<T> q, k, v, g, beta, h0, d_o, d_final;

  Data(const Shape& s, unsigned seed, double g_min) : shape(s) {
    std::mt19937_64 rng(seed);
    const test::RandomInputs r = test::random_inputs(s, rng);
    auto cast = [](const std::vector<double>& x) { return std::vector<T>(x.begin(), x.end()); };
    q = cast(r.q);
    k = cast(r.k);
    v = cast(r.v);
    beta = cast(r.beta);
    g = g_min < 0 ? cast(test::uniform(s.g_elems(), g_min, 0, rng)) : cast(r.g);
    h0 = cast(test::uniform(s.state_elems(), -1, 1, rng));
    d_o = cast(test::uniform(s.v_elems(), -1, 1, rng));
    d_final = cast(test::uniform(s.state_elems(), -1, 1, rng));
  }

  Inputs<T> inputs() const {
    return Inputs<T>{q.data(), k.data(), v.data(), g.data(), beta.data(), shape, default_scale<T>(shape.key_dim)};
  }
};

// The policy that runs `a` on `pool`.
kda::Exec on(Algorithm a, ThreadPool* pool = nullptr) { return kda::Exec{{pool, KernelKind::best}, a}; }

template <class T>
struct Outputs {
  std::vector<T> o, final_state, o0, s, m, g_state;
};

template <class T>
Outputs<T> run_all(const Data<T>& d, Algorithm a, ThreadPool* pool = nullptr) {
  const Shape& s = d.shape;
  const kda::Exec exec = on(a, pool);
  Outputs<T> out;
  out.o.resize(s.v_elems());
  out.o0.resize(s.v_elems());
  out.final_state.resize(s.state_elems());
  out.s.resize(s.state_elems());
  out.m.resize(s.transfer_elems());
  out.g_state.resize(s.state_elems());
  const Inputs<T> in = d.inputs();
  forward(in, d.h0.data(), out.o.data(), out.final_state.data(), exec);
  forward(in, nullptr, out.o0.data(), nullptr, exec);
  chunk_summary(in, out.s.data(), out.m.data(), exec);
  incoming_grad(in, d.d_o.data(), out.g_state.data(), exec);
  return out;
}

// rel_error, except that a reference whose largest entry is below `floor`
// counts as `floor` in size: under strong decay a float transfer M over many
// tokens underflows into subnormals, where neither algorithm keeps 24 bits.
template <class T>
double rel_error_floor(const std::vector<T>& got, const std::vector<T>& want, double floor) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff = std::max(diff, std::abs(double(got[i]) - double(want[i])));
    ref = std::max(ref, std::abs(double(want[i])));
  }
  ref = std::max(ref, floor);
  return ref > 0 ? diff / ref : diff;
}

template <class T>
void expect_close(const Outputs<T>& got, const Outputs<T>& want, double tol,
                  const std::string& what) {
  EXPECT_EQ(got.m.size(), want.m.size());
  // M's natural scale is 1 (the identity at T = 0); 2^-100 is far above
  // float's subnormals and far below any entry a wrong product would leave.
  const double m_floor = sizeof(T) == 4 ? 0x1p-100 : 0;
  EXPECT_LE(rel_error_floor(got.m, want.m, m_floor), tol) << what << " summary M";
  EXPECT_LE(rel_error(got.o, want.o), tol) << what << " o";
  EXPECT_LE(rel_error(got.o0, want.o0), tol) << what << " o (zero incoming)";
  EXPECT_LE(rel_error(got.final_state, want.final_state), tol) << what << " final state";
  EXPECT_LE(rel_error(got.s, want.s), tol) << what << " summary S";
  EXPECT_LE(rel_error(got.g_state, want.g_state), tol) << what << " G";
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
void compare_forward(const Shape& s, double g_min, double tol, unsigned seed) {
  const Data<T> d(s, seed, g_min);
  const Outputs<T> want = run_all(d, Algorithm::recurrent);
  const Outputs<T> got = run_all(d, Algorithm::chunk);
  expect_close(got, want, tol,
               "T=" + std::to_string(s.tokens) + " g_min=" + std::to_string(g_min));
}

template <class T>
struct GradOut {
  std::vector<T> dq, dk, dv, dg, dbeta, dinc;
  bool operator==(const GradOut& o) const {
    return same_bits(dq, o.dq) && same_bits(dk, o.dk) && same_bits(dv, o.dv) &&
           same_bits(dg, o.dg) && same_bits(dbeta, o.dbeta) && same_bits(dinc, o.dinc);
  }
};

template <class T>
GradOut<T> run_backward(const Data<T>& d, Algorithm a, bool with_state,
                        ThreadPool* pool = nullptr, ForwardCache<T>* kept = nullptr) {
  const Shape& s = d.shape;
  GradOut<T> r{std::vector<T>(s.qk_elems()), std::vector<T>(s.qk_elems()),
               std::vector<T>(s.v_elems()),  std::vector<T>(s.g_elems()),
               std::vector<T>(s.beta_elems()), std::vector<T>(s.state_elems())};
  backward(d.inputs(), with_state ? d.h0.data() : nullptr, d.d_o.data(),
           with_state ? d.d_final.data() : nullptr,
           Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(),
                    r.dinc.data()},
           on(a, pool), kDefaultCheckpointInterval, kept);
  return r;
}

// B·H > 1, HV = 2H, K ≠ V; every T around the chunk size.
Shape shape_with(std::size_t tokens) { return Shape{2, tokens, 1, 2, 32, 48}; }

const std::size_t kTokens[] = {1, kC - 1, kC, kC + 1, 3 * kC + 5};

}  // namespace
}  // namespace kdacp::kda
