// grouped_allgather_p2p (SPEC §6): blocks of w consecutive positions gather
// their [S|M] slots inside the block; the block owners (last position of each
// block) relay the block's incoming state along a chain; each rank then scans
// its block's slots from that state. Per element the same operations in the
// same order as the chain, so bitwise identical to it. Memory: w slots plus
// at most two states.
#include "exchange/common.hpp"
#include "kdacp/error.hpp"
#include "exchange/protocols.hpp"

namespace kdacp::detail {

namespace {

class GroupedExchange final : public StateExchange {
 public:
  GroupedExchange(std::shared_ptr<Communicator> cp, std::shared_ptr<Communicator> intra,
                  std::size_t rank, std::size_t size, std::size_t width, ExchangeOptions options)
      : StateExchange(rank, size),
        cp_(std::move(cp)),
        intra_(std::move(intra)),
        width_(width),
        block_(rank / width),
        local_(rank % width),
        blocks_(size / width),
        owner_(block_ * width + width - 1),
        options_(options) {}

  std::string method() const override { return "grouped_allgather_p2p"; }
  bool exact() const override { return true; }

  State forward(const StateView& s, const StateView& m) override {
    const SummaryShape shape = validate_summary(s, m, "S", rank_);
    CallMeter meter({cp_.get(), intra_.get()});
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
             options_.exec, FoldFlags::consume_offsets);
        have_result = true;
        sent = cp_->isend(bytes_of(send), owner_ + width_, kTagForward);
      }
    }
    if (has_incoming) intra_->broadcast(bytes_of(incoming), width_ - 1);
    if (!have_result)
      scan(gathered.slots(), 0, local_, Direction::forward, in_ptr, result.view(), std::nullopt,
           nullptr, options_.exec, FoldFlags::consume_offsets);
    if (sent) sent->wait();
    stats_ = meter.finish(result);
    return result;
  }

  State backward(const StateView& g, const StateView& m) override {
    const SummaryShape shape = validate_summary(g, m, "G", rank_);
    CallMeter meter({cp_.get(), intra_.get()});
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
             std::nullopt, nullptr, options_.exec, FoldFlags::consume_offsets);
        sent = cp_->isend(bytes_of(send), owner_ - width_, kTagBackward);
      }
    }
    if (has_incoming) intra_->broadcast(bytes_of(incoming), width_ - 1);
    State result = make_state(shape);
    // The owner (local = w-1) scans nothing: its result is the block's incoming gradient.
    scan(gathered.slots(), width_ - 1, width_ - 1 - local_, Direction::backward, in_ptr,
         result.view(), std::nullopt, nullptr, options_.exec, FoldFlags::consume_offsets);
    if (sent) sent->wait();
    stats_ = meter.finish(result);
    return result;
  }

 private:
  std::shared_ptr<Communicator> cp_;
  std::shared_ptr<Communicator> intra_;
  std::size_t width_, block_, local_, blocks_, owner_;
  ExchangeOptions options_;
};

}  // namespace

std::unique_ptr<StateExchange> make_grouped_allgather_p2p(const ProtocolContext& ctx) {
  const std::size_t w = ctx.group_size;
  check_group_width(ctx.rank, ctx.size, w);
  // The degenerate widths are the other two protocols, exactly.
  if (w == 1) return make_p2p(ctx);
  if (w == ctx.size) return make_allgather(ctx);
  const DeviceMesh split = split_mesh(*ctx.mesh, w, "kda_outer", "kda_group");
  return std::make_unique<GroupedExchange>(ctx.mesh->group(0), split.group(1), ctx.rank, ctx.size,
                                           w, ctx.options);
}

}  // namespace kdacp::detail
