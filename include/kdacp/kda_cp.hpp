// The context-parallel KDA layer: each rank holds one or more parts of the
// stream (contiguous, zigzag or any layout); forward = local summary of each
// part -> exchange.forward -> local forward of each part from its incoming
// state; backward = each part's G -> exchange.backward(G, saved M) -> local
// backward of each part with its final-state gradient. Equals one device
// (SPEC §9), also over packed sequences with initial and final states
// (SPEC §10, docs/sequences.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kdacp/agreement.hpp"
#include "kdacp/comm.hpp"
#include "kdacp/exchange.hpp"
#include "kdacp/kda.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp::kda {

// The layout value is the layout module's (layout.hpp).
using kdacp::Layout;
using kdacp::LayoutPart;
using kdacp::slice_tokens;
using kdacp::split_tokens;
using kdacp::TokenSplit;
using kdacp::unslice_tokens;

// A layer call's global token stream, identical on every rank: its sequences
// (kda::Sequences: packed with cu_seqlens, or one per batch row) and their
// layout over the CP ranks.
struct Stream {
  Sequences sequences;
  Layout layout;
};

// What forward hands the caller to keep until backward.
// One entry per part of this rank, in chain order.
struct Saved {
  std::vector<State> transfer;  // M [B,HV,K,K] (zero for a cut part: the exchange does not read it)
  std::vector<State> incoming;  // the incoming state [B,HV,K,V] (backward recomputes from it)
  // The stream of the forward (for the forward without one, its stream of
  // one sequence per row): backward runs the same parts with the same cuts.
  std::optional<Stream> stream;
  // What the chunk forward kept for this backward (keep_forward; null
  // otherwise): one record per sequence piece of every part, in order.
  std::shared_ptr<ForwardCache<float>> kept_f32;
  std::shared_ptr<ForwardCache<double>> kept_f64;
  // The forward ran the deterministic mode (deterministic(bool)):
  // its backward does too, and `transfer` is empty.
  bool deterministic = false;

  // kept_f32 or kept_f64, by element type.
  template <class T>
  std::shared_ptr<ForwardCache<T>>& kept() {
    if constexpr (std::is_same_v<T, float>) return kept_f32;
    else return kept_f64;
  }
  template <class T>
  const std::shared_ptr<ForwardCache<T>>& kept() const {
    if constexpr (std::is_same_v<T, float>) return kept_f32;
    else return kept_f64;
  }
};

// Seconds spent in each phase of the last call.
struct PhaseTimes {
  double local = 0;     // summary / G pass and the local recurrence
  double summary = 0;   // of local: the summary (forward) or the G pass (backward) alone
  double exchange = 0;  // the state exchange, and the ht / dht / dh0 collectives
};

// What the layer checks beyond its arguments' own validity.
struct LayerChecks {
  // A forward or backward that writes a NaN or ±Inf (o, ht, dq, dk, dv, dg,
  // dbeta, dh0, d_incoming; float32 overflow from finite inputs, say) throws
  // NumericalError naming the tensor and its first non-finite element
  // instead of returning it. Off: no scan of the outputs (a little faster).
  bool check_finite = true;
  // The caller's own fields that every rank must share (the CLI: a hash of
  // its input files' bytes, its seed), compared with the layer's own at
  // construction, in the same collective.
  Fingerprint agree;
};

// Ranks agree before any message (kdacp/agreement.hpp): the constructor and
// every forward and backward first compare, in one all-gather of a small
// fixed-size record over mesh.group(0), every argument that must be the same
// on every rank. At construction: dtype, method, allgather_group_size,
// every ExchangeOptions knob (segments, memory budget, reassociation, cost
// parameters, expected shape, part owners, expected cuts), the layout's part
// lengths, the communicator's timeout and LayerChecks::agree. Per call: the
// call itself, B, H, HV, K, V, scale, algorithm and, with a stream, its
// sequences (B, T, the exact cu_seqlens), the layout's part owners and
// lengths and which of h0 / ht / dht / dh0 are given. A difference, or an argument error on any
// one rank, throws InvalidArgument on EVERY rank naming each field and which
// ranks hold which value ("scale: ranks 0,2 have 0.088388346, rank 1 has
// 0.1"), before any message of the exchange, so no rank waits or crashes.
template <class T>
class ContextParallelLayer {
 public:
  // Builds the layer's exchange with make_state_exchange(mesh, method,
  // allgather_group_size, options), collective over the mesh as that is, and
  // hands it `exec` in place of options.exec: one policy (one pool) runs this
  // rank's KDA math and its exchange. exec.pool, when set, must outlive the
  // layer and is used by one call at a time.
  ContextParallelLayer(const DeviceMesh& mesh, const std::string& method,
                       long long allgather_group_size = 1, ExchangeOptions options = {},
                       const Exec& exec = {}, LayerChecks checks = {});
  // The layer for streams laid out by `layout` (P = the mesh's ranks): the
  // exchange is built with options.part_owners = layout.owners(). One part
  // per rank in rank order runs on every method; several parts per rank, or
  // parts out of rank order, need a method whose registry row takes layouts
  // (p2p, allgather, auto); make_state_exchange throws InvalidArgument for
  // the others.
  ContextParallelLayer(const DeviceMesh& mesh, const std::string& method, const Layout& layout,
                       long long allgather_group_size = 1, ExchangeOptions options = {},
                       const Exec& exec = {}, LayerChecks checks = {});

  // One sequence per batch row, zero initial state, no final state: rank r
  // holds the r-th run of consecutive tokens (any lengths; the rank needs
  // only its own). in: this rank's chunk, dense [B,T_r,...]; writes o
  // [B,T_r,HV,V]. Needs an exchange of one part per rank in rank order.
  // The same call as the stream forward below over that stream (the ranks'
  // T_r all-gathered first): one code path, the same bits.
  Saved forward(const Inputs<T>& in, Elem<T>* o);
  // Gradients of this rank's chunk; grads.d_incoming (optional) receives the
  // gradient w.r.t. this rank's incoming state. The stream backward with no
  // h0, dht or dh0.
  void backward(const Inputs<T>& in, const Saved& saved, const Elem<T>* d_o,
                const Grads<Elem<T>>& grads);

  // The stream of `batch` rows of `tokens` tokens over this layer's P ranks,
  // laid out by Layout::contiguous(tokens, P, counts): each row one sequence
  // (cu_seqlens empty) or N packed sequences (Sequences' rules). Its
  // InvalidArgument names this rank.
  Stream contiguous_stream(std::size_t batch, std::size_t tokens,
                           std::span<const std::int64_t> cu_seqlens = {},
                           std::span<const std::size_t> counts = {}) const;
  Stream contiguous_stream(std::size_t batch, std::size_t tokens,
                           std::span<const std::int32_t> cu_seqlens,
                           std::span<const std::size_t> counts = {}) const;

  // The layer over `stream` (SPEC §10). in: this rank's local tensors
  // [B,T_local,...] (its parts' tokens); writes o [B,T_local,HV,V].
  // h0: initial states [N,HV,K,V], identical on every rank (data null: zero).
  // ht: when ht.data is set, receives the final states [N,HV,K,V], complete
  // and the same bits on every rank: each row is computed by the part holding
  // its sequence's last token and broadcast from its rank over mesh.group(0).
  // ht is requested on every rank or on none (the broadcasts are collective).
  // Throws InvalidArgument naming this rank, before any message, for a stream
  // whose layout is not P ranks and T tokens or whose part owners are not the
  // exchange's (the layout the layer was built with; the first constructor:
  // one part per rank in rank order, or options.part_owners), inputs that are
  // not that rank's [B,T_local,...], and h0/ht not [N,HV,K,V].
  Saved forward(const Inputs<T>& in, const Stream& stream, SequenceStates<const Elem<T>> h0,
                Elem<T>* o, SequenceStates<Elem<T>> ht);
  // Gradients of the sequence forward that returned `saved`, with the same
  // inputs and h0. dht: this rank's loss's gradient w.r.t. ht [N,HV,K,V]
  // (given on every rank or on none; none: zero); the layer all-gathers the
  // ranks' dht and sums them in rank order, so ht's gradient is the sum over
  // ranks and every rank uses the same bits. Writes dq, dk, dv, dg, dbeta for
  // this rank's tokens, grads.d_incoming (optional) for this rank's first
  // part (the gradient w.r.t. the state entering it), and,
  // when dh0.data is set (on every rank or none), dh0 [N,HV,K,V] complete and
  // the same bits on every rank: row n computed by the part holding sequence
  // n's first token and broadcast from its rank.
  void backward(const Inputs<T>& in, const Saved& saved, SequenceStates<const Elem<T>> h0,
                const Elem<T>* d_o, SequenceStates<const Elem<T>> dht,
                const Grads<Elem<T>>& grads, SequenceStates<Elem<T>> dh0);

  const PhaseTimes& forward_times() const { return fwd_; }
  const PhaseTimes& backward_times() const { return bwd_; }
  const StateExchange& exchange() const { return *exchange_; }

  // With Algorithm::chunk, forward keeps in its Saved what the backward would
  // recompute (kda::ForwardCache: about 1.25× the rank's q, k, v, g at
  // K = V = 128), so the backward skips that pass; the same bits either way.
  // On by default (defaults::kKeepForward; off: Saved stays M and the
  // incoming state). The layer reuses
  // a cache's buffers once every Saved holding it is gone, so a training
  // loop does not fault fresh pages in every step; forward_cache_bytes()
  // is what the layer holds.
  void keep_forward(bool on) { keep_forward_ = on; }
  bool keeps_forward() const { return keep_forward_; }
  std::size_t forward_cache_bytes() const;

  // The algorithm of the following calls (kda::Exec::algorithm; the
  // constructor's exec sets it first). A backward runs with its forward's.
  void algorithm(Algorithm a) { exec_.algorithm = a; }
  Algorithm algorithm() const { return exec_.algorithm; }

  // The deterministic mode of the following forwards (off until set; a
  // backward runs in its forward's mode). On, the exchange is not used: each part receives
  // its incoming state from the part before it in chain order, computed by
  // that part's own forward from its incoming state (and the backward's
  // state gradient likewise in reverse), so o, ht, dq, dk, dv, dg, dbeta,
  // dh0 and d_incoming are the same bytes for every P, layout, method and
  // thread count, and equal kda::forward_sequences / backward_sequences on
  // one process. With Algorithm::chunk every part that continues a sequence
  // must start a multiple of kChunkSize tokens into it (else InvalidArgument
  // naming the part). The price: the parts' walks run one after another
  // (docs/determinism.md measures it), so a rank may wait up to about one
  // device's forward for its incoming state: the communicator's timeout
  // must exceed that. dht is still summed over ranks in
  // rank order: the bytes are P-invariant when one rank gives it.
  void deterministic(bool on) { deterministic_ = on; }
  bool deterministic() const { return deterministic_; }

  // LayerChecks::check_finite, for the following calls.
  void check_finite(bool on) { check_finite_ = on; }
  bool checks_finite() const { return check_finite_; }
  // Off: forward and backward skip their per-call agreement (the caller has
  // agreed on the call's arguments once, as kdacp.torch's CpContext does):
  // each rank's own argument checks still run and throw on that rank alone,
  // before it sends anything; its peers then wait until the timeout.
  void agree_per_call(bool on) { agree_calls_ = on; }
  bool agrees_per_call() const { return agree_calls_; }

 private:
  // A cache for the next forward (null unless keep_forward and chunk): one
  // no Saved holds any more, else a new one.
  std::shared_ptr<ForwardCache<Elem<T>>> next_cache();
  static ForwardCache<Elem<T>>* kept_of(const Saved& saved);

  // The calls without a stream run the plain exchange: one part per rank.
  void require_plain(std::size_t rank, const char* op) const;
  // The stream those calls stand for: one sequence per row over the ranks'
  // token counts (all-gathered, collective).
  Stream plain_stream(const Shape& local, const char* op) const;
  // Runs `checks` (this rank's argument checks), then agree() over comm_
  // with `fields` and their error, if any: every rank throws or none.
  void agree_on(const char* op, const Fingerprint& fields, const std::function<void()>& checks) const;
  // The deterministic mode's chain (see deterministic()): the parts' forwards
  // in chain order, each from the state its predecessor hands on; returns
  // each part's incoming state. The backward: in reverse, each part's
  // d_end from its successor's gradient w.r.t. its incoming state.
  std::vector<State> chain_forward(const Inputs<T>& in, const Stream& stream,
                                   const std::vector<Part>& parts, const std::vector<PartInfo>& infos,
                                   SequenceStates<const Elem<T>> h0, Elem<T>* o,
                                   SequenceStates<Elem<T>> ht, ForwardCache<Elem<T>>* cache);
  void chain_backward(const Inputs<T>& in, const Saved& saved, const std::vector<Part>& parts,
                      const std::vector<PartInfo>& infos, SequenceStates<const Elem<T>> h0,
                      const Elem<T>* d_o, SequenceStates<const Elem<T>> dht,
                      const Grads<Elem<T>>& grads, SequenceStates<Elem<T>> dh0,
                      ForwardCache<Elem<T>>* kept);
  // Both constructors: the agreement at construction, then the exchange.
  void build(const DeviceMesh& mesh, const std::string& method, long long allgather_group_size,
             ExchangeOptions options, const Layout* layout, const Fingerprint& caller);

  std::unique_ptr<StateExchange> exchange_;
  std::shared_ptr<Communicator> comm_;  // mesh.group(0): ht / dh0 broadcasts, dht gather
  Exec exec_;
  bool deterministic_ = defaults::kDeterministic;
  PhaseTimes fwd_, bwd_;
  bool keep_forward_ = defaults::kKeepForward;
  bool check_finite_ = true;
  bool agree_calls_ = true;
  ForwardCachePool<Elem<T>> caches_;
};

// Owning layer inputs in the layout of SPEC §9.
template <class T>
struct LayerData {
  Shape shape;
  std::vector<T> q, k, v, g, beta;
  Inputs<T> inputs(T scale) const { return Inputs<T>{q.data(), k.data(), v.data(), g.data(), beta.data(), shape, scale}; }
  // This rank's tokens as a dense chunk.
  LayerData slice(TokenSplit range) const;
};

}  // namespace kdacp::kda
