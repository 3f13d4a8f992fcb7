// The context-parallel KDA layer over MPI: each
// process holds its tokens, runs the layer over the MPI CP mesh, and compares
// its slice of o and of every gradient with one device, computed in the same
// process from the same seeded inputs; exact protocols agree bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/mpi.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/job.hpp"
#include "kda_helpers.hpp"

namespace kdacp::kda {
namespace {

using test::alloc;
using test::rel;
template <class T>
using Outputs = test::LayerResult<T>;

template <class T>
std::vector<const std::vector<T>*> fields(const Outputs<T>& r) {
  return {&r.o, &r.dq, &r.dk, &r.dv, &r.dg, &r.dbeta};
}

// One device's outputs, cut to this rank's tokens.
template <class T>
Outputs<T> single_slice(const LayerData<T>& d, const std::vector<T>& d_o, TokenSplit range) {
  const Shape& s = d.shape;
  Outputs<T> full = alloc<T>(s);
  const auto in = d.inputs(default_scale<T>(s.key_dim));
  forward(in, nullptr, full.o.data(), nullptr);
  backward(in, nullptr, d_o.data(), nullptr,
           Grads<T>{full.dq.data(), full.dk.data(), full.dv.data(), full.dg.data(), full.dbeta.data(), nullptr});
  Shape ls = s;
  ls.tokens = range.count;
  Outputs<T> part = alloc<T>(ls);
  slice_tokens(full.o.data(), s.batch, s.tokens, s.value_heads * s.value_dim, range, part.o.data());
  slice_tokens(full.dq.data(), s.batch, s.tokens, s.heads * s.key_dim, range, part.dq.data());
  slice_tokens(full.dk.data(), s.batch, s.tokens, s.heads * s.key_dim, range, part.dk.data());
  slice_tokens(full.dv.data(), s.batch, s.tokens, s.value_heads * s.value_dim, range, part.dv.data());
  slice_tokens(full.dg.data(), s.batch, s.tokens, s.value_heads * s.key_dim, range, part.dg.data());
  slice_tokens(full.dbeta.data(), s.batch, s.tokens, s.value_heads, range, part.dbeta.data());
  return part;
}

template <class T>
void check(double tol) {
  auto comm = mpi_world();
  const std::size_t p = comm->size(), rank = comm->rank();
  // T not a multiple of P, grouped value heads, K != V.
  const Shape shape{1, 37, 1, 2, 16, 32};
  const auto data = synthetic_layer<T>(shape, 21);
  const auto d_o = synthetic_tensor<T>(shape.v_elems(), 22);
  const TokenSplit range = split_tokens(shape.tokens, p, rank);
  const LayerData<T> local = data.slice(range);
  std::vector<T> ldo(local.shape.v_elems());
  slice_tokens(d_o.data(), shape.batch, shape.tokens, shape.value_heads * shape.value_dim, range, ldo.data());
  const Outputs<T> want = single_slice(data, d_o, range);
  const DeviceMesh mesh = DeviceMesh::create(comm, {p}, {"cp"});

  Outputs<T> chain;
  bool have_chain = false;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;
    const std::string name(row->name);
    std::vector<long long> widths{1};
    if (row->takes_group_size)
      for (std::size_t w = 2; w <= p; ++w)
        if (p % w == 0) widths.push_back(static_cast<long long>(w));
    for (long long w : widths) {
      SCOPED_TRACE(name + " w=" + std::to_string(w) + " rank " + std::to_string(rank) + " of " +
                   std::to_string(p));
      ContextParallelLayer<T> layer(mesh, name, w);
      const auto in = local.inputs(default_scale<T>(shape.key_dim));
      Outputs<T> got = alloc<T>(local.shape);
      const Saved saved = layer.forward(in, got.o.data());
      layer.backward(in, saved, ldo.data(),
                     Grads<T>{got.dq.data(), got.dk.data(), got.dv.data(), got.dg.data(), got.dbeta.data(),
                              nullptr});
      const auto g = fields(got), e = fields(want);
      const char* names[] = {"o", "dq", "dk", "dv", "dg", "dbeta"};
      for (std::size_t i = 0; i < g.size(); ++i) EXPECT_LT(rel(*g[i], *e[i]), tol) << names[i];
      if (!layer.exchange().exact()) continue;
      if (!have_chain) {
        chain = got;
        have_chain = true;
        continue;
      }
      const auto c = fields(chain);
      for (std::size_t i = 0; i < g.size(); ++i)
        EXPECT_EQ(std::memcmp(g[i]->data(), c[i]->data(), g[i]->size() * sizeof(T)), 0)
            << names[i] << " differs bitwise from p2p";
    }
  }
}

TEST(MpiKda, DoubleLayerEqualsOneDeviceOverEveryProtocol) { check<double>(1e-12); }
TEST(MpiKda, FloatLayerEqualsOneDeviceAndExactProtocolsAgreeBitwise) { check<float>(2e-5); }

// ------------------------------------------------- packed sequences and layouts

template <class T>
std::vector<std::pair<const char*, const std::vector<T>*>> all_fields(const job::LayerOutputs<T>& r) {
  return {{"o", &r.o},   {"dq", &r.dq},       {"dk", &r.dk}, {"dv", &r.dv},
          {"dg", &r.dg}, {"dbeta", &r.dbeta}, {"ht", &r.ht}, {"dh0", &r.dh0}};
}

// T = 37 in packed sequences [0,5) [5,6) [6,17) [17,30) [30,37) (one of a
// single token), random h0, dht and d_o; grouped value heads, K != V.
template <class T>
job::LayerJob<T> packed_job() {
  const Shape shape{1, 37, 1, 2, 16, 32};
  job::LayerJob<T> job;
  job.data = synthetic_layer<T>(shape, 31);
  job.scale = default_scale<T>(shape.key_dim);
  job.cu_seqlens = {0, 5, 6, 17, 30, 37};
  const std::size_t states = 5 * shape.value_heads * shape.key_dim * shape.value_dim;
  job.h0 = synthetic_tensor<T>(states, 32);
  job.d_o = synthetic_tensor<T>(shape.v_elems(), 33);
  job.dht = synthetic_tensor<T>(states, 34);
  return job;
}

// Layouts of the matrix on P ranks: contiguous with uneven counts (ranks
// r < P-1 hold r + 2 tokens, the last the rest, so sequences span several
// ranks and start or end at rank boundaries) and zigzag.
std::vector<kda::Layout> layouts_for(std::size_t p, std::size_t tokens) {
  std::vector<std::size_t> counts;
  std::size_t used = 0;
  for (std::size_t r = 0; r + 1 < p; ++r) used += counts.emplace_back(r + 2);
  counts.push_back(tokens - used);
  return {kda::Layout::uneven(tokens, p, counts), kda::Layout::zigzag(tokens, p)};
}

// Every exact protocol and width, over MPI, on every layout its registry row
// accepts: the outputs assembled on rank 0 (o, every gradient, ht, dh0) are
// the bits of the same job on in-process ranks and of every other exact
// protocol, and within tol of one device.
template <class T>
void check_sequences(double tol) {
  auto comm = mpi_world();
  const std::size_t p = comm->size();
  const job::LayerJob<T> job = packed_job<T>();
  const job::LayerOutputs<T> single = job::run_single(job, 1);
  for (const kda::Layout& layout : layouts_for(p, job.data.shape.tokens)) {
    std::optional<job::LayerOutputs<T>> chain;
    for (const ProtocolDescriptor* row : protocol_registry()) {
      if (row->chooser() || !row->exact()) continue;
      if (!layout.owners().is_one_per_rank() && !row->takes_layouts) continue;
      std::vector<long long> widths{1};
      if (row->takes_group_size)
        for (std::size_t w = 2; w < p; ++w)
          if (p % w == 0) widths.push_back(static_cast<long long>(w));
      for (long long w : widths) {
        const std::string what = std::string(row->name) + " w=" + std::to_string(w) + ", " + layout.str() +
                                 ", P=" + std::to_string(p);
        SCOPED_TRACE(what);
        job::LayerRunOptions opts;
        opts.method = std::string(row->name);
        opts.group_size = w;
        opts.layout = layout;
        const job::LayerOutputs<T> local = job::run_context_parallel(job, p, opts, 60);
        const auto got = job::run_context_parallel(comm, job, opts);
        if (comm->rank() != 0) {
          EXPECT_FALSE(got.has_value());
          continue;
        }
        ASSERT_TRUE(got.has_value());
        EXPECT_EQ(got->backend, "mpi");
        if (!chain) chain = *got;
        const auto g = all_fields(*got), l = all_fields(local), c = all_fields(*chain), o = all_fields(single);
        for (std::size_t i = 0; i < g.size(); ++i) {
          const auto& [name, x] = g[i];
          ASSERT_EQ(x->size(), o[i].second->size()) << name;
          ASSERT_FALSE(x->empty()) << name;
          EXPECT_EQ(std::memcmp(x->data(), l[i].second->data(), x->size() * sizeof(T)), 0)
              << name << " differs from in-process";
          EXPECT_EQ(std::memcmp(x->data(), c[i].second->data(), x->size() * sizeof(T)), 0)
              << name << " differs from the first exact protocol";
          EXPECT_LT(rel(*x, *o[i].second), tol) << name << " against one device";
        }
      }
    }
  }
}

TEST(MpiKda, DoubleSequencesEveryLayoutBitwiseInProcess) { check_sequences<double>(1e-12); }
TEST(MpiKda, FloatSequencesEveryLayoutBitwiseInProcess) { check_sequences<float>(2e-5); }

}  // namespace
}  // namespace kdacp::kda

namespace kdacp::kda {
namespace {

// Ranks agree before any message (issue 18), over MPI: the last rank calls
// forward with another scale, then (with the same scale) builds its layer
// with another protocol; every rank must throw InvalidArgument naming the
// field and the ranks, and the job must go on (no rank left in a collective).
TEST(MpiKda, DisagreeingRanksFailOnEveryRank) {
  auto comm = mpi_world();
  const std::size_t p = comm->size(), rank = comm->rank(), odd = p - 1;
  std::ostringstream ranks_text;  // the ranks other than `odd`, as the message writes them
  if (p == 2) ranks_text << "rank 0 has";
  else if (p == 3) ranks_text << "ranks 0,1 have";
  else ranks_text << "ranks 0-" << p - 2 << " have";
  const std::string others = ranks_text.str();
  auto mesh = DeviceMesh::create(comm, {p}, {"cp"});
  {
    ContextParallelLayer<double> layer(mesh, "p2p");
    const Shape s{1, 4, 1, 1, 8, 8};
    const std::vector<double> q(s.qk_elems(), 0.5), v(s.v_elems(), 0.5), g(s.g_elems(), -0.1),
        beta(s.beta_elems(), 0.5);
    std::vector<double> o(s.v_elems());
    const Inputs<double> in{q.data(), q.data(), v.data(), g.data(), beta.data(), s, rank == odd ? 0.5 : 0.25};
    try {
      layer.forward(in, o.data());
      ADD_FAILURE() << "rank " << rank << ": no InvalidArgument for a scale that differs on rank " << odd;
    } catch (const InvalidArgument& e) {
      const std::string want = "scale: " + others + " 0.25, rank " + std::to_string(odd) + " has 0.5";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what() << "\nexpected: " << want;
    }
  }
  try {
    ContextParallelLayer<double> layer(mesh, rank == odd ? "allgather" : "p2p");
    ADD_FAILURE() << "rank " << rank << ": no InvalidArgument for a method that differs on rank " << odd;
  } catch (const InvalidArgument& e) {
    const std::string want = "method: " + others + " p2p, rank " + std::to_string(odd) + " has allgather";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what() << "\nexpected: " << want;
  }
  comm->barrier();  // every rank left the agreement: the next collective works
}

}  // namespace
}  // namespace kdacp::kda
