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
#include <string>
#include <vector>

#include "kdacp/cost_model.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/mesh.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp {

// Measurements of the last call on this executor (metadata, not tensors).
struct ExchangeStats {
  std::size_t bytes_sent = 0;
  std::size_t bytes_received = 0;
  // Largest number of bytes this rank held at once for the call beyond its
  // inputs and its returned state (gather buffers, send/receive states).
  std::size_t peak_extra_bytes = 0;
};

struct ExchangeOptions {
  ExecPolicy exec{};
  // pipelined_p2p (and auto when it picks it): column segments c, 1..V/16;
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
};

class StateExchange {
 public:
  virtual ~StateExchange() = default;
  virtual State forward(const StateView& s, const StateView& m) = 0;
  virtual State backward(const StateView& g, const StateView& m) = 0;

  virtual std::string method() const = 0;
  // True when the protocol performs exactly the chain's operations (SPEC §5).
  virtual bool exact() const = 0;
  // For auto: the chosen configuration and its predicted time and memory;
  // empty for an explicitly named method.
  virtual std::optional<Prediction> prediction() const { return std::nullopt; }
  std::size_t rank() const { return rank_; }
  std::size_t size() const { return size_; }
  const ExchangeStats& last_stats() const { return stats_; }

 protected:
  StateExchange(std::size_t rank, std::size_t size) : rank_(rank), size_(size) {}
  std::size_t rank_;
  std::size_t size_;
  ExchangeStats stats_;
};

// Methods the factory knows, in the order they are documented (auto last).
std::vector<std::string> exchange_methods();

// What the factory table says about each method.
struct MethodInfo {
  std::string name;
  bool exact = true;              // the chain's operations: bitwise equal to p2p
  bool takes_group_size = false;  // accepts allgather_group_size != 1
  bool takes_segments = false;    // accepts ExchangeOptions::segments != 0
  bool chooser = false;           // auto: builds one of the other methods
};
std::vector<MethodInfo> exchange_method_info();

// The concrete protocols: every method except the chooser (auto).
std::vector<std::string> exchange_protocols();

// Builds the executor for `method` over the 1-D chronological CP mesh (SPEC
// §6 Factory): unknown method, non-positive group size, group size != 1 for a
// method other than grouped_allgather_p2p / grouped_allgather_rd, or a width
// not dividing P throw InvalidArgument. grouped with w = 1 is the chain
// (grouped_allgather_rd: recursive_doubling), with w = P the allgather.
// Segments other than 0 are only valid for pipelined_p2p and auto.
// "auto" needs options.expected_shape and picks with choose_protocol();
// method() then names the chosen protocol and prediction() reports it.
// Collective over the mesh's root when the grouped protocol splits the mesh.
std::unique_ptr<StateExchange> make_state_exchange(const DeviceMesh& mesh,
                                                   const std::string& method,
                                                   long long allgather_group_size = 1,
                                                   ExchangeOptions options = {});

}  // namespace kdacp
