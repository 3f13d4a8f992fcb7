// The α-β-γ cost model of the state exchange protocols.
//
// A message of n bytes costs α + β·n, a fold step of one K×V state per (b,h)
// costs 2·K·K·V flops at γ GFLOP/s. Each protocol states its critical path in
// those terms in its registry row (protocol.hpp; docs/protocols.md derives
// them); peak memory is the bytes a
// rank holds beyond its inputs and its returned state, the quantity
// ExchangeStats::peak_extra_bytes measures. The model is deterministic: every
// rank given the same parameters and shape makes the same choice, which is
// what lets `auto` choose without communicating.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kdacp/layout.hpp"

namespace kdacp {

// Machine parameters. The defaults describe an InfiniBand-like network and a
// GPU-class fold (α = 5 µs, 45 GB/s, 40 TFLOP/s); `kdacp calibrate` measures
// them for a backend.
struct CostParams {
  std::string source = "default (InfiniBand-like)";
  double alpha_s = 5e-6;              // per-message latency, seconds
  double beta_s_per_byte = 1 / 45e9;  // per-byte time, seconds per byte
  double gflops = 40000;              // fold throughput of one rank, GFLOP/s
  // Inside an all-gather group (an NVLink island); 0: same as above.
  double group_alpha_s = 0;
  double group_beta_s_per_byte = 0;
  // How many ranks can fold at γ at the same time: 0 means every rank (one
  // device, or its own cores, per rank), the usual cluster. When ranks share
  // a host's cores (in-process ranks as threads, or more MPI processes than
  // cores), `kdacp calibrate` sets it to the host's hardware threads divided
  // by the threads one rank uses. With P > concurrent_ranks the compute part
  // of a prediction becomes max(critical-path folds, all ranks' fold work /
  // concurrent_ranks): the cores are then the bound, not the dependency chain.
  std::size_t concurrent_ranks = 0;
  // Ranks per node, the island the group α/β describe (8 GPUs on NVLink):
  // with it the model prices each message by where its two ranks are, nodes
  // holding consecutive ranks (one part per rank; docs/scale.md measured
  // what it changes). 0: unknown, every message crosses the network except
  // inside an all-gather group.
  std::size_t node_ranks = 0;
  // A fat tree's leaf switch: the consecutive ranks under it (a multiple of
  // node_ranks) and its oversubscription o >= 1, what its ranks can send over
  // what its uplinks carry (2: half). With both (leaf_ranks > 0, o > 1) a
  // round in which one rank in s sends across leaves at once moves those
  // bytes at β·max(1, o/s): every rank at once gets 1/o of its bandwidth, a
  // carrier per o ranks or fewer all of it (docs/scale.md measured it). 0 and
  // 1: no leaf, every path non-blocking.
  std::size_t leaf_ranks = 0;
  double oversubscription = 1;
};

// JSON object {"source", "alpha_s", "beta_s_per_byte", "gflops",
// "group_alpha_s", "group_beta_s_per_byte", "concurrent_ranks",
// "node_ranks", "leaf_ranks", "oversubscription"}; missing keys keep their
// defaults (node_ranks, leaf_ranks and oversubscription are written only when
// set). Invalid values (non-positive α/β/γ, negative group
// values, a negative or fractional concurrent_ranks, node_ranks or
// leaf_ranks, leaf_ranks not a multiple of node_ranks, an oversubscription
// below 1) throw InvalidArgument
// naming the key; unreadable files throw IoError.
std::string to_json(const CostParams& params);
CostParams cost_params_from_json(const std::string& text);
CostParams load_cost_params(const std::string& path);
void save_cost_params(const CostParams& params, const std::string& path);

// What the model needs to know about one exchange.
struct ProblemShape {
  std::size_t ranks = 1;         // P
  std::size_t slabs = 1;         // B·H
  std::size_t key_dim = 128;     // K
  std::size_t value_dim = 128;   // V
  std::size_t elem_bytes = 4;    // FP32
  // The layout (SPEC §10, ExchangeOptions::part_owners): the rank holding
  // each part in chain order; none: PartOwners::one_per_rank(ranks)
  // (owners_of).
  std::optional<PartOwners> part_owners{};
  // Which parts are cuts (contain a sequence start), in chain order; empty:
  // none. A chain does not wait across a cut and a gather folds only from the
  // last cut before a part, so cuts shorten the predicted critical path.
  std::vector<bool> part_cuts{};
  // Ranks per node (CostParams::node_ranks; predict() fills it from the
  // parameters when 0 here). 0: unknown.
  std::size_t ranks_per_node = 0;
  // The leaf switch (CostParams::leaf_ranks, oversubscription; predict()
  // fills them from the parameters when 0 here). 0: none.
  std::size_t ranks_per_leaf = 0;
  double leaf_oversubscription = 0;
};

// The shape's part owners, explicit. Throws InvalidArgument when they span
// another P than shape.ranks.
PartOwners owners_of(const ProblemShape& shape);
// Several parts on a rank, or parts out of rank order: only the rows that
// take layouts (ProtocolDescriptor::takes_layouts) can run the shape, so
// auto and plan weigh only those. Not a pricing rule: every row prices one
// part per rank, explicit or not, as that layout (owners_of).
inline bool needs_layout_rows(const ProblemShape& shape) {
  return shape.part_owners && !shape.part_owners->is_one_per_rank();
}

// What the cost terms read from a shape's layout and cuts.
struct ChainProfile {
  std::size_t parts = 1;         // n
  std::size_t per_rank = 1;      // k: the most parts one rank holds
  // The critical path in steps: the chain waits along stretches, from a cut
  // (or the chain's start) to the next cut (or its end), and a block (a rank
  // for width 1) handles its parts in chain order, so a stretch through a
  // block also waits for the block's earlier parts. n-1 without cuts.
  std::size_t steps = 0;
  // Along the worst such path: the steps that cross from one run to the
  // next (a message each), where runs are maximal stretches of consecutive
  // parts held by one block of `width` consecutive ranks (width 1: one rank).
  std::size_t relays = 0;
  // Of those relays, the ones between ranks of different nodes
  // (ProblemShape::ranks_per_node, nodes holding consecutive ranks, any
  // layout); all of them when the nodes are unknown or do not divide P. For
  // width w a relay goes between the two blocks' carriers (their last ranks).
  std::size_t node_relays = 0;
  // Along it: the steps into a part from an earlier part of the same block
  // (a block handles its parts in chain order): a local step (zigzag's middle)
  // or a wait for the block's earlier part. pipelined_p2p streams all c
  // segments of a part before the next one, so each costs it c - 1 more
  // segments.
  std::size_t order_waits = 0;
  // Along it (p2p: width 1, order_weight 0, with cuts): the relays' waits
  // for a port. Stretches run side by side, and relays that leave one rank or
  // reach one in the same slot (their uncontended paths' relays) share its
  // port, each taking one more relay time per relay beside it (Ethernet,
  // P = 8, zigzag with documents: rank 4 receives two stretches' first states
  // at once). node_port_waits: the ones on relays across nodes. 0 without
  // cuts: one chain's relays leave one after the other.
  std::size_t port_waits = 0;
  std::size_t node_port_waits = 0;
  std::size_t runs = 1;           // runs in the chain
  std::size_t runs_per_block = 1; // the most runs one block holds
  std::size_t longest_run = 1;    // parts in the longest run
  // What the protocols hold, as their code allocates it (p2p.cpp,
  // pipelined_p2p.cpp, runs.cpp, allgather.cpp): the most over ranks (or
  // blocks) and over both directions. Cuts aside: a cut part is priced as a
  // part that folds (cuts shorten the time, never the buffers), an offset
  // as dense. One part per rank is the layout like any other.
  // p2p, over ranks: the states a rank's parts fold and send to another
  // rank, each held until the call ends, and one more when it hands a state
  // to a part of its own (that part's buffer and the state moved into it).
  // The chain's first part sends its offset as it is.
  std::size_t chain_sends = 0;
  // pipelined_p2p, over ranks: a receive buffer per part with a part before
  // it, a send buffer per part whose next part is on another rank.
  std::size_t stream_buffers = 0;
  // The blocks' relay (grouped_allgather_p2p, blocks of `width`): a carrier
  // holds a state per run of its block with a run before it (received,
  // then broadcast) and one per run with a run after it (sent).
  std::size_t relay_states = 0;
  // allgather, over ranks: the gather holds the parts rank by rank, k slots
  // per rank, and a part folds the positions from its rank's previous part
  // (or the chain's start) on: whether some part's positions are not
  // consecutive slots, so that its fold alternates with a temporary state.
  bool split_folds = false;
};
// The profile of `shape` for blocks of `width` ranks. The worst path is the
// one with the most relays + port_waits + order_weight · order_waits (then
// relays across nodes): order_weight is what an order wait costs in relays
// (0 for every row but pipelined_p2p, c - 1 there). Throws InvalidArgument
// for owners over another P, or cuts of another length.
ChainProfile chain_profile(const ProblemShape& shape, std::size_t width, std::size_t order_weight = 0);

class StreamWaitsCache;

// pipelined_p2p's streams of c >= 2 segments through shared NICs, with
// cuts: how many segment hops the ranks' NICs (messages between nodes; every
// message when the nodes are unknown) add to the chain's forward run.
// stream_makespan (pipelined_p2p.cpp) runs the protocol's steps hop by hop
// with and without them. Node ports are not counted: inside a node a segment
// holds its port for a small part of its hop (NVLink: 2.8 us of a 1 MiB
// segment against 3 us of latency), and counting them put nvlink-ib's rows at
// P = 8 and 16 at 0.62-0.85 of the simulation (docs/scale.md). 0 without
// cuts, for c < 2 (p2p's relays: ChainProfile::port_waits) and past 2^31
// segment hops. With a cache, found once per shape and segment count while
// the cache holds the shape.
double stream_nic_waits(const ProblemShape& shape, std::size_t segments, StreamWaitsCache* cache = nullptr);

// What stream_nic_waits found for the last four shapes, per segment count:
// auto and plan price every segment count of one shape several times over,
// and each time the protocol's steps run hop by hop. The planner that prices
// (Planner) owns one, so two planners in one process share nothing; it is
// thread-safe, so the threads of one planner may share it.
class StreamWaitsCache {
 public:
  StreamWaitsCache() = default;
  StreamWaitsCache(const StreamWaitsCache&) = delete;
  StreamWaitsCache& operator=(const StreamWaitsCache&) = delete;

 private:
  friend double stream_nic_waits(const ProblemShape& shape, std::size_t segments, StreamWaitsCache* cache);
  struct Entry {
    std::size_t ranks = 0, node = 0;  // P and the node width the waits were found for
    std::vector<std::size_t> owners;
    std::vector<bool> cuts;
    std::vector<double> waits;  // by segment count; NaN: not yet
  };
  static constexpr std::size_t kSize = 4;
  std::mutex mutex_;
  std::vector<Entry> entries_;
  std::size_t next_ = 0;  // the entry the next new shape replaces once all kSize are taken
};

// One configuration of one protocol. group_size: w for the grouped
// protocols (1 otherwise); segments: c for pipelined_p2p (0 otherwise).
struct ProtocolConfig {
  std::string method;
  std::size_t group_size = 1;
  std::size_t segments = 0;
};

struct Prediction {
  ProtocolConfig config;
  bool exact = true;
  double seconds = 0;               // one forward (a backward costs the same)
  std::size_t peak_extra_bytes = 0; // the largest over ranks
};

// Column segments of a protocol that takes segments: c column blocks of whole
// units of 16 columns (the last unit V mod 16 wide when 16 does not divide
// V), so at most ceil(V/16).
std::size_t max_segments(std::size_t value_dim);
// The model's c for `method` in [1, ceil(V/16)]; 0 for a method without segments.
std::size_t best_segments(const CostParams& params, const ProblemShape& shape,
                          const std::string& method);

// Predicts one configuration. Segments 0 on a row that takes segments uses
// best_segments; knobs a row does not take are reset (group size 1, segments
// 0). Throws InvalidArgument for an unknown method or the chooser, a group
// size that does not divide P, or more segments than ceil(V/16).
Prediction predict(const CostParams& params, const ProblemShape& shape,
                   const ProtocolConfig& config);

// Every configuration the model weighs, in registry order (protocol.hpp):
// each exact row (with include_reassociating also each reassociating row),
// rows with a group size once per divisor 1 < w < P (w = 1 and w = P are the
// chain and the allgather), rows with segments at the model's c.
std::vector<Prediction> predict_all(const CostParams& params, const ProblemShape& shape,
                                    bool include_reassociating);

// Each protocol's fastest configuration of predict_all (reassociating rows
// included), one per row in registry order: the grouped rows' best w, ties to
// the smaller. A grouped row with no proper divisor of P has none.
std::vector<Prediction> best_per_protocol(const CostParams& params, const ProblemShape& shape);

// auto's rule: the fastest configuration of predict_all whose peak memory is
// within `memory_budget_bytes` (0: unlimited), among the rows that take
// layouts when `layouts_only` (several parts per rank); ties go to the
// earlier row. Throws InvalidArgument when nothing fits, naming the smallest need.
Prediction choose_protocol(const CostParams& params, const ProblemShape& shape,
                           std::size_t memory_budget_bytes, bool allow_reassociation,
                           bool layouts_only = false);

// The planner: the functions above with one machine's parameters and the
// memory they share (StreamWaitsCache), for a caller that prices many
// configurations of one shape (auto's choice, plan's table). Each free
// function above is one call of a planner of its own. Thread-safe.
class Planner {
 public:
  explicit Planner(CostParams params);
  const CostParams& params() const { return params_; }
  std::size_t best_segments(const ProblemShape& shape, const std::string& method) const;
  Prediction predict(const ProblemShape& shape, const ProtocolConfig& config) const;
  std::vector<Prediction> predict_all(const ProblemShape& shape, bool include_reassociating) const;
  std::vector<Prediction> best_per_protocol(const ProblemShape& shape) const;
  Prediction choose_protocol(const ProblemShape& shape, std::size_t memory_budget_bytes,
                             bool allow_reassociation, bool layouts_only = false) const;
  // The stream waits this planner found (its cache), for the tests.
  double stream_nic_waits(const ProblemShape& shape, std::size_t segments) const;

 private:
  CostParams params_;
  std::unique_ptr<StreamWaitsCache> waits_;  // behind a pointer: a planner moves, a mutex does not
};

// Ulysses × state CP (docs/protocols.md, "Ulysses × state CP"): a head group
// of U consecutive ranks trades, by one all-to-all, each rank's T/P tokens of
// all H heads for U·T/P tokens of H/U heads (q, k, v, g, β in: 3K+V+1
// elements per head and token), runs the state exchange over the C = P/U
// ranks that hold the same heads (B·H/U slabs), and trades the output o (V
// per head and token) back by a second all-to-all. U = 1 is plain state CP.
// A backward moves the same bytes the other way (dO in; dq, dk, dv, dg, dβ
// out) and its exchange costs what the forward's does, so the forward's
// figures stand for both. The local attention's work is the same for every
// U (U times the tokens of 1/U of the heads) and is not priced.
struct UlyssesOptions {
  std::size_t heads = 0;                // H, which U divides; 0: shape.slabs (B = 1)
  std::size_t tokens_per_rank = 1;      // T/P of each batch row
  std::size_t activation_bytes = 2;     // bytes per activation element (bf16)
  // Ranks per NVLink island: the members of an all-to-all within one island
  // talk at CostParams' group α/β, across islands at the network's.
  std::size_t node_size = 8;
  std::size_t memory_budget_bytes = 0;  // the state exchange's, as choose_protocol (0: none)
};

struct UlyssesPrediction {
  std::size_t width = 1;        // U
  std::size_t state_ranks = 1;  // C = P/U
  // Bytes one rank holds of what the all-to-alls move: the activations in
  // and the output back (each all-to-all keeps 1/U of them and sends the rest).
  double in_bytes = 0, out_bytes = 0;
  double all_to_all_seconds = 0;  // the forward's two all-to-alls
  Prediction exchange;            // the fastest exact protocol over C ranks (choose_protocol)
  double seconds = 0;             // all_to_all_seconds + exchange.seconds
};

// One all-to-all over a group of `width` consecutive ranks in which each rank
// holds `bytes` (pairwise exchange: width−1 steps, each sending bytes/width
// to one peer and receiving as much from another). A group inside one island
// of `node_size` ranks (width dividing node_size) costs the group α/β per
// step; any other is priced on the network alone: a step waits for its send
// and its receive, and the rank at an island's edge has a peer across in
// every step.
double all_to_all_seconds(const CostParams& params, std::size_t width, double bytes, std::size_t node_size);

// One prediction per U in {1} ∪ {U ≥ 2 dividing both H and P}, ascending.
// The exchange at C = P/U is choose_protocol's exact choice on
// shape_at(C) with B·H/U slabs (shape_at: the layout and cuts of the stream
// on C ranks; empty: `shape` with C ranks, which then must have no layout and
// no cuts), with the group α/β kept only while U < node_size and U divides
// it (the C ranks of one head slice are U apart, so from U = node_size on no
// two of them share an island). At U = 1 the exchange is exactly
// choose_protocol(params, shape, budget, false, needs_layout_rows(shape)). Throws
// InvalidArgument for a zero option, heads that do not divide shape.slabs,
// or a shape with a layout or cuts and no shape_at.
std::vector<UlyssesPrediction> predict_ulysses(
    const CostParams& params, const ProblemShape& shape, const UlyssesOptions& options,
    const std::function<ProblemShape(std::size_t ranks)>& shape_at = {});

// The fastest of predict_ulysses' list, ties to the smaller U.
UlyssesPrediction best_ulysses(const std::vector<UlyssesPrediction>& options);

}  // namespace kdacp
