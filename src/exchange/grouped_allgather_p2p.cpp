// grouped_allgather_p2p (SPEC §6): blocks of w consecutive positions gather
// their [S|M] slots inside the block; the block owners (last position of each
// block) relay the block's incoming state along a chain; each rank then scans
// its block's slots from that state, or from the last cut before it (SPEC §10;
// an owner whose block has a cut sends without waiting for its incoming state). Per element the same operations in the
// same order as the chain, so bitwise identical to it. Memory: w slots plus
// at most two states.
#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"
#include "exchange/runs.hpp"

namespace kdacp::detail {

namespace {

class GroupedExchange final : public StateExchange {
 public:
  GroupedExchange(const ProtocolContext& ctx, std::shared_ptr<Communicator> intra)
      : StateExchange(ctx, grouped_allgather_p2p_protocol),
        cp_(ctx.mesh->group(0)),
        intra_(std::move(intra)),
        layout_(part_owners().list(), size_, ctx.group_size) {}

 private:
  std::vector<const Communicator*> communicators() const override {
    return {cp_.get(), intra_.get()};
  }

  // The block gathers all its ranks' parts in one collective (k slots per
  // rank), the carriers (each block's last rank) relay the state entering
  // each of the block's runs of consecutive parts along the chain, and every
  // rank folds its parts inside their run, all in the chain's order
  // (runs.hpp). One part per rank is one run per block: one gather, one
  // relay state per block boundary, one broadcast; the carrier folds its
  // block once, its own result on the way to the state it sends.
  std::vector<State> run(const Call& c) override {
    return run_layout_in_runs(RunsCall{&layout_, rank_, intra_.get(), cp_.get(), RunRelay::chain, c.parts,
                                       c.shape, c.direction, &options().exec});
  }

  std::shared_ptr<Communicator> cp_;
  std::shared_ptr<Communicator> intra_;
  RunLayout layout_;
};

CostTerms grouped_cost(const ProblemShape& s, const ProtocolConfig& config, StreamWaitsCache*) {
  const std::size_t p = s.ranks, w = config.group_size, blocks = p / w;
  CostTerms t;
  if (has_layout(s) || !s.part_cuts.empty()) {
    // The runs of consecutive parts per block (runs.hpp): one gather of k
    // slots per rank, a relay message per run boundary on the longest
    // stretch between cuts, each carrier folding its run, one broadcast of
    // the block's runs' incoming states.
    const ChainProfile chain = chain_profile(s, w);
    // The gather and broadcast are over the block's ranks (on nodes: a
    // block wider than a node gathers inside each node, then across).
    add_group_all_gather(t, w, chain.per_rank * packed_bytes(s), rank_node_width(s), &s);
    // On nodes, relays between carriers of one node go over it.
    add_messages(t, false, dbl(chain.node_relays), dbl(state_bytes(s)));
    add_messages(t, true, dbl(chain.relays - chain.node_relays), dbl(state_bytes(s)));
    if (chain.runs > 1) add_group_broadcast(t, w, chain.runs_per_block * state_bytes(s), rank_node_width(s));
    t.folds = dbl(chain.steps);
    t.work_folds = dbl(chain.parts) * dbl(w) / 2 + dbl(chain.parts);
    if (has_layout(s)) {
      // Slots, the runs' incoming states and the carrier's sent states; the
      // three states more are headroom (the folds consume the slots in
      // place and need no temporaries, the carrier's results are returned).
      t.peak_extra_bytes = w * chain.per_rank * packed_bytes(s) +
                           (2 * chain.runs_per_block + 3) * state_bytes(s);
    } else {
      t.peak_extra_bytes = w * packed_bytes(s) + 2 * state_bytes(s);
    }
    return t;
  }
  const std::size_t node = rank_node_width(s);
  add_group_all_gather(t, w, packed_bytes(s), node, &s);
  // The owners' relay: one state per block boundary, each owner folding its
  // whole block before it sends (on nodes: owners w ranks apart).
  const double crossings = node_crossings(dbl(blocks - 1), w, node);
  add_messages(t, false, crossings, dbl(state_bytes(s)));
  add_messages(t, true, dbl(blocks - 1) - crossings, dbl(state_bytes(s)));
  if (blocks > 1) add_group_broadcast(t, w, state_bytes(s), node);
  t.folds = dbl(blocks - 1) * dbl(w) + dbl(w - 1);
  // Local position l of the first block folds l-1 slots, of a later block
  // l+1 (its incoming state first); the owners of every block but the last
  // fold their whole block.
  for (std::size_t r = 0; r < p; ++r) {
    const std::size_t l = r % w, b = r / w;
    std::size_t steps = b > 0 ? l : (l >= 2 ? l - 1 : 0);
    if (l == w - 1 && b + 1 < blocks) steps = b > 0 ? w : w - 1;
    t.work_folds += dbl(steps);
  }
  t.peak_extra_bytes = w * packed_bytes(s) + 2 * state_bytes(s);
  return t;
}

std::unique_ptr<StateExchange> build_grouped(const ProtocolContext& ctx) {
  const std::size_t w = ctx.group_size;
  check_group_width(ctx.rank, ctx.size, w);
  // The degenerate widths are the other two protocols, exactly.
  if (w == 1) return p2p_protocol.build(ctx);
  if (w == ctx.size) return allgather_protocol.build(ctx);
  const DeviceMesh split = split_mesh(*ctx.mesh, w, "kda_outer", "kda_group");
  return std::make_unique<GroupedExchange>(ctx, split.group(1));
}

}  // namespace

const ProtocolDescriptor grouped_allgather_p2p_protocol{
    .name = "grouped_allgather_p2p",
    .kind = ProtocolClass::exact,
    .takes_group_size = true,
    .takes_layouts = true,
    .memory = "w packed slots + 2 states",
    .use_when = "the exact choice at P ≈ 1000 (w ≈ 32)",
    .cost = grouped_cost,
    .build = build_grouped,
};

}  // namespace kdacp::detail
