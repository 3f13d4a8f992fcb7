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

// The runs of consecutive parts per block (runs.hpp; one part per rank:
// one run per block): one gather of k slots per rank, a relay message per
// run boundary on the longest stretch between cuts, each carrier folding
// its run, one broadcast of the block's runs' incoming states.
// The degenerate widths are priced as what they build: p2p and allgather.
CostTerms grouped_cost(const ProblemShape& s, const ProtocolConfig& config, StreamWaitsCache* waits) {
  const std::size_t w = config.group_size;
  if (w == 1) return p2p_protocol.cost(s, {std::string(p2p_protocol.name), 1, 0}, waits);
  if (w == s.ranks) return allgather_protocol.cost(s, {std::string(allgather_protocol.name), 1, 0}, waits);
  CostTerms t;
  const ChainProfile chain = chain_profile(s, w);
  // The gather and broadcast are over the block's ranks (on nodes: a block
  // wider than a node gathers inside each node, then across).
  add_group_all_gather(t, w, chain.per_rank * packed_bytes(s), rank_node_width(s), &s);
  // On nodes, relays between carriers of one node go over it.
  add_messages(t, false, dbl(chain.node_relays), dbl(state_bytes(s)));
  add_messages(t, true, dbl(chain.relays - chain.node_relays), dbl(state_bytes(s)));
  if (chain.runs > 1) add_group_broadcast(t, w, chain.runs_per_block * state_bytes(s), rank_node_width(s));
  t.folds = dbl(chain.steps);
  add_run_work(t, s, w, true);
  // The slots, and the carrier's relayed states: the runs' incoming states
  // and the states it sends (the folds consume the slots in place and need
  // no temporaries; the results are returned).
  t.peak_extra_bytes = w * chain.per_rank * packed_bytes(s) + chain.relay_states * state_bytes(s);
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
