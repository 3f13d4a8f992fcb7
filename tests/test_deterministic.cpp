// The layer's deterministic mode (docs/determinism.md): every output (o, ht
// on every rank, dq, dk, dv, dg, dbeta, dh0 on every rank) the same bytes as
// the single-rank path for P in {1, 2, 3, 4, 8}, contiguous layouts (even and
// uneven, on chunk boundaries) and zigzag ones, every protocol configuration,
// 1 and 3 threads per rank, the forward cache kept or not, float32 and
// float64, packed sequences (one of one token) with h0 and dht, HV = 2H and
// K != V, both algorithms; the recurrent algorithm with cuts anywhere;
// layouts with runs of parts on one rank and several messages between two
// ranks. The default mode's bytes do depend on P (so the comparison can
// fail), and a chunk cut off its sequence's chunk grid is refused on every
// rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kda/sequences.hpp"
#include "kda_cp_stream_runner.hpp"
#include "kda_sequence_reference.hpp"
#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"

namespace kdacp::kda {
namespace {

using test::Case;
using test::CpRun;
using test::Problem;
using test::Result;
using test::RowConfig;
using test::make_problem;
using test::run_layer;
using test::same_bits;
using test::shape_of;

// T = 1024 (16 chunks). Sequences that start on the chunk grid, one of one
// token and one starting off the grid ([321, 384): no multiple of 64 inside
// it, so every cut on the global grid is on its sequence's grid too).
const Case kDocs{"docs", shape_of(1, 1024, 1, 2, 16, 32), {0, 320, 321, 384, 768, 896, 1000, 1024}};
// No cu_seqlens: two rows, each one sequence with its own h0 and ht.
const Case kRows{"rows", shape_of(2, 1024, 2, 4, 32, 16), {}};

constexpr std::size_t kTile = kChunkSize;

// A problem with h0, d_o and dht; dht[0] carries a negative zero, which a sum
// over ranks must keep.
template <class T>
Problem<T> problem(const Case& c) {
  Problem<double> p = make_problem(c, 7);
  p.dht[0] = -0.0;
  return p.cast<T>();
}

// The single-rank path (forward_sequences / backward_sequences): P = 1 in one
// process, what every CP run must reproduce.
template <class T>
Result<T> single(const Problem<T>& p, Algorithm algorithm) {
  return test::single_rank_path(p, kda::Exec{{nullptr, KernelKind::best}, algorithm});
}

// Rank 0 gives the loss's dht, the others zeros: the sum over ranks is dht.
template <class T>
std::vector<std::vector<T>> dht_on_rank0(const Problem<T>& p, std::size_t ranks) {
  std::vector<std::vector<T>> out(ranks, std::vector<T>(p.dht.size(), T(0)));
  out[0] = p.dht;
  return out;
}

// Parts on the chunk grid: `tiles` chunks of T split over `n` parts, by
// weights (each part at least one chunk), the last taking the rest.
std::vector<std::size_t> tile_counts(std::size_t tokens, std::size_t n, bool even) {
  const std::size_t tiles = tokens / kTile;
  const std::size_t weights[] = {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3};
  std::size_t total = 0;
  for (std::size_t i = 0; i < n; ++i) total += even ? 1 : weights[i];
  std::vector<std::size_t> out;
  std::size_t used = 0;
  for (std::size_t i = 0; i + 1 < n; ++i) {
    const std::size_t w = even ? 1 : weights[i];
    out.push_back(std::max<std::size_t>(1, tiles * w / total) * kTile);
    used += out.back();
  }
  out.push_back(tokens - used);
  return out;
}

// 2P parts on the chunk grid owned as zigzag (rank r: parts r and 2P-1-r).
Layout zigzag_on_tiles(std::size_t tokens, std::size_t ranks) {
  const std::vector<std::size_t> lengths = tile_counts(tokens, 2 * ranks, true);
  const PartOwners owners = PartOwners::zigzag(ranks);
  std::vector<LayoutPart> parts;
  std::size_t begin = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    parts.push_back({owners[i], begin, begin + lengths[i]});
    begin += lengths[i];
  }
  return Layout(ranks, parts);
}

// Names the outputs whose bytes differ.
template <class T>
std::string differing(const Result<T>& a, const Result<T>& b) {
  std::string out;
  auto one = [&](const char* name, const std::vector<T>& x, const std::vector<T>& y) {
    if (same_bits(x, y)) return;
    if (!out.empty()) out += ", ";
    out += name;
  };
  one("o", a.o, b.o);
  one("ht", a.ht, b.ht);
  one("dq", a.dq, b.dq);
  one("dk", a.dk, b.dk);
  one("dv", a.dv, b.dv);
  one("dg", a.dg, b.dg);
  one("dbeta", a.dbeta, b.dbeta);
  one("dh0", a.dh0, b.dh0);
  return out;
}

template <class T>
void check_ranks(std::size_t ranks) {
  for (const Case* c : {&kDocs, &kRows}) {
    const Problem<T> p = problem<T>(*c);
    const std::vector<std::vector<T>> dht = dht_on_rank0(p, ranks);
    const std::size_t tokens = c->shape.tokens;
    const std::vector<std::pair<std::string, Layout>> layouts{
        {"even", Layout::uneven(tokens, ranks, tile_counts(tokens, ranks, true))},
        {"uneven", Layout::uneven(tokens, ranks, tile_counts(tokens, ranks, false))},
        {"zigzag", zigzag_on_tiles(tokens, ranks)}};
    for (Algorithm algorithm : {Algorithm::chunk, Algorithm::recurrent}) {
      const Result<T> want = single(p, algorithm);
      const test::RunExec exec{kda::Exec{{nullptr, KernelKind::best}, algorithm}, true};
      std::size_t run = 0;
      const std::vector<RowConfig> all = test::row_configs(ranks, c->shape);
      for (const auto& [name, layout] : layouts)
        // Every configuration on the even layout; the first and last on the
        // others (the mode uses no protocol). Sanitizer builds take the first
        // and last everywhere: the same code paths, a quarter of the runs
        // (the P = 8 pair took 84 s each under ASan with every configuration).
        for (std::size_t i = 0; i < all.size(); ++i) {
#if defined(KDACP_SANITIZER_BUILD)
          constexpr bool every_on_even = false;
#else
          constexpr bool every_on_even = true;
#endif
          if (!(every_on_even && name == "even") && i != 0 && i + 1 != all.size()) continue;
          const RowConfig& m = all[i];
          // Alternate 1 and 3 threads per rank, forward cache kept or not.
          const std::size_t threads = run % 2 ? 3 : 1;
          const bool keep = run++ % 3 != 2;
          const std::string what = c->name + ", " + algorithm_name(algorithm) + ", P=" +
                                   std::to_string(ranks) + ", " + name + ", " +
                                   protocol_label(m.config) + ", " + std::to_string(threads) +
                                   " threads" + (keep ? "" : ", recompute");
          const CpRun<T> got = run_layer(p, dht, ranks, {}, m, layout, exec, threads, keep);
          EXPECT_EQ(differing(got.r, want), "") << what << ": not the single-rank bytes";
          for (std::size_t r = 1; r < ranks; ++r) {
            EXPECT_TRUE(same_bits(got.ht[r], want.ht)) << what << ": ht on rank " << r;
            EXPECT_TRUE(same_bits(got.dh0[r], want.dh0)) << what << ": dh0 on rank " << r;
          }
        }
    }
  }
}

class Deterministic : public ::testing::TestWithParam<std::size_t> {};

TEST_P(Deterministic, FloatIsTheSingleRankBytes) { check_ranks<float>(GetParam()); }
#if !defined(KDACP_SANITIZER_BUILD)
// Sanitizer builds run float32 only: float64 is the same template code, whose
// float64 instantiation the sanitizers see in CpSequences.*DoubleMatchFp64.
TEST_P(Deterministic, DoubleIsTheSingleRankBytes) { check_ranks<double>(GetParam()); }
#endif

#if defined(KDACP_SANITIZER_BUILD)
// An odd count and the largest: 2 and 4 add no code path, one rank runs no
// exchange (its layer path is in KdaCp.* and CpSequences.*), and the
// sanitizers spent 40 % of their suites' time in this test at every P.
INSTANTIATE_TEST_SUITE_P(Ranks, Deterministic, ::testing::Values(3, 8));
#else
INSTANTIATE_TEST_SUITE_P(Ranks, Deterministic, ::testing::Values(1, 2, 3, 4, 8));
#endif

// Parts at `bounds` (chunk-grid token boundaries) held by `owners`.
Layout owned_parts(std::size_t ranks, const std::vector<std::size_t>& bounds,
                   const std::vector<std::size_t>& owners) {
  std::vector<LayoutPart> parts;
  for (std::size_t i = 0; i < owners.size(); ++i) parts.push_back({owners[i], bounds[i], bounds[i + 1]});
  return Layout(ranks, parts);
}

// The chain's hand-offs beyond zigzag's: a run of three parts on one rank
// (each hands on to the next in place), one rank holding the first and the
// last part, two messages from one rank to another in one direction, parts
// out of rank order, and one rank holding every part (no message at all);
// kDocs starts a sequence at the boundary 320, where nothing is handed on;
// kRows hands on at every boundary. Backward included, kept and recomputed.
TEST(Deterministic, RunsAndRoundTripsOfPartsAreTheSingleRankBytes) {
  const std::vector<std::size_t> bounds{0, 64, 128, 192, 320, 448, 512, 640, 960, 1024};
  const std::vector<std::pair<std::string, Layout>> layouts{
      {"P=3 runs", owned_parts(3, bounds, {1, 1, 1, 0, 2, 0, 2, 0, 1})},
      {"P=1 parts", owned_parts(1, {0, 192, 320, 640, 1024}, {0, 0, 0, 0})}};
  const RowConfig p2p{{"p2p", 1, 0}, true, 0};
  for (const Case* c : {&kDocs, &kRows}) {
    const Problem<float> p = problem<float>(*c);
    for (Algorithm algorithm : {Algorithm::chunk, Algorithm::recurrent}) {
      const Result<float> want = single(p, algorithm);
      const test::RunExec exec{kda::Exec{{nullptr, KernelKind::best}, algorithm}, true};
      for (const auto& [name, layout] : layouts)
        for (bool keep : {true, false}) {
          const std::size_t ranks = layout.ranks();
          const std::string what = c->name + ", " + algorithm_name(algorithm) + ", " + name +
                                   (keep ? "" : ", recompute");
          const CpRun<float> got =
              run_layer(p, dht_on_rank0(p, ranks), ranks, {}, p2p, layout, exec, keep ? 1 : 2, keep);
          EXPECT_EQ(differing(got.r, want), "") << what << ": not the single-rank bytes";
          for (std::size_t r = 1; r < ranks; ++r) {
            EXPECT_TRUE(same_bits(got.ht[r], want.ht)) << what << ": ht on rank " << r;
            EXPECT_TRUE(same_bits(got.dh0[r], want.dh0)) << what << ": dh0 on rank " << r;
          }
        }
    }
  }
}

// The comparison above can fail: the default mode composes rank summaries,
// whose rounding depends on P, so its bytes at P = 4 are not P = 1's (while
// its values agree to rounding), for both algorithms.
TEST(Deterministic, DefaultModeBytesDependOnP) {
  const Problem<float> p = problem<float>(kDocs);
  const RowConfig p2p{{"p2p", 1, 0}, true, 0};
  for (Algorithm algorithm : {Algorithm::chunk, Algorithm::recurrent}) {
    const Result<float> want = single(p, algorithm);
    const test::RunExec exec{kda::Exec{{nullptr, KernelKind::best}, algorithm}, false};
    // Rank 1's part [64, 192) lies inside [0, 320): no cut, its map composed.
    const std::vector<std::size_t> counts{64, 128, 128, 704};
    const CpRun<float> got =
        run_layer(p, dht_on_rank0(p, 4), 4, {}, p2p, Layout::uneven(1024, 4, counts), exec);
    EXPECT_NE(differing(got.r, want), "") << algorithm_name(algorithm);
    EXPECT_LE(test::rel_error(got.r.o, want.o), 1e-5) << algorithm_name(algorithm);
    EXPECT_LE(test::rel_error(got.r.dk, want.dk), 1e-5) << algorithm_name(algorithm);
  }
}

// The recurrent algorithm has no grid: cuts anywhere, one-token parts.
TEST(Deterministic, RecurrentCutsAnywhere) {
  const Problem<double> p = problem<double>(kDocs);
  const Result<double> want = single(p, Algorithm::recurrent);
  const test::RunExec exec{kda::Exec{{nullptr, KernelKind::best}, Algorithm::recurrent}, true};
  const RowConfig p2p{{"p2p", 1, 0}, true, 0};
  const std::vector<std::size_t> counts{100, 1, 221, 2, 700};
  const CpRun<double> got =
      run_layer(p, dht_on_rank0(p, 5), 5, {}, p2p, Layout::uneven(1024, 5, counts), exec, 2);
  EXPECT_EQ(differing(got.r, want), "");
}

// With chunk, a part continuing a sequence off its chunk grid is refused on
// every rank, naming the part and the rule, before any message.
TEST(Deterministic, ChunkCutOffTheGridIsRefusedOnEveryRank) {
  const Problem<float> p = problem<float>(kDocs);
  const test::RunExec exec{kda::Exec{{nullptr, KernelKind::best}, Algorithm::chunk}, true};
  const RowConfig p2p{{"p2p", 1, 0}, true, 0};
  const std::vector<std::size_t> counts{128, 100, 796};  // 228 is 100 into [0, 320)
  std::vector<std::string> errors(3);
  try {
    run_layer(p, dht_on_rank0(p, 3), 3, {}, p2p, Layout::uneven(1024, 3, counts), exec);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the part [228, 1024) on rank 2 starts 228 tokens into its sequence"),
              std::string::npos) << m;
    EXPECT_NE(m.find("multiple of 64"), std::string::npos) << m;
  }
}

// Ranks that disagree on the mode are named on every rank, before any message.
TEST(Deterministic, RanksThatDisagreeOnTheModeAreNamed) {
  const Case c{"plain", shape_of(1, 128, 1, 1, 16, 16), {}};
  const Problem<float> p = problem<float>(c);
  std::vector<std::string> errors(2);
  run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t rank = comm->rank();
    auto mesh = DeviceMesh::create(comm, {2}, {"cp"});
    ContextParallelLayer<float> layer(mesh, "p2p", 1, {}, kda::Exec{{nullptr, KernelKind::best}, Algorithm::chunk});
    layer.deterministic(rank == 0);
    Shape ls = c.shape;
    ls.tokens = 64;
    auto local = [&](const std::vector<float>& full, std::size_t inner) {
      return std::vector<float>(full.begin() + rank * 64 * inner, full.begin() + (rank + 1) * 64 * inner);
    };
    const std::vector<float> q = local(p.q, 16), k = local(p.k, 16), v = local(p.v, 16), g = local(p.g, 16),
                             beta = local(p.beta, 1);
    std::vector<float> o(ls.v_elems());
    try {
      layer.forward(Inputs<float>{q.data(), k.data(), v.data(), g.data(), beta.data(), ls, p.scale}, o.data());
    } catch (const InvalidArgument& e) {
      errors[rank] = e.what();
    }
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("deterministic"), std::string::npos) << e;
}

}  // namespace
}  // namespace kdacp::kda
