// grouped_allgather_p2p (SPEC §6): blocks of w consecutive positions gather
// their [S|M] slots inside the block; the block owners (last position of each
// block) relay the block's incoming state along a chain; each rank then scans
// its block's slots from that state, or from the last cut before it (SPEC §10;
// an owner whose block has a cut sends without waiting for its incoming state). Per element the same operations in the
// same order as the chain, so bitwise identical to it. Memory: w slots plus
// at most two states.
#include "exchange/common.hpp"
#include "exchange/cost_terms.hpp"
#include "exchange/layouts.hpp"

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

  // The one run: one part per rank takes the chain-of-ranks algorithm
  // (run_one), several parts per rank or parts out of rank order the
  // layout's (run_layout); both give the chain-with-cuts bits.
  //
  // Still two algorithms (issue 19): with one part per rank the layout's
  // (run_layout_in_runs, one run per block) sends the same messages (one
  // gather, one relay state per block boundary, one broadcast) and does the
  // same operations in the same order, but it costs more: fold_slots folds
  // step by step through two temporaries without consuming the gathered
  // offsets, and the carrier folds its block twice (the state it sends, then
  // its own result), where run_one folds once in one fused scan that writes
  // the owner's result as its prefix and consumes the offsets in place
  // (w slots + 2 states, the bound test_exchange holds it to). run_one can go
  // once run_layout_in_runs fuses consecutive slots into one consuming scan
  // and lets the carrier's fold write its own parts' results as prefixes.
  std::vector<State> run(const Call& c) override {
    if (part_owners().is_one_per_rank()) return only(run_one(one_part(c)));
    return run_layout(c);
  }

  State run_one(const OnePart& c) {
    return c.direction == Direction::forward ? forward_step(c) : backward_step(c);
  }

  // A scan that starts at a cut's slot from no incoming state takes that
  // slot's offset itself as its first state, exactly (SPEC §10).
  State forward_step(const OnePart& c) {
    const bool is_owner = rank_ == owner_;
    const bool has_incoming = block_ > 0;
    const bool has_successor = block_ + 1 < blocks_;
    const ExecPolicy& exec = options().exec;
    constexpr auto kFwd = Direction::forward;
    constexpr auto kConsume = FoldFlags::consume_offsets;
    State incoming;
    if (has_incoming) incoming = make_state(c.shape, Buffer::Init::uninitialized);  // received whole
    // Post the owner's receive before the group gather (step 1).
    std::unique_ptr<Request> recv;
    if (is_owner && has_incoming) recv = cp_->irecv(bytes_of(incoming), owner_ - width_, c.tag);

    PackedSlots gathered(c.shape, width_);
    gathered.pack(local_, c.offset, c.transfer, c.cut);
    intra_->all_gather(gathered.bytes());
    const Slots slots = gathered.slots();

    State result = make_state(c.shape);
    const StateView in = incoming.view();
    const StateView* in_ptr = has_incoming ? &in : nullptr;
    bool have_result = false;
    State send;
    std::unique_ptr<Request> sent;
    if (is_owner && has_successor) {
      send = make_state(c.shape, Buffer::Init::uninitialized);  // the scan writes it all
      const StateView res = result.view();
      // After the block's last cut its outgoing state does not depend on the
      // incoming one: it is sent before that arrives.
      if (const auto cut = gathered.last_cut(0, width_)) {
        const bool prefix = *cut < width_ - 1;  // this rank's own state is on the way
        scan(slots, *cut, width_ - *cut, kFwd, nullptr, send.view(),
             prefix ? std::optional<std::size_t>(width_ - 1 - *cut) : std::nullopt,
             prefix ? &res : nullptr, exec, kConsume);
        have_result = prefix;
      } else {
        if (recv) recv->wait();
        scan(slots, 0, width_, kFwd, in_ptr, send.view(), local_, &res, exec, kConsume);
        have_result = true;
      }
      sent = cp_->isend(bytes_of(send), owner_ + width_, c.tag);
    }
    if (recv) recv->wait();
    if (has_incoming) intra_->broadcast(bytes_of(incoming), width_ - 1);
    if (!have_result) fold_in_block(gathered, local_, kFwd, in_ptr, result.view(), exec);
    if (sent) sent->wait();
    return result;
  }

  State backward_step(const OnePart& c) {
    const bool is_owner = rank_ == owner_;
    const bool has_incoming = block_ + 1 < blocks_;  // gradient arriving from the next block
    const bool has_predecessor = block_ > 0;
    const ExecPolicy& exec = options().exec;
    constexpr auto kBwd = Direction::backward;
    constexpr auto kConsume = FoldFlags::consume_offsets;
    State incoming;
    if (has_incoming) incoming = make_state(c.shape, Buffer::Init::uninitialized);  // received whole
    std::unique_ptr<Request> recv;
    if (is_owner && has_incoming) recv = cp_->irecv(bytes_of(incoming), owner_ + width_, c.tag);

    PackedSlots gathered(c.shape, width_);
    gathered.pack(local_, c.offset, c.transfer, c.cut);
    intra_->all_gather(gathered.bytes());
    const Slots slots = gathered.slots();

    const StateView in = incoming.view();
    const StateView* in_ptr = has_incoming ? &in : nullptr;
    State send;
    std::unique_ptr<Request> sent;
    if (is_owner && has_predecessor) {
      send = make_state(c.shape, Buffer::Init::uninitialized);  // the scan writes it all
      // Before the block's first cut the gradient to the previous block does
      // not depend on the one arriving: it is sent before that arrives.
      if (const auto cut = gathered.first_cut(0, width_)) {
        scan(slots, *cut, *cut + 1, kBwd, nullptr, send.view(), std::nullopt, nullptr, exec, kConsume);
      } else {
        if (recv) recv->wait();
        scan(slots, width_ - 1, width_, kBwd, in_ptr, send.view(), std::nullopt, nullptr, exec,
             kConsume);
      }
      sent = cp_->isend(bytes_of(send), owner_ - width_, c.tag);
    }
    if (recv) recv->wait();
    if (has_incoming) intra_->broadcast(bytes_of(incoming), width_ - 1);
    State result = make_state(c.shape);
    // The owner (local = w-1) scans nothing: its result is the block's incoming gradient.
    fold_in_block(gathered, local_, kBwd, in_ptr, result.view(), exec);
    if (sent) sent->wait();
    return result;
  }

  // A layout: the block gathers all its ranks' parts in one collective (k
  // slots per rank), the owners relay the state entering each of the block's
  // runs of consecutive parts, and every rank folds its parts inside their
  // run, all in the chain's order (layouts.hpp).
  std::vector<State> run_layout(const Call& c) {
    const LayoutIndex layout(part_owners().list(), size_);
    return run_layout_in_runs(RunsCall{&layout, width_, rank_, intra_.get(), cp_.get(), RunRelay::chain,
                                       c.parts, c.shape, c.direction, &options().exec});
  }

  std::shared_ptr<Communicator> cp_;
  std::shared_ptr<Communicator> intra_;
  std::size_t width_, block_, local_, blocks_, owner_;
};

CostTerms grouped_cost(const ProblemShape& s, const ProtocolConfig& config) {
  const std::size_t p = s.ranks, w = config.group_size, blocks = p / w;
  CostTerms t;
  if (has_layout(s) || !s.part_cuts.empty()) {
    // The runs of consecutive parts per block (layouts.hpp): one gather of k
    // slots per rank, a relay message per run boundary on the longest
    // stretch between cuts, each carrier folding its run, one broadcast of
    // the block's runs' incoming states.
    const ChainProfile chain = chain_profile(s, w);
    add_group_all_gather(t, w, chain.per_rank * packed_bytes(s));
    t.messages = dbl(chain.relays);
    t.bytes = dbl(chain.relays) * dbl(state_bytes(s));
    if (chain.runs > 1) add_group_broadcast(t, w, chain.runs_per_block * state_bytes(s));
    t.folds = dbl(chain.steps);
    t.work_folds = dbl(chain.parts) * dbl(w) / 2 + dbl(chain.parts);
    if (has_layout(s)) {
      // Slots, the runs' incoming states, the carrier's sent states and two
      // fold temporaries.
      t.peak_extra_bytes = w * chain.per_rank * packed_bytes(s) +
                           (2 * chain.runs_per_block + 3) * state_bytes(s);
    } else {
      t.peak_extra_bytes = w * packed_bytes(s) + 2 * state_bytes(s);
    }
    return t;
  }
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
    .takes_layouts = true,
    .memory = "w packed slots + 2 states",
    .use_when = "the exact choice at P ≈ 1000 (w ≈ 32)",
    .cost = grouped_cost,
    .build = build_grouped,
};

}  // namespace kdacp::detail
