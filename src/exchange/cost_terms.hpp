// Internal: the building blocks of the protocols' cost terms (protocol.hpp),
// in counts of messages, bytes and steps. docs/protocols.md derives them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "kdacp/protocol.hpp"

namespace kdacp::detail {

inline std::size_t ceil_log2(std::size_t n) {
  std::size_t r = 0;
  while ((std::size_t{1} << r) < n) ++r;
  return r;
}

inline double dbl(std::size_t n) { return static_cast<double>(n); }

// InvalidArgument naming the parameter (cost_params.cpp): non-positive α/β/γ,
// negative group values, an oversubscription below 1, leaves that are not
// whole nodes.
void check_cost_params(const CostParams& params);
// InvalidArgument unless P, B·H, K, V and the element size are positive.
void check_cost_shape(const ProblemShape& shape);
// InvalidArgument unless the shape's cuts are none or one per part (n).
void check_part_cuts(const ProblemShape& shape, std::size_t n);

// Whether the step into part j (j >= 1) joins ranks of two nodes of `node`
// consecutive ranks (every step when node is 0: the nodes unknown).
inline bool crosses_nodes(const PartOwners& owners, std::size_t node, std::size_t j) {
  return node == 0 || owners[j] / node != owners[j - 1] / node;
}

// Bytes each packed slot and affine pair carries for its flags (the cut,
// SPEC §10), so that they travel in the summary's own message; 64 keeps every
// slot 64-byte aligned.
inline constexpr std::size_t kSlotTailBytes = 64;

// Bytes of one [B,H,K,V] state and of one packed [S|M] slot (or affine pair)
// with its flags.
inline std::size_t state_bytes(const ProblemShape& s) {
  return s.slabs * s.key_dim * s.value_dim * s.elem_bytes;
}
inline std::size_t packed_bytes(const ProblemShape& s) {
  return s.slabs * s.key_dim * (s.value_dim + s.key_dim) * s.elem_bytes + kSlotTailBytes;
}

// Fold steps on the chain's critical path: positions 1..P-2 fold once each
// (position 1 receives S_0 itself, never a product with the zero state).
inline double chain_folds(std::size_t p) { return p >= 3 ? dbl(p - 2) : 0; }
// The same along a stretch of `steps` chain steps from a cut or the start:
// the first step is the offset itself.
inline double stretch_folds(std::size_t steps) { return steps >= 2 ? dbl(steps - 1) : 0; }

// Every protocol runs one part per rank as the layout of one part per rank
// (exchange.cpp makes the owners explicit), so the terms read the shape's
// layout (owners_of, chain_profile) whether it is given or not.

// Nodes (CostParams::node_ranks, carried by ProblemShape::ranks_per_node):
// a message between two ranks of one node goes at the group α/β (NVLink), any
// other at α/β. Nodes hold consecutive ranks: rank_node_width() is the node's
// width in ranks (P itself when one node holds every rank), else 0: every
// message a network one, an all-gather group's own at the group α/β. The
// members of a collective (a group's gather and broadcast) and the positions
// of one part per rank are ranks; a layout's chain and runs find their nodes
// by their parts' owners (ChainProfile::node_relays, add_layout_runs).
inline std::size_t rank_node_width(const ProblemShape& s) {
  const std::size_t n = std::min(s.ranks_per_node, s.ranks);
  return n > 1 && s.ranks % n == 0 ? n : 0;
}

// Leaf switches (CostParams::leaf_ranks and oversubscription, carried by
// ProblemShape::ranks_per_leaf and leaf_oversubscription): the leaf's width in
// ranks when its uplinks are oversubscribed (o > 1), else 0; as
// rank_node_width(), over ranks.
inline std::size_t rank_leaf_width(const ProblemShape& s) {
  const std::size_t n = std::min(s.ranks_per_leaf, s.ranks);
  return n > 1 && s.leaf_oversubscription > 1 && s.ranks % n == 0 ? n : 0;
}
// `bytes` that cross leaves in a round where one rank in `stride` sends across
// at once: the uplinks give each 1/max(1, o/stride) of its bandwidth.
inline void add_leaf_contention(CostTerms& t, const ProblemShape& s, double bytes, std::size_t stride) {
  const double slower = std::max(1.0, s.leaf_oversubscription / dbl(stride));
  t.contention_bytes += bytes * (slower - 1);
}

// `count` messages of `bytes_each`, inside a node (group terms) or not.
inline void add_messages(CostTerms& t, bool inside_node, double count, double bytes_each) {
  if (inside_node) {
    t.group_messages += count;
    t.group_bytes += count * bytes_each;
  } else {
    t.messages += count;
    t.bytes += count * bytes_each;
  }
}

// A chain's waits for shared ports (ChainProfile::port_waits): each one more
// message's `bytes_each` on the relay's link, without another latency.
inline void add_port_waits(CostTerms& t, const ChainProfile& chain, double bytes_each) {
  const double across = dbl(chain.node_port_waits);
  t.contention_bytes += across * bytes_each;
  t.group_bytes += (dbl(chain.port_waits) - across) * bytes_each;
}

// The agreement before every collective of the MPI backend
// (src/comm/mpi/communicator.cpp): the m members all-reduce a 3-word header,
// which a recursive-doubling all-reduce (what Open MPI picks for a few words)
// does in ceil(log2 m) rounds of latency; on nodes, the rounds inside a node
// at the group α, the others at α. Its bytes are negligible. (Measured on
// the simulated Ethernet with one head, docs/scale.md: exactly these
// latencies per collective.)
inline void add_agreement(CostTerms& t, std::size_t m, std::size_t node) {
  if (m <= 1) return;
  if (node == 0 || m <= node) {
    t.group_messages += dbl(ceil_log2(m));
    return;
  }
  t.group_messages += dbl(ceil_log2(node));
  t.messages += dbl(ceil_log2(m / node));
}

// A latency-optimal, bandwidth-optimal all-gather of m slots of n bytes inside
// a group (Bruck / recursive doubling, what MPI picks for these sizes), after
// its agreement (add_agreement). On
// nodes (node > 0) a group wider than a node gathers inside each node first,
// then across the m/node nodes. Every group gathers at once: with a shape
// whose leaves are oversubscribed (rank_leaf_width: the members are ranks,
// whatever the layout), a group wider than a leaf moves m - leaf of its
// slots across leaves with every rank sending.
inline void add_group_all_gather(CostTerms& t, std::size_t m, std::size_t n, std::size_t node = 0,
                                 const ProblemShape* leaves = nullptr) {
  if (m <= 1) return;
  add_agreement(t, m, node);
  if (leaves != nullptr) {
    const std::size_t leaf = rank_leaf_width(*leaves);
    if (node > 0 && leaf > 0 && m > leaf) add_leaf_contention(t, *leaves, dbl(m - leaf) * dbl(n), 1);
  }
  if (node == 0 || m <= node) {
    t.group_messages += dbl(ceil_log2(m));
    t.group_bytes += dbl(m - 1) * dbl(n);
    return;
  }
  t.group_messages += dbl(ceil_log2(node));
  t.group_bytes += dbl(node - 1) * dbl(n);
  t.messages += dbl(ceil_log2(m / node));
  t.bytes += dbl(m - node) * dbl(n);
}
// A binomial broadcast of n bytes over m members of a group (on nodes: the
// steps between nodes first, then inside them), after its agreement.
inline void add_group_broadcast(CostTerms& t, std::size_t m, std::size_t n, std::size_t node = 0) {
  if (m <= 1) return;
  add_agreement(t, m, node);
  if (node == 0 || m <= node) {
    t.group_messages += dbl(ceil_log2(m));
    t.group_bytes += dbl(ceil_log2(m)) * dbl(n);
    return;
  }
  add_messages(t, true, dbl(ceil_log2(node)), dbl(n));
  add_messages(t, false, dbl(ceil_log2(m / node)), dbl(n));
}

// The scan's pairs on the member that holds one position: the prefix, the
// outgoing aggregate and the receive buffer, one pair each, on every
// position but the first (which holds the outgoing one only); the last
// position, which has no outgoing pair, composes into a temporary one.
inline std::size_t recursive_doubling_memory(const ProblemShape& s, std::size_t m) {
  // Two positions: the first holds its outgoing pair, the second its prefix
  // and its receive buffer; from three on a middle position holds all three.
  return m <= 1 ? 0 : (m == 2 ? 2 : 3) * packed_bytes(s);
}

// The runs of a layout for blocks of w ranks (run r held by its block's
// carrier, the block's last rank) in recursive doubling (runs_cost.cpp,
// where the protocols' own run decomposition, runs.hpp, is at hand):
// - The scan over the runs, as rd_exclusive_scan_parts (runs.cpp) runs
//   it: in each round every position q sends to q + 2^k, and a carrier
//   holding several positions sends (and receives) all of theirs. A round
//   takes as long as the busiest carrier's network messages in one direction
//   (the ones between nodes; all of them when the nodes are unknown), or,
//   when none crosses, its messages inside a node: they travel at once, each
//   kind on its own links. With oversubscribed leaves (rank_leaf_width) a
//   round takes at least the busiest leaf's messages across leaves in one
//   direction at leaf/o ports' bandwidth (zigzag: two per rank; the
//   difference goes to contention_bytes). Compute: each round the costliest
//   message's sender's compositions (before it sends) and receiver's (after
//   it receives), counted position by position with the runs' cuts (a run
//   is a cut when one of its parts is): a composition after a cut costs
//   nothing, one before a cut no product.
// - The folds inside the runs: the carrier's fold of each run into a pair
//   (its parts from the run's last cut on: a cut's pair is constant, the
//   parts before it add nothing) and every rank's fold inside its runs (from
//   the run's start or a cut to the next cut), for the longest run of each.
void add_layout_runs(CostTerms& t, const ProblemShape& s, std::size_t w);

// The folds every rank runs inside the runs of a layout for blocks of w
// ranks, as run_layout_in_runs (runs.cpp) runs them, all ranks together
// (work_folds, work_products; cuts aside, forward): each rank folds each
// run of its block that holds one of its parts up to its last one there,
// from the run's incoming state (the chain's first run from its first
// part's offset: a step fewer). `chain_relay` (grouped_allgather_p2p): the
// carrier folds each run that has a run after it whole, for the state it
// sends. Otherwise (the doubling scan) the carrier folds each run of
// several parts into a pair first (a fold and a K×K product per part after
// the first), and at width 1 a run of one part folds nothing: its own pair
// is scanned and the scan's state is its result.
void add_run_work(CostTerms& t, const ProblemShape& s, std::size_t w, bool chain_relay);

// Recursive doubling over a layout's runs (runs.hpp) for blocks of w
// ranks (one part per rank: the scan over the ranks at w = 1, over the
// blocks' pairs at w > 1): the block gathers k slots per rank, its carrier
// folds each run of several parts into a pair and scans the runs
// (add_layout_runs), then broadcasts their incoming states; every rank folds
// inside its runs (add_run_work).
inline void add_layout_doubling(CostTerms& t, const ProblemShape& s, const ChainProfile& chain,
                                std::size_t w) {
  const std::size_t m = chain.runs_per_block;
  add_group_all_gather(t, w, chain.per_rank * packed_bytes(s), rank_node_width(s), &s);
  add_layout_runs(t, s, w);
  add_run_work(t, s, w, false);
  if (w > 1 && chain.runs > 1) add_group_broadcast(t, w, m * state_bytes(s), rank_node_width(s));
  // Memory, as run_layout_in_runs allocates it on the busiest carrier. At
  // width 1 a run of one part is scanned as it is: with every run one part
  // long (one part per rank) nothing is packed and the scan's states are
  // the results. Otherwise the slots, an aggregate pair per run of several
  // parts, and, while it folds one (run_pair), a temporary state and a
  // K×K product, freed before the scan. Then the scan: one position per carrier holds
  // recursive_doubling_memory's pairs, several hold three each and one
  // composition pair more; beside them the runs' states: at width 1 those
  // that runs of several parts fold from, at width > 1 the runs' incoming
  // states, and the scan's results beside them while they are copied in
  // (several runs per block).
  const bool direct = w == 1, pairs = chain.longest_run > 1;
  const std::size_t packed = packed_bytes(s), state = state_bytes(s);
  const std::size_t slots = direct && !pairs ? 0 : w * chain.per_rank * packed;
  const std::size_t aggregates = pairs ? m * packed : 0;
  const std::size_t scan = m == 1 ? recursive_doubling_memory(s, chain.runs) : (3 * m + 1) * packed;
  std::size_t states = 0;
  if (direct) {
    states = pairs ? m : 0;
  } else if (chain.runs > 1) {
    states = m == 1 ? 1 : 2 * m;
  }
  const std::size_t pair_fold = pairs ? packed - kSlotTailBytes : 0;  // a state and a K×K product
  t.peak_extra_bytes = slots + aggregates + std::max(pair_fold, scan + states * state);
}

}  // namespace kdacp::detail
