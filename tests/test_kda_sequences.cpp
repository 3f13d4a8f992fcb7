// Packed sequences with initial and final states (SPEC §10): the single-rank
// path and the part functions against an FP64 recurrence that runs each
// sequence alone, the chain with cuts folded here over contiguous and zigzag
// layouts, central finite differences, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/kda_cp.hpp"
#include "kda/sequences.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/thread_pool.hpp"
#include "kda/parts.hpp"
#include "kda_sequence_reference.hpp"

namespace kdacp::kda {
namespace {

// The recurrent algorithm: a part chain that cuts a sequence reproduces one
// device's bits only there (chunk's chunk boundaries move with the cut).
const kda::Exec kRecurrent{{nullptr, KernelKind::best}, Algorithm::recurrent};

using test::Case;
using test::Problem;
using test::Result;
using test::Seq;
using test::make_problem;
using test::reference;
using test::rel_error;
using test::sequences_of;
using test::shape_of;

// T = 48, parts of 12 (P = 4), 6 (P = 8) or 3 (zigzag P = 8): sequences that
// lie inside one part ([0,5)), are one token ([5,6), [40,41)), end at a part
// boundary ([6,12)), start at one and span three parts ([12,30)).
const Case kMixed{"mixed", shape_of(1, 48, 1, 2, 16, 32), {0, 5, 6, 12, 30, 40, 41, 48}};
// One sequence through every middle part.
const Case kLong{"long", shape_of(1, 48, 1, 2, 32, 16), {0, 3, 45, 48}};
// One sequence: the layer without cuts.
const Case kWhole{"whole", shape_of(1, 48, 2, 2, 16, 16), {0, 48}};
// Every token its own sequence.
const Case kTokens{"tokens", shape_of(1, 16, 1, 2, 16, 16),
                   {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}};
// No cu_seqlens: each of B rows is a sequence with its own h0 and ht.
const Case kRows{"rows", shape_of(2, 48, 2, 4, 32, 16), {}};

const Case* const kCases[] = {&kMixed, &kLong, &kWhole, &kTokens, &kRows};

template <class T>
Result<T> single_rank(const Problem<T>& p, std::size_t threads) {
  ThreadPool pool(threads);
  return test::single_rank_path(p, kda::Exec{{&pool, KernelKind::best}, Algorithm::recurrent});
}

template <class T>
constexpr double kTolerance = std::is_same_v<T, double> ? 1e-12 : 2e-5;

template <class T>
void expect_close(const Result<T>& got, const Result<double>& want, const std::string& what) {
  const double tol = kTolerance<T>;
  EXPECT_LE(rel_error(got.o, want.o), tol) << what << ": o";
  EXPECT_LE(rel_error(got.ht, want.ht), tol) << what << ": ht";
  EXPECT_LE(rel_error(got.dq, want.dq), tol) << what << ": dq";
  EXPECT_LE(rel_error(got.dk, want.dk), tol) << what << ": dk";
  EXPECT_LE(rel_error(got.dv, want.dv), tol) << what << ": dv";
  EXPECT_LE(rel_error(got.dg, want.dg), tol) << what << ": dg";
  EXPECT_LE(rel_error(got.dbeta, want.dbeta), tol) << what << ": dbeta";
  EXPECT_LE(rel_error(got.dh0, want.dh0), tol) << what << ": dh0";
}

template <class T>
bool same_bits(const T* a, const T* b, std::size_t n) {
  return std::memcmp(a, b, n * sizeof(T)) == 0;
}

template <class T>
void single_rank_matches_reference() {
  for (const Case* c : kCases) {
    const Problem<double> pd = make_problem(*c, 1);
    const Result<double> want = reference(pd);
    const Problem<T> p = pd.cast<T>();
    const Result<T> base = single_rank(p, 1);
    expect_close(base, want, c->name);
    for (std::size_t threads : {0, 3, 8}) {
      const Result<T> r = single_rank(p, threads);
      EXPECT_TRUE(r.o == base.o && r.ht == base.ht && r.dq == base.dq && r.dk == base.dk &&
                  r.dv == base.dv && r.dg == base.dg && r.dbeta == base.dbeta &&
                  r.dh0 == base.dh0)
          << c->name << ": " << threads << " threads";
    }
  }
}

TEST(KdaSequences, SingleRankMatchesFp64Double) { single_rank_matches_reference<double>(); }
TEST(KdaSequences, SingleRankMatchesFp64Float) { single_rank_matches_reference<float>(); }

// Without cu_seqlens and with one sequence the path is kda::forward/backward
// from h0 with d_final = dht, bit for bit.
TEST(KdaSequences, OneSequencePerRowIsTheChunkKernel) {
  for (const Case* c : {&kRows, &kWhole}) {
    const Problem<float> p = make_problem(*c, 2).cast<float>();
    const Result<float> r = single_rank(p, 2);
    Result<float> want(*c);
    forward(p.inputs(), p.h0.data(), want.o.data(), want.ht.data(), kRecurrent);
    backward(p.inputs(), p.h0.data(), p.d_o.data(), p.dht.data(),
             Grads<float>{want.dq.data(), want.dk.data(), want.dv.data(), want.dg.data(),
                          want.dbeta.data(), want.dh0.data()},
             kRecurrent);
    EXPECT_TRUE(r.o == want.o && r.ht == want.ht && r.dq == want.dq && r.dk == want.dk &&
                r.dv == want.dv && r.dg == want.dg && r.dbeta == want.dbeta &&
                r.dh0 == want.dh0)
        << c->name;
  }
}

// Ranks, each holding its parts' stream token ranges in token order.
struct Layout {
  std::string name;
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> ranks;
};

Layout contiguous(const std::string& name, const std::vector<std::size_t>& counts) {
  Layout l{name, {}};
  std::size_t begin = 0;
  for (std::size_t n : counts) {
    l.ranks.push_back({{begin, begin + n}});
    begin += n;
  }
  return l;
}

std::vector<Layout> layouts(std::size_t tokens) {
  std::vector<Layout> out;
  const std::size_t weights[] = {3, 1, 4, 1, 5, 9, 2, 6};
  for (std::size_t p : {1, 2, 3, 4, 8}) {
    std::vector<std::size_t> even, uneven;
    for (std::size_t r = 0; r < p; ++r) even.push_back(split_tokens(tokens, p, r).count);
    std::size_t total = 0;
    for (std::size_t r = 0; r < p; ++r) total += weights[r];
    std::size_t used = 0;
    for (std::size_t r = 0; r + 1 < p; ++r) {
      uneven.push_back(std::max<std::size_t>(1, tokens * weights[r] / total));
      used += uneven.back();
    }
    uneven.push_back(tokens - used);
    out.push_back(contiguous("contiguous P=" + std::to_string(p), even));
    out.push_back(contiguous("uneven P=" + std::to_string(p), uneven));
    Layout zig{"zigzag P=" + std::to_string(p), std::vector<std::vector<std::pair<std::size_t, std::size_t>>>(p)};
    for (std::size_t j = 0; j < 2 * p; ++j) {
      const TokenSplit part = split_tokens(tokens, 2 * p, j);
      zig.ranks[std::min(j, 2 * p - 1 - j)].push_back({part.begin, part.begin + part.count});
    }
    out.push_back(zig);
  }
  return out;
}

// Tokens of `parts` (stream ranges at their local_begin) of a [B,T,inner]
// tensor, concatenated into [B,T_local,inner], and back.
template <class T>
std::vector<T> gather(const std::vector<T>& full, const Shape& s, std::size_t inner,
                      const std::vector<Part>& parts, std::size_t local_tokens) {
  std::vector<T> out(s.batch * local_tokens * inner);
  for (std::size_t b = 0; b < s.batch; ++b)
    for (const Part& p : parts)
      std::copy_n(full.begin() + (b * s.tokens + p.begin) * inner, (p.end - p.begin) * inner,
                  out.begin() + (b * local_tokens + p.local_begin) * inner);
  return out;
}

template <class T>
void scatter(const std::vector<T>& local, const Shape& s, std::size_t inner,
             const std::vector<Part>& parts, std::size_t local_tokens, std::vector<T>& full) {
  for (std::size_t b = 0; b < s.batch; ++b)
    for (const Part& p : parts)
      std::copy_n(local.begin() + (b * local_tokens + p.local_begin) * inner,
                  (p.end - p.begin) * inner, full.begin() + (b * s.tokens + p.begin) * inner);
}

// C = op(M)·X + S per (b, value head) slab: the library's step kernel for
// float, the same sums in k order for double.
template <class T>
std::vector<T> step(const std::vector<T>& m, const std::vector<T>& x, const std::vector<T>& s,
                    const Shape& shape, Direction direction) {
  const std::size_t kd = shape.key_dim, vd = shape.value_dim;
  std::vector<T> out(s.size());
  for (std::size_t slab = 0; slab < shape.batch * shape.value_heads; ++slab) {
    const T* ms = m.data() + slab * kd * kd;
    const T* xs = x.data() + slab * kd * vd;
    const T* ss = s.data() + slab * kd * vd;
    T* cs = out.data() + slab * kd * vd;
    if constexpr (std::is_same_v<T, float>) {
      affine_step(ms, kd, xs, vd, ss, vd, cs, vd, kd, vd, direction);
    } else {
      for (std::size_t i = 0; i < kd; ++i)
        for (std::size_t c = 0; c < vd; ++c) {
          T acc = ss[i * vd + c];
          for (std::size_t a = 0; a < kd; ++a)
            acc += (direction == Direction::forward ? ms[i * kd + a] : ms[a * kd + i]) *
                   xs[a * vd + c];
          cs[i * vd + c] = acc;
        }
    }
  }
  return out;
}

// One rank's local tensors.
template <class T>
struct Local {
  std::vector<Part> parts;
  std::size_t tokens = 0;
  Shape shape;
  std::vector<T> q, k, v, g, beta, d_o, o, dq, dk, dv, dg, dbeta;
  T scale = 0;
  Inputs<T> inputs() const {
    return {q.data(), k.data(), v.data(), g.data(), beta.data(), shape, scale};
  }
};

// The chain with cuts (SPEC §10), folded serially here; every part runs the
// part_* functions on its rank's local tensors.
template <class T>
void check_chain(const Problem<T>& p, const Result<T>& single, const Result<double>& want,
                 const Layout& layout) {
  const Case& c = p.c;
  const Shape& s = c.shape;
  const Sequences seqs = c.sequences();
  const std::string what = c.name + ", " + layout.name;
  const std::size_t qk = s.heads * s.key_dim, vv = s.value_heads * s.value_dim,
                    gk = s.value_heads * s.key_dim, bh = s.value_heads;

  std::vector<Local<T>> ranks(layout.ranks.size());
  struct Entry {
    std::size_t rank, index;
    Part part;
  };
  std::vector<Entry> chain;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    Local<T>& l = ranks[r];
    for (const auto& [begin, end] : layout.ranks[r]) {
      l.parts.push_back(Part{begin, end, l.tokens});
      chain.push_back({r, l.parts.size() - 1, l.parts.back()});
      l.tokens += end - begin;
    }
    l.shape = s;
    l.shape.tokens = l.tokens;
    l.scale = p.scale;
    l.q = gather(p.q, s, qk, l.parts, l.tokens);
    l.k = gather(p.k, s, qk, l.parts, l.tokens);
    l.v = gather(p.v, s, vv, l.parts, l.tokens);
    l.g = gather(p.g, s, gk, l.parts, l.tokens);
    l.beta = gather(p.beta, s, bh, l.parts, l.tokens);
    l.d_o = gather(p.d_o, s, vv, l.parts, l.tokens);
    for (auto* x : {&l.o, &l.dv}) x->assign(s.batch * l.tokens * vv, T(0));
    for (auto* x : {&l.dq, &l.dk}) x->assign(s.batch * l.tokens * qk, T(0));
    l.dg.assign(s.batch * l.tokens * gk, T(0));
    l.dbeta.assign(s.batch * l.tokens * bh, T(0));
  }
  std::sort(chain.begin(), chain.end(),
            [](const Entry& a, const Entry& b) { return a.part.begin < b.part.begin; });

  ThreadPool pool(3);
  const kda::Exec exec{{&pool, KernelKind::best}, Algorithm::recurrent};
  const std::size_t n = chain.size();
  std::vector<PartInfo> info(n);
  std::vector<std::vector<T>> offset(n, std::vector<T>(s.state_elems())),
      transfer(n, std::vector<T>(s.transfer_elems())), incoming(n);
  for (std::size_t j = 0; j < n; ++j) {
    info[j] = part_summary(ranks[chain[j].rank].inputs(), seqs, chain[j].part, p.states(p.h0),
                           offset[j].data(), transfer[j].data(), exec);
    EXPECT_EQ(info[j].cut, info[j].started.count > 0) << what;
  }
  for (std::size_t j = 0; j < n; ++j) {
    if (info[j].starts_sequence) continue;
    ASSERT_GT(j, 0u);
    incoming[j] = info[j - 1].cut
                      ? offset[j - 1]
                      : step(transfer[j - 1], incoming[j - 1], offset[j - 1], s, Direction::forward);
  }
  Result<T> got(c);
  for (std::size_t j = 0; j < n; ++j) {
    Local<T>& l = ranks[chain[j].rank];
    part_forward(l.inputs(), seqs, chain[j].part, incoming[j].empty() ? nullptr : incoming[j].data(),
                 p.states(p.h0), l.o.data(), sequence_states(got.ht.data(), seqs, s), exec);
  }

  std::vector<std::vector<T>> grad(n, std::vector<T>(s.state_elems())),
      out(n, std::vector<T>(s.state_elems(), T(0))), d_incoming = grad;
  for (std::size_t j = 0; j < n; ++j) {
    const Local<T>& l = ranks[chain[j].rank];
    part_incoming_grad(l.inputs(), seqs, chain[j].part, l.d_o.data(), p.states(p.dht),
                       grad[j].data(), exec);
  }
  EXPECT_TRUE(info[n - 1].ends_sequence) << what;
  for (std::size_t j = n - 1; j-- > 0;)
    out[j] = info[j + 1].cut ? grad[j + 1]
                             : step(transfer[j + 1], out[j + 1], grad[j + 1], s, Direction::backward);
  for (std::size_t j = 0; j < n; ++j) {
    Local<T>& l = ranks[chain[j].rank];
    part_backward(l.inputs(), seqs, chain[j].part,
                  incoming[j].empty() ? nullptr : incoming[j].data(), p.states(p.h0),
                  l.d_o.data(), out[j].data(), p.states(p.dht),
                  Grads<T>{l.dq.data(), l.dk.data(), l.dv.data(), l.dg.data(), l.dbeta.data(),
                           d_incoming[j].data()},
                  sequence_states(got.dh0.data(), seqs, s), exec);
  }
  for (const Local<T>& l : ranks) {
    scatter(l.o, s, vv, l.parts, l.tokens, got.o);
    scatter(l.dq, s, qk, l.parts, l.tokens, got.dq);
    scatter(l.dk, s, qk, l.parts, l.tokens, got.dk);
    scatter(l.dv, s, vv, l.parts, l.tokens, got.dv);
    scatter(l.dg, s, gk, l.parts, l.tokens, got.dg);
    scatter(l.dbeta, s, bh, l.parts, l.tokens, got.dbeta);
  }
  expect_close(got, want, what);

  // The gradient w.r.t. a part's incoming state is G + Aᵀ·out of the part,
  // which the fold passed to its predecessor; a part that starts sequence m
  // reports dh0[m].
  const std::size_t kv = s.key_dim * s.value_dim;
  for (std::size_t j = 0; j < n; ++j) {
    if (info[j].starts_sequence) {
      const std::size_t row = c.cu.empty() ? 0 : info[j].started.first;
      EXPECT_TRUE(same_bits(d_incoming[j].data(), got.dh0.data() + row * s.value_heads * kv,
                            s.state_elems()))
          << what << ": part " << j;
    } else {
      std::vector<double> fold(out[j - 1].begin(), out[j - 1].end());
      EXPECT_LE(rel_error(d_incoming[j], fold), kTolerance<T>) << what << ": part " << j;
    }
  }

  // A part's state is the single-rank path's bits where it never went through
  // a fold M·x + S: its incoming is h0 or the b of a cut, or a sequence start
  // lies before the token in the part.
  std::vector<char> exact_token(s.tokens, 0);
  for (std::size_t j = 0; j < n; ++j) {
    const Part& part = chain[j].part;
    bool exact = info[j].starts_sequence || (j > 0 && info[j - 1].cut);
    for (std::size_t t = part.begin; t < part.end; ++t) {
      exact = exact || std::find(seqs.boundaries().begin(), seqs.boundaries().end(), t) !=
                           seqs.boundaries().end();
      exact_token[t] = exact;
    }
  }
  for (std::size_t b = 0; b < s.batch; ++b)
    for (std::size_t t = 0; t < s.tokens; ++t) {
      if (!exact_token[t]) continue;
      EXPECT_TRUE(same_bits(got.o.data() + (b * s.tokens + t) * vv,
                            single.o.data() + (b * s.tokens + t) * vv, vv))
          << what << ": o of token " << t;
    }
  for (const Seq& seq : sequences_of(c)) {
    if (!exact_token[seq.end - 1]) continue;
    EXPECT_TRUE(same_bits(got.ht.data() + seq.n * s.value_heads * kv,
                          single.ht.data() + seq.n * s.value_heads * kv, s.value_heads * kv))
        << what << ": ht of sequence " << seq.n;
  }
}

template <class T>
void chain_matches() {
  for (const Case* c : kCases) {
    const Problem<double> pd = make_problem(*c, 3);
    const Result<double> want = reference(pd);
    const Problem<T> p = pd.cast<T>();
    const Result<T> single = single_rank(p, 1);
    for (const Layout& layout : layouts(c->shape.tokens)) check_chain(p, single, want, layout);
  }
}

TEST(KdaSequences, ChainWithCutsDouble) { chain_matches<double>(); }
TEST(KdaSequences, ChainWithCutsFloat) { chain_matches<float>(); }

TEST(KdaSequences, PartInfo) {
  const Sequences mixed = kMixed.sequences();
  PartInfo i = part_info(mixed, Part{0, 12, 0});
  EXPECT_TRUE(i.starts_sequence && i.cut && i.ends_sequence);
  EXPECT_EQ(i.started.first, 0u);
  EXPECT_EQ(i.started.count, 3u);
  EXPECT_EQ(i.ended.first, 0u);
  EXPECT_EQ(i.ended.count, 3u);
  i = part_info(mixed, Part{12, 24, 0});
  EXPECT_TRUE(i.starts_sequence && i.cut && !i.ends_sequence);
  EXPECT_EQ(i.started.first, 3u);
  EXPECT_EQ(i.started.count, 1u);
  EXPECT_EQ(i.ended.count, 0u);
  i = part_info(mixed, Part{24, 36, 0});
  EXPECT_TRUE(!i.starts_sequence && i.cut && !i.ends_sequence);
  EXPECT_EQ(i.started.first, 4u);
  EXPECT_EQ(i.started.count, 1u);
  EXPECT_EQ(i.ended.first, 3u);
  EXPECT_EQ(i.ended.count, 1u);
  i = part_info(mixed, Part{13, 29, 0});
  EXPECT_TRUE(!i.starts_sequence && !i.cut && !i.ends_sequence);
  EXPECT_EQ(i.started.count + i.ended.count, 0u);
  i = part_info(mixed, Part{40, 41, 0});
  EXPECT_TRUE(i.starts_sequence && i.cut && i.ends_sequence);
  EXPECT_EQ(i.started.first, 5u);
  EXPECT_EQ(i.ended.first, 5u);

  const Sequences rows = kRows.sequences();
  i = part_info(rows, Part{0, 24, 0});
  EXPECT_TRUE(i.starts_sequence && i.cut && !i.ends_sequence);
  EXPECT_EQ(i.started.count, 2u);
  EXPECT_EQ(i.ended.count, 0u);
  i = part_info(rows, Part{24, 48, 0});
  EXPECT_TRUE(!i.starts_sequence && !i.cut && i.ends_sequence);
  EXPECT_EQ(i.ended.first, 0u);
  EXPECT_EQ(i.ended.count, 2u);
  EXPECT_EQ(rows.count(), 2u);
  EXPECT_EQ(mixed.count(), 7u);
}

// L = Σ o ⊙ d_o + Σ ht ⊙ dht by central differences of forward_sequences, for
// dh0 and sampled entries of the inputs; with d_o = 0 only the dht path is left.
void check_finite_differences(const Case& c, bool with_outputs) {
  Problem<double> p = make_problem(c, 4);
  if (!with_outputs) std::fill(p.d_o.begin(), p.d_o.end(), 0.0);
  const Result<double> grads = single_rank(p, 2);
  const Sequences seqs = c.sequences();
  auto loss = [&] {
    std::vector<double> o(c.shape.v_elems()), ht(c.states());
    forward_sequences(p.inputs(), seqs, p.states(p.h0), o.data(),
                      sequence_states(ht.data(), seqs, c.shape));
    double l = 0;
    for (std::size_t i = 0; i < o.size(); ++i) l += o[i] * p.d_o[i];
    for (std::size_t i = 0; i < ht.size(); ++i) l += ht[i] * p.dht[i];
    return l;
  };
  std::mt19937_64 rng(5);
  auto check = [&](std::vector<double>& x, const std::vector<double>& analytic,
                   std::size_t samples, const std::string& name) {
    EXPECT_LE(test::finite_difference_error(x, analytic, samples, rng, loss), 1e-6)
        << c.name << ": " << name;
  };
  check(p.h0, grads.dh0, 256, "dh0");
  check(p.q, grads.dq, 48, "dq");
  check(p.k, grads.dk, 48, "dk");
  check(p.v, grads.dv, 48, "dv");
  check(p.g, grads.dg, 48, "dg");
  check(p.beta, grads.dbeta, 48, "dbeta");
}

const Case kSmallMixed{"small mixed", shape_of(1, 24, 1, 2, 16, 16), {0, 5, 6, 12, 20, 24}};
const Case kSmallRows{"small rows", shape_of(2, 12, 1, 2, 16, 16), {}};

TEST(KdaSequences, FiniteDifferences) {
  for (const Case* c : {&kSmallMixed, &kSmallRows}) check_finite_differences(*c, true);
}

TEST(KdaSequences, FiniteDifferencesThroughDhtOnly) {
  for (const Case* c : {&kSmallMixed, &kSmallRows}) check_finite_differences(*c, false);
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

TEST(KdaSequences, BadCuSeqlensThrow) {
  auto packed = [](std::size_t batch, std::size_t tokens, std::vector<std::int64_t> cu) {
    return [=] { Sequences(batch, tokens, std::span<const std::int64_t>(cu)); };
  };
  expect_invalid(packed(1, 48, {1, 5, 48}), "cu_seqlens[0] is 1, expected 0");
  expect_invalid(packed(1, 48, {0, 20, 17, 48}), "cu_seqlens[2] is 17, expected > cu_seqlens[1] = 20");
  expect_invalid(packed(1, 48, {0, 5, 5, 48}), "cu_seqlens[2] is 5, expected > cu_seqlens[1] = 5");
  expect_invalid(packed(1, 48, {0, -3, 48}), "cu_seqlens[1] is -3");
  expect_invalid(packed(1, 48, {0, 5, 40}), "cu_seqlens[2] (the last entry) is 40, expected T = 48");
  expect_invalid(packed(1, 48, {0, 5, 50}), "expected T = 48");
  expect_invalid(packed(2, 48, {0, 5, 48}), "batch (B) = 2, expected B = 1");
  expect_invalid(packed(1, 48, {0}), "cu_seqlens has 1 entries");
  const std::vector<std::int32_t> cu32{0, 7, 6, 48};
  expect_invalid([&] { Sequences(1, 48, std::span(cu32)); },
                 "cu_seqlens[2] is 6, expected > cu_seqlens[1] = 7");
  const std::vector<std::int32_t> good32{0, 7, 48};
  EXPECT_EQ(Sequences(1, 48, std::span(good32)).count(), 2u);
  expect_invalid([] { Sequences(0, 4); }, "batch (B) = 0");
  expect_invalid([] { Sequences(1, 0); }, "tokens (T) = 0");
}

// Bad states, parts and pointers throw before any output is written.
TEST(KdaSequences, BadArgumentsThrowBeforeWriting) {
  const Problem<double> p = make_problem(kMixed, 6);
  const Shape& s = kMixed.shape;
  const Sequences seqs = kMixed.sequences();
  const double mark = 7.5;
  Result<double> r(kMixed);
  for (auto* x : {&r.o, &r.ht, &r.dq, &r.dk, &r.dv, &r.dg, &r.dbeta, &r.dh0})
    std::fill(x->begin(), x->end(), mark);
  std::vector<double> state(s.state_elems(), mark), transfer(s.transfer_elems(), mark);
  auto untouched = [&] {
    for (auto* x : {&r.o, &r.ht, &r.dq, &r.dk, &r.dv, &r.dg, &r.dbeta, &r.dh0, &state, &transfer})
      if (std::any_of(x->begin(), x->end(), [&](double e) { return e != mark; })) return false;
    return true;
  };
  const Grads<double> grads{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data()};
  auto states = [&](std::vector<double>& x) { return sequence_states(x.data(), seqs, s); };
  auto fwd = [&](SequenceStates<const double> h0, SequenceStates<double> ht) {
    return [=, &p, &r, &seqs] { forward_sequences(p.inputs(), seqs, h0, r.o.data(), ht); };
  };
  auto bwd = [&](SequenceStates<const double> dht, SequenceStates<double> dh0) {
    return [=, &p, &seqs] {
      backward_sequences(p.inputs(), seqs, p.states(p.h0), p.d_o.data(), dht, grads, dh0);
    };
  };

  SequenceStates<const double> h0 = p.states(p.h0);
  h0.sequences = 6;
  expect_invalid(fwd(h0, states(r.ht)), "h0 has shape [6,2,16,32], expected [N,HV,K,V] = [7,2,16,32]");
  h0 = p.states(p.h0);
  std::swap(h0.key_dim, h0.value_dim);
  expect_invalid(fwd(h0, states(r.ht)), "h0 has shape [7,2,32,16]");
  SequenceStates<double> ht = states(r.ht);
  ht.value_heads = 1;
  expect_invalid(fwd(p.states(p.h0), ht), "ht has shape [7,1,16,32]");
  SequenceStates<const double> dht = p.states(p.dht);
  dht.sequences = 8;
  expect_invalid(bwd(dht, states(r.dh0)), "dht has shape [8,2,16,32]");
  SequenceStates<double> dh0 = states(r.dh0);
  dh0.value_dim = 16;
  expect_invalid(bwd(p.states(p.dht), dh0), "dh0 has shape [7,2,16,16]");
  expect_invalid(
      [&] {
        Grads<double> with_incoming = grads;
        with_incoming.d_incoming = state.data();
        backward_sequences(p.inputs(), seqs, p.states(p.h0), p.d_o.data(), p.states(p.dht),
                           with_incoming, states(r.dh0));
      },
      "grads.d_incoming is set");
  const Sequences rows(2, 48);
  expect_invalid([&] { forward_sequences(p.inputs(), rows, {}, r.o.data(), {}); },
                 "shape.batch (B) = 1, expected the sequences' B = 2");
  const Sequences shorter(1, 40);
  expect_invalid([&] { forward_sequences(p.inputs(), shorter, {}, r.o.data(), {}); },
                 "shape.tokens (T) = 48, expected the sequences' T = 40");

  // The part_* calls trust the layer's validation (kda/validate.hpp); the
  // public calls check the rest of their arguments.
  expect_invalid(
      [&] {
        backward_sequences(p.inputs(), seqs, p.states(p.h0), nullptr, p.states(p.dht), grads,
                           states(r.dh0));
      },
      "kda::backward_sequences: d_o is null");
  expect_invalid(
      [&] {
        backward_sequences(p.inputs(), seqs, p.states(p.h0), p.d_o.data(), p.states(p.dht), grads,
                           states(r.dh0), {}, 0);
      },
      "kda::backward_sequences: checkpoint_interval = 0");
  auto no_scale = p.inputs();
  no_scale.scale = 0;
  expect_invalid([&] { forward_sequences(no_scale, seqs, {}, r.o.data(), {}); },
                 "kda::forward_sequences: scale = 0, expected a finite value > 0");
  EXPECT_TRUE(untouched());
}

}  // namespace
}  // namespace kdacp::kda
