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
#include "exchange/layouts.hpp"

namespace kdacp::detail {
namespace {

class GroupedRdExchange final : public StateExchange {
 public:
  GroupedRdExchange(const ProtocolContext& ctx, std::shared_ptr<Communicator> owners,
                    std::shared_ptr<Communicator> intra)
      : StateExchange(ctx, grouped_allgather_rd_protocol),
        owners_(std::move(owners)),
        intra_(std::move(intra)),
        width_(ctx.group_size),
        block_(rank_ / width_),
        local_(rank_ % width_),
        blocks_(size_ / width_) {}

 private:
  // The outer communicator of a non-owner links the other blocks' members of
  // the same local index; only the owners' one carries traffic.
  std::vector<const Communicator*> communicators() const override {
    return {intra_.get(), local_ + 1 == width_ ? owners_.get() : nullptr};
  }

  // The one run: one part per rank takes the chain-of-ranks algorithm
  // (run_one), several parts per rank or parts out of rank order the
  // layout's (run_layout); both within the reassociation bound.
  //
  // Still two algorithms (issue 19), for the reason grouped_allgather_p2p.cpp
  // gives: with one part per rank the layout's algorithm (one run per block)
  // scans the same block pairs (rd_exclusive_scan_parts, as run_one does)
  // with the same messages, but run_pair and the final folds go step by step
  // through two temporaries without consuming the gathered offsets, and the
  // scan's result is copied through the runs' incoming stack; run_one folds
  // the block in one fused scan and every rank its prefix in place
  // (fold_in_block). run_one can go with grouped_allgather_p2p's.
  std::vector<State> run(const Call& c) override {
    if (part_owners().is_one_per_rank()) return only(run_one(one_part(c)));
    return run_layout(c);
  }

  State run_one(const OnePart& call) {
    const StateView& offset = call.offset;
    const StateView& m = call.transfer;
    const SummaryShape& shape = call.shape;
    const Direction dir = call.direction;
    const bool fwd = dir == Direction::forward;
    const bool is_owner = local_ + 1 == width_;
    const bool has_incoming = fwd ? block_ > 0 : block_ + 1 < blocks_;

    PackedSlots gathered(shape, width_);
    gathered.pack(local_, offset, m, call.cut);
    intra_->all_gather(gathered.bytes());

    State incoming;
    if (is_owner) {
      // One position per owner: the scan over the blocks.
      std::vector<std::size_t> positions(blocks_);
      for (std::size_t b = 0; b < blocks_; ++b) positions[b] = b;
      const PairBuffer block = block_pair(gathered, shape, dir);
      const PairView pair = block.view();
      incoming = std::move(rd_exclusive_scan_parts(*owners_, positions, std::span(&pair, 1), shape, dir,
                                                   options().exec).front());
    } else if (has_incoming) {
      incoming = make_state(shape);
    }
    if (has_incoming) intra_->broadcast(bytes_of(incoming), width_ - 1);

    State result = make_state(shape);
    const StateView in = incoming.view();
    fold_in_block(gathered, local_, dir, has_incoming ? &in : nullptr, result.view(), options().exec);
    return result;
  }

  // The block as one pair: its fold from zero in chain order and the product
  // M_{w-1}···M_0 (the same product serves both directions: backward the
  // pair's op is its transpose). A block with a cut is a cut pair: its fold
  // from the cut nearest the block's end (in chain order), no product.
  PairBuffer block_pair(const PackedSlots& gathered, const SummaryShape& shape, Direction dir) const {
    const bool fwd = dir == Direction::forward;
    const Slots slots = gathered.slots();
    PairBuffer pair(shape);
    const auto cut = fwd ? gathered.last_cut(0, width_) : gathered.first_cut(0, width_);
    pair.set_cut(cut.has_value());
    if (cut) {
      scan(slots, *cut, fwd ? width_ - *cut : *cut + 1, dir, nullptr, pair.offset(), std::nullopt,
           nullptr, options().exec);
      return pair;
    }
    scan(slots, fwd ? 0 : width_ - 1, width_, dir, nullptr, pair.offset(), std::nullopt, nullptr,
         options().exec);
    State tmp(shape.batch, shape.heads, shape.key_dim, shape.key_dim, shape.dtype);
    StateView cur = slots.transfers.slot(0);
    for (std::size_t j = 1; j < width_; ++j) {
      // Alternate so that the last product lands in the pair.
      const StateView dst = (width_ - 1 - j) % 2 == 0 ? pair.transfer() : tmp.view();
      apply_step(slots.transfers.slot(j), cur, nullptr, dst, false, options().exec);
      cur = dst;
    }
    return pair;
  }

  // A layout: the block gathers all its ranks' parts in one collective, the
  // owners scan the pairs of the block's runs of consecutive parts, and every
  // rank folds its parts inside their run in the chain's order (layouts.hpp).
  std::vector<State> run_layout(const Call& c) {
    const LayoutIndex layout(part_owners().list(), size_);
    return run_layout_in_runs(RunsCall{&layout, width_, rank_, intra_.get(), owners_.get(),
                                       RunRelay::doubling, c.parts, c.shape, c.direction,
                                       &options().exec});
  }

  std::shared_ptr<Communicator> owners_;
  std::shared_ptr<Communicator> intra_;
  std::size_t width_, block_, local_, blocks_;
};

// Owners fold their group into one pair (w-1 state folds and w-1 K×K
// products), scan across the blocks, broadcast; everyone folds its prefix.
CostTerms grouped_rd_cost(const ProblemShape& s, const ProtocolConfig& config) {
  const std::size_t p = s.ranks, w = config.group_size, blocks = p / w;
  CostTerms t;
  if (has_layout(s)) {
    add_layout_doubling(t, s, chain_profile(s, w), w);
    return t;
  }
  add_group_all_gather(t, w, packed_bytes(s));
  if (blocks > 1) {
    t.folds += dbl(w - 1);
    t.products += dbl(w - 1);
    add_recursive_doubling(t, s, blocks);
    add_group_broadcast(t, w, state_bytes(s));
    t.work_folds += dbl(blocks) * dbl(w - 1);
    t.work_products += dbl(blocks) * dbl(w - 1);
  }
  t.folds += dbl(w - 1);
  t.work_folds += dbl(p) * dbl(w - 1) / 2;
  t.peak_extra_bytes = w * packed_bytes(s) + (blocks > 1 ? packed_bytes(s) : 0) +
                       recursive_doubling_memory(s, blocks) + state_bytes(s);
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
