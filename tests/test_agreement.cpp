// Ranks agree before any message (issue 18): the Fingerprint and agree()
// themselves, then the layer on in-process ranks where ONE rank differs in
// one argument (scale, algorithm, layout, counts, cu_seqlens of equal length,
// sum and weighted sum, protocol and its knobs, h0 / ht / dht / dh0, the
// timeout, a caller's own field): every rank must throw InvalidArgument
// naming the field and the ranks, and none may wait (a short world timeout
// turns a wait into a Timeout, which fails the test).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kdacp/agreement.hpp"
#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda_cp.hpp"
#include "kda/sequences.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/thread_pool.hpp"
#include "kda_test_inputs.hpp"

namespace kdacp {
namespace {

TEST(Agreement, Fnv1aIsTheStandardHash) {
  EXPECT_EQ(fnv1a64(std::string_view("")), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64(std::string_view("a")), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64(std::string_view("foobar")), 0x85944171f73967e8ull);
}

TEST(Agreement, ListTextShowsShortListsAndHashesLongOnes) {
  const std::vector<std::int64_t> a{0, 1, 5, 6, 24};
  EXPECT_EQ(list_text(std::span<const std::int64_t>(a)), "[0,1,5,6,24]");
  std::vector<std::int64_t> long_list(40);
  for (std::size_t i = 0; i < long_list.size(); ++i) long_list[i] = static_cast<std::int64_t>(i * 100);
  const std::string t = list_text(std::span<const std::int64_t>(long_list));
  EXPECT_EQ(t.rfind("40 entries #", 0), 0u) << t;
  EXPECT_LE(t.size(), kAgreementTextChars);
}

// agree() on P in-process ranks with fingerprint fp(rank); the message each
// rank threw ("" for none), and any other error fails the test.
std::vector<std::string> agree_on_ranks(std::size_t ranks, const std::function<Fingerprint(std::size_t)>& fp,
                                        const std::function<std::string(std::size_t)>& local_error = {}) {
  std::vector<std::string> msgs(ranks);
  InProcessOptions o;
  o.timeout = std::chrono::milliseconds(20000);
  run_in_process(
      ranks,
      [&](const std::shared_ptr<Communicator>& comm) {
        const std::size_t r = comm->rank();
        try {
          agree(*comm, fp(r), "test call", local_error ? local_error(r) : "");
        } catch (const InvalidArgument& e) {
          msgs[r] = e.what();
        }
      },
      o);
  return msgs;
}

TEST(Agreement, EqualFingerprintsPass) {
  const auto msgs = agree_on_ranks(3, [](std::size_t) {
    Fingerprint f;
    f.add_real("scale", 0.125).add_text("algorithm", "chunk").add_int("n", 7).add_flag("h0", true);
    return f;
  });
  for (const std::string& m : msgs) EXPECT_EQ(m, "");
}

TEST(Agreement, OneRankSendsNothing) {
  run_in_process(1, [](const std::shared_ptr<Communicator>& comm) {
    Fingerprint f;
    f.add_int("n", 1);
    agree(*comm, f, "test call");
    EXPECT_EQ(comm->stats().messages_sent, 0u);
    try {
      agree(*comm, f, "test call", "q is null");
      ADD_FAILURE() << "no InvalidArgument for the rank's own error";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()), "q is null");
    }
  });
}

TEST(Agreement, NamesTheFieldAndTheRanksOfEachValue) {
  const auto msgs = agree_on_ranks(4, [](std::size_t r) {
    Fingerprint f;
    f.add_text("algorithm", "chunk");
    f.add_real("scale", r == 1 ? 0.1 : 0.0883883);
    f.add_int("segments", r == 3 ? 2 : 0);
    return f;
  });
  for (std::size_t r = 0; r < 4; ++r) {
    EXPECT_NE(msgs[r].find("test call on rank " + std::to_string(r) + " of 4"), std::string::npos) << msgs[r];
    EXPECT_NE(msgs[r].find("scale: ranks 0,2,3 have 0.0883883, rank 1 has 0.1"), std::string::npos) << msgs[r];
    EXPECT_NE(msgs[r].find("segments: ranks 0-2 have 0, rank 3 has 2"), std::string::npos) << msgs[r];
    EXPECT_EQ(msgs[r].find("algorithm"), std::string::npos) << msgs[r];
  }
}

TEST(Agreement, ValuesThatPrintAlikeAreToldApartByHash) {
  // Two long texts with the same shown prefix.
  const auto msgs = agree_on_ranks(2, [](std::size_t r) {
    Fingerprint f;
    f.add_text("method", r == 0 ? "grouped_allgather_p2p_with_a_long_name_A" : "grouped_allgather_p2p_with_a_long_name_B");
    return f;
  });
  EXPECT_NE(msgs[0].find("method: rank 0 has grouped_allgather_p2p.. (#"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[0].find("rank 1 has grouped_allgather_p2p.. (#"), std::string::npos) << msgs[0];
}

TEST(Agreement, ALocalErrorFailsEveryRank) {
  const auto msgs = agree_on_ranks(
      3,
      [](std::size_t) {
        Fingerprint f;
        f.add_int("n", 1);
        return f;
      },
      [](std::size_t r) { return r == 2 ? std::string("q is null") : std::string(); });
  EXPECT_EQ(msgs[2], "q is null");
  for (std::size_t r : {0u, 1u})
    EXPECT_NE(msgs[r].find("rank 2 rejected its own arguments"), std::string::npos) << msgs[r];
}

TEST(Agreement, DifferentFieldListsAreNamed) {
  const auto msgs = agree_on_ranks(2, [](std::size_t r) {
    Fingerprint f;
    f.add_int("n", 1);
    if (r == 1) f.add_int("extra", 2);
    return f;
  });
  for (const std::string& m : msgs)
    EXPECT_NE(m.find("the ranks check different arguments from field 2"), std::string::npos) << m;
}

TEST(Agreement, ManyFieldsFoldIntoTheLastSlot) {
  const auto msgs = agree_on_ranks(2, [](std::size_t r) {
    Fingerprint f;
    for (std::size_t i = 0; i < kAgreementFields + 5; ++i)
      f.add_int(std::string("f").append(std::to_string(i)), static_cast<long long>(i == kAgreementFields + 3 && r == 1 ? 99 : i));
    return f;
  });
  const std::string last = "fields f" + std::to_string(kAgreementFields - 1) + " and later";
  for (const std::string& m : msgs) EXPECT_NE(m.find(last), std::string::npos) << m;
}

}  // namespace

namespace kda {
namespace {

using test::filled;

constexpr std::size_t kTokens = 24;
const Shape kShape{1, kTokens, 1, 2, 16, 16};  // B, T, H, HV, K, V

// One rank's arguments to the layer; the tests change one field on one rank.
struct RankArgs {
  std::string method = "p2p";
  long long width = 1;
  ExchangeOptions options{};
  bool zigzag = false;              // the layer's and the stream's layout
  std::vector<std::size_t> counts;  // contiguous per-rank counts (empty: even split)
  bool stream_counts_only = false;  // counts apply to the call's stream, not to the layer
  double scale = 0.25;
  Algorithm algorithm = Algorithm::chunk;
  std::vector<std::int64_t> cu{0, 1, 5, 6, 24};
  bool h0 = true, ht = true, dht = true, dh0 = true;
  bool null_o = false;  // forward gets no o (an argument error of this rank alone)
  Fingerprint extra;
};

Layout layout_of(const RankArgs& a, std::size_t ranks, bool for_layer) {
  if (a.zigzag) return Layout::zigzag(kTokens, ranks);
  if (for_layer && a.stream_counts_only) return Layout::contiguous(kTokens, ranks);
  return Layout::contiguous(kTokens, ranks, a.counts);
}

// What each rank saw: the stage that threw and its message.
struct Outcome {
  std::string stage = "none";  // construction, forward, backward, none
  std::string message;
};

// The layer on P in-process ranks, rank r with args(r): construction,
// forward over a packed stream with h0/ht, backward with dht/dh0. A wait
// past 20 s fails the test (Timeout is not caught here).
std::vector<Outcome> run_layer(std::size_t ranks, const std::function<RankArgs(std::size_t)>& args,
                               std::chrono::milliseconds timeout = std::chrono::milliseconds(20000)) {
  std::vector<Outcome> out(ranks);
  InProcessOptions o;
  o.timeout = timeout;
  run_in_process(
      ranks,
      [&](const std::shared_ptr<Communicator>& comm) {
        const std::size_t r = comm->rank();
        const RankArgs a = args(r);
        Outcome& mine = out[r];
        try {
          mine.stage = "construction";
          auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
          LayerChecks checks;
          checks.agree = a.extra;
          ContextParallelLayer<double> layer(mesh, a.method, layout_of(a, ranks, true), a.width, a.options,
                                             kda::Exec{{nullptr, KernelKind::best}, a.algorithm}, checks);
          mine.stage = "forward";
          const Stream stream{Sequences(1, kTokens, std::span(a.cu)), layout_of(a, ranks, false)};
          Shape ls = kShape;
          ls.tokens = stream.layout.local_tokens(r);
          const std::vector<double> q = filled<double>(ls.qk_elems(), -1, 1, 1),
                                    k = filled<double>(ls.qk_elems(), -0.3, 0.3, 2),
                                    v = filled<double>(ls.v_elems(), -1, 1, 3),
                                    g = filled<double>(ls.g_elems(), -0.2, -0.01, 4),
                                    beta = filled<double>(ls.beta_elems(), 0.1, 0.9, 5);
          const Inputs<double> in{q.data(), k.data(), v.data(), g.data(), beta.data(), ls, a.scale};
          const std::size_t n = stream.sequences.count() * kShape.value_heads * kShape.key_dim * kShape.value_dim;
          const std::vector<double> h0 = filled<double>(n, -1, 1, 6), dht = filled<double>(n, -1, 1, 7);
          std::vector<double> o_(ls.v_elems()), ht(n), dh0(n);
          auto states = [&](const std::vector<double>& x, bool on) {
            return on ? sequence_states(x.data(), stream.sequences, ls) : SequenceStates<const double>{};
          };
          auto out_states = [&](std::vector<double>& x, bool on) {
            return on ? sequence_states(x.data(), stream.sequences, ls) : SequenceStates<double>{};
          };
          const Saved saved = layer.forward(in, stream, states(h0, a.h0), a.null_o ? nullptr : o_.data(),
                                            out_states(ht, a.ht));
          mine.stage = "backward";
          const std::vector<double> d_o = filled<double>(ls.v_elems(), -1, 1, 8);
          std::vector<double> dq(ls.qk_elems()), dk(ls.qk_elems()), dv(ls.v_elems()), dg(ls.g_elems()),
              dbeta(ls.beta_elems());
          layer.backward(in, saved, states(h0, a.h0), d_o.data(), states(dht, a.dht),
                         Grads<double>{dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data()},
                         out_states(dh0, a.dh0));
          mine.stage = "none";
        } catch (const InvalidArgument& e) {
          mine.message = e.what();
        }
      },
      o);
  return out;
}

// Every rank must fail at `stage` with a message holding `needle`.
void expect_every_rank(const std::vector<Outcome>& out, const std::string& stage, const std::string& needle) {
  for (std::size_t r = 0; r < out.size(); ++r) {
    EXPECT_EQ(out[r].stage, stage) << "rank " << r << ": " << out[r].message;
    EXPECT_NE(out[r].message.find(needle), std::string::npos)
        << "rank " << r << " threw '" << out[r].message << "', expected it to mention '" << needle << "'";
  }
}

// Rank `odd` (of 3) runs with `change` applied.
std::vector<Outcome> one_rank_differs(const std::function<void(RankArgs&)>& change, std::size_t odd = 1,
                                      std::size_t ranks = 3) {
  return run_layer(ranks, [&](std::size_t r) {
    RankArgs a;
    if (r == odd) change(a);
    return a;
  });
}

TEST(RankAgreement, EqualArgumentsRunThrough) {
  const auto out = run_layer(3, [](std::size_t) { return RankArgs{}; });
  for (std::size_t r = 0; r < out.size(); ++r) EXPECT_EQ(out[r].stage, "none") << out[r].message;
}

TEST(RankAgreement, Scale) {
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.scale = 0.1; }), "forward",
                    "scale: ranks 0,2 have 0.25, rank 1 has 0.1");
}

TEST(RankAgreement, Algorithm) {
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.algorithm = Algorithm::recurrent; }), "forward",
                    "algorithm: ranks 0,2 have chunk, rank 1 has recurrent");
}

TEST(RankAgreement, CuSeqlensOfEqualLengthSumAndWeightedSum) {
  // [0,1,5,6,24] and [0,2,3,7,24]: same length (5), sum (36) and Σ i·c_i (125).
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.cu = {0, 2, 3, 7, 24}; }), "forward",
                    "cu_seqlens: ranks 0,2 have [0,1,5,6,24], rank 1 has [0,2,3,7,24]");
}

TEST(RankAgreement, LayoutAtConstruction) {
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.zigzag = true; }, 0), "construction",
                    "options.part_owners: rank 0 has [0,1,2,2,1,0], ranks 1,2 have [0,1,2]");
}

TEST(RankAgreement, ExpectedCutsAtConstruction) {
  // auto would choose from them: ranks expecting other cuts could build
  // different protocols.
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.options.expected_cuts = {true, true, false}; }, 1),
                    "construction", "options.expected_cuts: ranks 0,2 have [], rank 1 has [1,1,0]");
}

TEST(RankAgreement, PerRankCountsAtConstruction) {
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.counts = {4, 10, 10}; }, 2), "construction",
                    "layout part lengths: ranks 0,1 have [8,8,8], rank 2 has [4,10,10]");
}

TEST(RankAgreement, PerRankCountsOfTheStream) {
  // The layer built alike; one rank's call brings other per-rank counts.
  expect_every_rank(one_rank_differs([](RankArgs& a) {
                      a.counts = {4, 10, 10};
                      a.stream_counts_only = true;
                    }),
                    "forward", "layout part lengths: ranks 0,2 have [8,8,8], rank 1 has [4,10,10]");
}

TEST(RankAgreement, Protocol) {
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.method = "allgather"; }), "construction",
                    "method: ranks 0,2 have p2p, rank 1 has allgather");
}

TEST(RankAgreement, GroupSize) {
  const auto out = run_layer(4, [](std::size_t r) {
    RankArgs a;
    a.method = "grouped_allgather_p2p";
    a.width = r == 3 ? 4 : 2;
    return a;
  });
  expect_every_rank(out, "construction", "allgather_group_size: ranks 0-2 have 2, rank 3 has 4");
}

TEST(RankAgreement, ProtocolKnobs) {
  expect_every_rank(one_rank_differs([](RankArgs& a) {
                      a.method = "pipelined_p2p";
                      a.options.segments = 1;
                    }),
                    "construction", "options.segments: ranks 0,2 have 0, rank 1 has 1");
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.options.memory_budget_bytes = 1 << 20; }), "construction",
                    "options.memory_budget_bytes: ranks 0,2 have 0, rank 1 has 1048576");
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.options.allow_reassociation = true; }), "construction",
                    "options.allow_reassociation: ranks 0,2 have no, rank 1 has yes");
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.options.cost.alpha_s = 1e-3; }), "construction",
                    "options.cost: ranks 0,2 have hash #");
}

TEST(RankAgreement, StateFlags) {
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.h0 = false; }), "forward",
                    "h0 given: ranks 0,2 have yes, rank 1 has no");
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.ht = false; }), "forward",
                    "ht requested: ranks 0,2 have yes, rank 1 has no");
  // Forward agrees; backward does not.
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.dht = false; }), "backward",
                    "dht given: ranks 0,2 have yes, rank 1 has no");
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.dh0 = false; }), "backward",
                    "dh0 requested: ranks 0,2 have yes, rank 1 has no");
}

TEST(RankAgreement, CallersOwnFields) {
  expect_every_rank(one_rank_differs([](RankArgs& a) { a.extra.add_int("--seed", 1); }), "construction",
                    "the ranks check different arguments");
  const auto out = run_layer(3, [](std::size_t r) {
    RankArgs a;
    a.extra.add_int("--seed", r == 1 ? 1 : 0);
    a.extra.add_hash("inputs", r == 2 ? 0xabcdefull : 0x123456ull, r == 2 ? "q.npy #2" : "q.npy #1");
    return a;
  });
  expect_every_rank(out, "construction", "--seed: ranks 0,2 have 0, rank 1 has 1");
  expect_every_rank(out, "construction", "inputs: ranks 0,1 have q.npy #1, rank 2 has q.npy #2");
}

TEST(RankAgreement, Timeout) {
  // The world's timeout is one for all ranks in-process; a rank's own
  // communicator with another timeout is what MPI or torch would give.
  std::vector<Outcome> out(2);
  InProcessWorld world(2, InProcessOptions{std::chrono::milliseconds(20000)});
  world.run([&](const std::shared_ptr<Communicator>& comm) {
    // A wrapper reporting another timeout on rank 1.
    struct Other : Communicator {
      std::shared_ptr<Communicator> c;
      explicit Other(std::shared_ptr<Communicator> inner) : c(std::move(inner)) {}
      std::size_t rank() const override { return c->rank(); }
      std::size_t size() const override { return c->size(); }
      const std::vector<std::size_t>& global_ranks() const override { return c->global_ranks(); }
      std::size_t world_size() const override { return c->world_size(); }
      std::string backend() const override { return c->backend(); }
      void all_gather(std::span<std::byte> b) override { c->all_gather(b); }
      void broadcast(std::span<std::byte> b, std::size_t root) override { c->broadcast(b, root); }
      void barrier() override { c->barrier(); }
      std::unique_ptr<Request> isend(std::span<const std::byte> d, std::size_t p, int t) override {
        return c->isend(d, p, t);
      }
      std::unique_ptr<Request> irecv(std::span<std::byte> d, std::size_t p, int t) override {
        return c->irecv(d, p, t);
      }
      std::shared_ptr<Communicator> split(int color, int key) override { return c->split(color, key); }
      std::chrono::milliseconds timeout() const override { return std::chrono::milliseconds(5000); }
      CommStats stats() const override { return c->stats(); }
    };
    const std::size_t r = comm->rank();
    std::shared_ptr<Communicator> mine = r == 1 ? std::make_shared<Other>(comm) : comm;
    try {
      auto mesh = DeviceMesh::from_group(mine, {0, 1}, "cp");
      ContextParallelLayer<double> layer(mesh, "p2p");
      out[r].stage = "none";
    } catch (const InvalidArgument& e) {
      out[r].stage = "construction";
      out[r].message = e.what();
    }
  });
  expect_every_rank(out, "construction", "timeout ms: rank 0 has 20000, rank 1 has 5000");
}

TEST(RankAgreement, OneRanksArgumentErrorFailsEveryRank) {
  // Rank 1 passes no o: it names that; its peers name rank 1 instead of
  // waiting for it in the exchange.
  const auto out = one_rank_differs([](RankArgs& a) { a.null_o = true; });
  for (std::size_t r = 0; r < out.size(); ++r) EXPECT_EQ(out[r].stage, "forward") << out[r].message;
  EXPECT_NE(out[1].message.find("forward on rank 1: o is null"), std::string::npos) << out[1].message;
  for (std::size_t r : {0u, 2u})
    EXPECT_NE(out[r].message.find("rank 1 rejected its own arguments"), std::string::npos) << out[r].message;
}

TEST(RankAgreement, PlainCallsAgreeToo) {
  // The forward and backward without a stream: one rank's scale differs.
  std::vector<Outcome> out(2);
  run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t r = comm->rank();
    auto mesh = DeviceMesh::create(comm, {2}, {"cp"});
    ContextParallelLayer<double> layer(mesh, "p2p");
    Shape ls = kShape;
    ls.tokens = 12;
    const std::vector<double> q = filled<double>(ls.qk_elems(), -1, 1, 1), v = filled<double>(ls.v_elems(), -1, 1, 3),
                              g = filled<double>(ls.g_elems(), -0.2, -0.01, 4),
                              beta = filled<double>(ls.beta_elems(), 0.1, 0.9, 5);
    std::vector<double> o(ls.v_elems());
    Inputs<double> in{q.data(), q.data(), v.data(), g.data(), beta.data(), ls, r == 0 ? 0.25 : 0.5};
    try {
      layer.forward(in, o.data());
      out[r].stage = "none";
    } catch (const InvalidArgument& e) {
      out[r].stage = "forward";
      out[r].message = e.what();
    }
  });
  expect_every_rank(out, "forward", "scale: rank 0 has 0.25, rank 1 has 0.5");
}

}  // namespace
}  // namespace kda
}  // namespace kdacp
