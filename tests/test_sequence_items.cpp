// The packed-sequence path runs every (piece, batch row, value head) of a
// call as one work item on strided views (src/kda/sequences.cpp): each
// piece's results must be the bits of kda::forward / backward /
// chunk_summary / incoming_grad called on a copy of that piece's tokens,
// whatever the pool size, for both algorithms, grouped value heads, B > 1,
// parts in the middle of a rank's local tensors and the forward cache. And
// `kdacp bench layer --docs N` runs the layer over such a packing.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kda/parts.hpp"
#include "kda/sequences.hpp"
#include "kda_sequence_reference.hpp"
#include "kdacp/error.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/report/layer_bench.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::kda {
namespace {

using test::Case;
using test::Problem;
using test::Result;
using test::Seq;
using test::make_problem;
using test::sequences_of;
using test::shape_of;

// Tokens [lo, hi) of every row of a [B,T,inner] tensor, as [B,hi-lo,inner].
std::vector<float> rows_slice(const std::vector<float>& x, const Shape& s, std::size_t inner,
                              std::size_t lo, std::size_t hi) {
  std::vector<float> out;
  for (std::size_t b = 0; b < s.batch; ++b)
    out.insert(out.end(), x.begin() + static_cast<std::ptrdiff_t>((b * s.tokens + lo) * inner),
               x.begin() + static_cast<std::ptrdiff_t>((b * s.tokens + hi) * inner));
  return out;
}

// The inverse: writes [B,hi-lo,inner] into tokens [lo, hi) of `x`.
void rows_put(const std::vector<float>& part, const Shape& s, std::size_t inner, std::size_t lo,
              std::size_t hi, std::vector<float>& x) {
  for (std::size_t b = 0; b < s.batch; ++b)
    std::copy_n(part.begin() + static_cast<std::ptrdiff_t>(b * (hi - lo) * inner), (hi - lo) * inner,
                x.begin() + static_cast<std::ptrdiff_t>((b * s.tokens + lo) * inner));
}

// Tokens [lo, hi) of the problem's tensors (all rows), owned.
struct Slice {
  Shape shape;
  std::vector<float> q, k, v, g, beta, d_o;
  float scale = 0;

  Slice(const Problem<float>& p, std::size_t lo, std::size_t hi) : shape(p.c.shape) {
    const Shape& s = p.c.shape;
    shape.tokens = hi - lo;
    q = rows_slice(p.q, s, s.heads * s.key_dim, lo, hi);
    k = rows_slice(p.k, s, s.heads * s.key_dim, lo, hi);
    v = rows_slice(p.v, s, s.value_heads * s.value_dim, lo, hi);
    g = rows_slice(p.g, s, s.value_heads * s.key_dim, lo, hi);
    beta = rows_slice(p.beta, s, s.value_heads, lo, hi);
    d_o = rows_slice(p.d_o, s, s.value_heads * s.value_dim, lo, hi);
    scale = p.scale;
  }
  Inputs<float> inputs() const {
    return {q.data(), k.data(), v.data(), g.data(), beta.data(), shape, scale};
  }
};

// Gradients of one slice, owned.
struct SliceGrads {
  std::vector<float> dq, dk, dv, dg, dbeta, d_incoming;
  explicit SliceGrads(const Shape& s)
      : dq(s.qk_elems()), dk(s.qk_elems()), dv(s.v_elems()), dg(s.g_elems()),
        dbeta(s.beta_elems()), d_incoming(s.state_elems()) {}
  Grads<float> grads() {
    return {dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), d_incoming.data()};
  }
};

std::vector<float> state_row(const std::vector<float>& states, const Shape& s, std::size_t n) {
  const std::size_t e = s.state_elems();
  return {states.begin() + static_cast<std::ptrdiff_t>(n * e),
          states.begin() + static_cast<std::ptrdiff_t>((n + 1) * e)};
}

// Every sequence run alone by kda::forward / backward on a copy of its
// tokens, from its h0 row with d_final = its dht row: what the stream's
// results must equal bit for bit.
Result<float> one_call_per_sequence(const Problem<float>& p, const kda::Exec& exec) {
  const Shape& s = p.c.shape;
  Result<float> r(p.c);
  Shape row = s;
  if (!p.c.cu.empty()) row.batch = 1;
  // Without cu_seqlens every row is a sequence over all tokens: one call
  // over all rows is each row's call.
  const std::vector<Seq> seqs = p.c.cu.empty() ? std::vector<Seq>{{0, 0, s.tokens, 0}} : sequences_of(p.c);
  for (const Seq& seq : seqs) {
    const Slice in(p, seq.begin, seq.end);
    const std::vector<float> h0 = state_row(p.h0, row, seq.n), dht = state_row(p.dht, row, seq.n);
    std::vector<float> o(in.shape.v_elems()), ht(in.shape.state_elems());
    forward(in.inputs(), h0.data(), o.data(), ht.data(), exec);
    SliceGrads g(in.shape);
    backward(in.inputs(), h0.data(), in.d_o.data(), dht.data(), g.grads(), exec);
    rows_put(o, s, s.value_heads * s.value_dim, seq.begin, seq.end, r.o);
    rows_put(g.dq, s, s.heads * s.key_dim, seq.begin, seq.end, r.dq);
    rows_put(g.dk, s, s.heads * s.key_dim, seq.begin, seq.end, r.dk);
    rows_put(g.dv, s, s.value_heads * s.value_dim, seq.begin, seq.end, r.dv);
    rows_put(g.dg, s, s.value_heads * s.key_dim, seq.begin, seq.end, r.dg);
    rows_put(g.dbeta, s, s.value_heads, seq.begin, seq.end, r.dbeta);
    std::copy(ht.begin(), ht.end(), r.ht.begin() + static_cast<std::ptrdiff_t>(seq.n * ht.size()));
    std::copy(g.d_incoming.begin(), g.d_incoming.end(),
              r.dh0.begin() + static_cast<std::ptrdiff_t>(seq.n * ht.size()));
  }
  return r;
}

void expect_same(const Result<float>& got, const Result<float>& want, const std::string& what) {
  EXPECT_TRUE(got.o == want.o) << what << ": o";
  EXPECT_TRUE(got.ht == want.ht) << what << ": ht";
  EXPECT_TRUE(got.dq == want.dq) << what << ": dq";
  EXPECT_TRUE(got.dk == want.dk) << what << ": dk";
  EXPECT_TRUE(got.dv == want.dv) << what << ": dv";
  EXPECT_TRUE(got.dg == want.dg) << what << ": dg";
  EXPECT_TRUE(got.dbeta == want.dbeta) << what << ": dbeta";
  EXPECT_TRUE(got.dh0 == want.dh0) << what << ": dh0";
}

// Sequences of 1 token, of several chunks (C = 64) and between; grouped
// value heads (HV = 3H: their dq/dk sums have an order); and B = 2 rows
// without cu_seqlens.
const Case kPacked{"packed", shape_of(1, 200, 1, 3, 16, 16), {0, 1, 70, 71, 150, 155, 199, 200}};
const Case kRows{"rows", shape_of(2, 100, 1, 2, 16, 32), {}};

TEST(SequenceItems, EachSequenceIsOneKernelCallBitForBit) {
  for (const Case* c : {&kPacked, &kRows}) {
    const Problem<float> p = make_problem(*c, 7).cast<float>();
    const Sequences seqs = c->sequences();
    for (Algorithm algorithm : {Algorithm::recurrent, Algorithm::chunk}) {
      const Result<float> want =
          one_call_per_sequence(p, kda::Exec{{nullptr, KernelKind::best}, algorithm});
      for (std::size_t threads : {0, 1, 3, 8}) {
        for (bool cached : {false, true}) {
          std::unique_ptr<ThreadPool> pool = threads ? std::make_unique<ThreadPool>(threads) : nullptr;
          const kda::Exec exec{{pool.get(), KernelKind::best}, algorithm};
          ForwardCache<float> cache;
          Result<float> r(*c);
          forward_sequences(p.inputs(), seqs, p.states(p.h0), r.o.data(),
                            sequence_states(r.ht.data(), seqs, c->shape), exec,
                            cached ? &cache : nullptr);
          // One record per piece, in piece order, with the chunk algorithm.
          if (cached) {
            const std::size_t pieces = c->cu.empty() ? 1 : seqs.count();
            EXPECT_EQ(cache.records(), algorithm == Algorithm::chunk ? pieces : 0u);
          }
          backward_sequences(p.inputs(), seqs, p.states(p.h0), p.d_o.data(), p.states(p.dht),
                             Grads<float>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(),
                                          r.dbeta.data()},
                             sequence_states(r.dh0.data(), seqs, c->shape), exec,
                             kDefaultCheckpointInterval, cached ? &cache : nullptr);
          expect_same(r, want,
                      fmt::format("{} {} {} threads{}", c->name, algorithm_name(algorithm), threads,
                                  cached ? " cached" : ""));
        }
      }
    }
  }
}

// The part_* calls on a part in the middle of a rank's local tensors, with
// B = 2 (the rows interleave the part's tokens with others) and with a
// packed stream whose part continues one sequence, ends it and starts the
// next: each call's results are those of the kda:: call on the piece's
// tokens.
TEST(SequenceItems, PartsAreKernelCallsOnTheirPieces) {
  for (Algorithm algorithm : {Algorithm::recurrent, Algorithm::chunk}) {
    ThreadPool pool(3);
    const kda::Exec exec{{&pool, KernelKind::best}, algorithm};
    const kda::Exec alone{{nullptr, KernelKind::best}, algorithm};
    const std::string what = algorithm_name(algorithm);

    // No sequence boundary inside the part: one piece.
    {
      const Case c{"rows", shape_of(2, 160, 1, 2, 16, 16), {}};
      const Problem<float> p = make_problem(c, 11).cast<float>();
      const Shape& s = c.shape;
      const Sequences seqs = c.sequences();
      const Part part{20, 150, 20};
      const Slice in(p, part.begin, part.end);
      const std::vector<float> incoming = state_row(p.h0, s, 0), d_end = state_row(p.dht, s, 0);

      std::vector<float> state(s.state_elems()), transfer(s.transfer_elems());
      std::vector<float> want_state(state.size()), want_transfer(transfer.size());
      part_summary(p.inputs(), seqs, part, {}, state.data(), transfer.data(), exec);
      chunk_summary(in.inputs(), want_state.data(), want_transfer.data(), alone);
      EXPECT_TRUE(state == want_state && transfer == want_transfer) << what << ": part_summary";

      Result<float> r(c);
      ForwardCache<float> cache;
      part_forward(p.inputs(), seqs, part, incoming.data(), {}, r.o.data(), {}, exec, &cache);
      std::vector<float> want_o(in.shape.v_elems());
      forward(in.inputs(), incoming.data(), want_o.data(), nullptr, alone);
      EXPECT_TRUE(rows_slice(r.o, s, s.value_heads * s.value_dim, part.begin, part.end) == want_o)
          << what << ": part_forward";

      std::vector<float> g(s.state_elems()), want_g(s.state_elems());
      part_incoming_grad(p.inputs(), seqs, part, p.d_o.data(), {}, g.data(), exec);
      incoming_grad(in.inputs(), in.d_o.data(), want_g.data(), alone);
      EXPECT_TRUE(g == want_g) << what << ": part_incoming_grad";

      std::vector<float> d_incoming(s.state_elems());
      part_backward(p.inputs(), seqs, part, incoming.data(), {}, p.d_o.data(), d_end.data(), {},
                    Grads<float>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(),
                                 d_incoming.data()},
                    {}, exec, kDefaultCheckpointInterval, &cache);
      SliceGrads want(in.shape);
      backward(in.inputs(), incoming.data(), in.d_o.data(), d_end.data(), want.grads(), alone);
      EXPECT_TRUE(rows_slice(r.dq, s, s.heads * s.key_dim, part.begin, part.end) == want.dq) << what;
      EXPECT_TRUE(rows_slice(r.dv, s, s.value_heads * s.value_dim, part.begin, part.end) == want.dv) << what;
      EXPECT_TRUE(rows_slice(r.dg, s, s.value_heads * s.key_dim, part.begin, part.end) == want.dg) << what;
      EXPECT_TRUE(rows_slice(r.dbeta, s, s.value_heads, part.begin, part.end) == want.dbeta) << what;
      EXPECT_TRUE(d_incoming == want.d_incoming) << what << ": part_backward d_incoming";
    }

    // Packed: the part [40, 110) continues sequence 1 (to 90) and starts 2.
    {
      const Case c{"packed", shape_of(1, 130, 2, 4, 16, 16), {0, 30, 90, 130}};
      const Problem<float> p = make_problem(c, 12).cast<float>();
      const Shape& s = c.shape;
      const Sequences seqs = c.sequences();
      const Part part{40, 110, 40};
      const Slice first(p, 40, 90), last(p, 90, 110);
      const std::vector<float> incoming = state_row(p.h0, s, 0), d_end = state_row(p.dht, s, 0);
      const std::vector<float> h0_2 = state_row(p.h0, s, 2), dht_1 = state_row(p.dht, s, 1);

      std::vector<float> state(s.state_elems()), want_state(s.state_elems());
      std::vector<float> scratch_o(last.shape.v_elems());
      EXPECT_TRUE(part_summary(p.inputs(), seqs, part, p.states(p.h0), state.data(), nullptr, exec).cut);
      forward(last.inputs(), h0_2.data(), scratch_o.data(), want_state.data(), alone);
      EXPECT_TRUE(state == want_state) << what << ": part_summary of a cut";

      Result<float> r(c);
      ForwardCache<float> cache;
      part_forward(p.inputs(), seqs, part, incoming.data(), p.states(p.h0), r.o.data(),
                   sequence_states(r.ht.data(), seqs, s), exec, &cache);
      EXPECT_EQ(cache.records(), algorithm == Algorithm::chunk ? 2u : 0u);
      std::vector<float> o1(first.shape.v_elems()), o2(last.shape.v_elems()), ht1(s.state_elems());
      forward(first.inputs(), incoming.data(), o1.data(), ht1.data(), alone);
      forward(last.inputs(), h0_2.data(), o2.data(), nullptr, alone);
      EXPECT_TRUE(rows_slice(r.o, s, s.value_heads * s.value_dim, 40, 90) == o1) << what;
      EXPECT_TRUE(rows_slice(r.o, s, s.value_heads * s.value_dim, 90, 110) == o2) << what;
      EXPECT_TRUE(state_row(r.ht, s, 1) == ht1) << what << ": ht of the sequence ending in the part";

      std::vector<float> g(s.state_elems());
      part_incoming_grad(p.inputs(), seqs, part, p.d_o.data(), p.states(p.dht), g.data(), exec);
      SliceGrads via(first.shape);
      backward(first.inputs(), nullptr, first.d_o.data(), dht_1.data(), via.grads(), alone);
      EXPECT_TRUE(g == via.d_incoming) << what << ": part_incoming_grad through dht";

      std::vector<float> d_incoming(s.state_elems());
      part_backward(p.inputs(), seqs, part, incoming.data(), p.states(p.h0), p.d_o.data(),
                    d_end.data(), p.states(p.dht),
                    Grads<float>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(),
                                 d_incoming.data()},
                    sequence_states(r.dh0.data(), seqs, s), exec, kDefaultCheckpointInterval, &cache);
      SliceGrads w1(first.shape), w2(last.shape);
      backward(first.inputs(), incoming.data(), first.d_o.data(), dht_1.data(), w1.grads(), alone);
      backward(last.inputs(), h0_2.data(), last.d_o.data(), d_end.data(), w2.grads(), alone);
      EXPECT_TRUE(rows_slice(r.dq, s, s.heads * s.key_dim, 40, 90) == w1.dq) << what;
      EXPECT_TRUE(rows_slice(r.dk, s, s.heads * s.key_dim, 90, 110) == w2.dk) << what;
      EXPECT_TRUE(rows_slice(r.dg, s, s.value_heads * s.key_dim, 90, 110) == w2.dg) << what;
      EXPECT_TRUE(d_incoming == w1.d_incoming) << what << ": part_backward d_incoming";
      EXPECT_TRUE(state_row(r.dh0, s, 2) == w2.d_incoming) << what << ": dh0 of the sequence started";
    }
  }
}

// `kdacp bench layer --docs N`: the layer over N packed documents on one
// rank and in CP, every algorithm within its tolerance of the first.
TEST(LayerBench, DocsPackTheStream) {
  report::LayerBenchConfig c;
  c.shape = Shape{1, 300, 1, 2, 16, 16};
  c.ranks = 3;
  c.repeats = 1;
  c.peak_seconds = 0.01;
  c.docs = 40;
  const report::LayerBenchResult res = report::bench_layer(c);
  ASSERT_EQ(res.records.size(), 4u);
  for (const report::LayerBenchRecord& r : res.records) {
    EXPECT_GT(r.forward_seconds, 0);
    EXPECT_EQ(r.rel_errors.size(), 6u);
    EXPECT_LE(r.max_rel_error, r.tolerance) << r.mode << " " << algorithm_name(r.algorithm);
  }
  EXPECT_TRUE(report::layer_bench_failures(res).empty());
  // The packing's own checks, before anything runs.
  c.docs = 301;
  EXPECT_THROW(report::bench_layer(c), InvalidArgument);
  c.docs = 2;
  c.shape.batch = 2;
  EXPECT_THROW(report::bench_layer(c), InvalidArgument);
}

}  // namespace
}  // namespace kdacp::kda
