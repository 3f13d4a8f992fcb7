#include "kdacp/job.hpp"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <sstream>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "core/buffer_allocator.hpp"
#include "kdacp/admission.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"
#include "kdacp/inprocess.hpp"
#include "kdacp/kda_ulysses.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/thread_pool.hpp"
#include "kda/sequences.hpp"

namespace kdacp::job {

kda::Layout make_layout(bool zigzag, std::span<const std::size_t> counts, std::size_t tokens, std::size_t ranks) {
  if (!zigzag) return kda::Layout::contiguous(tokens, ranks, counts);
  if (!counts.empty())
    throw InvalidArgument("the zigzag layout takes no per-rank token counts (they apply to the contiguous layout)");
  return kda::Layout::zigzag(tokens, ranks);
}

namespace {

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}

std::string count_text(const char* name, std::size_t got, std::size_t want, const char* what) {
  std::ostringstream s;
  s << name << " has " << got << " elements, expected " << want << " (" << what << ")";
  return s.str();
}

// Optional [N,HV,K,V] states: absent when the vector is empty.
template <class T>
kda::SequenceStates<const T> states_of(const std::vector<T>& x, const kda::Sequences& seqs, const kda::Shape& s) {
  return x.empty() ? kda::SequenceStates<const T>{} : kda::sequence_states(x.data(), seqs, s);
}
template <class T>
kda::SequenceStates<T> states_of(std::vector<T>& x, const kda::Sequences& seqs, const kda::Shape& s) {
  return x.empty() ? kda::SequenceStates<T>{} : kda::sequence_states(x.data(), seqs, s);
}

// Token fields of the layer, with the inner size (elements per token and row)
// of each: o, dq, dk, dv, dg, dbeta.
std::vector<std::size_t> output_inners(const kda::Shape& s, bool grads) {
  std::vector<std::size_t> inner{s.value_heads * s.value_dim};
  if (grads)
    for (std::size_t x : {s.heads * s.key_dim, s.heads * s.key_dim, s.value_heads * s.value_dim,
                          s.value_heads * s.key_dim, s.value_heads})
      inner.push_back(x);
  return inner;
}

template <class T>
std::vector<std::vector<T>*> token_outputs(LayerOutputs<T>& r) {
  std::vector<std::vector<T>*> out{&r.o};
  if (!r.dq.empty())
    for (auto* f : {&r.dq, &r.dk, &r.dv, &r.dg, &r.dbeta}) out.push_back(f);
  return out;
}

// Copies a rank's parts out of a whole [B,T,inner] tensor into its local
// [B,T_local,inner] one, at `local` (and back, for outputs).
template <class T>
void take_parts(const T* full, std::size_t batch, std::size_t tokens, std::size_t inner,
                const std::vector<kda::Part>& parts, std::size_t local_tokens, T* local) {
  for (std::size_t b = 0; b < batch; ++b)
    for (const kda::Part& p : parts)
      std::copy_n(full + (b * tokens + p.begin) * inner, (p.end - p.begin) * inner,
                  local + (b * local_tokens + p.local_begin) * inner);
}
template <class T>
void put_parts(const T* local, std::size_t batch, std::size_t tokens, std::size_t inner,
               const std::vector<kda::Part>& parts, std::size_t local_tokens, T* full) {
  for (std::size_t b = 0; b < batch; ++b)
    for (const kda::Part& p : parts)
      std::copy_n(local + (b * local_tokens + p.local_begin) * inner, (p.end - p.begin) * inner,
                  full + (b * tokens + p.begin) * inner);
}

// Tag of the messages that bring each rank's outputs to rank 0; the layer's
// own messages are all complete by then.
constexpr int kOutputsTag = 7411;

// Times each rank reports: forward, backward, their exchanges, their
// summary / G passes.
constexpr std::size_t kTimes = 6;

// Where rank `rank`'s local tokens start in the whole stream when they are
// one range of it that a pointer can stand for: [B,T_local,inner] at
// full + offset·inner is then the rank's local tensor (B = 1, or the rank
// holds every token in place). nullopt otherwise (zigzag, B > 1 on P > 1).
std::optional<std::size_t> in_place_offset(const kda::Shape& s, const kda::Layout& layout, std::size_t rank) {
  const std::vector<kda::Part> parts = layout.local_parts(rank);
  const std::size_t offset = parts.empty() ? 0 : parts.front().begin - parts.front().local_begin;
  for (const kda::Part& p : parts)
    if (p.begin - p.local_begin != offset) return std::nullopt;
  if (s.batch != 1 && (offset != 0 || layout.local_tokens(rank) != s.tokens)) return std::nullopt;
  return offset;
}

}  // namespace

template <class T>
kda::Sequences LayerJob<T>::sequences() const {
  const kda::Shape& s = data.shape;
  kda::validate(s);
  kda::Sequences seqs = cu_seqlens.empty() ? kda::Sequences(s.batch, s.tokens)
                                           : kda::Sequences(s.batch, s.tokens, std::span(cu_seqlens));
  const std::size_t n = seqs.count() * s.value_heads * s.key_dim * s.value_dim;
  if (!h0.empty() && h0.size() != n) throw InvalidArgument(count_text("h0", h0.size(), n, "[N,HV,K,V]"));
  if (!dht.empty() && dht.size() != n) throw InvalidArgument(count_text("dht", dht.size(), n, "[N,HV,K,V]"));
  if (!d_o.empty() && d_o.size() != s.v_elems())
    throw InvalidArgument(count_text("do", d_o.size(), s.v_elems(), "[B,T,HV,V]"));
  return seqs;
}

template <class T>
std::size_t LayerJob<T>::state_elems() const {
  const kda::Shape& s = data.shape;
  const std::size_t n = cu_seqlens.empty() ? s.batch : cu_seqlens.size() - 1;
  return n * s.value_heads * s.key_dim * s.value_dim;
}

namespace {
// Outputs of `s`: the gradients with `grads`; ht (and dh0 with grads) of
// `states` elements.
template <class T>
LayerOutputs<T> outputs_for(const kda::Shape& s, bool grads, std::size_t states) {
  LayerOutputs<T> r;
  // Zeroed (callers rely on it), in huge pages where large.
  auto zeros = [](std::vector<T>& x, std::size_t n) {
    x.reserve(n);
    detail::advise_huge_pages(x.data(), n * sizeof(T));
    x.resize(n);
  };
  zeros(r.o, s.v_elems());
  if (grads) {
    zeros(r.dq, s.qk_elems());
    zeros(r.dk, s.qk_elems());
    zeros(r.dv, s.v_elems());
    zeros(r.dg, s.g_elems());
    zeros(r.dbeta, s.beta_elems());
  }
  zeros(r.ht, states);
  if (grads) zeros(r.dh0, states);
  return r;
}
}  // namespace

template <class T>
LayerOutputs<T> allocate_outputs(const LayerJob<T>& job) {
  return outputs_for<T>(job.data.shape, job.grads(), job.final_states ? job.state_elems() : 0);
}

template <class T>
LayerOutputs<T> run_single(const LayerJob<T>& job, std::size_t threads) {
  const kda::Sequences seqs = job.sequences();
  const kda::Shape& s = job.data.shape;
  LayerOutputs<T> r = allocate_outputs(job);
  r.method = "single";
  auto in = job.data.inputs(job.scale);
  ThreadPool pool(threads);
  // The one-process strategy of the same config the ranks run.
  LayerConfig config = layer_config(job, LayerRunOptions{});
  config.pool = &pool;
  const std::unique_ptr<Layer<T>> layer = make_layer<T>(nullptr, config);
  for (std::size_t step = 0; step <= job.warmup_steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    const std::shared_ptr<LayerSaved> saved =
        layer->forward(in, states_of(job.h0, seqs, s), r.o.data(), states_of(r.ht, seqs, s));
    r.forward_seconds = since(t0);
    r.phases.forward = r.forward_seconds;
    if (job.grads()) {
      t0 = std::chrono::steady_clock::now();
      layer->backward(in, *saved, states_of(job.h0, seqs, s), job.d_o.data(), states_of(job.dht, seqs, s),
                      kda::Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), nullptr},
                      states_of(r.dh0, seqs, s));
      r.backward_seconds = since(t0);
      r.phases.backward = r.backward_seconds;
    }
  }
  return r;
}

// The layer's config for `job` run with `options`: one config, whatever the
// strategy (kdacp/layer.hpp).
template <class T>
LayerConfig layer_config(const LayerJob<T>& job, const LayerRunOptions& options) {
  LayerConfig c;
  c.shape = job.data.shape;
  c.cu_seqlens = job.cu_seqlens;
  c.layout = options.layout_kind;
  c.split = options.split;
  c.parts = options.layout;
  if (job.storage) {
    c.storage.fill(job.storage);
    c.out_storage = job.storage;
  }
  c.algorithm = job.algorithm;
  c.deterministic = job.deterministic;
  c.keep_forward = job.keep_forward && job.grads();
  c.protocol = options.method;
  c.group_size = options.group_size;
  c.exchange = options.exchange;
  c.ulysses = options.ulysses;
  c.extra = options.agree;
  c.names = options.names;
  return c;
}


namespace {

// Rank r > 0 sends its token outputs `fields` (o, dq, ... of `inners`
// elements per token, [B,T_local,inner] each) to rank 0, which puts them
// into `whole` in the global layout: true on the ranks that sent.
template <class T>
bool gather_outputs(Communicator& comm, const kda::Layout& layout, const kda::Shape& s,
                    const std::vector<std::size_t>& inners, const std::vector<T*>& fields, LayerOutputs<T>* whole) {
  const std::size_t local_tokens = layout.local_tokens(comm.rank());
  if (comm.rank() != 0) {
    std::size_t n = 0;
    for (std::size_t inner : inners) n += s.batch * local_tokens * inner;
    std::vector<T> packed;
    packed.reserve(n);
    for (std::size_t i = 0; i < inners.size(); ++i)
      packed.insert(packed.end(), fields[i], fields[i] + s.batch * local_tokens * inners[i]);
    comm.isend(std::as_bytes(std::span(packed)), 0, kOutputsTag)->wait();
    return true;
  }
  const std::vector<std::vector<T>*> full = token_outputs(*whole);
  for (std::size_t from = 1; from < comm.size(); ++from) {
    const std::vector<kda::Part> their = layout.local_parts(from);
    const std::size_t lt = layout.local_tokens(from);
    std::size_t n = 0;
    for (std::size_t inner : inners) n += s.batch * lt * inner;
    // Filled whole by the message: rank `from` packs exactly n elements of
    // the same layout.
    const std::unique_ptr<T[]> packed(new T[n]);
    comm.irecv(std::as_writable_bytes(std::span(packed.get(), n)), from, kOutputsTag)->wait();
    const T* at = packed.get();
    for (std::size_t i = 0; i < inners.size(); ++i) {
      put_parts(at, s.batch, s.tokens, inners[i], their, lt, full[i]->data());
      at += s.batch * lt * inners[i];
    }
  }
  return false;
}

// The result's times: each phase's slowest rank, and the phases of the rank
// whose forward + backward took longest. `all` holds kTimes per rank: forward,
// backward, their exchanges, their summary / G passes.
template <class T>
void slowest_times(const std::vector<double>& all, std::size_t ranks, LayerOutputs<T>& r) {
  r.forward_seconds = r.backward_seconds = r.exchange_seconds = r.summary_seconds = 0;
  double slowest = -1;
  for (std::size_t q0 = 0; q0 < ranks; ++q0) {
    const double* t = &all[kTimes * q0];
    r.forward_seconds = std::max(r.forward_seconds, t[0]);
    r.backward_seconds = std::max(r.backward_seconds, t[1]);
    r.exchange_seconds = std::max(r.exchange_seconds, t[2] + t[3]);
    r.summary_seconds = std::max(r.summary_seconds, t[4] + t[5]);
    if (t[0] + t[1] > slowest) {
      slowest = t[0] + t[1];
      r.phases = LayerPhases{t[4], t[5], t[2] + t[3], t[0] - t[4] - t[2], t[1] - t[5] - t[3], q0};
    }
  }
}

}  // namespace

template <class T>
std::optional<LayerOutputs<T>> run_context_parallel(const std::shared_ptr<Communicator>& world,
                                                    const LayerJob<T>& job, const LayerRunOptions& options,
                                                    LayerOutputs<T>* shared) {
  Communicator& comm = *world;
  const std::size_t ranks = comm.size(), rank = comm.rank();
  const kda::Shape& s = job.data.shape;
  // The job's own checks (every process holds the same job), then the
  // layer's one validation and agreement, before the first message.
  const kda::Sequences seqs = job.sequences();
  ThreadPool pool(options.threads_per_rank);
  LayerConfig config = layer_config(job, options);
  config.pool = &pool;
  const std::unique_ptr<Layer<T>> layer = make_layer<T>(world, config);
  const kda::Layout& layout = layer->layout();

  const std::vector<kda::Part> parts = layout.local_parts(rank);
  kda::Shape ls = s;
  ls.tokens = layout.local_tokens(rank);
  const bool grads = job.grads();
  const std::size_t states = job.final_states ? job.state_elems() : 0;
  // Where this rank's tokens are one range of the stream (one rank; B = 1
  // with a contiguous layout), it reads the job's arrays and writes the
  // whole outputs in place: a copy of each would be as much memory again,
  // and fresh pages to fault in on every run.
  const std::optional<std::size_t> offset = in_place_offset(s, layout, rank);
  // Otherwise a copy of this rank's parts, which cover its local tokens
  // exactly: take_parts writes every element, so none is zeroed first.
  std::vector<std::unique_ptr<T[]>> copies;
  auto local = [&](const std::vector<T>& full, std::size_t inner) -> const T* {
    if (full.empty()) return full.data();
    if (offset) return full.data() + *offset * inner;
    copies.emplace_back(new T[s.batch * ls.tokens * inner]);
    take_parts(full.data(), s.batch, s.tokens, inner, parts, ls.tokens, copies.back().get());
    return copies.back().get();
  };
  const std::size_t qk = s.heads * s.key_dim, vv = s.value_heads * s.value_dim, gk = s.value_heads * s.key_dim;
  const T *q = local(job.data.q, qk), *k = local(job.data.k, qk), *v = local(job.data.v, vv),
          *g = local(job.data.g, gk), *beta = local(job.data.beta, s.value_heads);
  const T* d_o = grads ? local(job.d_o, vv) : nullptr;
  const kda::Inputs<T> in{q, k, v, g, beta, ls, job.scale};
  // ht's gradient is the sum over ranks of each rank's dht: rank 0 carries
  // the job's, the others zero, so the sum is the job's dht bit for bit.
  const std::vector<T> dht = job.dht.empty() || rank == 0 ? job.dht : std::vector<T>(job.dht.size());

  // The whole outputs: the caller's (in-process ranks), else rank 0's own,
  // allocated before the run so that its tokens are written in place.
  LayerOutputs<T> gathered;
  if (!shared && rank == 0) gathered = allocate_outputs(job);
  LayerOutputs<T>* whole = shared ? shared : rank == 0 ? &gathered : nullptr;
  const bool in_place = offset && whole != nullptr;
  // This rank's ht and dh0 (every rank's are the stream's: the layer shares
  // them), and its token outputs where they are not written in place.
  kda::Shape held = ls;
  if (in_place) held.tokens = 0;
  LayerOutputs<T> lr = outputs_for<T>(held, grads, states);
  const std::vector<std::size_t> inners = output_inners(s, grads);
  std::vector<T*> fields;  // o, dq, dk, dv, dg, dbeta: this rank's [B,T_local,inner]
  if (in_place) {
    const std::vector<std::vector<T>*> full = token_outputs(*whole);
    for (std::size_t i = 0; i < inners.size(); ++i) fields.push_back(full[i]->data() + *offset * inners[i]);
  } else {
    for (std::vector<T>* f : token_outputs(lr)) fields.push_back(f->data());
  }

  // forward, backward, their exchanges, the summary, the G pass.
  double times[kTimes] = {0, 0, 0, 0, 0, 0};
  for (std::size_t step = 0; step <= job.warmup_steps; ++step) {
    comm.barrier();
    auto t0 = std::chrono::steady_clock::now();
    const std::shared_ptr<LayerSaved> saved =
        layer->forward(in, states_of(job.h0, seqs, ls), fields[0], states_of(lr.ht, seqs, ls));
    times[0] = since(t0);
    times[2] = layer->forward_times().exchange;
    times[4] = layer->forward_times().summary;
    if (grads) {
      comm.barrier();
      t0 = std::chrono::steady_clock::now();
      layer->backward(in, *saved, states_of(job.h0, seqs, ls), d_o, states_of(dht, seqs, ls),
                      kda::Grads<T>{fields[1], fields[2], fields[3], fields[4], fields[5], nullptr},
                      states_of(lr.dh0, seqs, ls));
      times[1] = since(t0);
      times[3] = layer->backward_times().exchange;
      times[5] = layer->backward_times().summary;
    }
  }
  copies.clear();  // the input copies are done with

  // The slowest rank's times, then every rank's outputs into the whole ones.
  std::vector<double> all_times(kTimes * ranks);
  std::copy_n(times, kTimes, all_times.begin() + static_cast<std::ptrdiff_t>(kTimes * rank));
  comm.all_gather(std::as_writable_bytes(std::span(all_times)));
  if (whole != nullptr && !in_place) {
    const std::vector<std::vector<T>*> full = token_outputs(*whole);
    for (std::size_t i = 0; i < inners.size(); ++i)
      put_parts(fields[i], s.batch, s.tokens, inners[i], parts, ls.tokens, full[i]->data());
    for (std::vector<T>* f : token_outputs(lr)) std::vector<T>().swap(*f);  // in the whole outputs now
  }
  if (shared) {
    comm.barrier();  // every rank's tokens are in *shared
    if (rank != 0) return std::nullopt;
  } else {
    const bool sent = gather_outputs(comm, layout, s, inners, fields, whole);
    for (std::vector<T>* f : token_outputs(lr)) std::vector<T>().swap(*f);  // sent or in the whole outputs
    if (sent) return std::nullopt;
  }
  LayerOutputs<T>& r = *whole;
  r.ht = std::move(lr.ht);
  r.dh0 = std::move(lr.dh0);
  slowest_times(all_times, ranks, r);
  r.method = layer->method();
  r.exact = layer->exact();
  r.ulysses = layer->ulysses_width();
  r.backend = comm.backend();
  r.ranks = ranks;
  if (shared) return std::nullopt;
  return gathered;
}

template <class T>
LayerOutputs<T> run_context_parallel(const LayerJob<T>& job, std::size_t ranks, const LayerRunOptions& options,
                                     double timeout_s) {
  // One whole outputs that every rank writes its tokens into: it outlives
  // the ranks' threads, which run_in_process joins even when one fails.
  // The job is checked first (as every rank checks it), so that no shape
  // it refuses is allocated.
  job.sequences();
  LayerOutputs<T> result = allocate_outputs(job);
  InProcessOptions opts;
  opts.timeout = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));
  run_in_process(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    run_context_parallel(comm, job, options, &result);
  }, opts);
  return result;
}

bool layer_in_place(const kda::Shape& s, const kda::Layout& layout) {
  for (std::size_t r = 0; r < layout.ranks(); ++r)
    if (!in_place_offset(s, layout, r)) return false;
  return true;
}

template LayerConfig layer_config<float>(const LayerJob<float>&, const LayerRunOptions&);
template LayerConfig layer_config<double>(const LayerJob<double>&, const LayerRunOptions&);
template struct LayerJob<float>;
template struct LayerJob<double>;
template LayerOutputs<float> allocate_outputs<float>(const LayerJob<float>&);
template LayerOutputs<double> allocate_outputs<double>(const LayerJob<double>&);
template LayerOutputs<float> run_single<float>(const LayerJob<float>&, std::size_t);
template LayerOutputs<double> run_single<double>(const LayerJob<double>&, std::size_t);
template std::optional<LayerOutputs<float>> run_context_parallel<float>(const std::shared_ptr<Communicator>&,
                                                                        const LayerJob<float>&,
                                                                        const LayerRunOptions&,
                                                                        LayerOutputs<float>*);
template std::optional<LayerOutputs<double>> run_context_parallel<double>(const std::shared_ptr<Communicator>&,
                                                                          const LayerJob<double>&,
                                                                          const LayerRunOptions&,
                                                                          LayerOutputs<double>*);
template LayerOutputs<float> run_context_parallel<float>(const LayerJob<float>&, std::size_t,
                                                         const LayerRunOptions&, double);
template LayerOutputs<double> run_context_parallel<double>(const LayerJob<double>&, std::size_t,
                                                           const LayerRunOptions&, double);

}  // namespace kdacp::job
