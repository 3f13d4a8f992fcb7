// Ulysses × state CP (kdacp/kda_ulysses.hpp): on P in-process ranks with head
// groups of U, forward + backward over packed sequences with h0, ht, dht and
// dh0 give the bits of the context-parallel layer over the P/U-rank group
// layout, every rank the same ht and dh0, and agree with the FP64 one-device
// reference; bad arguments on one rank throw on every rank before any
// message.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <tuple>

#include "kdacp/error.hpp"
#include "kdacp/half.hpp"
#include "kdacp/kda_ulysses.hpp"
#include "kda_cp_stream_runner.hpp"
#include "kdacp/job.hpp"
#include "kdacp/report/layer_bench.hpp"
#include "kdacp/report/run_report.hpp"

namespace kdacp::kda {
namespace {

using test::Case;
using test::CpRun;
using test::Problem;
using test::RowConfig;
using test::same_bits;

template <class T>
constexpr double kTolerance = std::is_same_v<T, double> ? 1e-10 : 2e-4;

double rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// One forward + backward through a UlyssesLayer of width `width` on `ranks`
// in-process ranks over `layout`; rank r's dht is dht[r] (empty: none).
// wire_in / wire_out: UlyssesLayer::wire_types (none: T on the wire).
using WireIn = std::array<std::optional<Half>, 5>;
template <class T>
CpRun<T> run_ulysses(const Problem<T>& p, const std::vector<std::vector<T>>& dht, std::size_t ranks,
                     std::size_t width, const Layout& layout, const std::string& method, Algorithm algorithm,
                     bool deterministic = false, const WireIn& wire_in = {}, std::optional<Half> wire_out = {}) {
  const Case& c = p.c;
  const Shape& s = c.shape;
  CpRun<T> out(c);
  out.ht.assign(ranks, std::vector<T>(c.states()));
  out.dh0.assign(ranks, std::vector<T>(c.states()));
  std::mutex m;
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t rank = comm->rank();
    const DeviceMesh mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
    kda::Exec exec;
    exec.algorithm = algorithm;
    ExchangeOptions options;  // auto prices the whole layer's shape: the layer divides its heads by U
    options.expected_shape =
        SummaryShape{s.batch, s.value_heads, s.key_dim, s.value_dim, std::is_same_v<T, double> ? DType::f64 : DType::f32};
    UlyssesLayer<T> layer(mesh, width, method, layout, 1, options, exec);
    layer.state_layer().deterministic(deterministic);
    layer.wire_types(wire_in, wire_out);
    const Stream stream{test::stream_sequences(c), layout};
    test::RankData<T> d(p, layout, rank);
    const Sequences& seqs = stream.sequences;
    const UlyssesSaved<T> saved =
        layer.forward(d.inputs(), stream, p.states(p.h0), d.o.data(), sequence_states(out.ht[rank].data(), seqs, d.shape));
    layer.backward(d.inputs(), saved, p.states(p.h0), d.d_o.data(),
                   dht.empty() ? SequenceStates<const T>{} : p.states(dht[rank]), d.grads(),
                   sequence_states(out.dh0[rank].data(), seqs, d.shape));
    const std::lock_guard lock(m);
    d.scatter(out.r);
  });
  out.r.ht = out.ht.front();
  out.r.dh0 = out.dh0.front();
  return out;
}

struct UlyssesCase {
  std::string name;
  Case c;
  std::size_t ranks, width;
  bool zigzag;
  std::vector<std::size_t> counts;  // uneven contiguous split (empty: even)
};

std::vector<UlyssesCase> cases() {
  return {
      {"P4 U2 packed", {"packed", test::shape_of(1, 96, 2, 4, 16, 16), {0, 7, 40, 41, 96}}, 4, 2, false, {}},
      {"P4 U4 rows", {"rows", test::shape_of(2, 40, 4, 4, 16, 16), {}}, 4, 4, false, {}},
      {"P6 U3 uneven GVA", {"uneven", test::shape_of(1, 90, 3, 6, 16, 32), {0, 30, 31, 90}}, 6, 3, false,
       {5, 20, 1, 30, 14, 20}},
      {"P8 U2 zigzag", {"zigzag", test::shape_of(1, 160, 2, 2, 16, 16), {0, 50, 160}}, 8, 2, true, {}},
      {"P4 U1", {"u1", test::shape_of(1, 64, 2, 2, 16, 16), {0, 64}}, 4, 1, false, {}},
  };
}

Layout layout_of(const UlyssesCase& u) {
  if (u.zigzag) return Layout::zigzag(u.c.shape.tokens, u.ranks);
  return Layout::contiguous(u.c.shape.tokens, u.ranks, u.counts);
}

template <class T>
void check_against_state_cp(Algorithm algorithm, const std::string& method) {
  for (const UlyssesCase& u : cases()) {
    SCOPED_TRACE(u.name + " " + algorithm_name(algorithm) + " " + method);
    const Problem<double> pd = test::make_problem(u.c, 301 + u.ranks);
    const Problem<T> p = pd.template cast<T>();
    const Layout layout = layout_of(u);
    // Rank 0 holds the job's dht, the others zero: ht's gradient is the
    // job's dht exactly, on both sides.
    std::vector<std::vector<T>> dht(u.ranks, std::vector<T>(u.c.states(), T(0)));
    dht[0] = p.dht;
    const CpRun<T> got = run_ulysses(p, dht, u.ranks, u.width, layout, method, algorithm);
    const std::size_t groups = u.ranks / u.width;
    std::vector<std::vector<T>> group_dht(groups, std::vector<T>(u.c.states(), T(0)));
    group_dht[0] = p.dht;
    test::RunExec exec;
    exec.algorithm = algorithm;
    const RowConfig row{{method, 1, 0}, true, 0};
    const CpRun<T> want =
        test::run_layer(p, group_dht, groups, {}, row, ulysses_group_layout(layout, u.width), exec);
    EXPECT_TRUE(same_bits(got.r, want.r)) << "not the bits of the state-CP layer over the group layout";
    for (std::size_t r = 1; r < u.ranks; ++r) {
      EXPECT_TRUE(same_bits(got.ht[r], got.ht[0])) << "ht on rank " << r;
      EXPECT_TRUE(same_bits(got.dh0[r], got.dh0[0])) << "dh0 on rank " << r;
    }
    if constexpr (std::is_same_v<T, float>) {
      Problem<double> ref = pd;
      ref.dht = std::vector<double>(p.dht.begin(), p.dht.end());
      const test::Result<double> one = test::reference(ref);
      EXPECT_LE(rel_error(got.r.o, one.o), kTolerance<T>) << "o";
      EXPECT_LE(rel_error(got.r.ht, one.ht), kTolerance<T>) << "ht";
      EXPECT_LE(rel_error(got.r.dq, one.dq), kTolerance<T>) << "dq";
      EXPECT_LE(rel_error(got.r.dk, one.dk), kTolerance<T>) << "dk";
      EXPECT_LE(rel_error(got.r.dv, one.dv), kTolerance<T>) << "dv";
      EXPECT_LE(rel_error(got.r.dg, one.dg), kTolerance<T>) << "dg";
      EXPECT_LE(rel_error(got.r.dbeta, one.dbeta), kTolerance<T>) << "dbeta";
      EXPECT_LE(rel_error(got.r.dh0, one.dh0), kTolerance<T>) << "dh0";
    }
  }
}

TEST(Ulysses, ChunkFloatIsTheStateCpLayerOverTheGroupLayout) { check_against_state_cp<float>(Algorithm::chunk, "p2p"); }
TEST(Ulysses, RecurrentDoubleIsTheStateCpLayerOverTheGroupLayout) {
  check_against_state_cp<double>(Algorithm::recurrent, "allgather");
}

// x's values rounded to `type` (what a 16-bit tensor widened holds).
std::vector<float> as_half(const std::vector<float>& x, Half type) {
  std::vector<std::uint16_t> bits(x.size());
  (void)narrow(type, x.data(), x.size(), bits.data());
  std::vector<float> out(x.size());
  widen(type, bits.data(), bits.size(), out.data());
  return out;
}
std::vector<float> as_half(const std::vector<float>& x, const std::optional<Half>& type) {
  return type ? as_half(x, *type) : x;
}

// 16-bit wire types: inputs stored in them (q, k, v bfloat16, g float32, β
// float16; d_o as o as v), the results narrowed to the inputs' types are
// the bits of float32 on the wire, and ht, dh0 (float32) the same bits.
TEST(Ulysses, SixteenBitWireIsTheBitsOfFloatOnTheWireNarrowed) {
  const WireIn wire{Half::bf16, Half::bf16, Half::bf16, std::nullopt, Half::f16};
  for (const UlyssesCase& u : cases()) {
    if (u.width == 1) continue;
    SCOPED_TRACE(u.name);
    Problem<float> p = test::make_problem(u.c, 17 + u.ranks).cast<float>();
    p.q = as_half(p.q, wire[0]), p.k = as_half(p.k, wire[1]), p.v = as_half(p.v, wire[2]);
    p.g = as_half(p.g, wire[3]), p.beta = as_half(p.beta, wire[4]), p.d_o = as_half(p.d_o, Half::bf16);
    std::vector<std::vector<float>> dht(u.ranks, std::vector<float>(u.c.states(), 0.0f));
    dht[0] = p.dht;
    const Layout layout = layout_of(u);
    const CpRun<float> plain = run_ulysses(p, dht, u.ranks, u.width, layout, "p2p", Algorithm::chunk);
    const CpRun<float> half =
        run_ulysses(p, dht, u.ranks, u.width, layout, "p2p", Algorithm::chunk, false, wire, Half::bf16);
    EXPECT_TRUE(same_bits(as_half(half.r.o, Half::bf16), as_half(plain.r.o, Half::bf16))) << "o";
    EXPECT_TRUE(same_bits(as_half(half.r.dq, wire[0]), as_half(plain.r.dq, wire[0]))) << "dq";
    EXPECT_TRUE(same_bits(as_half(half.r.dk, wire[1]), as_half(plain.r.dk, wire[1]))) << "dk";
    EXPECT_TRUE(same_bits(as_half(half.r.dv, wire[2]), as_half(plain.r.dv, wire[2]))) << "dv";
    EXPECT_TRUE(same_bits(half.r.dg, plain.r.dg)) << "dg (float32 on the wire)";
    EXPECT_TRUE(same_bits(as_half(half.r.dbeta, wire[4]), as_half(plain.r.dbeta, wire[4]))) << "dbeta";
    EXPECT_TRUE(same_bits(half.r.ht, plain.r.ht)) << "ht";
    EXPECT_TRUE(same_bits(half.r.dh0, plain.r.dh0)) << "dh0";
    // The wire rounds: o as it arrives is already bfloat16.
    EXPECT_TRUE(same_bits(half.r.o, as_half(half.r.o, Half::bf16))) << "o is not bfloat16 values";
  }
}

// Every tensor 16-bit on the wire: a forward's all-to-alls send half the
// bytes of float32's, counted by the head group's communicator.
TEST(Ulysses, SixteenBitWireHalvesTheAllToAllBytes) {
  const Case c{"bytes", test::shape_of(1, 64, 2, 2, 16, 16), {0, 64}};
  const Problem<float> p = test::make_problem(c, 5).cast<float>();
  const Layout layout = Layout::contiguous(64, 4);
  std::vector<std::size_t> sent[2];
  for (int half = 0; half < 2; ++half) {
    sent[half].assign(4, 0);
    run_in_process(4, [&](const std::shared_ptr<Communicator>& comm) {
      const DeviceMesh mesh = DeviceMesh::create(comm, {4}, {"cp"});
      UlyssesLayer<float> layer(mesh, 2, "p2p", layout);
      if (half) layer.wire_types({Half::bf16, Half::bf16, Half::bf16, Half::bf16, Half::bf16}, Half::bf16);
      test::RankData<float> d(p, layout, comm->rank());
      const Stream stream{test::stream_sequences(c), layout};
      const std::size_t before = layer.head_group().stats().bytes_sent;
      (void)layer.forward(d.inputs(), stream, {}, d.o.data(), {});
      sent[half][comm->rank()] = layer.head_group().stats().bytes_sent - before;
    });
  }
  for (std::size_t r = 0; r < 4; ++r) {
    EXPECT_GT(sent[0][r], 0u);
    EXPECT_EQ(sent[1][r] * 2, sent[0][r]) << "rank " << r;
  }
  // float64 has no 16-bit wire.
  run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
    const DeviceMesh mesh = DeviceMesh::create(comm, {2}, {"cp"});
    UlyssesLayer<double> layer(mesh, 2, "p2p", Layout::contiguous(64, 2));
    EXPECT_THROW(layer.wire_types({Half::bf16, {}, {}, {}, {}}, {}), InvalidArgument);
  });
}

TEST(Ulysses, DhtFromEveryRankIsSummed) {
  const UlyssesCase u = cases()[0];
  Problem<double> p = test::make_problem(u.c, 77);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> dist(-1, 1);
  std::vector<std::vector<double>> dht(u.ranks, std::vector<double>(u.c.states()));
  std::vector<double> sum(u.c.states(), 0.0);
  for (auto& d : dht)
    for (std::size_t i = 0; i < d.size(); ++i) sum[i] += d[i] = dist(rng);
  const CpRun<double> got = run_ulysses(p, dht, u.ranks, u.width, layout_of(u), "auto", Algorithm::chunk);
  p.dht = sum;
  const test::Result<double> one = test::reference(p);
  for (const auto& [name, a, b] : {std::tuple{"dq", &got.r.dq, &one.dq}, std::tuple{"dg", &got.r.dg, &one.dg},
                                   std::tuple{"dh0", &got.r.dh0, &one.dh0}}) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < b->size(); ++i) num += ((*a)[i] - (*b)[i]) * ((*a)[i] - (*b)[i]), den += (*b)[i] * (*b)[i];
    EXPECT_LE(std::sqrt(num / den), 1e-10) << name;
  }
}

// The deterministic mode (docs/determinism.md) runs in the state-CP layer:
// with Ulysses too every output is the one-process bytes.
TEST(Ulysses, DeterministicIsTheOneProcessBytes) {
  for (const UlyssesCase& u : cases()) {
    SCOPED_TRACE(u.name);
    const Problem<float> p = test::make_problem(u.c, 501).cast<float>();
    kda::Exec exec;
    exec.algorithm = Algorithm::recurrent;
    const test::Result<float> one = test::single_rank_path(p, exec);
    std::vector<std::vector<float>> dht(u.ranks, std::vector<float>(u.c.states(), 0.0f));
    dht[u.ranks - 1] = p.dht;  // one rank's dht: the sum is that dht, bit for bit
    const CpRun<float> got =
        run_ulysses(p, dht, u.ranks, u.width, layout_of(u), "p2p", Algorithm::recurrent, true);
    EXPECT_TRUE(same_bits(got.r, one));
  }
}

TEST(Ulysses, GroupLayoutMergesEachHeadGroupsAdjacentParts) {
  EXPECT_EQ(ulysses_group_layout(Layout::contiguous(12, 4), 2).str(), Layout::contiguous(12, 2).str());
  // Zigzag over 4 ranks, groups of 2: parts 0,1 | 2,3 | 4,5 | 6,7 go to groups 0, 1, 1, 0.
  const Layout z = ulysses_group_layout(Layout::zigzag(16, 4), 2);
  EXPECT_EQ(z.owners().list(), (std::vector<std::size_t>{0, 1, 0}));
  EXPECT_EQ(z.part_lengths(), (std::vector<std::size_t>{4, 8, 4}));
  EXPECT_THROW(ulysses_group_layout(Layout::contiguous(12, 4), 3), InvalidArgument);
  EXPECT_THROW(ulysses_group_layout(Layout::contiguous(12, 4), 0), InvalidArgument);
  ExchangeOptions o;
  o.expected_shape = SummaryShape{1, 4, 16, 16};
  o.expected_cuts = {false, true, false, false, false, false, true, false};
  const ExchangeOptions g = ulysses_exchange_options(o, Layout::zigzag(16, 4), 2);
  EXPECT_EQ(g.expected_shape->heads, 2u);
  EXPECT_EQ(g.expected_cuts, (std::vector<bool>{true, false, true}));
  o.expected_cuts.pop_back();
  EXPECT_THROW(ulysses_exchange_options(o, Layout::zigzag(16, 4), 2), InvalidArgument);
  o.expected_cuts.clear();
  EXPECT_THROW(ulysses_exchange_options(o, Layout::zigzag(16, 4), 3), InvalidArgument);
}

// Every rank throws InvalidArgument (and no rank hangs): rank `bad` with a
// message containing `want`, the others with one containing `elsewhere`.
void expect_every_rank_throws(std::size_t ranks, const std::function<void(std::size_t, const DeviceMesh&)>& fn,
                              std::size_t bad, const std::string& want, const std::string& elsewhere) {
  std::atomic<std::size_t> thrown{0};
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    const DeviceMesh mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
    try {
      fn(comm->rank(), mesh);
    } catch (const InvalidArgument& e) {
      ++thrown;
      const std::string& expected = comm->rank() == bad ? want : elsewhere;
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  });
  EXPECT_EQ(thrown.load(), ranks);
}

TEST(Ulysses, BadArgumentsOnOneRankThrowOnEveryRankBeforeAnyMessage) {
  const Case c{"bad", test::shape_of(1, 32, 2, 2, 16, 16), {0, 32}};
  const Problem<double> p = test::make_problem(c, 9);
  const Layout layout = Layout::contiguous(32, 4);
  // A width that does not divide P, on every rank; then on rank 2 only.
  expect_every_rank_throws(
      4, [&](std::size_t, const DeviceMesh& mesh) { UlyssesLayer<double>(mesh, 3, "p2p", layout); }, 0,
      "expected a divisor (>= 1) of the P = 4 ranks", "expected a divisor (>= 1) of the P = 4 ranks");
  expect_every_rank_throws(
      4, [&](std::size_t r, const DeviceMesh& mesh) { UlyssesLayer<double>(mesh, r == 2 ? 4 : 2, "p2p", layout); },
      2, "ulysses width: ranks 0,1,3 have 2, rank 2 has 4", "ulysses width: ranks 0,1,3 have 2, rank 2 has 4");
  // Per call: heads the width does not divide (rank 1's shape), d_incoming.
  auto call = [&](bool spoil_heads, bool d_incoming) {
    return [&, spoil_heads, d_incoming](std::size_t r, const DeviceMesh& mesh) {
      UlyssesLayer<double> layer(mesh, 2, "p2p", layout);
      Shape ls = c.shape;
      ls.tokens = 8;
      if (spoil_heads && r == 1) ls.heads = ls.value_heads = 3;
      std::vector<double> o(8 * 3 * 16), grads(8 * 3 * 16 * 5);
      const Inputs<double> in{p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), ls, p.scale};
      const Stream stream{test::stream_sequences(c), layout};
      const UlyssesSaved<double> saved = layer.forward(in, stream, {}, o.data(), {});
      double* g = grads.data();
      layer.backward(in, saved, {}, o.data(), {}, Grads<double>{g, g, g, g, g, d_incoming && r == 3 ? g : nullptr},
                     {});
    };
  };
  expect_every_rank_throws(4, call(true, false), 1,
                           "kda::UlyssesLayer::forward on rank 1: H = 3 and HV = 3 heads, expected multiples of the "
                           "Ulysses width U = 2",
                           "rank 1 rejected its own arguments");
  // Deterministic chunk: the head groups' layout cuts the sequence at token
  // 16, off the 64-token grid: the state-CP layer's check, before any message.
  expect_every_rank_throws(
      4,
      [&](std::size_t r, const DeviceMesh& mesh) {
        kda::Exec exec;
        exec.algorithm = Algorithm::chunk;
        UlyssesLayer<double> layer(mesh, 2, "p2p", layout, 1, {}, exec);
        layer.state_layer().deterministic(true);
        Shape ls = c.shape;
        ls.tokens = 8;
        std::vector<double> o(8 * 2 * 16);
        const std::size_t at = r * 8;
        const Inputs<double> in{p.q.data() + at * 32, p.k.data() + at * 32, p.v.data() + at * 32,
                                p.g.data() + at * 32, p.beta.data() + at * 2, ls, p.scale};
        layer.forward(in, Stream{test::stream_sequences(c), layout}, {}, o.data(), {});
      },
      0, "the part [16, 32) on rank 1 starts 16 tokens into its sequence",
      "the part [16, 32) on rank 1 starts 16 tokens into its sequence");
  expect_every_rank_throws(4, call(false, true), 3,
                           "kda::UlyssesLayer::backward on rank 3: grads.d_incoming is set, expected null",
                           "rank 3 rejected its own arguments");
}

// A training loop's steady state: once no UlyssesSaved holds the kept
// inputs, the next forward writes into the same buffer (no fresh pages);
// while one does, it gets another.
TEST(Ulysses, KeptInputsAreReusedOnceReleased) {
  const Case c{"reuse", test::shape_of(1, 32, 2, 2, 16, 16), {0, 32}};
  const Problem<double> p = test::make_problem(c, 12);
  const Layout layout = Layout::contiguous(32, 2);
  run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
    const DeviceMesh mesh = DeviceMesh::create(comm, {2}, {"cp"});
    UlyssesLayer<double> layer(mesh, 2, "p2p", layout);
    test::RankData<double> d(p, layout, comm->rank());
    const Stream stream{test::stream_sequences(c), layout};
    std::optional<UlyssesSaved<double>> first(layer.forward(d.inputs(), stream, {}, d.o.data(), {}));
    const std::vector<double>* buffer = first->inputs.get();
    const std::vector<double> o1 = d.o;
    const UlyssesSaved<double> second = layer.forward(d.inputs(), stream, {}, d.o.data(), {});
    EXPECT_NE(second.inputs.get(), buffer);  // the first still holds it
    EXPECT_EQ(d.o, o1);
    first.reset();
    const UlyssesSaved<double> third = layer.forward(d.inputs(), stream, {}, d.o.data(), {});
    EXPECT_EQ(third.inputs.get(), buffer);
    EXPECT_EQ(d.o, o1);
  });
}

TEST(Ulysses, NonFiniteResultsAreNamed) {
  const Case c{"inf", test::shape_of(1, 32, 2, 2, 16, 16), {0, 32}};
  Problem<double> p = test::make_problem(c, 10);
  const Layout layout = Layout::contiguous(32, 4);
  p.v[5] = std::numeric_limits<double>::infinity();  // token 0: rank 0's
  std::atomic<std::size_t> thrown{0};
  run_in_process(4, [&](const std::shared_ptr<Communicator>& comm) {
    const DeviceMesh mesh = DeviceMesh::create(comm, {4}, {"cp"});
    UlyssesLayer<double> layer(mesh, 2, "p2p", layout);
    Shape ls = c.shape;
    ls.tokens = 8;
    const std::size_t at = comm->rank() * 8;
    const Inputs<double> in{p.q.data() + at * 32, p.k.data() + at * 32, p.v.data() + at * 32,
                            p.g.data() + at * 32, p.beta.data() + at * 2, ls, p.scale};
    std::vector<double> o(8 * 32);
    try {
      layer.forward(in, Stream{test::stream_sequences(c), layout}, {}, o.data(), {});
    } catch (const NumericalError& e) {
      ++thrown;
      EXPECT_NE(std::string(e.what()).find("kda::UlyssesLayer::forward on rank"), std::string::npos) << e.what();
      if (comm->rank() == 0) {
        EXPECT_NE(std::string(e.what()).find("the input v[0,0,0,5] is already inf"), std::string::npos)
            << e.what();
      }
    }
  });
  // Head 0's state carries the Inf through every token after it: every
  // rank's o holds a non-finite value.
  EXPECT_EQ(thrown.load(), 4u);
}

}  // namespace
}  // namespace kdacp::kda

namespace kdacp::job {
namespace {

// --ulysses auto: the cost model's U, as `kdacp plan --tokens-per-rank`
// prints it (K = V = 128, H = 8, P = 8, default parameters: T/P = 32 -> U = 4,
// 1.66x; T/P = 4096 -> U = 1; with two documents' cut -> U = 2), and the run
// with it is the run with that U.
TEST(UlyssesAuto, ChoosesThePlansWidthAndRunsIt) {
  const kda::Shape small{1, 256, 8, 8, 128, 128}, large{1, 8 * 4096, 8, 8, 128, 128};
  auto options = [](const kda::Shape& s, const kda::Layout& layout) {
    return layer_exchange_options({}, s, DType::f32, layout, kda::Sequences(s.batch, s.tokens));
  };
  const kda::Layout l8 = kda::Layout::contiguous(256, 8), big = kda::Layout::contiguous(large.tokens, 8);
  EXPECT_EQ(choose_ulysses(small, l8, options(small, l8), 4), 4u);
  EXPECT_EQ(choose_ulysses(large, big, options(large, big), 4), 1u);
  EXPECT_EQ(resolve_ulysses(kUlyssesAuto, "auto", small, l8, options(small, l8), 4), 4u);
  EXPECT_EQ(resolve_ulysses(2, "p2p", small, l8, options(small, l8), 4), 2u);
  EXPECT_THROW(resolve_ulysses(kUlyssesAuto, "p2p", small, l8, options(small, l8), 4), InvalidArgument);

  const LayerJob<float> job = [&] {
    LayerJob<float> j = report::synthetic_layer_job(small, {0, 100, 256}, 3);
    j.d_o.assign(small.v_elems(), 0.5f);
    return j;
  }();
  // The packing's cuts shorten the plain chain: the pick weighs them (U = 2 here).
  const std::size_t want = choose_ulysses(small, l8, layer_exchange_options({}, small, DType::f32, l8, job.sequences()), 4);
  EXPECT_EQ(want, 2u);
  LayerRunOptions opts;
  opts.ulysses = kUlyssesAuto;
  const LayerOutputs<float> chosen = run_context_parallel(job, 8, opts, 60);
  EXPECT_EQ(chosen.ulysses, want);
  opts.ulysses = want;
  const LayerOutputs<float> named = run_context_parallel(job, 8, opts, 60);
  EXPECT_TRUE(same_bits(chosen, named));
  opts.method = "p2p";
  opts.ulysses = kUlyssesAuto;
  EXPECT_THROW(run_context_parallel(job, 8, opts, 60), InvalidArgument);
}

// `kdacp bench layer --ulysses U`: the Ulysses runs after plain state CP's,
// in the same run, every algorithm within its tolerance, the width recorded;
// their memory counted; a width that does not divide H refused before any run.
TEST(UlyssesBench, RunsBesidePlainStateCp) {
  report::LayerBenchConfig c;
  c.shape = kda::Shape{1, 128, 4, 4, 16, 16};
  c.single = false;
  c.ranks = 4;
  c.repeats = 1;
  c.peak_seconds = 0.01;
  const double plain_bytes = report::layer_bench_bytes(c);
  c.ulysses = 2;
  EXPECT_GT(report::layer_bench_bytes(c), plain_bytes);
  const report::LayerBenchResult res = report::bench_layer(c);
  ASSERT_EQ(res.records.size(), 4u);  // cp recurrent, cp chunk, ulysses recurrent, ulysses chunk
  for (std::size_t i = 0; i < 4; ++i) {
    const report::LayerBenchRecord& r = res.records[i];
    EXPECT_EQ(r.mode, i < 2 ? "cp" : "cp ulysses");
    EXPECT_EQ(r.ulysses, i < 2 ? 1u : 2u);
    EXPECT_EQ(r.ranks, 4u);
    EXPECT_GT(r.forward_seconds, 0);
    EXPECT_LE(r.max_rel_error, r.tolerance) << r.mode;
  }
  EXPECT_EQ(report::layer_run_label("cp ulysses", 2), "Ulysses U=2 x CP");
  c.ulysses = 3;
  EXPECT_THROW(report::bench_layer(c), InvalidArgument);
  c.ulysses = kUlyssesAuto;  // needs method auto
  EXPECT_THROW(report::bench_layer(c), InvalidArgument);
  c.method = "auto";
  const report::LayerBenchResult picked = report::bench_layer(c);
  ASSERT_EQ(picked.records.size(), 4u);
  EXPECT_EQ(picked.records[2].ulysses, choose_ulysses(c.shape, kda::Layout::contiguous(128, 4),
                                                      layer_exchange_options(c.exchange, c.shape, DType::f32,
                                                                             kda::Layout::contiguous(128, 4),
                                                                             kda::Sequences(1, 128)),
                                                      sizeof(float)));
}

}  // namespace
}  // namespace kdacp::job
