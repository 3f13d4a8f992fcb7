#include "kdacp/kda_ulysses.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "layer/agreement_fields.hpp"
#include "layer/layer_finite.hpp"
#include "kda/validate.hpp"

namespace kdacp::kda {

using namespace layer_detail;  // the finite check (layer_finite.hpp)
using namespace agreed;        // the agreements' fields (agreement_fields.hpp)

Layout ulysses_group_layout(const Layout& layout, std::size_t width) {
  const std::size_t ranks = layout.ranks();
  if (width == 0 || ranks % width != 0)
    throw InvalidArgument(fmt::format("Ulysses width U = {}, expected a divisor (>= 1) of the P = {} ranks", width,
                                      ranks));
  std::vector<LayoutPart> parts;
  for (const LayoutPart& p : layout.parts()) {
    const std::size_t group = p.rank / width;
    if (!parts.empty() && parts.back().rank == group) parts.back().end = p.end;  // adjacent: one part
    else parts.push_back({group, p.begin, p.end});
  }
  return Layout(ranks / width, std::move(parts));
}

ExchangeOptions ulysses_exchange_options(const ExchangeOptions& options, const Layout& layout, std::size_t width) {
  ExchangeOptions out = options;
  if (options.expected_shape) {
    if (options.expected_shape->heads % width != 0)
      throw InvalidArgument(fmt::format("options.expected_shape has {} heads, expected a multiple of the Ulysses "
                                        "width U = {}",
                                        options.expected_shape->heads, width));
    out.expected_shape->heads /= width;
  }
  if (!options.expected_cuts.empty()) {
    const std::vector<LayoutPart>& parts = layout.parts();
    if (options.expected_cuts.size() != parts.size())
      throw InvalidArgument(fmt::format("options.expected_cuts has {} flags, expected one per part of the layout ({})",
                                        options.expected_cuts.size(), parts.size()));
    out.expected_cuts.clear();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const bool merged = i > 0 && parts[i - 1].rank / width == parts[i].rank / width;
      if (merged) out.expected_cuts.back() = out.expected_cuts.back() || options.expected_cuts[i];
      else out.expected_cuts.push_back(options.expected_cuts[i]);
    }
  }
  return out;
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class T>
using Kinds = std::vector<typename UlyssesLayer<T>::HeadTensor>;

// q, k, v, g, beta (and their gradients) of shape s, in that order, each
// in its wire type.
template <class T>
Kinds<T> input_kinds(const Shape& s, const std::array<std::optional<Half>, 5>& wire) {
  return {{s.heads, s.key_dim, wire[0]}, {s.heads, s.key_dim, wire[1]}, {s.value_heads, s.value_dim, wire[2]},
          {s.value_heads, s.key_dim, wire[3]}, {s.value_heads, 1, wire[4]}};
}

// 2-byte units of one element on the wire.
template <class T>
std::size_t units(const std::optional<Half>& wire) {
  static_assert(sizeof(T) % 2 == 0);
  return wire ? 1 : sizeof(T) / 2;
}

// n elements of T onto the wire at dst (narrowed to `wire`, else copied);
// returns the end.
template <class T>
std::uint16_t* put(const T* src, std::size_t n, const std::optional<Half>& wire, std::uint16_t* dst) {
  // wire_types refuses 16-bit types for T = double: only float narrows.
  if constexpr (std::is_same_v<T, float>) {
    if (wire) {
      (void)narrow(*wire, src, n, dst);  // an overflow is ±Inf, which the finite check names
      return dst + n;
    }
  }
  std::memcpy(dst, src, n * sizeof(T));
  return dst + n * units<T>(wire);
}

// n elements from the wire at src into dst (widened, else copied); returns
// the end.
template <class T>
const std::uint16_t* get(const std::uint16_t* src, std::size_t n, const std::optional<Half>& wire, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    if (wire) {
      widen(*wire, src, n, dst);
      return src + n;
    }
  }
  std::memcpy(dst, src, n * sizeof(T));
  return src + n * units<T>(wire);
}

std::string wire_text(const std::array<std::optional<Half>, 5>& in, const std::optional<Half>& out) {
  std::string text;
  for (const auto& w : in) text += std::string(w ? half_name(*w) : "as computed") + ", ";
  return text + "out " + (out ? half_name(*out) : "as computed");
}

// Where each tensor of `kinds` starts in one buffer of [B·T_group] tokens of
// a head slice, tensor after tensor.
template <class P, class T>
std::vector<P*> fields_of(P* base, const Kinds<T>& kinds, std::size_t tokens, std::size_t width) {
  std::vector<P*> out;
  for (const auto& t : kinds) {
    out.push_back(base);
    base += tokens * (t.heads / width) * t.dim;
  }
  return out;
}

// Elements per token of one head slice of every tensor in `kinds`.
template <class K>
std::size_t slice_width(const std::vector<K>& kinds, std::size_t width) {
  std::size_t w = 0;
  for (const K& t : kinds) w += t.heads / width * t.dim;
  return w;
}

// The same in 2-byte wire units.
template <class T, class K>
std::size_t slice_units(const std::vector<K>& kinds, std::size_t width) {
  std::size_t w = 0;
  for (const K& t : kinds) w += t.heads / width * t.dim * units<T>(t.wire);
  return w;
}

// One pairwise all-to-all over `group`: in U - 1 steps this rank sends the
// block for member (r + s) % U and receives member (r - s) % U's, one peer at
// a time, every wait bounded by the group's timeout. Its own block is not
// sent (the caller reads it from `send`).
template <class T>
void all_to_all(Communicator& group, const T* send, std::span<const std::size_t> send_at,
                std::span<const std::size_t> send_count, T* recv, std::span<const std::size_t> recv_at,
                std::span<const std::size_t> recv_count, int tag) {
  const std::size_t u = group.size(), r = group.rank();
  for (std::size_t s = 1; s < u; ++s) {
    const std::size_t to = (r + s) % u, from = (r + u - s) % u;
    auto in = group.irecv(std::as_writable_bytes(std::span<T>(recv + recv_at[from], recv_count[from])), from, tag);
    auto out = group.isend(std::as_bytes(std::span<const T>(send + send_at[to], send_count[to])), to, tag);
    out->wait();
    in->wait();
  }
}

std::vector<std::size_t> prefix(const std::vector<std::size_t>& counts) {
  std::vector<std::size_t> at(counts.size(), 0);
  for (std::size_t i = 1; i < counts.size(); ++i) at[i] = at[i - 1] + counts[i - 1];
  return at;
}

}  // namespace

template <class T>
UlyssesLayer<T>::UlyssesLayer(const DeviceMesh& mesh, std::size_t width, const std::string& method,
                              const Layout& layout, long long allgather_group_size, ExchangeOptions options,
                              const Exec& exec, LayerChecks checks)
    : width_(width),
      layout_(layout),
      group_layout_(layout),
      world_(mesh.group(0)),
      exec_(exec),
      check_finite_(checks.check_finite) {
  // This rank's own errors are shared in the agreement: no rank goes on to
  // split the mesh alone.
  std::string local_error;
  ExchangeOptions inner_options;
  try {
    if (mesh.ndim() != 1)
      throw InvalidArgument(fmt::format("expected a 1-D mesh of the P ranks, got {} dims", mesh.ndim()));
    if (layout.ranks() != mesh.size())
      throw InvalidArgument(
          fmt::format("layout spans {} ranks, expected the mesh's P = {}", layout.ranks(), mesh.size()));
    group_layout_ = ulysses_group_layout(layout, width);
    inner_options = ulysses_exchange_options(options, layout, width);
  } catch (const InvalidArgument& e) {
    local_error = fmt::format("on rank {}: {}", world_->rank(), e.what());
  }
  Fingerprint fields;
  fields.add_int("ulysses width", static_cast<long long>(width));
  fields.append(construction_fields<T>(method, allgather_group_size, options, &layout, world_->timeout()));
  fields.append(checks.agree);
  agree(*world_, fields, "kda::UlyssesLayer construction", local_error);

  const std::size_t ranks = mesh.size(), rank = world_->rank(), group = rank / width;
  const DeviceMesh grid = mesh.unflatten(0, {ranks / width, width}, {"cp", "hp"});
  heads_ = grid.group(grid.dim_index("hp"));
  if (heads_->size() != width || heads_->rank() != rank % width)
    throw Error(fmt::format("kda::UlyssesLayer on rank {}: its head group has {} ranks and it is member {}, "
                            "expected {} and {}",
                            rank, heads_->size(), heads_->rank(), width, rank % width));
  LayerChecks inner_checks;
  inner_checks.check_finite = false;  // checked here, after the call's last message
  inner_checks.agree = checks.agree;
  inner_ = std::make_unique<ContextParallelLayer<T>>(grid["cp"], method, group_layout_, allgather_group_size,
                                                     std::move(inner_options), exec, inner_checks);
  // Every call is agreed over all P ranks first (a superset of the state-CP
  // layer's fields): its own agreement would be one collective more.
  inner_->agree_per_call(false);

  // Where each member's parts lie in the group's tensors.
  const std::vector<Part> group_parts = group_layout_.local_parts(group);
  for (std::size_t m = 0; m < width; ++m) {
    member_tokens_.push_back(layout.local_tokens(group * width + m));
    for (const Part& p : layout.local_parts(group * width + m)) {
      const auto in = std::find_if(group_parts.begin(), group_parts.end(),
                                   [&](const Part& g) { return g.begin <= p.begin && p.end <= g.end; });
      segments_.push_back({m, p.local_begin, in->local_begin + (p.begin - in->begin), p.end - p.begin});
    }
  }
  group_tokens_ = group_layout_.local_tokens(group);
}

template <class T>
void UlyssesLayer<T>::agree_on(const char* op, const Fingerprint& fields,
                               const std::function<void()>& checks) const {
  std::string local_error;
  try {
    checks();
  } catch (const InvalidArgument& e) {
    local_error = fmt::format("kda::UlyssesLayer::{} on rank {}: {}", op, world_->rank(), e.what());
  }
  if (!agree_calls_) {  // agreed once by the caller: this rank's checks alone
    if (!local_error.empty()) throw InvalidArgument(local_error);
    return;
  }
  agree(*world_, fields, fmt::format("kda::UlyssesLayer::{}", op), local_error);
}

namespace {

// The stream is the one the layer was built for, and this rank's inputs are
// its tokens of it, with heads the width divides.
void check_stream(const Stream& stream, const Layout& layout, const Shape& local, std::size_t rank,
                  std::size_t width) {
  const Layout& got = stream.layout;
  if (got.ranks() != layout.ranks() || got.owners().list() != layout.owners().list() ||
      got.part_lengths() != layout.part_lengths())
    throw InvalidArgument(fmt::format("stream.layout is {}, expected the layout the layer was built with ({})",
                                      got.str(), layout.str()));
  if (got.tokens() != stream.sequences.tokens())
    throw InvalidArgument(fmt::format("stream.layout covers {} tokens, expected the sequences' T = {}", got.tokens(),
                                      stream.sequences.tokens()));
  check::batch(local, stream.sequences, "");
  if (local.tokens != layout.local_tokens(rank))
    throw InvalidArgument(fmt::format("shape.tokens (T_local) = {}, expected the layout's {} tokens of rank {}",
                                      local.tokens, layout.local_tokens(rank), rank));
  if (local.heads % width != 0 || local.value_heads % width != 0)
    throw InvalidArgument(fmt::format("H = {} and HV = {} heads, expected multiples of the Ulysses width U = {}",
                                      local.heads, local.value_heads, width));
}

// Rows [N, HV/U, K, V] of head slice `slice` of states [N, HV, K, V].
template <class T>
std::vector<T> slice_states(const SequenceStates<const T>& st, std::size_t width, std::size_t slice) {
  if (st.data == nullptr) return {};
  const std::size_t row = st.value_heads * st.key_dim * st.value_dim, w = row / width;
  std::vector<T> out(st.sequences * w);
  for (std::size_t n = 0; n < st.sequences; ++n)
    std::copy_n(st.data + n * row + slice * w, w, out.data() + n * w);
  return out;
}

// The state-CP layer's local shape: the group's tokens of one head slice.
Shape slice_shape(const Shape& s, std::size_t group_tokens, std::size_t width) {
  Shape out = s;
  out.tokens = group_tokens;
  out.heads /= width;
  out.value_heads /= width;
  return out;
}

template <class S>
SequenceStates<S> with_data(SequenceStates<S> st, std::type_identity_t<S>* data, std::size_t width) {
  st.data = data;
  st.value_heads /= width;
  return st;
}

}  // namespace

template <class T>
UlyssesSaved<T> UlyssesLayer<T>::forward(const Inputs<T>& in, const Stream& stream, SequenceStates<const Elem<T>> h0,
                                         Elem<T>* o, SequenceStates<Elem<T>> ht) {
  const std::size_t rank = world_->rank(), u = heads_->rank(), width = width_;
  const Sequences& seqs = stream.sequences;
  Exec exec = exec_;
  exec.algorithm = inner_->algorithm();
  const bool deterministic = inner_->deterministic();
  Fingerprint fields = call_fields("ulysses forward", in, exec.algorithm, deterministic);
  fields.add_text("16-bit wire types (q, k, v, g, beta, o)", wire_text(wire_in_, wire_out_));
  add_stream(fields, stream);
  fields.add_flag("h0 given", h0.data != nullptr);
  fields.add_flag("ht requested", ht.data != nullptr);
  agree_on("forward", fields, [&] {
    check::inputs(in, "");
    if (in.half.any()) throw InvalidArgument("16-bit inputs read in place: the Ulysses layer takes them widened");
    check::algorithm(exec.algorithm, "");
    check_stream(stream, layout_, in.shape, rank, width);
    // The state-CP layer's own check, on the layout it runs: before the first
    // all-to-all rather than after it.
    if (deterministic && exec.algorithm == Algorithm::chunk) check::chunk_boundaries(seqs, group_layout_);
    check::pointer(o, "", "o");
    check::states(h0, seqs, in.shape, "", "h0");
    check::states(ht, seqs, in.shape, "", "ht");
  });
  const Shape& s = in.shape;
  const Shape gs = slice_shape(s, group_tokens_, width);
  const Kinds<T> kinds = input_kinds<T>(s, wire_in_);
  const std::size_t bt = s.batch * group_tokens_;
  std::shared_ptr<std::vector<T>> inputs = kept_inputs(bt * slice_width(kinds, width));

  auto t0 = std::chrono::steady_clock::now();
  const T* const sources[5] = {in.q, in.k, in.v, in.g, in.beta};
  to_heads(std::span<const T* const>(sources), kinds, s, inputs->data(), 0);
  fwd_a2a_ = seconds_since(t0);

  const std::vector<const T*> field = fields_of<const T, T>(inputs->data(), kinds, bt, width);
  const Inputs<T> gin{field[0], field[1], field[2], field[3], field[4], gs, in.scale};
  const std::vector<T> h0_slice = slice_states(h0, width, u);
  const std::size_t state_row = gs.value_heads * gs.key_dim * gs.value_dim;
  std::vector<T> ht_slots(ht.data ? width * ht.sequences * state_row : 0);
  std::vector<T>& o_slice = out_slice_;
  o_slice.resize(bt * gs.value_heads * gs.value_dim);
  const Stream group_stream{seqs, group_layout_};
  Saved saved = inner_->forward(gin, group_stream, with_data(h0, h0_slice.empty() ? nullptr : h0_slice.data(), width),
                                o_slice.data(),
                                with_data(ht, ht.data ? ht_slots.data() + u * ht.sequences * state_row : nullptr, width));
  fwd_ = inner_->forward_times();

  t0 = std::chrono::steady_clock::now();
  const T* const outs[1] = {o_slice.data()};
  T* const dests[1] = {o};
  to_tokens(std::span<const T* const>(outs), Kinds<T>{{s.value_heads, s.value_dim, wire_out_}}, s,
            std::span<T* const>(dests), 1);
  if (ht.data) gather_states(std::span<T>(ht_slots), ht, ht.sequences * state_row);
  fwd_a2a_ += seconds_since(t0);
  fwd_.exchange += fwd_a2a_;

  if (check_finite_) {
    std::vector<Named<T>> named = input_tensors(in);
    named.push_back({"h0", h0.data, states_shape(h0)});
    require_finite_results<T>(fmt::format("kda::UlyssesLayer::forward on rank {}", rank),
                              {{"ht", ht.data, states_shape(ht)},
                               {"o", o, {s.batch, s.tokens, s.value_heads, s.value_dim}}},
                              named, exec_.pool);
  }
  return UlyssesSaved<T>{std::move(saved), std::move(inputs), stream};
}

template <class T>
void UlyssesLayer<T>::backward(const Inputs<T>& in, const UlyssesSaved<T>& saved, SequenceStates<const Elem<T>> h0,
                               const Elem<T>* d_o, SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads,
                               SequenceStates<Elem<T>> dh0) {
  const std::size_t rank = world_->rank(), u = heads_->rank(), width = width_;
  Fingerprint fields = call_fields("ulysses backward", in, inner_->algorithm());
  fields.add_text("16-bit wire types (q, k, v, g, beta, d_o)", wire_text(wire_in_, wire_out_));
  fields.add_flag("deterministic (the forward's)", saved.saved.deterministic);
  if (saved.stream) add_stream(fields, *saved.stream);
  else fields.add_text("stream", "none (not a Saved of forward)");
  fields.add_flag("h0 given", h0.data != nullptr);
  fields.add_flag("dht given", dht.data != nullptr);
  fields.add_flag("dh0 requested", dh0.data != nullptr);
  agree_on("backward", fields, [&] {
    if (!saved.stream || !saved.inputs)
      throw InvalidArgument("saved holds no stream, expected what this layer's forward returned");
    check::inputs(in, "");
    check_stream(*saved.stream, layout_, in.shape, rank, width);
    check::pointer(d_o, "", "d_o");
    check::grads(grads, "");
    if (grads.d_incoming != nullptr)
      throw InvalidArgument("grads.d_incoming is set, expected null: with Ulysses a rank's tokens are not one part "
                            "of the state exchange");
    const Sequences& seqs = saved.stream->sequences;
    check::states(h0, seqs, in.shape, "", "h0");
    check::states(dht, seqs, in.shape, "", "dht");
    check::states(dh0, seqs, in.shape, "", "dh0");
  });
  const Shape& s = in.shape;
  const Shape gs = slice_shape(s, group_tokens_, width);
  const Kinds<T> kinds = input_kinds<T>(s, wire_in_);
  const std::size_t bt = s.batch * group_tokens_;
  const std::size_t state_row = gs.value_heads * gs.key_dim * gs.value_dim;

  auto t0 = std::chrono::steady_clock::now();
  std::vector<T>& d_o_slice = out_slice_;
  d_o_slice.resize(bt * gs.value_heads * gs.value_dim);
  const T* const sources[1] = {d_o};
  to_heads(std::span<const T* const>(sources), Kinds<T>{{s.value_heads, s.value_dim, wire_out_}}, s,
           d_o_slice.data(), 2);
  // dht: each member's slice of this rank's head slice, summed in member
  // order (exact zeros not added, as the state-CP layer sums over its ranks).
  std::vector<T> dht_slice;
  if (dht.data) {
    const std::size_t n = dht.sequences * state_row;
    std::vector<T> blocks(width * n), got(width * n);
    for (std::size_t m = 0; m < width; ++m)
      for (std::size_t q = 0; q < dht.sequences; ++q)
        std::copy_n(dht.data + (q * width + m) * state_row, state_row, blocks.data() + m * n + q * state_row);
    const std::vector<std::size_t> count(width, n), at = prefix(count);
    all_to_all(*heads_, blocks.data(), at, count, got.data(), at, count, 3);
    std::copy_n(blocks.data() + u * n, n, got.data() + u * n);
    dht_slice.assign(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(n));
    for (std::size_t m = 1; m < width; ++m)
      for (std::size_t i = 0; i < n; ++i)
        if (const T x = got[m * n + i]; x != T(0)) dht_slice[i] += x;
  }
  bwd_a2a_ = seconds_since(t0);

  const std::vector<const T*> field = fields_of<const T, T>(saved.inputs->data(), kinds, bt, width);
  const Inputs<T> gin{field[0], field[1], field[2], field[3], field[4], gs, in.scale};
  std::vector<T>& grad_slices = grad_slices_;
  grad_slices.resize(saved.inputs->size());
  const std::vector<T*> gfield = fields_of<T, T>(grad_slices.data(), kinds, bt, width);
  const std::vector<T> h0_slice = slice_states(h0, width, u);
  std::vector<T> dh0_slots(dh0.data ? width * dh0.sequences * state_row : 0);
  inner_->backward(gin, saved.saved, with_data(h0, h0_slice.empty() ? nullptr : h0_slice.data(), width),
                   d_o_slice.data(), with_data(dht, dht_slice.empty() ? nullptr : dht_slice.data(), width),
                   Grads<T>{gfield[0], gfield[1], gfield[2], gfield[3], gfield[4], nullptr},
                   with_data(dh0, dh0.data ? dh0_slots.data() + u * dh0.sequences * state_row : nullptr, width));
  bwd_ = inner_->backward_times();

  t0 = std::chrono::steady_clock::now();
  const T* const outs[5] = {gfield[0], gfield[1], gfield[2], gfield[3], gfield[4]};
  T* const dests[5] = {grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta};
  to_tokens(std::span<const T* const>(outs), kinds, s, std::span<T* const>(dests), 4);
  if (dh0.data) gather_states(std::span<T>(dh0_slots), dh0, dh0.sequences * state_row);
  bwd_a2a_ += seconds_since(t0);
  bwd_.exchange += bwd_a2a_;

  if (check_finite_) {
    std::vector<Named<T>> outputs = grad_tensors(grads, s);
    outputs.push_back({"dh0", dh0.data, states_shape(dh0)});
    std::vector<Named<T>> named = input_tensors(in);
    named.push_back({"d_o", d_o, {s.batch, s.tokens, s.value_heads, s.value_dim}});
    named.push_back({"h0", h0.data, states_shape(h0)});
    named.push_back({"dht", dht.data, states_shape(dht)});
    require_finite_results<T>(fmt::format("kda::UlyssesLayer::backward on rank {}", rank), outputs, named,
                              exec_.pool);
  }
}

template <class T>
std::shared_ptr<std::vector<T>> UlyssesLayer<T>::kept_inputs(std::size_t elems) {
  // A buffer no UlyssesSaved holds any more (only this list does) is
  // reused: a training loop does not fault fresh pages in every step.
  for (const std::shared_ptr<std::vector<T>>& b : inputs_pool_)
    if (b.use_count() == 1) {
      b->resize(elems);
      return b;
    }
  inputs_pool_.push_back(std::make_shared<std::vector<T>>(elems));
  return inputs_pool_.back();
}

template <class T>
void UlyssesLayer<T>::to_heads(std::span<const T* const> sources, const Kinds<T>& kinds,
                               const Shape& s, T* dest, int tag) {
  const std::size_t width = width_, u = heads_->rank(), tr = s.tokens, b_count = s.batch;
  const std::size_t w = slice_units<T>(kinds, width);
  // To member m: this rank's tokens of head slice m, tensor after tensor,
  // each in its wire type.
  std::vector<std::size_t> send_count(width, b_count * tr * w), recv_count(width);
  for (std::size_t m = 0; m < width; ++m) recv_count[m] = b_count * member_tokens_[m] * w;
  const std::vector<std::size_t> send_at = prefix(send_count), recv_at = prefix(recv_count);
  send_.resize(width * b_count * tr * w);
  recv_.resize(recv_at.back() + recv_count.back());
  for (std::size_t m = 0; m < width; ++m) {
    std::uint16_t* out = send_.data() + send_at[m];
    for (std::size_t i = 0; i < kinds.size(); ++i) {
      const std::size_t row = kinds[i].heads * kinds[i].dim, sw = row / width;
      for (std::size_t t = 0; t < b_count * tr; ++t) out = put(sources[i] + t * row + m * sw, sw, kinds[i].wire, out);
    }
  }
  all_to_all(*heads_, send_.data(), send_at, send_count, recv_.data(), recv_at, recv_count, tag);
  // Member m's block: its tokens, tensor after tensor; its parts go to their
  // places among the group's tokens (this rank's own from its send buffer,
  // in the same wire type as every member's).
  const std::size_t tg = group_tokens_;
  for (std::size_t m = 0; m < width; ++m) {
    const std::uint16_t* block = m == u ? send_.data() + send_at[u] : recv_.data() + recv_at[m];
    const std::size_t tm = member_tokens_[m];
    T* field = dest;
    for (std::size_t i = 0; i < kinds.size(); ++i) {
      const std::size_t sw = kinds[i].heads / width * kinds[i].dim, su = sw * units<T>(kinds[i].wire);
      for (const Segment& seg : segments_) {
        if (seg.member != m) continue;
        for (std::size_t b = 0; b < b_count; ++b)
          get(block + (b * tm + seg.local) * su, seg.count * sw, kinds[i].wire, field + (b * tg + seg.group) * sw);
      }
      block += b_count * tm * su;
      field += b_count * tg * sw;
    }
  }
}

template <class T>
void UlyssesLayer<T>::to_tokens(std::span<const T* const> sources, const Kinds<T>& kinds,
                                const Shape& s, std::span<T* const> dests, int tag) {
  const std::size_t width = width_, u = heads_->rank(), tr = s.tokens, b_count = s.batch, tg = group_tokens_;
  const std::size_t w = slice_units<T>(kinds, width);
  // To member m: its tokens of this rank's head slice, tensor after tensor.
  std::vector<std::size_t> send_count(width), recv_count(width, b_count * tr * w);
  for (std::size_t m = 0; m < width; ++m) send_count[m] = b_count * member_tokens_[m] * w;
  const std::vector<std::size_t> send_at = prefix(send_count), recv_at = prefix(recv_count);
  send_.resize(send_at.back() + send_count.back());
  recv_.resize(width * b_count * tr * w);
  for (std::size_t m = 0; m < width; ++m) {
    std::uint16_t* block = send_.data() + send_at[m];
    const std::size_t tm = member_tokens_[m];
    for (std::size_t i = 0; i < kinds.size(); ++i) {
      const std::size_t sw = kinds[i].heads / width * kinds[i].dim, su = sw * units<T>(kinds[i].wire);
      for (const Segment& seg : segments_) {
        if (seg.member != m) continue;
        for (std::size_t b = 0; b < b_count; ++b)
          put(sources[i] + (b * tg + seg.group) * sw, seg.count * sw, kinds[i].wire, block + (b * tm + seg.local) * su);
      }
      block += b_count * tm * su;
    }
  }
  all_to_all(*heads_, send_.data(), send_at, send_count, recv_.data(), recv_at, recv_count, tag);
  // From member m: this rank's tokens of head slice m.
  for (std::size_t m = 0; m < width; ++m) {
    const std::uint16_t* block = m == u ? send_.data() + send_at[u] : recv_.data() + recv_at[m];
    for (std::size_t i = 0; i < kinds.size(); ++i) {
      const std::size_t row = kinds[i].heads * kinds[i].dim, sw = row / width;
      for (std::size_t t = 0; t < b_count * tr; ++t) block = get(block, sw, kinds[i].wire, dests[i] + t * row + m * sw);
    }
  }
}

template <class T>
void UlyssesLayer<T>::wire_types(const std::array<std::optional<Half>, 5>& inputs, std::optional<Half> out) {
  if constexpr (!std::is_same_v<T, float>) {
    bool any = out.has_value();
    for (const auto& w : inputs) any = any || w.has_value();
    if (any) throw InvalidArgument("kda::UlyssesLayer::wire_types: 16-bit wire types need T = float");
  }
  wire_in_ = inputs;
  wire_out_ = out;
}

template <class T>
void UlyssesLayer<T>::gather_states(std::span<T> slots, SequenceStates<T> out, std::size_t slot) {
  heads_->all_gather(std::as_writable_bytes(slots));
  const std::size_t width = width_, row = slot / out.sequences;
  for (std::size_t m = 0; m < width; ++m)
    for (std::size_t n = 0; n < out.sequences; ++n)
      std::copy_n(slots.data() + m * slot + n * row, row, out.data + (n * width + m) * row);
}

template class UlyssesLayer<float>;
template class UlyssesLayer<double>;

}  // namespace kdacp::kda
