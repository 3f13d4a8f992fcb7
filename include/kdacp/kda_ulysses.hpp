// Ulysses × state CP: the KDA layer over P ranks arranged as a P/U × U grid
// (docs/scale.md, "Ulysses × state CP", prices it). Rank r = c·U + u: the U
// consecutive ranks c·U .. c·U+U-1 form head group c, the P/U ranks with the
// same u form head slice u's state-CP group. A call:
//
//   1. all-to-all over the head group: rank (c, u) sends member u' the heads
//      [u'·H/U, (u'+1)·H/U) of its tokens' q, k (and value heads
//      [u'·HV/U, ...) of v, g, β), and receives the group's tokens of its
//      own head slice: group c's parts of the stream, H/U and HV/U heads;
//   2. the context-parallel layer (ContextParallelLayer) over the P/U ranks
//      of its state-CP group, on the group layout (the stream's parts with
//      each rank's owner replaced by its head group, adjacent parts of one
//      group merged), with h0 sliced by value heads;
//   3. all-to-all of o back; ht (and in backward dh0) all-gathered over the
//      head group. The backward sends d_o and dht out and the gradients back.
//
// The state exchange then carries HV/U heads over P/U ranks instead of HV
// over P: U times less data over U times fewer hops, for two all-to-alls of
// the activations per direction. H and HV must be multiples of U.
//
// Results: o, ht, the gradients and dh0 are those of the context-parallel
// layer over the group layout (each head's math is the same operations in
// the same order; tests/test_ulysses.cpp compares bitwise), so they equal one
// device as that layer does. ht's gradient is the sum over the P ranks of
// their dht (over the head group, then over the state-CP group, exact zeros
// not added: one rank's dht with zeros elsewhere is that dht bit for bit).
//
// Agreement (kdacp/agreement.hpp): the constructor and every call first
// agree over all P ranks (mesh.group(0)) on everything the context-parallel
// layer's agreement names, plus U; a bad argument on any rank throws on
// every rank before the first all-to-all. Bounded waits: every message is a
// Communicator operation under its timeout.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdacp/half.hpp"
#include "kdacp/kda_cp.hpp"
#include "kdacp/mesh.hpp"

namespace kdacp::kda {

// What forward hands the caller to keep until backward: the state-CP layer's
// Saved and this rank's inputs of its head slice over the group's tokens
// (the backward's inputs; sending them again would cost an all-to-all).
template <class T>
struct UlyssesSaved {
  Saved saved;
  std::shared_ptr<const std::vector<T>> inputs;  // q, k, v, g, β of the head slice, one buffer
  std::optional<Stream> stream;                   // the caller's stream
};

// The group layout of `layout` (P ranks) for head groups of `width`
// consecutive ranks: each part's owner divided by `width`, adjacent parts
// of one group merged. Throws InvalidArgument unless width ≥ 1 divides P.
Layout ulysses_group_layout(const Layout& layout, std::size_t width);

// The exchange options of the state-CP layer for `options` (those of a
// layer over `layout` on P ranks): expected_shape's heads divided by
// `width`, expected_cuts mapped to the group layout's parts (a merged part
// is a cut when any of its parts is). Throws InvalidArgument naming the
// field when the heads are not a multiple of width or the cuts do not have
// one flag per part of `layout`.
ExchangeOptions ulysses_exchange_options(const ExchangeOptions& options, const Layout& layout,
                                         std::size_t width);

template <class T>
class UlyssesLayer {
 public:
  // Collective over the ROOT of `mesh` (a 1-D mesh of P ranks: the world, or
  // one dim of a mesh attached to it), as DeviceMesh::unflatten: splits it
  // into the P/U × U grid ("cp", "hp") and builds the state-CP layer over
  // "cp" for ulysses_group_layout(layout, width) with
  // ulysses_exchange_options(options, layout, width). width = 1 is the
  // context-parallel layer with two no-op all-to-alls.
  UlyssesLayer(const DeviceMesh& mesh, std::size_t width, const std::string& method, const Layout& layout,
               long long allgather_group_size = 1, ExchangeOptions options = {}, const Exec& exec = {},
               LayerChecks checks = {});

  // ContextParallelLayer::forward / backward's contract over `stream` (its
  // layout: the one the layer was built with), for this rank's tokens and
  // all heads. grads.d_incoming is not supported (a rank's tokens are not
  // one part of the state exchange): InvalidArgument.
  UlyssesSaved<T> forward(const Inputs<T>& in, const Stream& stream, SequenceStates<const Elem<T>> h0, Elem<T>* o,
                          SequenceStates<Elem<T>> ht);
  void backward(const Inputs<T>& in, const UlyssesSaved<T>& saved, SequenceStates<const Elem<T>> h0,
                const Elem<T>* d_o, SequenceStates<const Elem<T>> dht, const Grads<Elem<T>>& grads,
                SequenceStates<Elem<T>> dh0);

  std::size_t width() const { return width_; }
  // The head group's communicator (U ranks, this rank's group): its stats
  // count the all-to-alls and the all-gathers of ht and dh0.
  const Communicator& head_group() const { return *heads_; }
  // The state-CP group's layout (P/U ranks).
  const Layout& group_layout() const { return group_layout_; }
  // The state-CP layer; its setters (keep_forward, algorithm, deterministic)
  // apply to the following calls.
  ContextParallelLayer<T>& state_layer() { return *inner_; }
  const ContextParallelLayer<T>& state_layer() const { return *inner_; }
  const StateExchange& exchange() const { return inner_->exchange(); }
  // The state-CP layer's phases; `exchange` adds the all-to-alls and the
  // head group's all-gathers.
  const PhaseTimes& forward_times() const { return fwd_; }
  const PhaseTimes& backward_times() const { return bwd_; }
  // Seconds of the last forward's / backward's all-to-alls and all-gathers.
  double forward_all_to_all_seconds() const { return fwd_a2a_; }
  double backward_all_to_all_seconds() const { return bwd_a2a_; }

  // Off: forward and backward skip their agreement over the P ranks (the
  // caller agreed on the call's arguments once, as kdacp.torch's CpContext
  // does): each rank's own checks still run and throw on that rank alone,
  // before it sends anything; its peers then wait until the timeout.
  void agree_per_call(bool on) { agree_calls_ = on; }
  bool agrees_per_call() const { return agree_calls_; }

  // The 16-bit types the caller stores the following calls' tensors in
  // (nullopt: T): q, k, v, g, beta, and `out` for o (forward) and d_o
  // (backward). Each then travels the all-to-alls in that type, and so does
  // each input's gradient in the backward: half the bytes of a float32
  // message. The caller's inputs and d_o are values of those types (16-bit
  // storage widened, as kdacp.torch's are) and it narrows o and the
  // gradients to them, so the results are the bits of T on the wire
  // (tests/test_ulysses.cpp). A value that is not is rounded to nearest even
  // on the wire; a result beyond the type's range becomes ±Inf, which the
  // finite check names. Ranks must agree (forward and backward compare them
  // with the call's other fields). InvalidArgument for T = double.
  void wire_types(const std::array<std::optional<Half>, 5>& inputs, std::optional<Half> out);
  const std::array<std::optional<Half>, 5>& wire_inputs() const { return wire_in_; }
  std::optional<Half> wire_out() const { return wire_out_; }

  // A non-finite output throws NumericalError (LayerChecks::check_finite),
  // after the call's last message.
  void check_finite(bool on) { check_finite_ = on; }
  bool checks_finite() const { return check_finite_; }

  // A per-token tensor of the all-to-alls: `heads` heads of `dim` elements,
  // in `wire` on the way (nullopt: T).
  struct HeadTensor {
    std::size_t heads, dim;
    std::optional<Half> wire;
  };

 private:
  // One token segment of the head group's exchange: `count` tokens at
  // `local` in member `member`'s tensors and at `group` in the group's.
  struct Segment {
    std::size_t member, local, group, count;
  };
  // The call's shared checks and agreement over all P ranks.
  void agree_on(const char* op, const Fingerprint& fields, const std::function<void()>& checks) const;
  // All-to-all over the head group: this rank's tokens of `sources` (all
  // heads, `kinds`, local shape s) to `dest`, the group's tokens of this
  // rank's head slice, tensor after tensor ([B, T_group, heads/U, dim] each).
  void to_heads(std::span<const T* const> sources, const std::vector<HeadTensor>& kinds, const Shape& s, T* dest,
                int tag);
  // The reverse: `sources` [B, T_group, heads/U, dim] of this rank's head
  // slice to this rank's tokens of every head in `dests`.
  void to_tokens(std::span<const T* const> sources, const std::vector<HeadTensor>& kinds, const Shape& s,
                 std::span<T* const> dests, int tag);
  // All-gather over the head group of `slots` (slot u: head slice u of
  // [N, HV/U, K, V], `slot` elements) into `out` [N, HV, K, V].
  void gather_states(std::span<T> slots, SequenceStates<T> out, std::size_t slot);

  std::size_t width_ = 1;
  Layout layout_, group_layout_;
  std::shared_ptr<Communicator> world_, heads_;  // all P ranks; this rank's head group
  std::unique_ptr<ContextParallelLayer<T>> inner_;
  std::vector<Segment> segments_;  // every member's parts, in member order
  std::vector<std::size_t> member_tokens_;
  std::size_t group_tokens_ = 0;
  Exec exec_;
  bool check_finite_ = true;
  bool agree_calls_ = true;
  std::array<std::optional<Half>, 5> wire_in_{};
  std::optional<Half> wire_out_;
  PhaseTimes fwd_, bwd_;
  double fwd_a2a_ = 0, bwd_a2a_ = 0;
  // A buffer for the head slice of the group's inputs that a forward keeps
  // in its UlyssesSaved: one no UlyssesSaved holds any more, else a new one.
  std::shared_ptr<std::vector<T>> kept_inputs(std::size_t elems);

  // The all-to-alls' send and receive buffers (in 2-byte units: a 16-bit
  // value is one, a float two), the o / d_o slice and the gradients'
  // slices, reused by the next call; the kept inputs' buffers.
  std::vector<std::uint16_t> send_, recv_;
  std::vector<T> out_slice_, grad_slices_;
  std::vector<std::shared_ptr<std::vector<T>>> inputs_pool_;
};

}  // namespace kdacp::kda
