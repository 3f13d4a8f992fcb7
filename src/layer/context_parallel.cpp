#include "kdacp/kda_cp.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <span>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/finite.hpp"
#include "kdacp/thread_pool.hpp"
#include "exchange/p2p.hpp"
#include "layer/agreement_fields.hpp"
#include "layer/layer_finite.hpp"
#include "kda/parts.hpp"
#include "kda/validate.hpp"

namespace kdacp::kda {

using namespace layer_detail;  // the finite check (layer_finite.hpp)
using namespace agreed;        // the agreements' fields (agreement_fields.hpp)

namespace {
template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs the checks and local work before a call's first message, naming the
// rank in any InvalidArgument they throw.
void on_rank(std::size_t rank, const char* op, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(
        fmt::format("kda::ContextParallelLayer::{} on rank {}: {}", op, rank, e.what()));
  }
}

// This rank's parts of the stream in chain order, once the stream is checked
// against the exchange's layout and the local inputs.
std::vector<Part> checked_parts(const Stream& stream, const Shape& local, std::size_t rank,
                                std::size_t ranks, const PartOwners& part_owners) {
  const Layout& layout = stream.layout;
  const Sequences& seqs = stream.sequences;
  if (layout.ranks() != ranks)
    throw InvalidArgument(fmt::format("stream.layout spans {} ranks, expected the mesh's P = {}",
                                      layout.ranks(), ranks));
  // The exchange was built for one assignment of chain positions to ranks.
  if (const PartOwners owners = layout.owners(); !(owners == part_owners))
    throw InvalidArgument(fmt::format(
        "stream.layout has part owners {}, expected the exchange's {} (the layout the layer was "
        "built with)",
        owners.str(), part_owners.str()));
  if (layout.tokens() != seqs.tokens())
    throw InvalidArgument(fmt::format("stream.layout covers {} tokens, expected the sequences' T = {}",
                                      layout.tokens(), seqs.tokens()));
  check::batch(local, seqs, "");
  if (local.tokens != layout.local_tokens(rank))
    throw InvalidArgument(fmt::format(
        "shape.tokens (T_local) = {}, expected the layout's {} tokens of rank {}", local.tokens,
        layout.local_tokens(rank), rank));
  return layout.local_parts(rank);
}

// Rows [first, first + count) of [N,HV,K,V] states that each part computes,
// with the part's rank: the sequences ending (ht) or starting (dh0) in it.
struct PartRows {
  std::size_t rank;
  SequenceRange rows;
};
std::vector<PartRows> rows_by_part(const Stream& stream, bool ending) {
  std::vector<PartRows> out;
  for (const LayoutPart& p : stream.layout.parts()) {
    const PartInfo info = part_info(stream.sequences, Part{p.begin, p.end, 0});
    out.push_back({p.rank, ending ? info.ended : info.started});
  }
  return out;
}

// Every part's rows to every rank, each broadcast whole from the rank that
// computed it, in chain order: copies, so every rank holds the same bits.
template <class T>
void share_rows(Communicator& comm, const SequenceStates<T>& st,
                const std::vector<PartRows>& parts) {
  const std::size_t row = st.value_heads * st.key_dim * st.value_dim;
  for (const PartRows& p : parts)
    if (p.rows.count > 0)
      comm.broadcast(std::as_writable_bytes(std::span<T>(st.data + p.rows.first * row,
                                                         p.rows.count * row)),
                     p.rank);
}

// The sum over ranks of their dht: all-gathered, then added in rank order,
// so every rank gets the same bits. An exact zero is not added: x + 0 is x
// but for x = -0, so one rank's dht with zeros elsewhere is that dht bit for
// bit, whatever P (the deterministic mode relies on it).
template <class T>
std::vector<T> summed_over_ranks(Communicator& comm, const SequenceStates<const T>& dht) {
  const std::size_t n = dht.sequences * dht.value_heads * dht.key_dim * dht.value_dim;
  const std::size_t ranks = comm.size();
  std::vector<T> slots(ranks * n);
  std::copy_n(dht.data, n, slots.begin() + comm.rank() * n);
  comm.all_gather(std::as_writable_bytes(std::span<T>(slots)));
  std::vector<T> sum(slots.begin(), slots.begin() + n);
  for (std::size_t r = 1; r < ranks; ++r)
    for (std::size_t i = 0; i < n; ++i)
      if (const T x = slots[r * n + i]; x != T(0)) sum[i] += x;
  return sum;
}

// The deterministic chain's states, [B,HV,K,V] of the layer's element type.
template <class T>
SummaryShape summary_shape(const Shape& s) {
  return {.batch = s.batch, .heads = s.value_heads, .key_dim = s.key_dim, .value_dim = s.value_dim,
          .dtype = dtype_of<T>()};
}
}  // namespace

namespace {
ExchangeOptions with_layout(const DeviceMesh& mesh, const Layout& layout,
                            ExchangeOptions options) {
  if (layout.ranks() != mesh.size())
    throw InvalidArgument(fmt::format(
        "kda::ContextParallelLayer: layout spans {} ranks, expected the mesh's P = {}",
        layout.ranks(), mesh.size()));
  options.part_owners = layout.owners();
  return options;
}


}  // namespace

template <class T>
ContextParallelLayer<T>::ContextParallelLayer(const DeviceMesh& mesh, const std::string& method,
                                              long long allgather_group_size,
                                              ExchangeOptions options, const Exec& exec,
                                              LayerChecks checks)
    : comm_(mesh.group(0)), exec_(exec), check_finite_(checks.check_finite) {
  build(mesh, method, allgather_group_size, std::move(options), nullptr, checks.agree);
}

template <class T>
ContextParallelLayer<T>::ContextParallelLayer(const DeviceMesh& mesh, const std::string& method,
                                              const Layout& layout, long long allgather_group_size,
                                              ExchangeOptions options, const Exec& exec,
                                              LayerChecks checks)
    : comm_(mesh.group(0)), exec_(exec), check_finite_(checks.check_finite) {
  build(mesh, method, allgather_group_size, std::move(options), &layout, checks.agree);
}

template <class T>
void ContextParallelLayer<T>::build(const DeviceMesh& mesh, const std::string& method,
                                    long long allgather_group_size, ExchangeOptions options,
                                    const Layout* layout, const Fingerprint& caller) {
  // The layout's own error (P not the mesh's) is this rank's: shared in the
  // agreement, so that no rank goes on to build the exchange alone.
  std::string local_error;
  if (layout != nullptr) {
    try {
      options = with_layout(mesh, *layout, std::move(options));
    } catch (const InvalidArgument& e) {
      local_error = e.what();
    }
  }
  Fingerprint fields = construction_fields<T>(method, allgather_group_size, options, layout,
                                              comm_->timeout());
  fields.append(caller);
  // Before make_state_exchange, which may split the mesh: ranks that asked
  // for different protocols would otherwise wait in different collectives.
  agree(*comm_, fields, "kda::ContextParallelLayer construction", local_error);
  options.exec = exec_;
  exchange_ = make_state_exchange(mesh, method, allgather_group_size, std::move(options));
}

template <class T>
void ContextParallelLayer<T>::agree_on(const char* op, const Fingerprint& fields,
                                       const std::function<void()>& checks) const {
  if (!agree_calls_) {  // agreed once by the caller: this rank's checks alone
    on_rank(comm_->rank(), op, checks);
    return;
  }
  std::string local_error;
  try {
    on_rank(comm_->rank(), op, checks);
  } catch (const InvalidArgument& e) {
    local_error = e.what();
  }
  agree(*comm_, fields, fmt::format("kda::ContextParallelLayer::{}", op), local_error);
}

// The call without a stream is the stream of one sequence per row, laid out
// contiguously by the ranks' own token counts (one all-gather of them).
template <class T>
Stream ContextParallelLayer<T>::plain_stream(const Shape& local, const char* op) const {
  const std::size_t rank = exchange_->rank(), ranks = exchange_->size();
  require_plain(rank, op);
  std::vector<std::size_t> counts(ranks, 0);
  counts[rank] = local.tokens;
  comm_->all_gather(std::as_writable_bytes(std::span<std::size_t>(counts)));
  std::size_t tokens = 0;
  for (std::size_t c : counts) tokens += c;
  std::optional<Stream> out;
  on_rank(rank, op, [&] {
    Layout layout = Layout::uneven(tokens, ranks, counts);
    out.emplace(Stream{Sequences(std::max<std::size_t>(local.batch, 1), tokens), std::move(layout)});
  });
  return std::move(*out);
}

template <class T>
Saved ContextParallelLayer<T>::forward(const Inputs<T>& in, Elem<T>* o) {
  return forward(in, plain_stream(in.shape, "forward"), {}, o, {});
}

template <class T>
std::shared_ptr<ForwardCache<Elem<T>>> ContextParallelLayer<T>::next_cache() {
  if (!keep_forward_ || exec_.algorithm != Algorithm::chunk) return nullptr;
  return caches_.acquire();
}

template <class T>
ForwardCache<Elem<T>>* ContextParallelLayer<T>::kept_of(const Saved& saved) {
  ForwardCache<Elem<T>>* kept = saved.kept<T>().get();
  if (kept) kept->rewind();
  return kept;
}

template <class T>
std::size_t ContextParallelLayer<T>::forward_cache_bytes() const {
  return caches_.bytes();
}

template <class T>
void ContextParallelLayer<T>::backward(const Inputs<T>& in, const Saved& saved, const Elem<T>* d_o,
                                       const Grads<Elem<T>>& grads) {
  backward(in, saved, {}, d_o, {}, grads, {});
}

namespace {

template <class Int>
Stream contiguous_stream_of(std::size_t rank, std::size_t ranks, std::size_t batch,
                            std::size_t tokens, std::span<const Int> cu_seqlens,
                            std::span<const std::size_t> counts) {
  std::optional<Stream> out;
  on_rank(rank, "contiguous_stream", [&] {
    Layout layout = Layout::contiguous(tokens, ranks, counts);
    out.emplace(Stream{cu_seqlens.empty() ? Sequences(batch, tokens)
                                          : Sequences(batch, tokens, cu_seqlens),
                       std::move(layout)});
  });
  return std::move(*out);
}

}  // namespace

template <class T>
Stream ContextParallelLayer<T>::contiguous_stream(std::size_t batch, std::size_t tokens,
                                                  std::span<const std::int64_t> cu_seqlens,
                                                  std::span<const std::size_t> counts) const {
  return contiguous_stream_of(exchange_->rank(), exchange_->size(), batch, tokens, cu_seqlens, counts);
}

template <class T>
Stream ContextParallelLayer<T>::contiguous_stream(std::size_t batch, std::size_t tokens,
                                                  std::span<const std::int32_t> cu_seqlens,
                                                  std::span<const std::size_t> counts) const {
  return contiguous_stream_of(exchange_->rank(), exchange_->size(), batch, tokens, cu_seqlens, counts);
}

template <class T>
void ContextParallelLayer<T>::require_plain(std::size_t rank, const char* op) const {
  if (!exchange_->part_owners().is_one_per_rank())
    throw InvalidArgument(fmt::format(
        "kda::ContextParallelLayer::{} on rank {}: the layer's layout has part owners {}, "
        "expected one part per rank in rank order for the call without a stream",
        op, rank, exchange_->part_owners().str()));
}

template <class T>
Saved ContextParallelLayer<T>::forward(const Inputs<T>& in, const Stream& stream,
                                       SequenceStates<const Elem<T>> h0, Elem<T>* o,
                                       SequenceStates<Elem<T>> ht) {
  const std::size_t rank = exchange_->rank();
  const Sequences& seqs = stream.sequences;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<Part> parts;
  std::vector<PartInfo> infos;
  std::vector<State> offsets, transfers;
  std::vector<PartSummary> summaries;
  Fingerprint fields = call_fields("forward (stream)", in, exec_.algorithm, deterministic_);
  add_stream(fields, stream);
  fields.add_flag("h0 given", h0.data != nullptr);
  fields.add_flag("ht requested", ht.data != nullptr);
  // The call's one validation (kda/validate.hpp); the part_* calls trust it.
  agree_on("forward", fields, [&] {
    check::inputs(in, "");
    check::algorithm(exec_.algorithm, "");
    parts = checked_parts(stream, in.shape, rank, exchange_->size(), exchange_->part_owners());
    check::pointer(o, "", "o");
    check::states(h0, seqs, in.shape, "", "h0");
    check::states(ht, seqs, in.shape, "", "ht");
    if (deterministic_ && exec_.algorithm == Algorithm::chunk)
      check::chunk_boundaries(stream.sequences, stream.layout);
  });
  // After the ht broadcasts, so that no rank stops before its peers' last
  // message; ht is the same bits on every rank, so every rank throws for it.
  const auto check_forward_finite = [&] {
    const Shape& s = in.shape;
    std::vector<Named<T>> inputs = input_tensors(in);
    inputs.push_back({"h0", h0.data, states_shape(h0)});
    require_finite_results<T>(where(comm_->rank(), "forward"),
                              {{"ht", ht.data, states_shape(ht)},
                               {"o", o, {s.batch, s.tokens, s.value_heads, s.value_dim}}},
                              inputs, exec_.pool);
  };
  if (deterministic_) {
    for (const Part& part : parts) infos.push_back(part_info(seqs, part));
    fwd_ = {};
    const auto cache = next_cache();
    std::vector<State> incoming = chain_forward(in, stream, parts, infos, h0, o, ht, cache.get());
    if (ht.data != nullptr) {
      t0 = std::chrono::steady_clock::now();
      share_rows(*comm_, ht, rows_by_part(stream, true));
      fwd_.exchange += since(t0);
    }
    if (check_finite_) check_forward_finite();
    Saved saved{{}, std::move(incoming), stream, nullptr, nullptr, true};
    saved.kept<T>() = cache;
    return saved;
  }
  on_rank(rank, "forward", [&] {
    const Shape& s = in.shape;
    for (const Part& part : parts) {
      offsets.emplace_back(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
      // A cut's M is never read: the zero buffer stands for it.
      transfers.emplace_back(s.batch, s.value_heads, s.key_dim, s.key_dim, dtype_of<T>());
      infos.push_back(part_info(seqs, part));
      // A part whose last token ends a sequence (the stream's last part,
      // always) hands nothing on: its successor starts a sequence, a cut,
      // which ignores what enters it, and the backward exchange multiplies
      // its M by that zero out-gradient. Zeros stand for its S and M (any
      // finite M gives those bits), and the pass is skipped: with P ranks
      // sharing cores that is a rank's summary less to wait for.
      if (infos.back().ends_sequence) {
        std::fill_n(offsets.back().data<T>(), s.state_elems(), T(0));
        std::fill_n(transfers.back().data<T>(), s.batch * s.value_heads * s.key_dim * s.key_dim, T(0));
        continue;
      }
      part_summary(in, seqs, part, h0, offsets.back().data<T>(),
                   infos.back().cut ? nullptr : transfers.back().data<T>(), exec_);
    }
    for (std::size_t i = 0; i < parts.size(); ++i)
      summaries.push_back({offsets[i].view(), transfers[i].view(), PartFlags{infos[i].cut}});
  });
  fwd_.local = fwd_.summary = since(t0);
  t0 = std::chrono::steady_clock::now();
  std::vector<State> incoming = exchange_->forward(summaries);
  fwd_.exchange = since(t0);
  t0 = std::chrono::steady_clock::now();
  const auto cache = next_cache();
  for (std::size_t i = 0; i < parts.size(); ++i)
    part_forward(in, seqs, parts[i], infos[i].starts_sequence ? nullptr : incoming[i].data<T>(),
                 h0, o, ht, exec_, cache.get());
  fwd_.local += since(t0);
  if (ht.data != nullptr) {
    t0 = std::chrono::steady_clock::now();
    share_rows(*comm_, ht, rows_by_part(stream, true));
    fwd_.exchange += since(t0);
  }
  if (check_finite_) check_forward_finite();
  Saved saved{std::move(transfers), std::move(incoming), stream, nullptr, nullptr};
  saved.kept<T>() = cache;
  return saved;
}

template <class T>
void ContextParallelLayer<T>::backward(const Inputs<T>& in, const Saved& saved,
                                       SequenceStates<const Elem<T>> h0, const Elem<T>* d_o,
                                       SequenceStates<const Elem<T>> dht,
                                       const Grads<Elem<T>>& grads, SequenceStates<Elem<T>> dh0) {
  const std::size_t rank = exchange_->rank();
  std::vector<Part> parts;
  std::vector<PartInfo> infos;
  Fingerprint fields = call_fields("backward (stream)", in, exec_.algorithm);
  fields.add_flag("deterministic (the forward's)", saved.deterministic);
  if (saved.stream) add_stream(fields, *saved.stream);
  else fields.add_text("stream", "none (not a Saved of forward)");
  fields.add_flag("h0 given", h0.data != nullptr);
  fields.add_flag("dht given", dht.data != nullptr);
  fields.add_flag("dh0 requested", dh0.data != nullptr);
  agree_on("backward", fields, [&] {
    if (!saved.stream)
      throw InvalidArgument(
          "saved holds no stream, expected what this layer's forward returned");
    check::inputs(in, "");
    check::algorithm(exec_.algorithm, "");
    parts = checked_parts(*saved.stream, in.shape, rank, exchange_->size(), exchange_->part_owners());
    check::pointer(d_o, "", "d_o");
    check::grads(grads, "");
    const Sequences& seqs = saved.stream->sequences;
    check::states(h0, seqs, in.shape, "", "h0");
    check::states(dht, seqs, in.shape, "", "dht");
    check::states(dh0, seqs, in.shape, "", "dh0");
    for (const Part& part : parts) infos.push_back(part_info(seqs, part));
  });
  const Stream& stream = *saved.stream;
  const Sequences& seqs = stream.sequences;
  const Shape& s = in.shape;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<T> dht_sum;
  SequenceStates<const T> dht_total{};
  if (dht.data != nullptr) {
    dht_sum = summed_over_ranks(*comm_, dht);
    dht_total = dht;
    dht_total.data = dht_sum.data();
  }
  bwd_.exchange = since(t0);
  if (saved.deterministic) {
    bwd_.local = bwd_.summary = 0;
    chain_backward(in, saved, parts, infos, h0, d_o, dht_total, grads, dh0, kept_of(saved));
  } else {
  t0 = std::chrono::steady_clock::now();
  std::vector<State> gs;
  std::vector<PartSummary> summaries;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    gs.emplace_back(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
    part_incoming_grad(in, seqs, parts[i], d_o, dht_total, gs.back().data<T>(), exec_);
  }
  for (std::size_t i = 0; i < parts.size(); ++i)
    summaries.push_back({gs[i].view(), saved.transfer[i].view(), PartFlags{infos[i].cut}});
  bwd_.local = bwd_.summary = since(t0);
  t0 = std::chrono::steady_clock::now();
  const std::vector<State> d_end = exchange_->backward(summaries);
  bwd_.exchange += since(t0);
  t0 = std::chrono::steady_clock::now();
  ForwardCache<Elem<T>>* kept = kept_of(saved);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    // d_incoming is one state: that of the rank's first part.
    Grads<Elem<T>> part_grads = grads;
    if (i > 0) part_grads.d_incoming = nullptr;
    part_backward(in, seqs, parts[i],
                  infos[i].starts_sequence ? nullptr : saved.incoming[i].data<T>(), h0, d_o,
                  d_end[i].data<T>(), dht_total, part_grads, dh0, exec_, kDefaultCheckpointInterval,
                  kept);
  }
  bwd_.local += since(t0);
  }
  if (dh0.data != nullptr) {
    t0 = std::chrono::steady_clock::now();
    share_rows(*comm_, dh0, rows_by_part(stream, false));
    bwd_.exchange += since(t0);
  }
  // After the dh0 broadcasts (see forward); dh0 first: every rank has it.
  if (check_finite_) {
    std::vector<Named<T>> outputs{{"dh0", dh0.data, states_shape(dh0)}};
    for (const Named<T>& g : grad_tensors(grads, s)) outputs.push_back(g);
    std::vector<Named<T>> inputs = input_tensors(in);
    inputs.push_back({"d_o", d_o, {s.batch, s.tokens, s.value_heads, s.value_dim}});
    inputs.push_back({"h0", h0.data, states_shape(h0)});
    inputs.push_back({"dht", dht.data, states_shape(dht)});
    require_finite_results<T>(where(comm_->rank(), "backward"), outputs, inputs, exec_.pool);
  }
}

// The deterministic chain, walked by the p2p protocol (exchange/p2p.hpp) over
// comm_, the CP group the registry's p2p runs on. Each rank runs its parts in
// chain order; a part that continues a sequence first takes its incoming
// state from the part before it (a message, or the rank's own previous part),
// and a part whose last sequence goes on hands its final state to the next.
// Every part's walk is then the one-device walk over the same tokens from the
// same bits.
template <class T>
std::vector<State> ContextParallelLayer<T>::chain_forward(
    const Inputs<T>& in, const Stream& stream, const std::vector<Part>& parts,
    const std::vector<PartInfo>& infos, SequenceStates<const Elem<T>> h0, Elem<T>* o,
    SequenceStates<Elem<T>> ht, ForwardCache<Elem<T>>* cache) {
  const Shape& s = in.shape;
  std::vector<detail::ChainInput> inputs;
  for (const PartInfo& info : infos)
    inputs.push_back(info.starts_sequence ? detail::ChainInput::none : detail::ChainInput::awaited);
  const detail::ChainStep step = [&](std::size_t i, const State* incoming) -> detail::ChainOut {
    const bool hands_on = !infos[i].ends_sequence;
    State outgoing = hands_on ? State(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>())
                              : State();
    part_forward(in, stream.sequences, parts[i], incoming ? incoming->data<T>() : nullptr, h0, o,
                 ht, exec_, cache, hands_on ? outgoing.data<T>() : nullptr);
    if (!hands_on) return {};
    return outgoing;
  };
  detail::ChainWalk walk = detail::walk_chain(*comm_, exchange_->part_owners(), comm_->rank(),
                                              Direction::forward, summary_shape<T>(s), inputs,
                                              detail::ChainOrder::in_order, step);
  fwd_.exchange += walk.waiting;
  fwd_.local += walk.stepping;
  return std::move(walk.incoming);
}

// The backward walks the chain the other way: each part's d_end is the
// gradient its successor computed w.r.t. that successor's incoming state.
template <class T>
void ContextParallelLayer<T>::chain_backward(
    const Inputs<T>& in, const Saved& saved, const std::vector<Part>& parts,
    const std::vector<PartInfo>& infos, SequenceStates<const Elem<T>> h0, const Elem<T>* d_o,
    SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads, SequenceStates<Elem<T>> dh0,
    ForwardCache<Elem<T>>* kept) {
  const Shape& s = in.shape;
  const Stream& stream = *saved.stream;
  // Where each part's records start in the forward's cache (one per piece).
  std::vector<std::size_t> first_record(parts.size() + 1, 0);
  for (std::size_t i = 0; i < parts.size(); ++i)
    first_record[i + 1] = first_record[i] + kdacp::pieces(stream.sequences, parts[i]).size();
  std::vector<detail::ChainInput> inputs;
  for (const PartInfo& info : infos)
    inputs.push_back(info.ends_sequence ? detail::ChainInput::none : detail::ChainInput::awaited);
  const detail::ChainStep step = [&](std::size_t i, const State* d_end) -> detail::ChainOut {
    // The gradient w.r.t. the part's incoming state: its predecessor's d_end.
    Grads<Elem<T>> part_grads = grads;
    part_grads.d_incoming = nullptr;
    State d_start;
    if (!infos[i].starts_sequence) {
      d_start = State(s.batch, s.value_heads, s.key_dim, s.value_dim, dtype_of<T>());
      part_grads.d_incoming = d_start.data<T>();
    } else if (i == 0) {
      part_grads.d_incoming = grads.d_incoming;  // dh0's rows, copied
    }
    if (kept) kept->seek(first_record[i]);
    part_backward(in, stream.sequences, parts[i],
                  infos[i].starts_sequence ? nullptr : saved.incoming[i].data<T>(), h0, d_o,
                  d_end ? d_end->data<T>() : nullptr, dht, part_grads, dh0, exec_,
                  kDefaultCheckpointInterval, kept);
    if (infos[i].starts_sequence) return {};
    if (i == 0 && grads.d_incoming != nullptr)
      std::copy_n(d_start.data<T>(), s.state_elems(), grads.d_incoming);
    return d_start;
  };
  detail::ChainWalk walk = detail::walk_chain(*comm_, exchange_->part_owners(), comm_->rank(),
                                              Direction::backward, summary_shape<T>(s), inputs,
                                              detail::ChainOrder::in_order, step);
  bwd_.exchange += walk.waiting;
  bwd_.local += walk.stepping;
}

template <class T>
LayerData<T> LayerData<T>::slice(TokenSplit range) const {
  LayerData<T> out;
  out.shape = shape;
  out.shape.tokens = range.count;
  const std::size_t b = shape.batch, t = shape.tokens;
  auto cut = [&](const std::vector<T>& full, std::size_t inner, std::vector<T>& local) {
    local.resize(b * range.count * inner);
    slice_tokens(full.data(), b, t, inner, range, local.data());
  };
  cut(q, shape.heads * shape.key_dim, out.q);
  cut(k, shape.heads * shape.key_dim, out.k);
  cut(v, shape.value_heads * shape.value_dim, out.v);
  cut(g, shape.value_heads * shape.key_dim, out.g);
  cut(beta, shape.value_heads, out.beta);
  return out;
}

template struct LayerData<float>;
template struct LayerData<double>;
template class ContextParallelLayer<float>;
template class ContextParallelLayer<double>;

}  // namespace kdacp::kda
