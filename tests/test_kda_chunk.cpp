// The chunkwise KDA algorithm (Algorithm::chunk) against the recurrent one
// on the same inputs: forward, final state, chunk summary, G pass (and the
// backward, which the chunk algorithm runs on the recurrent reverse sweep),
// thread-count invariance, and the CP layer with the chunk algorithm.
#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "kda_chunk_data.hpp"

namespace kdacp::kda {
namespace {

TEST(KdaChunk, ForwardSummaryGMatchRecurrentDouble) {
  for (std::size_t t : kTokens) {
    compare_forward<double>(shape_with(t), 0, 1e-10, 1);
    compare_forward<double>(shape_with(t), -5, 1e-10, 2);
  }
}

TEST(KdaChunk, ForwardSummaryGMatchRecurrentFloat) {
  for (std::size_t t : kTokens) {
    compare_forward<float>(shape_with(t), 0, 5e-5, 3);
    compare_forward<float>(shape_with(t), -5, 5e-5, 4);
  }
}

// Other head sizes: K > V, the smallest and a wide one; B = 1, H = 2.
TEST(KdaChunk, ForwardOtherShapes) {
  compare_forward<double>(Shape{1, 77, 2, 2, 64, 16}, -5, 1e-10, 5);
  compare_forward<double>(Shape{1, 40, 1, 1, 16, 16}, 0, 1e-10, 6);
  compare_forward<float>(Shape{1, 70, 1, 3, 16, 128}, -2, 5e-5, 7);
  compare_forward<float>(Shape{1, 70, 1, 1, 256, 16}, -2, 5e-5, 15);
  compare_forward<double>(Shape{1, 70, 1, 1, 16, 256}, -2, 1e-10, 16);
}

// Decay beyond the sub-chunk's safe range (g = -12 per channel and token,
// e^-180 over 15 tokens): the exact diagonal-block fallback, in both types.
TEST(KdaChunk, ExtremeDecayUsesExactBlocks) {
  compare_forward<double>(Shape{1, 2 * kC + 3, 1, 1, 16, 32}, -12, 1e-10, 8);
  compare_forward<float>(Shape{1, 2 * kC + 3, 1, 1, 16, 32}, -12, 5e-5, 9);
  compare_forward<double>(Shape{1, 2 * kC + 3, 1, 1, 16, 32}, -60, 1e-10, 10);
}

template <class T>
void compare_backward(const Shape& s, double g_min, double tol, unsigned seed) {
  const Data<T> d(s, seed, g_min);
  const std::string what = "T=" + std::to_string(s.tokens) + " g_min=" + std::to_string(g_min);
  for (bool with_state : {true, false}) {
    const GradOut<T> want = run_backward(d, Algorithm::recurrent, with_state);
    const GradOut<T> got = run_backward(d, Algorithm::chunk, with_state);
    EXPECT_LE(rel_error(got.dq, want.dq), tol) << what << " dq";
    EXPECT_LE(rel_error(got.dk, want.dk), tol) << what << " dk";
    EXPECT_LE(rel_error(got.dv, want.dv), tol) << what << " dv";
    EXPECT_LE(rel_error(got.dg, want.dg), tol) << what << " dg";
    EXPECT_LE(rel_error(got.dbeta, want.dbeta), tol) << what << " dbeta";
    EXPECT_LE(rel_error(got.dinc, want.dinc), tol) << what << " d_incoming";
  }
}

TEST(KdaChunk, BackwardMatchesRecurrentDouble) {
  for (std::size_t t : kTokens) {
    compare_backward<double>(shape_with(t), 0, 1e-10, 21);
    compare_backward<double>(shape_with(t), -5, 1e-10, 22);
  }
  compare_backward<double>(Shape{1, 77, 2, 2, 64, 16}, -5, 1e-10, 23);
  compare_backward<double>(Shape{1, 70, 1, 1, 256, 16}, -2, 1e-10, 28);
  compare_backward<double>(Shape{1, 2 * kC + 3, 1, 1, 16, 32}, -12, 1e-10, 24);
}

TEST(KdaChunk, BackwardMatchesRecurrentFloat) {
  for (std::size_t t : kTokens) {
    compare_backward<float>(shape_with(t), 0, 5e-5, 25);
    compare_backward<float>(shape_with(t), -5, 5e-5, 26);
  }
  compare_backward<float>(Shape{1, 2 * kC + 3, 1, 1, 16, 32}, -12, 5e-5, 27);
}

// Central differences in double of L = <d_o, o> + <d_final, S_T> on the
// chunk path, for every input and the incoming state; two chunks (the
// second ragged), HV = 2H, B = 2 and strong decay.
TEST(KdaChunk, BackwardFiniteDifferences) {
  const Shape s{2, kC + 6, 1, 2, 16, 16};
  Data<double> d(s, 31, -3);
  const GradOut<double> g = run_backward(d, Algorithm::chunk, true);
  std::vector<double> o(s.v_elems()), fin(s.state_elems());
  auto loss = [&] {
    forward(d.inputs(), d.h0.data(), o.data(), fin.data(), on(Algorithm::chunk));
    double l = 0;
    for (std::size_t i = 0; i < o.size(); ++i) l += d.d_o[i] * o[i];
    for (std::size_t i = 0; i < fin.size(); ++i) l += d.d_final[i] * fin[i];
    return l;
  };
  std::mt19937_64 rng(5);
  EXPECT_LE(test::finite_difference_error(d.q, g.dq, 60, rng, loss), 1e-6) << "dq";
  EXPECT_LE(test::finite_difference_error(d.k, g.dk, 60, rng, loss), 1e-6) << "dk";
  EXPECT_LE(test::finite_difference_error(d.v, g.dv, 60, rng, loss), 1e-6) << "dv";
  EXPECT_LE(test::finite_difference_error(d.g, g.dg, 60, rng, loss), 1e-6) << "dg";
  EXPECT_LE(test::finite_difference_error(d.beta, g.dbeta, 60, rng, loss), 1e-6) << "dbeta";
  EXPECT_LE(test::finite_difference_error(d.h0, g.dinc, 60, rng, loss), 1e-6) << "d_incoming";
}

TEST(KdaChunk, ThreadCountInvariant) {
  const Data<float> df(Shape{2, kC + 9, 2, 4, 16, 32}, 11, -3);
  const Data<double> dd(Shape{2, kC + 9, 2, 4, 16, 32}, 12, -3);
  const Outputs<float> f1 = run_all(df, Algorithm::chunk);
  const Outputs<double> d1 = run_all(dd, Algorithm::chunk);
  const GradOut<float> gf1 = run_backward(df, Algorithm::chunk, true);
  const GradOut<double> gd1 = run_backward(dd, Algorithm::chunk, true);
  for (std::size_t threads : {2u, 3u}) {
    ThreadPool pool(threads);
    const Outputs<float> f = run_all(df, Algorithm::chunk, &pool);
    const Outputs<double> d = run_all(dd, Algorithm::chunk, &pool);
    EXPECT_TRUE(same_bits(f.o, f1.o) && same_bits(f.final_state, f1.final_state) &&
                same_bits(f.s, f1.s) && same_bits(f.m, f1.m) && same_bits(f.g_state, f1.g_state))
        << threads << " threads, float";
    EXPECT_TRUE(same_bits(d.o, d1.o) && same_bits(d.final_state, d1.final_state) &&
                same_bits(d.s, d1.s) && same_bits(d.m, d1.m) && same_bits(d.g_state, d1.g_state))
        << threads << " threads, double";
    EXPECT_TRUE(run_backward(df, Algorithm::chunk, true, &pool) == gf1) << threads << " float";
    EXPECT_TRUE(run_backward(dd, Algorithm::chunk, true, &pool) == gd1) << threads << " double";
  }
}

// Every compiled target the CPU supports gives the same bits as the
// library's choice, for every function and both types (K, V multiples of 16
// as the layer requires; a ragged last chunk; unsafe sub-chunks included).
template <class T>
std::vector<std::vector<T>> run_kernels(const detail::ChunkKernels<T>& kern, const Data<T>& d) {
  const Shape& s = d.shape;
  const Inputs<T> in = d.inputs();
  std::vector<std::vector<T>> r{std::vector<T>(s.v_elems()),       std::vector<T>(s.state_elems()),
                                std::vector<T>(s.state_elems()),   std::vector<T>(s.transfer_elems()),
                                std::vector<T>(s.state_elems()),   std::vector<T>(s.qk_elems()),
                                std::vector<T>(s.qk_elems()),      std::vector<T>(s.v_elems()),
                                std::vector<T>(s.g_elems()),       std::vector<T>(s.beta_elems()),
                                std::vector<T>(s.state_elems())};
  const kda::Exec exec{};
  // The forward's record (ForwardCache) on this target, and the backward from it.
  std::vector<T> record(ForwardCache<T>::record_elems(s, Algorithm::chunk));
  detail::forward_chunked(kern, in, d.h0.data(), r[0].data(), r[1].data(), exec, record.data());
  detail::chunk_summary_chunked(kern, in, r[2].data(), r[3].data(), exec);
  detail::incoming_grad_chunked(kern, in, d.d_o.data(), r[4].data(), exec);
  detail::backward_chunked(kern, in, d.h0.data(), d.d_o.data(), d.d_final.data(),
                           Grads<T>{r[5].data(), r[6].data(), r[7].data(), r[8].data(),
                                    r[9].data(), r[10].data()},
                           exec);
  std::vector<std::vector<T>> kept(6);
  for (std::size_t i = 0; i < 6; ++i) kept[i].resize(r[5 + i].size());
  detail::backward_chunked(kern, in, d.h0.data(), d.d_o.data(), d.d_final.data(),
                           Grads<T>{kept[0].data(), kept[1].data(), kept[2].data(), kept[3].data(),
                                    kept[4].data(), kept[5].data()},
                           exec, record.data());
  for (std::size_t i = 0; i < 6; ++i) EXPECT_TRUE(same_bits(kept[i], r[5 + i])) << "kept record, gradient " << i;
  r.push_back(std::move(record));
  return r;
}

// Every target gives the same bits, on gates that mix factorised and exact
// channels (U(-7, 0)) and on gates where every channel is exact (U(-1e4, 0)).
TEST(KdaChunk, BitwiseEqualAcrossTargets) {
  for (double g_min : {-7.0, -1e4}) {
    const Data<float> df(Shape{1, kC + 21, 1, 2, 32, 16}, 41, g_min);
    const Data<double> dd(Shape{1, kC + 21, 1, 2, 32, 16}, 42, g_min);
    const auto want_f = run_kernels(detail::chosen_chunk_kernels<float>(), df);
    const auto want_d = run_kernels(detail::chosen_chunk_kernels<double>(), dd);
    const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
    EXPECT_FALSE(targets.empty());
    for (int64_t target : targets) {
      hwy::SetSupportedTargetsForTest(target);
      const kdacp::detail::KernelTable table = kdacp::detail::make_kernel_table();
      const auto got_f = run_kernels(table.f32.chunk, df);
      const auto got_d = run_kernels(table.f64.chunk, dd);
      for (std::size_t i = 0; i < want_f.size(); ++i) {
        EXPECT_TRUE(same_bits(got_f[i], want_f[i])) << hwy::TargetName(target) << " float #" << i << " g_min " << g_min;
        EXPECT_TRUE(same_bits(got_d[i], want_d[i])) << hwy::TargetName(target) << " double #" << i << " g_min " << g_min;
      }
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

// Packed sequences with initial and final states (kda/sequences.hpp): the
// Inputs' algorithm reaches every piece; chunk equals recurrent.
TEST(KdaChunk, PackedSequencesMatchRecurrent) {
  const Shape s{1, 3 * kC + 5, 1, 2, 16, 32};
  const Data<double> d(s, 51, -4);
  const std::vector<std::int64_t> cu{0, 50, 50 + kC + 3, static_cast<std::int64_t>(s.tokens)};
  const Sequences seqs(1, s.tokens, cu);
  const std::size_t n_state = seqs.count() * s.value_heads * s.key_dim * s.value_dim;
  std::mt19937_64 rng(52);
  const std::vector<double> h0 = test::uniform(n_state, -1, 1, rng);
  const std::vector<double> dht = test::uniform(n_state, -1, 1, rng);
  struct Run {
    std::vector<double> o, ht, dq, dk, dv, dg, dbeta, dh0;
  };
  auto run = [&](Algorithm a) {
    Run r{std::vector<double>(s.v_elems()),  std::vector<double>(n_state),
          std::vector<double>(s.qk_elems()), std::vector<double>(s.qk_elems()),
          std::vector<double>(s.v_elems()),  std::vector<double>(s.g_elems()),
          std::vector<double>(s.beta_elems()), std::vector<double>(n_state)};
    const Inputs<double> in = d.inputs();
    forward_sequences(in, seqs, sequence_states(h0.data(), seqs, s), r.o.data(),
                      sequence_states(r.ht.data(), seqs, s), on(a));
    backward_sequences(in, seqs, sequence_states(h0.data(), seqs, s), d.d_o.data(),
                       sequence_states(dht.data(), seqs, s),
                       Grads<double>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(),
                                     r.dbeta.data(), nullptr},
                       sequence_states(r.dh0.data(), seqs, s), on(a));
    return r;
  };
  const Run want = run(Algorithm::recurrent), got = run(Algorithm::chunk);
  EXPECT_LE(rel_error(got.o, want.o), 1e-10) << "o";
  EXPECT_LE(rel_error(got.ht, want.ht), 1e-10) << "ht";
  EXPECT_LE(rel_error(got.dq, want.dq), 1e-10) << "dq";
  EXPECT_LE(rel_error(got.dk, want.dk), 1e-10) << "dk";
  EXPECT_LE(rel_error(got.dv, want.dv), 1e-10) << "dv";
  EXPECT_LE(rel_error(got.dg, want.dg), 1e-10) << "dg";
  EXPECT_LE(rel_error(got.dbeta, want.dbeta), 1e-10) << "dbeta";
  EXPECT_LE(rel_error(got.dh0, want.dh0), 1e-10) << "dh0";
}

// Packed streams of few-token documents (1, 2, 3 tokens ... and longer
// ones around the chunk size): the chunk path equals the recurrent one, and
// its shortcuts give no other bits: the forward's record (sized by each
// piece's real tokens, without the first chunk's state) against the
// backward's recomputed one, a reused cache, states given as zeros against
// none (the products on a +0 state are skipped), dh0 wanted or not, one
// thread or three.
template <class T>
struct DocRun {
  std::vector<T> o, ht, dq, dk, dv, dg, dbeta, dh0;
  bool operator==(const DocRun& b) const {
    const auto same = [](const std::vector<T>& x, const std::vector<T>& y) {
      return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0);
    };
    return same(o, b.o) && same(ht, b.ht) && same(dq, b.dq) && same(dk, b.dk) && same(dv, b.dv) &&
           same(dg, b.dg) && same(dbeta, b.dbeta) && same(dh0, b.dh0);
  }
};

template <class T>
void check_few_token_documents(const Data<T>& d, const Sequences& seqs, double tol, ThreadPool* pool,
                               const std::string& what) {
  const Shape& s = d.shape;
  const std::size_t n_state = seqs.count() * s.value_heads * s.key_dim * s.value_dim;
  std::mt19937_64 rng(77);
  const auto cast = [](const std::vector<double>& x) { return std::vector<T>(x.begin(), x.end()); };
  const std::vector<T> h0 = cast(test::uniform(n_state, -1, 1, rng));
  const std::vector<T> dht = cast(test::uniform(n_state, -1, 1, rng));
  const std::vector<T> zeros(n_state, T(0));
  // h0, dht: null or data; dh0 wanted or not; cache: null, or the forward's.
  const auto run = [&](Algorithm a, const T* h0p, const T* dhtp, bool want_dh0, ForwardCache<T>* cache,
                       ThreadPool* threads) {
    DocRun<T> r{std::vector<T>(s.v_elems()),  std::vector<T>(n_state),
                std::vector<T>(s.qk_elems()), std::vector<T>(s.qk_elems()),
                std::vector<T>(s.v_elems()),  std::vector<T>(s.g_elems()),
                std::vector<T>(s.beta_elems()), std::vector<T>(want_dh0 ? n_state : 0)};
    const Inputs<T> in = d.inputs();
    forward_sequences(in, seqs, sequence_states(h0p, seqs, s), r.o.data(),
                      sequence_states(r.ht.data(), seqs, s), on(a, threads), cache);
    backward_sequences(in, seqs, sequence_states(h0p, seqs, s), d.d_o.data(),
                       sequence_states(dhtp, seqs, s),
                       Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), nullptr},
                       sequence_states(want_dh0 ? r.dh0.data() : static_cast<T*>(nullptr), seqs, s),
                       on(a, threads), kDefaultCheckpointInterval, cache);
    return r;
  };
  for (const bool with_h0 : {true, false})
    for (const bool with_dht : {true, false}) {
      const std::string w = what + (with_h0 ? " h0" : " no h0") + (with_dht ? " dht" : " no dht");
      const T* h0p = with_h0 ? h0.data() : nullptr;
      const T* dhtp = with_dht ? dht.data() : nullptr;
      const DocRun<T> want = run(Algorithm::recurrent, h0p, dhtp, true, nullptr, nullptr);
      const DocRun<T> got = run(Algorithm::chunk, h0p, dhtp, true, nullptr, pool);
      EXPECT_LE(rel_error(got.o, want.o), tol) << w << " o";
      EXPECT_LE(rel_error(got.ht, want.ht), tol) << w << " ht";
      EXPECT_LE(rel_error(got.dq, want.dq), tol) << w << " dq";
      EXPECT_LE(rel_error(got.dk, want.dk), tol) << w << " dk";
      EXPECT_LE(rel_error(got.dv, want.dv), tol) << w << " dv";
      EXPECT_LE(rel_error(got.dg, want.dg), tol) << w << " dg";
      EXPECT_LE(rel_error(got.dbeta, want.dbeta), tol) << w << " dbeta";
      EXPECT_LE(rel_error(got.dh0, want.dh0), tol) << w << " dh0";
      ForwardCache<T> cache;
      EXPECT_TRUE(run(Algorithm::chunk, h0p, dhtp, true, &cache, pool) == got) << w << " forward cache";
      EXPECT_EQ(cache.records(), seqs.count()) << w;
      cache.clear();
      EXPECT_TRUE(run(Algorithm::chunk, h0p, dhtp, true, &cache, pool) == got) << w << " reused cache";
      EXPECT_TRUE(run(Algorithm::chunk, h0p, dhtp, true, nullptr, nullptr) == got) << w << " one thread";
      // Zeros given as states: the same bits as none.
      EXPECT_TRUE(run(Algorithm::chunk, with_h0 ? h0p : zeros.data(), with_dht ? dhtp : zeros.data(), true,
                      nullptr, pool) == got)
          << w << " zeros given";
      // dh0 not wanted: the same gradients.
      DocRun<T> no_dh0 = run(Algorithm::chunk, h0p, dhtp, false, nullptr, pool);
      no_dh0.dh0 = got.dh0;
      EXPECT_TRUE(no_dh0 == got) << w << " without dh0";
      cache.clear();
      no_dh0 = run(Algorithm::chunk, h0p, dhtp, false, &cache, pool);
      no_dh0.dh0 = got.dh0;
      EXPECT_TRUE(no_dh0 == got) << w << " without dh0, forward cache";
    }
}

TEST(KdaChunk, FewTokenDocumentsMatchRecurrentWithAndWithoutTheCache) {
  // 1..7-token documents around a chunk, one and two chunks, ragged or not.
  const std::vector<std::size_t> lengths{1, 1, 2, 3, 1, 7, 5, kC, 1, kC + 1, 16, 17, 2 * kC + 9, 4, 1};
  std::vector<std::int64_t> cu{0};
  for (std::size_t n : lengths) cu.push_back(cu.back() + static_cast<std::int64_t>(n));
  const Shape s{1, static_cast<std::size_t>(cu.back()), 1, 2, 16, 32};
  const Sequences seqs(1, s.tokens, cu);
  ThreadPool pool(3);
  for (const double g_min : {-4.0, -30.0}) {
    const std::string what = " g_min=" + std::to_string(g_min);
    check_few_token_documents(Data<double>(s, 61, g_min), seqs, 1e-10, &pool, "double" + what);
    check_few_token_documents(Data<float>(s, 62, g_min), seqs, 2e-4, &pool, "float" + what);
  }
}

// The record of one head is sized by its tokens: R and Δ (T×V each), L and P
// (c×c each per chunk of c tokens), and the state entering every chunk
// after the first (the first is the incoming state, not kept).
TEST(KdaChunk, ForwardCacheRecordIsSizedByTheTokens) {
  const std::size_t hv = 3, k = 16, v = 32;
  const auto elems = [&](std::size_t tokens) {
    return ForwardCache<float>::record_elems(Shape{2, tokens, 1, hv, k, v}, Algorithm::chunk);
  };
  const std::size_t pairs = 2 * hv;
  EXPECT_EQ(elems(1), pairs * (2 * v + 2));
  EXPECT_EQ(elems(5), pairs * (2 * 5 * v + 2 * 25));
  EXPECT_EQ(elems(kC), pairs * (2 * kC * v + 2 * kC * kC));
  EXPECT_EQ(elems(kC + 3), pairs * (k * v + 2 * (kC + 3) * v + 2 * kC * kC + 2 * 9));
  EXPECT_EQ(elems(3 * kC), pairs * (2 * k * v + 2 * 3 * kC * v + 3 * 2 * kC * kC));
}

// The summary's defining property on the chunk path itself:
// forward(h).final = M·h + S.
TEST(KdaChunk, SummaryComposes) {
  const Shape s{1, 2 * kC + 7, 1, 1, 32, 16};
  const Data<double> d(s, 13, -4);
  const Outputs<double> r = run_all(d, Algorithm::chunk);
  std::vector<double> want(s.state_elems());
  for (std::size_t i = 0; i < s.key_dim; ++i)
    for (std::size_t j = 0; j < s.value_dim; ++j) {
      double acc = r.s[i * s.value_dim + j];
      for (std::size_t l = 0; l < s.key_dim; ++l)
        acc += r.m[i * s.key_dim + l] * d.h0[l * s.value_dim + j];
      want[i * s.value_dim + j] = acc;
    }
  EXPECT_LE(rel_error(r.final_state, want), 1e-12);
}

TEST(KdaChunk, AlgorithmNames) {
  EXPECT_STREQ(algorithm_name(Algorithm::chunk), "chunk");
  EXPECT_STREQ(algorithm_name(Algorithm::recurrent), "recurrent");
  EXPECT_EQ(parse_algorithm("chunk"), Algorithm::chunk);
  EXPECT_EQ(parse_algorithm("recurrent"), Algorithm::recurrent);
  EXPECT_THROW(parse_algorithm("wy"), InvalidArgument);
  const Data<float> d(Shape{1, 4, 1, 1, 16, 16}, 14, 0);
  const Inputs<float> in = d.inputs();
  std::vector<float> o(d.shape.v_elems());
  EXPECT_THROW(forward(in, nullptr, o.data(), nullptr, on(static_cast<Algorithm>(7))), InvalidArgument);
}


// ---- The CP layer with the chunk algorithm equals one rank -----------------

using test::LayerResult;

using test::Method;
using test::methods_for;

template <class T>
void check_cp(std::size_t p, const Shape& s, double tol) {
  const auto data = synthetic_layer<T>(s, p * 7 + s.tokens);
  const auto d_o = synthetic_tensor<T>(s.v_elems(), s.tokens);
  const auto want = test::single_rank(data, d_o, Algorithm::chunk);
  std::vector<LayerResult<T>> all;
  for (const Method& m : methods_for(p)) {
    const std::string what = m.name + " w=" + std::to_string(m.width) + " P=" + std::to_string(p);
    all.push_back(test::context_parallel(data, d_o, p, m.name, m.width, Algorithm::chunk));
    test::expect_close(all.back(), want, tol, what);
    if (m.exact) {
      EXPECT_TRUE(test::same_bits(all.back(), all.front())) << what;
    }
  }
}

// Ranks of one to three chunks, ragged last chunks, B > 1, HV = 2H, K ≠ V.
TEST(KdaChunk, CpLayerEqualsOneRankDouble) {
  check_cp<double>(2, Shape{1, 150, 1, 1, 16, 32}, 1e-12);
  check_cp<double>(3, Shape{2, 100, 1, 2, 16, 16}, 1e-12);
  check_cp<double>(4, Shape{1, 137, 2, 2, 32, 16}, 1e-12);
  check_cp<double>(8, Shape{1, 90, 1, 1, 16, 16}, 1e-12);
}

TEST(KdaChunk, CpLayerEqualsOneRankFloat) {
  check_cp<float>(2, Shape{1, 150, 1, 1, 16, 32}, 2e-5);
  check_cp<float>(4, Shape{2, 137, 1, 2, 16, 16}, 2e-5);
  check_cp<float>(8, Shape{1, 90, 1, 1, 16, 16}, 2e-5);
}

}  // namespace
}  // namespace kdacp::kda
