// grouped_allgather_rd (reassociating, opt-in; width w, 1 < w < P, w | P):
// the hierarchical shape for NVLink islands joined by a network. Blocks of w
// consecutive positions all-gather their [S|M] (or [G|M]) slots; each block's
// owner (its last position) folds the block into one affine pair; the P/w
// owners run the recursive-doubling exclusive scan over those pairs; each
// owner broadcasts its block's incoming state inside the block; every rank
// scans its block's slots from it, exactly as grouped_allgather_p2p does.
// Only the block aggregates reassociate; inside a block the chain's order
// holds. Memory: w slots, one aggregate pair, the scan's three pairs.
#include "exchange/affine_pairs.hpp"
#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"
#include "exchange/runs.hpp"

namespace kdacp::detail {
namespace {

class GroupedRdExchange final : public StateExchange {
 public:
  GroupedRdExchange(const ProtocolContext& ctx, std::shared_ptr<Communicator> owners,
                    std::shared_ptr<Communicator> intra)
      : StateExchange(ctx, grouped_allgather_rd_protocol),
        owners_(std::move(owners)),
        intra_(std::move(intra)),
        layout_(part_owners().list(), size_, ctx.group_size) {}

 private:
  // The outer communicator of a non-owner links the other blocks' members of
  // the same local index; only the owners' one carries traffic.
  std::vector<const Communicator*> communicators() const override {
    const std::size_t w = layout_.width;
    return {intra_.get(), rank_ % w + 1 == w ? owners_.get() : nullptr};
  }

  // The block gathers all its ranks' parts in one collective, the owners
  // scan the pairs of the block's runs of consecutive parts, and every rank
  // folds its parts inside their run in the chain's order (runs.hpp).
  // One part per rank is one run per block: each owner folds its block into
  // one pair, the owners scan the P/w pairs, and every rank folds its prefix
  // of the block from the block's incoming state.
  std::vector<State> run(const Call& c) override {
    return run_layout_in_runs(RunsCall{&layout_, rank_, intra_.get(), owners_.get(), RunRelay::doubling,
                                       c.parts, c.shape, c.direction, &options().exec});
  }

  std::shared_ptr<Communicator> owners_;
  std::shared_ptr<Communicator> intra_;
  RunLayout layout_;
};

// Each carrier folds each run of its block into one pair (one part per
// rank: the block, w-1 folds and w-1 K×K products), the carriers scan the
// pairs across the blocks and broadcast, everyone folds inside its runs
// (add_layout_doubling). The degenerate widths are priced as what they
// build: recursive_doubling (the same terms) and allgather.
CostTerms grouped_rd_cost(const ProblemShape& s, const ProtocolConfig& config, StreamWaitsCache* waits) {
  if (config.group_size == s.ranks && s.ranks > 1)
    return allgather_protocol.cost(s, {std::string(allgather_protocol.name), 1, 0}, waits);
  CostTerms t;
  add_layout_doubling(t, s, chain_profile(s, config.group_size), config.group_size);
  return t;
}

std::unique_ptr<StateExchange> build_grouped_rd(const ProtocolContext& ctx) {
  const std::size_t w = ctx.group_size;
  check_group_width(ctx.rank, ctx.size, w);
  // Degenerate widths: one rank per group is the plain scan, one group is
  // the allgather (nothing left to reassociate).
  if (w == 1) return recursive_doubling_protocol.build(ctx);
  if (w == ctx.size) return allgather_protocol.build(ctx);
  const DeviceMesh split = split_mesh(*ctx.mesh, w, "kda_outer", "kda_group");
  return std::make_unique<GroupedRdExchange>(ctx, split.group(0), split.group(1));
}

}  // namespace

const ProtocolDescriptor grouped_allgather_rd_protocol{
    .name = "grouped_allgather_rd",
    .kind = ProtocolClass::reassociating,
    .takes_group_size = true,
    .takes_layouts = true,
    .memory = "w packed slots + 4 pairs + 1 state",
    .use_when = "NVLink islands of w joined by a slower network",
    .cost = grouped_rd_cost,
    .error_bound = reassociation_bound,
    .error_bound_text = "(⌈log₂P⌉+2)·K·2⁻²⁴",
    .build = build_grouped_rd,
};

}  // namespace kdacp::detail
