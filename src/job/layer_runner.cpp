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
  const ExecPolicy exec{&pool, KernelKind::best, job.algorithm};
  kda::ForwardCache<T> cache;
  kda::ForwardCache<T>* keep = job.keep_forward && job.grads() ? &cache : nullptr;
  for (std::size_t step = 0; step <= job.warmup_steps; ++step) {
    cache.clear();
    auto t0 = std::chrono::steady_clock::now();
    kda::forward_sequences(in, seqs, states_of(job.h0, seqs, s), r.o.data(), states_of(r.ht, seqs, s), exec,
                           keep);
    r.forward_seconds = since(t0);
    r.phases.forward = r.forward_seconds;
    if (job.grads()) {
      t0 = std::chrono::steady_clock::now();
      kda::backward_sequences(in, seqs, states_of(job.h0, seqs, s), job.d_o.data(), states_of(job.dht, seqs, s),
                              kda::Grads<T>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(),
                                            nullptr},
                              states_of(r.dh0, seqs, s), exec, kda::kDefaultCheckpointInterval, keep);
      r.backward_seconds = since(t0);
      r.phases.backward = r.backward_seconds;
    }
  }
  return r;
}

namespace {

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
  constexpr std::size_t kTimes = 6;
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
  } else if (rank != 0) {
    auto packed_elems = [&] {
      std::size_t n = 0;
      for (std::size_t inner : inners) n += s.batch * ls.tokens * inner;
      return n;
    };
    std::vector<T> packed;
    packed.reserve(packed_elems());
    for (std::size_t i = 0; i < inners.size(); ++i)
      packed.insert(packed.end(), fields[i], fields[i] + s.batch * ls.tokens * inners[i]);
    for (std::vector<T>* f : token_outputs(lr)) std::vector<T>().swap(*f);  // packed holds them now
    comm.isend(std::as_bytes(std::span(packed)), 0, kOutputsTag)->wait();
    return std::nullopt;
  } else {
    const std::vector<std::vector<T>*> full = token_outputs(*whole);
    for (std::size_t from = 1; from < ranks; ++from) {
      const std::vector<kda::Part> their = layout.local_parts(from);
      const std::size_t lt = layout.local_tokens(from);
      std::size_t n = 0;
      for (std::size_t inner : inners) n += s.batch * lt * inner;
      // Filled whole by the message: rank `from` packs exactly n elements
      // of the same layout.
      const std::unique_ptr<T[]> packed(new T[n]);
      comm.irecv(std::as_writable_bytes(std::span(packed.get(), n)), from, kOutputsTag)->wait();
      const T* at = packed.get();
      for (std::size_t i = 0; i < inners.size(); ++i) {
        put_parts(at, s.batch, s.tokens, inners[i], their, lt, full[i]->data());
        at += s.batch * lt * inners[i];
      }
    }
  }
  LayerOutputs<T>& r = *whole;
  r.ht = std::move(lr.ht);
  r.dh0 = std::move(lr.dh0);
  r.forward_seconds = r.backward_seconds = r.exchange_seconds = r.summary_seconds = 0;
  double slowest = -1;
  for (std::size_t q0 = 0; q0 < ranks; ++q0) {
    const double* t = &all_times[kTimes * q0];
    r.forward_seconds = std::max(r.forward_seconds, t[0]);
    r.backward_seconds = std::max(r.backward_seconds, t[1]);
    r.exchange_seconds = std::max(r.exchange_seconds, t[2] + t[3]);
    r.summary_seconds = std::max(r.summary_seconds, t[4] + t[5]);
    if (t[0] + t[1] > slowest) {
      slowest = t[0] + t[1];
      r.phases = LayerPhases{t[4], t[5], t[2] + t[3], t[0] - t[4] - t[2], t[1] - t[5] - t[3], q0};
    }
  }
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

double layer_output_bytes(const kda::Shape& s, bool grads, std::size_t elem_bytes) {
  // In double: a shape too large for size_t products must still be refused.
  const double bt = double(s.batch) * double(s.tokens), hv = double(s.value_heads);
  const double qk = bt * double(s.heads) * double(s.key_dim), v = bt * hv * double(s.value_dim);
  const double g = bt * hv * double(s.key_dim), beta = bt * hv;
  return (v + (grads ? 2 * qk + v + g + beta : 0.0)) * double(elem_bytes);
}



double layer_rank_bytes(const kda::Shape& s, std::size_t sequences, const kda::Layout& layout, bool grads,
                        std::size_t elem_bytes, double rank_exchange_bytes) {
  std::size_t local = 0;
  const std::size_t parts = layout.owners().max_per_rank();
  for (std::size_t r = 0; r < layout.ranks(); ++r) local = std::max(local, layout.local_tokens(r));
  const double share = double(local) / double(s.tokens);
  const double kv = double(s.value_heads) * double(s.key_dim) * double(s.value_dim);
  const double state = double(s.batch) * kv;
  // The largest rank's slices of the inputs and of its outputs, and rank 0's
  // outputs gathered in the global layout.
  const double tensors = share * (layer_output_bytes(s, true, elem_bytes) + layer_output_bytes(s, grads, elem_bytes)) +
                         layer_output_bytes(s, grads, elem_bytes);
  const double states = state * (double(local) / 64 + 5 * double(parts)) * double(elem_bytes);
  const double sequence_states = double(sequences) * kv * 5 * double(elem_bytes);
  return tensors + states + sequence_states + rank_exchange_bytes;
}


std::size_t resolve_ulysses(std::size_t given, const std::string& method, const kda::Shape& s,
                            const kda::Layout& layout, const ExchangeOptions& eo, std::size_t elem_bytes) {
  if (given != kUlyssesAuto) return given;
  if (!find_protocol(method).chooser())
    throw InvalidArgument(fmt::format("Ulysses width auto prices each U with the exact protocol auto chooses, "
                                      "expected protocol auto, got {}",
                                      method));
  return choose_ulysses(s, layout, eo, elem_bytes);
}

void check_ulysses(std::size_t width, std::size_t ranks, const kda::Shape& s) {
  if (width == 0 || ranks % width != 0 || s.heads % width != 0 || s.value_heads % width != 0)
    throw InvalidArgument(fmt::format("Ulysses width U = {}: expected a divisor of P = {}, H = {} and HV = {}", width,
                                      ranks, s.heads, s.value_heads));
}

double ulysses_rank_bytes(const kda::Shape& s, std::size_t sequences, const kda::Layout& layout, std::size_t width,
                          bool grads, std::size_t elem_bytes) {
  if (width <= 1) return 0;
  const kda::Layout group = kda::ulysses_group_layout(layout, width);
  std::size_t own = 0, together = 0;  // the most tokens of one rank, of one group
  for (std::size_t r = 0; r < layout.ranks(); ++r) own = std::max(own, layout.local_tokens(r));
  for (std::size_t c = 0; c < group.ranks(); ++c) together = std::max(together, group.local_tokens(c));
  const double per_token_in = double(s.heads) * 2 * double(s.key_dim) +
                              double(s.value_heads) * (double(s.value_dim) + double(s.key_dim) + 1);
  const double per_token_out = double(s.value_heads) * double(s.value_dim);
  const double b = double(s.batch), u = double(width), e = double(elem_bytes);
  const double slice_in = b * double(together) * per_token_in / u, rank_in = b * double(own) * per_token_in;
  const double slice_out = b * double(together) * per_token_out / u;
  // Kept inputs (and gradients), o (and d_o) slices, send + receive buffers
  // (the largest all-to-all: the inputs'), and per sequence the h0 slice,
  // the ht / dh0 slots and dht's blocks.
  const double tensors = (grads ? 2 : 1) * (slice_in + slice_out) + 2 * std::max(rank_in, slice_in);
  const double states = double(sequences) * double(s.value_heads) * double(s.key_dim) * double(s.value_dim) * 4;
  return (tensors + states) * e;
}

bool layer_in_place(const kda::Shape& s, const kda::Layout& layout) {
  for (std::size_t r = 0; r < layout.ranks(); ++r)
    if (!in_place_offset(s, layout, r)) return false;
  return true;
}

double layer_run_bytes(const kda::Shape& s, std::size_t sequences, std::size_t ranks, bool grads,
                       std::size_t elem_bytes, double rank_exchange_bytes, std::size_t parts, bool in_place) {
  const double kv = double(s.value_heads) * double(s.key_dim) * double(s.value_dim);
  const double state = double(s.batch) * kv;
  // The ranks' slices of the inputs (as large as the gradients) and of the
  // outputs unless in place, the outputs, checkpoints every 64 tokens, per
  // rank S, M, the incoming state and G, and per rank its dht, ht and dh0
  // [N,HV,K,V] beside the job's h0 and dht.
  const double slices =
      in_place ? 0.0 : layer_output_bytes(s, true, elem_bytes) + layer_output_bytes(s, grads, elem_bytes);
  const double tensors = slices + layer_output_bytes(s, grads, elem_bytes);
  const double states = state * (double(s.tokens) / 64 + 5 * double(parts ? parts : ranks)) * double(elem_bytes);
  const double sequence_states = double(sequences) * kv * (3 * double(ranks) + 2) * double(elem_bytes);
  return tensors + states + sequence_states + double(ranks) * rank_exchange_bytes;
}

namespace {

// ||a - b||_F / ||b||_F (||a - b||_F when b is zero); a and b have one size.
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

std::vector<double> relative_errors(const LayerOutputs<float>& got, const LayerOutputs<float>& want) {
  std::vector<double> errs;
  for (auto [a, b] : {std::pair{&got.o, &want.o}, {&got.dq, &want.dq}, {&got.dk, &want.dk},
                      {&got.dv, &want.dv}, {&got.dg, &want.dg}, {&got.dbeta, &want.dbeta}})
    errs.push_back(relative_error(*a, *b));
  if (!got.ht.empty() && !want.ht.empty()) errs.push_back(relative_error(got.ht, want.ht));
  if (!got.dh0.empty() && !want.dh0.empty()) errs.push_back(relative_error(got.dh0, want.dh0));
  return errs;
}

double layer_error_tolerance(const std::string& method, std::size_t ranks, std::size_t key_dim) {
  double bound = 0;
  for (const ProtocolDescriptor* row : protocol_registry())
    if (row->name == method) bound = error_bound(*row, ranks, key_dim);
  return kLayerFloat32Tolerance + bound;
}

std::vector<std::string> errors_above(const std::vector<double>& errors, double tolerance) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < errors.size(); ++i) {
    if (errors[i] <= tolerance) continue;  // false for NaN
    const std::string name = i < kLayerErrorNames.size() ? kLayerErrorNames[i] : "?";
    char value[32] = "nan";
    if (!std::isnan(errors[i])) std::snprintf(value, sizeof value, "%.3g", errors[i]);
    out.push_back(name + " " + value);
  }
  return out;
}

bool same_bits(const LayerOutputs<float>& a, const LayerOutputs<float>& b) {
  auto eq = [](const std::vector<float>& x, const std::vector<float>& y) {
    // memcmp must not see the null data() of an empty vector (ht, dh0 without sequences).
    return x.size() == y.size() &&
           (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
  };
  return eq(a.o, b.o) && eq(a.dq, b.dq) && eq(a.dk, b.dk) && eq(a.dv, b.dv) && eq(a.dg, b.dg) &&
         eq(a.dbeta, b.dbeta) && eq(a.ht, b.ht) && eq(a.dh0, b.dh0);
}


Progress::Progress(std::string prefix, double quiet_seconds)
    : prefix_(std::move(prefix)), quiet_seconds_(quiet_seconds) {}

void Progress::note(const std::string& what) const {
  const double t = since(t0_);
  if (t > quiet_seconds_) std::fprintf(stderr, "%s: %s (%.1f s elapsed)\n", prefix_.c_str(), what.c_str(), t);
}

std::optional<ProtocolComparison> compare_protocols(const std::shared_ptr<Communicator>& world,
                                                    const LayerJob<float>& job, const LayerRunOptions& base,
                                                    const Progress& progress) {
  const bool lead = world->rank() == 0;
  if (!job.grads()) throw InvalidArgument("compare_protocols: the job has no d_o (it compares gradients too)");
  if (base.ulysses == kUlyssesAuto)
    throw InvalidArgument("compare_protocols: Ulysses width auto, expected a width (resolve_ulysses)");
  check_ulysses(base.ulysses, world->size(), job.data.shape);
  // The exchange runs over the head groups (P/U ranks; U = 1: the world).
  const std::size_t ranks = world->size() / base.ulysses;
  const kda::Layout layout = make_layer_layout(layer_config(job, base), world->size());
  // A layout with several parts on a rank, or parts out of rank order, runs
  // only on protocols whose registry row takes layouts.
  const bool plain = kda::ulysses_group_layout(layout, base.ulysses).owners().is_one_per_rank();
  ProtocolComparison cmp;
  for (const ProtocolDescriptor* row : protocol_registry()) {
    if (row->chooser()) continue;
    const std::string method(row->name);
    long long width = 1;
    if (row->takes_group_size) {
      if (ranks < 4 || ranks % 2 != 0) continue;  // needs 1 < w < P dividing P
      width = static_cast<long long>(ranks / 2);
    }
    std::string label = method;
    if (width > 1) label += fmt::format(" w={}", width);
    if (!plain && !row->takes_layouts) {
      cmp.runs.push_back({{}, width, label, {}, "n/a: protocol does not take layouts"});
      continue;
    }
    if (lead) progress.note("running " + method);
    LayerRunOptions opts = base;
    opts.method = method;
    opts.group_size = width;
    auto out = run_context_parallel(world, job, opts);
    cmp.runs.push_back({out ? std::move(*out) : LayerOutputs<float>{}, width, label, {}, {}});
  }
  if (!lead) return std::nullopt;
  const LayerOutputs<float>* first_exact = nullptr;
  for (ProtocolRun& r : cmp.runs) {
    if (!r.skipped.empty() || !r.out.exact) continue;
    if (!first_exact) first_exact = &r.out;
    r.bitwise = same_bits(r.out, *first_exact);
    cmp.all_bitwise = cmp.all_bitwise && *r.bitwise;
  }
  return cmp;
}

double layer_cache_bytes(const kda::Shape& s, kda::Algorithm algorithm, std::size_t tokens, std::size_t pieces,
                         std::size_t elem_bytes) {
  if (algorithm != kda::Algorithm::chunk) return 0;
  // A piece of t tokens keeps ⌈t/C⌉ - 1 < t/C states and L, P of c×c per
  // chunk of c ≤ C tokens (≤ 2·C·t in all): however the tokens are cut.
  (void)pieces;
  const double c = double(kda::kChunkSize);
  const double per_pair = std::ceil(double(tokens) / c) * double(s.key_dim) * double(s.value_dim) +
                          2 * c * double(tokens) + 2 * double(tokens) * double(s.value_dim);
  return double(s.batch) * double(s.value_heads) * per_pair * double(elem_bytes);
}

double layer_backward_records_bytes(const kda::Shape& s, kda::Algorithm algorithm, std::size_t tokens,
                                    std::size_t pieces, std::size_t elem_bytes, bool keep_forward,
                                    std::size_t threads) {
  const double cache = layer_cache_bytes(s, algorithm, tokens, pieces, elem_bytes);
  if (keep_forward) return cache;
  // One record per (row, value head) in flight: a thread's scratch.
  const double pairs = double(s.batch) * double(s.value_heads);
  return cache * std::min(double(std::max<std::size_t>(threads, 1)), pairs) / pairs;
}

double compare_protocols_bytes(const kda::Shape& shape, std::size_t sequences, const kda::Layout& layout,
                               bool one_rank_per_process, bool keep_forward, std::size_t ulysses) {
  const std::size_t ranks = layout.ranks();
  const ProblemShape ps = layer_problem_shape(shape, sizeof(float), layout);
  // compare_protocols runs only the rows that take the layout when it is not
  // the plain one.
  const bool plain = !has_layout(ps);
  Prediction hungriest;
  std::size_t protocols = 0;
  for (const Prediction& p : predict_all(CostParams{}, ps, true)) {
    if (!plain && !find_protocol(p.config.method).takes_layouts) continue;
    ++protocols;
    if (p.peak_extra_bytes >= hungriest.peak_extra_bytes) hungriest = p;
  }
  const double kept_states =
      2 * double(sequences) * double(shape.value_heads) * double(shape.key_dim) * double(shape.value_dim);
  const double kept = double(protocols + 2) * (layer_output_bytes(shape, true, sizeof(float)) + kept_states * sizeof(float));
  const double exchange = exchange_rank_bytes(ps, hungriest);
  // The single-rank run's cache (the whole stream) is as large as all P
  // ranks' together, and never held at the same time as theirs.
  const std::size_t pieces = sequences + layout.parts().size();
  const double cache =
      keep_forward ? layer_cache_bytes(shape, kda::Algorithm::chunk, shape.tokens, pieces, sizeof(float)) : 0.0;
  // The Ulysses layer's buffers per rank: of the width given, or the widest
  // of any width auto may pick (a width that does not divide P, H and HV is
  // refused by the run, naming it).
  double ulysses_extra = 0;
  for (std::size_t u = 2; u <= ranks; ++u) {
    if (ulysses != kUlyssesAuto && u != ulysses) continue;
    if (ranks % u != 0 || shape.heads % u != 0 || shape.value_heads % u != 0) continue;
    ulysses_extra = std::max(ulysses_extra, ulysses_rank_bytes(shape, sequences, layout, u, true, sizeof(float)));
  }
  if (one_rank_per_process)
    return kept + cache + layer_rank_bytes(shape, sequences, layout, true, sizeof(float), exchange) + ulysses_extra;
  return kept + cache + layer_run_bytes(shape, sequences, ranks, true, sizeof(float), exchange, layout.parts().size()) +
         double(ranks) * ulysses_extra;
}

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
