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
#include "exchange/protocols.hpp"
#include "kdacp/error.hpp"

namespace kdacp::detail {
namespace {

class GroupedRdExchange final : public DirectedExchange {
 public:
  GroupedRdExchange(std::shared_ptr<Communicator> owners, std::shared_ptr<Communicator> intra,
                    std::size_t rank, std::size_t size, std::size_t width, ExchangeOptions options)
      : DirectedExchange(rank, size),
        owners_(std::move(owners)),
        intra_(std::move(intra)),
        width_(width),
        block_(rank / width),
        local_(rank % width),
        blocks_(size / width),
        options_(options) {}

  std::string method() const override { return "grouped_allgather_rd"; }
  bool exact() const override { return false; }

 private:
  State run(const StateView& offset, const StateView& m, const char* name, Direction dir) override {
    const SummaryShape shape = validate_summary(offset, m, name, rank_);
    // The outer communicator of a non-owner links the other blocks' members
    // of the same local index; only the owners' one carries traffic.
    CallMeter meter({intra_.get(), local_ + 1 == width_ ? owners_.get() : nullptr});
    const bool fwd = dir == Direction::forward;
    const bool is_owner = local_ + 1 == width_;
    const bool has_incoming = fwd ? block_ > 0 : block_ + 1 < blocks_;

    PackedSlots gathered(shape, width_);
    gathered.pack(local_, offset, m);
    intra_->all_gather(gathered.bytes());
    const Slots slots = gathered.slots();

    State incoming;
    if (is_owner) {
      // The block as one pair: its fold from zero in chain order and the
      // product M_{w-1}···M_0 (the same product serves both directions:
      // backward the pair's op is its transpose).
      PairBuffer block_pair(shape);
      scan(slots, fwd ? 0 : width_ - 1, width_, dir, nullptr, block_pair.offset(), std::nullopt,
           nullptr, options_.exec);
      State tmp(shape.batch, shape.heads, shape.key_dim, shape.key_dim, shape.dtype);
      StateView cur = slots.transfers.slot(0);
      for (std::size_t j = 1; j < width_; ++j) {
        // Alternate so that the last product lands in the pair.
        const StateView dst = (width_ - 1 - j) % 2 == 0 ? block_pair.transfer() : tmp.view();
        apply_step(slots.transfers.slot(j), cur, nullptr, dst, false, options_.exec);
        cur = dst;
      }
      incoming = rd_exclusive_scan(*owners_, block_pair.offset(), block_pair.transfer(), shape,
                                   dir, options_.exec, fwd ? kTagForward : kTagBackward);
    } else if (has_incoming) {
      incoming = make_state(shape);
    }
    if (has_incoming) intra_->broadcast(bytes_of(incoming), width_ - 1);

    State result = make_state(shape);
    const StateView in = incoming.view();
    const StateView* in_ptr = has_incoming ? &in : nullptr;
    if (fwd) {
      scan(slots, 0, local_, dir, in_ptr, result.view(), std::nullopt, nullptr, options_.exec,
           FoldFlags::consume_offsets);
    } else {
      scan(slots, width_ - 1, width_ - 1 - local_, dir, in_ptr, result.view(), std::nullopt,
           nullptr, options_.exec, FoldFlags::consume_offsets);
    }
    stats_ = meter.finish(result);
    return result;
  }

  std::shared_ptr<Communicator> owners_;
  std::shared_ptr<Communicator> intra_;
  std::size_t width_, block_, local_, blocks_;
  ExchangeOptions options_;
};

}  // namespace

std::unique_ptr<StateExchange> make_grouped_allgather_rd(const ProtocolContext& ctx) {
  const std::size_t w = ctx.group_size;
  check_group_width(ctx.rank, ctx.size, w);
  // Degenerate widths: one rank per group is the plain scan, one group is
  // the allgather (nothing left to reassociate).
  if (w == 1) return make_recursive_doubling(ctx);
  if (w == ctx.size) return make_allgather(ctx);
  const DeviceMesh split = split_mesh(*ctx.mesh, w, "kda_outer", "kda_group");
  return std::make_unique<GroupedRdExchange>(split.group(0), split.group(1), ctx.rank, ctx.size,
                                             w, ctx.options);
}

}  // namespace kdacp::detail
