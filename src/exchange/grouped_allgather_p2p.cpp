// grouped_allgather_p2p (SPEC §6): blocks of w consecutive positions gather
// their [S|M] slots inside the block; the block owners (last position of each
// block) relay the block's incoming state along a chain; each rank then scans
// its block's slots from that state. Per element the same operations in the
// same order as the chain, so bitwise identical to it. Memory: w slots plus
// at most two states.
#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"

namespace kdacp::detail {

namespace {

class GroupedExchange final : public StateExchange {
 public:
  GroupedExchange(const ProtocolContext& ctx, std::shared_ptr<Communicator> intra)
      : StateExchange(ctx, grouped_allgather_p2p_protocol),
        cp_(ctx.mesh->group(0)),
        intra_(std::move(intra)),
        width_(ctx.group_size),
        block_(rank_ / width_),
        local_(rank_ % width_),
        blocks_(size_ / width_),
        owner_(block_ * width_ + width_ - 1) {}

 private:
  std::vector<const Communicator*> communicators() const override {
    return {cp_.get(), intra_.get()};
  }

  State run(const Call& c) override {
    return c.direction == Direction::forward ? forward_step(c.offset, c.transfer, c.shape)
                                             : backward_step(c.offset, c.transfer, c.shape);
  }

  State forward_step(const StateView& s, const StateView& m, const SummaryShape& shape) {
    const bool is_owner = rank_ == owner_;
    const bool has_incoming = block_ > 0;
    const bool has_successor = block_ + 1 < blocks_;
    State incoming;
    if (has_incoming) incoming = make_state(shape, Buffer::Init::uninitialized);  // received whole
    // Post the owner's receive before the group gather (step 1).
    std::unique_ptr<Request> recv;
    if (is_owner && has_incoming) recv = cp_->irecv(bytes_of(incoming), owner_ - width_, kTagForward);

    PackedSlots gathered(shape, width_);
    gathered.pack(local_, s, m);
    intra_->all_gather(gathered.bytes());

    State result = make_state(shape);
    const StateView in = incoming.view();
    const StateView* in_ptr = has_incoming ? &in : nullptr;
    bool have_result = false;
    State send;
    std::unique_ptr<Request> sent;
    if (is_owner) {
      if (recv) recv->wait();
      if (has_successor) {
        send = make_state(shape, Buffer::Init::uninitialized);  // the scan writes it all
        const StateView res = result.view();
        scan(gathered.slots(), 0, width_, Direction::forward, in_ptr, send.view(), local_, &res,
             options().exec, FoldFlags::consume_offsets);
        have_result = true;
        sent = cp_->isend(bytes_of(send), owner_ + width_, kTagForward);
      }
    }
    if (has_incoming) intra_->broadcast(bytes_of(incoming), width_ - 1);
    if (!have_result)
      scan(gathered.slots(), 0, local_, Direction::forward, in_ptr, result.view(), std::nullopt,
           nullptr, options().exec, FoldFlags::consume_offsets);
    if (sent) sent->wait();
    return result;
  }

  State backward_step(const StateView& g, const StateView& m, const SummaryShape& shape) {
    const bool is_owner = rank_ == owner_;
    const bool has_incoming = block_ + 1 < blocks_;  // gradient arriving from the next block
    const bool has_predecessor = block_ > 0;
    State incoming;
    if (has_incoming) incoming = make_state(shape, Buffer::Init::uninitialized);  // received whole
    std::unique_ptr<Request> recv;
    if (is_owner && has_incoming)
      recv = cp_->irecv(bytes_of(incoming), owner_ + width_, kTagBackward);

    PackedSlots gathered(shape, width_);
    gathered.pack(local_, g, m);
    intra_->all_gather(gathered.bytes());

    const StateView in = incoming.view();
    const StateView* in_ptr = has_incoming ? &in : nullptr;
    State send;
    std::unique_ptr<Request> sent;
    if (is_owner) {
      if (recv) recv->wait();
      if (has_predecessor) {
        send = make_state(shape, Buffer::Init::uninitialized);  // the scan writes it all
        scan(gathered.slots(), width_ - 1, width_, Direction::backward, in_ptr, send.view(),
             std::nullopt, nullptr, options().exec, FoldFlags::consume_offsets);
        sent = cp_->isend(bytes_of(send), owner_ - width_, kTagBackward);
      }
    }
    if (has_incoming) intra_->broadcast(bytes_of(incoming), width_ - 1);
    State result = make_state(shape);
    // The owner (local = w-1) scans nothing: its result is the block's incoming gradient.
    scan(gathered.slots(), width_ - 1, width_ - 1 - local_, Direction::backward, in_ptr,
         result.view(), std::nullopt, nullptr, options().exec, FoldFlags::consume_offsets);
    if (sent) sent->wait();
    return result;
  }

  std::shared_ptr<Communicator> cp_;
  std::shared_ptr<Communicator> intra_;
  std::size_t width_, block_, local_, blocks_, owner_;
};

CostTerms grouped_cost(const ProblemShape& s, const ProtocolConfig& config) {
  const std::size_t p = s.ranks, w = config.group_size, blocks = p / w;
  CostTerms t;
  add_group_all_gather(t, w, packed_bytes(s));
  // The owners' relay: one state per block boundary, each owner folding its
  // whole block before it sends.
  t.messages = dbl(blocks - 1);
  t.bytes = dbl(blocks - 1) * dbl(state_bytes(s));
  if (blocks > 1) add_group_broadcast(t, w, state_bytes(s));
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
    .memory = "w packed slots + 2 states",
    .use_when = "the exact choice at P ≈ 1000 (w ≈ 32)",
    .cost = grouped_cost,
    .build = build_grouped,
};

}  // namespace kdacp::detail
