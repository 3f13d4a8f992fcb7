// The whole valid gate domain (issue 18): every finite g ≤ 0, from no decay
// to -1e4 per token and channel (α underflowing to 0, in-chunk products far
// below the smallest subnormal), constant or mixed per channel, with β at 0
// and 1, in float and double, forward and backward, one rank and CP, both
// algorithms against the hand-written FP64 reference of
// kda_sequence_reference.hpp. Tolerances are the project's: ≤ 1e-10 relative
// (double) and ≤ 5e-5 relative (float against the FP64 reference), per
// tensor (max |err| / max |ref|), for o, ht and every gradient. max |ref|
// is taken as at least the tested type's smallest normal number (2^-126 in
// float): under g = -100 float's α = e^-100 is subnormal, and so is every
// entry of dg and dh0, which then hold fewer than 24 bits in any algorithm.
//
// The table each test prints (KDACP_GATE_TABLE=1 prints it for every case)
// is the one docs/limits.md quotes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kda_cp_runner.hpp"
#include "kda_sequence_reference.hpp"
#include "kdacp/kda.hpp"

namespace kdacp::kda::test {
namespace {

constexpr std::size_t kC = kChunkSize;

// A gate pattern: fills g [B,T,HV,K] given the shape.
struct Gates {
  std::string name;
  std::function<void(const Shape&, std::vector<double>&, std::mt19937_64&)> fill;
};

Gates constant(double c) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "g=%g", c);
  return {buf, [c](const Shape&, std::vector<double>& g, std::mt19937_64&) {
            std::fill(g.begin(), g.end(), c);
          }};
}

// Ordinary gates (log U(0.9, 1)) with a few extreme channels: channel 0 is
// always -1e4 (α = 0), channel 1 always -50, and per token and head three
// random channels drawn from {-8, -20, -100, -800}.
Gates mixture() {
  return {"mix", [](const Shape& s, std::vector<double>& g, std::mt19937_64& rng) {
            std::uniform_real_distribution<double> weak(0.9, 1.0);
            std::uniform_int_distribution<std::size_t> ch(0, s.key_dim - 1), pick(0, 3);
            const double extreme[] = {-8, -20, -100, -800};
            for (auto& e : g) e = std::log(weak(rng));
            for (std::size_t r = 0; r < g.size(); r += s.key_dim) {
              g[r] = -1e4;
              g[r + 1] = -50;
              for (int n = 0; n < 3; ++n) g[r + ch(rng)] = extreme[pick(rng)];
            }
          }};
}

// Log-uniform over every scale: g = -exp(U(ln 1e-4, ln 1e4)), per element.
Gates log_uniform() {
  return {"log-uniform", [](const Shape&, std::vector<double>& g, std::mt19937_64& rng) {
            std::uniform_real_distribution<double> u(std::log(1e-4), std::log(1e4));
            for (auto& e : g) e = -std::exp(u(rng));
          }};
}

std::vector<Gates> sweep() {
  std::vector<Gates> out;
  for (double c : {0.0, -1e-3, -0.5, -5.0, -8.0, -20.0, -50.0, -100.0, -800.0, -1e4})
    out.push_back(constant(c));
  out.push_back(mixture());
  out.push_back(log_uniform());
  return out;
}

// The FP64 problem: random q, v, normalised k, h0, d_o, dht; the gates of
// `gates`; β ∈ U(0, 1) with exact 0 and 1 on some tokens.
Problem<double> gate_problem(const Case& c, const Gates& gates, std::uint64_t seed, bool states) {
  Problem<double> p = make_problem(c, seed);
  std::mt19937_64 rng(seed + 1000);
  gates.fill(c.shape, p.g, rng);
  std::uniform_real_distribution<double> u(0, 1);
  for (std::size_t i = 0; i < p.beta.size(); ++i)
    p.beta[i] = i % 7 == 3 ? 0.0 : i % 5 == 1 ? 1.0 : u(rng);
  if (!states) {
    std::fill(p.h0.begin(), p.h0.end(), 0.0);
    std::fill(p.dht.begin(), p.dht.end(), 0.0);
  }
  return p;
}

// forward + backward through the public one-call API.
template <class T>
Result<T> run_api(const Problem<T>& p, Algorithm algorithm) {
  Result<T> r(p.c);
  const Inputs<T> in = p.inputs();
  const kda::Exec exec{{nullptr, KernelKind::best}, algorithm};
  forward(in, p.h0.data(), r.o.data(), r.ht.data(), exec);
  backward(in, p.h0.data(), p.d_o.data(), p.dht.data(),
           Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), r.dh0.data()}, exec);
  return r;
}

struct Errors {
  double o = 0, ht = 0, dq = 0, dk = 0, dv = 0, dg = 0, dbeta = 0, dh0 = 0;
  double max() const { return std::max({o, ht, dq, dk, dv, dg, dbeta, dh0}); }
};

// max |got - want| / max(max |want|, the smallest normal T); infinite for
// any non-finite entry of got.
template <class T>
double checked(const std::vector<T>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0, ref = static_cast<double>(std::numeric_limits<T>::min());
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double x = static_cast<double>(got[i]);
    if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(x - want[i]));
    ref = std::max(ref, std::abs(want[i]));
  }
  return diff / ref;
}

template <class T>
Errors errors(const Result<T>& got, const Result<double>& want, bool with_ht) {
  Errors e;
  e.o = checked(got.o, want.o);
  e.ht = with_ht ? checked(got.ht, want.ht) : 0;
  e.dq = checked(got.dq, want.dq);
  e.dk = checked(got.dk, want.dk);
  e.dv = checked(got.dv, want.dv);
  e.dg = checked(got.dg, want.dg);
  e.dbeta = checked(got.dbeta, want.dbeta);
  e.dh0 = checked(got.dh0, want.dh0);
  return e;
}

void expect_within(const Errors& e, double tol, const std::string& what) {
  EXPECT_LE(e.o, tol) << what << " o";
  EXPECT_LE(e.ht, tol) << what << " ht";
  EXPECT_LE(e.dq, tol) << what << " dq";
  EXPECT_LE(e.dk, tol) << what << " dk";
  EXPECT_LE(e.dv, tol) << what << " dv";
  EXPECT_LE(e.dg, tol) << what << " dg";
  EXPECT_LE(e.dbeta, tol) << what << " dbeta";
  EXPECT_LE(e.dh0, tol) << what << " dh0";
}

void print_row(const std::string& what, const Errors& e) {
  std::printf("  %-34s %9.1e %9.1e %9.1e %9.1e %9.1e %9.1e %9.1e %9.1e\n", what.c_str(), e.o, e.ht,
              e.dq, e.dk, e.dv, e.dg, e.dbeta, e.dh0);
}

void print_header() {
  std::printf("  %-34s %9s %9s %9s %9s %9s %9s %9s %9s\n", "case (vs FP64 reference)", "o", "ht",
              "dq", "dk", "dv", "dg", "dbeta", "dh0");
}

// B = 1, HV = 2H (dq, dk sum over the group), K ≠ V; T around the chunk.
Case gate_case(std::size_t tokens) { return {"gates", shape_of(1, tokens, 1, 2, 32, 48), {}}; }

TEST(KdaGates, SweepOneRankBothAlgorithmsBothTypes) {
  print_header();
  Errors worst_d[2], worst_f[2];
  std::uint64_t seed = 1;
  for (const Gates& gates : sweep())
    for (std::size_t t : {std::size_t{1}, kC / 4 + 1, 2 * kC + 21}) {
      const Problem<double> p = gate_problem(gate_case(t), gates, seed++, true);
      const Result<double> want = reference(p);
      const Problem<float> pf = p.cast<float>();
      for (int a = 0; a < 2; ++a) {
        const Algorithm algo = a == 0 ? Algorithm::recurrent : Algorithm::chunk;
        const std::string what = gates.name + " T=" + std::to_string(t) + " " + algorithm_name(algo);
        const Errors ed = errors(run_api(p, algo), want, true);
        const Errors ef = errors(run_api(pf, algo), want, true);
        expect_within(ed, 1e-10, what + " double");
        expect_within(ef, 5e-5, what + " float");
        if (t == 2 * kC + 21) {
          print_row(what + " double", ed);
          print_row(what + " float", ef);
        }
        auto keep_max = [](Errors& w, const Errors& e) {
          w.o = std::max(w.o, e.o), w.ht = std::max(w.ht, e.ht), w.dq = std::max(w.dq, e.dq);
          w.dk = std::max(w.dk, e.dk), w.dv = std::max(w.dv, e.dv), w.dg = std::max(w.dg, e.dg);
          w.dbeta = std::max(w.dbeta, e.dbeta), w.dh0 = std::max(w.dh0, e.dh0);
        };
        keep_max(worst_d[a], ed);
        keep_max(worst_f[a], ef);
      }
    }
  std::printf("  worst over the sweep:\n");
  print_row("recurrent double", worst_d[0]);
  print_row("chunk double", worst_d[1]);
  print_row("recurrent float", worst_f[0]);
  print_row("chunk float", worst_f[1]);
}

// The chunk summary (S, M) and the G pass, which the CP layer adds, on the
// same sweep: chunk against recurrent in double, and float against double.
TEST(KdaGates, SummaryAndGPassOnTheSweep) {
  std::uint64_t seed = 500;
  for (const Gates& gates : sweep()) {
    const Problem<double> p = gate_problem(gate_case(2 * kC + 21), gates, seed++, true);
    const Shape& s = p.c.shape;
    auto run = [&](const auto& prob, Algorithm algo) {
      using T = typename std::decay_t<decltype(prob.q)>::value_type;
      const Inputs<T> in = prob.inputs();
      const kda::Exec exec{{nullptr, KernelKind::best}, algo};
      std::vector<T> st(s.state_elems()), m(s.transfer_elems()), gs(s.state_elems());
      chunk_summary(in, st.data(), m.data(), exec);
      incoming_grad(in, prob.d_o.data(), gs.data(), exec);
      return std::vector<std::vector<double>>{{st.begin(), st.end()}, {m.begin(), m.end()},
                                              {gs.begin(), gs.end()}};
    };
    const auto want = run(p, Algorithm::recurrent);
    const auto got_d = run(p, Algorithm::chunk);
    const auto got_f = run(p.cast<float>(), Algorithm::chunk);
    const char* names[] = {"summary S", "summary M", "G"};
    for (int i = 0; i < 3; ++i) {
      for (double x : got_d[i]) ASSERT_TRUE(std::isfinite(x)) << gates.name << " " << names[i];
      for (double x : got_f[i]) ASSERT_TRUE(std::isfinite(x)) << gates.name << " " << names[i];
      EXPECT_LE(rel_error(got_d[i], want[i]), 1e-10) << gates.name << " double " << names[i];
      // M underflows into float's subnormals under strong decay; its scale
      // is 1 (the identity at T = 0).
      double diff = 0, ref = i == 1 ? 1.0 : double(std::numeric_limits<float>::min());
      for (std::size_t j = 0; j < want[i].size(); ++j) {
        diff = std::max(diff, std::abs(got_f[i][j] - want[i][j]));
        ref = std::max(ref, std::abs(want[i][j]));
      }
      EXPECT_LE(ref > 0 ? diff / ref : diff, 5e-5) << gates.name << " float " << names[i];
    }
  }
}

// CP over three in-process ranks with every exact protocol and the
// allgather, the chunk algorithm (the default), against the FP64 reference
// of the whole stream (zero h0, no dht: the plain layer).
template <class T>
void check_cp(const Gates& gates, std::uint64_t seed, double tol) {
  const Case c = gate_case(3 * kC + 10);
  const Problem<double> p = gate_problem(c, gates, seed, false);
  const Result<double> want = reference(p);
  const Problem<T> pt = p.cast<T>();
  LayerData<T> d{c.shape, pt.q, pt.k, pt.v, pt.g, pt.beta};
  for (const Method& m : methods_for(3)) {
    const LayerResult<T> r = context_parallel(d, pt.d_o, 3, m.name, m.width, Algorithm::chunk);
    const std::string what = gates.name + " P=3 " + m.name + (sizeof(T) == 4 ? " float" : " double");
    EXPECT_LE(checked(r.o, want.o), tol) << what << " o";
    EXPECT_LE(checked(r.dq, want.dq), tol) << what << " dq";
    EXPECT_LE(checked(r.dk, want.dk), tol) << what << " dk";
    EXPECT_LE(checked(r.dv, want.dv), tol) << what << " dv";
    EXPECT_LE(checked(r.dg, want.dg), tol) << what << " dg";
    EXPECT_LE(checked(r.dbeta, want.dbeta), tol) << what << " dbeta";
  }
}

TEST(KdaGates, ContextParallelChunkOnStrongGates) {
  std::uint64_t seed = 900;
  for (const Gates& gates : {constant(-8), constant(-50), constant(-1e4), mixture(), log_uniform()}) {
    check_cp<double>(gates, seed++, 1e-10);
    check_cp<float>(gates, seed++, 5e-5);
  }
}

}  // namespace
}  // namespace kdacp::kda::test
