// The context-parallel layer over packed sequences with initial and final
// states (SPEC §10): every protocol configuration, P in {1, 2, 3, 4, 8}, even
// and uneven contiguous splits, and zigzag and irregular layouts with several
// parts per rank for the rows that take layouts, against an FP64 recurrence that runs each
// sequence alone; ht and dh0 the same bits on every rank; exact protocols
// bitwise equal to each other; central finite differences through the layer
// for dh0 and the dht path; bad input refused before any message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/protocol.hpp"
#include "kda_cp_stream_runner.hpp"
#include "kda_sequence_reference.hpp"

namespace kdacp::kda {
namespace {

using test::Case;
using test::Problem;
using test::Result;
using test::make_problem;
using test::reference;
using test::rel_error;
using test::shape_of;
using test::CpRun;
using Method = test::RowConfig;
using test::cast_all;
using test::run_layer;
using test::same_bits;
using test::stream_sequences;

// T = 48. Even splits: P = 4 parts of 12, P = 8 of 6, P = 3 of 16. Sequences
// inside one rank ([0,5)), of one token ([5,6), [40,41)), ending at a rank
// boundary ([6,12) for P = 4, 8), starting at one ([12,30), which spans three
// ranks at P = 8), and ending the stream ([41,48)).
const Case kMixed{"mixed", shape_of(1, 48, 1, 2, 16, 32), {0, 5, 6, 12, 30, 40, 41, 48}};
// One sequence through every middle rank, starting and ending inside a rank.
const Case kLong{"long", shape_of(1, 48, 1, 2, 32, 16), {0, 3, 45, 48}};
// Every token its own sequence: every part is a cut and starts a sequence.
const Case kTokens{"tokens", shape_of(1, 16, 1, 1, 16, 16),
                   {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}};
// No cu_seqlens: each of B rows is one sequence with its own h0 and ht.
const Case kRows{"rows", shape_of(2, 24, 1, 2, 16, 16), {}};

const Case* const kCases[] = {&kMixed, &kLong, &kTokens, &kRows};

template <class T>
constexpr double kTolerance = std::is_same_v<T, double> ? 1e-12 : 2e-5;

// Per-rank token counts: empty (the default ⌈T/P⌉/⌊T/P⌋ split) or uneven.
std::vector<std::vector<std::size_t>> splits_for(std::size_t tokens, std::size_t p) {
  const std::size_t weights[] = {3, 1, 4, 1, 5, 9, 2, 6};
  std::size_t total = 0;
  for (std::size_t r = 0; r < p; ++r) total += weights[r];
  std::vector<std::size_t> uneven;
  std::size_t used = 0;
  for (std::size_t r = 0; r + 1 < p; ++r) {
    uneven.push_back(std::max<std::size_t>(1, tokens * weights[r] / total));
    used += uneven.back();
  }
  uneven.push_back(tokens - used);
  return {{}, uneven};
}

std::string counts_name(const std::vector<std::size_t>& counts) {
  if (counts.empty()) return "even";
  std::ostringstream n;
  n << "counts";
  for (std::size_t c : counts) n << ' ' << c;
  return n.str();
}

// Rank r's dht: random, and their sum in rank order for the reference.
std::vector<std::vector<double>> dht_by_rank(const Case& c, std::size_t ranks, std::uint64_t seed,
                                             std::vector<double>& sum) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-1, 1);
  std::vector<std::vector<double>> out(ranks, std::vector<double>(c.states()));
  sum.assign(c.states(), 0.0);
  for (auto& d : out)
    for (std::size_t i = 0; i < d.size(); ++i) sum[i] += d[i] = dist(rng);
  return out;
}

template <class T>
void expect_close(const Result<T>& got, const Result<double>& want, double tol,
                  const std::string& what) {
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
void check_ranks(std::size_t ranks) {
  for (const Case* c : kCases) {
    Problem<double> pd = make_problem(*c, 11 + ranks);
    const std::vector<std::vector<double>> dht = dht_by_rank(*c, ranks, 17 + ranks, pd.dht);
    const Result<double> want = reference(pd);
    const Problem<T> p = pd.cast<T>();
    const std::vector<std::vector<T>> local_dht = cast_all<T>(dht);
    for (const std::vector<std::size_t>& counts : splits_for(c->shape.tokens, ranks)) {
      std::optional<CpRun<T>> chain;
      for (const Method& m : test::row_configs(ranks, c->shape)) {
        const std::string what = c->name + ", P=" + std::to_string(ranks) + ", " +
                                 counts_name(counts) + ", " + protocol_label(m.config);
        const CpRun<T> got = run_layer(p, local_dht, ranks, counts, m);
        expect_close(got.r, want, std::max(kTolerance<T>, m.bound), what);
        for (std::size_t r = 1; r < ranks; ++r) {
          EXPECT_TRUE(same_bits(got.ht[r], got.ht[0])) << what << ": ht on rank " << r;
          EXPECT_TRUE(same_bits(got.dh0[r], got.dh0[0])) << what << ": dh0 on rank " << r;
        }
        if (!m.exact) continue;
        // The first exact row is the chain (p2p); every exact one gives its bits.
        if (!chain) chain.emplace(got);
        EXPECT_TRUE(same_bits(got.r, chain->r)) << what << ": not the chain's bits";
      }
    }
  }
}

class CpSequences : public ::testing::TestWithParam<std::size_t> {};

TEST_P(CpSequences, DoubleMatchesFp64) { check_ranks<double>(GetParam()); }
TEST_P(CpSequences, FloatMatchesFp64) { check_ranks<float>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Ranks, CpSequences, ::testing::Values(1, 2, 3, 4, 8),
                         [](const auto& info) {
                           std::ostringstream n;
                           n << 'P' << info.param;
                           return n.str();
                         });

// P = 3 ranks in six parts of 1/12, 3/12, 1/12, 4/12, 2/12 and 3/12 of T on
// ranks 2, 0, 0, 1, 2, 1: a rank holding two adjacent parts, the first part
// not on rank 0, parts of one rank far apart.
Layout irregular_layout(std::size_t tokens) {
  const std::size_t twelfths[] = {0, 1, 4, 5, 9, 11, 12}, owners[] = {2, 0, 0, 1, 2, 1};
  std::vector<LayoutPart> parts;
  for (std::size_t j = 0; j < 6; ++j)
    parts.push_back({owners[j], tokens * twelfths[j] / 12, tokens * twelfths[j + 1] / 12});
  return Layout(3, std::move(parts));
}

// Zigzag for P in {1, 2, 3, 4} and the irregular layout, every case, every
// row (all take layouts): close to FP64 (a reassociating row within its
// documented bound for the layout), ht and dh0 the same bits on every rank,
// and the exact rows bitwise equal to each other.
template <class T>
void check_layouts() {
  for (const Case* c : kCases) {
    Problem<double> pd = make_problem(*c, 51);
    std::vector<Layout> layouts;
    for (std::size_t ranks = 1; ranks <= 4; ++ranks)
      layouts.push_back(Layout::zigzag(c->shape.tokens, ranks));
    layouts.push_back(irregular_layout(c->shape.tokens));
    for (const Layout& layout : layouts) {
      const std::size_t ranks = layout.ranks();
      const std::vector<std::vector<double>> dht = dht_by_rank(*c, ranks, 53 + ranks, pd.dht);
      const Result<double> want = reference(pd);
      const Problem<T> p = pd.cast<T>();
      const bool zigzag = layout.parts().size() == 2 * ranks;
      const std::string name =
          c->name + (zigzag ? ", zigzag P=" : ", irregular P=") + std::to_string(ranks);
      ProblemShape shape;
      shape.ranks = ranks;
      shape.key_dim = c->shape.key_dim;
      shape.value_dim = c->shape.value_dim;
      shape.part_owners = layout.owners();
      std::optional<CpRun<T>> first;
      std::size_t rows = 0;
      for (const ProtocolDescriptor* row : protocol_registry()) {
        if (row->chooser()) continue;
        ASSERT_TRUE(row->takes_layouts) << row->name;
        ++rows;
        const double bound = row->exact() ? 0.0 : error_bound(*row, shape);
        for (const ProtocolConfig& config : valid_configs(*row, ranks, c->shape.value_dim)) {
          const std::string what = name + ", " + protocol_label(config);
          const CpRun<T> got =
              run_layer(p, cast_all<T>(dht), ranks, {}, Method{config, row->exact(), bound}, layout);
          expect_close(got.r, want, std::max(kTolerance<T>, bound), what);
          for (std::size_t r = 1; r < ranks; ++r) {
            EXPECT_TRUE(same_bits(got.ht[r], got.ht[0])) << what << ": ht on rank " << r;
            EXPECT_TRUE(same_bits(got.dh0[r], got.dh0[0])) << what << ": dh0 on rank " << r;
          }
          if (!row->exact()) continue;
          if (!first) first.emplace(got);
          EXPECT_TRUE(same_bits(got.r, first->r)) << what << ": not the first exact row's bits";
        }
      }
      EXPECT_GE(rows, 6u) << "every concrete row takes layouts";
    }
  }
}

TEST(CpSequences, LayoutsDoubleMatchFp64) { check_layouts<double>(); }
TEST(CpSequences, LayoutsFloatMatchFp64) { check_layouts<float>(); }

TEST(CpSequences, ZigzagLayout) {
  const Layout z = Layout::zigzag(10, 2);
  const std::size_t want[][3] = {{0, 0, 3}, {1, 3, 6}, {1, 6, 8}, {0, 8, 10}};
  ASSERT_EQ(z.parts().size(), 4u);
  for (std::size_t j = 0; j < 4; ++j) {
    EXPECT_EQ(z.parts()[j].rank, want[j][0]) << j;
    EXPECT_EQ(z.parts()[j].begin, want[j][1]) << j;
    EXPECT_EQ(z.parts()[j].end, want[j][2]) << j;
  }
  EXPECT_EQ(z.owners().list(), (std::vector<std::size_t>{0, 1, 1, 0}));
  const std::vector<Part> local = z.local_parts(1);
  ASSERT_EQ(local.size(), 2u);
  EXPECT_EQ(local[1].local_begin, 3u);
  EXPECT_EQ(z.local_tokens(0), 5u);
  EXPECT_THROW(Layout::zigzag(3, 2), InvalidArgument);
  EXPECT_THROW(Layout::zigzag(8, 0), InvalidArgument);
}

// Every row runs a zigzag layer (built collectively on every rank), and a
// contiguous layout is the plain exchange.
TEST(CpSequences, EveryRowBuildsAZigzagLayer) {
  const std::size_t ranks = 4;
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
    for (const ProtocolDescriptor* row : protocol_registry()) {
      if (row->chooser()) continue;
      const std::string name(row->name);
      for (const ProtocolConfig& config : valid_configs(*row, ranks, 16)) {
        // w = 1 is p2p and w = P allgather, which the factory builds instead.
        if (row->takes_group_size && (config.group_size == 1 || config.group_size == ranks)) continue;
        const auto w = static_cast<long long>(config.group_size);
        ContextParallelLayer<double> layer(mesh, name, Layout::zigzag(16, ranks), w);
        EXPECT_EQ(layer.exchange().method(), name);
        ContextParallelLayer<double> plain(mesh, name, Layout::contiguous(16, ranks), w);
        EXPECT_EQ(plain.exchange().method(), name);
      }
    }
  });
}

// The call without a stream runs one part per rank: a zigzag layer refuses it.
TEST(CpSequences, ZigzagLayerRefusesTheCallWithoutAStream) {
  const std::size_t ranks = 2;
  const Shape s = shape_of(1, 8, 1, 1, 16, 16);
  const Problem<double> p = make_problem(Case{"plain", s, {}}, 61);
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
    ContextParallelLayer<double> layer(mesh, std::string(kChainProtocol),
                                       Layout::zigzag(16, ranks));
    const Inputs<double> in{p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), s,
                            p.scale};
    std::vector<double> o(s.v_elems());
    const CommStats before = comm->stats();
    try {
      layer.forward(in, o.data());
      ADD_FAILURE() << "rank " << comm->rank() << ": no InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("has part owners {0, 1, 1, 0}, expected one part per "
                                           "rank in rank order"),
                std::string::npos)
          << e.what();
    }
    // The ranks' agreement (one all-gather) and nothing of the exchange.
    EXPECT_LE(comm->stats().messages_sent, before.messages_sent + 1);
  });
}

// Without cu_seqlens, h0, ht, dht and dh0 the stream forward is the forward
// without one, bit for bit, for every protocol.
template <class T>
void matches_plain_layer(std::size_t ranks) {
  const Case c{"plain", shape_of(2, 30, 1, 2, 16, 32), {}};
  const Problem<T> p = make_problem(c, 21).cast<T>();
  const Shape& s = c.shape;
  for (const Method& m : test::row_configs(ranks, s)) {
    std::vector<std::vector<T>> plain(ranks), stream(ranks);
    run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
      const std::size_t rank = comm->rank();
      auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
      ExchangeOptions options;
      options.segments = m.config.segments;
      ContextParallelLayer<T> layer(mesh, m.config.method,
                                    static_cast<long long>(m.config.group_size), options);
      const TokenSplit range = split_tokens(s.tokens, ranks, rank);
      Shape ls = s;
      ls.tokens = range.count;
      auto local = [&](const std::vector<T>& full, std::size_t inner) {
        std::vector<T> x(s.batch * range.count * inner);
        slice_tokens(full.data(), s.batch, s.tokens, inner, range, x.data());
        return x;
      };
      const std::size_t qk = s.heads * s.key_dim, vv = s.value_heads * s.value_dim;
      const std::vector<T> q = local(p.q, qk), k = local(p.k, qk), v = local(p.v, vv),
                           g = local(p.g, s.value_heads * s.key_dim),
                           beta = local(p.beta, s.value_heads), d_o = local(p.d_o, vv);
      const Inputs<T> in{q.data(), k.data(), v.data(), g.data(), beta.data(), ls, p.scale};
      auto run = [&](bool with_stream) {
        std::vector<T> o(ls.v_elems()), dq(ls.qk_elems()), dk(ls.qk_elems()), dv(ls.v_elems()),
            dg(ls.g_elems()), dbeta(ls.beta_elems()), d_incoming(ls.state_elems());
        const Grads<T> grads{dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(),
                             d_incoming.data()};
        if (with_stream) {
          const Stream st = layer.contiguous_stream(s.batch, s.tokens);
          const Saved saved = layer.forward(in, st, {}, o.data(), {});
          layer.backward(in, saved, {}, d_o.data(), {}, grads, {});
        } else {
          const Saved saved = layer.forward(in, o.data());
          layer.backward(in, saved, d_o.data(), grads);
        }
        std::vector<T> all;
        for (const auto* x : {&o, &dq, &dk, &dv, &dg, &dbeta, &d_incoming})
          all.insert(all.end(), x->begin(), x->end());
        return all;
      };
      plain[rank] = run(false);
      stream[rank] = run(true);
    });
    for (std::size_t r = 0; r < ranks; ++r)
      EXPECT_TRUE(same_bits(stream[r], plain[r]))
          << protocol_label(m.config) << " P=" << ranks << ": rank " << r;
  }
}

TEST(CpSequences, WithoutSequencesIsThePlainLayer) {
  for (std::size_t ranks : {1, 3, 4}) {
    matches_plain_layer<float>(ranks);
    matches_plain_layer<double>(ranks);
  }
}

// L = Σ_r (Σ o_r ⊙ d_o_r + Σ ht ⊙ dht_r): each rank's loss on its tokens and
// on its copy of ht. Central differences of the layer's forward for dh0 and
// sampled inputs; with d_o = 0 only the dht path is left.
void check_finite_differences(const Case& c, std::size_t ranks,
                              const std::vector<std::size_t>& counts, bool with_outputs) {
  Problem<double> p = make_problem(c, 31);
  if (!with_outputs) std::fill(p.d_o.begin(), p.d_o.end(), 0.0);
  std::vector<double> sum;
  const std::vector<std::vector<double>> dht = dht_by_rank(c, ranks, 37, sum);
  const Method p2p{{std::string(kChainProtocol), 1, 0}, true, 0};
  const CpRun<double> grads = run_layer(p, dht, ranks, counts, p2p);
  auto loss = [&] {
    const CpRun<double> run = run_layer(p, dht, ranks, counts, p2p);
    double l = 0;
    for (std::size_t i = 0; i < run.r.o.size(); ++i) l += run.r.o[i] * p.d_o[i];
    for (std::size_t r = 0; r < ranks; ++r)
      for (std::size_t i = 0; i < c.states(); ++i) l += run.ht[r][i] * dht[r][i];
    return l;
  };
  std::mt19937_64 rng(5);
  auto check = [&](std::vector<double>& x, const std::vector<double>& analytic,
                   std::size_t samples, const std::string& name) {
    EXPECT_LE(test::finite_difference_error(x, analytic, samples, rng, loss), 1e-6)
        << c.name << ", P=" << ranks << ", " << counts_name(counts) << ": " << name
        << (with_outputs ? "" : " (dht path)");
  };
  check(p.h0, grads.r.dh0, 24, "dh0");
  check(p.k, grads.r.dk, 8, "dk");
  check(p.v, grads.r.dv, 8, "dv");
  check(p.g, grads.r.dg, 8, "dg");
  check(p.beta, grads.r.dbeta, 8, "dbeta");
}

// Small: T = 12 over P = 3 ranks of 4 tokens or {2, 7, 3}; sequences of one
// token, across a rank boundary, ending at one.
const Case kSmall{"small", shape_of(1, 12, 1, 1, 16, 16), {0, 1, 6, 8, 12}};
const Case kSmallRows{"small rows", shape_of(2, 9, 1, 1, 16, 16), {}};

TEST(CpSequences, FiniteDifferences) {
  check_finite_differences(kSmall, 3, {}, true);
  check_finite_differences(kSmall, 3, {2, 7, 3}, true);
  check_finite_differences(kSmallRows, 3, {}, true);
}

TEST(CpSequences, FiniteDifferencesThroughDhtOnly) {
  check_finite_differences(kSmall, 3, {}, false);
  check_finite_differences(kSmall, 3, {2, 7, 3}, false);
  check_finite_differences(kSmallRows, 3, {}, false);
}

// Runs fn(layer, rank) on P ranks of a p2p layer; each rank expects an
// InvalidArgument mentioning `needle` and its rank, thrown before the layer
// sent or received a byte.
void expect_refused(std::size_t ranks,
                    const std::function<void(ContextParallelLayer<double>&, std::size_t)>& fn,
                    const std::string& needle) {
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t rank = comm->rank();
    auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
    ContextParallelLayer<double> layer(mesh, std::string(kChainProtocol));
    const CommStats before = comm->stats();
    try {
      fn(layer, rank);
      ADD_FAILURE() << "rank " << rank << ": no InvalidArgument; expected one mentioning '"
                    << needle << "'";
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(needle), std::string::npos) << msg;
      EXPECT_NE(msg.find("on rank " + std::to_string(rank)), std::string::npos) << msg;
    }
    // At most the ranks' agreement (one all-gather), nothing of the exchange.
    EXPECT_LE(comm->stats().messages_sent, before.messages_sent + 1) << "rank " << rank;
  });
}

TEST(CpSequences, BadStreamsAreRefusedNamingTheRank) {
  const std::vector<std::int64_t> not_zero{1, 5, 24}, not_increasing{0, 9, 9, 24},
      short_end{0, 5, 20};
  const std::vector<std::int32_t> not_increasing32{0, 9, 4, 24};
  auto stream = [](std::vector<std::int64_t> cu, std::vector<std::size_t> counts = {}) {
    return [=](ContextParallelLayer<double>& layer, std::size_t) {
      layer.contiguous_stream(1, 24, std::span(cu), std::span(counts));
    };
  };
  expect_refused(3, stream(not_zero), "cu_seqlens[0] is 1, expected 0");
  expect_refused(3, stream(not_increasing), "cu_seqlens[2] is 9, expected > cu_seqlens[1] = 9");
  expect_refused(3, stream(short_end), "cu_seqlens[2] (the last entry) is 20, expected T = 24");
  expect_refused(
      2,
      [&](ContextParallelLayer<double>& layer, std::size_t) {
        layer.contiguous_stream(1, 24, std::span(not_increasing32));
      },
      "cu_seqlens[2] is 4, expected > cu_seqlens[1] = 9");
  expect_refused(3, stream({0, 24}, {8, 8, 9}), "counts sum to 25, expected T = 24");
  expect_refused(3, stream({0, 24}, {12, 12, 0}), "counts[2] = 0, expected >= 1");
  expect_refused(3, stream({0, 24}, {12, 12}), "counts has 2 entries, expected one per rank, P = 3");
  expect_refused(
      4, [](ContextParallelLayer<double>& layer, std::size_t) { layer.contiguous_stream(1, 3); },
      "context-parallel size P is 4 for 3 tokens");
}

TEST(CpSequences, BadCallsAreRefusedBeforeAnyMessage) {
  const Case c{"bad", shape_of(1, 24, 1, 2, 16, 16), {0, 5, 24}};
  const Problem<double> p = make_problem(c, 41);
  const Shape& s = c.shape;
  const std::size_t ranks = 3;
  // Each rank's 8 tokens of the stream.
  Shape ls = s;
  ls.tokens = 8;
  std::vector<double> o(ls.v_elems());
  const Inputs<double> in{p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), ls,
                          p.scale};
  auto forward = [&](std::function<void(SequenceStates<const double>&, SequenceStates<double>&,
                                        Stream&, Inputs<double>&)> spoil) {
    return [=, &p, &o](ContextParallelLayer<double>& layer, std::size_t) {
      Stream st = layer.contiguous_stream(s.batch, s.tokens, std::span(c.cu));
      std::vector<double> ht(c.states());
      SequenceStates<const double> h0 = p.states(p.h0);
      SequenceStates<double> ht_states = sequence_states(ht.data(), st.sequences, ls);
      Inputs<double> local = in;
      spoil(h0, ht_states, st, local);
      layer.forward(local, st, h0, o.data(), ht_states);
    };
  };
  expect_refused(ranks, forward([](auto& h0, auto&, auto&, auto&) { h0.sequences = 3; }),
                 "h0 has shape [3,2,16,16], expected [N,HV,K,V] = [2,2,16,16]");
  expect_refused(ranks, forward([](auto&, auto& ht, auto&, auto&) { ht.value_dim = 32; }),
                 "ht has shape [2,2,16,32]");
  expect_refused(ranks, forward([](auto&, auto&, auto&, auto& local) { local.shape.tokens = 9; }),
                 "shape.tokens (T_local) = 9, expected the layout's 8 tokens");
  expect_refused(ranks,
                 forward([](auto&, auto&, Stream& st, auto&) {
                   st.layout = Layout(3, {{0, 0, 4}, {1, 4, 8}, {2, 8, 16}, {0, 16, 24}});
                 }),
                 "stream.layout has part owners {0, 1, 2, 0}, expected the exchange's {0, 1, 2}");
  expect_refused(ranks,
                 forward([](auto&, auto&, Stream& st, auto&) {
                   st.layout = Layout(3, {{1, 0, 8}, {0, 8, 16}, {2, 16, 24}});
                 }),
                 "stream.layout has part owners {1, 0, 2}, expected the exchange's {0, 1, 2}");
  expect_refused(ranks,
                 forward([](auto&, auto&, Stream& st, auto&) {
                   st.layout = Layout::contiguous(24, 2, {});
                 }),
                 "stream.layout spans 2 ranks, expected the mesh's P = 3");

  // Backward: a wrong dht or dh0 is refused before the dht all-gather.
  for (const bool bad_dht : {true, false}) {
    const std::string needle = bad_dht ? "dht has shape [2,2,5,16]" : "dh0 has shape [5,2,16,16]";
    run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
      const std::size_t rank = comm->rank();
      auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
      ContextParallelLayer<double> layer(mesh, std::string(kChainProtocol));
      const Stream st = layer.contiguous_stream(s.batch, s.tokens, std::span(c.cu));
      std::vector<double> lo(ls.v_elems());
      const Saved saved = layer.forward(in, st, p.states(p.h0), lo.data(), {});
      std::vector<double> d_o(ls.v_elems(), 1.0), dq(ls.qk_elems()), dk(ls.qk_elems()),
          dv(ls.v_elems()), dg(ls.g_elems()), dbeta(ls.beta_elems()), dh0(c.states());
      SequenceStates<const double> dht = p.states(p.dht);
      SequenceStates<double> dh0_states = sequence_states(dh0.data(), st.sequences, ls);
      (bad_dht ? dht.key_dim : dh0_states.sequences) = 5;
      const CommStats before = comm->stats();
      try {
        layer.backward(in, saved, p.states(p.h0), d_o.data(), dht,
                       Grads<double>{dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data()},
                       dh0_states);
        ADD_FAILURE() << "rank " << rank << ": no InvalidArgument; expected '" << needle << "'";
      } catch (const InvalidArgument& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(needle), std::string::npos) << msg;
        EXPECT_NE(msg.find("backward on rank " + std::to_string(rank)), std::string::npos) << msg;
      }
      // The ranks' agreement (one all-gather), not the dht all-gather.
      EXPECT_LE(comm->stats().messages_sent, before.messages_sent + 1) << "rank " << rank;
    });
  }
}

}  // namespace
}  // namespace kdacp::kda
