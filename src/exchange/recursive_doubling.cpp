// recursive_doubling (reassociating, opt-in): the exclusive scan of the
// ranks' affine pairs in ceil(log2 P) rounds (affine_pairs.hpp), forward
// over (M, S), backward over the transposed suffix of (M, G). Products of
// transfers are reassociated, so results differ from the chain by round-off
// within reassociation_bound (docs/protocols.md). Memory: three pairs per rank.
#include "exchange/affine_pairs.hpp"
#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"
#include "exchange/runs.hpp"

namespace kdacp::detail {
namespace {

class RecursiveDoublingExchange final : public CommExchange {
 public:
  explicit RecursiveDoublingExchange(const ProtocolContext& ctx)
      : CommExchange(ctx, recursive_doubling_protocol), layout_(part_owners().list(), size_, 1) {}

 private:
  // The scan runs over the chain of runs of consecutive parts per rank, each
  // run folded into one pair, each rank standing for all of its runs
  // (messages between its own runs stay local), and every part then folds
  // inside its run from the run's incoming state (runs.hpp). One part per
  // rank is the scan over the ranks' own pairs: one run per rank, nothing
  // packed, the scan's three pairs, its result the part's.
  std::vector<State> run(const Call& c) override {
    return run_layout_in_runs(RunsCall{&layout_, rank_, nullptr, comm_.get(), RunRelay::doubling, c.parts,
                                       c.shape, c.direction, &options().exec});
  }

  RunLayout layout_;
};

// Cuts do not shorten the scan: its rounds are fixed by the positions. The
// positions are the runs of consecutive parts per rank (one part per rank:
// the ranks; zigzag: 2P-1), a rank standing for up to runs_per_block of them
// per round.
CostTerms recursive_doubling_cost(const ProblemShape& s, const ProtocolConfig&, StreamWaitsCache*) {
  CostTerms t;
  add_layout_doubling(t, s, chain_profile(s, 1), 1);
  return t;
}

}  // namespace

const ProtocolDescriptor recursive_doubling_protocol{
    .name = "recursive_doubling",
    .kind = ProtocolClass::reassociating,
    .takes_layouts = true,
    .memory = "3 packed pairs",
    .use_when = "large P when round-off within the documented bound is acceptable",
    .cost = recursive_doubling_cost,
    .error_bound = reassociation_bound,
    .error_bound_text = "(⌈log₂P⌉+2)·K·2⁻²⁴",
    .build = [](const ProtocolContext& ctx) -> std::unique_ptr<StateExchange> {
      return std::make_unique<RecursiveDoublingExchange>(ctx);
    },
};

}  // namespace kdacp::detail
