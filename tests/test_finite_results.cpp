// Non-finite results: float32 overflow from finite inputs raises
// NumericalError naming the tensor on every rank, in the forward and the
// backward, unless check_finite is off; the pool's scan names the first
// element.
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
namespace kda {
namespace {

using test::filled;

struct FloatRun {
  std::vector<float> o, dq;
  std::string forward_error, backward_error;  // NumericalError messages
};

// The float32 layer on `ranks` ranks over one sequence per row, with
// v = v_value and d_o = do_value everywhere (finite inputs).
std::vector<FloatRun> run_float(std::size_t ranks, float v_value, float do_value, bool check, bool stream) {
  std::vector<FloatRun> out(ranks);
  InProcessOptions opts;
  opts.timeout = std::chrono::milliseconds(20000);
  run_in_process(
      ranks,
      [&](const std::shared_ptr<Communicator>& comm) {
        const std::size_t r = comm->rank();
        auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
        LayerChecks checks;
        checks.check_finite = check;
        ContextParallelLayer<float> layer(mesh, "p2p", 1, {}, kda::Exec{{nullptr, KernelKind::best}, Algorithm::chunk},
                                          checks);
        const Stream st = layer.contiguous_stream(1, kTokens);
        Shape ls = kShape;
        ls.tokens = st.layout.local_tokens(r);
        const std::vector<float> q = filled<float>(ls.qk_elems(), 0.5, 1, 1), k = filled<float>(ls.qk_elems(), 0.2, 0.25, 2),
                                 g = filled<float>(ls.g_elems(), -0.01, 0, 4),
                                 beta = filled<float>(ls.beta_elems(), 0.1, 0.2, 5);
        const std::vector<float> v(ls.v_elems(), v_value), d_o(ls.v_elems(), do_value);
        const Inputs<float> in{q.data(), k.data(), v.data(), g.data(), beta.data(), ls, 1.0f};
        FloatRun& mine = out[r];
        mine.o.resize(ls.v_elems());
        mine.dq.resize(ls.qk_elems());
        std::vector<float> dk(ls.qk_elems()), dv(ls.v_elems()), dg(ls.g_elems()), dbeta(ls.beta_elems());
        const Grads<float> grads{mine.dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data()};
        try {
          if (stream) {
            const Saved saved = layer.forward(in, st, {}, mine.o.data(), {});
            try {
              layer.backward(in, saved, {}, d_o.data(), {}, grads, {});
            } catch (const NumericalError& e) {
              mine.backward_error = e.what();
            }
          } else {
            const Saved saved = layer.forward(in, mine.o.data());
            try {
              layer.backward(in, saved, d_o.data(), grads);
            } catch (const NumericalError& e) {
              mine.backward_error = e.what();
            }
          }
        } catch (const NumericalError& e) {
          mine.forward_error = e.what();
        }
      },
      opts);
  return out;
}

bool all_finite(const std::vector<float>& x) {
  for (float e : x)
    if (!std::isfinite(e)) return false;
  return true;
}

TEST(FiniteResults, Float32OverflowInTheForwardIsAnError) {
  for (const bool stream : {true, false})
    for (const std::size_t ranks : {1u, 2u}) {
      const auto out = run_float(ranks, 3e38f, 1.0f, true, stream);
      for (std::size_t r = 0; r < ranks; ++r) {
        const std::string& m = out[r].forward_error;
        SCOPED_TRACE("ranks " + std::to_string(ranks) + " rank " + std::to_string(r) + (stream ? " stream" : ""));
        EXPECT_NE(m.find("kda::ContextParallelLayer::forward on rank " + std::to_string(r) + ": o["),
                  std::string::npos)
            << m;
        EXPECT_NE(m.find("a non-finite result from finite inputs"), std::string::npos) << m;
      }
    }
}

TEST(FiniteResults, TheCheckCanBeTurnedOff) {
  const auto out = run_float(2, 3e38f, 1.0f, false, true);
  for (const FloatRun& r : out) {
    EXPECT_EQ(r.forward_error, "");
    EXPECT_FALSE(all_finite(r.o));  // the overflow is there, unreported
  }
}

TEST(FiniteResults, Float32OverflowInTheBackwardIsAnError) {
  for (const bool stream : {true, false}) {
    const auto out = run_float(2, 1.0f, 3e38f, true, stream);
    for (std::size_t r = 0; r < out.size(); ++r) {
      EXPECT_EQ(out[r].forward_error, "");
      const std::string& m = out[r].backward_error;
      EXPECT_NE(m.find("kda::ContextParallelLayer::backward on rank " + std::to_string(r) + ": d"), std::string::npos)
          << m;
      EXPECT_NE(m.find("a non-finite result from finite inputs"), std::string::npos) << m;
    }
    const auto off = run_float(2, 1.0f, 3e38f, false, stream);
    for (const FloatRun& r : off) {
      EXPECT_EQ(r.backward_error, "");
      EXPECT_FALSE(all_finite(r.dq));
    }
  }
}

// With a pool the scan runs in blocks on several threads: the element named
// must still be the first non-finite one. Overflow only from token 1500 on,
// so o's first bad element lies in a later block than the first.
TEST(FiniteResults, ThePoolsScanNamesTheFirstElement) {
  const std::size_t tokens = 2048, first_big = 1500;
  Shape s = kShape;
  s.tokens = tokens;
  const std::vector<float> q = filled<float>(s.qk_elems(), 0.5, 1, 1), k = filled<float>(s.qk_elems(), 0.2, 0.25, 2),
                           g = filled<float>(s.g_elems(), -0.01, 0, 4), beta = filled<float>(s.beta_elems(), 0.1, 0.2, 5);
  std::vector<float> v(s.v_elems(), 1.0f);
  std::fill(v.begin() + static_cast<std::ptrdiff_t>(first_big * s.value_heads * s.value_dim), v.end(), 3e38f);
  const Inputs<float> in{q.data(), k.data(), v.data(), g.data(), beta.data(), s, 1.0f};
  auto run = [&](bool check, std::vector<float>& o) {
    std::string error;
    run_in_process(1, [&](const std::shared_ptr<Communicator>& comm) {
      ThreadPool pool(3);
      auto mesh = DeviceMesh::create(comm, {1}, {"cp"});
      LayerChecks checks;
      checks.check_finite = check;
      ContextParallelLayer<float> layer(mesh, "p2p", 1, {}, kda::Exec{{&pool, KernelKind::best}, Algorithm::chunk},
                                        checks);
      try {
        layer.forward(in, layer.contiguous_stream(1, tokens), {}, o.data(), {});
      } catch (const NumericalError& e) {
        error = e.what();
      }
    });
    return error;
  };
  std::vector<float> o(s.v_elems());
  EXPECT_EQ(run(false, o), "");
  const auto first = find_non_finite(std::span<const float>(o));
  ASSERT_TRUE(first.has_value());
  EXPECT_GE(*first, first_big * s.value_heads * s.value_dim);
  const std::string want = "o" + index_string(*first, {1, tokens, s.value_heads, s.value_dim}) + " = ";
  const std::string got = run(true, o);
  EXPECT_NE(got.find(want), std::string::npos) << got << "\nexpected: " << want;
}

TEST(FiniteResults, OrdinaryInputsPass) {
  const auto out = run_float(2, 1.0f, 1.0f, true, true);
  for (const FloatRun& r : out) {
    EXPECT_EQ(r.forward_error, "");
    EXPECT_EQ(r.backward_error, "");
    EXPECT_TRUE(all_finite(r.o));
    EXPECT_TRUE(all_finite(r.dq));
  }
}

}  // namespace
}  // namespace kda
}  // namespace kdacp
