// The p2p protocol's walk of the chain over parts (SPEC §6, §10), shared by
// the p2p exchange (its folds) and the layer's deterministic mode (each
// part's forward or backward): one messaging code for both.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <variant>
#include <vector>

#include "kdacp/comm.hpp"
#include "kdacp/kernels.hpp"
#include "kdacp/layout.hpp"
#include "kdacp/summary.hpp"
#include "kdacp/tensor.hpp"

namespace kdacp::detail {

// What enters one of this rank's parts.
enum class ChainInput {
  none,     // nothing: the part before it hands nothing on (or there is none)
  awaited,  // a state the part's step reads: the walk waits for it first
  kept,     // a state the step does not read: the walk only returns it
};

// When the steps of parts whose step reads no incoming state run.
enum class ChainOrder {
  // Every step in this rank's chain order (the deterministic layer: its
  // forward cache records the parts in that order).
  in_order,
  // Those steps first, in chain order, before any wait; then the others
  // (p2p: a cut hands its offset on before anything arrives, so the chain
  // does not wait across it).
  unwaited_first,
};

// What a step hands on to the next part in the direction of the walk:
// nothing, a state the step made, or a view of one that outlives the walk
// (sent as it is when dense, else densely copied; copied for a part of this
// rank).
using ChainOut = std::variant<std::monostate, State, StateView>;

// The step of this rank's part i (index into its parts, ascending chain
// positions): `incoming` is the state that entered the part when its input is
// awaited, else null.
using ChainStep = std::function<ChainOut(std::size_t i, const State* incoming)>;

struct ChainWalk {
  // Each of this rank's parts' incoming state, in the order of its parts:
  // what arrived or was handed on locally; zeros where the input is none.
  std::vector<State> incoming;
  double waiting = 0;   // seconds waiting on messages (receives, then sends)
  double stepping = 0;  // seconds in the steps
};

// Walks the chain in `direction` on `rank` of `comm`, the parts' owners
// being `owners` (this rank's parts: owners.parts_of(rank)). Each part
// receives its incoming state from the rank holding the part before it, or
// takes it from this rank's own step, as `inputs[i]` says (the caller's flags
// must agree with what the previous part's step hands on); the step runs; what
// it hands on goes to the rank holding the next part, or straight into that
// part when this rank holds it. Messages carry part_tag(position entered,
// direction); every receive is posted before the first step, and the walk
// returns once every message of this rank has completed (each wait bounded
// by the communicator's timeout). States are [B,H,K,V] of `shape`.
ChainWalk walk_chain(Communicator& comm, const PartOwners& owners, std::size_t rank,
                     Direction direction, const SummaryShape& shape,
                     std::span<const ChainInput> inputs, ChainOrder order, const ChainStep& step);

}  // namespace kdacp::detail
