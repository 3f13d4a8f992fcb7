// The FP64 reference of the packed-sequence tests (SPEC §9, §10): a stream
// with its cu_seqlens, random inputs with contractive transfers, and a
// recurrence that runs each sequence alone, token by token, with its
// hand-written reverse sweep.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kdacp/kda.hpp"
#include "kda/sequences.hpp"
#include "kda_test_inputs.hpp"

namespace kdacp::kda::test {

// A stream: its shape and its cu_seqlens (empty: each row is one sequence).
struct Case {
  std::string name;
  Shape shape;
  std::vector<std::int64_t> cu;

  Sequences sequences() const {
    return cu.empty() ? Sequences(shape.batch, shape.tokens)
                      : Sequences(shape.batch, shape.tokens, std::span(cu));
  }
  std::size_t count() const { return cu.empty() ? shape.batch : cu.size() - 1; }
  std::size_t states() const {
    return count() * shape.value_heads * shape.key_dim * shape.value_dim;
  }
};

inline Shape shape_of(std::size_t b, std::size_t t, std::size_t h, std::size_t hv,
                      std::size_t k, std::size_t v) {
  return {b, t, h, hv, k, v};
}

template <class T>
struct Problem {
  Case c;
  T scale = 0;
  std::vector<T> q, k, v, g, beta, h0, d_o, dht;

  Inputs<T> inputs() const {
    return {q.data(), k.data(), v.data(), g.data(), beta.data(), c.shape, scale};
  }
  SequenceStates<const T> states(const std::vector<T>& x) const {
    return {x.data(), c.count(), c.shape.value_heads, c.shape.key_dim, c.shape.value_dim};
  }
  template <class U>
  Problem<U> cast() const {
    auto conv = [](const std::vector<T>& x) { return std::vector<U>(x.begin(), x.end()); };
    return {c,       static_cast<U>(scale), conv(q),  conv(k),  conv(v),
            conv(g), conv(beta),            conv(h0), conv(d_o), conv(dht)};
  }
};

// k L2-normalised, g = log U(0.9, 1), β ∈ (0.1, 0.9): contractive transfers.
inline Problem<double> make_problem(const Case& c, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Shape& s = c.shape;
  Problem<double> p;
  p.c = c;
  p.scale = default_scale<double>(s.key_dim);
  RandomInputs in = random_inputs(s, rng);
  p.q = std::move(in.q);
  p.k = std::move(in.k);
  p.v = std::move(in.v);
  p.g = std::move(in.g);
  p.beta = std::move(in.beta);
  p.h0 = uniform(c.states(), -1, 1, rng);
  p.d_o = uniform(s.v_elems(), -1, 1, rng);
  p.dht = uniform(c.states(), -1, 1, rng);
  return p;
}

// Everything a forward + backward over the stream produces.
template <class T>
struct Result {
  std::vector<T> o, ht, dq, dk, dv, dg, dbeta, dh0;
  explicit Result(const Case& c)
      : o(c.shape.v_elems()), ht(c.states()), dq(c.shape.qk_elems()), dk(c.shape.qk_elems()),
        dv(c.shape.v_elems()), dg(c.shape.g_elems()), dbeta(c.shape.beta_elems()),
        dh0(c.states()) {}
};

// One sequence: row `row`, tokens [begin, end), state row n.
struct Seq {
  std::size_t row, begin, end, n;
};

inline std::vector<Seq> sequences_of(const Case& c) {
  std::vector<Seq> out;
  if (c.cu.empty()) {
    for (std::size_t b = 0; b < c.shape.batch; ++b) out.push_back({b, 0, c.shape.tokens, b});
  } else {
    for (std::size_t n = 0; n + 1 < c.cu.size(); ++n)
      out.push_back({0, std::size_t(c.cu[n]), std::size_t(c.cu[n + 1]), n});
  }
  return out;
}

// Each sequence run alone from its h0 row in FP64, SPEC §9 token by token
// (S' = Diag(α)S, u = v - S'ᵀk, S = S' + β k uᵀ, o = scale·Sᵀq), then the
// reverse sweep of that recurrence by hand, from dht.
inline Result<double> reference(const Problem<double>& p) {
  const Shape& s = p.c.shape;
  const std::size_t kd = s.key_dim, vd = s.value_dim, kv = kd * vd;
  Result<double> r(p.c);
  for (const Seq& seq : sequences_of(p.c))
    for (std::size_t j = 0; j < s.value_heads; ++j) {
      const std::size_t h = j / s.group(), len = seq.end - seq.begin;
      auto at_qk = [&](std::size_t t) { return ((seq.row * s.tokens + t) * s.heads + h) * kd; };
      auto at_v = [&](std::size_t t) { return ((seq.row * s.tokens + t) * s.value_heads + j) * vd; };
      auto at_g = [&](std::size_t t) { return ((seq.row * s.tokens + t) * s.value_heads + j) * kd; };
      auto at_b = [&](std::size_t t) { return (seq.row * s.tokens + t) * s.value_heads + j; };
      const std::size_t slot = (seq.n * s.value_heads + j) * kv;
      std::vector<std::vector<double>> state(len + 1), decayed(len), u(len);
      state[0].assign(p.h0.begin() + slot, p.h0.begin() + slot + kv);
      for (std::size_t i = 0; i < len; ++i) {
        const std::size_t t = seq.begin + i;
        const double* k = &p.k[at_qk(t)];
        const double* q = &p.q[at_qk(t)];
        const double beta = p.beta[at_b(t)];
        decayed[i].resize(kv);
        u[i].resize(vd);
        state[i + 1].resize(kv);
        for (std::size_t a = 0; a < kd; ++a)
          for (std::size_t c = 0; c < vd; ++c)
            decayed[i][a * vd + c] = std::exp(p.g[at_g(t) + a]) * state[i][a * vd + c];
        for (std::size_t c = 0; c < vd; ++c) {
          double kd_s = 0;
          for (std::size_t a = 0; a < kd; ++a) kd_s += k[a] * decayed[i][a * vd + c];
          u[i][c] = p.v[at_v(t) + c] - kd_s;
        }
        for (std::size_t a = 0; a < kd; ++a)
          for (std::size_t c = 0; c < vd; ++c)
            state[i + 1][a * vd + c] = decayed[i][a * vd + c] + beta * k[a] * u[i][c];
        for (std::size_t c = 0; c < vd; ++c) {
          double acc = 0;
          for (std::size_t a = 0; a < kd; ++a) acc += q[a] * state[i + 1][a * vd + c];
          r.o[at_v(t) + c] = p.scale * acc;
        }
      }
      std::copy(state[len].begin(), state[len].end(), r.ht.begin() + slot);

      std::vector<double> ds(p.dht.begin() + slot, p.dht.begin() + slot + kv), du(vd);
      for (std::size_t i = len; i-- > 0;) {
        const std::size_t t = seq.begin + i;
        const double* k = &p.k[at_qk(t)];
        const double* q = &p.q[at_qk(t)];
        const double* d_o = &p.d_o[at_v(t)];
        const double beta = p.beta[at_b(t)];
        for (std::size_t a = 0; a < kd; ++a) {
          double dq = 0;
          for (std::size_t c = 0; c < vd; ++c) {
            dq += state[i + 1][a * vd + c] * d_o[c];
            ds[a * vd + c] += p.scale * q[a] * d_o[c];
          }
          r.dq[at_qk(t) + a] += p.scale * dq;
        }
        double dbeta = 0;
        for (std::size_t c = 0; c < vd; ++c) {
          double z = 0;
          for (std::size_t a = 0; a < kd; ++a) z += k[a] * ds[a * vd + c];
          du[c] = beta * z;
          dbeta += z * u[i][c];
          r.dv[at_v(t) + c] = du[c];
        }
        r.dbeta[at_b(t)] = dbeta;
        for (std::size_t a = 0; a < kd; ++a) {
          double dk = 0, dg = 0;
          const double alpha = std::exp(p.g[at_g(t) + a]);
          for (std::size_t c = 0; c < vd; ++c) {
            dk += beta * ds[a * vd + c] * u[i][c] - decayed[i][a * vd + c] * du[c];
            const double dd = ds[a * vd + c] - k[a] * du[c];
            dg += decayed[i][a * vd + c] * dd;
            ds[a * vd + c] = alpha * dd;
          }
          r.dk[at_qk(t) + a] += dk;
          r.dg[at_g(t) + a] = dg;
        }
      }
      std::copy(ds.begin(), ds.end(), r.dh0.begin() + slot);
    }
  return r;
}


// The single-rank path (forward_sequences / backward_sequences) over the
// problem's stream with `exec`: o, ht, the gradients and dh0.
template <class T>
Result<T> single_rank_path(const Problem<T>& p, const kda::Exec& exec) {
  const Case& c = p.c;
  Result<T> r(c);
  const Sequences seqs = c.sequences();
  forward_sequences(p.inputs(), seqs, p.states(p.h0), r.o.data(),
                    sequence_states(r.ht.data(), seqs, c.shape), exec);
  backward_sequences(p.inputs(), seqs, p.states(p.h0), p.d_o.data(), p.states(p.dht),
                     Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data()},
                     sequence_states(r.dh0.data(), seqs, c.shape), exec);
  return r;
}

}  // namespace kdacp::kda::test
