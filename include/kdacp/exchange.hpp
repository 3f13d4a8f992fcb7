// State exchange protocols (SPEC §3-§6) behind one interface and one factory.
//
// forward(S, M) returns this rank's incoming state; backward(G, saved M)
// returns its final-state gradient. Inputs are never modified. An executor
// holds communication metadata only: no tensors, no caches between calls, so
// several forwards may be live before their backwards, in any order.
// Every input is validated (summary.hpp) before any message is sent.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdacp/cost_model.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/protocol.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp {

namespace detail {
struct ExchangeAccess;
}

// Measurements of the last call on this executor (metadata, not tensors).
struct ExchangeStats {
  std::size_t bytes_sent = 0;
  std::size_t bytes_received = 0;
  // Largest number of bytes this rank held at once for the call beyond its
  // inputs and its returned state (gather buffers, send/receive states).
  std::size_t peak_extra_bytes = 0;
};

// This rank's part of the token stream (SPEC §10). A part that contains a
// sequence start is a cut: its outgoing state is its offset exactly, whatever
// its incoming state (A = 0 instead of M), so its M is validated but never
// read, and the chain does not wait across it. Forward and backward of one
// part must be called with the same flags.
struct PartFlags {
  bool cut = false;
};

struct ExchangeOptions {
  ExecPolicy exec{};
  // pipelined_p2p (and auto when it picks it): column segments c, 1..ceil(V/16);
  // 0 = the cost model's choice for each call's shape. Other methods: 0.
  std::size_t segments = 0;
  // auto: the per-rank budget for peak_extra_bytes; 0 = unlimited.
  std::size_t memory_budget_bytes = 0;
  // auto: also weigh the reassociating protocols (not bitwise equal to the
  // chain; see docs/protocols.md for their error bound).
  bool allow_reassociation = false;
  // The machine the cost model predicts for (auto, and segments = 0).
  CostParams cost{};
  // auto: the summary shape of the calls (B, H, K, V, dtype). Required by
  // auto, which must choose at construction: the grouped protocols split the
  // mesh collectively there. Calls with another shape still run correctly.
  std::optional<SummaryShape> expected_shape;
  // The layout (SPEC §10): the rank that holds each part, in chain order
  // (Layout::owners()). None: PartOwners::one_per_rank(P), which the factory
  // sets explicitly. A rank may hold several parts (zigzag: parts r and
  // 2P-1-r on rank r). Only protocols that take layouts
  // (ProtocolDescriptor::takes_layouts) accept owners other than one part
  // per rank in rank order.
  std::optional<PartOwners> part_owners;
  // The cuts the calls are expected to carry, one flag per part in chain
  // order (Layout::cuts(sequences); the layer and the CLI pass the stream's).
  // auto weighs them (cuts shorten the chain: on a slow network with packed
  // documents the chain's pipelined_p2p wins where, without cuts, a grouped
  // gather would), and pipelined_p2p's segments = 0 prices them. Empty: no
  // cuts expected. Calls with other cuts run correctly, on the choice made.
  std::vector<bool> expected_cuts;
};

// One of this rank's parts: its offset (S forward, G backward), M, and flags.
struct PartSummary {
  StateView offset;
  StateView transfer;
  PartFlags flags;
};

class StateExchange {
 public:
  virtual ~StateExchange() = default;
  StateExchange(const StateExchange&) = delete;
  StateExchange& operator=(const StateExchange&) = delete;

  // Validates the summary (summary.hpp) before any message, runs the
  // protocol's step and records last_stats(). Not virtual: a protocol writes
  // only its communication and folds (run()). Every exact protocol returns
  // the chain-with-cuts result bit for bit (SPEC §5, §10).
  State forward(const StateView& s, const StateView& m, PartFlags part = {});
  State backward(const StateView& g, const StateView& m, PartFlags part = {});
  // The same for a layout (part_owners()): this rank's parts
  // in chain order, all of one shape; returns each part's incoming state
  // (forward) or final-state gradient (backward), in the same order.
  std::vector<State> forward(std::span<const PartSummary> parts);
  std::vector<State> backward(std::span<const PartSummary> parts);
  // Chain positions of this rank's parts, ascending.
  const std::vector<std::size_t>& own_parts() const { return own_parts_; }
  // The rank holding each part, in chain order (explicit: one part per rank
  // is PartOwners::one_per_rank(P)).
  const PartOwners& part_owners() const { return part_owners_; }

  // The registry row of the protocol that runs (for auto: the chosen one).
  const ProtocolDescriptor& descriptor() const { return *descriptor_; }
  std::string method() const { return std::string(descriptor_->name); }
  // True when the protocol performs exactly the chain's operations (SPEC §5).
  bool exact() const { return descriptor_->exact(); }
  // The group size and segment count in force (segments 0: chosen per call).
  const ProtocolConfig& config() const { return config_; }
  // For auto: the chosen configuration and its predicted time and memory;
  // empty for an explicitly named method.
  const std::optional<Prediction>& prediction() const { return prediction_; }
  std::size_t rank() const { return rank_; }
  std::size_t size() const { return size_; }
  const ExchangeStats& last_stats() const { return stats_; }

 protected:
  // What run() is asked: this rank's parts in chain order (validated, one
  // shape), at chain positions own_parts(): their offsets (S forward, G
  // backward), M and cut flags. One part per rank is one part.
  struct Call {
    std::span<const PartSummary> parts;
    SummaryShape shape;
    Direction direction;
  };

  StateExchange(const detail::ProtocolContext& ctx, const ProtocolDescriptor& descriptor);
  // Returns each of this rank's parts' result, in the order of call.parts;
  // every message it sends goes through communicators(), whose traffic the
  // call's stats count. The one code path of a protocol: rows without
  // takes_layouts only ever see one part per rank (the factory rejects other
  // owners for them).
  virtual std::vector<State> run(const Call& call) = 0;
  // The rank holding chain position j, and the number of parts.
  std::size_t owner(std::size_t j) const { return part_owners_[j]; }
  std::size_t part_count() const { return part_owners_.size(); }
  virtual std::vector<const Communicator*> communicators() const = 0;

  const ExchangeOptions& options() const { return options_; }
  std::size_t rank_;
  std::size_t size_;

 private:
  friend struct detail::ExchangeAccess;  // the chooser attaches its prediction
  std::vector<State> call(std::span<const PartSummary> parts, Direction direction);

  const ProtocolDescriptor* descriptor_;
  ProtocolConfig config_;
  ExchangeOptions options_;
  PartOwners part_owners_;  // chain position -> rank
  std::vector<std::size_t> own_parts_;
  std::optional<Prediction> prediction_;
  ExchangeStats stats_;
};

// Methods the factory knows: the registry's names in documentation order
// (auto last). protocol.hpp has the rows themselves.
std::vector<std::string> exchange_methods();

// Builds the executor for `method` over the 1-D chronological CP mesh (SPEC
// §6 Factory): an unknown method, a non-positive group size, a group size != 1
// for a row that takes none, or a width not dividing P throw InvalidArgument.
// grouped with w = 1 is the chain (grouped_allgather_rd: recursive_doubling),
// with w = P the allgather. Segments other than 0 are only valid for rows that
// take segments.
// "auto" needs options.expected_shape and picks with choose_protocol();
// method() then names the chosen protocol and prediction() reports it.
// Collective over the mesh's root when the grouped protocol splits the mesh.
std::unique_ptr<StateExchange> make_state_exchange(const DeviceMesh& mesh,
                                                   const std::string& method,
                                                   long long allgather_group_size = 1,
                                                   ExchangeOptions options = {});

// The configuration make_state_exchange(mesh, method, group_size, options)
// runs at P = shape.ranks and its prediction, without building it: for auto
// its own choice (the registry's chooser, from shape.part_owners standing for
// options.part_owners), else predict() of the named method. Throws what the
// factory would (unknown method, bad group size, nothing within the memory
// budget).
Prediction predict_exchange(const ProblemShape& shape, const std::string& method, long long group_size,
                            const ExchangeOptions& options);

}  // namespace kdacp
