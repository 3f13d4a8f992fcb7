// The chain profile (ChainProfile): what the cost terms read from a shape's
// layout and cuts — the critical path in steps and relays, its waits for a
// block's earlier parts and for shared ports.
#include <algorithm>
#include <array>
#include <map>
#include <vector>

#include <fmt/format.h>

#include "exchange/cost_terms.hpp"
#include "kdacp/cost_model.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

PartOwners owners_of(const ProblemShape& s) {
  if (!s.part_owners) return PartOwners::one_per_rank(s.ranks);
  if (s.part_owners->ranks() != s.ranks) {
    throw InvalidArgument(fmt::format("cost model: part_owners spans {} ranks, expected P = {}",
                                      s.part_owners->ranks(), s.ranks));
  }
  return *s.part_owners;
}

namespace detail {

// The shape's cuts, checked against its n parts (empty: none).
void check_part_cuts(const ProblemShape& s, std::size_t n) {
  if (!s.part_cuts.empty() && s.part_cuts.size() != n) {
    throw InvalidArgument(fmt::format("cost model: part_cuts has {} entries, expected one per part ({})",
                                      s.part_cuts.size(), n));
  }
}

}  // namespace detail

namespace {

using detail::check_part_cuts;
using detail::rank_node_width;

// For each relay j (the step into part j that changes run, leaving in
// slot[j]): how many other relays hold one of its two ports in that slot, the
// port it leaves through and the one it arrives at (a rank's node port for
// relays inside a node, its NIC for those where across(j)). chain_profile's
// ports.
template <class Across>
std::vector<std::size_t> port_sharing(const PartOwners& owners, const std::vector<std::size_t>& run_of,
                                      const Across& across, const std::vector<std::size_t>& slot) {
  const std::size_t n = owners.size();
  using Port = std::array<std::size_t, 4>;  // rank, across nodes, leaving, slot
  auto ports = [&](std::size_t j) {
    const std::size_t a = across(j) ? 1 : 0;
    return std::array{Port{owners[j - 1], a, 1, slot[j]}, Port{owners[j], a, 0, slot[j]}};
  };
  std::map<Port, std::size_t> held;
  for (std::size_t j = 1; j < n; ++j)
    if (run_of[j] != run_of[j - 1])
      for (const Port& port : ports(j)) ++held[port];
  std::vector<std::size_t> shared(n, 0);
  for (std::size_t j = 1; j < n; ++j)
    if (run_of[j] != run_of[j - 1])
      for (const Port& port : ports(j)) shared[j] = std::max(shared[j], held[port] - 1);
  return shared;
}

// ChainProfile's buffers (chain_sends, stream_buffers, relay_states,
// split_folds), counted as the protocols allocate them.
void count_buffers(ChainProfile& out, const PartOwners& owners, const std::vector<std::size_t>& run_of,
                   std::size_t w) {
  const std::size_t n = owners.size(), p = owners.ranks();
  std::vector<std::size_t> sends(p), local(p), buffers(p);
  for (const bool forward : {true, false}) {
    std::fill(sends.begin(), sends.end(), 0);
    std::fill(local.begin(), local.end(), 0);
    std::fill(buffers.begin(), buffers.end(), 0);
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t r = owners[j];
      const bool has_prev = forward ? j > 0 : j + 1 < n;
      const bool has_next = forward ? j + 1 < n : j > 0;
      const bool next_here = has_next && owners[forward ? j + 1 : j - 1] == r;
      if (next_here) local[r] = 1;
      if (has_next && !next_here && has_prev) ++sends[r];
      buffers[r] += (has_prev ? 1 : 0) + (has_next && !next_here ? 1 : 0);
    }
    for (std::size_t r = 0; r < p; ++r) {
      out.chain_sends = std::max(out.chain_sends, sends[r] + local[r]);
      out.stream_buffers = std::max(out.stream_buffers, buffers[r]);
    }
  }
  // Runs fed and runs sent on: the same count in both directions.
  std::vector<std::size_t> relayed(p / w + 1, 0);
  for (std::size_t j = 0; j < n; ++j) {
    if (j > 0 && run_of[j] == run_of[j - 1]) continue;
    relayed[owners[j] / w] += (run_of[j] > 0 ? 1 : 0) + (run_of[j] + 1 < out.runs ? 1 : 0);
  }
  out.relay_states = *std::max_element(relayed.begin(), relayed.end());
  // The gather's slot of each part (allgather.cpp: rank by rank, k each),
  // and `breaks`: how many adjacent positions before u are not adjacent
  // slots. A part folds the positions from its rank's previous part on
  // (forward [start, j), backward (j, start]).
  std::vector<std::size_t> held(p, 0), slot(n), breaks(n, 0);
  for (std::size_t j = 0; j < n; ++j) slot[j] = owners[j] * out.per_rank + held[owners[j]]++;
  for (std::size_t u = 1; u < n; ++u) breaks[u] = breaks[u - 1] + (slot[u] != slot[u - 1] + 1 ? 1 : 0);
  std::vector<std::size_t> last(p, n);  // each rank's previous part, forward
  for (std::size_t j = 0; j < n && !out.split_folds; ++j) {
    const std::size_t start = last[owners[j]] == n ? 0 : last[owners[j]];
    last[owners[j]] = j;
    out.split_folds = j >= start + 2 && breaks[j - 1] != breaks[start];
  }
  std::fill(last.begin(), last.end(), n);  // each rank's previous part, backward
  for (std::size_t j = n; j-- > 0 && !out.split_folds;) {
    const std::size_t start = last[owners[j]] == n ? n - 1 : last[owners[j]];
    last[owners[j]] = j;
    out.split_folds = start >= j + 2 && breaks[start] != breaks[j + 1];
  }
}

}  // namespace

ChainProfile chain_profile(const ProblemShape& s, std::size_t width, std::size_t order_weight) {
  const std::size_t p = s.ranks;
  const PartOwners owners = owners_of(s);
  const std::size_t n = owners.size();
  check_part_cuts(s, n);
  const std::size_t w = std::max<std::size_t>(1, width);
  ChainProfile out;
  out.parts = n;
  out.per_rank = owners.max_per_rank();
  std::vector<std::size_t> run_of(n, 0), block_runs(p / w + 1, 0);
  std::size_t run_len = 0;
  out.runs = 0;
  out.longest_run = 0;
  for (std::size_t j = 0; j < n; ++j) {
    if (j == 0 || owners[j] / w != owners[j - 1] / w) {
      ++out.runs;
      ++block_runs[owners[j] / w];
      run_len = 0;
    }
    run_of[j] = out.runs - 1;
    out.longest_run = std::max(out.longest_run, ++run_len);
  }
  out.runs_per_block = *std::max_element(block_runs.begin(), block_runs.end());
  // Stretches start at the chain's start and at every cut and end at the
  // next cut, which receives but need not wait (the backward chain has the
  // same stretches, mirrored). A rank (a block, for width w) handles its
  // parts one after the other in chain order, waiting for each part's state
  // (p2p.cpp, runs.cpp): a stretch that passes a rank also waits for that
  // rank's earlier parts. The critical path is the longest path over both
  // kinds of edges (chain order is a topological order of them): by relays,
  // (plus order_weight per edge of the second kind), then relays across
  // nodes; and, apart, by steps.
  auto cut = [&](std::size_t j) { return !s.part_cuts.empty() && s.part_cuts[j]; };
  // A relay goes between the carriers of two blocks, their last ranks (runs.cpp;
  // width 1: the parts' owners themselves), on nodes of consecutive ranks
  // for any layout.
  const std::size_t node = rank_node_width(s);
  auto carrier_node = [&](std::size_t rank) { return (rank / w * w + w - 1) / node; };
  auto across = [&](std::size_t j) { return node == 0 || carrier_node(owners[j - 1]) != carrier_node(owners[j]); };
  struct Path {
    std::size_t relays = 0, node_relays = 0, order_waits = 0;
    std::size_t port_waits = 0, node_port_waits = 0;
  };
  auto key = [&](const Path& a) { return a.relays + a.port_waits + order_weight * a.order_waits; };
  auto worse = [&](const Path& a, const Path& b) {
    const bool less = key(a) != key(b) ? key(a) < key(b) : a.node_relays < b.node_relays;
    return less ? b : a;
  };
  std::vector<Path> done(n);
  // The longest paths to every part, a relay into part j costing 1 + shared[j]
  // (its port's other messages, below; none on the first walk).
  auto walk = [&](const std::vector<std::size_t>& shared) {
    std::fill(done.begin(), done.end(), Path{});
    std::vector<std::size_t> done_steps(n, 0);
    std::vector<std::size_t> last_of_block(p / w + 1, n);  // n: none yet
    Path worst;
    out.steps = 0;
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t block = owners[j] / w;
      const std::size_t before = last_of_block[block];
      last_of_block[block] = j;
      if (j == 0) continue;
      // The step into j: its incoming state, a message when the run changes.
      Path in = done[j - 1];
      if (run_of[j] != run_of[j - 1]) {
        ++in.relays;
        if (across(j)) ++in.node_relays;
        if (!shared.empty()) {
          in.port_waits += shared[j];
          if (across(j)) in.node_port_waits += shared[j];
        }
      } else {
        ++in.order_waits;  // the block's previous part, on the same block
      }
      const std::size_t in_steps = done_steps[j - 1] + 1;
      worst = worse(worst, in);
      out.steps = std::max(out.steps, in_steps);
      // A cut hands its own offset on without waiting: a new stretch.
      if (cut(j)) continue;
      done[j] = in;
      done_steps[j] = in_steps;
      // The block's previous part, when it is not the chain's previous one.
      if (before != n && before + 1 != j) {
        Path wait = done[before];
        ++wait.order_waits;
        done[j] = worse(done[j], wait);
        done_steps[j] = std::max(done_steps[j], done_steps[before] + 1);
        worst = worse(worst, done[j]);
        out.steps = std::max(out.steps, done_steps[j]);
      }
    }
    return worst;
  };
  Path worst = walk({});
  // Ports (p2p: ranks, one state per relay): stretches run side by side, and
  // a rank's port carries one state at a time at full speed. A relay leaves
  // when its part is done (the first walk's key, in relays) and holds the
  // port of the rank it leaves and of the one it reaches (inside a node the
  // rank's node port, across nodes its NIC) for one relay time: relays that
  // hold one port in the same slot share it, and each takes one more relay
  // time per relay beside it. One chain without cuts never shares (its
  // relays leave one after the other). The second walk finds the worst path
  // with these costs. Not for blocks (w > 1: a block's carrier sends its
  // runs) nor pipelined_p2p's streams (order_weight > 0): c segments that
  // overlap in part, which relay counts do not time (stream_nic_waits).
  if (w == 1 && order_weight == 0 && n >= 2 && !s.part_cuts.empty()) {
    std::vector<std::size_t> slot(n, 0);
    for (std::size_t j = 1; j < n; ++j) slot[j] = key(done[j - 1]);
    const std::vector<std::size_t> shared = port_sharing(owners, run_of, across, slot);
    const bool any = std::any_of(shared.begin(), shared.end(), [](std::size_t k) { return k > 0; });
    if (any) worst = walk(shared);
  }
  out.relays = worst.relays;
  out.node_relays = worst.node_relays;
  out.order_waits = worst.order_waits;
  out.port_waits = worst.port_waits;
  out.node_port_waits = worst.node_port_waits;
  count_buffers(out, owners, run_of, w);
  return out;
}

}  // namespace kdacp
