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
#include <string>
#include <vector>

#include "kdacp/kernels.hpp"
#include "kdacp/mesh.hpp"
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
};

class StateExchange {
 public:
  virtual ~StateExchange() = default;
  virtual State forward(const StateView& s, const StateView& m) = 0;
  virtual State backward(const StateView& g, const StateView& m) = 0;

  virtual std::string method() const = 0;
  // True when the protocol performs exactly the chain's operations (SPEC §5).
  virtual bool exact() const = 0;
  std::size_t rank() const { return rank_; }
  std::size_t size() const { return size_; }
  const ExchangeStats& last_stats() const { return stats_; }

 protected:
  StateExchange(std::size_t rank, std::size_t size) : rank_(rank), size_(size) {}
  std::size_t rank_;
  std::size_t size_;
  ExchangeStats stats_;
};

// Methods the factory knows, in the order they are documented.
std::vector<std::string> exchange_methods();

// Builds the executor for `method` over the 1-D chronological CP mesh (SPEC
// §6 Factory): unknown method, non-positive group size, group size != 1 for a
// method other than grouped_allgather_p2p, or a width not dividing P throw
// InvalidArgument. grouped with w = 1 is the chain, with w = P the allgather.
// Collective over the mesh's root when the grouped protocol splits the mesh.
std::unique_ptr<StateExchange> make_state_exchange(const DeviceMesh& mesh,
                                                   const std::string& method,
                                                   long long allgather_group_size = 1,
                                                   ExchangeOptions options = {});

}  // namespace kdacp
