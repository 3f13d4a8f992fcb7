// The layer built from one config (kdacp/layer.hpp): every strategy behind
// make_layer gives the engines' bits, and ranks that disagree on anything that
// changes a result or a message size are named on every rank, in the names
// the config's user wrote, before any message of the layer.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kda_test_inputs.hpp"
#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/layer.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp {
namespace {

using kda::Shape;

struct Data {
  Shape shape;
  std::vector<double> q, k, v, g, beta, d_o;
};

Data make_data(const Shape& s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  kda::test::RandomInputs r = kda::test::random_inputs(s, rng);
  Data d{s, r.q, r.k, r.v, r.g, r.beta, kda::test::uniform(s.v_elems(), -1, 1, rng)};
  return d;
}

// One rank's outputs: o, dq, dk, dv, dg, dbeta in the global layout's
// positions (the rank writes only its own tokens), ht.
struct Outputs {
  std::vector<double> o, dq, dk, dv, dg, dbeta, ht;
};

// Runs `layer` forward + backward on its rank's tokens of `d` (B = 1) and
// writes them into `out` at their stream positions.
void run_rank(Layer<double>& layer, const Data& d, Outputs& out) {
  const Shape& s = d.shape;
  const Shape ls = layer.local_shape();
  const auto parts = layer.layout().local_parts(layer.rank());
  auto take = [&](const std::vector<double>& full, std::size_t inner) {
    std::vector<double> local(ls.tokens * inner);
    for (const Part& p : parts)
      std::copy_n(full.data() + p.begin * inner, (p.end - p.begin) * inner, local.data() + p.local_begin * inner);
    return local;
  };
  auto put = [&](const std::vector<double>& local, std::size_t inner, std::vector<double>& full) {
    for (const Part& p : parts)
      std::copy_n(local.data() + p.local_begin * inner, (p.end - p.begin) * inner, full.data() + p.begin * inner);
  };
  const std::size_t qk = s.heads * s.key_dim, vv = s.value_heads * s.value_dim, gk = s.value_heads * s.key_dim;
  const std::vector<double> q = take(d.q, qk), k = take(d.k, qk), v = take(d.v, vv), g = take(d.g, gk),
                            beta = take(d.beta, s.value_heads), d_o = take(d.d_o, vv);
  const kda::Inputs<double> in{q.data(), k.data(), v.data(), g.data(), beta.data(), ls, 0.25};
  std::vector<double> o(ls.tokens * vv), dq(q.size()), dk(k.size()), dv(v.size()), dg(g.size()), db(beta.size());
  const kda::Sequences& seqs = layer.sequences();
  std::vector<double> ht(seqs.count() * s.value_heads * s.key_dim * s.value_dim);
  auto saved = layer.forward(in, {}, o.data(), kda::sequence_states(ht.data(), seqs, ls));
  layer.backward(in, *saved, {}, d_o.data(), {}, {dq.data(), dk.data(), dv.data(), dg.data(), db.data(), nullptr},
                 {});
  put(o, vv, out.o);
  put(dq, qk, out.dq);
  put(dk, qk, out.dk);
  put(dv, vv, out.dv);
  put(dg, gk, out.dg);
  put(db, s.value_heads, out.dbeta);
  if (layer.rank() == 0) out.ht = ht;  // the same bits on every rank
}

Outputs zeros(const Shape& s) {
  return {std::vector<double>(s.v_elems()), std::vector<double>(s.qk_elems()), std::vector<double>(s.qk_elems()),
          std::vector<double>(s.v_elems()), std::vector<double>(s.g_elems()), std::vector<double>(s.beta_elems()),
          {}};
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

LayerConfig config_for(const Shape& s, std::vector<std::int64_t> cu) {
  LayerConfig c;
  c.shape = s;
  c.cu_seqlens = std::move(cu);
  return c;
}

// Every rank of `ranks` runs `fn`; each must throw InvalidArgument whose
// message contains `want` (none hangs: the world's timeout is short).
void expect_every_rank_names(std::size_t ranks, const std::function<void(const std::shared_ptr<Communicator>&)>& fn,
                             const std::vector<std::string>& want) {
  std::atomic<std::size_t> thrown{0};
  InProcessOptions opts;
  opts.timeout = std::chrono::milliseconds(20000);
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    try {
      fn(comm);
      ADD_FAILURE() << "rank " << comm->rank() << " returned";
    } catch (const InvalidArgument& e) {
      ++thrown;
      for (const std::string& w : want)
        EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << "rank " << comm->rank() << ": " << e.what();
    }
  }, opts);
  EXPECT_EQ(thrown.load(), ranks);
}

TEST(Layer, EveryStrategyGivesTheChainsBitsOrOneDevicesInDeterministicMode) {
  const Shape s{1, 200, 2, 4, 16, 16};
  const Data d = make_data(s, 7);
  const std::vector<std::int64_t> cu{0, 37, 38, 130, 200};
  // One process: the whole stream.
  Outputs one = zeros(s);
  {
    LayerConfig c = config_for(s, cu);
    c.algorithm = kda::Algorithm::recurrent;
    auto layer = make_layer<double>(nullptr, c);
    EXPECT_EQ(layer->method(), "none");
    run_rank(*layer, d, one);
  }
  for (const bool deterministic : {false, true}) {
    for (const std::size_t width : {1, 2}) {
      for (const LayoutKind kind : {LayoutKind::contiguous, LayoutKind::zigzag}) {
        for (const std::size_t ranks : {2, 4}) {
          Outputs cp = zeros(s);
          run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
            LayerConfig c = config_for(s, cu);
            c.layout = kind;
            c.ulysses = width;
            c.deterministic = deterministic;
            c.algorithm = kda::Algorithm::recurrent;  // any split in deterministic mode
            c.protocol = "p2p";
            auto layer = make_layer<double>(comm, c);
            EXPECT_EQ(layer->ulysses_width(), width);
            run_rank(*layer, d, cp);
          });
          for (auto* f : {&cp.o, &cp.dq, &cp.dk, &cp.dv, &cp.dg, &cp.dbeta}) ASSERT_FALSE(f->empty());
          if (deterministic) {
            // CP = 1 ≡ CP = N: one device's bytes.
            EXPECT_TRUE(same_bits(cp.o, one.o) && same_bits(cp.dq, one.dq) && same_bits(cp.dk, one.dk) &&
                        same_bits(cp.dv, one.dv) && same_bits(cp.dg, one.dg) && same_bits(cp.dbeta, one.dbeta) &&
                        same_bits(cp.ht, one.ht))
                << "P " << ranks << " U " << width << " " << layout_kind_name(kind);
          } else {
            EXPECT_LT(kda::test::rel_error(cp.o, one.o), 1e-12);
            EXPECT_LT(kda::test::rel_error(cp.dk, one.dk), 1e-12);
            EXPECT_LT(kda::test::rel_error(cp.ht, one.ht), 1e-12);
          }
        }
      }
    }
  }
}

TEST(Layer, ConfigErrorsNameTheUsersSettings) {
  const Shape s{1, 64, 2, 2, 8, 8};
  LayerConfig c = config_for(s, {0, 50, 50, 64});
  c.names = LayerNames::cli();
  try {
    make_layer<double>(nullptr, c);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("--seqlens: entry 2 (50) is not above entry 1 (50)"), std::string::npos)
        << e.what();
  }
  c = config_for(s, {0, 64});
  c.split = {30, 30};
  EXPECT_THROW(
      {
        try {
          validate_layer_config(c, 2);
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("split 30,30 sums to 60 tokens, expected T = 64"), std::string::npos)
              << e.what();
          throw;
        }
      },
      InvalidArgument);
  c.split.clear();
  c.protocol = "ring";
  EXPECT_THROW(validate_layer_config(c, 2), InvalidArgument);
  c.protocol = "auto";
  c.ulysses = 3;
  EXPECT_THROW(validate_layer_config(c, 2), InvalidArgument);
}

// Two ranks whose contexts were built from different cu_seqlens with the same
// split used to return silently different answers: named on every rank now.
TEST(Layer, RanksWithDifferentSequencesAreNamedOnEveryRank) {
  const Shape s{1, 128, 2, 2, 8, 8};
  expect_every_rank_names(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        make_layer<double>(comm, config_for(s, comm->rank() == 0 ? std::vector<std::int64_t>{0, 50, 128}
                                                                 : std::vector<std::int64_t>{0, 60, 128}));
      },
      {"cu_seqlens: rank 0 has [0,50,128], rank 1 has [0,60,128]"});
  // The CLI's names for the same settings.
  expect_every_rank_names(
      3,
      [&](const std::shared_ptr<Communicator>& comm) {
        LayerConfig c = config_for(s, {0, 128});
        c.names = LayerNames::cli();
        c.split = comm->rank() == 2 ? std::vector<std::size_t>{40, 40, 48} : std::vector<std::size_t>{43, 43, 42};
        c.protocol = comm->rank() == 1 ? "allgather" : "p2p";
        make_layer<double>(comm, c);
      },
      {"--split: ranks 0,1 have [43,43,42], rank 2 has [40,40,48]", "--protocol: ranks 0,2 have p2p, rank 1 has allgather"});
}

// A context (kdacp.torch's build_cp_context) agrees before any call's shape
// is known: another split or cu_seqlens is named on every rank, and one
// rank's own argument error reaches the others instead of a timeout.
TEST(Layer, ContextsThatDifferAreNamedOnEveryRank) {
  auto context = [](std::vector<std::int64_t> cu, std::vector<std::size_t> split) {
    LayerConfig c;
    c.shape.batch = 1;
    c.shape.tokens = static_cast<std::size_t>(cu.back());
    c.cu_seqlens = std::move(cu);
    c.split = std::move(split);
    return c;
  };
  expect_every_rank_names(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        agree_layer_context(comm, context({0, 50, 128}, comm->rank() == 0 ? std::vector<std::size_t>{64, 64}
                                                                           : std::vector<std::size_t>{60, 68}),
                            "build_cp_context");
      },
      {"build_cp_context", "split: rank 0 has [64,64], rank 1 has [60,68]"});
  expect_every_rank_names(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        agree_layer_context(comm, context({0, 128}, {}), "build_cp_context",
                            comm->rank() == 1 ? "split[0] is '2.5', expected an integer" : "");
      },
      {});  // rank 1: its own error; rank 0: that rank 1 rejected its arguments
  // The same context on every rank: its layout (split None: ceil/floor).
  run_in_process(3, [&](const std::shared_ptr<Communicator>& comm) {
    const Layout l = agree_layer_context(comm, context({0, 7, 128}, {}), "build_cp_context");
    EXPECT_EQ(l.local_tokens(0), 43u);
    EXPECT_EQ(l.local_tokens(2), 42u);
  });
  EXPECT_THROW(agree_layer_context(nullptr, context({0, 5, 5, 12}, {}), "build_cp_context"), InvalidArgument);
}

// A call whose layout follows from each rank's tokens (kdacp.torch's
// kda(group=...)): the counts travel in the agreement's one record; any
// field that differs, or one rank's own error, is named on every rank.
TEST(Layer, CallsWithTheirOwnSplitGatherTheCountsInTheAgreement) {
  const Shape s{1, 0, 2, 2, 8, 8};
  auto call = [](double scale) {
    Fingerprint f;
    f.add_real("scale", scale);
    return f;
  };
  run_in_process(3, [&](const std::shared_ptr<Communicator>& comm) {
    LayerConfig c = config_for(s, {0, 5, 30});
    c.shape.tokens = comm->rank() == 1 ? 15 : 7 + comm->rank();  // 7, 15, 9
    const LayerConfig got = agree_layer_call(comm, c, "float64", call(0.25), "kda");
    EXPECT_EQ(got.split, (std::vector<std::size_t>{7, 15, 9}));
    EXPECT_EQ(got.shape.tokens, 31u);
    // T is the sum: cu_seqlens ending at 30 is named by make_layer, on every rank.
    EXPECT_THROW(make_layer<double>(comm, got), InvalidArgument);
  });
  expect_every_rank_names(
      3,
      [&](const std::shared_ptr<Communicator>& comm) {
        LayerConfig c = config_for(s, {});
        c.shape.tokens = 4;
        agree_layer_call(comm, c, "float64", call(comm->rank() == 2 ? 0.5 : 0.25), "kda");
      },
      {"kda on rank", "scale: ranks 0,1 have 0.25, rank 2 has 0.5"});
  expect_every_rank_names(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        LayerConfig c = config_for(s, {});
        c.shape.tokens = 4;
        agree_layer_call(comm, c, comm->rank() == 0 ? "float64" : "float32", call(0.25), "kda");
      },
      {"dtype: rank 0 has float64, rank 1 has float32"});
  expect_every_rank_names(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        LayerConfig c = config_for(s, {});
        c.shape.tokens = 4;
        agree_layer_call(comm, c, "float64", call(0.25), "kda", comm->rank() == 1 ? "q: element [0,3,0,0] is nan" : "");
      },
      {});  // rank 1 its own error, rank 0 that rank 1 rejected its arguments
  // Zigzag's counts are its own: other counts are named by the layout check.
  run_in_process(2, [&](const std::shared_ptr<Communicator>& comm) {
    LayerConfig c = config_for(s, {});
    c.layout = LayoutKind::zigzag;
    c.names.split = "tokens per rank";
    c.shape.tokens = comm->rank() == 0 ? 6 : 10;
    const LayerConfig got = agree_layer_call(comm, c, "float64", call(0.25), "kda");
    try {
      make_layer_layout(got, 2);
      ADD_FAILURE() << "zigzag accepted counts 6,10";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("tokens per rank 6,10"), std::string::npos) << e.what();
    }
  });
}

// The in-kernel transforms are part of the config: checked in the user's
// names, and a rank that applies others is named before any message.
TEST(Layer, InputTransformsAreCheckedAndAgreed) {
  const Shape s{1, 16, 2, 2, 8, 8};
  LayerConfig c = config_for(s, {});
  c.transforms.lower_bound = -5.0;
  try {
    make_layer<double>(nullptr, c);
    ADD_FAILURE() << "a lower_bound without the gate was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("lower_bound, A_log or dt_bias without use_gate_in_kernel"),
              std::string::npos)
        << e.what();
  }
  c.transforms.gate = true;
  c.transforms.lower_bound = 0.5;
  EXPECT_THROW(make_layer<double>(nullptr, c), InvalidArgument);
  expect_every_rank_names(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        LayerConfig mine = config_for(s, {});
        mine.transforms.gate = true;
        mine.transforms.a_log = true;
        mine.transforms.beta_sigmoid = true;
        if (comm->rank() == 1) mine.transforms.lower_bound = -5.0;
        make_layer<double>(comm, mine);
      },
      {"in-kernel transforms: rank 0 has gate,A,sig, rank 1 has gate,A,lb=-5,sig"});
}

// ulysses auto prices the all-to-alls at the bytes they move: 16-bit
// storage as 2, the compute type's otherwise, a mix as the mean rounded up.
TEST(Layer, ActivationBytesAreWhatTheAllToAllsMove) {
  LayerConfig c = config_for(Shape{1, 8, 2, 2, 16, 16}, {});
  EXPECT_EQ(layer_activation_bytes(c, 4), 4u);
  EXPECT_EQ(layer_activation_bytes(c, 8), 8u);
  c.storage.fill(Half::bf16);
  EXPECT_EQ(layer_activation_bytes(c, 4), 2u);
  c.storage[3] = std::nullopt;  // a float32 gate among bfloat16 q, k, v, beta
  EXPECT_EQ(layer_activation_bytes(c, 4), 3u);
}

// Ulysses moves 16-bit inputs as 16 bits: a rank with another storage type
// would send messages of another size (a crash inside gloo once).
TEST(Layer, RanksWithDifferentStorageTypesAreNamedBeforeAnyMessage) {
  const Shape s{1, 64, 2, 2, 8, 8};
  expect_every_rank_names(
      2,
      [&](const std::shared_ptr<Communicator>& comm) {
        LayerConfig c = config_for(s, {});
        c.ulysses = 2;
        if (comm->rank() == 1) c.storage[0] = Half::bf16;
        make_layer<float>(comm, c);
      },
      {"storage dtypes q,k,v,g,beta: rank 0 has", "rank 1 has bfloat16,compute"});
}

// The deterministic mode's chunk rule under Ulysses names the user's ranks
// and tokens, not the head groups' parts.
TEST(Layer, DeterministicChunkRuleNamesUserRanks) {
  const Shape s{1, 32, 2, 2, 8, 8};
  expect_every_rank_names(
      4,
      [&](const std::shared_ptr<Communicator>& comm) {
        LayerConfig c = config_for(s, {0, 32});
        c.ulysses = 2;
        c.deterministic = true;
        c.algorithm = kda::Algorithm::chunk;
        make_layer<double>(comm, c);
      },
      {"rank 1's tokens [8, 16) start 8 tokens into their sequence"});
}

// Per call: a scale that differs, or one rank's inputs of the wrong length.
TEST(Layer, CallsAgreeOnTheirArguments) {
  const Shape s{1, 64, 2, 2, 8, 8};
  const Data d = make_data(s, 3);
  for (const std::size_t width : {1, 2}) {
    expect_every_rank_names(
        2,
        [&](const std::shared_ptr<Communicator>& comm) {
          LayerConfig c = config_for(s, {});
          c.ulysses = width;
          auto layer = make_layer<double>(comm, c);
          Shape ls = layer->local_shape();
          if (comm->rank() == 1) ls.tokens -= 1;  // one token short
          std::vector<double> o(ls.tokens * 16);
          const std::size_t at = comm->rank() * 32;
          const kda::Inputs<double> in{d.q.data() + at * 16, d.k.data() + at * 16, d.v.data() + at * 16,
                                       d.g.data() + at * 16, d.beta.data() + at * 2, ls, 0.25};
          layer->forward(in, {}, o.data(), {});
        },
        {"rank 1"});
    expect_every_rank_names(
        2,
        [&](const std::shared_ptr<Communicator>& comm) {
          LayerConfig c = config_for(s, {});
          c.ulysses = width;
          auto layer = make_layer<double>(comm, c);
          const Shape ls = layer->local_shape();
          std::vector<double> o(ls.tokens * 16);
          const std::size_t at = comm->rank() * 32;
          const kda::Inputs<double> in{d.q.data() + at * 16, d.k.data() + at * 16, d.v.data() + at * 16,
                                       d.g.data() + at * 16, d.beta.data() + at * 2, ls,
                                       comm->rank() == 0 ? 0.25 : 0.5};
          layer->forward(in, {}, o.data(), {});
        },
        {"scale: rank 0 has 0.25, rank 1 has 0.5"});
  }
}

}  // namespace
}  // namespace kdacp
