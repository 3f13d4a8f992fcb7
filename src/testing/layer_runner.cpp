#include "kdacp/testing/layer_runner.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <utility>

#include "kdacp/admission.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/testing/reference.hpp"
#include "kdacp/thread_pool.hpp"

namespace kdacp::testing {

template <class T>
LayerOutputs<T> allocate_outputs(const kda::Shape& s, bool grads) {
  LayerOutputs<T> r;
  r.o.resize(s.v_elems());
  if (grads) {
    r.dq.resize(s.qk_elems());
    r.dk.resize(s.qk_elems());
    r.dv.resize(s.v_elems());
    r.dg.resize(s.g_elems());
    r.dbeta.resize(s.beta_elems());
  }
  return r;
}

namespace {
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

template <class T>
LayerOutputs<T> run_single(const kda::LayerData<T>& data, T scale, const std::vector<T>* d_o,
                           std::size_t threads) {
  LayerOutputs<T> r = allocate_outputs<T>(data.shape, d_o != nullptr);
  r.method = "single";
  const auto in = data.inputs(scale);
  ThreadPool pool(threads);
  const ExecPolicy exec{&pool};
  auto t0 = std::chrono::steady_clock::now();
  kda::forward(in, nullptr, r.o.data(), nullptr, exec);
  r.forward_seconds = since(t0);
  if (d_o) {
    t0 = std::chrono::steady_clock::now();
    kda::backward(in, nullptr, d_o->data(), nullptr,
                  kda::Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), nullptr},
                  exec);
    r.backward_seconds = since(t0);
  }
  return r;
}

template <class T>
LayerOutputs<T> run_context_parallel(const kda::LayerData<T>& data, T scale,
                                     const std::vector<T>* d_o, std::size_t ranks,
                                     const std::string& method, long long group_size,
                                     std::size_t threads_per_rank, double timeout_s,
                                     ExchangeOptions options) {
  const kda::Shape& s = data.shape;
  if (!options.expected_shape) options.expected_shape = layer_summary_shape(s);
  LayerOutputs<T> r = allocate_outputs<T>(s, d_o != nullptr);
  std::mutex mu;
  InProcessOptions opts;
  opts.timeout = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    const std::size_t rank = comm->rank();
    const kda::TokenSplit range = kda::split_tokens(s.tokens, ranks, rank);
    const kda::LayerData<T> local = data.slice(range);
    const kda::Shape& ls = local.shape;
    auto mesh = DeviceMesh::create(comm, {ranks}, {"cp"});
    ThreadPool pool(threads_per_rank);
    kda::ContextParallelLayer<T> layer(mesh, method, group_size, options,
                                       ExecPolicy{&pool, options.exec.kernel});
    const auto in = local.inputs(scale);
    LayerOutputs<T> lr = allocate_outputs<T>(ls, d_o != nullptr);
    comm->barrier();
    auto t0 = std::chrono::steady_clock::now();
    const kda::Saved saved = layer.forward(in, lr.o.data());
    const double tf = since(t0);
    double tb = 0, exch = layer.forward_times().exchange;
    if (d_o) {
      std::vector<T> ldo(ls.v_elems());
      kda::slice_tokens(d_o->data(), s.batch, s.tokens, s.value_heads * s.value_dim, range, ldo.data());
      comm->barrier();
      t0 = std::chrono::steady_clock::now();
      layer.backward(in, saved, ldo.data(),
                     kda::Grads<T>{lr.dq.data(), lr.dk.data(), lr.dv.data(), lr.dg.data(), lr.dbeta.data(), nullptr});
      tb = since(t0);
      exch += layer.backward_times().exchange;
    }
    // Token ranges are disjoint: each rank writes its own part.
    auto put = [&](const std::vector<T>& local_v, std::vector<T>& full, std::size_t inner) {
      if (!local_v.empty()) kda::unslice_tokens(local_v.data(), s.batch, s.tokens, inner, range, full.data());
    };
    put(lr.o, r.o, s.value_heads * s.value_dim);
    put(lr.dq, r.dq, s.heads * s.key_dim);
    put(lr.dk, r.dk, s.heads * s.key_dim);
    put(lr.dv, r.dv, s.value_heads * s.value_dim);
    put(lr.dg, r.dg, s.value_heads * s.key_dim);
    put(lr.dbeta, r.dbeta, s.value_heads);
    std::lock_guard lock(mu);
    r.forward_seconds = std::max(r.forward_seconds, tf);
    r.backward_seconds = std::max(r.backward_seconds, tb);
    r.exchange_seconds = std::max(r.exchange_seconds, exch);
    if (rank == 0) {
      r.method = layer.exchange().method();
      r.exact = layer.exchange().exact();
    }
  }, opts);
  return r;
}

double layer_output_bytes(const kda::Shape& s, bool grads, std::size_t elem_bytes) {
  // In double: a shape too large for size_t products must still be refused.
  const double bt = double(s.batch) * double(s.tokens), hv = double(s.value_heads);
  const double qk = bt * double(s.heads) * double(s.key_dim), v = bt * hv * double(s.value_dim);
  const double g = bt * hv * double(s.key_dim), beta = bt * hv;
  return (v + (grads ? 2 * qk + v + g + beta : 0.0)) * double(elem_bytes);
}

double layer_run_bytes(const kda::Shape& s, std::size_t ranks, bool grads, std::size_t elem_bytes,
                       double rank_exchange_bytes) {
  const double state = double(s.batch) * double(s.value_heads) * double(s.key_dim) * double(s.value_dim);
  // The ranks' slices of the inputs (as large as the gradients) and of the
  // outputs, the outputs, checkpoints every 64 tokens, per rank S, M, the
  // incoming state and G.
  const double tensors = layer_output_bytes(s, true, elem_bytes) + 2 * layer_output_bytes(s, grads, elem_bytes);
  const double states = state * (double(s.tokens) / 64 + 5 * double(ranks)) * double(elem_bytes);
  return tensors + states + double(ranks) * rank_exchange_bytes;
}

std::vector<double> relative_errors(const LayerOutputs<float>& got, const LayerOutputs<float>& want) {
  std::vector<double> errs;
  for (auto [a, b] : {std::pair{&got.o, &want.o}, {&got.dq, &want.dq}, {&got.dk, &want.dk},
                      {&got.dv, &want.dv}, {&got.dg, &want.dg}, {&got.dbeta, &want.dbeta}})
    errs.push_back(reference::relative_error(*a, *b));
  return errs;
}

bool same_bits(const LayerOutputs<float>& a, const LayerOutputs<float>& b) {
  auto eq = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  return eq(a.o, b.o) && eq(a.dq, b.dq) && eq(a.dk, b.dk) && eq(a.dv, b.dv) && eq(a.dg, b.dg) &&
         eq(a.dbeta, b.dbeta);
}

SummaryShape layer_summary_shape(const kda::Shape& s) {
  return SummaryShape{s.batch, s.value_heads, s.key_dim, s.value_dim};
}

Progress::Progress(std::string prefix, double quiet_seconds)
    : prefix_(std::move(prefix)), quiet_seconds_(quiet_seconds) {}

void Progress::note(const std::string& what) const {
  const double t = since(t0_);
  if (t > quiet_seconds_) std::fprintf(stderr, "%s: %s (%.1f s elapsed)\n", prefix_.c_str(), what.c_str(), t);
}

ProtocolComparison compare_protocols(const kda::LayerData<float>& data, float scale, const std::vector<float>& d_o,
                                     std::size_t ranks, std::size_t threads_per_rank, double timeout_s,
                                     const Progress& progress) {
  ProtocolComparison cmp;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;
    const std::string method(row->name);
    long long width = 1;
    if (row->takes_group_size) {
      if (ranks < 4 || ranks % 2 != 0) continue;  // needs 1 < w < P dividing P
      width = static_cast<long long>(ranks / 2);
    }
    progress.note("running " + method);
    auto out = run_context_parallel(data, scale, &d_o, ranks, method, width, threads_per_rank, timeout_s);
    cmp.runs.push_back({std::move(out), width, width > 1 ? method + " w=" + std::to_string(width) : method, {}});
  }
  const LayerOutputs<float>* first_exact = nullptr;
  for (ProtocolRun& r : cmp.runs) {
    if (!r.out.exact) continue;
    if (!first_exact) first_exact = &r.out;
    r.bitwise = same_bits(r.out, *first_exact);
    cmp.all_bitwise = cmp.all_bitwise && *r.bitwise;
  }
  return cmp;
}

double compare_protocols_bytes(const kda::Shape& shape, std::size_t ranks) {
  const ProblemShape ps{ranks, shape.batch * shape.value_heads, shape.key_dim, shape.value_dim, sizeof(float)};
  Prediction hungriest;
  std::size_t protocols = 0;
  for (const Prediction& p : predict_all(CostParams{}, ps, true)) {
    ++protocols;
    if (p.peak_extra_bytes >= hungriest.peak_extra_bytes) hungriest = p;
  }
  return double(protocols + 2) * layer_output_bytes(shape, true, sizeof(float)) +
         layer_run_bytes(shape, ranks, true, sizeof(float), exchange_rank_bytes(ps, hungriest));
}

template LayerOutputs<float> allocate_outputs<float>(const kda::Shape&, bool);
template LayerOutputs<double> allocate_outputs<double>(const kda::Shape&, bool);
template LayerOutputs<float> run_single<float>(const kda::LayerData<float>&, float, const std::vector<float>*, std::size_t);
template LayerOutputs<double> run_single<double>(const kda::LayerData<double>&, double, const std::vector<double>*, std::size_t);
template LayerOutputs<float> run_context_parallel<float>(const kda::LayerData<float>&, float, const std::vector<float>*, std::size_t, const std::string&, long long, std::size_t, double, ExchangeOptions);
template LayerOutputs<double> run_context_parallel<double>(const kda::LayerData<double>&, double, const std::vector<double>*, std::size_t, const std::string&, long long, std::size_t, double, ExchangeOptions);

}  // namespace kdacp::testing
