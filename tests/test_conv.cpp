// The causal short convolution (kdacp/conv.hpp): one device against an FP64
// direct formula written here, gradients against central finite differences
// of that formula, and CP over the in-process backend (P = 2..5; contiguous,
// uneven with parts shorter than W-1, zigzag; cu_seqlens cuts) against one
// device: float64 within 1e-12, float32 within 1e-6 (relative to the largest
// reference value, at least 1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kdacp/conv.hpp"
#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/layout.hpp"

namespace kdacp {
namespace {

using conv::Activation;
using conv::CausalConv;

struct Problem {
  std::size_t B = 1, T = 1, D = 1, W = 1;
  std::optional<std::vector<std::int64_t>> cu;
  Activation act = Activation::none;
  bool bias = false, h0 = false, ht = false;
  std::uint64_t seed = 1;

  std::size_t N() const { return cu ? cu->size() - 1 : B; }
  Sequences seqs() const { return cu ? Sequences(B, T, *cu) : Sequences(B, T); }
};

template <class T>
struct Data {
  std::vector<T> x, w, bias, h0, dy, dht;
};

template <class T>
Data<T> make_data(const Problem& p) {
  std::mt19937_64 rng(p.seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  auto fill = [&](std::size_t n) {
    std::vector<T> v(n);
    for (T& e : v) e = static_cast<T>(u(rng));
    return v;
  };
  Data<T> d;
  d.x = fill(p.B * p.T * p.D);
  d.w = fill(p.D * p.W);
  if (p.bias) d.bias = fill(p.D);
  if (p.h0) d.h0 = fill(p.N() * p.D * p.W);
  d.dy = fill(p.B * p.T * p.D);
  if (p.ht) d.dht = fill(p.N() * p.D * p.W);
  return d;
}

template <class T>
struct Result {
  std::vector<T> y, ht, dx, dw, db, dh0;
};

// --- the FP64 direct formula --------------------------------------------------

// (first token, length, state row, batch row) of each sequence.
struct Seq {
  std::size_t begin, len, n, b;
};
std::vector<Seq> sequences_of(const Problem& p) {
  std::vector<Seq> out;
  if (p.cu) {
    for (std::size_t n = 0; n + 1 < p.cu->size(); ++n)
      out.push_back({static_cast<std::size_t>((*p.cu)[n]),
                     static_cast<std::size_t>((*p.cu)[n + 1] - (*p.cu)[n]), n, 0});
  } else {
    for (std::size_t b = 0; b < p.B; ++b) out.push_back({0, p.T, b, b});
  }
  return out;
}

// y (and final states) of the definition, in double; used by the finite
// differences with perturbed inputs.
struct Reference {
  std::vector<double> y, ht;
};
Reference reference(const Problem& p, const std::vector<double>& x, const std::vector<double>& w,
                    const std::vector<double>& bias, const std::vector<double>& h0) {
  Reference r;
  r.y.assign(p.B * p.T * p.D, 0.0);
  r.ht.assign(p.N() * p.D * p.W, 0.0);
  const long W = static_cast<long>(p.W);
  for (const Seq& s : sequences_of(p)) {
    // Position u relative to the sequence start; u < 0 reads the initial state.
    auto at = [&](long u, std::size_t d) -> double {
      if (u >= 0) return x[(s.b * p.T + s.begin + static_cast<std::size_t>(u)) * p.D + d];
      if (h0.empty()) return 0.0;
      return h0[(s.n * p.D + d) * p.W + static_cast<std::size_t>(u + W)];
    };
    for (std::size_t t = 0; t < s.len; ++t)
      for (std::size_t d = 0; d < p.D; ++d) {
        double z = bias.empty() ? 0.0 : bias[d];
        for (long k = 0; k < W; ++k)
          z += w[d * p.W + static_cast<std::size_t>(k)] * at(static_cast<long>(t) - (W - 1) + k, d);
        const double y = p.act == Activation::silu ? z / (1.0 + std::exp(-z)) : z;
        r.y[(s.b * p.T + s.begin + t) * p.D + d] = y;
      }
    for (std::size_t d = 0; d < p.D; ++d)
      for (long j = 0; j < W; ++j)
        r.ht[(s.n * p.D + d) * p.W + static_cast<std::size_t>(j)] =
            at(static_cast<long>(s.len) - W + j, d);
  }
  return r;
}

template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// --- one device and CP runs ------------------------------------------------------

template <class T>
conv::Tensors<T> tensors(const Problem& p, const Data<T>& d, const T* x) {
  conv::Tensors<T> in;
  in.x = x;
  in.weight = d.w.data();
  in.bias = p.bias ? d.bias.data() : nullptr;
  in.initial_state = p.h0 ? d.h0.data() : nullptr;
  in.activation = p.act;
  return in;
}

template <class T>
Result<T> run_single(const Problem& p, const Data<T>& d) {
  CausalConv c(p.seqs(), p.D, p.W);
  Result<T> r;
  r.y.resize(p.B * p.T * p.D);
  if (p.ht) r.ht.resize(p.N() * p.D * p.W);
  const auto in = tensors(p, d, d.x.data());
  const auto saved = c.forward(in, r.y.data(), p.ht ? r.ht.data() : nullptr);
  r.dx.resize(r.y.size());
  r.dw.resize(p.D * p.W);
  if (p.bias) r.db.resize(p.D);
  if (p.h0) r.dh0.resize(p.N() * p.D * p.W);
  c.backward(in, saved, d.dy.data(), p.ht ? d.dht.data() : nullptr,
             conv::Grads<T>{r.dx.data(), r.dw.data(), p.bias ? r.db.data() : nullptr,
                            p.h0 ? r.dh0.data() : nullptr});
  return r;
}

// [B,T,D] -> rank's [B,T_local,D] and back.
template <class T>
std::vector<T> to_local(const std::vector<T>& full, const Problem& p, const Layout& l,
                        std::size_t rank) {
  const std::size_t tl = l.local_tokens(rank);
  std::vector<T> out(p.B * tl * p.D);
  for (const Part& part : l.local_parts(rank))
    for (std::size_t b = 0; b < p.B; ++b)
      for (std::size_t t = part.begin; t < part.end; ++t)
        for (std::size_t d = 0; d < p.D; ++d)
          out[(b * tl + part.local_begin + t - part.begin) * p.D + d] =
              full[(b * p.T + t) * p.D + d];
  return out;
}
template <class T>
void from_local(const std::vector<T>& local, const Problem& p, const Layout& l, std::size_t rank,
                std::vector<T>& full) {
  const std::size_t tl = l.local_tokens(rank);
  for (const Part& part : l.local_parts(rank))
    for (std::size_t b = 0; b < p.B; ++b)
      for (std::size_t t = part.begin; t < part.end; ++t)
        for (std::size_t d = 0; d < p.D; ++d)
          full[(b * p.T + t) * p.D + d] =
              local[(b * tl + part.local_begin + t - part.begin) * p.D + d];
}

// CP over P in-process ranks: y, dx assembled; dw, db summed over the ranks in
// rank order; ht and dh0 checked bitwise equal on every rank.
template <class T>
Result<T> run_cp(const Problem& p, const Data<T>& d, const Layout& layout) {
  const std::size_t P = layout.ranks();
  std::vector<Result<T>> per(P);
  run_in_process(P, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t r = comm->rank();
    CausalConv c(comm, layout, p.seqs(), p.D, p.W);
    Result<T>& out = per[r];
    const std::vector<T> x = to_local(d.x, p, layout, r), dy = to_local(d.dy, p, layout, r);
    out.y.resize(x.size());
    if (p.ht) out.ht.resize(p.N() * p.D * p.W);
    const auto in = tensors(p, d, x.data());
    const auto saved = c.forward(in, out.y.data(), p.ht ? out.ht.data() : nullptr);
    out.dx.resize(x.size());
    out.dw.resize(p.D * p.W);
    if (p.bias) out.db.resize(p.D);
    if (p.h0) out.dh0.resize(p.N() * p.D * p.W);
    // The final state's gradient is the sum over ranks: rank 0's loss
    // carries all of it, the others' none.
    const std::vector<T> dht = r == 0 ? d.dht : std::vector<T>(d.dht.size(), T(0));
    c.backward(in, saved, dy.data(), p.ht ? dht.data() : nullptr,
               conv::Grads<T>{out.dx.data(), out.dw.data(), p.bias ? out.db.data() : nullptr,
                              p.h0 ? out.dh0.data() : nullptr});
  });
  Result<T> all;
  all.y.assign(p.B * p.T * p.D, T(0));
  all.dx = all.y;
  all.dw.assign(p.D * p.W, T(0));
  all.db.assign(p.bias ? p.D : 0, T(0));
  for (std::size_t r = 0; r < P; ++r) {
    from_local(per[r].y, p, layout, r, all.y);
    from_local(per[r].dx, p, layout, r, all.dx);
    for (std::size_t k = 0; k < all.dw.size(); ++k) all.dw[k] += per[r].dw[k];
    for (std::size_t k = 0; k < all.db.size(); ++k) all.db[k] += per[r].db[k];
    EXPECT_EQ(per[r].ht, per[0].ht) << "final_state differs between rank " << r << " and rank 0";
    EXPECT_EQ(per[r].dh0, per[0].dh0) << "dinitial_state differs between rank " << r
                                      << " and rank 0";
  }
  all.ht = per[0].ht;
  all.dh0 = per[0].dh0;
  return all;
}

// max |a - b| / max(1, max |b|).
template <class A, class B>
double rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  EXPECT_EQ(a.size(), b.size());
  double err = 0, scale = 1;
  for (std::size_t k = 0; k < std::min(a.size(), b.size()); ++k) {
    err = std::max(err, std::abs(static_cast<double>(a[k]) - static_cast<double>(b[k])));
    scale = std::max(scale, std::abs(static_cast<double>(b[k])));
  }
  return err / scale;
}

template <class T>
void expect_close(const Result<T>& got, const Result<T>& want, double tol,
                  const std::string& what) {
  EXPECT_LE(rel_error(got.y, want.y), tol) << what << ": y";
  EXPECT_LE(rel_error(got.ht, want.ht), tol) << what << ": final_state";
  EXPECT_LE(rel_error(got.dx, want.dx), tol) << what << ": dx";
  EXPECT_LE(rel_error(got.dw, want.dw), tol) << what << ": dweight";
  EXPECT_LE(rel_error(got.db, want.db), tol) << what << ": dbias";
  EXPECT_LE(rel_error(got.dh0, want.dh0), tol) << what << ": dinitial_state";
}

// Under CP every result but dweight and dbias (each rank's share) is one
// device's bits: halo x is copied, and the backward adds the terms of the
// tokens after a cut in token order, as one device does.
template <class T>
void expect_same_bits(const Result<T>& got, const Result<T>& want, const std::string& what) {
  auto same = [](const std::vector<T>& a, const std::vector<T>& b) {
    // memcmp's pointers must not be null, even for 0 bytes (UBSan): empty
    // results (no final state asked for) compare by size alone.
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
  };
  EXPECT_TRUE(same(got.y, want.y)) << what << ": y";
  EXPECT_TRUE(same(got.ht, want.ht)) << what << ": final_state";
  EXPECT_TRUE(same(got.dx, want.dx)) << what << ": dx";
  EXPECT_TRUE(same(got.dh0, want.dh0)) << what << ": dinitial_state";
}

std::string describe(const Problem& p) {
  std::string cu = p.cu ? "" : "none";
  if (p.cu)
    for (std::size_t i = 0; i < p.cu->size(); ++i)
      cu += fmt::format("{}{}", i ? "," : "", (*p.cu)[i]);
  return fmt::format("B={} T={} D={} W={} cu={} act={} bias={} h0={} ht={}", p.B, p.T, p.D, p.W,
                     cu, conv::activation_name(p.act), p.bias, p.h0, p.ht);
}

// --- one device ----------------------------------------------------------------

TEST(Conv, ForwardMatchesTheDirectFormula) {
  for (std::size_t W : {1, 2, 4, 8})
    for (int packed = 0; packed < 2; ++packed)
      for (int flags = 0; flags < 8; ++flags) {
        Problem p;
        p.D = 3;
        p.W = W;
        if (packed) {
          p.T = 17;
          p.cu = std::vector<std::int64_t>{0, 1, 3, 10, 11, 17};
        } else {
          p.B = 2;
          p.T = 11;
        }
        p.act = flags & 1 ? Activation::silu : Activation::none;
        p.bias = flags & 2;
        p.h0 = p.ht = flags & 4;
        p.seed = 7 + W + flags;
        const auto d = make_data<double>(p);
        const auto r = run_single(p, d);
        const Reference ref = reference(p, d.x, d.w, d.bias, d.h0);
        EXPECT_LE(rel_error(r.y, ref.y), 1e-15) << describe(p);
        if (p.ht) {
          EXPECT_LE(rel_error(r.ht, ref.ht), 0.0) << describe(p);
        }
        // float32 against the same formula
        const auto df = make_data<float>(p);
        const auto rf = run_single(p, df);
        const Reference reff = reference(p, widen(df.x), widen(df.w), widen(df.bias), widen(df.h0));
        EXPECT_LE(rel_error(rf.y, reff.y), 2e-7) << describe(p);
      }
}

TEST(Conv, MatchesTorchStyleCrossCorrelation) {
  // y[t] = sum_k w[k] x[t - (W-1) + k]: with x = e_s (one token set) the
  // output is the weight reversed from token s on.
  Problem p;
  p.T = 10;
  p.D = 1;
  p.W = 4;
  Data<double> d;
  d.x.assign(10, 0.0);
  d.x[3] = 1.0;
  d.w = {1.0, 2.0, 3.0, 4.0};
  d.dy.assign(10, 0.0);
  const auto r = run_single(p, d);
  const std::vector<double> want{0, 0, 0, 4, 3, 2, 1, 0, 0, 0};
  EXPECT_EQ(r.y, want);
}

TEST(Conv, GradientsMatchFiniteDifferences) {
  for (std::size_t W : {1, 3, 5})
    for (int packed = 0; packed < 2; ++packed)
      for (int act = 0; act < 2; ++act) {
        Problem p;
        p.D = 2;
        p.W = W;
        if (packed) {
          p.T = 9;
          p.cu = std::vector<std::int64_t>{0, 2, 3, 9};
        } else {
          p.B = 2;
          p.T = 6;
        }
        p.act = act ? Activation::silu : Activation::none;
        p.bias = p.h0 = p.ht = true;
        p.seed = 100 + W * 4 + packed * 2 + act;
        const auto d = make_data<double>(p);
        const auto r = run_single(p, d);
        // L = <y, dy> + <ht, dht>
        auto loss = [&](const std::vector<double>& x, const std::vector<double>& w,
                        const std::vector<double>& b, const std::vector<double>& h0) {
          const Reference ref = reference(p, x, w, b, h0);
          double l = 0;
          for (std::size_t k = 0; k < ref.y.size(); ++k) l += ref.y[k] * d.dy[k];
          for (std::size_t k = 0; k < ref.ht.size(); ++k) l += ref.ht[k] * d.dht[k];
          return l;
        };
        const double eps = 1e-6;
        auto check = [&](int which, const std::vector<double>& grad, const char* name) {
          std::vector<double> v[4] = {d.x, d.w, d.bias, d.h0};
          ASSERT_EQ(grad.size(), v[which].size()) << name;
          for (std::size_t k = 0; k < grad.size(); ++k) {
            const double keep = v[which][k];
            v[which][k] = keep + eps;
            const double lp = loss(v[0], v[1], v[2], v[3]);
            v[which][k] = keep - eps;
            const double lm = loss(v[0], v[1], v[2], v[3]);
            v[which][k] = keep;
            EXPECT_NEAR(grad[k], (lp - lm) / (2 * eps), 1e-7)
                << describe(p) << ": " << name << " element " << k;
          }
        };
        check(0, r.dx, "dx");
        check(1, r.dw, "dweight");
        check(2, r.db, "dbias");
        check(3, r.dh0, "dinitial_state");
        // Column 0 of the initial state is never read.
        for (std::size_t n = 0; n < p.N(); ++n)
          for (std::size_t c = 0; c < p.D; ++c) EXPECT_EQ(r.dh0[(n * p.D + c) * p.W], 0.0);
      }
}

TEST(Conv, RejectsBadArguments) {
  const Sequences s(1, 8);
  EXPECT_THROW(CausalConv(s, 4, 0), InvalidArgument);
  try {
    CausalConv(s, 4, 9);
    FAIL() << "W = 9 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("W = 9"), std::string::npos) << e.what();
  }
  EXPECT_THROW(CausalConv(s, 0, 4), InvalidArgument);
  EXPECT_THROW(conv::parse_activation("relu"), InvalidArgument);
  EXPECT_EQ(conv::parse_activation("swish"), Activation::silu);
  EXPECT_EQ(conv::parse_activation("silu"), Activation::silu);
  EXPECT_EQ(conv::parse_activation(""), Activation::none);
  // A layout of another length than the sequences.
  EXPECT_THROW(run_in_process(2,
                              [&](const std::shared_ptr<Communicator>& comm) {
                                CausalConv(comm, Layout::contiguous(10, 2), s, 4, 4);
                              }),
               InvalidArgument);
}

TEST(Conv, Float32OverflowIsAnErrorNotInfinity) {
  Problem p;
  p.T = 4;
  p.D = 1;
  p.W = 2;
  Data<float> d;
  d.x = {3e38f, 3e38f, 1.0f, 1.0f};
  d.w = {1.0f, 1.0f};
  d.dy.assign(4, 1.0f);
  CausalConv c(p.seqs(), 1, 2);
  std::vector<float> y(4);
  try {
    c.forward(tensors(p, d, d.x.data()), y.data(), nullptr);
    FAIL() << "an overflow to inf passed";
  } catch (const NumericalError& e) {
    EXPECT_NE(std::string(e.what()).find("y: element [0,1,0] is inf"), std::string::npos)
        << e.what();
  }
  // silu of a huge negative pre-activation is -0, not NaN.
  d.x = {-3e38f, -1e30f, 1.0f, 1.0f};
  Problem q = p;
  q.act = Activation::silu;
  const auto r = run_single(q, d);
  for (float v : r.y) EXPECT_TRUE(std::isfinite(v));
  for (float v : r.dx) EXPECT_TRUE(std::isfinite(v));
}

// --- context parallelism ------------------------------------------------------------

// Every part count split of T tokens over P ranks that the tests use: even,
// uneven with parts shorter than W-1 and a long one.
std::vector<std::vector<std::size_t>> splits(std::size_t T, std::size_t P) {
  std::vector<std::vector<std::size_t>> out;
  std::vector<std::size_t> ones(P, 1);
  ones.back() = T - (P - 1);  // all but the last rank hold one token
  out.push_back(ones);
  std::vector<std::size_t> front(P, 1);
  front.front() = T - (P - 1);  // the first holds almost everything
  out.push_back(front);
  std::vector<std::size_t> mixed(P);
  std::size_t left = T;
  for (std::size_t r = 0; r + 1 < P; ++r) {
    mixed[r] = 1 + (r * 5 + 2) % 4;  // 3, 4, 1, 2, ...
    left -= mixed[r];
  }
  mixed.back() = left;
  out.push_back(mixed);
  return out;
}

template <class T>
void cp_matrix(double tol) {
  int cases = 0;
  for (std::size_t P = 2; P <= 5; ++P)
    for (std::size_t W : {1, 2, 4, 8})
      for (int packed = 0; packed < 2; ++packed) {
        Problem p;
        p.D = 3;
        p.W = W;
        p.T = 23;
        if (packed)  // cuts everywhere: sequences of 1, 2 and 3 tokens, and long ones
          p.cu = std::vector<std::int64_t>{0, 1, 3, 4, 7, 15, 16, 18, 23};
        else
          p.B = 2;
        p.act = (P + W) % 2 ? Activation::silu : Activation::none;
        p.bias = (P + packed) % 2 == 0;
        p.h0 = p.ht = (W + packed) % 3 != 0;
        p.seed = 1000 + P * 37 + W * 3 + packed;
        const auto d = make_data<T>(p);
        const Result<T> one = run_single(p, d);
        std::vector<Layout> layouts{Layout::contiguous(p.T, P), Layout::zigzag(p.T, P)};
        for (const auto& counts : splits(p.T, P))
          layouts.push_back(Layout::uneven(p.T, P, counts));
        for (const Layout& l : layouts) {
          const Result<T> cp = run_cp(p, d, l);
          const std::string what = describe(p) + " P=" + std::to_string(P) + " " + l.str();
          expect_close(cp, one, tol, what);
          expect_same_bits(cp, one, what);
          ++cases;
        }
      }
  EXPECT_EQ(cases, 4 * 4 * 2 * 5);
}

TEST(ConvCp, Float64EqualsOneDeviceWithin1e12) { cp_matrix<double>(1e-12); }
TEST(ConvCp, Float32EqualsOneDeviceWithin1e6) { cp_matrix<float>(1e-6); }

TEST(ConvCp, HaloOfShortPartsComesFromSeveralRanks) {
  // Parts of 1 token each before the last: with W = 8 part 5 needs tokens
  // 0..4 from ranks 0..4 (five transfers), cut by nothing.
  const Layout l = Layout::uneven(12, 6, std::vector<std::size_t>{1, 1, 1, 1, 1, 7});
  std::vector<CausalConv::Transfer> got;
  run_in_process(6, [&](const std::shared_ptr<Communicator>& comm) {
    CausalConv c(comm, l, Sequences(1, 12), 2, 8);
    if (comm->rank() == 0) got = c.transfers();
  });
  std::size_t into_last = 0;
  for (const auto& t : got)
    if (t.to == 5) {
      ++into_last;
      EXPECT_EQ(t.end - t.begin, 1u);
    }
  EXPECT_EQ(into_last, 5u);
  // A sequence start at token 3 cuts the halo of part 5 to tokens 3..4.
  const std::vector<std::int64_t> cu{0, 3, 12};
  run_in_process(6, [&](const std::shared_ptr<Communicator>& comm) {
    CausalConv c(comm, l, Sequences(1, 12, cu), 2, 8);
    if (comm->rank() == 0) got = c.transfers();
  });
  into_last = 0;
  for (const auto& t : got)
    if (t.to == 5) {
      ++into_last;
      EXPECT_GE(t.begin, 3u);
    }
  EXPECT_EQ(into_last, 2u);
}

// Ranks that call with different arguments are each told which before any
// halo moves: a width, or a final state (its gradient) on one rank only.
TEST(ConvCp, RanksThatDisagreeAreNamedOnEveryRank) {
  const Layout l = Layout::contiguous(8, 2);
  constexpr std::size_t d = 2;
  // `call(comm, width, final_state, dht)`'s error on each rank.
  auto messages = [&](auto&& width, auto&& final_state, auto&& final_grad) {
    std::vector<std::string> out(2);
    run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
      const std::size_t r = comm->rank(), w = width(r);
      std::vector<double> x(4 * d, 1.0), wt(d * w, 0.5), y(4 * d), ht(d * w), dht(d * w, 1.0), dx(4 * d),
          dw(d * w);
      try {
        CausalConv c(comm, l, Sequences(1, 8), d, w);
        const conv::Tensors<double> in{x.data(), wt.data(), nullptr, nullptr, conv::Activation::none};
        const conv::Saved<double> saved = c.forward<double>(in, y.data(), final_state(r) ? ht.data() : nullptr);
        c.backward<double>(in, saved, x.data(), final_grad(r) ? dht.data() : nullptr,
                           {dx.data(), dw.data(), nullptr, nullptr});
      } catch (const InvalidArgument& e) {
        out[r] = e.what();
      }
    });
    return out;
  };
  auto four = [](std::size_t) { return std::size_t{4}; };
  auto none = [](std::size_t) { return false; };
  for (const std::string& m : messages([](std::size_t r) { return std::size_t{r == 1 ? 3u : 4u}; }, none, none))
    EXPECT_NE(m.find("W (weight's kernel width): rank 0 has 4, rank 1 has 3"), std::string::npos) << m;
  for (const std::string& m : messages(four, [](std::size_t r) { return r == 1; }, none))
    EXPECT_NE(m.find("output_final_state: rank 0 has no, rank 1 has yes"), std::string::npos) << m;
  for (const std::string& m : messages(four, none, [](std::size_t r) { return r == 0; }))
    EXPECT_NE(m.find("final_state's gradient given: rank 0 has yes, rank 1 has no"), std::string::npos) << m;
}

}  // namespace
}  // namespace kdacp
